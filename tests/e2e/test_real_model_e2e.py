"""A trained model under AFD: SmolLM2-135M-Instruct upcycled to an 8-expert MoE.

Every token of this model visits every expert, so all of its text depends on the FFN ranks.
Greedy float32 tokens must equal colocated serving's, offline at 1:2 on the slot plane (the
``slots`` transport with the device's wait semantics on host memory: the GPU data plane's
protocol and its host-side logic) and through the OpenAI server at 1:1 and while its FFN pool
(shm) is scaled live to two ranks and back (``make test-all``), and the model must still know
that the capital of France is Paris.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from failoverlib import colocated_job, streams_around
from serverlib import Server, http_request

from vllm_afd.bench.real_model import EXPECTED, PROMPT
from vllm_afd.host import SHM_DIR

pytestmark = pytest.mark.slow

PROMPTS = [PROMPT, "def fibonacci(n):"]
MAX_TOKENS = 12
#: Tokens of each stream around the two scales: both end while this model's six streams are
#: about half through (each scale is mostly a new FFN rank's start, which they share the
#: cores with).
SCALE_STREAM_TOKENS = 200


def _job(model: str, afd: dict | None = None) -> dict:
    return {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "afd": afd}


#: The slot plane, its waits as a device's: recorded where they fail, raised at the next step.
SLOTS = {"transport": "slots", "transport_config": {"waits": "device"}}


@pytest.fixture(scope="module")
def runs(smollm2_moe, run_pair) -> tuple[dict, dict]:
    """Colocated and AFD 1:2 offline, on the slot plane."""
    return run_pair(_job(smollm2_moe), _job(smollm2_moe, {"ratio": "1:2", **SLOTS}))


@pytest.fixture(scope="module")
def colocated(runs) -> dict:
    return runs[0]


def test_colocated_knows_paris(colocated):
    assert colocated["texts"][0].startswith(EXPECTED), colocated["texts"]


def test_afd_1to2_offline_on_the_slot_plane_gives_colocated_tokens(runs):
    colocated, afd = runs
    assert afd["token_ids"] == colocated["token_ids"]
    assert len(afd["ffn"]) == 2
    # fixed shapes: every token to both FFN ranks, each serving its half of the experts
    assert all(f["address"].startswith("vllm_afd_plane_") for f in afd["ffn"])
    assert afd["ffn"][0]["tokens"] == afd["ffn"][1]["tokens"] > 0
    assert afd["attention_param_bytes"] < colocated["attention_param_bytes"]


@pytest.mark.full
def test_the_pool_scaled_live_1_2_1_under_streams_gives_colocated_text(
    smollm2_moe, colocated, run_once, tmp_path
):
    """A 1:1 server (``VLLM_PLUGINS=afd``: the AFD routes) serves colocated's tokens; then,
    under six streams of 200 tokens, ``POST /afd/scale`` takes the FFN pool to two
    ranks and back to one: each scale answers 200 while the streams are in flight, and every
    stream ends with colocated's exact text and tokens. ``/afd/status`` and ``/metrics`` show
    the live pool and both scales; a count the experts cannot split into is refused (400)."""
    shm_before = set(os.listdir(SHM_DIR))
    server = Server(
        smollm2_moe,
        tmp_path / "server.log",
        extra=("--afd-ratio", "1:1"),
        env={"VLLM_PLUGINS": "afd"},
    )
    try:
        with ThreadPoolExecutor(1) as pool:  # the streams' reference while the server starts
            reference = colocated_job(smollm2_moe) | {"max_tokens": SCALE_STREAM_TOKENS}
            streamed = pool.submit(run_once, reference)
            server.wait_healthy()
            streamed = streamed.result()
        for prompt, expected in zip(PROMPTS, colocated["token_ids"], strict=True):
            status, body = server.complete(prompt, MAX_TOKENS)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == expected, body
        admin = server.admin_headers()
        status, body = http_request(server.url + "/afd/scale", {"num_ffn_ranks": 3}, headers=admin)
        assert status == 400 and "num_ffn_ranks 3" in body and "[1, 2, 4, 8]" in body, body

        def scale_up_and_down() -> list[tuple[int, dict | str, float, float]]:
            answers = []
            for count in (2, 1):
                began = time.monotonic()
                status, body = http_request(
                    server.url + "/afd/scale", {"num_ffn_ranks": count}, 300, admin
                )
                answers.append((status, body, began, time.monotonic()))
            return answers

        answers, results, _ = streams_around(
            server, scale_up_and_down, max_tokens=SCALE_STREAM_TOKENS
        )
        for count, (status, body, began, ended) in zip((2, 1), answers, strict=True):
            assert status == 200, body
            assert body["num_ffn_ranks"] == count and body["scale"]["to_ranks"] == count, body
            spanning = [r for r in results if r.times[0] < began and r.times[-1] > ended]
            assert spanning, (count, "no stream spanned the scale", began, ended)
        for i, result in enumerate(results):
            assert result.status == 200, (i, result.text[-300:])
            assert result.token_ids == streamed["token_ids"][i], i
            assert result.text == streamed["texts"][i], i
        status, body = http_request(server.url + "/afd/status", headers=admin)
        assert status == 200 and body["num_ffn_ranks"] == 1 and body["pool"] == 3, body
        assert [(e["from_ranks"], e["to_ranks"]) for e in body["scale_events"]] == [(1, 2), (2, 1)]
        metrics = http_request(server.url + "/metrics")[1]
        assert re.search(r"^vllm_afd_ffn_ranks\{[^}]*\} 1\.0$", metrics, re.M), metrics[-2000:]
        assert re.search(r"^vllm_afd_ffn_pool_scale_seconds_count\{[^}]*\} 2\.0$", metrics, re.M)
        assert server.log.read_text().count("AFD: FFN pool scaled from") == 2
        server.terminate()
        server.assert_nothing_left(30)
        left = set(os.listdir(SHM_DIR)) - shm_before  # the first pool's stats blocks too
        assert not left, sorted(left)
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
