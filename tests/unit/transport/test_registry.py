"""Backend registry errors and the GPU-only backend's behaviour on a CPU machine."""

from __future__ import annotations

import pytest
import torch
from transport_testlib import make_spec

from vllm_afd import transport
from vllm_afd.transport import (
    available_transports,
    create_attention_transport,
    create_ffn_transport,
    register_transport,
)


def test_unknown_backend_names_allowed_values() -> None:
    spec = make_spec("nccl-magic", 1, 1)
    with pytest.raises(ValueError, match=r"'nccl-magic'.*allowed: deepep, shm, tcp"):
        create_attention_transport(spec, 0)


def test_builtin_backends_registered() -> None:
    assert {"shm", "tcp", "deepep"} <= set(available_transports())


def test_register_refuses_a_second_target_for_a_name(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_BACKENDS", dict(transport._BACKENDS))
    shm = "vllm_afd.transport.shm:ShmAttentionTransport:ShmFFNTransport"
    register_transport("shm", shm)  # the same target again: a no-op
    with pytest.raises(ValueError, match=r"'shm' is already registered.*ShmFFNTransport"):
        register_transport("shm", "vllm_afd.transport.tcp:TcpAttentionTransport:TcpFFNTransport")
    with pytest.raises(ValueError, match="expected 'package.module:AttentionClass:FFNClass'"):
        register_transport("mine", "my_module:OnlyOneClass")
    assert transport._BACKENDS["shm"] == shm and "mine" not in available_transports()


def test_loaded_classes_must_be_transports(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_BACKENDS", dict(transport._BACKENDS))
    register_transport("wrong", "vllm_afd.transport.base:TransportSpec:FFNTransport")
    with pytest.raises(TypeError, match=r"base\.TransportSpec is not a subclass of Attention"):
        create_attention_transport(make_spec("wrong", 1, 1), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_deepep_without_gpu_raises_clear_error() -> None:
    spec = make_spec("deepep", 1, 1, dtype=torch.bfloat16, moe_layers=(0, 1))
    with pytest.raises(RuntimeError, match="deep_ep"):
        create_attention_transport(spec, 0)


def test_deepep_ffn_side_needs_the_moe_layers() -> None:
    spec = make_spec("deepep", 1, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="moe_layers"):
        create_ffn_transport(spec, 0)


def test_deepep_virtual_experts_land_on_ffn_group_ranks() -> None:
    from vllm_afd.transport.deepep import VirtualExperts

    spec = make_spec("deepep", 3, 2)  # 8 experts, 4 per FFN rank; group = 3 + 2 ranks
    experts = VirtualExperts.of(spec)
    assert (experts.num_ranks, experts.num_experts) == (5, 20)
    global_ids = torch.arange(spec.num_experts)[:, None]
    group_rank = experts.to_virtual(global_ids) // experts.experts_per_rank
    ffn_rank = spec.ffn_rank_of(global_ids)
    assert torch.equal(group_rank, ffn_rank + spec.num_attention_ranks)
    assert experts.group_rank_of_ffn(1) == 4
    assert experts.to_virtual(torch.tensor([[-1, 0]])).tolist() == [[-1, 12]]  # -1: no expert
