"""Speculative decoding with draft models of their own kinds under AFD at the default settings
(ratio 1:2, two ping-pong microbatches), each against the same speculative config colocated:
same greedy tokens, same acceptance counts, and verify steps really split (FFN requests of
microbatch 1). The drafts are built offline by vllm_afd/bench/draft_models.py.

* EAGLE-1, a dense head (vLLM's ``EagleLlamaForCausalLM``) derived from the target so that it
  is accepted often but not always: acceptance counts strictly between 0 and the draft
  tokens, so partial acceptance (the draft's KV and hidden-state bookkeeping) is exercised.
* EAGLE-3 (``LlamaForCausalLMEagle3``, random): the target returns its auxiliary hidden
  states beside the last one, through the microbatched forward.
* MTP, an MoE draft: a tiny DeepSeek-V3 with one multi-token-prediction layer, whose block
  (MLA attention, routed and shared experts) is layer 2, beside the target's MoE layer 1. Its
  experts stay on the attention ranks (patch P8): the FFN ranks serve layer 1 only. Run with
  one microbatch: with two, a DeepSeek target's decode tokens differ from colocated with or
  without speculation (the known issue of tests/e2e/test_deepseek_mla_e2e.py; also with
  VLLM_MLA_DISABLE=1).
"""

from __future__ import annotations

import pytest
from test_spec_decode_e2e import MAX_TOKENS, _assert_same

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(900)]
DEFAULT_AFD = {"ratio": "1:2"}  # microbatches: the default (2)
#: Enough requests that every verify step can be split in two.
PROMPTS = ["hello world", "1 2 3", "the router", "Once upon a time"]


def _pair(run_pair, model: str, spec: dict, afd: dict, **job) -> tuple[dict, dict]:
    """(colocated, AFD) runs of the same speculative config, side by side."""
    base = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **job}
    base["engine_args"] = {"speculative_config": spec}
    return run_pair({**base, "afd": None}, {**base, "afd": afd})


@pytest.fixture(scope="module")
def predictable_qwen3() -> str:
    from vllm_afd.bench.draft_models import default_predictable_target

    return str(default_predictable_target(arch="qwen3_moe"))


def test_eagle_head_matches_colocated(predictable_qwen3, run_pair):
    from vllm_afd.bench.draft_models import default_eagle_head

    head = str(default_eagle_head(predictable_qwen3))
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2}
    colocated, afd = _pair(run_pair, predictable_qwen3, spec, DEFAULT_AFD)
    _assert_same(colocated, afd)
    counts = colocated["spec_decode"]
    assert 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts  # a real draft


def test_eagle3_head_matches_colocated(predictable_qwen3, run_pair):
    from vllm_afd.bench.draft_models import default_eagle3_head

    head = str(default_eagle3_head(predictable_qwen3))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    colocated, afd = _pair(run_pair, predictable_qwen3, spec, DEFAULT_AFD)
    _assert_same(colocated, afd)


def test_mtp_moe_draft_keeps_its_experts_on_the_attention_ranks(run_pair):
    from vllm_afd.bench.draft_models import default_mtp_model

    model = str(default_mtp_model())
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    afd_config = {"ratio": "1:2", "microbatches": 1}
    colocated, afd = _pair(run_pair, model, spec, afd_config, dtype="bfloat16")
    assert afd["token_ids"] == colocated["token_ids"]
    assert afd["spec_decode"] == colocated["spec_decode"]
    assert afd["spec_decode"]["drafts"] > 0
    for ffn in afd["ffn"]:
        assert ffn["layers"] == [1]  # the target's MoE layer; MTP layer 2 stays local
        assert set(ffn["per_layer_calls"]) == {"1"}
