"""A trained model under AFD: SmolLM2-135M-Instruct upcycled to an 8-expert MoE, at 1:2.

Every token of this model visits every expert, so all of its text depends on the two FFN ranks.
Greedy float32 tokens must equal colocated serving's, offline and through the OpenAI server,
and the model must still know that the capital of France is Paris (the server: ``make
test-all``).
"""

from __future__ import annotations

import pytest
from serverlib import Server

from vllm_afd.bench.real_model import EXPECTED, PROMPT

pytestmark = pytest.mark.slow

PROMPTS = [PROMPT, "def fibonacci(n):"]
MAX_TOKENS = 12


def _job(model: str, afd: dict | None = None) -> dict:
    return {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "afd": afd}


@pytest.fixture(scope="module")
def runs(smollm2_moe, run_pair) -> tuple[dict, dict]:
    """Colocated and AFD 1:2 offline."""
    return run_pair(_job(smollm2_moe), _job(smollm2_moe, {"ratio": "1:2"}))


@pytest.fixture(scope="module")
def colocated(runs) -> dict:
    return runs[0]


def test_colocated_knows_paris(colocated):
    assert colocated["texts"][0].startswith(EXPECTED), colocated["texts"]


def test_afd_1to2_offline_gives_colocated_tokens(runs):
    colocated, afd = runs
    assert afd["token_ids"] == colocated["token_ids"]
    assert len(afd["ffn"]) == 2
    assert afd["attention_param_bytes"] < colocated["attention_param_bytes"]


@pytest.mark.full
def test_afd_1to2_server_gives_colocated_tokens(smollm2_moe, colocated, tmp_path):
    server = Server(smollm2_moe, tmp_path / "server.log", extra=("--afd-ratio", "1:2"))
    try:
        server.wait_healthy()
        for prompt, expected in zip(PROMPTS, colocated["token_ids"], strict=True):
            status, body = server.complete(prompt, MAX_TOKENS)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == expected, body
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
