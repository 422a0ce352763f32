"""FFN kernels: routing localisation, vLLM's CPU kernel against the reference, partial sums."""

from __future__ import annotations

import pytest
import torch

from vllm_afd.ffn.kernels import TorchExperts, VllmCpuExperts, expert_map, localize_routing
from vllm_afd.ffn.weights import load_routed_experts
from vllm_afd.transport import TransportSpec


def test_expert_map_is_vllms_convention():
    assert expert_map(range(4, 8), 8).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert expert_map(range(0, 2), 4).dtype == torch.int32


def test_localize_routing_masks_foreign_experts():
    ids = torch.tensor([[0, 5], [6, 7]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    local, weights = localize_routing(ids, w, expert_map(range(4, 8), 8))
    assert local.dtype == torch.int32 and local.tolist() == [[0, 1], [2, 3]]
    assert weights.tolist() == [[0.0, 0.75], [0.5, 0.5]]


def test_localize_routing_takes_any_expert_map():
    """vLLM's own ``expert_map`` (int64 here) and the wire's int32 ids: the kernel's dtypes."""
    vllm_map = torch.tensor([-1, -1, 0, 1])  # this rank holds global experts 2 and 3
    ids = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
    w = torch.tensor([[0.4, 0.6], [0.7, 0.3]])
    local, weights = localize_routing(ids, w, vllm_map)
    assert local.tolist() == [[0, 0], [1, 0]] and local.dtype == torch.int32
    assert weights.dtype == torch.float32
    assert torch.allclose(weights, torch.tensor([[0.0, 0.6], [0.7, 0.0]]))


def test_cpu_kernel_matches_reference_and_partials_sum(tiny_qwen3):
    torch.manual_seed(0)
    x = torch.randn(7, 128)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)])
    w = torch.softmax(torch.randn(7, 2), dim=-1)
    full = load_routed_experts(tiny_qwen3, range(0, 8), torch.float32)
    everything = expert_map(range(0, 8), 8)
    reference = TorchExperts(full)(1, x, *localize_routing(ids, w, everything))
    fast = VllmCpuExperts(full, torch.float32)(1, x, *localize_routing(ids, w, everything))
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
    partial = torch.zeros_like(x)
    spec = TransportSpec(
        "shm", 1, num_ffn_ranks=2, num_experts=8, hidden_size=128, top_k=2, max_tokens=7
    )
    for rank in range(2):
        experts = spec.expert_range(rank)
        kernel = VllmCpuExperts(
            load_routed_experts(tiny_qwen3, experts, torch.float32), torch.float32
        )
        partial += kernel(1, x, *localize_routing(ids, w, expert_map(experts, 8)))
    torch.testing.assert_close(partial, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_cls", [TorchExperts, VllmCpuExperts])
def test_kernel_writes_into_out_when_given(tiny_qwen3, kernel_cls):
    torch.manual_seed(1)
    x = torch.randn(3, 128)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(3)])
    w = torch.softmax(torch.randn(3, 2), dim=-1)
    layers = load_routed_experts(tiny_qwen3, range(0, 8), torch.float32)
    kernel = (
        TorchExperts(layers) if kernel_cls is TorchExperts else kernel_cls(layers, torch.float32)
    )
    routing = localize_routing(ids, w, expert_map(range(0, 8), 8))
    out = torch.full_like(x, float("nan"))
    assert kernel(0, x, *routing, out) is out
    torch.testing.assert_close(out, kernel(0, x, *routing), rtol=0, atol=0)
