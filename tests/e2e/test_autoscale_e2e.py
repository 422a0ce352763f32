"""``--afd-autoscale`` on a live server: the planner in the loop follows the load from short to
long contexts and scales the FFN pool itself.

The tiny model served at 1:1 with ``--data-parallel-size 2`` (two attention ranks, two FFN
ranks; the explicit size makes vLLM start two API server processes, its multi-server shape,
where the group and its advisor live in the parent and each API server reads the live pool
from ``pool.json``), planned on ``SLOW_DEVICE``: there the planner's best A:F moves with the
context as it does for a real model on a real GPU (tests/unit/test_autoscale.py: Qwen3-30B-A3B
on an H200). At three requests per attention rank (six streams) it prefers 1:1 by +35% at a
100-token context and 2:1 by +33% at 1,500 tokens.

1. Short contexts (the six prompts, ``SHORT_TOKENS`` each): the advisor measures the decode
   steps the attention workers record (patch W1), the planner prefers the live 1:1, the
   advisor holds and says why.
2. Long contexts (six prompts of about 1,400 tokens, ``LONG_TOKENS`` each), in rounds until
   the advisor has scaled: it holds for the window that first sees the gain, then scales the
   pool to one FFN rank (2:1). Every stream, those in flight at the scale included, ends with
   colocated's text; the log says why with the measured context, and ``/afd/status`` and
   ``/metrics`` have the prediction next to the measured step.
3. SIGTERM stops everything (in this shape Ray's own SIGTERM handler once took shutdown away
   from vLLM): the server exits 0 within 60 s and leaves no process behind.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from failoverlib import PROMPTS, colocated_job, streams_around
from serverlib import Server, http_request

pytestmark = [pytest.mark.slow, pytest.mark.full]

#: An H200 at 1/480 of its memory bandwidth with no fixed per-layer term: a device on which
#: the tiny model's expert weights (its FFN time) cost what its KV cache reads (its attention
#: time) cost at a few hundred tokens of context, as a real model's do on a real GPU.
SLOW_DEVICE = {
    "base": "h200",
    "name": "slow-h200",
    "hbm_bandwidth": 1e10,
    "sm_bandwidth": 1e10,
    "dispatch_intercept": 1e-6,
}
SHORT_TOKENS = 100  # contexts of 4-256 tokens
#: About 1,400 tokens each (the code prompt is 156), distinct from the first token on.
LONG_PROMPTS = [f"{i}: " + PROMPTS[3] * 9 for i in range(len(PROMPTS))]
LONG_TOKENS = 150


def _status(server: Server) -> dict:
    status, body = http_request(server.url + "/afd/status", headers=server.admin_headers())
    assert status == 200, body
    return body


def _context(said: str) -> int:
    return int(re.search(r"context (\d+),", said).group(1))


def test_autoscale_follows_the_load_from_short_to_long_contexts(tiny_qwen3, run_once, tmp_path):
    device = tmp_path / "slow-h200.json"
    device.write_text(json.dumps(SLOW_DEVICE))
    long_job = {
        "model": tiny_qwen3,
        "prompts": LONG_PROMPTS,
        "max_tokens": LONG_TOKENS,
        "max_model_len": 2048,
        "max_num_batched_tokens": 64,  # the server's chunk
    }
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
        env={"VLLM_PLUGINS": "afd", "VLLM_AFD_PLAN_HARDWARE": str(device)},
        max_model_len=2048,
    )
    try:
        with ThreadPoolExecutor(1) as pool:  # the long reference while the server starts
            long_colocated = pool.submit(run_once, long_job)
            colocated = run_once(colocated_job(tiny_qwen3))
            server.wait_healthy()
            long_colocated = long_colocated.result()

        # 1. short contexts: the planner prefers the live 1:1, the advisor holds
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, results, _ = streams_around(server, lambda: None, max_tokens=SHORT_TOKENS)
            for i, result in enumerate(results):
                assert result.status == 200, (i, result.text[-300:])
                assert result.token_ids == colocated["token_ids"][i][:SHORT_TOKENS], i
            if _status(server)["live"] is not None:
                break
        body = _status(server)
        live = body["live"]
        assert live is not None, server.log.read_text()[-3000:]
        assert (live["rule"], live["recommended"]) == (
            "best",
            {"num_ffn_ranks": 2, "ratio": "1:1"},
        ), live
        assert live["window"]["context"] < 300 and not body["scale_events"], body
        log = server.log.read_text()
        held = re.findall(r"AFD autoscale: hold: (.*)", log)
        assert held and "the live 1:1 (2 FFN rank(s)" in held[0], log[-3000:]
        assert _context(held[0]) < 300, held[0]

        # 2. long contexts: the planner prefers 2:1, the advisor scales under the streams
        rounds = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the load goes on until the advisor has scaled

            def wait_for_the_scale():
                until = time.monotonic() + 120
                while time.monotonic() < until and not _status(server)["scale_events"]:
                    time.sleep(0.2)

            _, results, _ = streams_around(
                server, wait_for_the_scale, prompts=LONG_PROMPTS, max_tokens=LONG_TOKENS
            )
            rounds.append(results)
            if _status(server)["scale_events"]:
                break
        body = _status(server)
        assert body["scale_events"], server.log.read_text()[-3000:]
        for round_ in rounds:
            for i, result in enumerate(round_):
                assert result.status == 200, (i, result.text[-300:])
                assert result.token_ids == long_colocated["token_ids"][i], i
                assert result.text == long_colocated["texts"][i], i
        # after the scale: one FFN rank, 2:1, the advisor's decision and why
        assert (body["num_ffn_ranks"], body["ratio"]) == (1, "2:1"), body
        assert [(e["from_ranks"], e["to_ranks"]) for e in body["scale_events"]] == [(2, 1)]
        log = server.log.read_text()
        said = re.findall(r"AFD autoscale: scale: (.*)", log)
        assert said and "the planner prefers 2:1 (1 FFN rank(s)" in said[0], log[-3000:]
        assert "to 1:1 (2 FFN rank(s)" in said[0] and ">= the margin +10%" in said[0]
        assert _context(said[0]) > 1000, said[0]
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
        server.assert_nothing_left(20)
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
