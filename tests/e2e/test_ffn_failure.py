"""An FFN rank that stops, fails or dies with failover off, seen through the server: `/health`
and the in-flight request (failover itself: test_server.py).

One server at 1:1 with ``--afd-failover-timeout 0`` and the fault-injection file configured
(``VLLM_AFD_FAULT_FILE``, absent at first), under ``--fail-on-environ-validation``. A
SIGSTOPped FFN rank turns `/health` to 503 within 2 s through its heartbeat (its pid is alive,
so a pid check alone would not see it) and back to 200 on SIGCONT. Then the fault file makes
the FFN rank's serve loop raise: the in-flight request fails within 2 s, the FFN's error text
reaches the attention rank (server log), and `/health` turns 503 (the engine stops: an
exception in a forward is fatal to vLLM's engine), and stopping the server leaves no process
behind. Without failover a lost FFN rank fails the combine at once (``FFNRankLost``:
tests/unit/transport/test_failover.py, test_processes.py).

A second server, with failover on (the default), shows that an error in the serve loop is a
failover: the fault file reading ``once`` makes the FFN rank raise on one layer batch while six
streams are in flight; the supervisor replaces the rank, the attention rank sends the batch once
more, to the replacement, and every stream ends with colocated's text and tokens.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from failoverlib import colocated_job, fail_once, lose_the_ffn_rank_under_streams
from serverlib import Server, http_request, session_processes

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ffn_failure")
    srv = Server(
        tiny_qwen3,
        tmp / "server.log",
        # vLLM refuses to start on a VLLM_* variable it does not know (patch E1 declares ours)
        extra=("--afd-ratio", "1:1", "--afd-failover-timeout", "0", "--fail-on-environ-validation"),
        env={"VLLM_AFD_FAULT_FILE": str(tmp / "fault")},
    )
    srv.fault = tmp / "fault"
    try:
        srv.wait_healthy()
        yield srv
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill_leftovers()


def _health(server: Server) -> int | str:
    try:
        return http_request(server.url + "/health", timeout=5)[0]
    except OSError:
        return "down"


def _seconds_until(server: Server, want, limit_s: float) -> float:
    """Seconds until `/health` satisfies ``want`` (polled every 0.1 s), or ``inf``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if want(_health(server)):
            return time.monotonic() - start
        time.sleep(0.1)
    return float("inf")


def test_a_stopped_ffn_rank_shows_in_health_within_2s(server):
    assert server.complete("hello world", 4)[0] == 200
    pid = server.ffn_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        took = _seconds_until(server, lambda h: h == 503, 10.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 2.0, f"/health saw the stopped FFN rank after {took:.1f}s"
    assert _seconds_until(server, lambda h: h == 200, 10.0) < 10.0
    assert server.complete("hello world", 4)[0] == 200


def test_an_ffn_serve_error_fails_the_request_at_once_and_health(server):
    server.fault.touch()
    start = time.monotonic()
    status, body = server.complete("hello world", 8, timeout=60.0)
    took = time.monotonic() - start
    assert status >= 500, body
    assert took < 2.0, f"the failing request took {took:.1f}s"
    log = server.log.read_text()
    assert "FFNServeError: FFN rank 0: layer 0: RuntimeError: injected fault" in log
    assert _seconds_until(server, lambda h: h != 200, 10.0) < 10.0
    server.terminate()
    deadline = time.monotonic() + 30
    while (left := session_processes(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]


@pytest.fixture(scope="module")
def failover_server(tiny_qwen3, run_once, tmp_path_factory):
    """A 1:1 server with failover on and the fault file configured (absent at first), and as
    ``colocated`` the colocated runs of failoverlib's prompts."""
    tmp = tmp_path_factory.mktemp("ffn_error_failover")
    srv = Server(
        tiny_qwen3,
        tmp / "server.log",
        extra=("--afd-ratio", "1:1", "--fail-on-environ-validation"),
        env={"VLLM_AFD_FAULT_FILE": str(tmp / "fault"), "VLLM_PLUGINS": "afd"},
    )
    srv.fault = tmp / "fault"
    try:
        srv.colocated = run_once(colocated_job(tiny_qwen3))
        srv.wait_healthy()
        yield srv
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill_leftovers()


def test_an_ffn_serve_error_under_streams_is_a_failover_that_loses_nothing(failover_server):
    server = failover_server
    lose_the_ffn_rank_under_streams(server, server.colocated, fail_once(server.fault))
    assert not server.fault.exists(), "the fault did not fire"
    log = server.log.read_text()
    assert "failed serving a request" in log, log[-3000:]
    assert "FFN rank 0 replaced in" in log
    assert server.complete("hello world", 4)[0] == 200
