"""Transport registry: ``create_attention_transport`` / ``create_ffn_transport`` by name.

Backends register themselves lazily: the registry maps a name to the module that defines it,
so that heavy optional imports (deep_ep on GPUs) happen only when that backend is chosen.
A name is bound once: registering another target under a taken name is refused.
"""

from __future__ import annotations

import importlib

from vllm_afd.transport.base import (
    AttentionTransport,
    DispatchHandle,
    FFNRankLost,
    FFNRequest,
    FFNServeError,
    FFNTimeout,
    FFNTransport,
    ProtocolError,
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
    """Register a backend as ``"package.module:AttentionCls:FFNCls"``.

    The module is imported only when the backend is first created. Registering the same
    target again is a no-op.

    Raises:
        ValueError: if ``target`` is not ``"module:AttentionCls:FFNCls"``, or if ``name`` is
            already registered with a different target.
    """
    parts = target.split(":")
    if len(parts) != 3 or not all(parts):
        raise ValueError(
            f"AFD transport target {target!r} for {name!r}: expected "
            "'package.module:AttentionClass:FFNClass'"
        )
    current = _BACKENDS.get(name)
    if current is not None and current != target:
        raise ValueError(
            f"AFD transport backend {name!r} is already registered as {current!r}; "
            f"refusing to replace it with {target!r}"
        )
    _BACKENDS[name] = target


def available_transports() -> tuple[str, ...]:
    """Names of the registered backends, sorted (their modules are not imported)."""
    return tuple(sorted(_BACKENDS))


def _load(name: str) -> tuple[type[AttentionTransport], type[FFNTransport]]:
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown AFD transport backend {name!r}; allowed: {', '.join(available_transports())}"
        )
    module_name, attn_name, ffn_name = _BACKENDS[name].split(":")
    module = importlib.import_module(module_name)
    classes = []
    for attr, base in ((attn_name, AttentionTransport), (ffn_name, FFNTransport)):
        cls = getattr(module, attr)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(
                f"AFD transport backend {name!r}: {module_name}.{attr} is not a subclass of "
                f"{base.__name__}"
            )
        classes.append(cls)
    return classes[0], classes[1]


def create_attention_transport(spec: TransportSpec, rank: int) -> AttentionTransport:
    """The attention endpoint of backend ``spec.backend`` for attention rank ``rank``.

    ``spec`` is the one the FFN group published (its ``addresses`` filled in); the endpoint
    connects to every FFN rank before it returns.

    Raises:
        ValueError: for an unknown backend, or a ``spec``/``rank`` the backend refuses.
        TransportError: if an FFN rank cannot be reached.
        RuntimeError: if this machine cannot run the backend (e.g. deepep without a GPU).
    """
    return _load(spec.backend)[0](spec, rank)


def create_ffn_transport(spec: TransportSpec, rank: int) -> FFNTransport:
    """The FFN endpoint of backend ``spec.backend`` for FFN rank ``rank``.

    An entry of ``spec.addresses`` is a request here (shm: segment-name prefix, tcp: the
    ``host:port`` to bind); the endpoint's ``address`` is what attention ranks connect to.

    Raises:
        ValueError: for an unknown backend, or a ``spec``/``rank`` the backend refuses.
        RuntimeError: if this machine cannot run the backend (e.g. deepep without a GPU).
    """
    return _load(spec.backend)[1](spec, rank)


__all__ = [
    "AttentionTransport",
    "DispatchHandle",
    "FFNRankLost",
    "FFNRequest",
    "FFNServeError",
    "FFNTimeout",
    "FFNTransport",
    "ProtocolError",
    "TransportError",
    "TransportSpec",
    "available_transports",
    "create_attention_transport",
    "create_ffn_transport",
    "register_transport",
]
