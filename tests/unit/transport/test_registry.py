"""Backend registry errors, what each backend declares, and the GPU-only backend's behaviour on
a CPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transport_testlib import make_spec

from vllm_afd import transport
from vllm_afd.transport import (
    AttentionTransport,
    Backend,
    Feature,
    available_transports,
    backend,
    create_attention_transport,
    register_transport,
)
from vllm_afd.transport.base import ServesRequests
from vllm_afd.transport.slots import PlaneFFN, SteppedPlaneFFN


def test_unknown_backend_names_allowed_values() -> None:
    spec = make_spec("nccl-magic", 1, 1)
    with pytest.raises(ValueError, match=r"'nccl-magic'.*allowed: nixl, shm, slots or a module"):
        create_attention_transport(spec, 0)
    with pytest.raises(ValueError, match=r"cannot load 'no_such_module:Backend'"):
        backend("no_such_module:Backend")


def test_builtin_backends_registered() -> None:
    assert {"shm", "slots", "nixl"} <= set(available_transports())
    with pytest.raises(ValueError, match="'tcp' is retired; across hosts use nixl"):
        backend("tcp")


def test_register_refuses_a_second_target_for_a_name(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_BACKENDS", dict(transport._BACKENDS))
    shm = "vllm_afd.transport.slots:ShmBackend"
    register_transport("shm", shm)  # the same target again: a no-op
    with pytest.raises(ValueError, match=r"'shm' is already registered.*ShmBackend"):
        register_transport("shm", "vllm_afd.transport.nixl:NixlBackend")
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
    shm, nixl, slots = (backend(name) for name in ("shm", "nixl", "slots"))
    assert [b.name for b in (shm, nixl, slots)] == ["shm", "nixl", "slots"]
    every = frozenset(Feature)
    assert shm.features() == nixl.features() == slots.features() == every  # host waits
    assert slots.features({"waits": "device"}) == {Feature.FAILOVER}  # whole steps
    assert slots.endpoints({"waits": "device"})[1] is SteppedPlaneFFN
    assert shm.endpoints({})[1] is slots.endpoints({"waits": "host"})[1] is PlaneFFN
    assert shm.device_problem("cpu", "cuda") is None  # FFN ranks may compute on a GPU
    assert "cannot serve a CUDA model" in shm.device_problem("cuda", "cuda")
    assert slots.resolve_settings({}, "cuda") == {"waits": "device"}
    assert slots.resolve_settings({}, "cpu") == {} == shm.resolve_settings({}, "cuda")
    assert "not built yet" in nixl.device_problem("cuda", "cuda")
    assert slots.device_problem("cuda", "cuda") is None and slots.device_problem("cpu", "cuda")
    assert isinstance(shm.reap_stale(), list)
    spec = make_spec("nixl", 1, 1, dtype=torch.bfloat16)  # ids and weights out, sums back
    hidden = spec.hidden_size * 2
    assert nixl.round_trip_bytes(spec, 3) == (3 * (hidden + spec.top_k * 8), 3 * hidden)
    assert slots.round_trip_bytes(spec, 3) == nixl.round_trip_bytes(spec, 3)


class _Attention(AttentionTransport):
    def dispatch(self, layer, x, topk_ids, topk_weights, microbatch=0):
        raise NotImplementedError

    def combine(self, handle):
        raise NotImplementedError


class _FFN(ServesRequests):
    address = "nowhere"

    def recv(self, timeout_s):
        return []

    def reply(self, request, out) -> None:
        pass

    def reply_error(self, request, message) -> None:
        pass


class _Bare(Backend):
    name = "bare"
    attention = _Attention
    ffn = _FFN


def test_a_backend_claims_only_what_its_endpoints_implement() -> None:
    """Nothing is claimed by default: an FFN side serving requests gives scaling, isolation and
    shared groups; failover needs an attention endpoint that ``Reconnects``."""
    assert Feature.FAILOVER not in _Bare.features()
    assert _Bare.features() == {Feature.LIVE_SCALING, Feature.ISOLATION, Feature.SHARED_GROUP}

    class Stepped(_Bare):
        ffn = SteppedPlaneFFN

    assert Stepped.features() == frozenset()  # failover needs ``Reconnects``


#: docs/architecture.md's backend x feature table: its columns, as (backend, settings).
_COLUMNS = {
    "shm": ("shm", {}),
    "slots, host waits": ("slots", {"waits": "host"}),
    "slots, device waits (every GPU)": ("slots", {"waits": "device"}),
    "nixl": ("nixl", {}),
}


def test_the_documented_feature_table_is_what_the_backends_claim() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    lines = [line for line in doc.splitlines() if line.startswith("| ")]
    header = next(i for i, line in enumerate(lines) if line.startswith("| feature | shm |"))
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")][1:]
    assert columns == list(_COLUMNS)
    rows = {}
    for line in lines[header + 1 : header + 1 + len(Feature)]:  # "|---" is not a "| " line
        name, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        rows[Feature(name)] = cells
    assert set(rows) == set(Feature)
    for i, column in enumerate(columns):
        name, settings = _COLUMNS[column]
        claimed = backend(name).features(settings)
        assert {f for f, cells in rows.items() if cells[i] == "yes"} == claimed, column
        assert all(cells[i] in ("yes", "no") for cells in rows.values())
