"""A quantized checkpoint under AFD: routed experts in DeepSeek-V3's 128x128 block FP8, every
other layer bfloat16 (``ignored_layers``), served in bfloat16 at 1:1.

Where the platform has no FP8 expert kernel (a CPU without AMX), the FFN rank dequantizes the
experts at load (``ffn/weights.py``): AFD then gives exactly the greedy tokens stock colocated
vLLM gives on the dequantized twin (the same model, experts dequantized exactly to bfloat16),
and stock vLLM cannot serve the FP8 checkpoint there at all. Where it has one (AMX CPUs, GPUs),
the FFN rank runs vLLM's FP8 kernel, whose rounding differs from the bfloat16 GEMM's by an ulp
(a long prompt's greedy tokens part from the twin's after a few steps, colocated too): AFD then
gives exactly stock colocated vLLM's tokens on the FP8 checkpoint. Either way the attention
rank holds none of the experts' bytes, scales included.
"""

from __future__ import annotations

import pytest
from test_offline import PROMPTS

from vllm_afd.bench.tiny_models import default_fp8_experts_model

pytestmark = [pytest.mark.slow, pytest.mark.full]


def _job(model: str, afd: dict | None) -> dict:
    return {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": 12,
        "dtype": "bfloat16",
        "afd": afd,
        "max_num_batched_tokens": 64,
    }


def _has_fp8_expert_kernel() -> bool:
    """vLLM's CPU FP8 expert kernel (``CPUExpertsFp8``) needs AMX tiles: read from the CPU's
    flags, not from the product."""
    with open("/proc/cpuinfo") as cpuinfo:
        return any(line.startswith("flags") and "amx_tile" in line.split() for line in cpuinfo)


def test_fp8_experts_at_1_1_match_stock_vllm(run_pair):
    fp8, twin = (str(p) for p in default_fp8_experts_model(arch="qwen2_moe"))
    kernel = _has_fp8_expert_kernel()
    # stock vLLM on what it can serve here: the FP8 checkpoint with a kernel, else the twin
    afd, reference = run_pair(_job(fp8, {"ratio": "1:1"}), _job(fp8 if kernel else twin, None))
    (ffn,) = afd["ffn"]
    assert ffn["experts"] == [0, 8] and ffn["tokens"] > 0
    twin_expert_bytes = 2 * 8 * 3 * 128 * 128 * 2  # layers * experts * (gate, up, down) * bf16
    fp8_expert_bytes = twin_expert_bytes // 2 + 2 * 8 * (2 + 1) * 4  # + w13, w2 block scales
    # The path the FFN rank took, seen in the tensors it holds.
    if kernel:
        assert "float8_e4m3fn" in ffn["weight_dtypes"], ffn
        assert ffn["quant_methods"] == ["Fp8MoEMethod"], ffn
        assert ffn["param_bytes"] == fp8_expert_bytes
    else:
        assert ffn["weight_dtypes"] == ["bfloat16"], ffn
        assert ffn["quant_methods"] == ["UnquantizedFusedMoEMethod"], ffn
        assert ffn["param_bytes"] == twin_expert_bytes
    for i, (a, c) in enumerate(zip(afd["token_ids"], reference["token_ids"], strict=True)):
        assert a == c, f"prompt {i}: AFD {a} != colocated {c} (FP8 kernel: {kernel})"
    reference_expert_bytes = fp8_expert_bytes if kernel else twin_expert_bytes
    assert afd["attention_param_bytes"] == (
        reference["attention_param_bytes"] - reference_expert_bytes
    )
