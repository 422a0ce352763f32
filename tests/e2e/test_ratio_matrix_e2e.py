"""Qwen3-MoE, Mixtral and Qwen2-MoE (gated shared expert) at AFD 1:1 and 1:2, offline and
through the OpenAI server: greedy token ids identical to colocated vLLM's and the sampled
tokens' logprobs within 1e-4 (float32).

This module fills the (family, ratio, API) cells the other e2e tests leave empty:
test_offline.py runs Qwen3-MoE 1:1, Mixtral 1:2 and Qwen2-MoE 1:2 offline, test_server.py
Qwen3-MoE 2:1 (two data-parallel attention ranks) and test_real_model_e2e.py the trained
Mixtral-layout model 1:2 through the server. Each family's colocated run happens once (offline,
module-scoped) and is the reference of both APIs; each server answers all prompts at once.
"""

from __future__ import annotations

import pytest
from matrixlib import assert_matches, job, serve

from vllm_afd.bench.offline_run import run_generation

pytestmark = pytest.mark.slow

#: Cells not run elsewhere (see the module docstring).
OFFLINE = [("qwen3_moe", "1:2"), ("mixtral", "1:1"), ("qwen2_moe", "1:1")]
SERVER = [
    (arch, ratio) for arch in ("qwen3_moe", "mixtral", "qwen2_moe") for ratio in ("1:1", "1:2")
]


@pytest.fixture(scope="module")
def tiny_model():
    """``tiny_model(arch)``: the default tiny checkpoint of ``arch`` (cached on disk)."""
    from vllm_afd.bench.tiny_models import default_tiny_model

    return lambda arch: str(default_tiny_model(arch=arch))


@pytest.fixture(scope="module")
def colocated(tiny_model):
    """``colocated(arch)``: the colocated offline run of ``arch``, once per module."""
    runs: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in runs:
            runs[arch] = run_generation(job(tiny_model(arch)))
        return runs[arch]

    return get


@pytest.mark.parametrize(("arch", "ratio"), OFFLINE)
def test_offline_matches_colocated(tiny_model, colocated, arch, ratio):
    result = run_generation(job(tiny_model(arch), {"ratio": ratio}))
    assert_matches(result["token_ids"], result["logprobs"], colocated(arch))
    ffn_ranks = int(ratio.split(":")[1])
    assert len(result["ffn"]) == ffn_ranks
    assert all(f["tokens"] > 0 for f in result["ffn"])


@pytest.mark.parametrize(("arch", "ratio"), SERVER)
def test_server_matches_colocated(tiny_model, colocated, tmp_path, arch, ratio):
    token_ids, logprobs = serve(tiny_model(arch), tmp_path / "server.log", ratio)
    assert_matches(token_ids, logprobs, colocated(arch))
