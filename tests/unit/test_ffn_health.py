"""``/health``'s view of the FFN ranks (``placement.ffn_group_problems``): from the pid, the
heartbeat, the busy-since word and the failure count in each rank's stats block."""

from __future__ import annotations

import os
import socket
import time

import pytest

from vllm_afd.metrics.blocks import F_BUSY_SINCE, F_FAILURES, F_HEARTBEAT, FFNStatsBlock
from vllm_afd.placement import HEARTBEAT_TIMEOUT_S, ffn_group_problems
from vllm_afd.transport import TransportSpec


@pytest.fixture
def rank_block(monkeypatch):
    """This process posing as FFN rank 0 of a deployment: its pid and its stats block."""
    address = f"afdhealthtest{os.getpid()}"
    spec = TransportSpec("shm", 1, 1, 8, 16, 2, 4, timeout_s=5.0, addresses=(address,))
    monkeypatch.setenv("VLLM_AFD_RUNTIME", spec.to_json())
    monkeypatch.setenv("VLLM_AFD_FFN_PIDS", f"{socket.gethostname()}:{os.getpid()}")
    block = FFNStatsBlock(address, 0, [0, 1])
    yield block
    block.close()


def _set(block: FFNStatsBlock, word: int, value: float) -> None:
    block.d[block._o_scalars + word] = value


def test_a_beating_idle_rank_is_healthy(rank_block):
    rank_block.beat()
    assert ffn_group_problems() == []


def test_a_rank_without_heartbeat_is_stopped(rank_block):
    _set(rank_block, F_HEARTBEAT, time.monotonic() - HEARTBEAT_TIMEOUT_S - 0.5)
    (problem,) = ffn_group_problems()
    assert problem.startswith(f"FFN rank 0 (pid {os.getpid()}) stopped: no heartbeat for")


def test_a_rank_busy_past_the_timeout_is_wedged(rank_block):
    rank_block.beat()
    rank_block.set_busy(time.monotonic() - 6.0)
    (problem,) = ffn_group_problems()
    assert "wedged: one layer batch running for 6." in problem and "timeout_s=5" in problem
    rank_block.set_busy(time.monotonic())
    assert ffn_group_problems() == []


def test_a_rank_that_failed_a_request_stays_unhealthy(rank_block):
    rank_block.beat()
    rank_block.record_failure(3)
    assert ffn_group_problems() == [f"FFN rank 0 (pid {os.getpid()}) failed 3 request(s)"]
    assert rank_block.d[rank_block._o_scalars + F_FAILURES] == 3
    assert rank_block.d[rank_block._o_scalars + F_BUSY_SINCE] == 0


def test_a_dead_rank_is_dead(monkeypatch):
    monkeypatch.setenv("VLLM_AFD_FFN_PIDS", f"{socket.gethostname()}:999999999")
    monkeypatch.delenv("VLLM_AFD_RUNTIME", raising=False)
    assert ffn_group_problems() == ["FFN rank 0 (pid 999999999) died"]
