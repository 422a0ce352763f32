"""The FFN directory: where each FFN rank of a deployment can be reached now (failover).

An FFN rank that dies, stops or wedges is replaced by a new process (``placement``'s
supervisor), which has a new address (new shm segments, a new NIXL agent). The attention
ranks, the ``/health`` check and ``/metrics`` learn about it here: one small JSON file per FFN
rank (``rank<r>.json``) in a directory of the deployment (``TransportSpec.directory``: inside
the deployment's private directory, mode 0700, removed with it). The supervisor is the only
writer; every write is a whole file renamed into place, so a reader sees the old entry or the
new one, never half of one.

An entry's ``incarnation`` counts the starts of that rank (1: the first process). Its ``state``:

- ``up``: the process of this incarnation serves at ``address``;
- ``recovering``: the last incarnation was lost (``reason``) and its replacement is starting;
- ``failed``: the supervisor gave up on the rank (``reason``): it failed too often in a row.

Why files and not a service: every reader already runs on the front-end's host (the attention
ranks of a single-node deployment, the API server) and reads the directory only when something
failed, or at a scrape (and a thread of each attention worker ``stat``s ``pool.json`` every
50 ms: a live scale, below); a file read needs no connection, no authentication and no process
of its own. The hot path never reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

UP, RECOVERING, FAILED = "up", "recovering", "failed"
#: How often a waiting attention rank reads the directory again.
POLL_S = 0.02


@dataclass(frozen=True)
class RankEntry:
    """One FFN rank as the directory knows it (see the module docstring)."""

    rank: int
    incarnation: int
    state: str
    address: str
    host: str
    pid: int
    #: Why the last failover happened (``recovering``, ``up`` after a failover) or why the
    #: supervisor gave up (``failed``).
    reason: str = ""
    #: Failovers of this rank so far, and the seconds they took in total, each from the
    #: detection of the loss to the replacement serving.
    failovers: int = 0
    recovery_s: float = 0.0


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def publish(directory: str, entry: RankEntry) -> None:
    """Write ``entry`` as FFN rank ``entry.rank``'s (atomically: a renamed whole file)."""
    _write(_path(directory, entry.rank), dataclasses.asdict(entry))


def lookup(directory: str, rank: int) -> RankEntry | None:
    """FFN rank ``rank``'s entry, or ``None`` if the directory has none (or is gone)."""
    data = _read(_path(directory, rank))
    try:
        return None if data is None else RankEntry(**data)
    except TypeError:
        return None


def entries(directory: str, num_ranks: int) -> list[RankEntry | None]:
    """Every FFN rank's entry, in rank order."""
    return [lookup(directory, r) for r in range(num_ranks)]


class ReplacementTimeout(TimeoutError):
    """No replacement of a lost FFN rank came up in time, or the supervisor gave up."""


def wait_for_replacement(directory: str, rank: int, after: int, timeout_s: float) -> RankEntry:
    """Wait for an ``up`` entry of FFN rank ``rank`` with an incarnation above ``after``.

    Raises:
        ReplacementTimeout: after ``timeout_s``, or at once when the entry says ``failed``
            (the message carries the supervisor's reason).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        entry = lookup(directory, rank)
        if entry is not None and entry.state == FAILED:
            raise ReplacementTimeout(f"FFN rank {rank} is not replaced: {entry.reason}")
        if entry is not None and entry.state == UP and entry.incarnation > after:
            return entry
        if time.monotonic() >= deadline:
            state = "no entry" if entry is None else f"{entry.state} #{entry.incarnation}"
            raise ReplacementTimeout(
                f"FFN rank {rank}: no replacement up within {timeout_s:g}s "
                f"(--afd-failover-timeout; directory says: {state})"
            )
        time.sleep(POLL_S)


# --------------------------------------------------------------------------------------------
# The pool: which FFN ranks serve now (a live scale, ``placement/scaling.py``), and which pool
# each attention rank switched to.
# --------------------------------------------------------------------------------------------
#
# A live scale starts a new pool of FFN ranks (its own spec: rank count, addresses, and an FFN
# directory of its own for failover) next to the running one and publishes it as the next
# *epoch* in ``pool.json``, next to the deployment's FFN directories. Each attention rank
# switches to the newest epoch at a step boundary and says so in ``attention<a>.json``; once
# every attention rank did, the old pool drains and stops. Same rules as the rank entries: one
# writer per file, whole files renamed into place. Epoch 1 is the pool the front-end started
# (no ``pool.json`` until the first scale).


@dataclass(frozen=True)
class Pool:
    """The pool attention ranks switch to: epoch ``epoch``, FFN ranks as ``spec`` (the JSON of
    its ``TransportSpec``), and every scale so far (``ScaleEvent`` dicts, oldest first)."""

    epoch: int
    spec: str
    events: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Switch:
    """Attention rank ``rank`` serves on pool ``epoch`` since its switch, which held its step
    for ``stall_s`` seconds (connecting to the new pool's ranks)."""

    rank: int
    epoch: int
    stall_s: float = 0.0


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            data: dict[str, Any] = json.load(fh)
            return data
    except (OSError, ValueError):
        return None


def _beside(ffn_directory: str, name: str) -> str:
    """File ``name`` of the deployment whose (any epoch's) FFN directory is ``ffn_directory``,
    in its private directory, next to the FFN directories."""
    return os.path.join(os.path.dirname(ffn_directory), name)


def pool_path(ffn_directory: str) -> str:
    return _beside(ffn_directory, "pool.json")


def publish_pool(ffn_directory: str, pool: Pool) -> None:
    data = dataclasses.asdict(pool)
    data["events"] = list(pool.events)
    _write(pool_path(ffn_directory), data)


def read_pool(ffn_directory: str) -> Pool | None:
    """The published pool, or ``None`` before the first scale (or for a directory-less spec)."""
    data = _read(pool_path(ffn_directory)) if ffn_directory else None
    if data is None:
        return None
    try:
        return Pool(int(data["epoch"]), str(data["spec"]), tuple(data.get("events", ())))
    except (KeyError, TypeError, ValueError):
        return None


def live_runtime(runtime: str) -> str:
    """The runtime spec JSON (``VLLM_AFD_RUNTIME``) of the pool serving now: the newest
    epoch's once a live scale published one, else ``runtime``. A process other than the one
    that scaled (another API server) has the spec it was started with in its environment."""
    try:
        where = json.loads(runtime).get("directory") or ""
    except (ValueError, AttributeError):
        return runtime
    pool = read_pool(where)
    return pool.spec if pool is not None else runtime


def epoch_of(ffn_directory: str) -> int:
    """The epoch of the pool whose FFN directory is ``ffn_directory`` while it is the newest
    (a front-end that joined after a scale starts on it); else 1."""
    pool = read_pool(ffn_directory)
    if pool is None or json.loads(pool.spec).get("directory") != ffn_directory:
        return 1
    return pool.epoch


def publish_switch(ffn_directory: str, switch: Switch) -> None:
    _write(_beside(ffn_directory, f"attention{switch.rank}.json"), dataclasses.asdict(switch))


def switches(ffn_directory: str, ranks: Iterable[int]) -> list[Switch | None]:
    """Each attention rank's last switch (``None``: it never switched: epoch 1)."""
    out: list[Switch | None] = []
    for rank in ranks:
        data = _read(_beside(ffn_directory, f"attention{rank}.json"))
        try:
            out.append(None if data is None else Switch(**data))
        except TypeError:
            out.append(None)
    return out


# The planner in the loop's latest advice (``placement/autoscale.py``): written by the process
# that holds the FFN group, read by ``/afd/status`` and ``/metrics`` in every API server.


def publish_advice(ffn_directory: str, advice: dict[str, Any]) -> None:
    _write(_beside(ffn_directory, "advice.json"), advice)


def read_advice(ffn_directory: str) -> dict[str, Any] | None:
    """The latest advice (``None``: none yet, or a directory-less spec)."""
    return _read(_beside(ffn_directory, "advice.json")) if ffn_directory else None
