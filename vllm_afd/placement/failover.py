"""Placement, failover: ``Supervisor``, a thread of the front-end, replaces an FFN rank that
died, stopped, wedged or failed serving a request (``health.rank_problem``; on another Ray
node, ``RayWatch``: its process or its node died), and publishes the replacement in the FFN
directory (``transport/directory.py``), where the attention ranks find it
(``transport/endpoint.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import threading
import time

from vllm_afd.ffn.rank import FROZEN_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from vllm_afd.host import (
    pid_alive,
)
from vllm_afd.patches import ray_errors
from vllm_afd.placement.cluster import FFNGroup, log_rank_up
from vllm_afd.placement.health import rank_problem, reap_once_exited
from vllm_afd.transport import directory
from vllm_afd.transport.directory import RankEntry

logger = logging.getLogger("vllm.afd")
#: Failover (``Supervisor``): a replacement that served this long ends a streak of failures;
#: after this many failures of one rank in a row the supervisor gives up on it; the longest
#: wait before starting a replacement.
FAILOVER_STABLE_S = 30.0
FAILOVER_MAX_STREAK = 5
FAILOVER_MAX_DELAY_S = 30.0
#: How long stopping the supervisor waits for its thread (``Supervisor.stop``).
STOP_WAIT_S = 2.0


#: Pids of the FFN rank processes this front-end's supervisors watch or watched
#: (``supervised_pid``).
_SUPERVISED: set[int] = set()


def supervised_pid(pid: int) -> bool:
    """A supervisor of this process watches (or watched) the FFN rank that runs (ran) as
    ``pid``: its death is the supervisor's to report (patch R1 keeps Ray's report of it out of
    the log; Ray may print it before the supervisor notices)."""
    return pid in _SUPERVISED


def restart_delay(streak: int) -> float:
    """Seconds before starting the replacement after the ``streak``-th failure of a rank in a
    row: 0 for the first, then 1, 3, 7, 15 s (at most ``FAILOVER_MAX_DELAY_S``)."""
    return min(2.0 ** (streak - 1) - 1, FAILOVER_MAX_DELAY_S)


def failure_cause(problem: str) -> str:
    """The kind of failure ``problem`` names: its words after the rank and pid, up to a colon,
    parenthesis or semicolon (``died``, ``stopped``, ``wedged``, ``failed serving a request``,
    ``gave no answer through Ray for``...). A streak counts failures of one kind: a rank that
    died of an OOM kill and, a few seconds later, failed a bad request is not crash-looping."""
    text = problem.split(") ", 1)[-1]
    return re.split(r"[:(;]", text, maxsplit=1)[0].rstrip(" 0123456789.s")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc``'s text on one line (Ray's errors span several), at most ``limit`` characters."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RayWatch:
    """The supervisor's view, through Ray, of FFN ranks on other Ray nodes than the front-end's
    (their pid and stats block are not readable here: ``health.rank_problem``).

    Each such rank has one ``FFNRank.problem`` call in flight (the next one made when it
    answered), collected without blocking every supervisor interval. The rank is lost when the call
    fails with the actor dead (``ActorDiedError``: its process, or its node, died: Ray fails
    the calls of an actor on a node that its GCS health check declared dead), or when no answer
    came for ``FROZEN_TIMEOUT_S`` (a node cut off, a stopped process: Ray answers
    ``ActorUnavailableError`` meanwhile, and is asked again). An answer is the rank's own view
    of its stats block (``ffn.rank.block_problem``: heartbeat, a wedged batch, failed requests).
    """

    def __init__(self, group: FFNGroup) -> None:
        self.group = group
        #: rank -> (the actor asked, the call in flight, when its last answer came)
        self._calls: dict[int, tuple[object, object, float]] = {}
        self._here: str | None = None

    def watches(self, rank: int) -> bool:
        """FFN rank ``rank`` runs on another Ray node than this process."""
        import ray

        if not ray.is_initialized():
            return False
        if self._here is None:
            self._here = ray.get_runtime_context().get_node_id()
        return self.group.infos[rank].get("node") not in (None, self._here)

    def problem(self, entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
        """As ``health.rank_problem`` for ``entry``'s rank, through Ray (see the class)."""
        import ray

        rank, now = entry.rank, time.monotonic()
        actor = self.group.actors[rank]
        held = self._calls.get(rank)
        if held is None or held[0] is not actor:  # a new incarnation: its first call
            self._calls[rank] = (actor, actor.problem.remote(entry, timeout_s), now)
            return None, 0.0
        _, call, answered = held
        node = str(self.group.infos[rank].get("node", ""))[:12]
        who = f"FFN rank {rank} (pid {entry.pid}, Ray node {node})"
        if not ray.wait([call], timeout=0)[0]:
            if now - answered > FROZEN_TIMEOUT_S:
                return f"{who} gave no answer through Ray for {now - answered:.1f}s", 0.0
            return None, 0.0
        answer: tuple[str | None, float] = (None, 0.0)
        try:
            answer, answered = tuple(ray.get(call)), now  # type: ignore[assignment]
        except ray.exceptions.ActorUnavailableError:
            pass  # unreachable for now: asked again, lost after FROZEN_TIMEOUT_S
        except ray.exceptions.RayActorError as exc:
            del self._calls[rank]
            return f"{who} died: {_one_line(exc)}", 0.0
        self._calls[rank] = (actor, actor.problem.remote(entry, timeout_s), answered)
        return answer


class Supervisor:
    """Failover: a thread of the front-end that replaces FFN ranks that died, stopped, wedged
    or failed serving a request.

    Every ``HEARTBEAT_INTERVAL_S`` it checks each ``up`` rank of the FFN directory as
    ``/health`` does (``rank_problem``: pid, heartbeat, busy-since; ranks on this host), so a
    loss is seen within one interval (died), ``HEARTBEAT_TIMEOUT_S`` plus one (stopped) or
    ``FROZEN_TIMEOUT_S`` plus one (frozen; ``health.py``), and a rank that failed serving a
    request (an exception in its serve loop: the failure count of its stats block) within one
    interval. Then, on a thread of its own for each lost rank (ranks lost together, as on a
    node that held several, are replaced side by side), it marks the rank
    ``recovering``, kills what is left of it (a stopped or wedged process would never answer),
    removes its shared-memory segments, starts a replacement in the same placement bundle
    (``FFNGroup.start_rank``: same experts, loaded again) and publishes it ``up`` with the next
    incarnation, the failover count and the seconds from detection to serving. The attention
    ranks, which noticed the loss themselves, wait for that entry and send the replacement what
    the lost rank had not answered (``transport/endpoint.py``).

    Repeated failures back off: a rank that fails again within ``FAILOVER_STABLE_S`` of its
    replacement extends its streak, and the replacement waits ``restart_delay(streak)``; after
    ``FAILOVER_MAX_STREAK`` failures in a row the rank is published ``failed`` with the reason,
    waiting requests fail at once with it, and ``/health`` says so.
    """

    def __init__(self, group: FFNGroup) -> None:
        self.group = group
        num_ffn = group.spec.num_ffn_ranks
        self._streak = [0] * num_ffn
        self._cause = [""] * num_ffn  # of each rank's last failure: a streak is of one cause
        self._started = [time.monotonic()] * num_ffn
        self._ray = RayWatch(group)
        #: The failovers under way, one thread each: ranks lost together (a node that held
        #: several) are replaced side by side, not one start after the other.
        self._failing: dict[int, threading.Thread] = {}
        _SUPERVISED.update(info["pid"] for info in group.infos if info and "pid" in info)
        ray_errors.apply(supervised_pid)  # Ray's report of a watched rank's death: not printed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-ffn-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising, within ``STOP_WAIT_S``: a replacement being started is given up
        (the thread kills it when its start returns: ``_fail_over``), so that a server stopped
        while its FFN ranks die with it (a signal to its whole process group) exits at once
        instead of waiting out a start that cannot finish."""
        self._stop.set()
        deadline = time.monotonic() + STOP_WAIT_S
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_WAIT_S)
        for thread in list(self._failing.values()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        spec = self.group.spec
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self._failing = {r: t for r, t in self._failing.items() if t.is_alive()}
            for entry in directory.entries(spec.directory, spec.num_ffn_ranks):
                if entry is None or entry.state != directory.UP or entry.rank in self._failing:
                    continue
                problem, failures = rank_problem(entry, spec.timeout_s)
                if problem is None and self._ray.watches(entry.rank):
                    problem, seen = self._ray.problem(entry, spec.timeout_s)
                    failures = max(failures, seen)
                if problem is None and failures:  # its state after an exception is not trusted
                    problem = f"FFN rank {entry.rank} (pid {entry.pid}) failed serving a request"
                if problem is not None and not self._stop.is_set():
                    self._failing[entry.rank] = thread = threading.Thread(
                        target=self._guarded_fail_over,
                        args=(entry, problem),
                        name=f"afd-ffn-failover-{entry.rank}",
                        daemon=True,
                    )
                    thread.start()

    def _guarded_fail_over(self, entry: RankEntry, problem: str) -> None:
        try:
            self._fail_over(entry, problem)
        except Exception:  # noqa: BLE001 - the supervisor must outlive one failover
            logger.exception("AFD: failover of FFN rank %d failed", entry.rank)

    def _publish(self, entry: RankEntry, **changes) -> RankEntry:
        entry = dataclasses.replace(entry, **changes)
        directory.publish(self.group.spec.directory, entry)
        return entry

    def _fail_over(self, entry: RankEntry, problem: str) -> None:
        rank, detected, cause = entry.rank, time.monotonic(), failure_cause(problem)
        stable = detected - self._started[rank] >= FAILOVER_STABLE_S
        streak = 1 if stable or cause != self._cause[rank] else self._streak[rank] + 1
        logger.warning("AFD: %s; replacing it (failure %d in a row)", problem, streak)
        entry = self._publish(entry, state=directory.RECOVERING, reason=problem)
        self._kill(rank, entry)
        lost = problem
        while True:
            if streak > FAILOVER_MAX_STREAK:
                reason = (
                    f"FFN rank {rank} failed {streak - 1} times in a row, each within "
                    f"{FAILOVER_STABLE_S:g}s of its start; the last: {problem}"
                )
                logger.error("AFD: %s; giving up on it: requests fail until a restart", reason)
                self._publish(entry, state=directory.FAILED, reason=reason)
                return
            if self._stop.wait(restart_delay(streak)):
                return
            try:
                self.group.start_rank(rank)
            except Exception as exc:  # noqa: BLE001 - counted as the next failure
                problem = f"FFN rank {rank}: its replacement did not start ({_one_line(exc)})"
                logger.warning("AFD: %s", problem)
                streak += 1
                continue
            if self._stop.is_set():  # the group stopped while it started: nobody stops it
                self._kill(rank, dataclasses.replace(entry, pid=self.group.infos[rank]["pid"]))
                return
            break
        info = self.group.infos[rank]
        _SUPERVISED.add(info["pid"])
        took = time.monotonic() - detected
        self._streak[rank], self._started[rank] = streak, time.monotonic()
        self._cause[rank] = cause
        self._publish(
            entry,
            incarnation=entry.incarnation + 1,
            state=directory.UP,
            address=info["address"],
            host=info["host"],
            pid=info["pid"],
            failovers=entry.failovers + 1,
            recovery_s=entry.recovery_s + took,
        )
        log_rank_up(info)
        logger.warning(
            "AFD: FFN rank %d replaced in %.1fs (failover %d; it had %s)",
            rank,
            took,
            entry.failovers + 1,
            lost.split(") ", 1)[-1],
        )

    def _kill(self, rank: int, entry: RankEntry) -> None:
        """Kill the lost rank's process (stopped and wedged ones too) and reap its segments."""
        import ray

        actor = self.group.actors[rank]
        if actor is not None and ray.is_initialized():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if entry.host != socket.gethostname():
            return
        if pid_alive(entry.pid):
            try:
                os.kill(entry.pid, signal.SIGKILL)  # the pid of the process this group started
            except ProcessLookupError:
                pass
        reaped = reap_once_exited([entry.pid], 5.0)
        if reaped:
            logger.info("AFD: removed %d segment(s) of dead processes from /dev/shm", len(reaped))
