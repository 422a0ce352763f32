"""The DeepSeek-V2/V3 layout under AFD: MLA attention, a shared expert, and a dense first layer
(first_k_dense_replace=1), so the only MoE layer is layer 1 (the checkpoint's layout:
tests/unit/bench/test_tiny_models.py). At 1:1 and 1:2, offline, greedy token ids must equal
colocated vLLM's, and the FFN ranks must serve layer 1 only, under the model's own layer number.
Through the OpenAI server the model runs the same code (the server path is family-blind: the
other e2e modules serve qwen3_moe, qwen2_moe and the trained Mixtral-layout model); its server
pair was dropped to keep the full tier short.

Compared in bfloat16, both sides: on a CPU with AMX tiles vLLM picks the AMX_MLA backend,
whose weight packing takes bfloat16 only (in float32 the model fails to load, colocated too);
elsewhere it picks CPU_MLA, which takes bfloat16 as well. AFD and colocated run the same
kernels, so greedy ids match exactly. Logprobs: equal within 1e-4 at 1:1 (one FFN rank runs the
colocated layer's kernel on all experts); at 1:2 each FFN rank rounds its partial sum to
bfloat16 before the attention rank adds the two, where colocated rounds the sum once, so they
agree only to bfloat16 precision.

vLLM's CPU MLA path gives tokens that depend on which other sequences share the step (the
first token of a prompt already changes when it is prefilled beside others; float32 CPU_MLA
too, colocated alone), so AFD is compared with colocated on the same schedule: the prompts
batched, both sides.

Default settings: for an MLA model the CPU runner falls back from the default two microbatches
to one, with a warning (patches/cpu_runner.py, tests/unit/patches/test_cpu_runner.py): with
two, the decode tokens of the first microbatch differ from colocated for this model (float32
and bfloat16, both MLA backends; the cause is not found yet).
"""

from __future__ import annotations

import pytest
from matrixlib import assert_matches, job

pytestmark = [pytest.mark.slow, pytest.mark.full]

DTYPE = "bfloat16"
#: Logprob tolerance per ratio (see the module docstring).
ATOL = {"1:1": 1e-4, "1:2": 0.1}


@pytest.fixture(scope="module")
def deepseek() -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="deepseek_v2"))


@pytest.fixture(scope="module")
def colocated(deepseek, run_once) -> dict:
    return run_once(job(deepseek, dtype=DTYPE))


RATIOS = ("1:1", "1:2")


@pytest.fixture(scope="module")
def offline(deepseek, run_pair) -> dict[str, dict]:
    """The AFD runs at both ratios, side by side (default microbatches)."""
    runs = run_pair(*(job(deepseek, {"ratio": ratio}, dtype=DTYPE) for ratio in RATIOS))
    return dict(zip(RATIOS, runs, strict=True))


@pytest.mark.parametrize("ratio", RATIOS)
def test_offline_matches_colocated_and_serves_layer_1_only(offline, colocated, ratio):
    result = offline[ratio]
    assert_matches(result["token_ids"], result["logprobs"], colocated, atol=ATOL[ratio])
    ffn_ranks = int(ratio.split(":")[1])
    assert len(result["ffn"]) == ffn_ranks
    for ffn in result["ffn"]:
        assert ffn["layers"] == [1]  # the FFN rank's layer dict, checked against the spec
        assert set(ffn["per_layer_calls"]) == {"1"}  # every request it served was layer 1's
        assert ffn["param_bytes"] == 8 // ffn_ranks * 3 * 128 * 64 * 2  # its experts, bf16
