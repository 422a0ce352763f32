"""The FFN expert kernel (each layer's own quant method) against the PyTorch reference over the
checkpoint's experts: one rank's share, and the sum of the shares."""

from __future__ import annotations

import pytest
import torch

from tests.unit.ffn.conftest import FAMILIES, GPT_OSS, model_info, reference_experts
from vllm_afd.ffn.executor import ExpertKernel
from vllm_afd.ffn.weights import expert_bytes, load_routed_experts
from vllm_afd.testing.reference import reference_moe_combine


def _routing(tokens: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return ids.to(torch.int32), weights


@pytest.mark.parametrize("arch", FAMILIES)
def test_rank_outputs_sum_to_the_reference(family_model, arch):
    """Tokens routed across both ranks' experts: each rank answers its share, the shares sum to
    the checkpoint's experts (PyTorch reference) and to the single-rank layer."""
    model_dir = family_model(arch)
    info = model_info(model_dir)
    layer = info.moe_layers[-1]
    x = torch.randn(9, info.hidden_size, generator=torch.Generator().manual_seed(3))
    ids, w = _routing(9, info.num_experts, info.top_k, seed=4)
    experts = reference_experts(model_dir, arch, layer)
    want = reference_moe_combine(x, ids, w, experts, info.num_experts)
    whole = ExpertKernel(load_routed_experts(model_dir, 0, 1, torch.float32))(layer, x, ids, w)
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-4)
    total = torch.zeros_like(x)
    for rank in range(2):
        kernel = ExpertKernel(load_routed_experts(model_dir, rank, 2, torch.float32))
        part = kernel(layer, x, ids, w)
        share = range(rank * info.num_experts // 2, (rank + 1) * info.num_experts // 2)
        only = reference_moe_combine(
            x, ids, w * torch.isin(ids, torch.tensor(list(share))), experts, info.num_experts
        )
        torch.testing.assert_close(part, only, rtol=1e-4, atol=1e-4)
        total += part
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_gpt_oss_fused_experts_split_over_ranks(family_model):
    """gpt-oss: fused ``gate_up_proj`` tensors with biases, sliced by its own loader."""
    model_dir = family_model(GPT_OSS)
    whole = load_routed_experts(model_dir, 0, 1, torch.float32)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    ids, w = _routing(9, 8, 2, seed=6)
    want = ExpertKernel(whole)(1, x, ids, w)
    total = torch.zeros_like(x)
    for rank in range(2):
        part = load_routed_experts(model_dir, rank, 2, torch.float32)
        assert expert_bytes(part) * 2 == expert_bytes(whole)
        total += ExpertKernel(part)(1, x, ids, w)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


def test_tokens_routed_only_elsewhere_get_exact_zeros(tiny_qwen3):
    kernel = ExpertKernel(load_routed_experts(tiny_qwen3, 1, 2, torch.float32))
    x = torch.randn(3, 128)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0]], dtype=torch.int32)  # rank 0's experts only
    out = kernel(0, x, ids, torch.full((3, 2), 0.5))
    assert out.shape == x.shape and out.dtype == x.dtype and not out.any()
