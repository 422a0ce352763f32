"""``--afd-ratio auto``: the planner's choice of FFN ranks for the attention ranks given."""

import pytest

from vllm_afd.config import AFDConfigError, MoEModelInfo
from vllm_afd.planner.auto_ratio import candidate_ffn_ranks, recommend_for_deployment

INFO = MoEModelInfo("Qwen3MoeForCausalLM", 2, 8, 2, 128, 64, (0, 1))


def test_candidates_divide_ranks_and_experts():
    assert candidate_ffn_ranks(INFO, 4) == [1, 2, 4]
    assert candidate_ffn_ranks(INFO, 6) == [1, 2]
    assert candidate_ffn_ranks(INFO, 1) == [1]


def test_auto_picks_a_feasible_split_and_says_why(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    attn, ffn, line = recommend_for_deployment(
        INFO, 4, tiny_qwen3, context=512, max_batch=16, platform_is_cpu=True
    )
    assert attn == 4 and ffn in (1, 2, 4)
    assert "planner on h200" in line and "tok/s per device" in line


def test_auto_on_cpu_without_hardware_is_a_clear_error(tiny_qwen3, monkeypatch):
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    with pytest.raises(AFDConfigError, match="VLLM_AFD_PLAN_HARDWARE"):
        recommend_for_deployment(
            INFO, 2, tiny_qwen3, context=512, max_batch=16, platform_is_cpu=True
        )


def test_auto_counts_the_speculative_draft(qwen3_30b_dir, monkeypatch):
    """With a draft of d tokens every request sends 1 + d tokens per step through the FFN:
    on a Qwen3-30B-A3B-sized model the predicted step is longer than without speculation, and
    the line says d."""
    import re

    info = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    steps = {}
    for d in (0, 3):
        _, _, line = recommend_for_deployment(
            info, 4, qwen3_30b_dir, 4096, max_batch=64, platform_is_cpu=True, draft_length=d
        )
        assert f"d={d}," in line
        steps[d] = float(re.search(r"step ([0-9.]+) ms", line).group(1))
    assert steps[3] > steps[0]
