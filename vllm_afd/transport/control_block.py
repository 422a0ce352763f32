"""The slot plane's control block: per FFN rank, in host shared memory whatever the data plane's
memory (the FFN rank's host reads it, with no device sync): who the FFN process is, the handle
of its request buffer, and per attention rank the handle of its answer buffer and a ring of its
last ``SCHEDULE_RING`` announced ``StepSchedule``s (``control.py``). The FFN side of the plane
reads a request's layer from its sender's schedule (requests served as they come) or serves
the uses the schedules name (whole steps); an attention endpoint watches the FFN process
through it and fails fast once it closed.

Why a ring. An FFN rank serving whole steps takes every attention rank's next step in order
(``taken``); an attention rank may announce a few steps before the FFN rank takes the first:
the CUDA-graph captures at start announce without a device sync (``Mode.CAPTURE``), so one
rank can capture a size and announce the next warm-up before a slower rank announced its own
capture, and one mailbox would lose the capture the FFN rank still waits for. Step ``s`` goes
into entry ``s % SCHEDULE_RING``; an attention rank whose FFN rank serves whole steps announces
into an entry only once the step there was taken (``untaken``; ``endpoint._announce`` waits
for it)."""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence

import torch

from vllm_afd.host import (
    map_segment,
    pid_namespace,
    process_start_time,
    reap_segments,
    unlink_if_creator,
)
from vllm_afd.transport.control import StepSchedule, schedule_words
from vllm_afd.transport.slot_plane import PLANE_PREFIX, PlaneLayout, Push
from vllm_afd.transport.slot_plane_host import create_fresh

_MAGIC = 0x3130_5354_4F4C_5341  # b"ASLOTS01" little-endian
_VERSION = 3
_OPEN, _CLOSED = 1, 2
# header words: magic, version, pid, pid namespace, state, handle bytes, schedule words, then
# the layout's params from word 8
_W_MAGIC, _W_VERSION, _W_PID, _W_PIDNS, _W_STATE, _W_HANDLE, _W_SCHEDULE = range(7)
_W_PARAMS = 8
_HEADER_WORDS = 16
#: Room for a buffer's handle (a segment name; a CUDA IPC handle as JSON).
HANDLE_BYTES = 1024
#: Words per attention rank after its schedules: its answer handle's generation (odd while it
#: is being written: a seqlock) and length, then the last of its steps the FFN rank took.
_ANSWER_WORDS = 2
_RANK_WORDS = _ANSWER_WORDS + 1
#: Schedules kept per attention rank (module docstring).
SCHEDULE_RING = 4


class ControlBlock:
    """An FFN rank's control block: who the FFN process is, the handle of its request buffer,
    and per attention rank the handle of its answer buffer (``offer_answers``) and the last
    ``StepSchedule`` it announced (``control.StepSchedule.words``). In a ``/dev/shm`` segment
    (mode 0600: ``create``, ``attach``), or in a buffer of a memory whose peers' stores arrive
    as messages (``buffer`` and ``push``: ``nixl.py``), where an attention rank writes its
    mirror of the block and ``push`` carries the words to the FFN rank.

    A schedule is written as a seqlock over x86-64 store order: its step word is zeroed, the
    other words written, then the step word; a reader takes the step word, the rest, and the
    step word again, and keeps only a read where both agree. A pushed line is stored by its
    owner's own thread, the step word last, so it reads whole there too."""

    def __init__(
        self,
        name: str,
        buffer: torch.Tensor,
        layout: PlaneLayout,
        words_per: int,
        push: Push | None = None,
        mm: mmap.mmap | None = None,
    ) -> None:
        self.name, self.buffer, self.layout, self.words_per = name, buffer, layout, words_per
        self.mm, self._push = mm, push
        self.data = buffer.numpy().data.cast("B")
        self.words = self.data.cast("q")
        #: Unlinks the block at its creator's exit (``create``); attached blocks have none.
        self._finalizer: weakref.finalize[[str, int], ControlBlock] | None = None

    @staticmethod
    def size(layout: PlaneLayout, words_per: int) -> int:
        ranks = layout.num_attention_ranks
        return (
            8 * (_HEADER_WORDS + ranks * (SCHEDULE_RING * words_per + _RANK_WORDS))
            + (1 + ranks) * HANDLE_BYTES
        )

    @classmethod
    def create(
        cls,
        layout: PlaneLayout,
        moe_layers: Sequence[int],
        handle: str,
        prefix: str = PLANE_PREFIX,
        rank: int = 0,
    ) -> ControlBlock:
        """A new block in ``/dev/shm``, named ``<prefix><pid>_f<rank>_...``."""
        size = cls.size(layout, schedule_words(moe_layers))
        name, mm = create_fresh(f"{prefix}{os.getpid()}_f{rank}_", size)
        block = cls.format(name, _tensor(mm), layout, moe_layers, handle, pid_namespace(), mm)
        block._finalizer = weakref.finalize(block, unlink_if_creator, name, os.getpid())
        return block

    @classmethod
    def format(
        cls,
        name: str,
        buffer: torch.Tensor,
        layout: PlaneLayout,
        moe_layers: Sequence[int],
        handle: str,
        pid_ns: int,
        mm: mmap.mmap | None = None,
    ) -> ControlBlock:
        """This process's block in ``buffer`` (``size`` bytes, zeroed), open; ``pid_ns``:
        where its pid means something (``Creator.watch``)."""
        data = handle.encode()
        if len(data) > HANDLE_BYTES:
            raise ValueError(f"request buffer handle of {len(data)} bytes, room for {HANDLE_BYTES}")
        block = cls(name, buffer, layout, schedule_words(moe_layers), mm=mm)
        words = block.words
        for i, value in enumerate(layout.params):
            words[_W_PARAMS + i] = value
        start = block._handle_at(-1)
        block.data[start : start + len(data)] = data
        words[_W_HANDLE], words[_W_SCHEDULE] = len(data), block.words_per
        words[_W_VERSION], words[_W_PID], words[_W_PIDNS] = _VERSION, os.getpid(), pid_ns
        words[_W_STATE] = _OPEN
        words[_W_MAGIC] = _MAGIC
        return block

    @classmethod
    def attach(cls, name: str, layout: PlaneLayout, moe_layers: Sequence[int]) -> ControlBlock:
        """Map an FFN rank's block (``host.map_segment``: ours, mode 0600, of the spec's size).

        Raises:
            ValueError: if its layout is not ``layout``'s (the two sides disagree on the spec).
        """
        mm = map_segment(name, cls.size(layout, schedule_words(moe_layers)))
        return cls.open(name, _tensor(mm), layout, moe_layers, mm=mm)

    @classmethod
    def open(
        cls,
        name: str,
        buffer: torch.Tensor,
        layout: PlaneLayout,
        moe_layers: Sequence[int],
        push: Push | None = None,
        mm: mmap.mmap | None = None,
    ) -> ControlBlock:
        """The block in ``buffer`` (an FFN rank's, mapped or mirrored), checked.

        Raises:
            ValueError: if its layout is not ``layout``'s (the two sides disagree on the spec).
        """
        block = cls(name, buffer, layout, schedule_words(moe_layers), push, mm)
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

    def _handle_at(self, attention_rank: int) -> int:
        """Byte offset of ``attention_rank``'s answer handle (-1: the request buffer's)."""
        return len(self.data) - (self.layout.num_attention_ranks - attention_rank) * HANDLE_BYTES

    @property
    def handle(self) -> str:
        """The request buffer's handle."""
        start = self._handle_at(-1)
        return bytes(self.data[start : start + self.words[_W_HANDLE]]).decode()

    def offer_answers(self, attention_rank: int, handle: str) -> None:
        """Publish ``attention_rank``'s answer buffer (``AttentionPlane.answer_handles``) before
        it announces a step: its generation word is odd while the handle is written."""
        data = handle.encode()
        if len(data) > HANDLE_BYTES:
            raise ValueError(f"answer buffer handle of {len(data)} bytes, room for {HANDLE_BYTES}")
        words, at = self.words, self._answer_word(attention_rank)
        start = self._handle_at(attention_rank)
        writing = words[at] | 1
        words[at] = writing
        self.data[start : start + len(data)] = data
        words[at + 1] = len(data)
        words[at] = writing + 1
        if self._push is not None:
            self._push((self.buffer[start : start + len(data)],), self._line(at, _ANSWER_WORDS))

    def answers(self, attention_rank: int) -> tuple[int, str] | None:
        """``(generation, handle)`` of ``attention_rank``'s answer buffer, or ``None`` if none
        was offered or one is being written."""
        words, at = self.words, self._answer_word(attention_rank)
        start = self._handle_at(attention_rank)
        generation = words[at]
        handle = bytes(self.data[start : start + min(words[at + 1], HANDLE_BYTES)])
        if not generation or generation % 2 or words[at] != generation:
            return None
        return generation, handle.decode(errors="replace")

    def answers_generation(self, attention_rank: int) -> int:
        """Grows each time ``attention_rank`` offers an answer buffer (0: none yet)."""
        return self.words[self._answer_word(attention_rank)]

    def _answer_word(self, attention_rank: int) -> int:
        return self._base(attention_rank) + SCHEDULE_RING * self.words_per

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
        return _HEADER_WORDS + attention_rank * (SCHEDULE_RING * self.words_per + _RANK_WORDS)

    def _entry(self, attention_rank: int, step: int) -> int:
        """The first word of the ring entry of ``attention_rank``'s step ``step``."""
        return self._base(attention_rank) + step % SCHEDULE_RING * self.words_per

    def announce(
        self, attention_rank: int, schedule: StepSchedule, encoded: Sequence[int] = ()
    ) -> None:
        """Write ``attention_rank``'s schedule into its ring entry (the seqlock of the class
        docstring); ``encoded``: its words where the caller has them (``StepSchedule.words``
        of this block's ``words_per``: an attention rank encodes once for every FFN rank)."""
        words, base = self.words, self._entry(attention_rank, schedule.step)
        encoded = encoded or schedule.words(self.words_per)
        words[base] = 0
        for i in range(len(encoded) - 1, 0, -1):
            words[base + i] = encoded[i]
        words[base] = encoded[0]
        if self._push is not None:
            self._push((), self._line(base, self.words_per))

    def _line(self, word: int, count: int) -> torch.Tensor:
        """Words ``word .. word + count`` of the block, as an int64 tensor (``push``'s line)."""
        return self.buffer[8 * word : 8 * (word + count)].view(torch.int64)

    def announced_steps(self, attention_rank: int) -> list[int]:
        """The steps in ``attention_rank``'s ring (0: an entry empty or being written)."""
        words, base, size = self.words, self._base(attention_rank), self.words_per
        return [words[base + i * size] for i in range(SCHEDULE_RING)]

    def announced_step(self, attention_rank: int) -> int:
        """The step ``attention_rank`` announced last (0: none)."""
        return max(self.announced_steps(attention_rank))

    def schedule(self, attention_rank: int) -> StepSchedule | None:
        """``attention_rank``'s last schedule, or ``None`` if none or being written."""
        encoded = self.schedule_words(attention_rank, self.announced_step(attention_rank))
        return None if encoded is None else StepSchedule.from_words(encoded)

    def schedule_words(self, attention_rank: int, step: int) -> tuple[int, ...] | None:
        """``attention_rank``'s schedule of ``step`` as its words (``StepSchedule.words``:
        decoding them is left to a reader that has not seen them before), or ``None`` if its
        entry holds another step or is being written."""
        if step <= 0:
            return None
        words, base = self.words, self._entry(attention_rank, step)
        if words[base] != step:
            return None
        encoded = tuple(words[base : base + self.words_per])
        if words[base] != step:
            return None
        return encoded

    def take(self, attention_rank: int, step: int) -> None:
        """The FFN rank took ``attention_rank``'s step ``step`` (serving whole steps): its
        ring entry may be written again (``untaken``)."""
        self.words[self._answer_word(attention_rank) + _ANSWER_WORDS] = step

    def taken_word(self, attention_rank: int) -> memoryview:
        """The last step of ``attention_rank`` the FFN rank took, as a one-word view."""
        at = self._answer_word(attention_rank) + _ANSWER_WORDS
        return self.words[at : at + 1]

    def untaken(self, attention_rank: int, step: int) -> int:
        """The step in the ring entry of ``attention_rank``'s ``step`` that the FFN rank has not
        taken yet (serving whole steps), or 0 when the entry may be written."""
        held = self.words[self._entry(attention_rank, step)]
        return 0 if held <= self.taken_word(attention_rank)[0] or held >= step else held

    def close(self, creator: bool = False) -> None:
        """Unmap; the creator marks the block closed (waiting attention ranks fail fast) and
        unlinks it."""
        if creator:
            self.words[_W_STATE] = _CLOSED
            if self._finalizer is not None:
                self._finalizer()
        self.words.release()
        self.data.release()
        del self.buffer  # the tensor's export of the mapping goes with it
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view of the block's tensor outlives it
                pass


def _tensor(mm: mmap.mmap) -> torch.Tensor:
    return torch.frombuffer(mm, dtype=torch.uint8)


def reap_stale_control_blocks(prefix: str = PLANE_PREFIX) -> list[str]:
    """Unlink control blocks named ``<prefix>...`` and data segments named ``<prefix>data_...``
    whose creator, in this pid namespace, is dead. Returns the names unlinked."""
    own_ns = pid_namespace()
    data = prefix + "data_"

    def is_stale(name: str, header: Sequence[int]) -> bool:
        if name.startswith(data) or header[_W_MAGIC] != _MAGIC or header[_W_PIDNS] != own_ns:
            return False
        return process_start_time(header[_W_PID]) is None

    def creator_dead(name: str, header: Sequence[int]) -> bool:
        pid = name[len(data) :].split("_", 1)[0]
        return pid.isdigit() and process_start_time(int(pid)) is None

    return reap_segments(prefix, _HEADER_WORDS, is_stale) + reap_segments(data, 0, creator_dead)
