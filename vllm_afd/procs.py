"""Process liveness and CPU binding on this host, shared by the transport, metrics, placement
and the benchmarks.

A pid alone is not enough: a killed child stays a zombie until reaped (``kill(pid, 0)``
still succeeds), and pids are reused. A process's start time from ``/proc/PID/stat``
identifies it for its whole life.

CPU binding: ``os.sched_setaffinity(0, ...)`` binds only the calling thread (and the threads it
starts later); a process that already runs helper threads (a Ray worker) is bound thread by
thread (``bind_process``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; ``None`` if gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int) -> bool:
    return process_start_time(pid) is not None


def bind_process(cpus: Iterable[int]) -> None:
    """Bind every thread of this process, and the threads they start later, to ``cpus``."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile
