"""The transport contract between attention ranks and the FFN executor group.

Modelled on DeepEP's dispatch/combine API (a dispatch returns a handle that combine consumes,
and combine splits into a receive hook and the receive, as DeepEP's ``return_recv_hook``):

* The attention side calls ``dispatch`` once per MoE layer per (micro)batch with the tokens'
  hidden states and their routing decision. It returns at once with a ``DispatchHandle``;
  ``combine(handle)`` waits and returns, in the original token order, the sum over the token's
  top-k experts of ``weight * expert(x)``.
* The FFN side serves in one of two ways, each an interface (``ServesRequests``: ``recv``
  takes every request that has arrived, from any attention rank, any layer, and ``reply``
  answers each; ``ServesSteps``: whole announced steps in stream order, for CUDA graphs). Either
  way an answer is, per row, the sum over the request's ``topk_ids`` the FFN rank owns of
  ``topk_weights * expert(x)``.

Every backend sends the routing weights to the FFN side, which returns rows already weighted
and summed over its experts; the attention side only adds the FFN ranks' answers. So a token
crosses once to each FFN rank it goes to and once back, whatever its top-k.

Expert placement is fixed and contiguous: with ``E`` routed experts and ``F`` FFN ranks, global
expert ``e`` lives on FFN rank ``e // (E // F)`` with local id ``e % (E // F)``. An attention
endpoint sends a token to an FFN rank only if at least one of its top-k experts lives there,
except on device memory (fixed shapes: every token to every FFN rank); the FFN side receives
the *global* ids and weights and masks the experts it does not own.

Why requests served as they come rather than a lockstep collective on the FFN side: the FFN
side then never needs every attention rank to step together. Prefill batches, decode batches,
profile and dummy runs, idle periods, one attention rank sending a request again on its own,
and front-ends that share one FFN group all fall out of the same "serve whatever is pending"
loop, and there is nothing to deadlock on. Attention ranks that run in lockstep (vLLM data
parallel) still get their tokens batched together on the FFN side, because their requests for
the same layer arrive together. An FFN side that serves announced steps (fixed-shape slots for
CUDA graphs) keeps the same contract on the attention side.

Failure: ``combine`` never waits forever. It raises ``TransportError`` after
``TransportSpec.timeout_s``, ``FFNServeError`` at once, with the FFN rank's error text, when
serving the request raised on the FFN rank (``ServesRequests.reply_error``), and
``FFNRankLost`` when the FFN rank is known gone (backends check liveness while waiting),
unless failover is on (``TransportSpec.directory``): then an attention endpoint that
``Reconnects`` waits for the rank's replacement and sends it again what the lost rank had not
answered, so that ``combine`` returns the same result (``endpoint.py``). What a backend can do
of the pool's features follows from the interfaces its endpoints implement
(``Backend.features``): nothing is claimed by default.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from vllm_afd.errors import (  # noqa: F401 - the contract's errors, named here too
    FFNRankLost,
    FFNServeError,
    FFNTimeout,
    ProtocolError,
    TransportError,
)
from vllm_afd.transport.control import Part, Step, StepSchedule, Use


def expert_range(num_experts: int, num_ffn_ranks: int, ffn_rank: int) -> range:
    """Global expert ids held by ``ffn_rank`` of ``num_ffn_ranks`` (contiguous placement)."""
    per_rank = num_experts // num_ffn_ranks
    return range(ffn_rank * per_rank, (ffn_rank + 1) * per_rank)


@dataclass(frozen=True)
class TransportSpec:
    """Everything both sides need to agree on before they connect.

    Created by the FFN group (placement) and shipped to every attention rank.
    """

    backend: str
    num_attention_ranks: int
    num_ffn_ranks: int
    num_experts: int
    hidden_size: int
    top_k: int
    #: Largest number of tokens one attention rank sends in one dispatch (vLLM's
    #: max_num_batched_tokens). Buffers are preallocated for it.
    max_tokens: int
    #: Hidden-state dtype on the wire (the model dtype).
    dtype: torch.dtype = torch.float32
    #: Requests one attention rank may have outstanding at once (microbatches).
    num_slots: int = 2
    #: Upper bound for one combine to wait, in seconds.
    timeout_s: float = 30.0
    #: Backend-specific rendezvous data filled in by the FFN side when it is up (shared-memory
    #: segment names, NIXL agent metadata, ...), one entry per FFN rank. An entry in the spec
    #: given to the FFN side is a request, not a result: the slot plane takes it as the
    #: segment-name prefix.
    addresses: tuple[str, ...] = field(default_factory=tuple)
    #: The model's MoE layer indices, ascending (filled by placement from the model): what a
    #: step visits (``control.StepSchedule``).
    moe_layers: tuple[int, ...] = ()
    #: The deployment's FFN directory (``directory.py``), where a lost FFN rank's replacement
    #: is announced; empty: no failover (a lost FFN rank fails the requests in flight).
    directory: str = ""
    #: How long an attention rank waits for a lost FFN rank's replacement, in seconds.
    failover_s: float = 0.0
    #: The first of the group's attention ranks that this front-end's ranks are (a front-end
    #: that joined a group run by ``vllm-afd ffn-server`` shares it with others).
    attention_rank_offset: int = 0
    #: The backend's own settings (``--afd-transport-config``, checked against
    #: ``Backend.settings``); opaque to everything but the backend's endpoints.
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def fails_over(self) -> bool:
        """A lost FFN rank's replacement is awaited (a directory and a wait are set)."""
        return bool(self.directory) and self.failover_s > 0

    @property
    def ratio(self) -> str:
        """The A:F ratio, in lowest terms (``"2:1"``)."""
        common = math.gcd(self.num_attention_ranks, self.num_ffn_ranks)
        return f"{self.num_attention_ranks // common}:{self.num_ffn_ranks // common}"

    def expert_range(self, ffn_rank: int) -> range:
        """Global expert ids held by ``ffn_rank`` (contiguous placement)."""
        return expert_range(self.num_experts, self.num_ffn_ranks, ffn_rank)

    def to_json(self) -> str:
        """The spec as JSON (the front-end hands it to every process it starts)."""
        data = dataclasses.asdict(self)
        data["dtype"] = str(self.dtype).removeprefix("torch.")
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TransportSpec:
        """Inverse of ``to_json``."""
        data = json.loads(text)
        data["dtype"] = getattr(torch, data["dtype"])
        data["addresses"] = tuple(data["addresses"])
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
        return cls(**data)

    @functools.cached_property
    def ffn_rank_table(self) -> torch.Tensor:
        """``[E]`` int64: the FFN rank of each global expert id (contiguous placement), computed
        once (indexing it is the per-dispatch lookup)."""
        return torch.arange(self.num_experts) // (self.num_experts // self.num_ffn_ranks)


#: Type of ``DispatchHandle.state``, one per backend (``endpoint.SendState``).
StateT = TypeVar("StateT")


@dataclass
class DispatchHandle(Generic[StateT]):
    """What ``dispatch`` returns and ``combine`` consumes (once).

    ``token_index[f]`` holds, for FFN rank ``f`` that got a request, the row indices (int64)
    of the original batch that were sent to it, so that combine can scatter the answers back.
    """

    layer: int
    num_tokens: int
    hidden_size: int
    dtype: torch.dtype
    token_index: dict[int, torch.Tensor]
    #: Backend-private bookkeeping (slot and sequence numbers, the plane's use, ...); ``None``
    #: after ``combine`` took it (a handle is combined only once), and for a dispatch that
    #: sent nothing.
    state: StateT | None = None
    #: The step (``AttentionTransport.step``) and microbatch the dispatch belongs to.
    step: int = 0
    microbatch: int = 0


@dataclass
class FFNRequest:
    """One request as the FFN side sees it.

    Attributes:
        src_rank: attention rank that sent it.
        layer: MoE layer index (the model's layer number).
        x: ``[N, H]`` hidden states, ``TransportSpec.dtype``.
        topk_ids: ``[N, K]`` int32 *global* expert ids.
        topk_weights: ``[N, K]`` float32 routing weights.
        reply_key: backend-private, identifies the request for ``reply`` (not its
            ``control.Tag``: that is ``layer``, ``step`` and ``microbatch``).
        reply_buffer: ``[N, H]`` ``spec.dtype`` where ``reply`` puts the answer, or ``None``
            when the backend has no such buffer (it then sends ``out`` itself). An FFN rank may
            compute its answer straight into it and pass it to ``reply``, which then only
            publishes it (the slot plane: one copy less per request). Valid until ``reply``.
        step, microbatch: the rest of the request's tag (``control.Tag``), as sent.
        schedule: the last ``StepSchedule`` its attention rank announced when it arrived, or
            ``None`` if that rank never announced one (``control.ScheduleChecker``).
    """

    src_rank: int
    layer: int
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    reply_key: object = None
    reply_buffer: torch.Tensor | None = None
    step: int = 0
    microbatch: int = 0
    schedule: StepSchedule | None = None


class AttentionTransport(abc.ABC):
    """Attention-rank endpoint. One per attention rank, connected to every FFN rank."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        #: The step announced last (``begin_step``); 0 before the first.
        self.step = 0
        #: Its schedule (a replacement FFN rank is told it again before anything else).
        self.schedule: StepSchedule | None = None
        #: Requests sent again to a lost FFN rank's replacement (failover), so far.
        self.redispatched = 0
        #: With failover, a request an FFN rank failed goes once more, to its replacement;
        #: ``False`` fails it at once (the attention side is finding the request an error
        #: follows: ``attention/failures.py``).
        self.retry_serve_errors = True

    def begin_step(self, schedule: StepSchedule) -> None:
        """Announce a forward step to every FFN rank, before its first ``dispatch``
        (``control.py``). ``schedule.step`` must be larger than the last one."""
        if schedule.step <= self.step:
            raise ValueError(f"step {schedule.step} announced after step {self.step}")
        self._announce(schedule)
        self.step = schedule.step
        self.schedule = schedule

    def _announce(self, schedule: StepSchedule) -> None:  # noqa: B027 - optional hook
        """Send ``schedule`` to every FFN rank (backends whose FFN side checks it)."""

    def check_sampled(self, step: int) -> None:  # noqa: B027 - optional hook
        """Step ``step``'s device work is done (vLLM synchronized on its sampled tokens):
        raise ``StepsFailed`` where its waits, or earlier steps', recorded a failure not
        raised yet (backends whose waits record failures instead of raising them)."""

    @abc.abstractmethod
    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle[Any]:
        """Send tokens to the FFN ranks owning their experts; returns without waiting.

        The requests are tagged (``self.step``, ``layer``, ``microbatch``).

        Args:
            layer: MoE layer index (the model's layer number).
            x: ``[T, H]`` hidden states, ``spec.dtype``, contiguous, ``T <= spec.max_tokens``.
            topk_ids: ``[T, K]`` integer global expert ids.
            topk_weights: ``[T, K]`` float32 routing weights (already normalised by the router).
            microbatch: the microbatch of the step the tokens belong to.
        Returns:
            A handle for ``combine``. At most ``spec.num_slots`` handles may be outstanding.
            The caller leaves ``x``, ``topk_ids`` and ``topk_weights`` unchanged until then
            (failover sends them again to a lost FFN rank's replacement).
        """

    @abc.abstractmethod
    def combine(self, handle: DispatchHandle[Any]) -> torch.Tensor:
        """Wait for the answers of ``handle`` and return ``[T, H]`` in the original order.

        Row ``t`` is ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``.
        Raises ``TransportError`` if an FFN rank dies or the wait exceeds ``spec.timeout_s``,
        and ``ValueError`` for a handle that was already combined (a handle that sent nothing
        may be combined again).
        """

    def combine_hook(
        self, handle: DispatchHandle[Any]
    ) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        """``combine`` in two parts, as DeepEP's ``return_recv_hook=True`` splits it:
        ``hook()`` waits for the answers (on a device, it queues the waits), ``receive()``
        returns ``combine``'s result. Under vLLM's DBO the hook is registered with
        ``dbo_register_recv_hook`` for the other microbatch to run before its next send, and
        ``receive`` runs after the yield (``attention.exchange.round_trip``). By default the hook
        does nothing and ``receive`` is ``combine``."""
        return (lambda: None), (lambda: self.combine(handle))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and connections."""


class Reconnects(abc.ABC):
    """An attention endpoint that can link to a lost FFN rank's replacement: what failover
    needs of it (``endpoint.AttentionEndpoint`` waits for the replacement, tells it the step and
    sends it again what the lost rank had not answered)."""

    @abc.abstractmethod
    def reconnect(self, ffn_rank: int, address: str) -> None:
        """Drop the link to FFN rank ``ffn_rank`` (lost) and link to its replacement at
        ``address``. Views of the old link's buffers that a caller still holds stay valid."""


class FFNTransport(abc.ABC):
    """FFN-rank endpoint. One per FFN rank, reachable by every attention rank. It serves in one
    of two ways, each an interface of its own: ``ServesRequests`` (each request as it comes)
    or ``ServesSteps`` (whole announced steps in stream order)."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Rendezvous string attention ranks use to reach this FFN rank."""

    def interrupt(self) -> None:  # noqa: B027 - optional hook
        """End the waits in progress at once (the serve loop is stopping; ``close`` follows
        once it stopped)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and connections."""


class ServesRequests(FFNTransport):
    """An FFN endpoint that serves each attention rank's requests as they come, whatever the
    other attention ranks do: what live scaling, request isolation and an FFN group shared by
    several front-ends need (their attention ranks do not step together)."""

    @abc.abstractmethod
    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """Return every request pending now, waiting up to ``timeout_s`` for the first one.

        Returns an empty list on timeout (idle period): the caller loops.
        """

    @abc.abstractmethod
    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """Answer ``request`` with ``out``: ``[N, H]`` (``spec.dtype``), one row per request
        row, weighted by ``request.topk_weights`` and summed over this rank's experts. ``out``
        may be ``request.reply_buffer`` itself (then nothing is copied)."""

    @abc.abstractmethod
    def reply_error(self, request: FFNRequest, message: str) -> None:
        """Fail ``request``: its ``combine`` raises ``FFNServeError`` carrying ``message``."""


#: ``forward(x [N, H], topk_ids [N, K] int32, topk_weights [N, K] float32, out [N, H]) -> out``:
#: the FFN rank's experts over a use's rows, written into ``out``.
UseForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ServesSteps(FFNTransport):
    """An FFN endpoint that serves whole announced steps in stream order, so that on a GPU a
    step is one CUDA graph (``ffn/step_graphs.py``): ``next_step``, then per use of the step
    ``serve_use``, ``fail_uses`` for those an error leaves, ``end_step``. It waits for every
    attention rank's step (``control.Step``), so it serves only ranks that step together."""

    @abc.abstractmethod
    def next_step(self, timeout_s: float) -> Step | None:
        """The next announced step, ready to serve; ``None`` if none came within
        ``timeout_s``."""

    @abc.abstractmethod
    def serve_use(self, slot: int, parts: tuple[Part, ...], forward: UseForward) -> None:
        """One use of a slot of the step: every part's rows through one ``forward``, every
        answer published (in stream order on devices with streams)."""

    @abc.abstractmethod
    def fail_uses(self, uses: Sequence[Use], message: str) -> None:
        """Answer every part of ``uses`` with ``message`` (their attention ranks' waits end)."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """The step is served (what its waits recorded is reported)."""


class Feature(enum.Enum):
    """A pool feature a backend can claim (``Backend.features``), only by implementing what it
    needs."""

    #: A lost FFN rank is replaced and the deployment serves on (``--afd-failover-timeout``):
    #: an attention endpoint that ``Reconnects``. Where the FFN side ``ServesRequests`` (its
    #: waits raise, so a loss is seen at once) the requests in flight complete with their
    #: tokens; where it ``ServesSteps`` (the device's waits: a kernel cannot raise) the
    #: requests of the step the loss spoiled fail with that step's output, and the next step
    #: runs on the replacement (``attention/failures.py``).
    FAILOVER = "failover"
    #: The FFN pool changes size while it serves (``POST /afd/scale``): each attention rank
    #: switches to the new pool at a step boundary of its own (``ServesRequests``).
    LIVE_SCALING = "live scaling"
    #: An FFN error fails only the request it follows: one attention rank sends a layer's rows
    #: again, request by request, in steps of its own (``ServesRequests``).
    ISOLATION = "request isolation"
    #: Several front-ends share one FFN group (``vllm-afd ffn-server``, ``--afd-join``); they do
    #: not step together (``ServesRequests``).
    SHARED_GROUP = "shared group"


class Backend:
    """What one transport backend is and can do, declared on the backend, as vLLM declares what
    its MoE kernels support (``FusedMoEExperts.is_supported_config``) and what a KV connector
    needs (``get_required_kvcache_layout``). Config, deployment, placement and metrics ask these
    and never compare a backend's name, so a new backend is one module with one subclass,
    registered by name (``register_transport``) or named by its module path
    (``--afd-transport package.module:MyBackend``).

    Every answer has a default here that claims nothing a backend must implement (its pool
    features follow from the interfaces its endpoints implement: ``features``); a backend
    overrides what differs. Class-level only: nothing is instantiated and nothing heavy is
    imported by asking (the front-end asks before any worker starts).
    """

    #: The name ``--afd-transport`` takes.
    name: ClassVar[str]
    #: The endpoint classes (``create_attention_transport``, ``create_ffn_transport``).
    attention: ClassVar[type[AttentionTransport]]
    ffn: ClassVar[type[FFNTransport]]
    #: Its attention side dispatches only inside announced steps (``begin_step``): its FFN
    #: side learns what to serve from the schedules (``slots``). A producer that drives
    #: endpoints directly (a benchmark) announces steps for it.
    needs_steps: ClassVar[bool] = False
    #: With attention and FFN ranks on GPUs of one node, each side maps the other's device
    #: memory (CUDA IPC): every attention GPU needs peer access to every FFN GPU, checked
    #: before anything starts (``deployment.check_devices``).
    maps_peer_gpu_memory: ClassVar[bool] = False
    #: The settings it takes in ``--afd-transport-config`` (its endpoints read them from
    #: ``TransportSpec.config``): name -> type of the JSON value. Empty: none.
    settings: ClassVar[Mapping[str, type]] = {}

    @classmethod
    def endpoints(
        cls, settings: Mapping[str, Any]
    ) -> tuple[type[AttentionTransport], type[FFNTransport]]:
        """Its endpoint classes for these ``settings`` (``TransportSpec.config``)."""
        return cls.attention, cls.ffn

    @classmethod
    def features(cls, settings: Mapping[str, Any] | None = None) -> frozenset[Feature]:
        """The pool features its endpoints for ``settings`` implement (``Feature``): failover
        where its attention side ``Reconnects``; live scaling, request isolation and shared
        groups where its FFN side ``ServesRequests``."""
        attention, ffn = cls.endpoints(settings or {})
        features = set()
        if issubclass(ffn, ServesRequests):
            features |= {Feature.LIVE_SCALING, Feature.ISOLATION, Feature.SHARED_GROUP}
        if issubclass(attention, Reconnects):
            features.add(Feature.FAILOVER)
        return frozenset(features)

    @classmethod
    def config_problem(cls, config: Mapping[str, Any]) -> str | None:
        """Why ``config`` is not a set of this backend's ``settings`` (``None``: it is)."""
        allowed = ", ".join(f"{k} ({t.__name__})" for k, t in sorted(cls.settings.items()))
        unknown = sorted(set(config) - set(cls.settings))
        if unknown:
            return (
                f"{cls.name} takes no setting {', '.join(unknown)}; its settings: "
                f"{allowed or 'none'}"
            )
        for key, value in config.items():
            typ = cls.settings[key]
            # JSON's true is a Python int too; a float setting takes an integer
            if isinstance(value, bool) != (typ is bool) or not isinstance(
                value, (int, float) if typ is float else typ
            ):
                return f"{cls.name} setting {key} takes a {typ.__name__}, got {value!r}"
        return None

    @classmethod
    def resolve_settings(cls, settings: Mapping[str, Any], attention_device: str) -> dict[str, Any]:
        """``settings`` as this backend runs them with attention ranks on
        ``attention_device`` (``"cpu"``, ``"cuda"``); the front-end writes them back before any
        worker starts, so every process gets the same."""
        return dict(settings)

    @classmethod
    def host_problem(cls) -> str | None:
        """Why this machine cannot run the backend's endpoints (``None``: it can)."""
        return None

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        """Why it cannot connect attention ranks on ``attention_device`` to FFN ranks on
        ``ffn_device`` (``"cpu"``, ``"cuda"``); ``None``: it can."""
        return None

    @classmethod
    def reap_stale(cls) -> list[str]:
        """Remove what this user's dead endpoints of this backend left on this host (the slot
        plane: its ``/dev/shm`` segments); returns their names."""
        return []

    @classmethod
    def round_trip_bytes(cls, spec: TransportSpec, tokens: int) -> tuple[int, int]:
        """(sent, received) payload bytes of one round trip of ``tokens`` token rows: here
        hidden states plus int32 ids and float32 weights out, hidden states back."""
        hidden = tokens * spec.hidden_size * spec.dtype.itemsize
        return hidden + tokens * spec.top_k * 8, hidden
