"""FFN executor: expert loading from safetensors, routing localisation, kernels vs reference."""

from __future__ import annotations

import pytest
import torch

from vllm_afd.ffn.executor import (
    TorchExperts,
    VllmCpuExperts,
    expert_range,
    load_routed_experts,
    localize_routing,
)


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("sharded"), shards=4))


def test_expert_range_is_contiguous():
    assert [expert_range(r, 4, 8) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]


def test_loads_only_its_experts_from_a_sharded_checkpoint(sharded_model):
    full = load_routed_experts(sharded_model, range(0, 8), torch.float32)
    part = load_routed_experts(sharded_model, range(4, 8), torch.float32)
    assert sorted(part) == [0, 1]
    assert part[0].w13.shape == (4, 2 * 64, 128) and part[0].w2.shape == (4, 128, 64)
    for layer in (0, 1):
        assert torch.equal(part[layer].w13, full[layer].w13[4:])
        assert torch.equal(part[layer].w2, full[layer].w2[4:])


def test_mixtral_names_load(tiny_mixtral):
    layers = load_routed_experts(tiny_mixtral, range(0, 2), torch.float32)
    assert layers[1].w13.shape[0] == 2


def test_no_expert_tensors_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="no routed-expert tensors"):
        load_routed_experts(tmp_path, range(0, 1), torch.float32)


def test_localize_routing_masks_foreign_experts():
    ids = torch.tensor([[0, 5], [6, 7]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    local, weights = localize_routing(ids, w, range(4, 8))
    assert local.dtype == torch.int32 and local.tolist() == [[0, 1], [2, 3]]
    assert weights.tolist() == [[0.0, 0.75], [0.5, 0.5]]


def test_cpu_kernel_matches_reference_and_partials_sum(tiny_qwen3):
    torch.manual_seed(0)
    x = torch.randn(7, 128)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)])
    w = torch.softmax(torch.randn(7, 2), dim=-1)
    full = load_routed_experts(tiny_qwen3, range(0, 8), torch.float32)
    reference = TorchExperts(full)(1, x, *localize_routing(ids, w, range(0, 8)))
    fast = VllmCpuExperts(full, torch.float32)(1, x, *localize_routing(ids, w, range(0, 8)))
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
    partial = torch.zeros_like(x)
    for rank in range(2):
        experts = expert_range(rank, 2, 8)
        kernel = VllmCpuExperts(
            load_routed_experts(tiny_qwen3, experts, torch.float32), torch.float32
        )
        partial += kernel(1, x, *localize_routing(ids, w, experts))
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
    routing = localize_routing(ids, w, range(0, 8))
    out = torch.full_like(x, float("nan"))
    assert kernel(0, x, *routing, out) is out
    torch.testing.assert_close(out, kernel(0, x, *routing), rtol=0, atol=0)
