"""Placement, one FFN group for many front-ends: ``vllm-afd ffn-server`` runs
``start_ffn_group`` in a process of its own and writes a group file (``write_group_file``); a
front-end given ``--afd-join`` checks it against its own configuration and takes attention
ranks of the group (``join_ffn_group``).

The group file names the group; the pool that serves now is ``pool.json``'s once a live scale
(``vllm-afd scale``, ``scaling.py``) published one: a front-end joins that pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket

from vllm_afd import envs
from vllm_afd.config import AUTO_TRANSPORT
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import (
    process_start_time,
    write_private_file,
)
from vllm_afd.placement.cluster import FFNGroup, GroupRequest
from vllm_afd.placement.credentials import private_directory
from vllm_afd.placement.health import keep_ledger, reap_dead_deployments
from vllm_afd.transport import TransportSpec, directory

logger = logging.getLogger("vllm.afd")

#: Version of the group file's format.
GROUP_FILE_FORMAT = 1
_GROUP_FILE_MAX_BYTES = 1 << 20
#: The joined group's lease directory and the attention ranks this front-end holds there.
_LEASES: tuple[str, list[int]] | None = None
#: The lease directory of the group this process serves (``write_group_file``).
_SERVED_LEASES: str | None = None


def _version() -> str:
    """This package's version (from its metadata: importing ``vllm_afd`` here would close an
    import circle)."""
    from importlib.metadata import version

    return version("vllm-afd")


def model_identity(model_dir: str) -> str:
    """What a front-end must serve to join a group: the sha256 of the checkpoint's
    ``config.json`` (architecture, sizes, experts, quantization)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def scale_requests_dir() -> str:
    """Where this process's ffn-server group takes scale requests (``scaling.py``)."""
    return os.path.join(private_directory(), "scale")


def write_group_file(group: FFNGroup | None, path: str | None, model_dir: str) -> str:
    """Describe the running FFN group for front-ends that join it (``--afd-join``).

    The file (mode 0600) holds the group's ``TransportSpec`` (addresses, FFN directory), the
    model's identity and dtype, the package version, the lease directory where joining
    front-ends take their attention ranks: nothing secret.
    Default place: the deployment's private directory. Returns the path.
    """
    global _SERVED_LEASES
    if group is None:
        raise RuntimeError("no FFN group runs in this process")
    leases = os.path.join(private_directory(), "leases")
    os.makedirs(leases, mode=0o700, exist_ok=True)
    requests = scale_requests_dir()
    os.makedirs(requests, mode=0o700, exist_ok=True)
    _SERVED_LEASES = leases
    content = {
        "format": GROUP_FILE_FORMAT,
        "vllm_afd": _version(),
        "spec": json.loads(group.spec.to_json()),
        "model": model_dir,
        "model_sha256": model_identity(model_dir),
        "leases": leases,
        "scale_requests": requests,
        "owner": {"host": socket.gethostname(), "pid": os.getpid()},
    }
    path = os.path.abspath(path or os.path.join(private_directory(), "group.json"))
    if os.path.lexists(path):
        os.unlink(path)
    return write_private_file(path, json.dumps(content, indent=1).encode())


def read_group_file(path: str, where: str) -> dict:
    """The group file at ``path``; ``AFDConfigError`` starting with ``where`` (the flag that
    named it) if it is not one of this user's."""
    from vllm_afd.host import read_private_file

    try:
        content = json.loads(read_private_file(path, _GROUP_FILE_MAX_BYTES))
    except FileNotFoundError:
        raise AFDConfigError(
            f"{where}: no such file; give the group file `vllm-afd ffn-server` printed"
        ) from None
    except (OSError, ValueError) as exc:
        raise AFDConfigError(f"{where}: not a readable group file of this user ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != GROUP_FILE_FORMAT:
        raise AFDConfigError(f"{where}: not a group file of format {GROUP_FILE_FORMAT}")
    return content


def join_ffn_group(request: GroupRequest) -> TransportSpec:
    """Join the FFN group of ``afd.join`` with this front-end's attention ranks.

    Everything that must agree is checked first, each mismatch an ``AFDConfigError`` naming
    both sides: package version, model (``model_identity``), dtype, expert layout, transport,
    batch size (``--max-num-batched-tokens`` at most the group's) and microbatches (at most
    the group's slots). Then this front-end takes ``num_attention_ranks`` consecutive attention
    ranks of the group (``_claim_ranks``), and the group's spec, with them, is handed to the
    processes vLLM starts (``VLLM_AFD_RUNTIME``). The front-end never stops the group; leaving
    gives its ranks back (``stop_ffn_group``).
    """
    global _LEASES
    afd, model, model_dir = request.afd, request.model, request.model_dir
    num_attention_ranks, max_tokens, dtype = (
        request.num_attention_ranks,
        request.max_tokens,
        request.dtype,
    )
    where = f"--afd-join (additional_config.afd.join) {afd.join!r}"
    content = read_group_file(afd.join, where)
    spec = TransportSpec.from_json(directory.live_runtime(json.dumps(content["spec"])))
    mine = {
        "vllm_afd version": _version(),
        "model (sha256 of config.json)": model_identity(model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "transport (--afd-transport)": (
            spec.backend if afd.transport == AUTO_TRANSPORT else afd.transport
        ),
        "experts, top_k, hidden size, MoE layers": (
            model.num_experts,
            model.top_k,
            model.hidden_size,
            list(model.moe_layers),
        ),
    }
    theirs = {
        "vllm_afd version": content.get("vllm_afd"),
        "model (sha256 of config.json)": content.get("model_sha256"),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "transport (--afd-transport)": spec.backend,
        "experts, top_k, hidden size, MoE layers": (
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            list(spec.moe_layers),
        ),
    }
    for field_name, value in mine.items():
        if value != theirs[field_name]:
            raise AFDConfigError(
                f"{where}: the FFN group serves {field_name} {theirs[field_name]!r}, this "
                f"front-end {value!r} (group model: {content.get('model')})"
            )
    if max_tokens > spec.max_tokens:
        raise AFDConfigError(
            f"{where}: --max-num-batched-tokens {max_tokens} is more than the FFN group takes "
            f"({spec.max_tokens}); use at most that"
        )
    if afd.microbatches > spec.num_slots:
        raise AFDConfigError(
            f"{where}: --afd-microbatches {afd.microbatches} is more than the FFN group's "
            f"{spec.num_slots} slots per attention rank"
        )
    reap_dead_deployments()  # as a start does: what killed front-ends left on this host
    leases = str(content["leases"])
    first = _claim_ranks(leases, num_attention_ranks, spec.num_attention_ranks, where)
    _LEASES = (leases, list(range(first, first + num_attention_ranks)))
    spec = dataclasses.replace(spec, attention_rank_offset=first)
    os.environ[envs.RUNTIME] = spec.to_json()
    keep_ledger(private_directory())  # vLLM's segments of this front-end, as a starter's
    logger.info(
        "AFD: joined the FFN group of %s as attention ranks %d..%d of %d (%d FFN rank(s), %s)",
        afd.join,
        first,
        first + num_attention_ranks - 1,
        spec.num_attention_ranks,
        spec.num_ffn_ranks,
        spec.backend,
    )
    return spec


def _claim_ranks(leases: str, count: int, capacity: int, where: str) -> int:
    """Take ``count`` consecutive attention ranks of a group: one lease file per rank, created
    exclusively, holding this process's pid and start time. A lease whose holder is gone (same
    host) is taken over. Returns the first rank."""
    pid = os.getpid()
    me = {"host": socket.gethostname(), "pid": pid, "start": process_start_time(pid)}
    for first in range(0, capacity - count + 1):
        taken: list[int] = []
        for rank in range(first, first + count):
            if not _take_lease(leases, rank, me):
                break
            taken.append(rank)
        if len(taken) == count:
            return first
        _release_leases(leases, taken)
    raise AFDConfigError(
        f"{where}: the FFN group has no {count} free attention rank(s) in a row (it takes "
        f"{capacity}; front-ends that joined hold the others: {sorted(os.listdir(leases))}); "
        "start the ffn-server with a larger --afd-ratio A, or use fewer ranks here"
    )


def _take_lease(leases: str, rank: int, me: dict) -> bool:
    path = os.path.join(leases, f"rank{rank}")
    for _ in range(2):
        try:
            write_private_file(path, json.dumps(me).encode())
            return True
        except FileExistsError:
            try:
                with open(path) as fh:
                    holder = json.load(fh)
            except (OSError, ValueError):
                return False
            if _holds(holder):
                return False
            os.unlink(path)  # its front-end died without giving it back
    return False


def _holds(holder: dict) -> bool:
    """The holder of a lease still runs (one on another host is taken to)."""
    if holder.get("host") != socket.gethostname():
        return True
    return process_start_time(int(holder.get("pid", 0))) == holder.get("start")


def served_attention_ranks(spec: TransportSpec) -> list[int]:
    """The attention ranks serving on this process's group ``spec``: of an ffn-server group,
    those a live front-end leased; else every rank of ``spec``."""
    first = spec.attention_rank_offset
    every = range(first, first + spec.num_attention_ranks)
    if _SERVED_LEASES is None:
        return list(every)
    held = []
    for rank in every:
        try:
            with open(os.path.join(_SERVED_LEASES, f"rank{rank}")) as fh:
                holder = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(holder, dict) and _holds(holder):
            held.append(rank)
    return held


def _release_leases(leases: str, ranks: list[int]) -> None:
    for rank in ranks:
        try:
            os.unlink(os.path.join(leases, f"rank{rank}"))
        except FileNotFoundError:
            pass


def leave_group() -> None:
    """Give back the attention ranks this front-end took of a joined group (if any), and
    forget the group this process served (``write_group_file``)."""
    global _LEASES, _SERVED_LEASES
    _SERVED_LEASES = None
    if _LEASES is not None:
        _release_leases(*_LEASES)
        _LEASES = None
