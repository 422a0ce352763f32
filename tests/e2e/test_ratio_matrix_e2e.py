"""Qwen3-MoE, Mixtral and Qwen2-MoE (gated shared expert) at AFD 1:1 and 1:2 through the
OpenAI server: greedy token ids identical to colocated vLLM's and the sampled tokens' logprobs
within 1e-4 (float32).

Offline, test_offline.py runs Qwen3-MoE 1:1 and 2:1, Mixtral 1:2 and Qwen2-MoE 1:2; the other
offline (family, ratio) cells were dropped to keep the full tier short: the servers here run
every family at both ratios through the same model code. test_server.py runs Qwen3-MoE 2:1
(two data-parallel attention ranks) and test_real_model_e2e.py the trained Mixtral-layout
model through the server. Each family's colocated run happens once a session (offline,
``run_once``); each server answers all prompts at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from matrixlib import assert_matches, job, serve

pytestmark = [pytest.mark.slow, pytest.mark.full]

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
RATIOS = ("1:1", "1:2")  # the server cells: every family at both


@pytest.fixture(scope="module")
def tiny_model():
    """``tiny_model(arch)``: the default tiny checkpoint of ``arch`` (cached on disk)."""
    from vllm_afd.bench.tiny_models import default_tiny_model

    return lambda arch: str(default_tiny_model(arch=arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_servers_at_1_1_and_1_2_match_colocated(tiny_model, run_once, tmp_path, arch):
    """Both servers of ``arch`` side by side (two servers at once about halve the wall time of
    their start-up on two cores); each answers the prompts all at once."""
    with ThreadPoolExecutor(len(RATIOS)) as pool:
        served = [
            pool.submit(serve, tiny_model(arch), tmp_path / f"server_{i}.log", ratio)
            for i, ratio in enumerate(RATIOS)
        ]
        colocated = run_once(job(tiny_model(arch)))
        served = [s.result() for s in served]
    for ratio, (token_ids, logprobs) in zip(RATIOS, served, strict=True):
        try:
            assert_matches(token_ids, logprobs, colocated)
        except AssertionError as exc:
            raise AssertionError(f"{arch} {ratio}: {exc}") from exc
