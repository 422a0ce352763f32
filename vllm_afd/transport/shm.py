"""Shared-memory transport: the fast path when attention and FFN ranks share one host.

Layout. Each FFN rank creates one POSIX shared-memory segment (a file in ``/dev/shm``) holding a
channel per attention rank, each with ``spec.num_slots`` slots; a dispatch uses the same slot
number on every FFN rank it sends to, so microbatches never share buffers::

    header            int64 words: magic, version, creator pid, state, pid-namespace inode, the
                      CPU the FFN rank last ran on, the layout parameters (checked by attachers),
                      per attention rank the CPU it last dispatched from, then, from the next
                      cache line, per attention rank its last announced step schedule
                      (``control.StepSchedule.words``, step word written last; page-aligned)
    slot (a, s)       page-aligned, for attention rank a, slot s:
      line 0          request header  (written by attention): seq, layer, num_tokens, step,
                      microbatch
      line 1          response header (written by FFN):       seq, num_tokens, error bytes, step,
                      layer, microbatch
      x               [max_tokens, H]  spec.dtype
      topk_ids        [max_tokens, K]  int32
      topk_weights    [max_tokens, K]  float32
      out             [max_tokens, H]  spec.dtype (or, for an error reply, its utf-8 text)

Headers are read and written through one ``memoryview.cast("q")`` of the segment (a word costs
a fraction of a torch scalar index); payloads through ``torch.frombuffer`` views whose ``[:n]``
slices are cached per slot, all four at once (``ViewCache``).

Hot path. Every PyTorch call costs as much as copying a few KiB, so a decode-sized round trip is
mostly call overhead. Per request: dispatch does one ``torch._foreach_copy_`` for x, ids and
weights (one call instead of three, which also converts ids to int32), the FFN side computes
into the slot's response buffer (``FFNRequest.reply_buffer``: ``reply`` then copies nothing),
and combine does one ``clone`` (measured numbers: docs/benchmarks.md).

Publish order. The writer stores the payload, then the other header words, then the sequence
number; the reader loads the sequence number, then the rest. This relies on x86-64 total store
order (stores become visible in program order, loads are not reordered with older loads) and on
CPython/PyTorch doing plain stores (glibc fences its non-temporal large copies). Python has no
portable store/load barrier to add on weakly ordered CPUs (aarch64), so there the backend is
refused (``--afd-transport`` names it at start-up, and both endpoints refuse to be created):
use ``--afd-transport tcp``.

Header fields are checked, never trusted: a request whose token count is negative or above
``max_tokens`` is answered with an error (and not read), and an answer whose row count or error
length is out of range, or whose rows differ from the tokens sent, fails the combine with
``ProtocolError`` (``p2p.combine_partials``).

Sequence numbers count per (attention rank, FFN rank) channel, start after the highest number
found in the segment (a restarted attention rank never repeats one), and tie a response to its
request: combine waits for ``response.seq == request.seq``; a reply to a request that has since
been superseded (its combine timed out and the slot was reused) is dropped.

Waiting is staged (``WaitPolicy``): spin on the sequence word for ``spin_s``, then
``os.sched_yield()`` between polls until ``yield_s`` (the poll window, ``VLLM_AFD_POLL_MS``), then
sleep with doubling intervals up to ``sleep_max_s``. The FFN side keeps its stage across
consecutive empty ``recv`` calls and starts again from the spin stage after serving, so the
layers of a decode are answered without a wake-up while an FFN rank idle past the window costs
almost no CPU. The spin stage is skipped when the peer last ran on this very CPU
(``current_cpu``, written into the header by both sides): spinning would only keep the peer from
running.

Liveness. The FFN side writes its pid; while waiting, combine checks every
``LIVENESS_INTERVAL_S`` that this process still exists, is not a zombie and has the start time it
had at attach (no pid reuse), and that the FFN side did not close the segment. It raises
``FFNRankLost`` naming the FFN rank within about that interval (with failover, ``p2p`` then
attaches the replacement's segment: ``_reconnect``), or ``TransportError`` after
``spec.timeout_s``.
The pid check is skipped (timeout only) when the FFN rank lives in another pid namespace.

Cleanup. The creator unlinks its segment on ``close()``, at interpreter exit and when collected
(``weakref.finalize``); attachers never unlink (the raw-file approach also keeps
``multiprocessing.resource_tracker`` out of it). A SIGKILLed creator leaks its segment until
``reap_stale_segments`` runs: every FFN rank calls it for its prefix at start-up, so does the
front-end before it starts an FFN group, and launchers can call it after an FFN rank died.

Other users. ``/dev/shm`` is shared by every user of the host. Segment names end in 8 random
bytes (unguessable before they exist); a segment is created with ``O_EXCL``/``O_NOFOLLOW`` and
mode 0600, and a name that is taken (planted) is replaced by a fresh one instead of failing;
attaching opens with ``O_NOFOLLOW`` and refuses a segment that is not this user's own regular
file of mode 0600 (``host.open_owned_segment``). Reaping only reads this user's own files.

Addresses. The FFN side's ``address`` is the segment name. ``spec.addresses[rank]``, when set on
the FFN side, is taken as the segment-name prefix to use (default ``DEFAULT_PREFIX``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from vllm_afd.host import (
    SHM_DIR,
    Creator,
    UnsafeFileError,
    map_segment,
    pid_namespace,
    process_start_time,
    reap_segments,
    shm_platform_problem,
    unlink_if_creator,
)
from vllm_afd.transport.base import (
    FFNRankLost,
    FFNRequest,
    FFNServeError,
    FFNTimeout,
    FFNTransport,
    ProtocolError,
    TransportError,
    TransportSpec,
)
from vllm_afd.transport.control import StepSchedule, Tag, answer_mismatch, schedule_words
from vllm_afd.transport.p2p import (
    Backoff,
    PointToPointAttentionTransport,
    PointToPointBackend,
    ViewCache,
    WaitPolicy,
)

DEFAULT_PREFIX = "vllm_afd_"
#: How often a waiting combine checks that the FFN process is alive.
LIVENESS_INTERVAL_S = 0.05

_MAGIC = 0x3130_4D48_5344_4641  # b"AFDSHM01" little-endian
_VERSION = 3
_LINE = 64
_PAGE = 4096
_STATE_OPEN, _STATE_CLOSED = 1, 2

# Global header words.
_G_MAGIC, _G_VERSION, _G_PID, _G_STATE, _G_PIDNS, _G_FFN_CPU = range(6)
_G_LAYOUT = 8  # 7 words: attention ranks, slots, max_tokens, hidden, top_k, itemsize, schedule
_G_ATTN_CPU = 16  # one word per attention rank: CPU it last dispatched from
# Slot header words, relative to the slot start.
_REQ_SEQ, _REQ_LAYER, _REQ_NTOK, _REQ_STEP, _REQ_MB = range(5)
_RESP = _LINE // 8
_RESP_SEQ, _RESP_NTOK, _RESP_ERR, _RESP_STEP, _RESP_LAYER, _RESP_MB = range(_RESP, _RESP + 6)

#: Fresh names an FFN rank tries when its segment name is taken (planted by someone else).
_CREATE_ATTEMPTS = 8


def _cpu_getter() -> Callable[[], int]:
    """``sched_getcpu()`` through libc (cheap enough for every dispatch), or a stub returning
    -1."""
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


current_cpu = _cpu_getter()


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class _Layout:
    """Byte layout of one FFN rank's segment, derived from the spec."""

    num_attention_ranks: int
    num_slots: int
    max_tokens: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    #: int64 words of one encoded step schedule (``control.schedule_words``).
    schedule_words: int

    @classmethod
    def of(cls, spec: TransportSpec) -> _Layout:
        return cls(
            spec.num_attention_ranks,
            spec.num_slots,
            spec.max_tokens,
            spec.hidden_size,
            spec.top_k,
            spec.dtype,
            schedule_words(spec.moe_layers),
        )

    @property
    def params(self) -> tuple[int, ...]:
        """What the header records and attachers check."""
        return (
            self.num_attention_ranks,
            self.num_slots,
            self.max_tokens,
            self.hidden,
            self.top_k,
            self.dtype.itemsize,
            self.schedule_words,
        )

    def schedule_word(self, attention_rank: int) -> int:
        """First header word of attention rank ``attention_rank``'s step schedule. The
        schedules start on a cache line of their own: the CPU words before them change on
        every dispatch, the schedules once per step."""
        first = _align(_G_ATTN_CPU + self.num_attention_ranks, _LINE // 8)
        return first + attention_rank * self.schedule_words

    @property
    def x_bytes(self) -> int:
        return _align(self.max_tokens * self.hidden * self.dtype.itemsize, _LINE)

    @property
    def routing_bytes(self) -> int:
        return _align(self.max_tokens * self.top_k * 4, _LINE)

    @property
    def slot_bytes(self) -> int:
        return _align(2 * _LINE + 2 * self.x_bytes + 2 * self.routing_bytes, _PAGE)

    @property
    def header_bytes(self) -> int:
        return _align(8 * self.schedule_word(self.num_attention_ranks), _PAGE)

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.num_attention_ranks * self.num_slots * self.slot_bytes

    def slot_offset(self, attention_rank: int, slot: int) -> int:
        return self.header_bytes + (attention_rank * self.num_slots + slot) * self.slot_bytes


#: ``[:n]`` views of one slot's payload: x, topk_ids, topk_weights, out.
_Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _Slot:
    """Header word indices and payload views of one slot (see module docstring)."""

    __slots__ = (
        "req_seq",
        "req_layer",
        "req_ntok",
        "req_step",
        "req_mb",
        "resp_seq",
        "resp_ntok",
        "resp_err",
        "resp_step",
        "resp_layer",
        "resp_mb",
        "views",
        "error_text",
    )

    def __init__(self, mm: mmap.mmap, layout: _Layout, offset: int) -> None:
        word = offset // 8
        self.req_seq, self.req_layer, self.req_ntok = (
            word + _REQ_SEQ,
            word + _REQ_LAYER,
            word + _REQ_NTOK,
        )
        self.req_step, self.req_mb = word + _REQ_STEP, word + _REQ_MB
        self.resp_seq, self.resp_ntok = word + _RESP_SEQ, word + _RESP_NTOK
        self.resp_err = word + _RESP_ERR
        self.resp_step, self.resp_layer, self.resp_mb = (
            word + _RESP_STEP,
            word + _RESP_LAYER,
            word + _RESP_MB,
        )
        rows, hidden, top_k = layout.max_tokens, layout.hidden, layout.top_k
        at = offset + 2 * _LINE

        def view(dtype: torch.dtype, cols: int, nbytes: int) -> torch.Tensor:
            nonlocal at
            flat = torch.frombuffer(mm, dtype=dtype, count=rows * cols, offset=at)
            at += nbytes
            return flat.view(rows, cols)

        x = view(layout.dtype, hidden, layout.x_bytes)
        ids = view(torch.int32, top_k, layout.routing_bytes)
        weights = view(torch.float32, top_k, layout.routing_bytes)
        #: The response area as bytes: an error reply's text.
        self.error_text = memoryview(mm)[at : at + layout.x_bytes]
        out = view(layout.dtype, hidden, layout.x_bytes)
        self.views: ViewCache[_Views] = ViewCache(lambda n: (x[:n], ids[:n], weights[:n], out[:n]))


class _Segment:
    """One FFN rank's segment, mapped: ``words`` (int64 header view) and slot views."""

    def __init__(self, name: str, mm: mmap.mmap, layout: _Layout) -> None:
        self.name = name
        self.mm = mm
        self.layout = layout
        self.words = memoryview(mm).cast("q")
        self.slots: dict[tuple[int, int], _Slot] = {}

    @classmethod
    def create(cls, name: str, layout: _Layout) -> _Segment:
        """``FileExistsError`` if ``name`` is taken (see ``host.create_segment``)."""
        return cls(name, map_segment(name, layout.total_bytes, create=True), layout)

    @classmethod
    def attach(cls, name: str, layout: _Layout) -> _Segment:
        """Map an existing segment: ours, of the spec's size (``host.map_segment``)."""
        return cls(name, map_segment(name, layout.total_bytes), layout)

    def slot(self, attention_rank: int, slot: int) -> _Slot:
        key = (attention_rank, slot)
        if key not in self.slots:
            offset = self.layout.slot_offset(attention_rank, slot)
            self.slots[key] = _Slot(self.mm, self.layout, offset)
        return self.slots[key]

    def release(self) -> None:
        """Drop our views and unmap (the mapping outlives us if a caller still holds a view)."""
        self.slots.clear()
        try:
            self.words.release()
            self.mm.close()
        except BufferError:
            pass  # an FFNRequest view is still alive; the mapping goes when it does


def reap_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink segments named ``<prefix><pid>_...`` whose creator (same pid namespace) is dead.

    Returns:
        The names unlinked.
    """
    own_ns = pid_namespace()

    def is_stale(name: str, header) -> bool:
        pid = name[len(prefix) :].split("_", 1)[0]
        if not pid.isdigit() or header[_G_MAGIC] != _MAGIC or header[_G_PIDNS] != own_ns:
            return False
        return process_start_time(int(pid)) is None

    return reap_segments(prefix, _G_LAYOUT, is_stale)


def _refuse_if_not_tso() -> None:
    problem = shm_platform_problem()
    if problem is not None:
        raise RuntimeError(problem)


class ShmAttentionTransport(PointToPointAttentionTransport):
    """Attention endpoint: attaches to every FFN rank's segment (``spec.addresses``)."""

    backend_name = "shm"

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        _refuse_if_not_tso()
        super().__init__(spec, rank, wait)
        self._layout = _Layout.of(spec)
        num_ffn = spec.num_ffn_ranks
        self._segments: list[_Segment] = [None] * num_ffn  # type: ignore[list-item]
        self._slots: list[list[_Slot]] = [[] for _ in range(num_ffn)]
        self._words: list[memoryview] = [None] * num_ffn  # type: ignore[list-item]
        self._seq = [0] * num_ffn
        self._creators: list[Creator] = [Creator(0, None)] * num_ffn
        self._cpu = -1
        for f, name in enumerate(self.addresses):
            self._link(f, name)

    def _link(self, ffn_rank: int, name: str) -> None:
        """Attach FFN rank ``ffn_rank``'s segment ``name`` and take its state."""
        segment = self._attach(ffn_rank, name, self._layout)
        self._segments[ffn_rank] = segment
        self._slots[ffn_rank] = [segment.slot(self.rank, s) for s in range(self.spec.num_slots)]
        self._words[ffn_rank] = segment.words
        self._seq[ffn_rank] = self._last_seq(ffn_rank)
        self._creators[ffn_rank] = self._creator(segment)

    def _reconnect(self, ffn_rank: int, address: str) -> None:
        """Attach the replacement's segment and unmap the lost one (it stays mapped while an
        answer read from it is still in use: ``_Segment.release``); the front-end reaps it."""
        old = self._segments[ffn_rank]
        try:
            self._link(ffn_rank, address)
        except (TransportError, ValueError) as exc:  # the replacement is gone too, or not ours
            raise FFNRankLost(ffn_rank, str(exc)) from None
        old.release()

    def _attach(self, ffn_rank: int, name: str, layout: _Layout) -> _Segment:
        try:
            segment = _Segment.attach(name, layout)
        except FileNotFoundError:
            raise TransportError(
                f"FFN rank {ffn_rank}: shared-memory segment {name!r} not found "
                "(FFN rank not started, or already gone)"
            ) from None
        except UnsafeFileError as exc:
            raise TransportError(f"FFN rank {ffn_rank}: {exc}") from None
        words = segment.words
        found = tuple(words[_G_LAYOUT : _G_LAYOUT + len(layout.params)])
        if words[_G_MAGIC] != _MAGIC or words[_G_VERSION] != _VERSION or found != layout.params:
            raise ValueError(
                f"FFN rank {ffn_rank}: segment {name!r} has layout {found}, expected "
                f"{layout.params} (attention ranks, slots, max_tokens, hidden, top_k, itemsize, "
                "schedule words)"
            )
        return segment

    def _creator(self, segment: _Segment) -> Creator:
        """The FFN process, watched (``host.Creator``)."""
        pid = segment.words[_G_PID]
        creator = Creator.watch(pid, segment.words[_G_PIDNS])
        if creator is None:
            raise TransportError(f"FFN process (pid {pid}) of segment {segment.name!r} is dead")
        return creator

    def _last_seq(self, ffn_rank: int) -> int:
        words = self._words[ffn_rank]
        return max(max(words[s.req_seq], words[s.resp_seq]) for s in self._slots[ffn_rank])

    def _begin_dispatch(self) -> None:
        """Record the CPU this dispatch runs on (FFN ranks on it skip their spin stage)."""
        self._cpu = current_cpu()

    def _announce_to(self, ffn_rank: int, schedule: StepSchedule) -> None:
        """Write ``schedule`` into this rank's schedule words, the step word last."""
        words = self._words[ffn_rank]
        base = self._layout.schedule_word(self.rank)
        encoded = schedule.words(self._layout.schedule_words)
        for i in range(len(encoded) - 1, -1, -1):  # word 0, the step, last (x86-64 TSO)
            words[base + i] = encoded[i]

    def _send(
        self,
        ffn_rank: int,
        slot: int,
        tag: Tag,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        rows: torch.Tensor,
        deadline: float,
    ) -> int:
        """Write one request into ``(ffn_rank, slot)`` and publish it; return its seq.

        Never blocks (``deadline`` is unused): the slot is this dispatch's alone. The copies
        convert ``topk_ids``/``topk_weights`` to int32/float32 on the way (cheaper than
        converting first: no temporary)."""
        buffers = self._slots[ffn_rank][slot]
        n = rows.shape[0]
        dst_x, dst_ids, dst_weights, _ = buffers.views[n]
        if n == x.shape[0]:
            torch._foreach_copy_((dst_x, dst_ids, dst_weights), (x, topk_ids, topk_weights))
        else:
            torch.index_select(x, 0, rows, out=dst_x)
            dst_ids.copy_(topk_ids.index_select(0, rows))
            dst_weights.copy_(topk_weights.index_select(0, rows))
        seq = self._seq[ffn_rank] + 1
        self._seq[ffn_rank] = seq
        words = self._words[ffn_rank]
        words[_G_ATTN_CPU + self.rank] = self._cpu
        words[buffers.req_layer] = tag.layer
        words[buffers.req_ntok] = n
        words[buffers.req_step] = tag.step
        words[buffers.req_mb] = tag.microbatch
        words[buffers.req_seq] = seq  # publish last (x86-64 TSO)
        return seq

    def _wait(
        self,
        ffn_rank: int,
        slot: int,
        seq: int,
        tag: Tag,
        deadline: float,
        awaited: Collection[int],
    ) -> torch.Tensor:
        """Wait until FFN rank ``ffn_rank`` answered ``seq`` in ``slot``; return ``[N, H]``
        (a view of the response buffer, valid until the slot is reused). Meanwhile checks the
        liveness of every FFN rank in ``awaited``, so that any dead one fails the wait."""
        buffers = self._slots[ffn_rank][slot]
        words = self._words[ffn_rank]
        if words[buffers.resp_seq] != seq:
            backoff = Backoff(self.wait, spin=words[_G_FFN_CPU] != self._cpu)
            next_check = backoff.start + LIVENESS_INTERVAL_S
            while words[buffers.resp_seq] != seq:
                now = backoff.pause()
                if now >= next_check:
                    for rank in awaited:
                        self._check_alive(rank)
                    if now >= deadline:
                        pid = self._creators[ffn_rank].pid
                        raise FFNTimeout(
                            f"FFN rank {ffn_rank} (pid {pid}) did not answer within "
                            f"timeout_s={self.spec.timeout_s}"
                        )
                    next_check = now + LIVENESS_INTERVAL_S
        rows = words[buffers.resp_ntok]
        if words[buffers.resp_err] or not 0 <= rows <= self.spec.max_tokens:
            self._raise_error(ffn_rank, slot, buffers)
        answer = (words[buffers.resp_step], words[buffers.resp_layer], words[buffers.resp_mb])
        if answer != tag:
            raise ProtocolError(answer_mismatch(ffn_rank, tag, Tag(*answer)))
        return buffers.views[rows][3]

    def _raise_error(self, ffn_rank: int, slot: int, buffers: _Slot) -> None:
        """Raise what an answer with an error or an out-of-range header means: the FFN rank's
        ``FFNServeError``, or ``ProtocolError`` for a corrupted header."""
        words = self._words[ffn_rank]
        error, rows = words[buffers.resp_err], words[buffers.resp_ntok]
        if not (0 <= error <= len(buffers.error_text) and 0 <= rows <= self.spec.max_tokens):
            raise ProtocolError(
                f"FFN rank {ffn_rank}: corrupted response header in slot {slot}: {rows} rows, "
                f"{error} error bytes (max_tokens={self.spec.max_tokens})"
            )
        text = bytes(buffers.error_text[:error]).decode(errors="replace")
        raise FFNServeError(f"FFN rank {ffn_rank}: {text}")

    def _check_alive(self, ffn_rank: int) -> None:
        """Raise ``FFNRankLost`` if FFN rank ``ffn_rank`` closed its endpoint or died."""
        creator = self._creators[ffn_rank]
        if self._words[ffn_rank][_G_STATE] == _STATE_CLOSED:
            raise FFNRankLost(
                ffn_rank, f"FFN rank {ffn_rank} (pid {creator.pid}) closed its shm endpoint"
            )
        if creator.died():
            raise FFNRankLost(ffn_rank, f"FFN rank {ffn_rank} (pid {creator.pid}) died")

    def close(self) -> None:
        """Unmap the segments (never unlinks: the FFN side owns them)."""
        segments = self._segments
        self._segments, self._slots, self._words = [], [], []
        for segment in segments:
            segment.release()


class ShmFFNTransport(FFNTransport):
    """FFN endpoint: creates and owns the segment for all attention ranks.

    Requests returned by ``recv`` are views of the shared slot: valid until ``reply``.
    """

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank)
        _refuse_if_not_tso()
        requested = spec.addresses[rank] if rank < len(spec.addresses) else ""
        prefix = requested or DEFAULT_PREFIX
        reap_stale_segments(prefix)
        self._layout = layout = _Layout.of(spec)
        self._segment = self._create(prefix, rank, layout)
        name = self._segment.name
        self._finalizer = weakref.finalize(self, unlink_if_creator, name, os.getpid())
        self._write_header(layout)
        self._words = self._segment.words
        self._slots = [
            (a, self._segment.slot(a, s))
            for a in range(spec.num_attention_ranks)
            for s in range(spec.num_slots)
        ]
        self._seen = [0] * len(self._slots)
        #: Per attention rank: the step schedule last read from its schedule words (``None``:
        #: none yet), and where those words start (word 0, the step, is 0 until one is).
        self._schedules: list[StepSchedule | None] = [None] * spec.num_attention_ranks
        self._schedule_bases = [layout.schedule_word(a) for a in range(spec.num_attention_ranks)]
        self._backoff = Backoff(wait or WaitPolicy())
        self._idle = False
        self._cpu = -1

    @staticmethod
    def _create(prefix: str, rank: int, layout: _Layout) -> _Segment:
        """A new segment under a fresh random name; a taken name (a file someone planted) is
        skipped, so it cannot keep the FFN rank from starting."""
        taken = []
        for _ in range(_CREATE_ATTEMPTS):
            name = f"{prefix}{os.getpid()}_f{rank}_{secrets.token_hex(8)}"
            try:
                return _Segment.create(name, layout)
            except FileExistsError:
                taken.append(name)
        raise TransportError(
            f"FFN rank {rank}: could not create a shared-memory segment in {SHM_DIR}: "
            f"{_CREATE_ATTEMPTS} fresh names were all taken ({', '.join(taken[:2])}, ...)"
        )

    def _write_header(self, layout: _Layout) -> None:
        words = self._segment.words
        for i, value in enumerate(layout.params):
            words[_G_LAYOUT + i] = value
        words[_G_VERSION] = _VERSION
        words[_G_PID] = os.getpid()
        words[_G_PIDNS] = pid_namespace()
        words[_G_FFN_CPU] = -1
        for a in range(self.spec.num_attention_ranks):
            words[_G_ATTN_CPU + a] = -1
        words[_G_STATE] = _STATE_OPEN
        words[_G_MAGIC] = _MAGIC

    @property
    def address(self) -> str:
        return self._segment.name

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """See ``FFNTransport.recv``: every pending request, in dispatch order per rank."""
        self._cpu = current_cpu()
        requests = self._poll()
        if requests:
            self._idle = False
            return requests
        if not self._idle:  # first wait after serving: start again from the spin stage
            self._idle = True
            self._backoff.reset()
        self._backoff.set_spin(self._spin_ok())
        deadline = time.perf_counter() + timeout_s
        while True:
            now = self._backoff.pause()
            requests = self._poll()
            if requests:
                self._idle = False
                return requests
            if now >= deadline:
                return []

    def _spin_ok(self) -> bool:
        """Spin only if no attention rank last dispatched from the CPU we run on."""
        words, cpu = self._words, self._cpu
        return all(words[_G_ATTN_CPU + a] != cpu for a in range(self.spec.num_attention_ranks))

    def _poll(self) -> list[FFNRequest]:
        words, schedules, bases = self._words, self._schedules, self._schedule_bases
        requests = []
        max_tokens = self.spec.max_tokens
        for i, (attention_rank, slot) in enumerate(self._slots):
            seq = words[slot.req_seq]
            if seq == self._seen[i]:
                continue
            self._seen[i] = seq
            num_tokens = words[slot.req_ntok]
            if not 0 <= num_tokens <= max_tokens:
                self._refuse_header(slot, seq, num_tokens)
                continue
            x, ids, weights, out = slot.views[num_tokens]
            step = words[slot.req_step]
            schedule = schedules[attention_rank]
            if (schedule is None or schedule.step != step) and words[bases[attention_rank]]:
                schedule = self._read_schedule(attention_rank)
            requests.append(
                FFNRequest(
                    attention_rank,
                    words[slot.req_layer],
                    x,
                    ids,
                    weights,
                    (i, seq),
                    out,
                    step,
                    words[slot.req_mb],
                    schedule,
                )
            )
        if len(requests) > 1:
            requests.sort(key=lambda r: (r.src_rank, r.reply_key[1]))
        return requests

    def _refuse_header(self, slot: _Slot, seq: int, num_tokens: int) -> None:
        """Answer a request whose header is out of range with an error (its payload is not
        read): the attention rank fails the combine with the reason."""
        words = self._words
        text = (
            f"corrupted request header: {num_tokens} tokens, allowed 0..{self.spec.max_tokens} "
            "(max_tokens)"
        ).encode()
        slot.error_text[: len(text)] = text
        words[_G_FFN_CPU] = self._cpu
        words[slot.resp_ntok] = 0
        words[slot.resp_err] = len(text)
        words[slot.resp_step] = words[slot.req_step]
        words[slot.resp_layer] = words[slot.req_layer]
        words[slot.resp_mb] = words[slot.req_mb]
        words[slot.resp_seq] = seq  # publish last (x86-64 TSO)

    def _read_schedule(self, attention_rank: int) -> StepSchedule:
        """The last schedule ``attention_rank`` announced, read from its schedule words (when a
        request names another step than the one held, and the rank announced one)."""
        base = self._schedule_bases[attention_rank]
        encoded = self._words[base : base + self._layout.schedule_words].tolist()
        held = self._schedules[attention_rank] = StepSchedule.from_words(encoded)
        return held

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """See ``FFNTransport.reply``; ``out``: ``[N, H]``, converted to ``spec.dtype``, or
        ``request.reply_buffer`` itself (already in place: nothing is copied)."""
        index, seq = request.reply_key
        slot = self._slots[index][1]
        buffer = request.reply_buffer
        if out is not buffer and out.shape != buffer.shape:
            n, hidden = buffer.shape
            raise ValueError(f"reply must be [{n}, {hidden}], got {out.shape}")
        words = self._words
        if words[slot.req_seq] != seq:
            return  # superseded: the attention rank gave up on it and reused the slot
        if out is not buffer:
            buffer.copy_(out)
        self._publish(request, slot, seq, buffer.shape[0], 0)

    def reply_error(self, request: FFNRequest, message: str) -> None:
        """See ``FFNTransport.reply_error``: the text goes into the slot's response area
        (truncated to it), its length into the response header."""
        index, seq = request.reply_key
        slot = self._slots[index][1]
        if self._words[slot.req_seq] != seq:
            return  # superseded, as in ``reply``
        text = message.encode()[: len(slot.error_text)] or b"?"
        slot.error_text[: len(text)] = text
        self._publish(request, slot, seq, 0, len(text))

    def _publish(
        self, request: FFNRequest, slot: _Slot, seq: int, num_tokens: int, error_bytes: int
    ) -> None:
        """Write the response header (the request's tag, the answer's size) and publish it."""
        words = self._words
        words[_G_FFN_CPU] = self._cpu
        words[slot.resp_ntok] = num_tokens
        words[slot.resp_err] = error_bytes
        words[slot.resp_step] = request.step
        words[slot.resp_layer] = request.layer
        words[slot.resp_mb] = request.microbatch
        words[slot.resp_seq] = seq  # publish last (x86-64 TSO)

    def close(self) -> None:
        """Mark the segment closed (waiting attention ranks fail fast), unlink and unmap it."""
        if not self._finalizer.alive:
            return
        self._words[_G_STATE] = _STATE_CLOSED
        self._finalizer()
        self._slots, self._words = [], None
        self._segment.release()


class ShmBackend(PointToPointBackend):
    """One host, shared memory; x86-64 only (``host.shm_platform_problem``)."""

    name = "shm"
    attention = ShmAttentionTransport
    ffn = ShmFFNTransport

    @classmethod
    def host_problem(cls) -> str | None:
        return shm_platform_problem()

    @classmethod
    def reap_stale(cls) -> list[str]:
        return reap_stale_segments()
