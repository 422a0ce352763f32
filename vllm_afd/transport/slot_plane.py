"""The slot plane: the one attention <-> FFN protocol, written once and run on every memory
(docs/architecture.md, "The slot plane"). The ``shm`` and ``slots`` backends (``slots.py``)
serve deployments on it; the attention endpoint (``endpoint.py``) drives it through a few wire
primitives.

Why. On GPUs the A:F hop must move each token once per FFN rank (not once per expert, as
DeepEP's low-latency kernels with virtual experts do), keep its buffers to the slots (not the
gigabytes of NVSHMEM those kernels take on every GPU) and make no host synchronization on the
token path, so that both sides' steps can be captured as CUDA graphs
(../shared/design/reviews/gpu-path-2.md). On one CPU host the same layout is the fastest way
there is (shared memory, plain stores). So the layout, the protocol, the step schedules and the
failure signalling live here, expressed in a handful of operations a device executes in stream
order, and a ``PlaneMemory`` supplies only the memory and the publish/wait primitive:

* ``HostPlaneMemory`` (``slot_plane_host.py``): a ``/dev/shm`` segment, plain stores (x86-64
  total store order) and a host wait. Every CI run exercises the protocol through it, with
  either wait semantics: the host's (a wait that fails raises at once) or the device's
  (``device_waits``: it is recorded and ``check()`` raises at the step's end), the CPU
  stand-in of the GPU layer's host-side logic.
* ``CudaPlaneMemory`` (``slot_plane_cuda.py``): device memory shared by CUDA IPC, a Triton
  store with release semantics and a Triton spin-wait with acquire semantics at system scope;
  every operation is a kernel on the current stream, so CUDA graphs capture the whole exchange.
* ``NixlPlaneMemory`` (``nixl.py``): across hosts, NIXL-registered host memory; a peer's buffer
  is a local mirror whose stores its owner applies from NIXL notifications (``push``, ``pump``).

No library does this: DeepEP's kernels are the wrong tool for the asymmetric hop (above); vLLM's
custom all-reduce has the pattern (IPC buffers, device flags) but only as an all-reduce; PyTorch
symmetric memory's ``put_signal``/``wait_signal`` need every rank to allocate the same buffer
through a rendezvous of one process group. The CUDA layer here uses PyTorch and Triton only.

Layout. Each side polls only memory it owns, and writes into its peer's (as vLLM's custom
all-reduce polls only its own signal slots): a dead peer never leaves a side reading memory that
went with it, and a replacement FFN rank answers into the buffers the attention rank already
has. One request buffer per FFN rank, owned by it, written by every attention rank::

    flags          one 128-byte line per (attention rank a, slot s): int64 words, the request
                   flag, then, on host memory, the row count and the CPU its writer last ran on
    slot (s, a)    x [T, H] spec.dtype | topk_ids [T, K] int32 | topk_weights [T, K] float32
                   (T = max_tokens, each part 128-byte aligned)

and one answer buffer per (attention rank, FFN rank), owned by the attention rank, written by
the FFN rank: per slot a flag line (the response flag, then the CPU of its writer), then per
slot ``out [T, H]``. One control block per FFN rank in host shared memory (``ControlBlock``, on
every device: the FFN rank's host reads it) holds the FFN process's identity, the request
buffer's handle, and per attention rank its answer buffer's handle and last announced
``StepSchedule`` (``control.py``).

Protocol. Slot ``s`` carries microbatch ``s``. Every use of a slot is tagged by its flag value,
``step << POSITION_BITS | position + 1`` (the use's value; ``value_use`` reads it): the sender's
step and the layer's position in that step's schedule. Both sides hold the step as a word on the
memory's device (``begin``), so the value is computed on the device and a CUDA graph replay,
whose host code does not run, uses the step announced before it::

    attention a, begin(step):   step word = step << 16; schedule into every control block
    attention a, send(f, s, p): copy x, ids, weights (and, on the host, the row count) into
                                slot (s, a) of FFN rank f; signal(request flag, value(step, p))
    FFN f, take(s, a, p):       wait(request flag (a, s), value(step_a, p))
    FFN f, answer(s, a, p):     write the weighted sum of f's experts into out (s) of a's
                                answer buffer for f; signal its response flag, value(step_a,
                                p); ``fail``: the negated value, the error text in out
    attention a, await(s, p):   wait(response flag (s) of its answer buffer for each FFN rank
                                f, value(step, p)); sum the FFN ranks' answers

A signal is a store ordered after the payload (release); a wait returns once the flag reaches
the awaited value (acquire), so the reader never sees a half-written payload. A send is one
``publish`` (payload, then flag: on a device one kernel, ``slot_plane_cuda``), so a use is one
operation per side and direction around the MoE kernel: the attention rank publishes to each
FFN rank and awaits and sums their answers at once (``wait_sum``); the FFN rank awaits every
attention rank's request and gathers their rows for one forward at once (``wait_gather``) and
answers them at once (``publish_all``), or, for one attention rank, waits, lets the experts
read the slot and write the answer in place, and signals. The FFN side serves the plane in one
of two ways from the same flags (``slots.py``): what is pending (host memory: a flag whose value
changed is a request, its layer read from its sender's announced schedule, its rows from the
row-count word; attention ranks need not step together), or whole announced steps (every device:
each wait is for the value its use must carry; values only grow within a step, so a wait that
finds a larger one knows its peer moved on and ends; shapes are fixed, so that a step is one
CUDA graph).

Fixed shapes on devices. Every dispatch on device memory sends all its ``n`` rows to every FFN
rank (no host-side filtering by expert, which needs the routing on the host), so traffic per
layer is ``n x H x F`` each way, against ``n x H x (FFN ranks a token touches)`` for filtered
sends: equal at F = 1 (7:1), 4 against 3.6 for Qwen3-235B at 28 + 4. The FFN side masks the
experts it does not hold.

Failure. A host wait raises ``FFNTimeout`` after its deadline and reports a flag that moved past
the awaited value to its caller; its ``watch`` callback (every ``WATCH_INTERVAL_S``:
``slot_plane_host.await_word``) lets the caller end it early (the FFN process died, the sender
announced a newer step). A device wait gives up at its deadline (the GPU's global timer), or on
an error answer, a peer that moved on or an abort word a host watchdog sets when the peer dies
(the step's later waits end at once), records its use's value in a word of host memory and
lets the stream go on (a kernel cannot raise); ``check()`` reads that word at step boundaries,
where the host looks anyway, without a device sync, and raises (``slot_plane_failures.py``,
``RecordedWaits``). An FFN
rank's wait that gives up also marks its part missed (a word on the device): the use's forward
still runs, on the slot's stale rows, but the answer to that part is an error answer, so that
the late request's own wait fails rather than take it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_afd.transport.base import TransportSpec, UseForward
from vllm_afd.transport.control import Part
from vllm_afd.transport.wait import ViewCache

#: Alignment of flags and payload parts: a GPU's L2 line (128 bytes), two x86 cache lines.
LINE = 128
#: Words of a flag line after the flag (host memory only): the request's row count, and the
#: CPU the line's writer last ran on (a peer there skips its spin: ``wait.current_cpu``).
ROWS_WORD, CPU_WORD = 1, 2
#: Bits of a flag value below the step: the layer's position in the step (+1).
POSITION_BITS = 16
#: Name prefix of an FFN rank's control block; its data segment on the host adds ``data_``.
PLANE_PREFIX = "vllm_afd_plane_"
#: How often a waiting host calls its ``watch`` (seconds).
WATCH_INTERVAL_S = 0.05
#: ``RecordedWaits.aborted`` that ends every wait.
ABORT_ALL = (1 << 63) - 1


def _words(tensor: torch.Tensor) -> memoryview:
    """A host tensor's int64 words as a memoryview (it shares the tensor's memory)."""
    return tensor.numpy().data.cast("B").cast("q")


#: ``(x, ids, weights)`` views of a request slot's first rows (``SlotViews.rows``).
SlotRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _align(n: int, to: int = LINE) -> int:
    return (n + to - 1) // to * to


def value_use(value: int) -> tuple[int, int]:
    """``(step, position)`` of a use's value ``step << POSITION_BITS | position + 1`` (module
    docstring)."""
    return value >> POSITION_BITS, (value & ((1 << POSITION_BITS) - 1)) - 1


@dataclass(frozen=True)
class PlaneLayout:
    """Byte layout of an FFN rank's request buffer and an attention rank's answer buffers
    (module docstring)."""

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
        return self.x_bytes + 2 * self.routing_bytes

    @property
    def flags_bytes(self) -> int:
        return self.num_attention_ranks * self.num_slots * LINE

    @property
    def total_bytes(self) -> int:
        """An FFN rank's request buffer."""
        return self.flags_bytes + self.num_attention_ranks * self.num_slots * self.slot_bytes

    @property
    def answer_bytes(self) -> int:
        """An attention rank's answer buffer for one FFN rank."""
        return self.num_slots * (LINE + self.x_bytes)

    def slot_offset(self, attention_rank: int, slot: int) -> int:
        """Byte offset of slot (``slot``, ``attention_rank``): a slot's attention ranks are
        adjacent, so one microbatch's requests lie together."""
        return (
            self.flags_bytes + (slot * self.num_attention_ranks + attention_rank) * self.slot_bytes
        )


def _flag_line(buffer: torch.Tensor, line: int) -> tuple[torch.Tensor, memoryview | None]:
    """Flag line ``line`` of ``buffer`` (``[16]`` int64, the flag first), and on host memory
    the same words as a memoryview (a word read or written through one costs a fraction of a
    tensor's ``int()`` or ``fill_``)."""
    view = buffer[line * LINE : (line + 1) * LINE].view(torch.int64)
    return view, _words(view) if buffer.device.type == "cpu" else None


def _part(buffer: torch.Tensor, at: int, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    return buffer[at : at + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)


class SlotViews:
    """One request slot in an FFN rank's buffer: its flag line (``request_line``, on host
    memory also ``request_words``; ``request``: the flag) and payload (``[T, ...]`` views);
    ``rows(n)``: ``(x, ids, weights)`` of the first ``n`` rows, built once per ``n``
    (``wait.ViewCache``: a slice costs about as much as copying a decode-sized row, so the hot
    path reuses them)."""

    __slots__ = ("request_line", "request_words", "request", "x", "ids", "weights", "rows")

    def __init__(self, buffer: torch.Tensor, layout: PlaneLayout, attention_rank: int, slot: int):
        line = attention_rank * layout.num_slots + slot
        self.request_line, self.request_words = _flag_line(buffer, line)
        self.request = self.request_line[:1]
        at, rows, k = layout.slot_offset(attention_rank, slot), layout.max_tokens, layout.top_k
        self.x = x = _part(buffer, at, layout.dtype, rows, layout.hidden)
        self.ids = ids = _part(buffer, at + layout.x_bytes, torch.int32, rows, k)
        at += layout.x_bytes + layout.routing_bytes
        self.weights = weights = _part(buffer, at, torch.float32, rows, k)
        cache: ViewCache[SlotRows] = ViewCache(lambda n: (x[:n], ids[:n], weights[:n]))
        self.rows = cache.__getitem__  # a bound method: one call less on the hot path


class AnswerViews:
    """One slot of an attention rank's answer buffer for one FFN rank: its flag line
    (``response_line``, on host memory also ``response_words``; ``response``: the flag) and
    ``out`` ``[T, H]``; ``rows(n)``: ``out[:n]``, cached as ``SlotViews.rows``."""

    __slots__ = ("response_line", "response_words", "response", "out", "rows")

    def __init__(self, buffer: torch.Tensor, layout: PlaneLayout, slot: int):
        self.response_line, self.response_words = _flag_line(buffer, slot)
        self.response = self.response_line[:1]
        at = layout.num_slots * LINE + slot * layout.x_bytes
        self.out = out = _part(buffer, at, layout.dtype, layout.max_tokens, layout.hidden)
        self.rows = ViewCache(lambda n: out[:n]).__getitem__

    def write_error(self, message: str) -> torch.Tensor:
        """An error answer's text into ``out`` (its length first, as one int64); returns the
        bytes written (a view of ``out``)."""
        area = self.out.view(-1).view(torch.uint8)
        text = (message.encode() or b"?")[: area.numel() - 8]
        data = bytearray(len(text).to_bytes(8, "little") + text)
        area[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
        return area[: len(data)]

    def read_error(self) -> str:
        """The text ``write_error`` left in ``out`` (host memory only)."""
        area = self.out.view(-1).view(torch.uint8)
        length = int.from_bytes(area[:8].numpy().tobytes(), "little")
        if not 0 < length <= area.numel() - 8:
            return f"(unreadable error answer: {length} bytes)"
        return area[8 : 8 + length].numpy().tobytes().decode(errors="replace")


#: ``watch()``, called by a waiting host every ``WATCH_INTERVAL_S``: raises to end the wait.
Watch = Callable[[], None]
#: ``push(regions, line)`` (``PlaneMemory.push``).
Push = Callable[[Sequence[torch.Tensor], torch.Tensor], None]


class PlaneMemory(Protocol):
    """What differs per device: where buffers live and how a flag is published and awaited.

    ``signal`` and ``wait`` are stream-ordered on devices with streams (they return at once and
    run in order with the copies around them); on the host they run when called. ``step`` is a
    one-element int64 tensor on the memory's device holding ``step << POSITION_BITS``; the value
    a flag carries for a use is ``step + position + 1`` (module docstring: the use's value)."""

    device: torch.device
    #: Its waits record where they fail, ``check`` raises (``RecordedWaits``); else they raise.
    records_waits: bool
    #: The plane may store a request's flag line itself through host words after copying its
    #: payload (host memory, plain stores under x86-64 store order: the CPU's hot path);
    #: otherwise every send is one ``publish``.
    stores_on_host: bool

    @property
    def push(self) -> Push | None:
        """``None`` where a store into a peer's buffer lands in that buffer (shared memory,
        CUDA IPC). Else the peer's buffer is mirrored here (``attach`` returns a local copy)
        and the plane calls ``push(regions, line)`` after its stores into a mirror:
        ``regions`` (views of the mirror) reach the peer's buffer, then ``line`` (int64 words
        of it, the flag first) is stored there by the owner, the flag last
        (``nixl.NixlPlaneMemory``)."""

    @property
    def pump(self) -> Callable[[], None] | None:
        """``None``, or what a waiting host calls between polls (``wait.Backoff``'s
        ``pump``): the owner applies the lines its peers pushed."""

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        """A zeroed ``uint8`` buffer of ``nbytes`` and the text peers attach it by."""

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        """The buffer ``handle`` names, mapped into this process."""

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` (a replacement's buffer, just attached) takes the place of ``old``: what
        the memory keeps of ``old``'s addresses for operations replayed without the plane (a
        CUDA graph's tables) addresses the same bytes of ``new`` from now on, and nothing
        launched before addresses ``old`` any more once it returns; the memory holds no
        mapping of ``old`` any more (it goes with the caller's views of it)."""

    def signal(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        failed: bool = False,
        missed: torch.Tensor | None = None,
    ) -> None:
        """Store the use's value (negated when ``failed``, or where ``missed``, the word a
        ``wait`` for the use's request wrote, holds 1) into ``flag`` after every earlier
        write (release)."""

    def publish(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
    ) -> None:
        """One use's payload and flag: copy each of ``srcs`` into its ``dsts`` (the same
        shapes; converted to the destination's dtype), then ``signal`` ``flag`` after them."""

    def publish_all(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
        missed: torch.Tensor | None = None,
    ) -> None:
        """``publish`` of several uses at once, each one part: ``srcs[i]`` into ``dsts[i]``,
        then ``flags[i]`` its use's value (step word ``steps[i]``, ``positions[i]``; negated
        where ``missed[i]`` holds 1: ``signal``). One operation on a device (an FFN rank's
        answers of one use to every attention rank, each into that rank's own buffer)."""

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        missed: torch.Tensor | None = None,
    ) -> int | None:
        """Until ``|flag|`` reaches the use's value (acquire), bounded; ``what`` names the flag
        in errors. Returns the flag's value on the host (the caller tells an answer, an error
        answer and a peer that moved on apart); ``None`` where the wait only records a
        failure (``check``), and then, where ``missed`` (an int64 word on the memory's device)
        is given, stores 1 there if it failed, else 0: an FFN rank's answer to a request it
        gave up on must be an error answer (``signal``), not one computed from the slot's
        stale rows, which the late request's own wait would take as its answer."""

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
        """``wait`` for every request ``flags[i]`` (step word ``steps[i]``, the use at
        ``positions[i]``; ``missed[i]`` as ``wait``'s), then its parts ``srcs[i]`` (``x``
        ``[N_i, H]``, ``ids`` and ``weights`` ``[N_i, K]``) into the next ``N_i`` rows of
        ``dsts`` (``x``, ``ids``, ``weights`` of ``sum N_i`` rows), in order: an FFN rank's
        requests of one use from every attention rank, side by side for one forward. One
        operation on a device."""

    def wait_sum(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        position: int,
        srcs: Sequence[torch.Tensor],
        out: torch.Tensor,
        what: Callable[[int], str],
    ) -> list[int | None]:
        """``wait`` for every answer ``flags[i]`` (step word ``steps[i]``, the use at
        ``position``), then ``out`` the sum of ``srcs`` (``srcs[i]`` the answer behind
        ``flags[i]``, each shaped as ``out``), in order: an attention rank's answers of one
        use from every FFN rank. One operation on a device."""

    def check(self, step: int | None = None) -> None:
        """Raise if a wait failed since the last check (where waits only record it);
        ``step``: the step about to be announced (``RecordedWaits.check``)."""

    def check_through(self, step: int) -> None:
        """Raise if a wait of a step up to ``step``, whose device work is done, failed since
        the last raise (where waits only record it: ``RecordedWaits.check_through``)."""

    def close(self) -> None:
        """Release what ``create`` and ``attach`` mapped (the creator's buffers go)."""


def publish_by_copies(
    signal: Callable[..., None],
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    flag: torch.Tensor,
    step: torch.Tensor,
    position: int,
    missed: torch.Tensor | None = None,
) -> None:
    """``publish`` as separate operations: the copies, then the memory's ``signal`` (its
    value negated where ``missed`` holds 1; host memory; on a device, a use its fused kernel
    does not take)."""
    if dsts:
        torch._foreach_copy_(list(dsts), list(srcs))
    signal(flag, step, position, False, missed)


def _word(missed: torch.Tensor | None, i: int) -> torch.Tensor | None:
    return None if missed is None else missed[i : i + 1]


def publish_each(
    signal: Callable[..., None],
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    flags: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    positions: Sequence[int],
    missed: torch.Tensor | None,
) -> None:
    """``publish_all`` as one ``publish_by_copies`` per part (host memory; on a device, parts
    its fused kernel does not take)."""
    uses = enumerate(zip(dsts, srcs, flags, steps, positions, strict=True))
    for i, (dst, src, flag, step, position) in uses:
        publish_by_copies(signal, (dst,), (src,), flag, step, position, _word(missed, i))


def _wait_each(
    wait: Callable[..., int | None],
    flags: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    positions: Sequence[int],
    what: Callable[[int], str],
    missed: torch.Tensor | None = None,
) -> list[int | None]:
    """``wait`` of each flag ``flags[i]`` for the use at ``positions[i]`` of step word
    ``steps[i]`` (``missed[i]``: ``PlaneMemory.wait``'s), in order; what each returned."""
    uses = enumerate(zip(flags, steps, positions, strict=True))
    return [wait(f, s, p, what(i), _word(missed, i)) for i, (f, s, p) in uses]


def wait_then_gather(
    wait: Callable[..., int | None],
    flags: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    positions: Sequence[int],
    srcs: Sequence[Sequence[torch.Tensor]],
    dsts: Sequence[torch.Tensor],
    what: Callable[[int], str],
    missed: torch.Tensor | None,
) -> list[int | None]:
    """``wait_gather`` as separate operations: the memory's ``wait`` of each flag, then one
    ``cat`` per part (host memory; on a device, parts its fused kernel does not take)."""
    found = _wait_each(wait, flags, steps, positions, what, missed)
    for i, gathered in enumerate(dsts):
        torch.cat([parts[i] for parts in srcs], out=gathered)
    return found


def wait_then_sum(
    wait: Callable[..., int | None],
    flags: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    position: int,
    srcs: Sequence[torch.Tensor],
    out: torch.Tensor,
    what: Callable[[int], str],
) -> list[int | None]:
    """``wait_sum`` as separate operations: the memory's ``wait`` of each flag, then a copy
    and an add per further answer (host memory; on a device, answers its fused kernel does not
    take)."""
    found = _wait_each(wait, flags, steps, [position] * len(flags), what)
    out.copy_(srcs[0])
    for src in srcs[1:]:
        out += src
    return found


def step_word(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def _set_step(word: torch.Tensor, step: int) -> None:
    word.fill_(step << POSITION_BITS)  # a kernel on a device: in stream order, no host sync


class PlaneError(Exception):
    """A host wait found another value than the one it waited for (``found``)."""

    def __init__(self, message: str, found: int) -> None:
        super().__init__(message)
        self.found = found


class AttentionPlane:
    """Attention rank ``rank``'s end: maps every FFN rank's request buffer (``handles``, in
    FFN rank order) and owns an answer buffer for each (``answer_handles``: the FFN ranks map
    them, ``FFNPlane.attach_answers``); sends into its own slots of a request buffer and awaits
    the answers in its own memory, one FFN rank at a time (``send``, ``await_answer``,
    ``answer``: what the attention endpoint's wire is made of; the device check drives every
    FFN rank at once with them, ``testing.slot_plane_check.dispatch``)."""

    def __init__(
        self, layout: PlaneLayout, memory: PlaneMemory, rank: int, handles: Sequence[str]
    ) -> None:
        self.layout, self.memory, self.rank = layout, memory, rank
        #: Every FFN rank's request buffer, mapped; ``slots``: views of it per slot.
        self.buffers = [memory.attach(handle, layout.total_bytes) for handle in handles]
        self.slots = [self._views(buffer) for buffer in self.buffers]
        self.answers: list[list[AnswerViews]] = []
        self.answer_handles: list[str] = []
        for _ in handles:
            buffer, handle = memory.create(layout.answer_bytes)
            self.answers.append([AnswerViews(buffer, layout, s) for s in range(layout.num_slots)])
            self.answer_handles.append(handle)
        self.step = step_word(memory.device)
        #: Where the memory lets the plane store flags (``stores_on_host``): the step word as
        #: a memoryview, ``send`` stores flags through the request line's words (the hot
        #: path), as ``HostPlaneMemory.signal`` would.
        self._host_step = _words(self.step) if memory.stores_on_host else None
        self._push = memory.push
        self._records = memory.records_waits

    def _views(self, buffer: torch.Tensor) -> list[SlotViews]:
        return [SlotViews(buffer, self.layout, self.rank, s) for s in range(self.layout.num_slots)]

    def attach(self, ffn_rank: int, handle: str) -> None:
        """Map FFN rank ``ffn_rank``'s new request buffer (its replacement's), in place of its
        old one, also for the sends a CUDA graph replays (``PlaneMemory.readdress``); its
        answers keep coming into the same answer buffer."""
        old, new = self.buffers[ffn_rank], self.memory.attach(handle, self.layout.total_bytes)
        self.memory.readdress(old, new)
        self.buffers[ffn_rank], self.slots[ffn_rank] = new, self._views(new)

    def last_step(self) -> int:
        """The largest step found in this rank's request flags of every buffer (a restarted
        attention rank goes on above it, so no value of its last life is sent again)."""
        values = [int(v.request) for views in self.slots for v in views]
        return max((value_use(value)[0] for value in values), default=0)

    def begin(self, step: int) -> None:
        """The step the next sends belong to (after its schedule is announced)."""
        _set_step(self.step, step)

    def send(
        self,
        ffn_rank: int,
        slot: int,
        position: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        index: torch.Tensor | None = None,
        cpu: int = -1,
    ) -> None:
        """Copy ``x`` ``[T, H]`` (``layout.dtype``), ``topk_ids`` ``[T, K]`` (integer, global
        expert ids) and ``topk_weights`` ``[T, K]`` (floating), or only their rows ``index``
        (``[N]`` int64), into ``slot`` of FFN rank ``ffn_rank`` and signal it as layer
        ``position`` of the step; returns at once on devices with streams. On host memory the
        row count and ``cpu`` go into the request line first. The caller checked the rows
        against ``layout.max_tokens`` (``dispatch`` does). They may be none (a
        tensor-parallel rank with no share of a small batch): the flag is still published, so
        the FFN rank's wait ends."""
        rows = x.shape[0] if index is None else index.shape[0]
        view = self.slots[ffn_rank][slot]
        words = view.request_words
        if words is None or self._host_step is None:  # one operation: payload, then flag
            sources: tuple[torch.Tensor, ...] = (x, topk_ids, topk_weights)
            if index is not None:
                sources = tuple(t.index_select(0, index) for t in sources)
            dsts = view.rows(rows) if rows else ()
            self.memory.publish(dsts, sources if rows else (), view.request, self.step, position)
            return
        parts = view.rows(rows) if rows else ()
        if parts:
            dst_x, dst_ids, dst_weights = parts
            if index is None:  # one call for the three (it converts the ids to int32)
                torch._foreach_copy_(parts, (x, topk_ids, topk_weights))
            else:
                torch.index_select(x, 0, index, out=dst_x)
                dst_ids.copy_(topk_ids.index_select(0, index))
                dst_weights.copy_(topk_weights.index_select(0, index))
        if not self._records:
            # a use sent again (to a replacement) must not find its last answer: cleared
            # first; not with the device's waits, where an FFN rank that failed a step answers
            # its uses before they are sent (as on a device, where a send clears nothing)
            self.answers[ffn_rank][slot].response_words[0] = 0  # type: ignore[index]
        words[ROWS_WORD], words[CPU_WORD] = rows, cpu
        words[0] = self._host_step[0] + position + 1  # after the payload (x86-64 TSO)
        if self._push is not None:
            self._push(parts, view.request_line[: CPU_WORD + 1])

    def await_answer(self, ffn_rank: int, slot: int, position: int) -> None:
        """Wait for FFN rank ``ffn_rank``'s answer to the use of ``slot`` at ``position``
        (on devices with streams, queue the wait). On the host raises ``PlaneError`` for an
        error answer (its text) or an answer to another use."""
        view = self.answers[ffn_rank][slot]
        found = self.memory.wait(view.response, self.step, position, self._name(ffn_rank, slot))
        self._check_answer(ffn_rank, slot, position, found)

    def await_sum(self, slot: int, position: int, out: torch.Tensor) -> None:
        """Wait for every FFN rank's answer to the use of ``slot`` at ``position`` and write
        their sum, in FFN rank order, into ``out`` ``[rows, H]`` (on devices with streams,
        queue it: one operation). On the host raises as ``await_answer``."""
        views = [answers[slot] for answers in self.answers]
        found = self.memory.wait_sum(
            [view.response for view in views],
            [self.step] * len(views),
            position,
            [view.rows(out.shape[0]) for view in views],
            out,
            lambda f: self._name(f, slot),
        )
        for ffn_rank, value in enumerate(found):
            self._check_answer(ffn_rank, slot, position, value)

    def _name(self, ffn_rank: int, slot: int) -> str:
        return f"response of FFN rank {ffn_rank} to attention rank {self.rank}, slot {slot}"

    def _check_answer(self, ffn_rank: int, slot: int, position: int, found: int | None) -> None:
        """On the host (``found`` read): ``PlaneError`` unless the flag carries the answer."""
        if found is None:
            return
        want = int(self.step) + position + 1
        if found == -want:
            error = self.answers[ffn_rank][slot].read_error()
            raise PlaneError(f"FFN rank {ffn_rank}: {error}", found)
        if found != want:
            what = self._name(ffn_rank, slot)
            raise PlaneError(f"{what} carries {found:#x}, awaited {want:#x}", found)

    def answer(self, ffn_rank: int, slot: int, rows: int) -> torch.Tensor:
        """FFN rank ``ffn_rank``'s answer in ``slot``: ``[rows, H]``, a view of this rank's
        answer buffer (read it before the slot's next use)."""
        return self.answers[ffn_rank][slot].rows(rows)


class FFNPlane:
    """FFN rank ``rank``'s end: owns the request buffer every attention rank writes into, and
    answers into each attention rank's answer buffer (``attach_answers``)."""

    def __init__(self, layout: PlaneLayout, memory: PlaneMemory, rank: int) -> None:
        self.layout, self.memory, self.rank = layout, memory, rank
        self.buffer, self.handle = memory.create(layout.total_bytes)
        attention = range(layout.num_attention_ranks)
        self.slots = [
            [SlotViews(self.buffer, layout, a, s) for a in attention]
            for s in range(layout.num_slots)
        ]
        #: Per attention rank, the slots of its answer buffer for this FFN rank (once mapped).
        self.answers: list[list[AnswerViews]] = [[] for _ in attention]
        self._answer_buffers: list[torch.Tensor | None] = [None for _ in attention]
        #: Per attention rank its step word (views of one tensor).
        words = torch.zeros(len(attention), dtype=torch.int64, device=memory.device)
        self.steps = [words[a : a + 1] for a in attention]
        #: Where waits only record a failure: per part of a use, whether the wait for its
        #: request gave up (``PlaneMemory.wait``): its answer is then an error answer.
        self._missed = (
            torch.zeros(len(attention), dtype=torch.int64, device=memory.device)
            if memory.records_waits
            else None
        )
        self._missed_alone = _word(self._missed, 0)  # a use of one attention rank's
        rows = layout.num_attention_ranks * layout.max_tokens
        #: Every attention rank's rows gathered for one forward (``serve``).
        self._gathered = (
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.int32, device=memory.device),
            torch.empty(rows, layout.top_k, dtype=torch.float32, device=memory.device),
            torch.empty(rows, layout.hidden, dtype=layout.dtype, device=memory.device),
        )

    def attach_answers(self, attention_rank: int, handle: str) -> None:
        """Map ``attention_rank``'s answer buffer for this FFN rank (``handle``: its
        ``AttentionPlane.answer_handles`` entry), in place of any before."""
        buffer = self.memory.attach(handle, self.layout.answer_bytes)
        old = self._answer_buffers[attention_rank]
        if old is not None:  # a restarted front-end's: the old one goes (``readdress``)
            self.memory.readdress(old, buffer)
        self._answer_buffers[attention_rank] = buffer
        slots = range(self.layout.num_slots)
        self.answers[attention_rank] = [AnswerViews(buffer, self.layout, s) for s in slots]

    def begin(self, attention_rank: int, step: int) -> None:
        """Serve ``step`` of ``attention_rank`` (its announced schedule) from now on."""
        _set_step(self.steps[attention_rank], step)

    def take(self, slot: int, part: Part) -> SlotViews:
        """Wait for ``part``'s request in ``slot``; returns the slot's views (the request's
        rows are ``[:part.rows]``). On the host raises ``PlaneError`` when the attention rank
        moved past this use."""
        a = part.attention_rank
        view = self.slots[slot][a]
        what = self._request_name(a, slot)
        missed = self._missed_alone
        found = self.memory.wait(view.request, self.steps[a], part.position, what, missed)
        self._check_taken(part, slot, found)
        return view

    def _request_name(self, attention_rank: int, slot: int) -> str:
        return f"request of attention rank {attention_rank} to FFN rank {self.rank}, slot {slot}"

    def _check_taken(self, part: Part, slot: int, found: int | None) -> None:
        """On the host (``found`` read): ``PlaneError`` unless the flag carries the use."""
        if found is None:
            return
        want = int(self.steps[part.attention_rank]) + part.position + 1
        if found != want:
            what = self._request_name(part.attention_rank, slot)
            raise PlaneError(f"{what} carries {found:#x}, awaited {want:#x}", found)

    def answer(self, slot: int, part: Part) -> None:
        """Publish ``part``'s answer, already in its attention rank's ``out`` of ``slot``
        (after ``take``: an error answer where its wait gave up)."""
        a = part.attention_rank
        response = self.answers[a][slot].response
        self.memory.signal(response, self.steps[a], part.position, False, self._missed_alone)

    def fail(self, slot: int, part: Part, message: str) -> None:
        """Answer ``part`` with an error: its attention rank's combine raises ``message``."""
        a = part.attention_rank
        view = self.answers[a][slot]
        view.write_error(message)
        self.memory.signal(view.response, self.steps[a], part.position, failed=True)

    def serve(self, slot: int, parts: Sequence[Part], forward: UseForward) -> None:
        """One use of ``slot``, whole and in stream order (a step served whole, a captured FFN
        step): wait for every part's request, run ``forward`` once over all their rows and
        publish every answer; with several attention ranks their requests are awaited and
        gathered by one ``wait_gather`` and answered by one ``publish_all``."""
        rows = [part.rows for part in parts]
        outs = [self.answers[part.attention_rank][slot].rows(part.rows) for part in parts]
        if len(parts) == 1:  # the experts read the slot and write the answer in place
            forward(*self.take(slot, parts[0]).rows(rows[0]), outs[0])
            self.answer(slot, parts[0])
            return
        x, ids, weights, out = (t[: sum(rows)] for t in self._gathered)
        views = [self.slots[slot][part.attention_rank] for part in parts]
        found = self.memory.wait_gather(
            [v.request for v in views],
            [self.steps[part.attention_rank] for part in parts],
            [part.position for part in parts],
            [v.rows(n) for v, n in zip(views, rows, strict=True)],
            (x, ids, weights),
            lambda i: self._request_name(parts[i].attention_rank, slot),
            self._missed,
        )
        for part, value in zip(parts, found, strict=True):
            self._check_taken(part, slot, value)
        forward(x, ids, weights, out)
        self.memory.publish_all(
            outs,
            out.split(rows),  # type: ignore[no-untyped-call]  # Tensor.split: unannotated
            [self.answers[part.attention_rank][slot].response for part in parts],
            [self.steps[part.attention_rank] for part in parts],
            [part.position for part in parts],
            self._missed,
        )


__all__ = [
    "AnswerViews",
    "AttentionPlane",
    "FFNPlane",
    "PlaneError",
    "PlaneLayout",
    "PlaneMemory",
    "SlotViews",
    "publish_by_copies",
    "publish_each",
    "wait_then_gather",
    "wait_then_sum",
]
