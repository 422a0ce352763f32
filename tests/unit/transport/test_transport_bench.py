"""The transport micro-benchmark: both copy floors, NIXL's own round trip, echo on the peer, one
small end-to-end run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vllm_afd.bench import transport_bench as tb

pytestmark = pytest.mark.timeout(120)


def _shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("vllm_afd_")}


def _leaked(before: set[str]) -> list[str]:
    """New ``vllm_afd_[floor_]<pid>_...`` files whose creator is gone (or is this process)."""
    leaked = []
    for name in _shm_files() - before:
        pid = name.removeprefix("vllm_afd_").removeprefix("floor_").split("_", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not os.path.exists(f"/proc/{pid}")):
            leaked.append(name)
    return leaked


def test_hot_copy_floor_times_positive() -> None:
    times = tb.hot_copy_floor(4096, 2048, seconds=0.01)
    assert len(times) >= 20 and all(t > 0 for t in times)


def test_cross_core_peer_copies_and_times(mp_ctx) -> None:
    before = _shm_files()
    cpus = sorted(os.sched_getaffinity(0))
    peer = tb.FFNCpuPeer(mp_ctx, 8192, 4096, cpus[-1])
    try:
        assert _leaked(before) == []  # unlinked once both sides mapped it
        for request, response in ((8192, 4096), (100, 60)):
            times = peer.cross_core_floor(request, response, seconds=0.01)
            assert len(times) >= 20 and all(t > 0 for t in times)
            # the peer wrote its answer (ones) into the zero-filled response buffer
            assert bool((peer.shared.response[:response] == 1).all())
        echo = peer.echo(4, 64, torch.bfloat16, 2, seconds=0.01)
        assert len(echo) >= 20 and all(t > 0 for t in echo)
    finally:
        peer.close()
    assert not peer.proc.is_alive()


def test_main_reports_both_floors(tmp_path, capsys) -> None:
    before = _shm_files()
    out = tmp_path / "transport.json"
    argv = ["--backends", "shm", "nixl", "--tokens", "1", "2", "--hidden", "64"]
    assert tb.main([*argv, "--seconds", "0.02", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["backend"], r["tokens"]) for r in data["results"]] == [
        ("shm", 1),
        ("shm", 2),
        ("nixl", 1),
        ("nixl", 2),
    ]
    for row in data["results"]:
        for key in ("rt_median_us", "echo_median_us", "floor_hot_median_us"):
            assert row[key] > 0, key
        assert row["floor_xcore_median_us"] > 0
        transport = row["rt_median_us"] - row["echo_median_us"]
        assert row["transport_us"] == pytest.approx(transport)
        assert row["ratio_hot"] == pytest.approx(transport / row["floor_hot_median_us"])
        assert row["ratio_xcore"] == pytest.approx(transport / row["floor_xcore_median_us"])
        if row["backend"] == "nixl":  # NIXL's own round trip of the same bytes, beside it
            assert row["ratio_nixl"] == pytest.approx(transport / row["floor_nixl_median_us"])
        else:
            assert "floor_nixl_median_us" not in row
    for backend in ("shm", "nixl"):
        ratios = [r["ratio_xcore"] for r in data["results"] if r["backend"] == backend]
        summary = data["summary"][backend]
        assert summary["decode_max_ratio_xcore"] == max(ratios)
        nixl = {"decode_median_ratio_nixl", "decode_max_ratio_nixl"} if backend == "nixl" else set()
        assert set(summary) == {
            "decode_median_ratio_hot",
            "decode_max_ratio_hot",
            "decode_median_ratio_xcore",
            "decode_max_ratio_xcore",
            *nixl,
        }
    printed = capsys.readouterr().out
    assert "x_xcore" in printed and printed.count("cross-core median") == 2
    assert "x_nixl" in printed and printed.count("NIXL's own median") == 1
    assert _leaked(before) == []
