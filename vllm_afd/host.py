"""This host's processes, CPUs and ``/dev/shm`` segments, shared by the transport, metrics,
placement and the benchmarks.

A pid alone is not enough: a killed child stays a zombie until reaped (``kill(pid, 0)``
still succeeds), and pids are reused. A process's start time from ``/proc/PID/stat``
identifies it for its whole life.

CPU binding: ``os.sched_setaffinity(0, ...)`` binds only the calling thread (and the threads it
starts later); a process that already runs helper threads (a Ray worker) is bound thread by
thread (``bind_process``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Sequence

SHM_DIR = "/dev/shm"


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


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if unknown): pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def unlink_segment(name: str) -> bool:
    """Remove ``/dev/shm/<name>``; ``False`` if it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def read_segment_header(name: str, words: int) -> Sequence[int] | None:
    """The first ``words`` int64 words of ``/dev/shm/<name>``, or ``None`` if unreadable/short."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as fh:
            raw = fh.read(8 * words)
    except OSError:
        return None
    if len(raw) < 8 * words:
        return None
    return memoryview(raw).cast("q")


def reap_segments(
    prefix: str, words: int, is_stale: Callable[[str, Sequence[int]], bool]
) -> list[str]:
    """Unlink the segments named ``<prefix>...`` whose header (``words`` int64 words) makes
    ``is_stale(name, header)`` true; returns the names unlinked."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    reaped = []
    for name in names:
        if not name.startswith(prefix):
            continue
        header = read_segment_header(name, words)
        if header is not None and is_stale(name, header) and unlink_segment(name):
            reaped.append(name)
    return reaped


def free_port() -> int:
    """A TCP port free on the loopback interface now (for gloo rendezvous, test servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
