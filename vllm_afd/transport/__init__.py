"""Transport registry: ``create_attention_transport`` / ``create_ffn_transport`` by name.

Backends register themselves lazily: the registry maps a name to the module that defines it,
so that heavy optional imports (deep_ep on GPUs) happen only when that backend is chosen.
"""

from __future__ import annotations

import importlib

from vllm_afd.transport.base import (
    AttentionTransport,
    DispatchHandle,
    FFNRequest,
    FFNTransport,
    TransportError,
    TransportSpec,
)

# name -> "module:AttentionClass:FFNClass"
_BACKENDS: dict[str, str] = {
    "shm": "vllm_afd.transport.shm:ShmAttentionTransport:ShmFFNTransport",
    "tcp": "vllm_afd.transport.tcp:TcpAttentionTransport:TcpFFNTransport",
    "deepep": "vllm_afd.transport.deepep:DeepEPAttentionTransport:DeepEPFFNTransport",
}


def register_transport(name: str, target: str) -> None:
    """Register a backend as ``"package.module:AttentionCls:FFNCls"`` (idempotent)."""
    _BACKENDS[name] = target


def available_transports() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def _load(name: str) -> tuple[type[AttentionTransport], type[FFNTransport]]:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown AFD transport backend {name!r}; allowed: {', '.join(available_transports())}"
        )
    module_name, attn_name, ffn_name = _BACKENDS[name].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, attn_name), getattr(module, ffn_name)


def create_attention_transport(spec: TransportSpec, rank: int) -> AttentionTransport:
    return _load(spec.backend)[0](spec, rank)


def create_ffn_transport(spec: TransportSpec, rank: int) -> FFNTransport:
    return _load(spec.backend)[1](spec, rank)


__all__ = [
    "AttentionTransport",
    "DispatchHandle",
    "FFNRequest",
    "FFNTransport",
    "TransportError",
    "TransportSpec",
    "available_transports",
    "create_attention_transport",
    "create_ffn_transport",
    "register_transport",
]
