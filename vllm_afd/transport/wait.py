"""How an endpoint waits, and the cached views its hot path reuses: shared by every backend.

``WaitPolicy``/``Backoff`` stage every wait: short spin, then yield, then sleep. The first two
stages together are the poll window (``VLLM_AFD_POLL_MS``, 20 ms by default, read through
``vllm_afd.envs``): a waiting endpoint keeps its CPU that long, so that the gaps of a decode step
(an FFN rank waiting for the next layer, an attention rank waiting for its experts) never put it
to sleep, because waking up from a sleep there measurably slows the remote call of a decode step
on the development machine's vCPUs (measured numbers: docs/benchmarks.md). Yielding hands the
CPU to anything else runnable on it, so a shared core still serves its other users; past the
window, an idle endpoint sleeps, in naps of at most 200 us, and a wait past a second (an idle
pool: no request in flight) in naps of 1 ms, so that an idle FFN rank costs about 3% of a core
rather than 10% (measured: docs/benchmarks.md), and only the first request after the idle
second waits up to 1 ms longer. The spin stage is skipped when the
peer last ran on this very CPU (``current_cpu``): there a spin only keeps the peer from running
and makes the round trip several times slower.

Decode-sized messages are dominated by per-call PyTorch overhead (a tensor slice costs as much as
copying a few KiB; measured numbers: docs/benchmarks.md), so ``ViewCache`` caches the ``[:n]``
views of preallocated buffers that the hot paths reuse on every call.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vllm_afd import envs

#: Cached row counts per ``ViewCache`` before the cache is dropped and rebuilt (bounds memory).
_MAX_CACHED_VIEWS = 1024

V = TypeVar("V")


class ViewCache(Generic[V]):
    """Views of preallocated buffers built once per row count ``n`` and reused: ``cache[n]``.

    Args:
        make: ``make(n)`` builds the views for ``n`` rows (views share the buffers' storage).
    """

    __slots__ = ("_make", "_cache")

    def __init__(self, make: Callable[[int], V]) -> None:
        self._make = make
        self._cache: dict[int, V] = {}

    def __getitem__(self, n: int) -> V:
        views = self._cache.get(n)
        if views is None:
            if len(self._cache) >= _MAX_CACHED_VIEWS:
                self._cache.clear()
            views = self._cache[n] = self._make(n)
        return views


def _poll_window_s() -> float:
    """``VLLM_AFD_POLL_MS`` in seconds (raises ``AFDConfigError`` naming it on a bad value)."""
    poll_ms: float = envs.VLLM_AFD_POLL_MS  # ``envs``' module ``__getattr__`` returns Any
    return poll_ms * 1e-3


@dataclass(frozen=True)
class WaitPolicy:
    """Staged waiting (seconds): spin, then yield the CPU, then sleep.

    The slot plane's host waits use all three stages (and skip the spin where the peer last ran
    on the same CPU). ``yield_s`` is where the poll window ends (module docstring); by
    default it is read from ``VLLM_AFD_POLL_MS`` when the policy is made.
    """

    spin_s: float = 50e-6
    yield_s: float = field(default_factory=_poll_window_s)
    sleep_min_s: float = 50e-6
    sleep_max_s: float = 200e-6
    #: A wait this old (an idle endpoint) sleeps up to ``idle_sleep_s`` at a time.
    idle_s: float = 1.0
    idle_sleep_s: float = 1e-3


class Backoff:
    """One wait under a ``WaitPolicy``; call ``pause()`` after every unsuccessful poll.
    ``pump``: called at every pause (a memory whose peers' stores arrive as messages applies
    them there: ``nixl.NixlPlaneMemory.pump``)."""

    __slots__ = ("policy", "start", "sleep_s", "spin_s", "pump")

    def __init__(
        self, policy: WaitPolicy, spin: bool = True, pump: Callable[[], None] | None = None
    ) -> None:
        self.policy = policy
        self.spin_s = policy.spin_s if spin else 0.0
        self.pump = pump
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.sleep_s = self.policy.sleep_min_s

    def set_spin(self, spin: bool) -> None:
        self.spin_s = self.policy.spin_s if spin else 0.0

    def pause(self) -> float:
        """Pause as the stage reached says (spin, yield, then sleep); return
        ``time.perf_counter()``."""
        if self.pump is not None:
            self.pump()
        elapsed = time.perf_counter() - self.start
        if elapsed < self.spin_s:
            pass  # the spin stage, even past a poll window shorter than it
        elif elapsed < self.policy.yield_s:
            os.sched_yield()
        else:
            time.sleep(self.sleep_s)
            policy = self.policy
            longest = policy.sleep_max_s if elapsed < policy.idle_s else policy.idle_sleep_s
            self.sleep_s = min(2 * self.sleep_s, longest)
        return time.perf_counter()


def _cpu_getter() -> Callable[[], int]:
    """``sched_getcpu()`` through libc (cheap enough for every dispatch), or a stub returning
    -1."""
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


#: The CPU the calling thread runs on now (-1 where unknown).
current_cpu = _cpu_getter()
