"""FFN weights: only this rank's routed experts, from sharded and Mixtral-named checkpoints."""

from __future__ import annotations

import pytest
import torch

from vllm_afd.ffn.weights import load_routed_experts


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("sharded"), shards=4))


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
