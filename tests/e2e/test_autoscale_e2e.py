"""``--afd-autoscale`` on a live server: the planner in the loop scales the FFN pool itself.

The tiny model served at 1:1 with ``--data-parallel-size 2`` (two attention ranks, two FFN
ranks; the explicit size makes vLLM start two API server processes, its multi-server shape,
where the group and its advisor live in the parent and each API server reads the live pool
from ``pool.json``), planned on
an H200 (``VLLM_AFD_PLAN_HARDWARE=h200``), where the planner prefers 2:1 at any batch and
context (+33% tokens/s per device: its two layers never keep a second FFN rank busy). Under
streams, the advisor measures the decode steps the attention workers record (patch W1),
plans, holds for the window that first sees the gain, then scales the pool to one FFN rank;
every stream, those in flight at the scale included, ends with colocated's text; the log says
why, and ``/afd/status`` and ``/metrics`` have the prediction next to the measured step. Last,
SIGTERM stops everything (in this shape Ray's own SIGTERM handler once took shutdown away from
vLLM): the server exits 0 within 60 s and leaves no process behind.

Why the switch is not driven by the context here: see tests/unit/test_autoscale.py, which
runs the loop from short to long contexts on a Qwen3-30B-A3B-sized model.
"""

from __future__ import annotations

import re
import time

import pytest
from failoverlib import PROMPTS, colocated_job, streams_around
from serverlib import Server, http_request, session_processes

pytestmark = [pytest.mark.slow, pytest.mark.full]


def _scaled(server: Server) -> dict | None:
    status, body = http_request(server.url + "/afd/status")
    assert status == 200, body
    return body if body["scale_events"] else None


def test_autoscale_takes_the_live_server_to_the_planners_ratio_under_streams(
    tiny_qwen3, run_once, tmp_path
):
    colocated = run_once(colocated_job(tiny_qwen3))
    server = Server(
        tiny_qwen3,
        tmp_path / "server.log",
        extra=(
            "--afd-ratio",
            "1:1",
            "--data-parallel-size",
            "2",
            "--afd-autoscale",
            "--afd-autoscale-interval",
            "6",
        ),
        env={"VLLM_PLUGINS": "afd", "VLLM_AFD_PLAN_HARDWARE": "h200"},
    )
    try:
        server.wait_healthy()
        rounds = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the load goes on until the advisor has scaled

            def wait_for_the_scale():
                until = time.monotonic() + 120
                while time.monotonic() < until and _scaled(server) is None:
                    time.sleep(0.2)

            _, results, _ = streams_around(server, wait_for_the_scale)
            rounds.append(results)
            if _scaled(server) is not None:
                break
        body = _scaled(server)
        assert body is not None, server.log.read_text()[-3000:]
        results = [r for round_ in rounds for r in round_]
        for i, result in enumerate(results):
            n = i % len(colocated["texts"])
            assert result.status == 200, (i, result.text[-300:])
            assert result.token_ids == colocated["token_ids"][n], i
            assert result.text == colocated["texts"][n], i
        # after the scale: one FFN rank, 2:1, the advisor's decision and why
        assert (body["num_ffn_ranks"], body["ratio"]) == (1, "2:1"), body
        assert [(e["from_ranks"], e["to_ranks"]) for e in body["scale_events"]] == [(2, 1)]
        log = server.log.read_text()
        said = re.findall(r"AFD autoscale: scale: (.*)", log)
        assert said and "the planner prefers 2:1 (1 FFN rank(s)" in said[0], log[-3000:]
        assert "measured: batch" in said[0] and ">= the margin +10%" in said[0]
        assert "AFD autoscale: now 1 FFN rank(s) (was 2)" in log
        # each API server reads the live pool: ready, no stopped rank of the old one a problem
        for _ in range(6):
            status, ready = http_request(server.url + "/afd/ready")
            assert status == 200, ready
        # the new pool serves colocated's tokens
        status, reply = server.complete(PROMPTS[0], 12)
        assert status == 200, reply
        assert reply["choices"][0]["token_ids"] == colocated["token_ids"][0][:12], reply
        # /metrics: the measured step next to the prediction per FFN rank count
        metrics = http_request(server.url + "/metrics")[1]
        for name in (
            "vllm_afd_window_step_seconds",
            'vllm_afd_planner_predicted_step_seconds{[^}]*num_ffn_ranks="1"',
            'vllm_afd_planner_predicted_step_seconds{[^}]*num_ffn_ranks="2"',
        ):
            assert re.search(rf"^{name}[^\n]* [0-9.e-]+$", metrics, re.M), name
        assert re.search(r"^vllm_afd_planner_recommended_ffn_ranks\{[^}]*\} 1\.0$", metrics, re.M)
        assert re.search(r"^vllm_afd_decode_step_seconds_count\{[^}]*\} [1-9]", metrics, re.M)
        started = time.monotonic()
        server.terminate()
        assert server.proc.returncode == 0, server.log.read_text()[-3000:]
        assert time.monotonic() - started < 60
        deadline = time.monotonic() + 20
        while (left := session_processes(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
