"""Placement, health: what keeps the FFN ranks from serving (``/health``, ``/afd/ready``, the
failover supervisor), and the clean-up of what dead processes left behind.

Two questions, two probes. Readiness (``/afd/ready``): does every FFN rank serve now? Any
problem says no, a rank being replaced too. Liveness (``/health``): can the deployment still
serve without a restart? A problem failover is healing (``Problem.healing``: a rank being
replaced, or one just lost that the supervisor will replace) says yes; one it cannot heal
(failover off or given up, a rank that failed requests) says no, so that Kubernetes restarts a
pod only when a restart is what it takes.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_afd import envs
from vllm_afd.host import (
    pid_alive,
    process_stopped,
    reap_private_dirs,
)
from vllm_afd.transport import TransportSpec, directory
from vllm_afd.transport.directory import RankEntry

logger = logging.getLogger("vllm.afd")
#: How old an FFN rank's heartbeat (``ffn.rank.HEARTBEAT_INTERVAL_S``) may be before
#: ``ffn_group_problems`` calls the rank stopped, when its process is stopped (SIGSTOP); and
#: when it is not (frozen: a deadlock, a call that never returns). The second is longer: on a
#: loaded host a running rank's heartbeat thread can go more than a second without the CPU
#: (seen on 2 cores with three servers starting), and replacing a rank that was only slow
#: costs a failover, or a server that had not finished starting.
HEARTBEAT_TIMEOUT_S = 1.0
FROZEN_TIMEOUT_S = 10.0


def reap_dead_segments() -> list[str]:
    """Unlink this user's ``/dev/shm`` segments (transport and metrics) whose creator died
    (SIGKILLed FFN or attention ranks of earlier runs); returns their names."""
    from vllm_afd.metrics.blocks import reap_stale_blocks
    from vllm_afd.transport import available_transports, backend

    reaped = [name for t in available_transports() for name in backend(t).reap_stale()]
    reaped += reap_stale_blocks()
    if reaped:
        logger.info("AFD: removed %d segment(s) of dead processes from /dev/shm", len(reaped))
    return reaped


def reap_dead_deployments() -> list[str]:
    """``reap_dead_segments``, and the private directories of front-ends that died without
    cleaning up (``host.reap_private_dirs``): run before a new FFN group starts."""
    dirs = reap_private_dirs()
    if dirs:
        logger.info("AFD: removed %d private directory(ies) of dead front-ends", len(dirs))
    return reap_dead_segments() + dirs


def rank_problem(entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
    """Why the process of ``entry`` (an ``up`` FFN rank) cannot serve, or ``None``; and the
    count of requests that failed on it. Only ranks on this host are checked (pid, stats
    block); others are ``(None, 0)``: the failover supervisor watches those through Ray
    (``failover.RayWatch``, which runs ``block_problem`` in the rank's own process)."""
    if entry.host != socket.gethostname():
        return None, 0.0
    who = f"FFN rank {entry.rank} (pid {entry.pid})"
    if not pid_alive(entry.pid):
        return f"{who} died", 0.0
    return block_problem(entry, timeout_s, lambda: process_stopped(entry.pid))


def block_problem(
    entry: RankEntry, timeout_s: float, stopped: Callable[[], bool]
) -> tuple[str | None, float]:
    """``rank_problem`` from the rank's stats block alone (read on the rank's host; ``stopped``
    says whether its process is stopped): no heartbeat, a layer batch running past
    ``timeout_s``; and the count of requests that failed on it."""
    from vllm_afd.metrics.blocks import (
        F_BUSY_SINCE,
        F_FAILURES,
        F_HEARTBEAT,
        ffn_block_name,
        read_block,
    )

    who = f"FFN rank {entry.rank} (pid {entry.pid})"
    block = read_block(ffn_block_name(entry.address, entry.rank))
    if block is None:
        return None, 0.0
    now = time.monotonic()
    beat, busy, failures = (block.scalars[i] for i in (F_HEARTBEAT, F_BUSY_SINCE, F_FAILURES))
    age = now - beat if beat else 0.0
    if age > FROZEN_TIMEOUT_S or (age > HEARTBEAT_TIMEOUT_S and stopped()):
        return f"{who} stopped: no heartbeat for {age:.1f}s", failures
    if busy and now - busy > timeout_s:
        return (
            f"{who} wedged: one layer batch running for {now - busy:.1f}s "
            f"(timeout_s={timeout_s:g})",
            failures,
        )
    return None, failures


@dataclass(frozen=True)
class Problem:
    """One thing that keeps an FFN rank from serving now."""

    text: str
    #: Failover is replacing the rank, or will within one supervisor interval.
    healing: bool = False


def _fails_over(spec: TransportSpec) -> bool:
    from vllm_afd.transport import Feature, backend

    features = backend(spec.backend).features(spec.config)
    return spec.failover_s > 0 and Feature.FAILOVER in features


def ffn_group_problems() -> list[Problem]:
    """What keeps the deployment's FFN ranks from serving, one each (empty: healthy).

    Readable from any process of the deployment (``/health`` runs in the API server), from the
    FFN directory of the live pool (``directory.live_runtime``). A rank is unhealthy while it
    is being replaced, once the supervisor gave up on it, and, on this host, when its process
    is gone, when its heartbeat (a thread of the rank, every ``HEARTBEAT_INTERVAL_S``) is older
    than ``HEARTBEAT_TIMEOUT_S`` with the process stopped (SIGSTOP) or ``FROZEN_TIMEOUT_S``
    with it running (frozen), when one layer batch has been running longer than the transport
    timeout (wedged), or once a request failed there (``FFNServeError``). Only a rank being
    replaced, and a lost or failing one of a deployment with failover, is ``healing``.
    """
    runtime = envs.VLLM_AFD_RUNTIME
    spec = TransportSpec.from_json(directory.live_runtime(runtime)) if runtime else None
    if spec is None or not spec.directory:
        return []
    fails_over = _fails_over(spec)
    problems = []
    for rank, entry in enumerate(directory.entries(spec.directory, spec.num_ffn_ranks)):
        if entry is None:
            continue
        if entry.state == directory.RECOVERING:
            problems.append(Problem(f"FFN rank {rank} is being replaced: {entry.reason}", True))
        elif entry.state == directory.FAILED:
            problems.append(Problem(entry.reason))
        else:
            problem, failures = rank_problem(entry, spec.timeout_s)
            if problem:
                problems.append(Problem(problem, fails_over))
            if failures:  # failover replaces the rank (``failover.Supervisor``)
                problems.append(
                    Problem(
                        f"FFN rank {rank} (pid {entry.pid}) failed {failures:.0f} request(s)",
                        fails_over,
                    )
                )
    return problems
