"""The attention endpoint, written once: ``AttentionEndpoint`` drives every backend.

The slot plane on every memory (``slots.py``: shared memory, NIXL, device memory) runs this
attention side.
``dispatch`` checks its arguments, splits the batch by FFN rank, takes the microbatch's slot,
and sends each FFN rank its rows; ``combine`` waits for every FFN rank's answer until one
deadline, sums the answers into the original order and frees the slot (``combine_hook`` splits
the two for vLLM's DBO). A backend supplies only the wire:

* ``_announce_to(ffn_rank, schedule)`` puts a step's schedule on the wire (``control.py``);
* ``_send(ffn_rank, slot, tag, x, topk_ids, topk_weights, rows, deadline) -> seq`` puts one
  request on the wire and returns what identifies it (a sequence number, the plane's value);
* ``_wait(ffn_rank, slot, seq, tag, deadline, awaited) -> [N, H]`` returns the answer to
  ``seq``, after checking that it carries ``tag`` (``control.answer_mismatch``);
* optionally ``_begin_dispatch()``, run once per dispatch before the first send, and
  ``_take_slot(tag, num_tokens)``, which slot a dispatch holds until its combine (any free one
  by default; the slot plane's slot ``s`` carries microbatch ``s``);
* ``reconnect(ffn_rank, address)`` replaces the link to a lost FFN rank by one to its
  replacement (failover: ``base.Reconnects``).

Failover. A backend raises ``FFNRankLost`` when an FFN rank is gone (its process died, it closed
its endpoint, its connection broke). With failover on (``spec.directory``), the attention side
then waits for the rank's replacement (``directory.wait_for_replacement``, at most
``spec.failover_s``), reconnects, tells it the current step's schedule, and sends it again every
request the lost rank had not answered: a handle keeps its inputs until ``combine`` (the caller
must leave ``x``, ``topk_ids`` and ``topk_weights`` unchanged until then; the attention hook's
custom op does), and a request sent before the rank's last replacement is sent again before it
is waited for. The answers are the ones the lost rank would have given (same experts, same
inputs), so a failover changes no token. ``redispatched`` counts the requests sent again. A
request the FFN rank failed (``FFNServeError``) goes once more, to the rank's replacement
(``_serve_error_as_loss``).

Two pure functions define the protocol's arithmetic:

* ``split_by_ffn_rank`` decides, per FFN rank, which rows of the batch must travel there (a token
  goes to every FFN rank that owns at least one of its top-k experts; contiguous placement). A
  wire with fixed shapes (the slot plane on device memory) sends every row to every FFN rank
  (``filters_rows``).
* ``combine_partials`` adds the per-FFN-rank partial answers back into a ``[T, H]`` tensor in the
  original order, FFN ranks in ascending order, starting from zero. That summation order is the
  one ``reference.reference_moe_combine`` uses, so that results can be compared exactly.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from vllm_afd.errors import FFNRankLost, FFNServeError, ProtocolError, TransportError
from vllm_afd.transport import directory
from vllm_afd.transport.base import (
    AttentionTransport,
    DispatchHandle,
    Reconnects,
    StateT,
    TransportSpec,
)
from vllm_afd.transport.control import StepSchedule, Tag
from vllm_afd.transport.wait import RowViews, WaitPolicy

#: Failover: FFN ranks that fail one request before it fails on the attention side (the rank
#: it was sent to, then its replacement).
SERVE_ERROR_ATTEMPTS = 2
logger = logging.getLogger("vllm.afd")


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
        seqs: ``{ffn_rank: what identifies the request sent}`` (``_send``), in ascending rank
            order.
        tag: the requests' tag, which the answers must carry.
        inputs: ``(x, topk_ids, topk_weights)`` as ``dispatch`` got them, to send again to a
            lost FFN rank's replacement.
        sent: ``{ffn_rank: the transport's replacement count when the request went out}``.
    """

    slot: int
    seqs: dict[int, int]
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
    """The attention endpoint of every backend: ``dispatch``/``combine`` over its wire's
    ``_send`` and ``_wait`` (see the module docstring).

    Args:
        spec: the FFN group's spec; ``spec.addresses`` holds one address per FFN rank.
        rank: this attention rank, ``0 <= rank < spec.num_attention_ranks``.
        wait: how waits are staged (default: ``WaitPolicy()``, poll window from the environment).
    """

    #: Backend name in error messages.
    backend_name = "attention endpoint"
    #: It sends an FFN rank only the rows routed to it (``split_by_ffn_rank``); ``False``:
    #: every row to every FFN rank (fixed shapes).
    filters_rows = True

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank)
        if not 0 <= rank < spec.num_attention_ranks:
            raise ValueError(f"attention rank {rank} outside [0, {spec.num_attention_ranks})")
        if len(spec.addresses) != spec.num_ffn_ranks:
            raise ValueError(
                f"{self.backend_name} transport needs one address per FFN rank "
                f"({spec.num_ffn_ranks}), got {spec.addresses!r}"
            )
        self.wait = wait or WaitPolicy()
        self._free = list(range(spec.num_slots - 1, -1, -1))
        self._rows = RowViews(torch.arange(spec.max_tokens))
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

    def _announce(self, schedule: StepSchedule) -> None:
        for ffn_rank in range(self.spec.num_ffn_ranks):
            while True:
                try:
                    self._announce_to(ffn_rank, schedule)
                    break
                except FFNRankLost as lost:
                    self._recover(lost)

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle[SendState]:
        """See ``AttentionTransport.dispatch``. Returns once every request is handed to the wire;
        the handle keeps ``x``, ``topk_ids`` and ``topk_weights`` for failover (leave them
        unchanged until ``combine``). A failed send frees the slot and raises."""
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
        slot = self._take_slot(tag, num_tokens)
        seqs: dict[int, int] = {}
        sent: dict[int, int] = {}
        try:
            self._begin_dispatch()
            deadline = time.perf_counter() + spec.timeout_s
            for ffn_rank, rows in split.items():
                while True:
                    try:
                        seqs[ffn_rank] = self._send(
                            ffn_rank, slot, tag, x, topk_ids, topk_weights, rows, deadline
                        )
                        sent[ffn_rank] = self.replacements
                        break
                    except FFNRankLost as lost:
                        self._recover(lost)
                        deadline = time.perf_counter() + spec.timeout_s
        except BaseException:
            self._release_slot(slot)
            raise
        state = SendState(slot, seqs, tag, (x, topk_ids, topk_weights), sent)
        return DispatchHandle(
            layer, num_tokens, spec.hidden_size, spec.dtype, split, state, step, microbatch
        )

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
            return combine_partials(handle, self._answers(handle, state))
        finally:
            self._release_slot(state.slot)

    def combine_hook(
        self, handle: DispatchHandle[SendState]
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """See ``AttentionTransport.combine_hook``: ``hook()`` waits for every FFN rank's answer
        (on devices with streams, queues the waits), ``receive()`` sums them. The slot is
        freed by ``receive``, or by a ``hook`` that raises."""
        if not handle.token_index:
            return (lambda: None), (lambda: combine_partials(handle, {}))
        state = self._take_state(handle)
        partials: dict[int, torch.Tensor] = {}

        def hook() -> None:
            try:
                partials.update(self._answers(handle, state))
            except BaseException:
                self._release_slot(state.slot)
                raise

        def receive() -> torch.Tensor:
            try:
                return combine_partials(handle, partials)
            finally:
                self._release_slot(state.slot)

        return hook, receive

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
        replaced_at, sent, seqs = self._replaced_at, state.sent, state.seqs
        partials = {}
        for ffn_rank, rows in handle.token_index.items():
            if sent[ffn_rank] < replaced_at[ffn_rank]:  # failover (``_answer``)
                partials[ffn_rank] = self._answer(ffn_rank, state, rows, deadline)
                continue
            try:  # the common case, inlined (a call costs 0.1 us of a ~10 us round trip)
                partials[ffn_rank] = self._wait(
                    ffn_rank, state.slot, seqs[ffn_rank], state.tag, deadline, seqs
                )
            except (FFNRankLost, FFNServeError) as failure:
                partials[ffn_rank] = self._answer(ffn_rank, state, rows, deadline, failure)
        return partials

    def _send_request(
        self, ffn_rank: int, state: SendState, rows: torch.Tensor, deadline: float
    ) -> None:
        """Send FFN rank ``ffn_rank`` its ``rows`` of ``state``'s dispatch."""
        x, topk_ids, topk_weights = state.inputs
        seq = self._send(ffn_rank, state.slot, state.tag, x, topk_ids, topk_weights, rows, deadline)
        state.seqs[ffn_rank] = seq
        state.sent[ffn_rank] = self.replacements

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
                    self._send_request(ffn_rank, state, rows, deadline)
                    self.redispatched += 1
                seq = state.seqs[ffn_rank]
                return self._wait(ffn_rank, state.slot, seq, state.tag, deadline, state.seqs)
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
        if entry.state != directory.UP or entry.incarnation != self._incarnation[ffn_rank]:
            reason = entry.reason or f"incarnation {entry.incarnation} is {entry.state}"
            raise FFNRankLost(ffn_rank, f"the failover supervisor replaces it ({reason})")

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
        logger.warning(
            "AFD: attention rank %d lost FFN rank %d (%s); waiting up to %gs for its replacement",
            self.rank,
            ffn_rank,
            lost,
            spec.failover_s,
        )
        try:
            entry = directory.wait_for_replacement(
                spec.directory, ffn_rank, self._incarnation[ffn_rank], spec.failover_s
            )
        except directory.ReplacementTimeout as exc:
            raise TransportError(f"{lost}; {exc}") from None
        self.reconnect(ffn_rank, entry.address)
        self.addresses[ffn_rank], self._incarnation[ffn_rank] = entry.address, entry.incarnation
        self.replacements += 1
        self._replaced_at[ffn_rank] = self.replacements
        if self.schedule is not None:
            self._announce_to(ffn_rank, self.schedule)
        logger.warning(
            "AFD: attention rank %d reconnected to FFN rank %d (incarnation %d, pid %d, %s)",
            self.rank,
            ffn_rank,
            entry.incarnation,
            entry.pid,
            entry.address,
        )

    def _release_slot(self, slot: int) -> None:
        """``slot`` is free again; one already free stays listed once (the slot plane frees
        every slot when a step begins, and a handle of the step before may be combined
        after that)."""
        if slot not in self._free:
            self._free.append(slot)

    def _begin_dispatch(self) -> None:  # noqa: B027 - optional hook
        """Runs once per dispatch that sends anything, before the first ``_send``."""

    def _take_slot(self, tag: Tag, num_tokens: int) -> int:
        """The slot a dispatch of ``num_tokens`` tokens tagged ``tag`` holds until its combine
        (``combine`` puts it back on ``self._free``): any free one here.

        Raises:
            RuntimeError: when every slot is held.
        """
        if not self._free:
            raise RuntimeError(
                f"more than num_slots={self.spec.num_slots} dispatches outstanding: "
                "combine one before dispatching again"
            )
        return self._free.pop()

    @abc.abstractmethod
    def _announce_to(self, ffn_rank: int, schedule: StepSchedule) -> None:
        """Put ``schedule`` on the wire to FFN rank ``ffn_rank``, ahead of the step's requests
        (the FFN side attaches it to the requests that follow: ``FFNRequest.schedule``)."""

    @abc.abstractmethod
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
        """Send FFN rank ``ffn_rank`` the rows ``rows`` of the batch in slot ``slot``.

        Args:
            tag: the request's (step, layer, microbatch).
            x, topk_ids, topk_weights: the whole batch as ``dispatch`` got it (``topk_ids`` of
                any integer dtype, converted to int32 on the way).
            rows: ``[N]`` int64 row indices, ascending; ``N == T`` means every row.
            deadline: ``time.perf_counter()`` value after which a blocked send must raise
                ``TransportError``.
        Returns:
            The request's sequence number, which ``_wait`` gets back.
        """

    @abc.abstractmethod
    def _wait(
        self,
        ffn_rank: int,
        slot: int,
        seq: int,
        tag: Tag,
        deadline: float,
        awaited: Collection[int],
    ) -> torch.Tensor:
        """Wait for FFN rank ``ffn_rank``'s answer to request ``seq`` in slot ``slot``.

        Args:
            tag: the request's tag; an answer carrying another raises ``ProtocolError``.
            deadline: ``time.perf_counter()`` value; past it, raise ``TransportError``.
            awaited: every FFN rank this combine waits for; a backend that checks liveness
                checks them all, so that any dead one fails the wait.
        Returns:
            ``[N, H]`` ``spec.dtype``, possibly a view of a transport buffer (read before the
            slot is freed, never kept).
        """
