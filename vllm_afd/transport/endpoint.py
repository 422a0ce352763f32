"""The attention endpoint, written once: ``AttentionEndpoint``, the slot plane's attention side
on every memory (``slots.py``: host shared memory, device memory; ``nixl.py``: NIXL).

``dispatch`` checks its arguments, splits the batch by FFN rank, takes the microbatch's slot
(slot ``s`` carries microbatch ``s``, inside an announced step: ``begin_step``) and sends each
FFN rank its rows (``slot_plane.AttentionPlane.send``); ``combine`` waits for every FFN rank's
answer until one deadline, sums the answers into the original order and frees the slot
(``combine_hook`` splits the two for vLLM's DBO). A request's identity is its use's value
(``step << POSITION_BITS | position + 1``: ``slot_plane``). A backend of another memory than
this process's (``plane_memory``) supplies only the memory (``_make_memory``), how an FFN
rank's control block is reached (``_connect``) and how its process is watched (``_watch``).

Failover. A wait raises ``FFNRankLost`` when an FFN rank is gone (its process died, it closed
its endpoint, the failover supervisor declared it lost). With failover on (``spec.directory``),
the attention side then waits for the rank's replacement (``directory.wait_for_replacement``,
at most ``spec.failover_s``), reconnects, tells it the current step's schedule, and sends it
again every request the lost rank had not answered: a handle keeps its inputs until
``combine`` (the caller must leave ``x``, ``topk_ids`` and ``topk_weights`` unchanged until
then; the attention hook's custom op does), and a request sent before the rank's last
replacement is sent again before it is waited for. The answers are the ones the lost rank would
have given (same experts, same inputs), so a failover changes no token. ``redispatched``
counts the requests sent again. A request the FFN rank failed (``FFNServeError``) goes once
more, to the rank's replacement (``_serve_error_as_loss``). With the device's waits (a wait
cannot watch its peer), a watchdog thread checks the FFN ranks' liveness and aborts the step's
waits (``RecordedWaits.abort``); the next announcement links the replacement and raises
``StepsFailed`` for the steps the loss spoiled (their requests fail; nothing is sent again).
A rank lost before this attention rank first linked it (it died while the engine started) is
awaited and linked the same way (``_link``), instead of failing the engine's start; a
replacement gone before it was linked is passed over for the next one.

Two pure functions define the protocol's arithmetic:

* ``split_by_ffn_rank`` decides, per FFN rank, which rows of the batch must travel there (a token
  goes to every FFN rank that owns at least one of its top-k experts; contiguous placement). On
  device memory (fixed shapes) every row goes to every FFN rank (``filters_rows``).
* ``combine_partials`` adds the per-FFN-rank partial answers back into a ``[T, H]`` tensor in the
  original order, FFN ranks in ascending order, starting from zero. That summation order is the
  one ``reference.reference_moe_combine`` uses, so that results can be compared exactly.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm_afd.errors import (
    FFNRankLost,
    FFNServeError,
    FFNTimeout,
    ProtocolError,
    StepsFailed,
    TransportError,
)
from vllm_afd.host import Creator, UnsafeFileError
from vllm_afd.transport import directory
from vllm_afd.transport.base import (
    AttentionTransport,
    DispatchHandle,
    Reconnects,
    StateT,
    TransportSpec,
)
from vllm_afd.transport.control import Mode, StepSchedule, Tag
from vllm_afd.transport.control_block import SCHEDULE_RING, ControlBlock
from vllm_afd.transport.slot_plane import (
    CPU_WORD,
    PLANE_PREFIX,
    POSITION_BITS,
    WATCH_INTERVAL_S,
    AttentionPlane,
    PlaneLayout,
    PlaneMemory,
)
from vllm_afd.transport.slot_plane_host import HostPlaneMemory, await_word
from vllm_afd.transport.wait import Backoff, ViewCache, WaitPolicy, current_cpu

#: Failover: FFN ranks that fail one request before it fails on the attention side (the rank
#: it was sent to, then its replacement).
SERVE_ERROR_ATTEMPTS = 2
logger = logging.getLogger("vllm.afd")
_T = TypeVar("_T")


@functools.lru_cache(maxsize=64)
def _positions(layers: tuple[int, ...]) -> dict[int, int]:
    """Each layer's position in a step through ``layers`` (shared: read, never written)."""
    return {layer: i for i, layer in enumerate(layers)}


def device_waits(settings: Mapping[str, Any]) -> bool:
    """The plane's waits are the device's (``waits: device``; set on GPUs)."""
    waits: object = settings.get("waits", "host")
    return waits == "device"


def plane_memory(spec: TransportSpec, prefix: str = PLANE_PREFIX + "data_") -> PlaneMemory:
    """The plane's memory in this process: with the device's waits the current GPU's where
    CUDA is; else the host's (data segments named ``<prefix>...``), also for CPU attention
    ranks whose FFN ranks compute on a GPU."""
    waits = device_waits(spec.config)
    if waits and torch.cuda.is_available():
        from vllm_afd.transport.slot_plane_cuda import CudaPlaneMemory

        return CudaPlaneMemory(torch.cuda.current_device(), spec.timeout_s)
    return HostPlaneMemory(spec.timeout_s, prefix, device_waits=waits)


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
    ranks = spec.ffn_rank_table[topk_ids.long()]
    hit = torch.zeros(num_tokens, spec.num_ffn_ranks, dtype=torch.bool)
    hit.scatter_(1, ranks, True)
    split = {}
    for rank, column in enumerate(hit.t()):
        rows = column.nonzero().squeeze(1)
        if rows.numel():
            split[rank] = rows
    return split


def combine_partials(
    handle: DispatchHandle[StateT], partials: dict[int, torch.Tensor]
) -> torch.Tensor:
    """Sum per-FFN-rank partial answers into the original token order.

    Args:
        handle: the dispatch handle; ``handle.token_index[f]`` are the rows sent to rank ``f``.
        partials: ``{f: [N_f, H]}`` answers, same dtype as ``handle.dtype``; may be views of
            transport buffers (they are read, never kept).
    Returns:
        ``[T, H]`` ``handle.dtype``: row ``t`` is ``0 + sum_f partial_f[t]`` over ranks in
        ascending order. Rows that no rank answered are zero.
    Raises:
        ProtocolError: if an answer has another row count than the tokens sent to its rank
            (a corrupted header: never a silently short or long result).
    """
    num_tokens = handle.num_tokens
    out: torch.Tensor | None = None
    for rank, rows in handle.token_index.items():
        part, sent = partials[rank], rows.numel()
        if part.shape[0] != sent:
            raise ProtocolError(
                f"FFN rank {rank} answered {part.shape[0]} rows for the {sent} "
                f"token(s) of layer {handle.layer} sent to it"
            )
        if out is None and sent == num_tokens:
            out = part.clone()  # 0 + part == part exactly: skip the zero fill
            continue
        if out is None:
            out = part.new_zeros(num_tokens, handle.hidden_size)
        if sent == num_tokens:
            out += part  # every row (``rows`` is ``arange``): no index, none on a device
        else:
            out.index_add_(0, rows, part)
    if out is None:
        out = torch.zeros(num_tokens, handle.hidden_size, dtype=handle.dtype)
    return out


@dataclass(slots=True)
class SendState:
    """``DispatchHandle.state`` of ``AttentionEndpoint``.

    Attributes:
        slot: the slot the dispatch holds on every FFN rank it sent to, until ``combine``.
        position: the layer's position in the announced step.
        value: the use's value, which every FFN rank's answer carries.
        tag: the requests' tag (named in errors).
        inputs: ``(x, topk_ids, topk_weights)`` as ``dispatch`` got them, to send again to a
            lost FFN rank's replacement.
        sent: ``{ffn_rank: the endpoint's replacement count when its request went out}``, in
            ascending rank order.
    """

    slot: int
    position: int
    value: int
    tag: Tag
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    sent: dict[int, int]


def check_dispatch_args(spec: TransportSpec, x: torch.Tensor, topk_ids: torch.Tensor) -> int:
    """Validate ``dispatch`` inputs cheaply and return the number of tokens ``T``.

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


class AttentionEndpoint(AttentionTransport, Reconnects):
    """The attention endpoint of every backend (module docstring): maps every FFN rank's control
    block (``spec.addresses``) and request buffer, owns an answer buffer for each, and
    dispatches only inside announced steps (``begin_step``), microbatch ``s`` in slot ``s``.

    Args:
        spec: the FFN group's spec; ``spec.addresses`` holds one address per FFN rank.
        rank: this attention rank, ``0 <= rank < spec.num_attention_ranks``.
        wait: how host waits are staged (default: ``WaitPolicy()``, poll window from the
            environment).
    """

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank)
        if not 0 <= rank < spec.num_attention_ranks:
            raise ValueError(f"attention rank {rank} outside [0, {spec.num_attention_ranks})")
        if len(spec.addresses) != spec.num_ffn_ranks:
            raise ValueError(
                f"{spec.backend} transport needs one address per FFN rank "
                f"({spec.num_ffn_ranks}), got {spec.addresses!r}"
            )
        self.wait = wait or WaitPolicy()
        rows = torch.arange(spec.max_tokens)
        self._rows = ViewCache(lambda n: rows[:n])
        #: Where each FFN rank is now, and its incarnation (the directory's, when there is one:
        #: a rank may have been replaced before this attention rank started).
        self.addresses = list(spec.addresses)
        self._incarnation = [1] * spec.num_ffn_ranks
        if spec.directory:
            for f, entry in enumerate(directory.entries(spec.directory, spec.num_ffn_ranks)):
                if entry is not None and entry.state == directory.UP:
                    self.addresses[f], self._incarnation[f] = entry.address, entry.incarnation
        #: Replacements seen (all ranks), and the count when each rank was last replaced.
        self.replacements = 0
        self._replaced_at = [0] * spec.num_ffn_ranks
        self.layout = layout = PlaneLayout.of(spec)
        self.memory = self._make_memory()
        self.controls: list[ControlBlock] = []
        self._creators: list[Creator] = []
        for f in range(spec.num_ffn_ranks):
            control, creator = self._link(f)
            self.controls.append(control)
            self._creators.append(creator)
        #: Control blocks of FFN ranks replaced since (``reconnect``) that the watchdog's
        #: thread unmaps at its next look (it may be reading one as the replacement is linked).
        self._unlinked: list[ControlBlock] = []
        #: It sends an FFN rank only the rows routed to it (``split_by_ffn_rank``); where waits
        #: record (device memory: fixed shapes), every row to every FFN rank.
        self.filters_rows = not self.memory.records_waits
        self.plane = AttentionPlane(layout, self.memory, rank, [c.handle for c in self.controls])
        for control, handle in zip(self.controls, self.plane.answer_handles, strict=True):
            control.offer_answers(rank, handle)
        self.step = self.plane.last_step()
        #: The announced step's layer positions, and its microbatches' tokens (one per slot).
        self._positions: dict[int, int] = {}
        self._tokens: tuple[int, ...] = ()
        #: Per slot, the position of its last use in this step (a use's value is sent once),
        #: and the slots no dispatch holds.
        self._used = [-1] * spec.num_slots
        self._free = list(range(spec.num_slots - 1, -1, -1))
        self._cpu = -1
        self._closed = threading.Event()
        self._watching = None
        if self.memory.records_waits:  # a wait cannot watch: a thread watches for it
            name = f"afd-plane-watchdog-{rank}"
            self._watching = threading.Thread(target=self._watchdog, name=name, daemon=True)
            self._watching.start()

    def _link(self, ffn_rank: int) -> tuple[ControlBlock, Creator]:
        """FFN rank ``ffn_rank``'s control block, mapped, and its process, watched. With
        failover, a rank lost before this attention rank first linked it (it died while the
        engine started) is a loss like any other: its replacement is awaited and linked
        instead of the engine's start failing."""
        try:
            return self._map(ffn_rank, self.addresses[ffn_rank])
        except FFNRankLost as lost:
            if not self.spec.fails_over:
                raise
            return self._relink(lost, lambda address: self._map(ffn_rank, address))[0]

    def _map(self, ffn_rank: int, address: str) -> tuple[ControlBlock, Creator]:
        """FFN rank ``ffn_rank``'s control block at ``address``, mapped, and its process,
        watched (``FFNRankLost`` where it is gone)."""
        control = self._connect(ffn_rank, address)
        try:
            return control, self._watch(ffn_rank, control)
        except FFNRankLost:
            control.close()
            raise

    def _make_memory(self) -> PlaneMemory:
        return plane_memory(self.spec)

    def _connect(self, ffn_rank: int, address: str) -> ControlBlock:
        """FFN rank ``ffn_rank``'s control block at ``address``, mapped (``FFNRankLost``
        where it is gone)."""
        try:
            return ControlBlock.attach(address, self.layout, self.spec.moe_layers)
        except FileNotFoundError:
            raise FFNRankLost(
                ffn_rank,
                f"FFN rank {ffn_rank}: control block {address!r} not found (FFN rank not "
                "started, or already gone)",
            ) from None
        except UnsafeFileError as exc:
            raise TransportError(f"FFN rank {ffn_rank}: {exc}") from None

    def _watch(self, ffn_rank: int, control: ControlBlock) -> Creator:
        """FFN rank ``ffn_rank``'s process, watched (``host.Creator``)."""
        return watch_creator(ffn_rank, control, control.pid_namespace)

    def _watchdog(self) -> None:
        """With the device's waits: every ``WATCH_INTERVAL_S``, the FFN ranks' liveness, as a
        host wait's watch checks it; a lost one aborts the step's waits at once
        (``RecordedWaits.abort``: the next announcement raises its ``FFNRankLost``) instead of
        letting each spin to its bound. Once per loss: a rank still lost at the next look (its
        replacement not linked yet: the announcement waits for it) must not abort the steps
        that follow."""
        aborted_for = None
        while not self._closed.wait(WATCH_INTERVAL_S):
            while self._unlinked:
                self._unlinked.pop().close()
            try:
                self._check_alive(range(len(self.controls)))
            except TransportError as lost:
                loss = (getattr(lost, "ffn_rank", None), tuple(self._incarnation))
                if loss != aborted_for:
                    aborted_for = loss
                    self.memory.abort(lost)  # type: ignore[attr-defined]

    def _announce(self, schedule: StepSchedule) -> None:
        """Raise what the earlier steps' device waits recorded (read without a device sync:
        ``RecordedWaits.check``; a lost FFN rank is replaced first, with failover), then start
        ``schedule``'s step (a step abandoned half-way leaves its slots to this one) and put it
        into every FFN rank's control block. A CUDA-graph capture touches neither the error
        word nor the step word (one set there would be baked into the graph); each replay's
        own announcement sets it."""
        if schedule.mode != Mode.CAPTURE:
            try:
                self.memory.check(schedule.step)
            except StepsFailed as failed:
                if isinstance(failed.cause, FFNRankLost):
                    self._recover(failed.cause)  # failover; raises without it
                raise
            self.plane.begin(schedule.step)
        self._positions = _positions(schedule.layers)
        self._tokens = schedule.microbatch_tokens[: self.spec.num_slots]
        self._free = list(range(self.spec.num_slots - 1, -1, -1))
        self._used = [-1] * self.spec.num_slots
        encoded = schedule.words(self.controls[0].words_per)  # once for every FFN rank
        for ffn_rank in range(self.spec.num_ffn_ranks):
            while True:
                try:
                    if self.memory.records_waits:
                        self._await_ring(ffn_rank, schedule.step)
                    self.controls[ffn_rank].announce(self.rank, schedule, encoded)
                    break
                except FFNRankLost as lost:
                    self._recover(lost)

    def check_sampled(self, step: int) -> None:
        """``RecordedWaits.check_through``: the failures of ``step`` and earlier steps,
        raised before their sampled tokens leave (a lost FFN rank is replaced at the next
        announcement)."""
        self.memory.check_through(step)

    def _await_ring(self, ffn_rank: int, step: int) -> None:
        """With the device's waits FFN rank ``ffn_rank`` takes whole steps in order: wait until
        it took the step that ``step`` replaces in its ring of schedules
        (``control_block.py``), at most ``timeout_s``, watching it meanwhile. At once but for
        an attention rank ``SCHEDULE_RING`` steps ahead of it (announcements without a device
        sync: CUDA-graph captures)."""
        control = self.controls[ffn_rank]
        held = control.untaken(self.rank, step)
        if not held:
            return
        deadline = time.perf_counter() + self.spec.timeout_s
        backoff = Backoff(self.wait, pump=self.memory.pump)
        watch = lambda: self._check_alive((ffn_rank,))  # noqa: E731
        if await_word(control.taken_word(self.rank), held, deadline, backoff, watch) is None:
            raise FFNTimeout(
                f"FFN rank {ffn_rank} (pid {self._creators[ffn_rank].pid}) did not take step "
                f"{held} of attention rank {self.rank} within timeout_s={self.spec.timeout_s}; "
                f"its ring of {SCHEDULE_RING} announced schedules is full"
            )

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle[SendState]:
        """See ``AttentionTransport.dispatch``. Returns once every request is written and
        signalled (never blocks: the slot is this dispatch's alone); the handle keeps ``x``,
        ``topk_ids`` and ``topk_weights`` for failover (leave them unchanged until
        ``combine``). A failed send frees the slot and raises.

        Raises:
            ProtocolError: outside an announced step, past what it announced, or for a layer
                of the microbatch at or before one it already sent in this step (``_misuse``).
            RuntimeError: while the microbatch's slot holds a dispatch not yet combined.
        """
        spec = self.spec
        num_tokens = check_dispatch_args(spec, x, topk_ids)
        all_rows = self._rows[num_tokens]
        if self.filters_rows:
            split = split_by_ffn_rank(spec, topk_ids, all_rows)
        else:
            split = dict.fromkeys(range(spec.num_ffn_ranks), all_rows)
        step = self.step
        if not split:
            return DispatchHandle(
                layer, num_tokens, spec.hidden_size, spec.dtype, split, None, step, microbatch
            )
        tag = Tag(step, layer, microbatch)
        slot, position = self._take_slot(tag, num_tokens)
        value = step << POSITION_BITS | position + 1
        state = SendState(slot, position, value, tag, (x, topk_ids, topk_weights), {})
        self._cpu = current_cpu()  # FFN ranks on it skip their spin stage
        try:
            for ffn_rank, rows in split.items():
                while True:
                    try:
                        self._send(ffn_rank, state, rows)
                        break
                    except FFNRankLost as lost:
                        self._recover(lost)
        except BaseException:
            self._release_slot(slot)
            raise
        return DispatchHandle(
            layer, num_tokens, spec.hidden_size, spec.dtype, split, state, step, microbatch
        )

    def _take_slot(self, tag: Tag, num_tokens: int) -> tuple[int, int]:
        """Slot ``tag.microbatch`` and the layer's position in the announced step (kept in
        ``_used`` until the slot's next use). Raises as ``dispatch`` says."""
        position, slot, tokens = self._positions.get(tag.layer), tag.microbatch, self._tokens
        if (
            position is None
            or not 0 <= slot < len(tokens)
            or num_tokens > tokens[slot]
            or position <= self._used[slot]
        ):
            raise self._misuse(tag, num_tokens)
        try:
            self._free.remove(slot)
        except ValueError:
            raise RuntimeError(
                f"slot {slot} is busy: combine its dispatch before dispatching again"
            ) from None
        self._used[slot] = position
        return slot, position

    def _misuse(self, tag: Tag, num_tokens: int) -> ProtocolError:
        """What ``_take_slot`` refused, explained."""
        schedule, rank, layer, slot = self.schedule, self.rank, tag.layer, tag.microbatch
        if schedule is None or layer not in self._positions:
            return ProtocolError(
                f"slot plane: attention rank {rank} dispatched layer {layer} outside an "
                f"announced step (schedule: {schedule}); the FFN ranks serve announced steps"
            )
        if not 0 <= slot < len(self._tokens) or num_tokens > self._tokens[slot]:
            return ProtocolError(
                f"slot plane: attention rank {rank} dispatched {num_tokens} tokens of "
                f"microbatch {slot}; step {schedule.step} announced "
                f"{list(schedule.microbatch_tokens)} (slots: {self.spec.num_slots})"
            )
        return ProtocolError(
            f"slot plane: attention rank {rank} dispatched layer {layer} of microbatch {slot} "
            f"after layer {schedule.layers[self._used[slot]]} in step {schedule.step}: each "
            "layer once, in the schedule's order"
        )

    def _send(self, ffn_rank: int, state: SendState, rows: torch.Tensor) -> None:
        """Write FFN rank ``ffn_rank``'s ``rows`` (``[N]`` int64, ascending; ``N == T``: every
        row) of ``state``'s dispatch into its slot and signal it."""
        x, topk_ids, topk_weights = state.inputs
        index = None if rows.shape[0] == x.shape[0] else rows
        slot, position, cpu = state.slot, state.position, self._cpu
        self.plane.send(ffn_rank, slot, position, x, topk_ids, topk_weights, index, cpu)
        state.sent[ffn_rank] = self.replacements

    def combine(self, handle: DispatchHandle[SendState]) -> torch.Tensor:
        """See ``AttentionTransport.combine``: ``[T, H]`` ``spec.dtype``, original order.

        Raises:
            ValueError: if ``handle`` was already combined.
            TransportError: as ``_wait`` raises it (timeout; a lost FFN rank without
                failover, or with no replacement in time: ``_recover``).
        """
        if not handle.token_index:
            return combine_partials(handle, {})
        state = self._take_state(handle)
        try:
            out = self._sum_into(handle, state)
            if out is None:
                return combine_partials(handle, self._answers(handle, state))
            self.plane.await_sum(state.slot, state.position, out)
            return out
        finally:
            self._release_slot(state.slot)

    def combine_hook(
        self, handle: DispatchHandle[SendState]
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """See ``AttentionTransport.combine_hook``: ``hook()`` waits for every FFN rank's answer
        (on devices with streams, queues the waits and their sum), ``receive()`` returns the
        sum. The slot is freed by ``receive``, or by a ``hook`` that raises."""
        if not handle.token_index:
            return (lambda: None), (lambda: combine_partials(handle, {}))
        state = self._take_state(handle)
        out = self._sum_into(handle, state)  # on this stream: the hook may run on another's
        partials: dict[int, torch.Tensor] = {}

        def hook() -> None:
            try:
                if out is None:
                    partials.update(self._answers(handle, state))
                else:
                    self.plane.await_sum(state.slot, state.position, out)
            except BaseException:
                self._release_slot(state.slot)
                raise

        def receive() -> torch.Tensor:
            try:
                return combine_partials(handle, partials) if out is None else out
            finally:
                self._release_slot(state.slot)

        return hook, receive

    def _sum_into(self, handle: DispatchHandle[SendState], state: SendState) -> torch.Tensor | None:
        """Where one ``await_sum`` combines ``state``'s answers (the device's waits: every row
        went to every FFN rank, and none of them was replaced since), the tensor it writes;
        else ``None`` (host waits, failover: ``_answers``)."""
        if not self.memory.records_waits or any(
            state.sent[f] < self._replaced_at[f] for f in handle.token_index
        ):
            return None
        shape = (handle.num_tokens, handle.hidden_size)
        return torch.empty(shape, dtype=handle.dtype, device=self.memory.device)

    @staticmethod
    def _take_state(handle: DispatchHandle[SendState]) -> SendState:
        state: SendState | None = handle.state
        if state is None:
            raise ValueError(f"handle of layer {handle.layer} was already combined")
        handle.state = None
        return state

    def _answers(
        self, handle: DispatchHandle[SendState], state: SendState
    ) -> dict[int, torch.Tensor]:
        """Every FFN rank's answer to ``state``'s requests, awaited until one deadline."""
        deadline = time.perf_counter() + self.spec.timeout_s
        replaced_at, sent = self._replaced_at, state.sent
        partials = {}
        for ffn_rank, rows in handle.token_index.items():
            if sent[ffn_rank] < replaced_at[ffn_rank]:  # failover (``_answer``)
                partials[ffn_rank] = self._answer(ffn_rank, state, rows, deadline)
                continue
            try:  # the common case, inlined (a call costs 0.1 us of a ~10 us round trip)
                partials[ffn_rank] = self._wait(ffn_rank, state, rows.shape[0], deadline)
            except (FFNRankLost, FFNServeError) as failure:
                partials[ffn_rank] = self._answer(ffn_rank, state, rows, deadline, failure)
        return partials

    def _wait(self, ffn_rank: int, state: SendState, rows: int, deadline: float) -> torch.Tensor:
        """FFN rank ``ffn_rank``'s answer to ``state``'s use: ``[rows, H]``, a view of this
        rank's answer buffer (read before the slot's next use). On host memory waits for
        exactly the use's value (the answer) or its negation (an error answer:
        ``FFNServeError``) until ``deadline`` (``time.perf_counter()``; then ``FFNTimeout``),
        checking the liveness of every FFN rank the combine waits for meanwhile; on the
        device's waits, queues the wait (``memory.check`` raises what it records)."""
        slot = state.slot
        if self.memory.records_waits:
            self.plane.await_answer(ffn_rank, slot, state.position)
            return self.plane.answer(ffn_rank, slot, rows)
        answer = self.plane.answers[ffn_rank][slot]
        line = answer.response_words
        assert line is not None  # host memory: waits are the host's
        found: int | None = line[0]
        if found != state.value:
            backoff = Backoff(self.wait, spin=line[CPU_WORD] != self._cpu, pump=self.memory.pump)
            watch = lambda: self._check_alive(state.sent)  # noqa: E731
            found = await_word(line, state.value, deadline, backoff, watch, exact=True)
            if found is None:
                raise FFNTimeout(
                    f"FFN rank {ffn_rank} (pid {self._creators[ffn_rank].pid}) did not answer "
                    f"within timeout_s={self.spec.timeout_s} ({state.tag})"
                )
        if found != state.value:
            raise FFNServeError(f"FFN rank {ffn_rank}: {answer.read_error()}")
        return self.plane.answer(ffn_rank, slot, rows)

    def _answer(
        self,
        ffn_rank: int,
        state: SendState,
        rows: torch.Tensor,
        deadline: float,
        failure: FFNRankLost | FFNServeError | None = None,
    ) -> torch.Tensor:
        """FFN rank ``ffn_rank``'s answer to ``state``'s request, after ``failure`` if the
        first wait for it failed; a request the rank's replacement never got is sent to it
        first (see the module docstring: failover, and ``_serve_error_as_loss``)."""
        serve_errors = 0
        while True:
            if failure is not None:
                if isinstance(failure, FFNServeError):
                    serve_errors += 1
                    failure = self._serve_error_as_loss(ffn_rank, failure, serve_errors)
                self._recover(failure)
                deadline = time.perf_counter() + self.spec.timeout_s
            try:
                if state.sent[ffn_rank] < self._replaced_at[ffn_rank]:
                    self._send(ffn_rank, state, rows)
                    self.redispatched += 1
                return self._wait(ffn_rank, state, rows.shape[0], deadline)
            except (FFNRankLost, FFNServeError) as exc:
                failure = exc

    def _serve_error_as_loss(
        self, ffn_rank: int, error: FFNServeError, attempt: int
    ) -> FFNRankLost:
        """A request that FFN rank ``ffn_rank`` failed (``error``, its ``attempt``-th failure
        of it) as the loss of the rank, which failover recovers from: the supervisor replaces
        a rank that failed a request (its state after an exception is not trusted: a CUDA
        error poisons the context), and the request goes once more, to the replacement.

        Raises:
            FFNServeError: ``error`` itself when the request already failed on a replacement
                (``SERVE_ERROR_ATTEMPTS``), without failover (or a directory entry for the
                rank), or while ``retry_serve_errors`` is off. The supervisor watches ranks on
                other hosts too (through Ray: ``placement.failover.RayWatch``).
        """
        spec = self.spec
        if attempt >= SERVE_ERROR_ATTEMPTS or not self.retry_serve_errors or not spec.fails_over:
            raise error
        if directory.lookup(spec.directory, ffn_rank) is None:
            raise error
        return FFNRankLost(ffn_rank, f"{error} (the supervisor replaces a rank that failed)")

    def _check_superseded(self, ffn_rank: int) -> None:
        """Raise ``FFNRankLost`` when the failover supervisor declared FFN rank ``ffn_rank``
        lost: its directory entry is being replaced, given up, or a newer incarnation than the
        one this rank is linked to. A rank on another host whose node died (or was cut off)
        closes no connection; only the supervisor, watching it through Ray, can tell. Called
        by a backend's wait while it blocks (the slot plane's watch)."""
        if not self.spec.fails_over:
            return
        entry = directory.lookup(self.spec.directory, ffn_rank)
        if entry is None:
            return
        linked = self._incarnation[ffn_rank]
        if entry.state != directory.UP or entry.incarnation != linked:
            reason = entry.reason or f"incarnation {entry.incarnation} is {entry.state}"
            raise FFNRankLost(ffn_rank, f"the failover supervisor replaces it ({reason})", linked)

    def _recover(self, lost: FFNRankLost) -> None:
        """Replace the link to the lost FFN rank by one to its replacement, or re-raise.

        Raises:
            FFNRankLost: ``lost`` itself, without failover (``spec.directory`` empty).
            TransportError: when no replacement came up within ``spec.failover_s`` or the
                supervisor gave up on the rank (the message says which).
        """
        spec, ffn_rank = self.spec, lost.ffn_rank
        if not spec.fails_over:
            raise lost
        if lost.incarnation not in (None, self._incarnation[ffn_rank]):
            # replaced already: the watchdog's abort for a death that an announcement, waiting
            # on the rank's ring, found and recovered from first
            return
        _, entry = self._relink(lost, lambda address: self.reconnect(ffn_rank, address))
        self.replacements += 1
        self._replaced_at[ffn_rank] = self.replacements
        if self.schedule is not None and not self.memory.records_waits:
            # the lost rank's unanswered requests of this step go again to the replacement;
            # with the device's waits the step failed and goes nowhere again: announced to the
            # replacement, it would wait for uses that never come (up to ``timeout_s`` each)
            self.controls[ffn_rank].announce(self.rank, self.schedule)
        logger.warning(
            "AFD: attention rank %d reconnected to FFN rank %d (incarnation %d, pid %d, %s)",
            self.rank,
            ffn_rank,
            entry.incarnation,
            entry.pid,
            entry.address,
        )

    def _relink(
        self, lost: FFNRankLost, link: Callable[[str], _T]
    ) -> tuple[_T, directory.RankEntry]:
        """``link(address)`` of the lost FFN rank's replacement, once one is up, and its
        directory entry, whose address and incarnation the rank is linked to from then on; a
        replacement gone before it was linked (``link`` raises ``FFNRankLost``) is passed
        over for the next one.

        Raises:
            TransportError: as ``_replacement``.
        """
        while True:
            entry = self._replacement(lost)
            try:
                linked = link(entry.address)
            except FFNRankLost as dead:
                self._incarnation[lost.ffn_rank], lost = entry.incarnation, dead
                continue
            self.addresses[lost.ffn_rank] = entry.address
            self._incarnation[lost.ffn_rank] = entry.incarnation
            return linked, entry

    def _replacement(self, lost: FFNRankLost) -> directory.RankEntry:
        """The directory's entry of the lost FFN rank's replacement, once it is up.

        Raises:
            TransportError: when none came up within ``spec.failover_s`` or the supervisor
                gave up on the rank (the message says which).
        """
        spec, ffn_rank = self.spec, lost.ffn_rank
        logger.warning(
            "AFD: attention rank %d lost FFN rank %d (%s); waiting up to %gs for its replacement",
            self.rank,
            ffn_rank,
            lost,
            spec.failover_s,
        )
        try:
            return directory.wait_for_replacement(
                spec.directory, ffn_rank, self._incarnation[ffn_rank], spec.failover_s
            )
        except directory.ReplacementTimeout as exc:
            raise TransportError(f"{lost}; {exc}") from None

    def _release_slot(self, slot: int) -> None:
        """``slot`` is free again; one already free stays listed once (the slot plane frees
        every slot when a step begins, and a handle of the step before may be combined
        after that)."""
        if slot not in self._free:
            self._free.append(slot)

    def _check_alive(self, ffn_ranks: Collection[int]) -> None:
        """Raise ``FFNRankLost`` for the first of ``ffn_ranks`` that closed its endpoint, died,
        or that the failover supervisor declared lost (a wedged rank: ``_check_superseded``)."""
        for f in ffn_ranks:
            control, creator = self.controls[f], self._creators[f]
            if control.closed or creator.died():
                gone = "closed its endpoint" if control.closed else "died"
                lost = f"FFN rank {f} (pid {creator.pid}) {gone}"
                raise FFNRankLost(f, lost, self._incarnation[f])
            self._check_superseded(f)

    def reconnect(self, ffn_rank: int, address: str) -> None:
        """Map the replacement's control block and request buffer (``address``: its control
        block) in place of the lost rank's, which are unmapped (the old block at the
        watchdog's next look, where a watchdog's thread may be reading it), and offer it
        this rank's answer buffer."""
        control, self._creators[ffn_rank] = self._map(ffn_rank, address)
        self.controls[ffn_rank], old = control, self.controls[ffn_rank]
        if self._watching is None:
            old.close()
        else:
            self._unlinked.append(old)
        self.plane.attach(ffn_rank, control.handle)
        control.offer_answers(self.rank, self.plane.answer_handles[ffn_rank])

    def close(self) -> None:
        """Unmap everything; unlink this rank's answer buffers (the FFN side unlinks its own)."""
        self._closed.set()
        if self._watching is not None:
            self._watching.join()  # before the control blocks it reads go
        for control in self.controls + self._unlinked:
            control.close()
        self.controls, self._unlinked = [], []
        self.memory.close()


def watch_creator(ffn_rank: int, control: ControlBlock, pid_ns: int) -> Creator:
    """FFN rank ``ffn_rank``'s process (its pid in ``control``, of pid namespace ``pid_ns``),
    watched (``host.Creator``).

    Raises:
        FFNRankLost: if it is dead already.
    """
    creator = Creator.watch(control.pid, pid_ns)
    if creator is None:
        raise FFNRankLost(
            ffn_rank,
            f"FFN rank {ffn_rank}: its process (pid {control.pid}) of control block "
            f"{control.name[:80]!r} is dead",
        )
    return creator
