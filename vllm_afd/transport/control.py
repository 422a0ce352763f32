"""The control plane: every message says which step, layer and microbatch it belongs to.

An attention rank announces each forward step to every FFN rank before its first request of
that step (``AttentionTransport.begin_step``) with a ``StepSchedule``: the step number, the
tokens of each microbatch (their count is the number of microbatches), the MoE layers the step
visits (the model's own list, ``TransportSpec.moe_layers``) and its mode (a normal step, or a
CUDA-graph capture, whose requests carry no real tokens). Every request then carries its
``Tag`` (step, layer, microbatch), and every answer the tag of its request.

The FFN side checks each request against its sender's schedule on receipt
(``ScheduleChecker``): same step, a microbatch the schedule has, no more tokens than that
microbatch holds, a layer of the schedule, and layers of one microbatch in the schedule's
order. The attention side checks that an answer carries its request's use (on the slot plane,
the flag's value). A mismatch is a ``base.ProtocolError`` naming both sides: never silent
corruption. (This module imports nothing
of the package: the checks return the reason, and their callers raise or reply it.)

An FFN side that serves requests as they come needs the schedule to check them (and, on the slot
plane, to read a request's layer: its flag carries the layer's position in the step). One that
serves whole steps (``slots.SteppedPlaneFFN``) needs it to know which uses of its slots a step
makes and how many rows each carries, which is why the schedule is a message of its own. The
slot plane serves only announced steps (a benchmark or test driving a transport directly
announces them too).

Encoding (the control block's words, ``control_block.py``): a schedule is a fixed number of
int64 words (``words``): step, mode, microbatch count, ``WIRE_MICROBATCHES`` token counts, then
a bitmap of layer numbers, enough words for the spec's largest MoE layer number
(``schedule_words``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: Microbatch token counts a schedule has room for on the wire (at least the largest
#: ``--afd-microbatches``, ``config.MAX_MICROBATCHES``; a test keeps them in step).
WIRE_MICROBATCHES = 8
_FIXED_WORDS = 3 + WIRE_MICROBATCHES


class Mode(enum.IntEnum):
    """What kind of step a schedule announces."""

    RUN = 0
    #: CUDA-graph capture: the requests are recorded, not served with real tokens.
    CAPTURE = 1


class Tag(NamedTuple):
    """Which step, MoE layer (the model's layer number) and microbatch a message belongs to.

    A named tuple: built on every dispatch, and compared with the tuple an answer carries."""

    step: int
    layer: int
    microbatch: int

    def __str__(self) -> str:
        return f"step {self.step}, layer {self.layer}, microbatch {self.microbatch}"


@dataclass(frozen=True)
class StepSchedule:
    """One forward step of one attention rank, as announced to every FFN rank.

    Attributes:
        step: the attention rank's step number (1, 2, ...; 0 is "never announced").
        microbatch_tokens: tokens of each microbatch of the step, in microbatch order.
        layers: the MoE layers the step visits, ascending (the model's layer numbers).
        mode: ``Mode.RUN`` or ``Mode.CAPTURE``.
    """

    step: int
    microbatch_tokens: tuple[int, ...]
    layers: tuple[int, ...]
    mode: Mode = Mode.RUN

    def __post_init__(self) -> None:
        if not 1 <= len(self.microbatch_tokens) <= WIRE_MICROBATCHES:
            raise ValueError(
                f"a step has 1 to {WIRE_MICROBATCHES} microbatches, got {self.microbatch_tokens}"
            )
        if list(self.layers) != sorted(set(self.layers)) or min(self.layers, default=0) < 0:
            raise ValueError(f"layers must be ascending layer numbers, got {self.layers}")

    def words(self, size: int) -> list[int]:
        """The schedule as ``size`` int64 words (``schedule_words`` of the spec's layers)."""
        tokens = list(self.microbatch_tokens)
        num_layer_words = size - _FIXED_WORDS
        bitmap = [0] * num_layer_words
        for layer in self.layers:
            if layer >= 64 * num_layer_words:
                raise ValueError(f"layer {layer} does not fit a schedule of {size} words")
            bitmap[layer // 64] |= 1 << (layer % 64)
        bitmap = [b - (1 << 64) if b >= 1 << 63 else b for b in bitmap]  # as signed int64
        padding = [0] * (WIRE_MICROBATCHES - len(tokens))
        return [self.step, int(self.mode), len(tokens), *tokens, *padding, *bitmap]

    @classmethod
    def from_words(cls, words: Sequence[int]) -> StepSchedule:
        """Inverse of ``words``."""
        step, mode, count = words[0], words[1], words[2]
        tokens = tuple(words[3 : 3 + count])
        layers = []
        for i, word in enumerate(words[_FIXED_WORDS:]):
            word &= (1 << 64) - 1
            layers += [64 * i + bit for bit in range(64) if word >> bit & 1]
        return cls(step, tokens, tuple(layers), Mode(mode))


def schedule_words(moe_layers: Sequence[int]) -> int:
    """Words of an encoded schedule for a spec with these MoE layers: the fixed part and a
    bitmap word per 64 layer numbers (at least one)."""
    return _FIXED_WORDS + max(moe_layers, default=0) // 64 + 1


class ScheduleChecker:
    """FFN side: checks each request's tag against its sender's schedule (see module doc).

    Args:
        ffn_rank: this FFN rank (named in errors).
        layers: the MoE layers this rank serves (the model's layer numbers).
    """

    def __init__(self, ffn_rank: int, layers: Sequence[int]) -> None:
        self.ffn_rank = ffn_rank
        self.layers = frozenset(layers)
        #: (attention rank, microbatch) -> (step, position in the schedule of the last layer).
        self._last: dict[tuple[int, int], tuple[int, int]] = {}

    def check(
        self, src: int, tag: Tag, num_tokens: int, schedule: StepSchedule | None
    ) -> str | None:
        """Why a request of ``num_tokens`` tokens from attention rank ``src`` tagged ``tag``
        does not fit ``schedule`` (the last one ``src`` announced), naming both sides; ``None``
        when it fits."""
        why = self._mismatch(src, tag, num_tokens, schedule)
        if why is None:
            return None
        return (
            f"FFN rank {self.ffn_rank} refused a request from attention rank {src} tagged "
            f"({tag}): {why}"
        )

    def _mismatch(
        self, src: int, tag: Tag, num_tokens: int, schedule: StepSchedule | None
    ) -> str | None:
        if tag.layer not in self.layers:
            return f"layer {tag.layer} is not an MoE layer here (MoE layers: {sorted(self.layers)})"
        if schedule is None:
            return None if tag.step == 0 else f"step {tag.step} was never announced"
        if tag.step != schedule.step:
            return f"its last announced step is {schedule.step}"
        k = len(schedule.microbatch_tokens)
        if not 0 <= tag.microbatch < k:
            return f"step {schedule.step} has {k} microbatch(es)"
        limit = schedule.microbatch_tokens[tag.microbatch]
        if num_tokens > limit:
            return f"{num_tokens} tokens, the microbatch has {limit}"
        if tag.layer not in schedule.layers:
            return f"the step visits layers {list(schedule.layers)}"
        position = schedule.layers.index(tag.layer)
        key = (src, tag.microbatch)
        last = self._last.get(key)
        if last is not None and last[0] == tag.step and position <= last[1]:
            return f"layer {schedule.layers[last[1]]} of this microbatch came before it"
        self._last[key] = (tag.step, position)
        return None


@dataclass(frozen=True)
class Part:
    """One attention rank's share of a use of a slot on the FFN side of a step served whole:
    its rows (from its schedule) and the layer's position in its step."""

    attention_rank: int
    rows: int
    position: int


#: One use of a slot in a step served whole: ``(layer, slot, parts)``.
Use = tuple[int, int, tuple[Part, ...]]
#: What a CUDA graph of a whole step is keyed by (``Step.shape``): the answer buffers the FFN
#: side mapped, then per attention rank in the step its schedule's words after the step number
#: (``StepSchedule.words``: a few small ints, cheap to hash at every step).
StepShape = tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]


@dataclass(frozen=True, eq=False)
class Step:
    """A step shape served whole by an FFN rank (``base.ServesSteps``): the uses of its slots
    in order, layer by layer and the microbatches of a layer in turn. The step numbers are not
    in it (they are device words the uses read), so an FFN endpoint builds one ``Step`` per
    shape and hands the same object out at every step of that shape; compared by identity.

    ``capture``: the attention ranks are capturing CUDA graphs of a step (``Mode.CAPTURE``:
    nothing is sent); its uses and shape are those of the step their replays will announce
    (each rank's schedule as a step to run), so that an FFN rank with graphs captures its own
    now, at start, not on the token path."""

    uses: tuple[Use, ...]
    shape: StepShape
    capture: bool = False

    @classmethod
    def of(
        cls, schedules: dict[int, StepSchedule], shape: StepShape, capture: bool = False
    ) -> Step:
        layers = sorted({layer for s in schedules.values() for layer in s.layers})
        slots = max((len(s.microbatch_tokens) for s in schedules.values()), default=0)
        uses: list[Use] = []
        for layer in layers:
            for slot in range(slots):
                parts = tuple(
                    Part(a, s.microbatch_tokens[slot], s.layers.index(layer))
                    for a, s in sorted(schedules.items())
                    if layer in s.layers and slot < len(s.microbatch_tokens)
                )
                if parts:
                    uses.append((layer, slot, parts))
        return cls(tuple(uses), shape, capture)
