"""Backend registry errors, what each backend declares, and the GPU-only backend's behaviour on
a CPU machine."""

from __future__ import annotations

import pytest
import torch
from transport_testlib import make_spec

from vllm_afd import transport
from vllm_afd.transport import (
    available_transports,
    backend,
    create_attention_transport,
    create_ffn_transport,
    register_transport,
)


def test_unknown_backend_names_allowed_values() -> None:
    spec = make_spec("nccl-magic", 1, 1)
    with pytest.raises(ValueError, match=r"'nccl-magic'.*allowed: deepep, shm, slots, tcp or a module"):
        create_attention_transport(spec, 0)
    with pytest.raises(ValueError, match=r"cannot load 'no_such_module:Backend'"):
        backend("no_such_module:Backend")


def test_builtin_backends_registered() -> None:
    assert {"shm", "tcp", "deepep"} <= set(available_transports())


def test_register_refuses_a_second_target_for_a_name(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_BACKENDS", dict(transport._BACKENDS))
    shm = "vllm_afd.transport.shm:ShmBackend"
    register_transport("shm", shm)  # the same target again: a no-op
    with pytest.raises(ValueError, match=r"'shm' is already registered.*ShmBackend"):
        register_transport("shm", "vllm_afd.transport.tcp:TcpBackend")
    with pytest.raises(ValueError, match="expected 'package.module:BackendClass'"):
        register_transport("mine", "my_module:Attention:FFN")
    assert transport._BACKENDS["shm"] == shm and "mine" not in available_transports()


def test_loaded_classes_must_be_backends_with_endpoints(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_BACKENDS", dict(transport._BACKENDS))
    register_transport("wrong", "vllm_afd.transport.base:TransportSpec")
    with pytest.raises(TypeError, match=r"base:TransportSpec is not a Backend subclass"):
        create_attention_transport(make_spec("wrong", 1, 1), 0)
    with pytest.raises(TypeError, match=r"base:Backend\.attention is not a subclass of Attention"):
        backend("vllm_afd.transport.base:Backend")


def test_a_backend_declares_what_it_can_do() -> None:
    """What config, deployment, placement and metrics ask instead of comparing names."""
    shm, tcp, deepep = (backend(name) for name in ("shm", "tcp", "deepep"))
    assert [b.name for b in (shm, tcp, deepep)] == ["shm", "tcp", "deepep"]
    assert (shm.needs_secret, tcp.needs_secret, deepep.needs_secret) == (False, True, True)
    assert (shm.supports_failover, deepep.supports_failover) == (True, False)
    assert (tcp.weights_applied_on, deepep.weights_applied_on) == ("ffn", "attention")
    assert tcp.plaintext_on_ffn_host and not shm.plaintext_on_ffn_host
    assert tcp.requested_addresses("10.0.0.2", 2) == ("10.0.0.2:0",) * 2
    assert shm.requested_addresses("10.0.0.2", 2) == ()
    assert shm.device_problem("cpu", "cuda") is None
    assert "cannot serve a CUDA model" in tcp.device_problem("cuda", "cuda")
    assert deepep.device_problem("cuda", "cuda") is None and deepep.device_problem("cpu", "cpu")
    assert shm.start_rendezvous(make_spec("shm", 1, 1), "127.0.0.1") is None
    assert tcp.reap_stale() == [] and isinstance(shm.reap_stale(), list)
    sizes = {"hidden_size": 7168, "max_tokens": 512, "microbatches": 2, "num_experts": 256}
    ranks = {"num_attention_ranks": 7, "num_ffn_ranks": 1}
    assert shm.limits_problem(dtype=torch.float32, **sizes, **ranks) is None
    assert "--max-num-batched-tokens 512" in deepep.limits_problem(
        dtype=torch.bfloat16, **sizes, **ranks
    )
    spec = make_spec("tcp", 1, 1, dtype=torch.bfloat16)  # point to point: ids and weights out
    hidden = spec.hidden_size * 2
    assert tcp.round_trip_bytes(spec, 3) == (3 * (hidden + spec.top_k * 8), 3 * hidden)
    assert deepep.round_trip_bytes(spec, 3) == (3 * spec.top_k * hidden,) * 2


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
