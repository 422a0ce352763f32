"""This host's processes, CPUs and ``/dev/shm`` segments, shared by the transport, metrics,
placement and the benchmarks.

A pid alone is not enough: a killed child stays a zombie until reaped (``kill(pid, 0)``
still succeeds), and pids are reused. A process's start time from ``/proc/PID/stat``
identifies it for its whole life.

CPU binding: ``os.sched_setaffinity(0, ...)`` binds only the calling thread (and the threads it
starts later); a process that already runs helper threads (a Ray worker) is bound thread by
thread (``bind_process``).

Files other users can plant. ``/dev/shm`` (and ``/tmp``) are shared by every user of the host:
another user can create a file under a name we are about to use, or a symbolic link to one of
ours. Every file of the product there is therefore opened with ``O_NOFOLLOW`` (and
``O_NONBLOCK`` when only read, so a planted FIFO cannot block the opener), created with
``O_EXCL`` and mode 0600, and checked after opening (``check_owned``: a regular file, owned by
this user, no access for group or others) before a byte of it is trusted. Secrets (the Ray
token, the admin token) live in a private directory (``private_dir``:
``mkdtemp``, mode 0700) in files of mode 0600 (``write_private_file``, ``read_private_file``).
"""

from __future__ import annotations

import errno
import ipaddress
import mmap
import os
import platform
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
#: Stores become visible to other CPUs in program order here (x86-64 total store order). The
#: shm transport relies on it and refuses to run elsewhere (aarch64 is weakly ordered).
STORE_ORDER_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def shm_platform_problem() -> str | None:
    """Why this machine cannot run the shm transport (``None``: it can): the one check behind
    ``--afd-transport``'s start-up refusal and the shm endpoints' own."""
    if STORE_ORDER_TSO:
        return None
    return (
        f"the shm transport relies on x86-64 store ordering and this CPU ({platform.machine()}) "
        "is weakly ordered (messages could be read torn); use --afd-transport nixl"
    )


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFileError(PermissionError):
    """A file the product was about to trust is not its own (planted by another user, a link,
    not a regular file, or readable by others). The message names the file and what is wrong."""


def check_owned(fd: int, path: str, exact_mode: int | None = 0o600) -> os.stat_result:
    """``fstat(fd)`` if ``fd`` (opened from ``path``) is a regular file owned by this user with
    no access for group or others (and, if given, exactly ``exact_mode``); else
    ``UnsafeFileError``."""
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif mode & 0o077 or (exact_mode is not None and mode != exact_mode):
        want = f"{exact_mode:#o}" if exact_mode is not None else "no group/other access"
        problem = f"mode {mode:#o}, expected {want}"
    if problem is not None:
        raise UnsafeFileError(f"refusing {path}: {problem} (planted by another user?)")
    return info


#: Name prefix of a deployment's private directory; the creator's pid follows it.
PRIVATE_PREFIX = "vllm_afd_dep_"


def private_dir(prefix: str = PRIVATE_PREFIX) -> str:
    """A new directory only this user can enter (``mkdtemp``: mode 0700, unguessable name),
    named ``<prefix><pid>_<random>`` so that ``reap_private_dirs`` can tell when its creator
    is gone."""
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_")


def reap_private_dirs(prefix: str = PRIVATE_PREFIX) -> tuple[list[str], list[str]]:
    """Remove this user's private directories (``private_dir``) whose creator died without
    removing it (a SIGKILLed front-end leaves its Ray token, FFN directory and
    leases), and the multiprocessing segments their ledgers name (``reclaim_ledger``); returns
    the directories' paths and the segments' names. A directory of a live pid (or another
    user's, or one whose name carries no pid) is left alone."""
    root, removed, segments = tempfile.gettempdir(), [], []
    for name in os.listdir(root):
        pid = name[len(prefix) :].split("_", 1)[0] if name.startswith(prefix) else ""
        path = os.path.join(root, name)
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            segments += reclaim_ledger(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed, segments


#: Python's multiprocessing names its ``/dev/shm`` files so: ``SharedMemory`` segments (vLLM's
#: message queues between API server, engine cores and workers) and named semaphores (its
#: locks). Its resource tracker unlinks them when their processes die, unless it is killed
#: with them (a SIGKILL of the whole process group or control group): then a deployment's
#: ledger of them (``LEDGER``) lets the next start reclaim them (``reap_private_dirs``).
MP_SEGMENT_PREFIXES = ("psm_", "sem.mp-")
#: The file of a private directory that lists the multiprocessing segments of its deployment,
#: one name a line (``placement.health.SegmentLedger`` writes it).
LEDGER = "segments"
_MP_NAME = re.compile(r"(?:psm_|sem\.mp-)[A-Za-z0-9_-]{1,64}")


def mapped_segments(pids: Iterable[int], prefixes: Sequence[str]) -> set[str]:
    """The names of the ``/dev/shm`` files starting with one of ``prefixes`` that the processes
    ``pids`` map (``/proc/PID/maps``; a process that ended meanwhile is skipped). A file is
    matched by its inode, not the name the map shows: glibc's ``sem_open`` maps a temporary
    file that it then links under the semaphore's name and unlinks."""
    inodes: set[int] = set()
    root = SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(root):
                        inodes.add(int(fields[4]))
        except (OSError, ValueError):
            continue
    found = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if entry.name.startswith(tuple(prefixes)):
                try:
                    if entry.inode() in inodes:
                        found.add(entry.name)
                except OSError:
                    continue
    return found


def live_pids() -> list[int]:
    """Every process of this host's pid namespace that ``/proc`` lists."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def reclaim_ledger(directory: str) -> list[str]:
    """Unlink the multiprocessing segments that ``directory``'s ledger (``LEDGER``) names and
    that no live process maps and that are this user's own; returns their names. Only names of
    the multiprocessing form are taken (a ledger line is never a path)."""
    try:
        text = read_private_file(os.path.join(directory, LEDGER), max_bytes=1 << 20)
    except OSError:
        return []
    listed = {n for n in text.decode(errors="replace").split() if _MP_NAME.fullmatch(n)}
    listed = {n for n in listed if _own_file(os.path.join(SHM_DIR, n))}
    if not listed:
        return []
    listed -= mapped_segments(live_pids(), MP_SEGMENT_PREFIXES)
    return sorted(n for n in listed if unlink_segment(n))


def _own_file(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def remove_private_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def write_private_file(path: str, data: bytes) -> str:
    """Create ``path`` (must not exist; never through a link) with mode 0600 holding ``data``."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


def read_private_file(path: str, max_bytes: int = 4096) -> bytes:
    """The content of ``path`` if it is this user's own regular file, closed to group and
    others (0600 or 0400), at most ``max_bytes`` long; else ``UnsafeFileError`` (``OSError``
    if it cannot be opened)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        info = check_owned(fd, path, exact_mode=None)
        if info.st_size > max_bytes:
            raise UnsafeFileError(f"refusing {path}: {info.st_size} bytes, at most {max_bytes}")
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def open_owned_segment(name: str, writable: bool = False) -> int:
    """Open ``/dev/shm/<name>`` without following links and check it is ours (mode 0600);
    returns the descriptor. Raises ``FileNotFoundError`` or ``UnsafeFileError``."""
    path = os.path.join(SHM_DIR, name)
    flags = (os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC) if writable else _READ_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UnsafeFileError(f"refusing {path}: {exc}") from None  # ELOOP: a link
    try:
        check_owned(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_segment(name: str, size: int) -> int:
    """Create ``/dev/shm/<name>`` (``O_EXCL``, never through a link, mode 0600) of ``size``
    bytes, its pages allocated now; returns the descriptor. ``FileExistsError`` if the name
    is taken; ``OSError`` (``ENOSPC``) saying how to give ``/dev/shm`` room where it has none:
    a sparse segment would fail later, as a SIGBUS of whichever process first writes a page
    that finds no room (a container's default ``/dev/shm`` is 64 MiB)."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except BaseException as exc:
        os.close(fd)
        unlink_segment(name)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            free = shutil.disk_usage(SHM_DIR).free
            raise OSError(
                errno.ENOSPC,
                f"no room in {SHM_DIR} for a segment of {size / 2**20:.1f} MiB ({name}; "
                f"{free / 2**20:.1f} MiB free): give it more (docker run --shm-size, a "
                "Kubernetes emptyDir of medium Memory mounted there)",
            ) from None
        raise
    return fd


def map_segment(name: str, size: int, create: bool = False) -> mmap.mmap:
    """``/dev/shm/<name>`` mapped read-write: a new one of ``size`` bytes (``create_segment``;
    ``FileExistsError`` if the name is taken), or an existing one of ours
    (``open_owned_segment``) that must be ``size`` bytes: else ``ValueError`` naming both sizes
    (its creator laid it out for another ``TransportSpec``)."""
    fd = create_segment(name, size) if create else open_owned_segment(name, writable=True)
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise ValueError(
                f"segment {name!r} is {found} bytes, the spec needs {size}: attention and FFN "
                "ranks disagree on the TransportSpec"
            )
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (state first); ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; ``None`` if gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int) -> bool:
    return process_start_time(pid) is not None


@dataclass(frozen=True)
class Creator:
    """The process that made a shared segment, as the peers that wait on it watch it: its pid
    and start time (``None``: it lives in another pid namespace, where this one's pids mean
    nothing, so it cannot be checked from here)."""

    pid: int
    start: int | None

    @classmethod
    def watch(cls, pid: int, pid_ns: int) -> Creator | None:
        """The creator ``pid`` of pid namespace ``pid_ns``; ``None`` if it is dead already."""
        if pid_ns != pid_namespace():
            return cls(pid, None)
        start = process_start_time(pid)
        return None if start is None else cls(pid, start)

    def died(self) -> bool:
        """It is gone (or its pid now names another process); never, where not checkable."""
        return self.start is not None and process_start_time(self.pid) != self.start


def session_pids(sid: int) -> list[int]:
    """Pids of the live processes of session ``sid`` (from /proc; zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != sid:
                continue
            with open(f"/proc/{pid}/stat") as fields:
                if fields.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except (OSError, IndexError):
            continue
        found.append(pid)
    return found


def process_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger: state ``T`` or ``t`` in ``/proc``)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in (b"T", b"t")


def bind_process(cpus: Iterable[int]) -> None:
    """Bind every thread of this process, and the threads they start later, to ``cpus``."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile


def cpu_stolen_times() -> tuple[int, int]:
    """This host's CPU time (all CPUs, in ``/proc/stat`` ticks) stolen by its hypervisor, and
    the whole, since boot: ``(stolen, total)``; ``(0, 0)`` where ``/proc/stat`` says neither."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return 0, 0
    if len(fields) < 9 or fields[0] != b"cpu":
        return 0, 0
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


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


def unlink_if_creator(name: str, creator_pid: int) -> None:
    """A creator's finalizer for its segment: a forked child inherits it and must not unlink."""
    if os.getpid() == creator_pid:
        unlink_segment(name)


def read_segment_header(name: str, words: int) -> Sequence[int] | None:
    """The first ``words`` int64 words of ``/dev/shm/<name>``, or ``None`` if unreadable, short
    or not this user's own file (``open_owned_segment``: another user's file is never read)."""
    try:
        fd = open_owned_segment(name)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8 * words, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < 8 * words:
        return None
    return memoryview(raw).cast("q")


def reap_segments(
    prefix: str, words: int, is_stale: Callable[[str, Sequence[int]], bool]
) -> list[str]:
    """Unlink the segments named ``<prefix>...`` whose header (``words`` int64 words) makes
    ``is_stale(name, header)`` true; returns the names unlinked. Only this user's own segments
    are looked at (``read_segment_header``)."""
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


def is_loopback(ip: str) -> bool:
    """Whether ``ip`` (an IPv4 or IPv6 address, a zone suffix or an IPv4-mapped form allowed)
    is a loopback address; a host name is not."""
    try:
        address = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def free_port() -> int:
    """A TCP port free on the loopback interface now (for gloo rendezvous, test servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
