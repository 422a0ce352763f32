"""The slot plane: the shm backend's slot protocol as stream-ordered operations, written once and
run on two memories (issue 19; docs/architecture.md, "The slot plane"). The ``slots`` backend
(``slots.py``) serves a deployment on it.

Why. On GPUs the A:F hop must move each token once per FFN rank (not once per expert, as
DeepEP's low-latency kernels with virtual experts do), keep its buffers to the slots (not the
gigabytes of NVSHMEM those kernels take on every GPU) and make no host synchronization on the
token path, so that both sides' steps can be captured as CUDA graphs
(../shared/design/reviews/gpu-path-2.md). The shm backend's layout already has that shape; what
it lacks on a GPU is a way to publish and wait that is not a host spin. So the layout, the
protocol, the step schedules and the failure signalling live here, expressed in a handful of
operations a device executes in stream order, and a ``PlaneMemory`` supplies only the memory and
the publish/wait primitive:

* ``HostPlaneMemory`` (this file): a ``/dev/shm`` segment, plain stores (x86-64 total store
  order, as in shm.py) and a host spin. Every CI run exercises the protocol through it, with
  either wait semantics: the host's (a wait that fails raises at once) or the device's
  (``device_waits``: it is recorded and ``check()`` raises at the step's end), the CPU stand-in
  of the GPU layer's host-side logic.
* ``CudaPlaneMemory`` (``slot_plane_cuda.py``): device memory shared by CUDA IPC, a Triton
  store with release semantics and a Triton spin-wait with acquire semantics at system scope;
  every operation is a kernel on the current stream, so CUDA graphs capture the whole exchange.

No library does this: DeepEP's kernels are the wrong tool for the asymmetric hop (above); vLLM's
custom all-reduce has the pattern (IPC buffers, device flags) but only as an all-reduce; PyTorch
symmetric memory's ``put_signal``/``wait_signal`` need every rank to allocate the same buffer
through a rendezvous of one process group. The CUDA layer here uses PyTorch and Triton only.

Layout. One data buffer per FFN rank, owned by it, mapped by every attention rank::

    flags          int64, one 128-byte line each: request flag and response flag of every
                   (attention rank a, slot s)
    slot (s, a)    x [T, H] spec.dtype | topk_ids [T, K] int32 | topk_weights [T, K] float32 |
                   out [T, H] spec.dtype       (T = max_tokens, each part 128-byte aligned)

and one control block per FFN rank in host shared memory (``ControlBlock``, on every device:
the FFN rank's host reads it): the FFN process's identity, the data buffer's handle, and each
attention rank's last announced ``StepSchedule`` (``control.py``).

Protocol. Slot ``s`` carries microbatch ``s``. Every use of a slot is tagged by its flag value,
``step << POSITION_BITS | position + 1`` (the use's value): the sender's step and the
layer's position in that step's schedule. Both sides hold the step as a device word
(``begin``), so the value is computed on the device and a CUDA graph replay, whose host code
does not run, uses the step announced before it::

    attention a, begin(step):   step word = step << 16; schedule into every control block
    attention a, dispatch(s, p): copy x, ids, weights into slot (s, a) of every FFN rank f;
                                signal(request flag (a, s) of f, value(step, p))
    FFN f, begin(a, step):      f's step word of a = step << 16 (read from a's schedule)
    FFN f, take(s, a, p):       wait(request flag (a, s), value(step_a, p))
    FFN f, answer(s, a, p):     signal(response flag (a, s), value(step_a, p)), after writing
                                the weighted sum of f's experts into out; ``fail``: the
                                negated value, the error text in out
    attention a, combine(h):    wait(response flag (a, s) of f, value(step, p)) for every f;
                                sum the f answers

A signal is a store ordered after the payload (release); a wait returns once ``|flag|`` reaches
the awaited value (acquire), so the reader never sees a half-written payload. Values only grow
(steps grow, and positions within a step), so a replay cannot be fooled by the previous use,
and a wait that finds a larger value knows its peer moved on (an attention rank that abandoned
a step after an error): it ends instead of waiting for a use that will never come. Slots of
different microbatches never share a flag, so any interleaving of two microbatches'
dispatches and combines (vLLM's DBO runs D0, D1, C0, D0', C1, ...) is served as long as the FFN
side serves each slot's uses in order (layer by layer, the microbatches of a layer in turn).
Tags are thereby checked on every message, on the device, and steps resynchronise the two sides
at every announcement: a step abandoned half-way leaves nothing behind.

Fixed shapes. Every dispatch sends all its ``n`` rows to every FFN rank (no host-side filtering
by expert, which needs the routing on the host), so traffic per layer is ``n x H x F`` each way,
against ``n x H x (FFN ranks a token touches)`` for the shm backend's filtered sends: equal at
F = 1 (7:1), 4 against 3.6 for Qwen3-235B at 28 + 4. The FFN side masks the experts it does not
hold. The row counts of a use come from the announced step schedule, as the CUDA graph to
replay does; a dispatch may send fewer (an upper bound was announced: the rest is not read).

Failure. A host wait raises ``FFNTimeout`` naming the flag after ``timeout_s`` and reports a
flag that moved past the awaited value to its caller; its ``watch`` callback (every
``WATCH_INTERVAL_S``) lets the caller end it early (the FFN process died, the sender announced
a newer step). A device wait gives up after its spin budget, or on an error answer or a peer
that moved on, records it in a device word and lets the stream go on (a kernel cannot raise);
``check()`` reads that word on the host (at step boundaries, where the host looks anyway) and
raises.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_afd.host import (
    map_segment,
    pid_namespace,
    process_start_time,
    reap_segments,
    shm_platform_problem,
    unlink_if_creator,
)
from vllm_afd.transport.base import FFNTimeout, TransportSpec
from vllm_afd.transport.control import StepSchedule, schedule_words

#: Alignment of flags and payload parts: a GPU's L2 line (128 bytes), two x86 cache lines.
LINE = 128
_FLAG_WORDS = LINE // 8
#: Bits of a flag value below the step: the layer's position in the step (+1).
POSITION_BITS = 16
#: Name prefix of the data segments ``HostPlaneMemory`` creates.
PLANE_PREFIX = "vllm_afd_plane_"
#: How often a waiting host calls its ``watch`` (seconds).
WATCH_INTERVAL_S = 0.05
#: ``forward(x [N, H], topk_ids [N, K] int32, topk_weights [N, K] float32, out [N, H]) -> out``,
#: already weighted and summed over the FFN rank's experts (``transport.reference.FFNForward``).
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _align(n: int, to: int = LINE) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class PlaneLayout:
    """Byte layout of one FFN rank's data buffer (module docstring)."""

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
    def params(self) -> tuple[int, ...]:
        """What a control block records and attachers check."""
        return (
            self.num_attention_ranks,
            self.num_slots,
            self.max_tokens,
            self.hidden,
            self.top_k,
            self.dtype.itemsize,
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


#: Row counts whose views a slot keeps (``SlotViews.rows``) before it drops them all.
_MAX_CACHED_ROWS = 1024


class SlotViews:
    """One slot's flags (one-element int64 views) and payload (``[T, ...]`` views)."""

    __slots__ = ("request", "response", "x", "ids", "weights", "out", "_rows")

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
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, ids, weights, out)`` of the first ``n`` rows, built once per ``n`` (a slice
        costs about as much as copying a decode-sized row: the hot path reuses them)."""
        views = self._rows.get(n)
        if views is None:
            if len(self._rows) >= _MAX_CACHED_ROWS:
                self._rows.clear()
            views = self._rows[n] = (self.x[:n], self.ids[:n], self.weights[:n], self.out[:n])
        return views

    def write_error(self, message: str) -> None:
        """An error answer's text into ``out`` (its length first, as one int64)."""
        area = self.out.view(-1).view(torch.uint8)
        text = (message.encode() or b"?")[: area.numel() - 8]
        data = bytearray(len(text).to_bytes(8, "little") + text)
        area[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))

    def read_error(self) -> str:
        """The text ``write_error`` left in ``out`` (host memory only)."""
        area = self.out.view(-1).view(torch.uint8)
        length = int.from_bytes(area[:8].numpy().tobytes(), "little")
        if not 0 < length <= area.numel() - 8:
            return f"(unreadable error answer: {length} bytes)"
        return area[8 : 8 + length].numpy().tobytes().decode(errors="replace")


#: ``watch()``, called by a waiting host every ``WATCH_INTERVAL_S``: raises to end the wait.
Watch = Callable[[], None]


class PlaneMemory(Protocol):
    """What differs per device: where buffers live and how a flag is published and awaited.

    ``signal`` and ``wait`` are stream-ordered on devices with streams (they return at once and
    run in order with the copies around them); on the host they run when called. ``step`` is a
    one-element int64 tensor on the memory's device holding ``step << POSITION_BITS``; the value
    a flag carries for a use is ``step + position + 1`` (module docstring: the use's value)."""

    device: torch.device
    #: Its waits record where they fail, ``check`` raises (``RecordedWaits``); else they raise.
    records_waits: bool

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        """A zeroed ``uint8`` buffer of ``nbytes`` and the text peers attach it by."""

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        """The buffer ``handle`` names, mapped into this process."""

    def signal(
        self, flag: torch.Tensor, step: torch.Tensor, position: int, failed: bool = False
    ) -> None:
        """Store the use's value (negated when ``failed``) into ``flag`` after every earlier
        write (release)."""

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        watch: Watch | None = None,
    ) -> int | None:
        """Until ``|flag|`` reaches the use's value (acquire), bounded; ``what`` names the flag
        in errors. Returns the flag's value on the host (the caller tells an answer, an error
        answer and a peer that moved on apart); ``None`` where the wait only records a
        failure (``check``)."""

    def check(self) -> None:
        """Raise if a wait failed since the last check (where waits only record it)."""

    def close(self) -> None:
        """Release what ``create`` and ``attach`` mapped (the creator's buffers go)."""


def step_word(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def _set_step(word: torch.Tensor, step: int) -> None:
    word.fill_(step << POSITION_BITS)  # a kernel on a device: in stream order, no host sync


@dataclass(frozen=True)
class PlaneHandle:
    """What ``dispatch`` returns and ``combine`` consumes: the slot, the layer's position in
    the step and the rows sent."""

    slot: int
    position: int
    num_tokens: int


class PlaneError(Exception):
    """A host wait found another value than the one it waited for (``found``)."""

    def __init__(self, message: str, found: int) -> None:
        super().__init__(message)
        self.found = found


class AttentionPlane:
    """Attention rank ``rank``'s end: maps every FFN rank's buffer (``handles``, in FFN rank
    order), dispatches into its own slots there and combines the answers."""

    def __init__(
        self, layout: PlaneLayout, memory: PlaneMemory, rank: int, handles: Sequence[str]
    ) -> None:
        self.layout, self.memory, self.rank = layout, memory, rank
        self.buffers = [memory.attach(h, layout.total_bytes) for h in handles]
        self.slots = [
            [SlotViews(b, layout, rank, s) for s in range(layout.num_slots)] for b in self.buffers
        ]
        self.step = step_word(memory.device)

    def begin(self, step: int) -> None:
        """The step the next dispatches belong to (after its schedule is announced)."""
        _set_step(self.step, step)

    def dispatch(
        self,
        slot: int,
        position: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> PlaneHandle:
        """Send ``x`` ``[N, H]`` (``layout.dtype``), ``topk_ids`` ``[N, K]`` (integer, global
        expert ids) and ``topk_weights`` ``[N, K]`` (floating) through ``slot`` to every FFN
        rank, as layer ``position`` of the step; returns at once on devices with streams.
        ``N`` may be 0 (a tensor-parallel rank with no share of a small batch): the flag is
        still published, so the FFN ranks' wait ends."""
        n = x.shape[0]
        if not 0 <= n <= self.layout.max_tokens:
            raise ValueError(f"dispatch of {n} tokens: allowed 0..{self.layout.max_tokens}")
        views = [v[slot] for v in self.slots]
        if n:
            dsts = [t for v in views for t in v.rows(n)[:3]]
            torch._foreach_copy_(dsts, [x, topk_ids, topk_weights] * len(views))
        for v in views:
            self.memory.signal(v.request, self.step, position)
        return PlaneHandle(slot, position, n)

    def combine(self, handle: PlaneHandle, watch: Watch | None = None) -> torch.Tensor:
        """``[N, H]`` (``layout.dtype``): the FFN ranks' answers to ``handle``'s dispatch, summed
        in FFN rank order. A new tensor: the slot may be reused at once."""
        hook, receive = self.combine_hook(handle, watch)
        hook()
        return receive()

    def combine_hook(
        self, handle: PlaneHandle, watch: Watch | None = None
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """``combine`` in two parts, as DeepEP's ``return_recv_hook=True`` and vLLM's async
        finalize split it: ``hook()`` waits for every FFN rank's answer (on devices with
        streams, it queues the waits), ``receive()`` then sums them. Under vLLM's DBO the hook
        goes to ``dbo_register_recv_hook`` and the other microbatch runs it before its next
        send; ``receive`` runs after the yield.

        On the host, ``hook`` raises ``PlaneError`` for an error answer (its text) or an
        answer to another use."""
        slot, position, n = handle.slot, handle.position, handle.num_tokens
        views = [v[slot] for v in self.slots]
        want = None

        def hook() -> None:
            nonlocal want
            for f, view in enumerate(views):
                what = f"response of FFN rank {f} to attention rank {self.rank}, slot {slot}"
                found = self.memory.wait(view.response, self.step, position, what, watch)
                if found is None:
                    continue
                want = want or int(self.step) + position + 1
                if found == -want:
                    raise PlaneError(f"FFN rank {f}: {view.read_error()}", found)
                if found != want:
                    raise PlaneError(f"{what} carries {found:#x}, awaited {want:#x}", found)

        def receive() -> torch.Tensor:
            total = views[0].rows(n)[3].clone()
            for view in views[1:]:
                total += view.rows(n)[3]
            return total

        return hook, receive


@dataclass(frozen=True)
class Part:
    """One attention rank's share of a use of a slot on the FFN side: its rows (from its
    schedule) and the layer's position in its step."""

    attention_rank: int
    rows: int
    position: int


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
        self.steps = [step_word(memory.device) for _ in attention]
        rows = layout.num_attention_ranks * layout.max_tokens
        #: Every attention rank's rows gathered for one forward (``serve``).
        self._gathered = (
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.int32, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.float32, device=memory.device),
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
        )

    def begin(self, attention_rank: int, step: int) -> None:
        """Serve ``step`` of ``attention_rank`` (its announced schedule) from now on."""
        _set_step(self.steps[attention_rank], step)

    def take(self, slot: int, part: Part, watch: Watch | None = None) -> SlotViews:
        """Wait for ``part``'s request in ``slot``; returns the slot's views (the request's
        rows are ``[:part.rows]``). On the host raises ``PlaneError`` when the attention rank
        moved past this use."""
        a = part.attention_rank
        view = self.slots[slot][a]
        what = f"request of attention rank {a} to FFN rank {self.rank}, slot {slot}"
        found = self.memory.wait(view.request, self.steps[a], part.position, what, watch)
        if found is not None:
            want = int(self.steps[a]) + part.position + 1
            if found != want:
                raise PlaneError(f"{what} carries {found:#x}, awaited {want:#x}", found)
        return view

    def answer(self, slot: int, part: Part) -> None:
        """Publish ``part``'s answer, already in its slot's ``out``."""
        a = part.attention_rank
        self.memory.signal(self.slots[slot][a].response, self.steps[a], part.position)

    def fail(self, slot: int, part: Part, message: str) -> None:
        """Answer ``part`` with an error: its attention rank's combine raises ``message``."""
        a = part.attention_rank
        view = self.slots[slot][a]
        view.write_error(message)
        self.memory.signal(view.response, self.steps[a], part.position, failed=True)

    def serve(self, slot: int, parts: Sequence[Part], forward: Forward) -> None:
        """One use of ``slot``, whole and in stream order (the device check and a captured FFN
        step): wait for every part's request, run ``forward`` once over all their rows and
        publish each answer."""
        views = [self.take(slot, part) for part in parts]
        rows = [part.rows for part in parts]
        if len(views) == 1:
            forward(*views[0].rows(rows[0]))
        else:
            self._serve_gathered(views, rows, forward)
        for part in parts:
            self.answer(slot, part)

    def _serve_gathered(self, views: list[SlotViews], rows: Sequence[int], forward: Forward):
        """One forward over the attention ranks' rows: gathered by one ``cat`` per part, the
        answers scattered back by one ``_foreach_copy_``."""
        total = sum(rows)
        x, ids, weights, out = (t[:total] for t in self._gathered)
        parts = [v.rows(n) for v, n in zip(views, rows, strict=True)]
        for i, gathered in enumerate((x, ids, weights)):
            torch.cat([p[i] for p in parts], out=gathered)
        forward(x, ids, weights, out)
        torch._foreach_copy_([p[3] for p in parts], list(out.split(rows)))


class RecordedWaits:
    """The device's way to fail a wait, shared by ``CudaPlaneMemory`` and ``HostPlaneMemory``
    with ``device_waits``: a wait cannot raise (a kernel), so one that ends without its
    answer (gave up, an error answer, a peer that moved on) is counted in ``errors``, a word
    on the memory's device, and ``check()`` reads it on the host and raises."""

    #: Its waits record where they fail (``check`` raises) instead of raising.
    records_waits = True
    errors: torch.Tensor
    #: What a wait gives up after, for the message (``"30 s"``, ``"67108864 polls"``).
    bound: str

    def check(self) -> None:
        failed = int(self.errors)  # a device sync: at step boundaries only
        if failed:
            self.errors.zero_()
            raise FFNTimeout(
                f"slot plane: {failed} wait(s) ended without their answer (given up after "
                f"{self.bound}, an error answer, or a peer that moved on)"
            )


class HostPlaneMemory(RecordedWaits):
    """Host memory: a ``/dev/shm`` segment (mode 0600, ``host.create_segment``), plain stores
    and a host spin. x86-64 only, for the reason shm.py gives (total store order).

    ``device_waits``: waits with the device's semantics (``RecordedWaits``) instead of raising
    where they fail; the CPU stand-in of ``CudaPlaneMemory``'s host-side logic."""

    device = torch.device("cpu")

    def __init__(
        self,
        timeout_s: float = 30.0,
        prefix: str = PLANE_PREFIX,
        device_waits: bool = False,
    ) -> None:
        problem = shm_platform_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.timeout_s, self.prefix, self.device_waits = timeout_s, prefix, device_waits
        self.records_waits = device_waits
        self.errors = torch.zeros(1, dtype=torch.int64)
        self.bound = f"{timeout_s} s"
        self._maps: list[mmap.mmap] = []
        self._created: list[weakref.finalize] = []
        #: One-word int64 views of flags and step words, by address: a word read or written
        #: through one costs a fraction of a tensor's ``int()`` or ``fill_``, on the hot path.
        self._words: dict[int, memoryview] = {}

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        name = f"{self.prefix}{os.getpid()}_{secrets.token_hex(8)}"
        buffer = self._map(map_segment(name, nbytes, create=True), nbytes)
        self._created.append(weakref.finalize(self, unlink_if_creator, name, os.getpid()))
        return buffer, name

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        return self._map(map_segment(handle, nbytes), nbytes)

    def _map(self, mm: mmap.mmap, nbytes: int) -> torch.Tensor:
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)

    def _word(self, tensor: torch.Tensor) -> memoryview:
        """``tensor``'s one int64 word (a flag or a step word), as a memoryview."""
        word = self._words.get(tensor.data_ptr())
        if word is None:
            word = memoryview(tensor.numpy()).cast("B").cast("q")
            self._words[tensor.data_ptr()] = word
        return word

    def signal(
        self, flag: torch.Tensor, step: torch.Tensor, position: int, failed: bool = False
    ) -> None:
        value = self._word(step)[0] + position + 1
        self._word(flag)[0] = -value if failed else value  # after the payload (x86-64 TSO)

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        watch: Watch | None = None,
    ) -> int | None:
        want = self._word(step)[0] + position + 1
        word = self._word(flag)
        seen = word[0]
        if abs(seen) >= want:
            return self._outcome(seen, want)
        start = time.perf_counter()
        deadline, next_watch = start + self.timeout_s, start + WATCH_INTERVAL_S
        while abs(seen := word[0]) < want:
            now = time.perf_counter()
            if now > next_watch:
                if watch is not None:
                    watch()
                next_watch = now + WATCH_INTERVAL_S
            if now > deadline:
                if self.device_waits:
                    self.errors += 1
                    return None
                raise FFNTimeout(f"slot plane: {what} did not come within {self.timeout_s} s")
            if now - start > 1e-3:
                time.sleep(50e-6)
        return self._outcome(seen, want)

    def _outcome(self, seen: int, want: int) -> int | None:
        if not self.device_waits:
            return seen
        if seen != want:
            self.errors += 1
        return None

    def check(self) -> None:
        if self.device_waits:
            super().check()

    def close(self) -> None:
        """Unmap (a mapping still viewed by a live tensor stays until that goes) and unlink
        the segments this memory created."""
        for finalizer in self._created:
            finalizer()
        self._words.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()


# --------------------------------------------------------------------------------------------
# The control block: the step schedules, in host memory whatever the data plane's memory.
# --------------------------------------------------------------------------------------------

CONTROL_PREFIX = "vllm_afd_slots_"
_MAGIC = 0x3130_5354_4F4C_5341  # b"ASLOTS01" little-endian
_VERSION = 1
_OPEN, _CLOSED = 1, 2
# header words: magic, version, pid, pid namespace, state, handle bytes, schedule words, then
# the layout's params from word 8
_W_MAGIC, _W_VERSION, _W_PID, _W_PIDNS, _W_STATE, _W_HANDLE, _W_SCHEDULE = range(7)
_W_PARAMS = 8
_HEADER_WORDS = 16
#: Room for the data buffer's handle (a segment name; a CUDA IPC handle as JSON).
HANDLE_BYTES = 2048


class ControlBlock:
    """An FFN rank's control block (``/dev/shm``, mode 0600): who the FFN process is, the
    handle of its data buffer, and per attention rank the last ``StepSchedule`` it announced
    (``control.StepSchedule.words``).

    A schedule is written as a seqlock over x86-64 store order: its step word is zeroed, the
    other words written, then the step word; a reader takes the step word, the rest, and the
    step word again, and keeps only a read where both agree."""

    def __init__(self, name: str, mm: mmap.mmap, layout: PlaneLayout, words_per: int) -> None:
        self.name, self.mm, self.layout, self.words_per = name, mm, layout, words_per
        self.words = memoryview(mm).cast("q")

    @staticmethod
    def size(layout: PlaneLayout, words_per: int) -> int:
        return 8 * (_HEADER_WORDS + layout.num_attention_ranks * words_per) + HANDLE_BYTES

    @classmethod
    def create(
        cls, layout: PlaneLayout, moe_layers: Sequence[int], handle: str, prefix: str, rank: int
    ) -> ControlBlock:
        words_per = schedule_words(moe_layers)
        data = handle.encode()
        if len(data) > HANDLE_BYTES:
            raise ValueError(f"data buffer handle of {len(data)} bytes, room for {HANDLE_BYTES}")
        size = cls.size(layout, words_per)
        name = f"{prefix}{os.getpid()}_f{rank}_{secrets.token_hex(8)}"
        block = cls(name, map_segment(name, size, create=True), layout, words_per)
        block._finalizer = weakref.finalize(block, unlink_if_creator, name, os.getpid())
        words = block.words
        for i, value in enumerate(layout.params):
            words[_W_PARAMS + i] = value
        block.mm[size - HANDLE_BYTES : size - HANDLE_BYTES + len(data)] = data
        words[_W_HANDLE], words[_W_SCHEDULE] = len(data), words_per
        words[_W_VERSION], words[_W_PID], words[_W_PIDNS] = _VERSION, os.getpid(), pid_namespace()
        words[_W_STATE] = _OPEN
        words[_W_MAGIC] = _MAGIC
        return block

    @classmethod
    def attach(cls, name: str, layout: PlaneLayout, moe_layers: Sequence[int]) -> ControlBlock:
        """Map an FFN rank's block (``host.map_segment``: ours, mode 0600, of the spec's size).

        Raises:
            ValueError: if its layout is not ``layout``'s (the two sides disagree on the spec).
        """
        words_per = schedule_words(moe_layers)
        mm = map_segment(name, cls.size(layout, words_per))
        block = cls(name, mm, layout, words_per)
        words = block.words
        found = tuple(words[_W_PARAMS : _W_PARAMS + len(layout.params)])
        if words[_W_MAGIC] != _MAGIC or words[_W_VERSION] != _VERSION or found != layout.params:
            block.close()
            raise ValueError(
                f"control block {name!r} has layout {found}, expected {layout.params} "
                "(attention ranks, slots, max_tokens, hidden, top_k, itemsize): attention and "
                "FFN ranks disagree on the TransportSpec"
            )
        return block

    @property
    def handle(self) -> str:
        start = len(self.mm) - HANDLE_BYTES
        return bytes(self.mm[start : start + self.words[_W_HANDLE]]).decode()

    @property
    def pid(self) -> int:
        return self.words[_W_PID]

    @property
    def pid_namespace(self) -> int:
        return self.words[_W_PIDNS]

    @property
    def closed(self) -> bool:
        return self.words[_W_STATE] == _CLOSED

    def _base(self, attention_rank: int) -> int:
        return _HEADER_WORDS + attention_rank * self.words_per

    def announce(self, attention_rank: int, schedule: StepSchedule) -> None:
        """Write ``attention_rank``'s schedule (the seqlock of the class docstring)."""
        words, base = self.words, self._base(attention_rank)
        encoded = schedule.words(self.words_per)
        words[base] = 0
        for i in range(len(encoded) - 1, 0, -1):
            words[base + i] = encoded[i]
        words[base] = encoded[0]

    def announced_step(self, attention_rank: int) -> int:
        """The step ``attention_rank`` announced last (0: none, or one being written)."""
        return self.words[self._base(attention_rank)]

    def schedule(self, attention_rank: int) -> StepSchedule | None:
        """``attention_rank``'s last schedule, or ``None`` if none or being written."""
        words, base = self.words, self._base(attention_rank)
        step = words[base]
        if not step:
            return None
        encoded = words[base : base + self.words_per].tolist()
        if words[base] != step:
            return None
        return StepSchedule.from_words(encoded)

    def close(self, creator: bool = False) -> None:
        """Unmap; the creator marks the block closed (waiting attention ranks fail fast) and
        unlinks it."""
        if creator:
            self.words[_W_STATE] = _CLOSED
            self._finalizer()
        self.words.release()
        self.mm.close()


def reap_stale_control_blocks(prefix: str = CONTROL_PREFIX) -> list[str]:
    """Unlink control blocks (and their data segments on the host) whose creator, in this pid
    namespace, is dead. Returns the names unlinked."""
    own_ns = pid_namespace()

    def is_stale(name: str, header) -> bool:
        if header[_W_MAGIC] != _MAGIC or header[_W_PIDNS] != own_ns:
            return False
        return process_start_time(header[_W_PID]) is None

    def creator_dead(name: str, header) -> bool:
        pid = name[len(PLANE_PREFIX) :].split("_", 1)[0]
        return pid.isdigit() and process_start_time(int(pid)) is None

    return reap_segments(prefix, _HEADER_WORDS, is_stale) + reap_segments(
        PLANE_PREFIX, 0, creator_dead
    )


__all__ = [
    "AttentionPlane",
    "ControlBlock",
    "FFNPlane",
    "HostPlaneMemory",
    "Part",
    "PlaneError",
    "PlaneHandle",
    "PlaneLayout",
    "PlaneMemory",
    "RecordedWaits",
    "SlotViews",
]
