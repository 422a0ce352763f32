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
    register_transport,
)


def test_unknown_backend_names_allowed_values() -> None:
    spec = make_spec("nccl-magic", 1, 1)
    with pytest.raises(ValueError, match=r"'nccl-magic'.*allowed: shm, slots, tcp or a module"):
        create_attention_transport(spec, 0)
    with pytest.raises(ValueError, match=r"cannot load 'no_such_module:Backend'"):
        backend("no_such_module:Backend")


def test_builtin_backends_registered() -> None:
    assert {"shm", "tcp", "slots"} <= set(available_transports())


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
    shm, tcp, slots = (backend(name) for name in ("shm", "tcp", "slots"))
    assert [b.name for b in (shm, tcp, slots)] == ["shm", "tcp", "slots"]
    assert (shm.needs_secret, tcp.needs_secret, slots.needs_secret) == (False, True, False)
    assert (shm.supports_failover, slots.supports_failover) == (True, False)
    assert (tcp.shares_group, slots.shares_group) == (True, False)
    assert tcp.plaintext_on_ffn_host and not shm.plaintext_on_ffn_host
    assert tcp.requested_addresses("10.0.0.2", 2) == ("10.0.0.2:0",) * 2
    assert shm.requested_addresses("10.0.0.2", 2) == ()
    assert shm.device_problem("cpu", "cuda") is None
    assert "cannot serve a CUDA model" in tcp.device_problem("cuda", "cuda")
    assert slots.device_problem("cuda", "cuda") is None and slots.device_problem("cpu", "cuda")
    assert tcp.reap_stale() == [] and isinstance(shm.reap_stale(), list)
    spec = make_spec("tcp", 1, 1, dtype=torch.bfloat16)  # ids and weights out, sums back
    hidden = spec.hidden_size * 2
    assert tcp.round_trip_bytes(spec, 3) == (3 * (hidden + spec.top_k * 8), 3 * hidden)
    assert slots.round_trip_bytes(spec, 3) == tcp.round_trip_bytes(spec, 3)
