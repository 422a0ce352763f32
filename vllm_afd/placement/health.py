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
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_afd import envs
from vllm_afd.ffn.rank import block_problem
from vllm_afd.host import (
    LEDGER,
    MP_SEGMENT_PREFIXES,
    SHM_DIR,
    mapped_segments,
    pid_alive,
    process_stopped,
    reap_private_dirs,
)
from vllm_afd.transport import TransportSpec, directory
from vllm_afd.transport.directory import RankEntry

logger = logging.getLogger("vllm.afd")
#: How often the front-end's ``SegmentLedger`` looks at ``/dev/shm``.
LEDGER_INTERVAL_S = 2.0


def reap_dead_segments() -> list[str]:
    """Unlink this user's ``/dev/shm`` segments (transport and metrics) whose creator died
    (SIGKILLed FFN or attention ranks of earlier runs); returns their names."""
    from vllm_afd.metrics.blocks import reap_stale_blocks
    from vllm_afd.transport import available_transports, backend

    reaped = [name for t in available_transports() for name in backend(t).reap_stale()]
    return reaped + reap_stale_blocks()


def reap_once_exited(pids: Iterable[int], within_s: float) -> list[str]:
    """Once the processes ``pids`` (this host's FFN ranks, killed by failover or ended by Ray
    without their stop) exited, or ``within_s`` passed, unlink the segments of dead processes
    (``reap_dead_segments``): a rank that did not run its stop leaves its segments (killed; or
    its raylet died before the front-end stopped, so the stop never reached it and it exited
    with Ray's shutdown, unlinking nothing). Returns their names."""
    deadline = time.monotonic() + within_s
    pids = list(pids)
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return reap_dead_segments()


def reap_dead_deployments() -> list[str]:
    """Reclaim what earlier deployments on this host left when they were killed (SIGKILL, a
    killed process group): this user's segments of dead processes (``reap_dead_segments``),
    the private directories of front-ends that died and the multiprocessing segments their
    ledgers name (``host.reap_private_dirs``, ``SegmentLedger``), in one log line; run before
    a new FFN group starts. Returns what it removed."""
    dirs, mp_segments = reap_private_dirs()
    segments = reap_dead_segments() + mp_segments
    if dirs or segments:
        logger.info(
            "AFD: reclaimed what killed deployments left: %d file(s) in /dev/shm, %d private "
            "directory(ies) in %s",
            len(segments),
            len(dirs),
            tempfile.gettempdir(),
        )
    return segments + dirs


class SegmentLedger:
    """The front-end's record of the multiprocessing segments in ``/dev/shm`` that its
    deployment's processes map (vLLM's message queues and locks: ``host.MP_SEGMENT_PREFIXES``),
    kept in its private directory (``host.LEDGER``) so that, if the deployment is killed with
    Python's resource tracker, the next start reclaims them (``reap_dead_deployments``).

    A thread looks every ``LEDGER_INTERVAL_S``; it reads the processes' maps only when the
    names of that kind in ``/dev/shm`` changed since its last look, so a serving deployment
    costs it one directory listing per interval. The deployment is this process and all it
    started (engine cores, workers, Ray's daemons and the FFN ranks).
    """

    def __init__(self, directory: str, interval_s: float = LEDGER_INTERVAL_S) -> None:
        self.path = os.path.join(directory, LEDGER)
        self._recorded: set[str] = set()
        self._listing: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="afd-segment-ledger", daemon=True)
        self._thread.start()

    def record(self) -> set[str]:
        """Look once; returns the names recorded so far."""
        try:
            listing = frozenset(n for n in os.listdir(SHM_DIR) if n.startswith(MP_SEGMENT_PREFIXES))
        except OSError:
            return self._recorded
        if listing == self._listing:
            return self._recorded
        self._listing = listing
        import psutil

        me = psutil.Process()
        pids = [me.pid, *(child.pid for child in me.children(recursive=True))]
        new = mapped_segments(pids, MP_SEGMENT_PREFIXES) - self._recorded
        if new:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o600)
            try:
                os.write(fd, "".join(f"{name}\n" for name in sorted(new)).encode())
            finally:
                os.close(fd)
            self._recorded |= new
        return self._recorded

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.record()
            except Exception:  # noqa: BLE001 - a ledger must never take the front-end down
                logger.debug("AFD: segment ledger", exc_info=True)


#: This front-end's ledger (``keep_ledger``), one per process, whether it started its FFN group
#: or joined one.
_LEDGER: SegmentLedger | None = None
_LEDGER_LOCK = threading.Lock()


def keep_ledger(directory: str) -> None:
    """Keep this front-end's ``SegmentLedger`` in its private ``directory`` (idempotent) until
    ``drop_ledger``."""
    global _LEDGER
    with _LEDGER_LOCK:
        if _LEDGER is None:
            _LEDGER = SegmentLedger(directory)


def drop_ledger() -> None:
    """Stop this front-end's ledger (its file goes with the private directory)."""
    global _LEDGER
    with _LEDGER_LOCK:
        ledger, _LEDGER = _LEDGER, None
    if ledger is not None:
        ledger.stop()


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
