"""FFN weights: an FFN rank holds the model's own vLLM MoE layers with exactly its experts,
for every family (no per-family code), and a missing expert tensor is a loud error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.ffn.conftest import FAMILIES, model_info
from vllm_afd.ffn.weights import expert_bytes, load_routed_experts
from vllm_afd.transport import TransportSpec


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("sharded"), shards=4))


def _spec(info, num_ffn_ranks: int) -> TransportSpec:
    return TransportSpec(
        "shm",
        1,
        num_ffn_ranks=num_ffn_ranks,
        num_experts=info.num_experts,
        hidden_size=info.hidden_size,
        top_k=info.top_k,
        max_tokens=1,
    )


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_rank_holds_exactly_its_experts(family_model, arch):
    model_dir = family_model(arch)
    info = model_info(model_dir)
    full = load_routed_experts(model_dir, 0, 1, torch.float32)
    assert sorted(full) == list(info.moe_layers)  # the model's own layer numbers
    for layer in full.values():
        assert layer.expert_map is None  # one rank: the colocated layer, no placement
    one_layer = expert_bytes({0: next(iter(full.values()))})
    hidden, inter = info.hidden_size, info.moe_intermediate_size
    assert one_layer == info.num_experts * 3 * hidden * inter * 4  # float32 gate, up, down
    for rank in range(2):
        part = load_routed_experts(model_dir, rank, 2, torch.float32)
        assert sorted(part) == sorted(full)
        assert expert_bytes(part) * 2 == expert_bytes(full)
        want = list(_spec(info, 2).expert_range(rank))
        for layer in part.values():
            assert layer.expert_map_manager.get_local_expert_ids() == want
            assert layer.local_num_experts == len(want)


def test_a_sharded_checkpoint_loads(sharded_model):
    assert len(list(Path(sharded_model).glob("*.safetensors"))) == 4
    layers = load_routed_experts(sharded_model, 1, 2, torch.float32)
    assert sorted(layers) == [0, 1]
    assert layers[1].expert_map_manager.get_local_expert_ids() == [4, 5, 6, 7]


def test_missing_expert_tensor_is_a_loud_error(sharded_model, tmp_path):
    """Experts of rank 1 lack one tensor: rank 1 fails naming layer and expert, rank 0 loads."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(sharded_model, model_dir)
    missing = "model.layers.1.mlp.experts.6.up_proj.weight"
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        if missing in tensors:
            del tensors[missing]
            save_file(tensors, str(path), metadata={"format": "pt"})
    load_routed_experts(model_dir, 0, 2, torch.float32)
    with pytest.raises(ValueError, match=r"layers\.1\..*w13_weight.*\[6\]"):
        load_routed_experts(model_dir, 1, 2, torch.float32)
