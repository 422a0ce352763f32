"""Transport registry: a backend (``base.Backend``: its endpoints and what it can do) by name.

Backends register themselves lazily: the registry maps a name to the module that defines it,
so that heavy optional imports (Triton on GPUs) happen only when that backend is asked for.
A name is bound once: registering another target under a taken name is refused. A backend
outside this package needs no registration: ``--afd-transport package.module:MyBackend``
names it by module path (as vLLM's ``kv_connector_module_path``), in every process.
"""

from __future__ import annotations

import importlib

from vllm_afd.errors import FFNRankLost, FFNServeError, FFNTimeout, ProtocolError, TransportError
from vllm_afd.transport.base import (
    AttentionTransport,
    Backend,
    DispatchHandle,
    Feature,
    FFNRequest,
    FFNTransport,
    TransportSpec,
)

# name -> "module:BackendClass"
_BACKENDS: dict[str, str] = {
    "shm": "vllm_afd.transport.slots:ShmBackend",
    "slots": "vllm_afd.transport.slots:SlotsBackend",
    "nixl": "vllm_afd.transport.nixl:NixlBackend",
}

#: Backends that were: name -> what to use instead (``backend`` refuses them with that advice).
_RETIRED = {"tcp": "retired; across hosts use nixl (the slot plane over NIXL), on one host shm"}


def _is_target(text: str) -> bool:
    parts = text.split(":")
    return len(parts) == 2 and all(parts)


def register_transport(name: str, target: str) -> None:
    """Register a backend as ``"package.module:BackendClass"`` (a ``Backend`` subclass).

    The module is imported only when the backend is first asked for. Registering the same
    target again is a no-op.

    Raises:
        ValueError: if ``target`` is not ``"module:BackendClass"``, or if ``name`` is already
            registered with a different target.
    """
    if not _is_target(target):
        raise ValueError(
            f"AFD transport target {target!r} for {name!r}: expected 'package.module:BackendClass'"
        )
    current = _BACKENDS.get(name)
    if current is not None and current != target:
        raise ValueError(
            f"AFD transport backend {name!r} is already registered as {current!r}; "
            f"refusing to replace it with {target!r}"
        )
    _BACKENDS[name] = target


#: ``--afd-transport auto``: the first of these whose endpoints this machine and these devices
#: can run (``auto_backend``): shared memory on one x86-64 CPU host, NIXL on other CPUs (whose
#: weak store order shared memory cannot use), the slot plane on GPUs (device memory shared by
#: CUDA IPC, within one node).
AUTO_ORDER = ("shm", "nixl", "slots")
#: The same for CPU attention ranks whose FFN ranks may run on other hosts (a given Ray
#: cluster): the slot plane over NIXL, nothing else (host memory ends at the host). GPUs keep
#: ``AUTO_ORDER``: the slot plane within one node (NIXL on device memory is not built).
AUTO_ORDER_ACROSS_HOSTS = ("nixl",)


def auto_backend(attention_device: str, ffn_device: str, across_hosts: bool = False) -> str:
    """The backend ``--afd-transport auto`` means for these devices (``"cpu"``, ``"cuda"``)
    on this machine: the first of ``AUTO_ORDER`` (``AUTO_ORDER_ACROSS_HOSTS`` for CPU attention
    ranks whose FFN ranks may run on other hosts) without a ``device_problem`` or
    ``host_problem``.

    Raises:
        ValueError: naming each backend's reason, if none can.
    """
    reasons = []
    cpu_across_hosts = across_hosts and attention_device == "cpu"
    for name in AUTO_ORDER_ACROSS_HOSTS if cpu_across_hosts else AUTO_ORDER:
        cls = backend(name)
        problem = cls.device_problem(attention_device, ffn_device) or cls.host_problem()
        if problem is None:
            return name
        reasons.append(problem)
    raise ValueError(
        f"no transport backend connects {attention_device} attention ranks to {ffn_device} FFN "
        f"ranks on this machine: {'; '.join(reasons)}"
    )


def available_transports() -> tuple[str, ...]:
    """Names of the registered backends, sorted (their modules are not imported)."""
    return tuple(sorted(_BACKENDS))


def backend(name: str) -> type[Backend]:
    """The backend registered as ``name``, or the one a ``"package.module:BackendClass"`` path
    names (its module imported now).

    Raises:
        ValueError: for a name neither registered nor a module path, or a module path that does
            not import.
        TypeError: if the target is not a ``Backend`` subclass with endpoint classes.
    """
    if name in _RETIRED:
        raise ValueError(f"AFD transport backend {name!r} is {_RETIRED[name]}")
    target = _BACKENDS.get(name) or (name if _is_target(name) else None)
    if target is None:
        raise ValueError(
            f"unknown AFD transport backend {name!r}; allowed: {', '.join(available_transports())}"
            " or a module path 'package.module:BackendClass'"
        )
    module_name, attr = target.split(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"AFD transport backend {name!r}: cannot load {target!r} ({exc})"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"AFD transport backend {name!r}: {target} is not a Backend subclass")
    for attr, base in (("attention", AttentionTransport), ("ffn", FFNTransport)):
        endpoint = getattr(cls, attr, None)
        if not (isinstance(endpoint, type) and issubclass(endpoint, base)):
            raise TypeError(
                f"AFD transport backend {name!r}: {target}.{attr} is not a subclass of "
                f"{base.__name__}"
            )
    return cls


def create_attention_transport(spec: TransportSpec, rank: int) -> AttentionTransport:
    """The attention endpoint of backend ``spec.backend`` for attention rank ``rank``.

    ``spec`` is the one the FFN group published (its ``addresses`` filled in); the endpoint
    (``Backend.endpoints`` for ``spec.config``) connects to every FFN rank before it returns.

    Raises:
        ValueError: for an unknown backend, or a ``spec``/``rank`` the backend refuses.
        TransportError: if an FFN rank cannot be reached.
        RuntimeError: if this machine cannot run the backend (e.g. shm on aarch64).
    """
    return backend(spec.backend).endpoints(spec.config)[0](spec, rank)


def create_ffn_transport(spec: TransportSpec, rank: int) -> FFNTransport:
    """The FFN endpoint of backend ``spec.backend`` for FFN rank ``rank``.

    An entry of ``spec.addresses`` is a request here (the slot plane: segment-name prefix);
    the endpoint's ``address`` is what attention ranks connect to.

    Raises:
        ValueError: for an unknown backend, or a ``spec``/``rank`` the backend refuses.
        RuntimeError: if this machine cannot run the backend (e.g. shm on aarch64).
    """
    return backend(spec.backend).endpoints(spec.config)[1](spec, rank)


__all__ = [
    "AttentionTransport",
    "Backend",
    "DispatchHandle",
    "Feature",
    "FFNRankLost",
    "FFNRequest",
    "FFNServeError",
    "FFNTimeout",
    "FFNTransport",
    "ProtocolError",
    "TransportError",
    "AUTO_ORDER",
    "TransportSpec",
    "auto_backend",
    "available_transports",
    "backend",
    "create_attention_transport",
    "create_ffn_transport",
    "register_transport",
]
