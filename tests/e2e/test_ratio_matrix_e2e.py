"""Qwen2-MoE (gated shared expert) at AFD 1:2 through the OpenAI server, the prompts all at
once: greedy token ids identical to colocated vLLM's and the sampled tokens' logprobs within
1e-4 (float32).

The rest of the (family, ratio, API) matrix is covered elsewhere, each cell once: offline,
test_offline.py runs Qwen3-MoE 1:1 and 2:1, Mixtral 1:2 and Qwen2-MoE 1:2, and
test_families_e2e.py the other families at 1:1; through the server, test_server.py runs
Qwen3-MoE 2:1 (two data-parallel attention ranks), test_ffn_failure.py Qwen3-MoE 1:1 and
test_real_model_e2e.py the trained Mixtral-layout model at 1:1 and 1:2 (the live scale). The
server path is family-blind (the same model code as offline), so the other family-by-ratio
server cells were dropped to keep the full tier short; this one keeps the family with the
most parts on the attention side (a gated shared expert) through it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from matrixlib import assert_matches, job, serve

pytestmark = [pytest.mark.slow, pytest.mark.full]


def test_qwen2_moe_server_at_1_2_matches_colocated(tiny_qwen2_moe, run_once, tmp_path):
    """The server and colocated's offline run side by side."""
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(serve, tiny_qwen2_moe, tmp_path / "server.log", "1:2")
        colocated = run_once(job(tiny_qwen2_moe))
        token_ids, logprobs = served.result()
    assert_matches(token_ids, logprobs, colocated)
