"""The slot plane's memories in host RAM (``slot_plane.PlaneMemory``): ``HostWords``, what
every one of them shares (flag lines and step words as int64 memoryviews, plain stores, a
staged host wait with the host's or the device's semantics), and ``HostPlaneMemory``, host
memory shared by the processes of one host (``/dev/shm``). ``nixl.NixlPlaneMemory`` is the
third, across hosts.
"""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import secrets
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker

import torch

from vllm_afd.errors import FFNTimeout, TransportError
from vllm_afd.host import SHM_DIR, map_segment, shm_platform_problem, unlink_segment
from vllm_afd.transport.slot_plane import (
    PLANE_PREFIX,
    WATCH_INTERVAL_S,
    Push,
    Watch,
    _words,
    publish_by_copies,
    publish_each,
    wait_then_gather,
    wait_then_sum,
)
from vllm_afd.transport.slot_plane_failures import RecordedWaits
from vllm_afd.transport.wait import Backoff, WaitPolicy

#: Fresh names a segment's creator tries when a name is taken (planted by someone else).
_CREATE_ATTEMPTS = 8


def create_fresh(stem: str, size: int) -> tuple[str, mmap.mmap]:
    """A new ``/dev/shm`` segment of ``size`` bytes named ``<stem><8 random bytes>`` (mode
    0600, ``host.map_segment``); a taken name (a file someone planted) is skipped, so it cannot
    keep the creator from starting.

    Raises:
        TransportError: when ``_CREATE_ATTEMPTS`` fresh names were all taken.
    """
    taken = []
    for _ in range(_CREATE_ATTEMPTS):
        name = f"{stem}{secrets.token_hex(8)}"
        try:
            return name, map_segment(name, size, create=True)
        except FileExistsError:
            taken.append(name)
    raise TransportError(
        f"could not create a shared-memory segment in {SHM_DIR}: {_CREATE_ATTEMPTS} fresh "
        f"names were all taken ({', '.join(taken[:2])}, ...)"
    )


def await_word(
    word: memoryview,
    want: int,
    deadline: float,
    backoff: Backoff,
    watch: Watch | None = None,
    exact: bool = False,
) -> int | None:
    """Poll the int64 ``word[0]`` until ``|word[0]|`` reaches ``want`` (``exact``: equals it),
    pausing as ``backoff`` stages it and calling ``watch`` every ``WATCH_INTERVAL_S``; returns
    the value read, or ``None`` once ``deadline`` (``time.perf_counter()``) passed."""
    seen = word[0]
    if abs(seen) == want or (not exact and abs(seen) > want):
        return seen
    next_watch = backoff.start + WATCH_INTERVAL_S
    while True:
        now = backoff.pause()
        seen = word[0]
        if abs(seen) == want or (not exact and abs(seen) > want):
            return seen
        if now >= next_watch:
            if watch is not None:
                watch()
            if now >= deadline:
                return None
            next_watch = now + WATCH_INTERVAL_S


class _Aborted(Exception):
    """A device-semantics wait on the host saw ``RecordedWaits.aborted`` set."""


def _unlink(name: str, creator_pid: int) -> None:
    """A segment's creator unlinks it, and tells the resource tracker (not a forked child)."""
    if os.getpid() == creator_pid:
        unlink_segment(name)
        resource_tracker.unregister(f"/{name}", "shared_memory")


class HostWords(RecordedWaits):
    """What every memory in host RAM shares: its flag lines and step words as int64
    memoryviews, ``signal`` and ``publish`` as plain stores, and a staged host wait
    (``wait.Backoff``), with the host's semantics (a wait that fails raises) or, with
    ``device_waits``, the device's (``RecordedWaits``: the CPU stand-in of
    ``CudaPlaneMemory``'s host-side logic). Subclasses supply the buffers."""

    device = torch.device("cpu")
    stores_on_host = True
    push: Push | None = None
    pump: Callable[[], None] | None = None

    def __init__(
        self, timeout_s: float = 30.0, device_waits: bool = False, policy: WaitPolicy | None = None
    ) -> None:
        self.timeout_s, self.device_waits = timeout_s, device_waits
        self.policy = policy or WaitPolicy()
        self.records_waits = device_waits
        self._record_failures(
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), f"{timeout_s} s"
        )
        #: int64 memoryviews of flag lines and step words, by address: a word read or written
        #: through one costs a fraction of a tensor's ``int()`` or ``fill_``, on the hot path.
        self._words: dict[tuple[int, int], memoryview] = {}

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """No operation on host memory is replayed from recorded addresses; the words cached
        of ``old`` go (each holds its mapping)."""
        start = old.data_ptr()
        end = start + old.numel() * old.element_size()
        for key in [key for key in self._words if start <= key[0] < end]:
            del self._words[key]

    def word(self, tensor: torch.Tensor) -> memoryview:
        """``tensor``'s int64 words (a flag line, a flag, a step word), as a memoryview."""
        key = (tensor.data_ptr(), tensor.numel())
        words = self._words.get(key)
        if words is None:
            words = self._words[key] = _words(tensor)
        return words

    def signal(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        failed: bool = False,
        missed: torch.Tensor | None = None,
    ) -> None:
        value = self.word(step)[0] + position + 1
        if failed or (missed is not None and self.word(missed)[0]):
            value = -value
        self.word(flag)[0] = value  # after the payload (x86-64 TSO)

    def publish(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
    ) -> None:
        publish_by_copies(self.signal, dsts, srcs, flag, step, position)

    def publish_all(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
        missed: torch.Tensor | None = None,
    ) -> None:
        publish_each(self.signal, dsts, srcs, flags, steps, positions, missed)

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        missed: torch.Tensor | None = None,
    ) -> int | None:
        want = self.word(step)[0] + position + 1
        if not self.device_waits:
            backoff = Backoff(self.policy, pump=self.pump)
            seen = await_word(self.word(flag), want, backoff.start + self.timeout_s, backoff)
            if seen is None:
                raise FFNTimeout(f"slot plane: {what} did not come within {self.timeout_s} s")
            return seen
        failed = not self._device_wait(flag, want)
        if failed:
            errors = self.word(self.errors)
            errors[0] = max(errors[0], want)
        if missed is not None:
            self.word(missed)[0] = failed
        return None

    def _device_wait(self, flag: torch.Tensor, want: int) -> bool:
        """The device's wait on the host: whether ``flag`` reached ``want`` before the bound,
        the abort word or another value ended it."""
        aborted = self.word(self.aborted)
        if aborted[0] >= want:  # a step whose peer died: its waits end at once
            return False
        backoff = Backoff(self.policy, pump=self.pump)

        def watch() -> None:
            if aborted[0] >= want:
                raise _Aborted

        try:
            deadline = backoff.start + self.timeout_s
            return await_word(self.word(flag), want, deadline, backoff, watch) == want
        except _Aborted:
            return False

    def wait_gather(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
        srcs: Sequence[Sequence[torch.Tensor]],
        dsts: Sequence[torch.Tensor],
        what: Callable[[int], str],
        missed: torch.Tensor | None = None,
    ) -> list[int | None]:
        return wait_then_gather(self.wait, flags, steps, positions, srcs, dsts, what, missed)

    def wait_sum(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        position: int,
        srcs: Sequence[torch.Tensor],
        out: torch.Tensor,
        what: Callable[[int], str],
    ) -> list[int | None]:
        return wait_then_sum(self.wait, flags, steps, position, srcs, out, what)

    def check(self, step: int | None = None) -> None:
        if self.device_waits:
            super().check(step)

    def check_through(self, step: int) -> None:
        if self.device_waits:
            super().check_through(step)


class HostPlaneMemory(HostWords):
    """Host memory shared by the processes of one host: a ``/dev/shm`` segment (mode 0600,
    ``host.create_segment``), plain stores and a staged host wait (``wait.Backoff``). x86-64
    only: a store is published after the stores before it (total store order), and Python has
    no portable barrier to add on weakly ordered CPUs (``host.shm_platform_problem``)."""

    def __init__(
        self,
        timeout_s: float = 30.0,
        prefix: str = PLANE_PREFIX + "data_",
        device_waits: bool = False,
        policy: WaitPolicy | None = None,
    ) -> None:
        problem = shm_platform_problem()
        if problem is not None:
            raise RuntimeError(problem)
        super().__init__(timeout_s, device_waits, policy)
        self.prefix = prefix
        #: Every segment mapped, by the address its tensor starts at.
        self._maps: dict[int, mmap.mmap] = {}
        self._created: list[multiprocessing.util.Finalize] = []

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        name, mm = create_fresh(f"{self.prefix}{os.getpid()}_", nbytes)
        buffer = self._map(mm, nbytes)
        # multiprocessing's finalizer, not weakref's: it also runs when a multiprocessing child
        # (vLLM's engine core, an attention rank owning answer buffers) ends, where atexit does
        # not; and Python's resource tracker unlinks the segment once every process of this
        # family exited, should this one be killed (vLLM force-kills its workers as it stops)
        resource_tracker.register(f"/{name}", "shared_memory")
        unlink = multiprocessing.util.Finalize(self, _unlink, (name, os.getpid()), exitpriority=0)
        self._created.append(unlink)
        return buffer, name

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        return self._map(map_segment(handle, nbytes), nbytes)

    def _map(self, mm: mmap.mmap, nbytes: int) -> torch.Tensor:
        buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        self._maps[buffer.data_ptr()] = mm
        return buffer

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``HostWords.readdress``, and ``old``'s segment is forgotten: it is unmapped once the
        caller's views of it go (a lost FFN rank's request buffer, a restarted front-end's
        answer buffer: its pages would otherwise stay until ``close``, at every failover)."""
        super().readdress(old, new)
        self._maps.pop(old.data_ptr(), None)

    def close(self) -> None:
        """Unmap (a mapping still viewed by a live tensor stays until that goes) and unlink
        the segments this memory created."""
        for finalizer in self._created:
            finalizer()
        self._words.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()


__all__ = ["HostPlaneMemory", "HostWords", "await_word", "create_fresh"]
