"""Process liveness on this host, shared by the transport, metrics and placement.

A pid alone is not enough: a killed child stays a zombie until reaped (``kill(pid, 0)``
still succeeds), and pids are reused. A process's start time from ``/proc/PID/stat``
identifies it for its whole life.
"""

from __future__ import annotations

import os


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
