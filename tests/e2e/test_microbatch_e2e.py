"""Ping-pong microbatching end to end (slow): the tiny Qwen3-MoE through the offline ``LLM``
API with ``microbatches=2``, greedy tokens compared with colocated serving."""

from __future__ import annotations

import pytest
from test_offline import PROMPTS

MAX_TOKENS = 24


def _job(model: str, afd: dict | None) -> dict:
    return {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "afd": afd,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_microbatches_match_colocated(tiny_qwen3) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from vllm_afd.bench.offline_run import run_generation

    with ThreadPoolExecutor(2) as workers:  # two engines side by side halve the wall time
        colocated = workers.submit(run_generation, _job(tiny_qwen3, None))
        afd = workers.submit(run_generation, _job(tiny_qwen3, {"ratio": "1:1", "microbatches": 2}))
        colocated, afd = colocated.result(), afd.result()
    for i, (a, c) in enumerate(zip(afd["token_ids"], colocated["token_ids"], strict=True)):
        assert a == c, f"prompt {i}: microbatched AFD {a} != colocated {c}"
    # Decode steps were split: each of the MAX_TOKENS - 1 decode steps of the five sequences
    # sent two requests per MoE layer (k=1 sends one, plus a handful of prefill chunks).
    (ffn,) = afd["ffn"]
    num_layers = len(ffn["per_layer_calls"])
    assert ffn["requests"] >= num_layers * 2 * (MAX_TOKENS - 1)
