"""The slot plane: the shm backend's slot protocol as stream-ordered operations, written once and
run on two memories (issue 19; docs/architecture.md, "The slot plane").

Why. On GPUs the A:F hop must move each token once per FFN rank (not once per expert, as
DeepEP's low-latency kernels with virtual experts do), keep its buffers to the slots (not the
gigabytes of NVSHMEM those kernels take on every GPU) and make no host synchronization on the
token path, so that both sides' steps can be captured as CUDA graphs
(../shared/design/reviews/gpu-path-2.md). The shm backend's layout already has that shape; what
it lacks on a GPU is a way to publish and wait that is not a host spin. So the layout and the
protocol live here, expressed in a handful of operations a device executes in stream order, and
a ``PlaneMemory`` supplies only the memory and the publish/wait primitive:

* ``HostPlaneMemory`` (this file): a ``/dev/shm`` segment, plain stores (x86-64 total store
  order, as in shm.py) and a host spin. Every CI run exercises the protocol through it.
* ``CudaPlaneMemory`` (``slot_plane_cuda.py``): device memory shared by CUDA IPC, a Triton store
  with release semantics and a Triton spin-wait with acquire semantics at system scope; every
  operation is a kernel on the current stream, so CUDA graphs capture the whole exchange.

No library does this: DeepEP's kernels are the wrong tool for the asymmetric hop (above); vLLM's
custom all-reduce has the pattern (IPC buffers, device flags) but only as an all-reduce; PyTorch
symmetric memory's ``put_signal``/``wait_signal`` need every rank to allocate the same buffer
through a rendezvous of one process group. The CUDA layer here uses PyTorch and Triton only.

Layout. One buffer per FFN rank, owned by it, mapped by every attention rank::

    flags          int64, one 128-byte line each: request flag and response flag of every
                   (attention rank a, slot s)
    slot (s, a)    x [T, H] spec.dtype | topk_ids [T, K] int32 | topk_weights [T, K] float32 |
                   out [T, H] spec.dtype       (T = max_tokens, each part 128-byte aligned)

Protocol. Both sides count every use of a channel (attention rank a, FFN rank f, slot s) in a
device-resident counter of their own, so a graph replay advances them without Python:

    attention, dispatch(s):  c[f, s] += 1; copy x, ids, weights into f's slot (s, a);
                             signal(request flag (a, s) of f, c[f, s])            for every f
    FFN f, serve(s):         c'[a, s] += 1; wait(request flag (a, s), c'[a, s])   for every a;
                             one forward over all attention ranks' rows; answers into out;
                             signal(response flag (a, s), c'[a, s])               for every a
    attention, combine(h):   wait(response flag (a, s) of f, c[f, s]); sum the f answers

A signal is a store ordered after the payload (release); a wait returns once the flag equals the
counter (acquire), so the reader never sees a half-written payload, and a flag never moves
backwards, so a replay cannot be fooled by the previous use. Each slot is one microbatch's
alone; slots of different microbatches never share a flag, so any interleaving of two
microbatches' dispatches and combines (vLLM's DBO runs D0, D1, C0, D0', C1, ...) is served as
long as the FFN side serves each slot's uses in order (layer by layer, the microbatches of a
layer in turn).

Fixed shapes. Every dispatch sends all its ``n`` rows to every FFN rank (no host-side filtering
by expert, which needs the routing on the host), so traffic per layer is ``n x H x F`` each way,
against ``n x H x (FFN ranks a token touches)`` for the shm backend's filtered sends: equal at
F = 1 (7:1), 4 against 3.6 for Qwen3-235B at 28 + 4. The FFN side masks the experts it does not
hold. The row counts a step sends (``rows``) come from the announced step schedule, once per
step, as the CUDA graph to replay does.

Failure. A host wait raises ``FFNTimeout`` naming the flag after ``timeout_s``. A device wait
gives up after its spin budget, records it in a device word and lets the stream go on (a kernel
cannot raise); ``check()`` reads that word on the host (the step's end, where vLLM synchronizes
anyway) and raises. Recovery (a new FFN rank, new buffer and counters from zero) is the shm
backend's failover, not yet wired to this plane.

Not yet: this plane is not a registered backend; the FFN executor and the attention-side hook do
not drive it (the next step of issue 19). ``vllm_afd.testing.slot_plane_check`` runs it between
two processes: on CPU through host memory, on a GPU through device memory with graph capture.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_afd.host import (
    create_segment,
    open_owned_segment,
    shm_platform_problem,
    unlink_if_creator,
)
from vllm_afd.transport.base import FFNTimeout, TransportSpec

#: Alignment of flags and payload parts: a GPU's L2 line (128 bytes), two x86 cache lines.
LINE = 128
_FLAG_WORDS = LINE // 8
#: ``forward(x [N, H], topk_ids [N, K] int32, topk_weights [N, K] float32, out [N, H]) -> out``,
#: already weighted and summed over the FFN rank's experts (``transport.reference.FFNForward``).
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _align(n: int, to: int = LINE) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class PlaneLayout:
    """Byte layout of one FFN rank's buffer (module docstring)."""

    num_attention_ranks: int
    num_slots: int
    max_tokens: int
    hidden: int
    top_k: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_attention_ranks", "num_slots", "max_tokens", "hidden", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"PlaneLayout.{name} must be at least 1, got {getattr(self, name)}"
                )

    @classmethod
    def of(cls, spec: TransportSpec) -> PlaneLayout:
        return cls(
            spec.num_attention_ranks,
            spec.num_slots,
            spec.max_tokens,
            spec.hidden_size,
            spec.top_k,
            spec.dtype,
        )

    @property
    def x_bytes(self) -> int:
        return _align(self.max_tokens * self.hidden * self.dtype.itemsize)

    @property
    def routing_bytes(self) -> int:
        return _align(self.max_tokens * self.top_k * 4)

    @property
    def slot_bytes(self) -> int:
        return 2 * self.x_bytes + 2 * self.routing_bytes

    @property
    def flags_bytes(self) -> int:
        return 2 * self.num_attention_ranks * self.num_slots * LINE

    @property
    def total_bytes(self) -> int:
        return self.flags_bytes + self.num_attention_ranks * self.num_slots * self.slot_bytes

    def flag_word(self, attention_rank: int, slot: int, response: bool) -> int:
        """Index of a flag among the buffer's int64 words."""
        channel = attention_rank * self.num_slots + slot
        return (2 * channel + int(response)) * _FLAG_WORDS

    def slot_offset(self, attention_rank: int, slot: int) -> int:
        """Byte offset of slot (``slot``, ``attention_rank``): a slot's attention ranks are
        adjacent, so one microbatch's requests lie together."""
        return (
            self.flags_bytes + (slot * self.num_attention_ranks + attention_rank) * self.slot_bytes
        )


class SlotViews:
    """One slot's flags (one-element int64 views) and payload (``[T, ...]`` views)."""

    __slots__ = ("request", "response", "x", "ids", "weights", "out")

    def __init__(self, buffer: torch.Tensor, layout: PlaneLayout, attention_rank: int, slot: int):
        words = buffer[: layout.flags_bytes].view(torch.int64)
        req = layout.flag_word(attention_rank, slot, response=False)
        resp = layout.flag_word(attention_rank, slot, response=True)
        self.request, self.response = words[req : req + 1], words[resp : resp + 1]
        at = layout.slot_offset(attention_rank, slot)
        rows = layout.max_tokens

        def part(dtype: torch.dtype, cols: int, nbytes: int) -> torch.Tensor:
            nonlocal at
            view = buffer[at : at + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)
            at += nbytes
            return view

        self.x = part(layout.dtype, layout.hidden, layout.x_bytes)
        self.ids = part(torch.int32, layout.top_k, layout.routing_bytes)
        self.weights = part(torch.float32, layout.top_k, layout.routing_bytes)
        self.out = part(layout.dtype, layout.hidden, layout.x_bytes)


class PlaneMemory(Protocol):
    """What differs per device: where buffers live and how a flag is published and awaited.
    ``signal`` and ``wait`` are stream-ordered on devices with streams (they return at once and
    run in order with the copies around them); on the host they run when called."""

    device: torch.device

    def create(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A zeroed ``uint8`` buffer of ``nbytes`` and a picklable handle peers attach it by."""

    def attach(self, handle: Any, nbytes: int) -> torch.Tensor:
        """The buffer ``handle`` names, mapped into this process."""

    def signal(self, flag: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``value`` (one int64) into ``flag`` after every earlier write (release)."""

    def wait(self, flag: torch.Tensor, value: torch.Tensor, what: str) -> None:
        """Until ``flag == value`` (acquire), bounded; ``what`` names the flag in the error."""

    def check(self) -> None:
        """Raise if a wait gave up (devices record it; the host raises in ``wait``)."""


@dataclass(frozen=True)
class PlaneHandle:
    """What ``dispatch`` returns and ``combine`` consumes: the slot and the rows sent."""

    slot: int
    num_tokens: int


class AttentionPlane:
    """Attention rank ``rank``'s end: maps every FFN rank's buffer (``handles``, in FFN rank
    order), dispatches into its own slots there and combines the answers."""

    def __init__(
        self, layout: PlaneLayout, memory: PlaneMemory, rank: int, handles: Sequence[Any]
    ) -> None:
        self.layout, self.memory, self.rank = layout, memory, rank
        self.buffers = [memory.attach(h, layout.total_bytes) for h in handles]
        self.slots = [
            [SlotViews(b, layout, rank, s) for s in range(layout.num_slots)] for b in self.buffers
        ]
        #: Uses of each (FFN rank, slot) channel, on the device: graph replays advance them.
        self.counters = torch.zeros(
            len(self.buffers), layout.num_slots, dtype=torch.int64, device=memory.device
        )

    def dispatch(
        self, slot: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> PlaneHandle:
        """Send ``x`` ``[N, H]`` (``layout.dtype``), ``topk_ids`` ``[N, K]`` (integer, global
        expert ids) and ``topk_weights`` ``[N, K]`` (floating) through ``slot`` to every FFN
        rank; returns at once on devices with streams."""
        n = x.shape[0]
        if not 0 < n <= self.layout.max_tokens:
            raise ValueError(f"dispatch of {n} tokens: allowed 1..{self.layout.max_tokens}")
        self.counters[:, slot] += 1
        views = [v[slot] for v in self.slots]
        dsts = [t for v in views for t in (v.x[:n], v.ids[:n], v.weights[:n])]
        torch._foreach_copy_(dsts, [x, topk_ids, topk_weights] * len(views))
        for f, v in enumerate(views):
            self.memory.signal(v.request, self.counters[f, slot : slot + 1])
        return PlaneHandle(slot, n)

    def combine(self, handle: PlaneHandle) -> torch.Tensor:
        """``[N, H]`` (``layout.dtype``): the FFN ranks' answers to ``handle``'s dispatch, summed
        in FFN rank order. A new tensor: the slot may be reused at once."""
        hook, receive = self.combine_hook(handle)
        hook()
        return receive()

    def combine_hook(
        self, handle: PlaneHandle
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """``combine`` in two parts, as DeepEP's ``return_recv_hook=True`` and vLLM's async
        finalize split it: ``hook()`` waits for every FFN rank's answer (on devices with
        streams, it queues the waits), ``receive()`` then sums them. Under vLLM's DBO the hook
        goes to ``dbo_register_recv_hook`` and the other microbatch runs it before its next
        send; ``receive`` runs after the yield."""
        slot, n = handle.slot, handle.num_tokens
        views = [v[slot] for v in self.slots]

        def hook() -> None:
            for f, view in enumerate(views):
                self.memory.wait(
                    view.response,
                    self.counters[f, slot : slot + 1],
                    f"response of FFN rank {f} to attention rank {self.rank}, slot {slot}",
                )

        def receive() -> torch.Tensor:
            total = views[0].out[:n].clone()
            for view in views[1:]:
                total += view.out[:n]
            return total

        return hook, receive


class FFNPlane:
    """FFN rank ``rank``'s end: owns the buffer every attention rank writes into."""

    def __init__(self, layout: PlaneLayout, memory: PlaneMemory, rank: int) -> None:
        self.layout, self.memory, self.rank = layout, memory, rank
        self.buffer, self.handle = memory.create(layout.total_bytes)
        attention = range(layout.num_attention_ranks)
        self.slots = [
            [SlotViews(self.buffer, layout, a, s) for a in attention]
            for s in range(layout.num_slots)
        ]
        self.counters = torch.zeros(
            layout.num_attention_ranks, layout.num_slots, dtype=torch.int64, device=memory.device
        )
        rows = layout.num_attention_ranks * layout.max_tokens
        #: Every attention rank's rows gathered for one forward (unused with one attention rank).
        self._gathered = (
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.int32, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.float32, device=memory.device),
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
        )

    def serve(self, slot: int, rows: Sequence[int], forward: Forward) -> None:
        """Serve one use of ``slot``: wait for every attention rank's request (``rows[a]`` tokens
        from attention rank ``a``, from the step schedule), run ``forward`` once over all of
        them and publish each answer."""
        if len(rows) != self.layout.num_attention_ranks:
            raise ValueError(f"rows: one count per attention rank, got {len(rows)}")
        views = self.slots[slot]
        self.counters[:, slot] += 1
        for a, v in enumerate(views):
            self.memory.wait(
                v.request,
                self.counters[a, slot : slot + 1],
                f"request of attention rank {a} to FFN rank {self.rank}, slot {slot}",
            )
        if len(views) == 1:
            v, n = views[0], rows[0]
            forward(v.x[:n], v.ids[:n], v.weights[:n], v.out[:n])
        else:
            self._serve_gathered(views, rows, forward)
        for a, v in enumerate(views):
            self.memory.signal(v.response, self.counters[a, slot : slot + 1])

    def _serve_gathered(self, views: list[SlotViews], rows: Sequence[int], forward: Forward):
        """One forward over the attention ranks' rows: gathered by one ``cat`` per part, the
        answers scattered back by one ``_foreach_copy_``."""
        total = sum(rows)
        x, ids, weights, out = (t[:total] for t in self._gathered)
        torch.cat([v.x[:n] for v, n in zip(views, rows, strict=True)], out=x)
        torch.cat([v.ids[:n] for v, n in zip(views, rows, strict=True)], out=ids)
        torch.cat([v.weights[:n] for v, n in zip(views, rows, strict=True)], out=weights)
        forward(x, ids, weights, out)
        torch._foreach_copy_(
            [v.out[:n] for v, n in zip(views, rows, strict=True)], list(out.split(rows))
        )


class HostPlaneMemory:
    """Host memory: a ``/dev/shm`` segment (mode 0600, ``host.create_segment``), plain stores
    and a host spin. x86-64 only, for the reason shm.py gives (total store order)."""

    device = torch.device("cpu")

    def __init__(self, timeout_s: float = 30.0, prefix: str = "vllm_afd_plane_") -> None:
        problem = shm_platform_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.timeout_s, self.prefix = timeout_s, prefix
        self._maps: list[mmap.mmap] = []

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        name = f"{self.prefix}{os.getpid()}_{secrets.token_hex(8)}"
        fd = create_segment(name, nbytes)
        weakref.finalize(self, unlink_if_creator, name, os.getpid())
        return self._map(fd, nbytes), name

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        fd = open_owned_segment(handle, writable=True)
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise ValueError(f"plane buffer {handle!r} is {size} bytes, the layout needs {nbytes}")
        return self._map(fd, nbytes)

    def _map(self, fd: int, nbytes: int) -> torch.Tensor:
        try:
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)

    def signal(self, flag: torch.Tensor, value: torch.Tensor) -> None:
        flag.copy_(value)  # after the payload's stores (x86-64 TSO)

    def wait(self, flag: torch.Tensor, value: torch.Tensor, what: str) -> None:
        want = int(value)
        if int(flag) == want:
            return
        start = time.perf_counter()
        deadline = start + self.timeout_s
        while int(flag) != want:
            now = time.perf_counter()
            if now > deadline:
                raise FFNTimeout(f"slot plane: {what} did not come within {self.timeout_s} s")
            if now - start > 1e-3:
                time.sleep(50e-6)

    def check(self) -> None:
        pass  # a host wait raises where it gives up
