"""Helpers of the (family, ratio, API) matrix tests: one offline job and one server run over the
same prompts, compared with colocated vLLM by greedy ids and sampled-token logprobs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serverlib import Server, http_request

PROMPTS = [
    "hello world",
    "The attention ranks keep the KV cache while the FFN ranks hold the experts",
    "def g(n):\n    return [i * i for i in range(n)]\n" * 6,  # longer than the 64-token chunk
]
MAX_TOKENS = 12
LOGPROB_ATOL = 1e-4


def job(model: str, afd: dict | None = None, **extra) -> dict:
    """The offline job over PROMPTS (the servers of serverlib run the same chunk size)."""
    return {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "max_num_batched_tokens": 64,
        "logprobs": True,
        "afd": afd,
        **extra,
    }


def assert_matches(token_ids, logprobs, reference: dict, atol: float = LOGPROB_ATOL) -> None:
    """Per prompt: the same greedy ids as ``reference`` and logprobs within ``atol``."""
    assert len(token_ids) == len(reference["token_ids"])
    for i, (ids, want) in enumerate(zip(token_ids, reference["token_ids"], strict=True)):
        assert ids == want, f"prompt {i}: AFD {ids} != colocated {want}"
    for i, (got, want) in enumerate(zip(logprobs, reference["logprobs"], strict=True)):
        worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
        assert got == pytest.approx(want, abs=atol), f"prompt {i}: logprobs differ by {worst:.2e}"


def complete_all(
    server: Server, concurrent: bool = True, timeout: float = 120.0
) -> tuple[list, list]:
    """PROMPTS through /v1/completions, all at once or one after the other; (token ids, sampled
    logprobs) per prompt."""

    def one(prompt: str):
        body = {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 0,
        }
        status, reply = http_request(server.url + "/v1/completions", body, timeout=timeout)
        assert status == 200, reply
        choice = reply["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    if not concurrent:
        replies = [one(prompt) for prompt in PROMPTS]
    else:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(one, PROMPTS))
    return [r[0] for r in replies], [r[1] for r in replies]


def serve(
    model: str, log, ratio: str, *flags: str, dtype: str = "float32", concurrent: bool = True
) -> tuple[list, list]:
    """Start ``vllm-afd serve --afd-ratio ratio``, answer PROMPTS (``complete_all``), stop it
    (nothing left)."""
    server = Server(model, log, extra=("--afd-ratio", ratio, *flags), dtype=dtype)
    try:
        server.wait_healthy()
        return complete_all(server, concurrent)
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
