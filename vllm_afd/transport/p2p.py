"""Helpers shared by the point-to-point transports (shm, tcp): token split, combine, waiting.

The attention side of every point-to-point backend does the same two things around its wire
protocol:

* ``split_by_ffn_rank`` decides, per FFN rank, which rows of the batch must travel there (a token
  goes to every FFN rank that owns at least one of its top-k experts; contiguous placement).
* ``combine_partials`` adds the per-FFN-rank partial answers back into a ``[T, H]`` tensor in the
  original order, FFN ranks in ascending order, starting from zero. That summation order is the
  one ``reference.reference_moe_combine`` uses, so that results can be compared exactly.

``WaitPolicy``/``Backoff`` stage every wait: short spin, then yield, then sleep. The first two
stages together are the poll window (``VLLM_AFD_POLL_MS``, 20 ms by default): a waiting endpoint
keeps its CPU that long, so that the gaps of a decode step (an FFN rank waiting for the next
layer, an attention rank waiting for its experts) never put it to sleep. Sleeping there is not
free on the development machine's vCPUs: in paired `vllm-afd bench` runs with a 2 ms window,
the remote call of a k = 1 step took 0.67 ms instead of 0.42 ms (default tiny model) and
3.60 instead of 3.30 ms (FFN-heavy recipe). Yielding hands the CPU to anything else runnable on
it, so a shared core still serves its other users; past the window, an idle endpoint sleeps and
costs almost nothing.

Decode-sized messages are dominated by per-call PyTorch overhead (a tensor slice costs about a
microsecond on the development machines, as much as copying a few KiB), so ``ViewCache`` (and
``RowViews``, its one-buffer case) caches the ``[:n]`` views of preallocated buffers that the hot
paths reuse on every call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from vllm_afd.config import AFDConfigError, non_negative_number
from vllm_afd.transport.base import DispatchHandle, TransportSpec

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


class RowViews(ViewCache[torch.Tensor]):
    """Cached leading-row views ``buffer[:n]`` of one preallocated ``[max_rows, ...]`` buffer."""

    __slots__ = ()

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__(lambda n: buffer[:n])


#: Environment variable: the poll window of every transport wait, in milliseconds.
POLL_ENV = "VLLM_AFD_POLL_MS"
DEFAULT_POLL_MS = 20.0


def poll_window_s(text: str | None = None) -> float:
    """The poll window in seconds from ``VLLM_AFD_POLL_MS`` (``text``; unset: 20 ms).

    Raises:
        AFDConfigError: naming the variable, for anything but a finite number of ms >= 0.
    """
    if text is None or not text.strip():
        return DEFAULT_POLL_MS * 1e-3
    ms = non_negative_number(text)
    if ms is None:
        raise AFDConfigError(
            f"{POLL_ENV}={text!r}: expected the milliseconds a waiting AFD endpoint polls "
            f"before it sleeps, a number >= 0 (default {DEFAULT_POLL_MS:g})"
        )
    return ms * 1e-3


@dataclass(frozen=True)
class WaitPolicy:
    """Staged waiting (seconds): spin, then yield the CPU, then sleep.

    shm uses all three stages and skips the spin when the peer last ran on the same CPU (there a
    50 us spin turned a 26 us round trip into 125 us on the development machine). tcp polls its
    sockets without blocking through the spin and yield stages, then blocks in ``epoll``.
    ``yield_s`` is where the poll window ends (see the module docstring).
    """

    spin_s: float = 50e-6
    yield_s: float = field(default_factory=lambda: poll_window_s(os.environ.get(POLL_ENV)))
    sleep_min_s: float = 50e-6
    sleep_max_s: float = 200e-6


class Backoff:
    """One wait under a ``WaitPolicy``; call ``pause()`` after every unsuccessful poll."""

    __slots__ = ("policy", "start", "sleep_s", "spin_s")

    def __init__(self, policy: WaitPolicy, spin: bool = True) -> None:
        self.policy = policy
        self.spin_s = policy.spin_s if spin else 0.0
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.sleep_s = self.policy.sleep_min_s

    def set_spin(self, spin: bool) -> None:
        self.spin_s = self.policy.spin_s if spin else 0.0

    def poll_pause(self) -> bool:
        """Pause as the spin or yield stage says; ``False`` once both are over."""
        elapsed = time.perf_counter() - self.start
        if elapsed < self.spin_s:
            return True
        if elapsed < self.policy.yield_s:
            os.sched_yield()
            return True
        return False

    def pause(self) -> float:
        """Pause as the stage reached says (then sleeping); return ``time.perf_counter()``."""
        if not self.poll_pause():
            time.sleep(self.sleep_s)
            self.sleep_s = min(2 * self.sleep_s, self.policy.sleep_max_s)
        return time.perf_counter()


def check_dispatch_args(spec: TransportSpec, x: torch.Tensor, topk_ids: torch.Tensor) -> int:
    """Validate ``dispatch`` inputs cheaply and return the number of tokens ``T``.

    Args:
        x: ``[T, H]`` hidden states, ``spec.dtype``.
        topk_ids: ``[T, K]`` global expert ids.
    Raises:
        ValueError: on a shape or dtype that does not match ``spec``.
    """
    num_tokens, hidden = x.shape
    if num_tokens > spec.max_tokens:
        raise ValueError(f"dispatch of {num_tokens} tokens exceeds max_tokens={spec.max_tokens}")
    if hidden != spec.hidden_size or x.dtype != spec.dtype:
        raise ValueError(
            f"x must be [T, {spec.hidden_size}] {spec.dtype}, got {list(x.shape)} {x.dtype}"
        )
    if topk_ids.shape != (num_tokens, spec.top_k):
        raise ValueError(f"topk_ids must be [{num_tokens}, {spec.top_k}], got {topk_ids.shape}")
    return num_tokens


def split_by_ffn_rank(
    spec: TransportSpec, topk_ids: torch.Tensor, all_rows: torch.Tensor | None = None
) -> dict[int, torch.Tensor]:
    """Rows of the batch each FFN rank must receive.

    Args:
        topk_ids: ``[T, K]`` integer global expert ids.
        all_rows: optional ``[T]`` int64 ``arange(T)`` to reuse when one FFN rank gets every row.
    Returns:
        ``{ffn_rank: [N_f] int64 row indices, ascending}`` for the FFN ranks with ``N_f > 0``,
        in ascending rank order. Empty for ``T == 0``.
    """
    num_tokens = topk_ids.shape[0]
    if num_tokens == 0:
        return {}
    if spec.num_ffn_ranks == 1:
        rows = torch.arange(num_tokens) if all_rows is None else all_rows
        return {0: rows}
    ranks = spec.ffn_rank_of(topk_ids).long()
    hit = torch.zeros(num_tokens, spec.num_ffn_ranks, dtype=torch.bool)
    hit.scatter_(1, ranks, True)
    split = {}
    for rank, column in enumerate(hit.t()):
        rows = column.nonzero().squeeze(1)
        if rows.numel():
            split[rank] = rows
    return split


def check_attention_rank(spec: TransportSpec, rank: int) -> None:
    if not 0 <= rank < spec.num_attention_ranks:
        raise ValueError(f"attention rank {rank} outside [0, {spec.num_attention_ranks})")


def pop_free_slot(free: list[int], spec: TransportSpec) -> int:
    """Take a free slot for a new dispatch; at most ``spec.num_slots`` may be outstanding."""
    if not free:
        raise RuntimeError(
            f"more than num_slots={spec.num_slots} dispatches outstanding: "
            "combine one before dispatching again"
        )
    return free.pop()


def take_handle_slot(handle: DispatchHandle) -> int:
    """The slot a point-to-point handle holds; a handle can be combined only once."""
    slot = handle.state.pop("slot", None)
    if slot is None:
        raise ValueError(f"handle of layer {handle.layer} was already combined")
    return slot


def combine_partials(handle: DispatchHandle, partials: dict[int, torch.Tensor]) -> torch.Tensor:
    """Sum per-FFN-rank partial answers into the original token order.

    Args:
        handle: the dispatch handle; ``handle.token_index[f]`` are the rows sent to rank ``f``.
        partials: ``{f: [N_f, H]}`` answers, same dtype as ``handle.dtype``; may be views of
            transport buffers (they are read, never kept).
    Returns:
        ``[T, H]`` ``handle.dtype``: row ``t`` is ``0 + sum_f partial_f[t]`` over ranks in
        ascending order. Rows that no rank answered are zero.
    """
    num_tokens = handle.num_tokens
    out: torch.Tensor | None = None
    for rank, rows in handle.token_index.items():
        part = partials[rank]
        if out is None and rows.numel() == num_tokens:
            out = part.clone()  # 0 + part == part exactly: skip the zero fill
            continue
        if out is None:
            out = torch.zeros(num_tokens, handle.hidden_size, dtype=handle.dtype)
        out.index_add_(0, rows, part)
    if out is None:
        out = torch.zeros(num_tokens, handle.hidden_size, dtype=handle.dtype)
    return out


def as_wire_tensors(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the dispatch inputs in wire format (a no-op when they already are).

    Returns:
        ``x`` contiguous; ``topk_ids`` ``[T, K]`` int32 contiguous; ``topk_weights`` ``[T, K]``
        float32 contiguous.
    """
    if topk_ids.dtype != torch.int32:
        topk_ids = topk_ids.to(torch.int32)
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.to(torch.float32)
    return x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
