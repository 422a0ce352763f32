"""The ``slots`` backend: a deployment served on the slot plane (``slot_plane.py``), host memory
on CPUs, device memory on GPUs (``slot_plane_cuda.py``), the same protocol on both.

What it adds to the plane is the step-driven FFN side. Each FFN rank serves *steps*: it waits
until every attention rank announced its next step (its ``StepSchedule`` in the FFN rank's
control block; vLLM's data-parallel ranks step together, idle ones with a dummy batch), then
walks the union of their schedules, layer by layer and, within a layer, microbatch by
microbatch, each use of a slot taking the rows of every attention rank whose schedule has it
(``Part``: its row count and the layer's position in its step). Two ways to drive that, by the
wait semantics of the plane's memory:

* host waits (CPU, ``waits: host``): ``recv`` hands the executor one use at a time, every
  attention rank's rows of it as requests, so ``FFNExecutor`` batches them into one forward of
  the layer's own vLLM MoE kernel exactly as for the point-to-point backends, checks their
  tags against the schedules and fails a request alone; ``reply`` publishes each answer. A rank
  whose wait fails is left out of the rest of the step.
* the device's waits (every GPU, ``waits: device`` on CPU; ``serves_steps``): the executor
  serves the whole step in stream order (``next_step``, ``serve_use`` per use, ``fail_uses``
  for what an error leaves, ``end_step``), nothing read back on the host, so that on a GPU the
  step is one CUDA graph per step shape (``StepGraphs``).

There is no Python relay and no hub: the schedule is a few words in shared memory, read once
per step.

Why "every attention rank", and how it stays bounded. A fixed group of ranks per step is what
lets the GPU side batch all attention ranks' tokens in fixed-shape slots and capture the FFN
step as one graph per shape. vLLM runs its data-parallel ranks in lockstep, but start-up
(profile and warm-up runs) may skew them: a rank that has not announced its next step within
half of ``timeout_s`` after the first one did is left out of that step (logged), and served in a
later one. A rank that abandons a step half-way (its combine failed) is dropped from the rest of
it as soon as it announces a newer step or dispatches past the awaited use (the plane's flag
values carry the step). Several front-ends sharing one FFN group (``vllm-afd ffn-server``) do
not step together, so this backend does not take them (``Backend.shares_group``).

Capabilities (``SlotsBackend``): CPU or GPU at both ends, the same kind; no failover, live
scaling or request isolation yet (each maps onto the plane: a replaced FFN rank's new buffer and
control block, resynchronised at the next announced step; not written). A dead FFN rank fails
a host wait within ``slot_plane.WATCH_INTERVAL_S`` (``FFNRankLost``); a silent one after
``timeout_s``. Settings (``--afd-transport-config``): ``{"waits": "host" | "device"}``: on
host memory, whether a failed wait raises at once (``host``, the default) or is recorded and
raised at the next step's announcement, as a device wait must be (``device``: the CPU stand-in
of the GPU layer's host-side logic). On GPUs waits are always the device's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_afd.host import Creator, UnsafeFileError, shm_platform_problem
from vllm_afd.transport.base import (
    AttentionTransport,
    Backend,
    DispatchHandle,
    FFNRankLost,
    FFNRequest,
    FFNServeError,
    FFNTimeout,
    FFNTransport,
    ProtocolError,
    TransportError,
    TransportSpec,
)
from vllm_afd.transport.control import Mode, StepSchedule
from vllm_afd.transport.p2p import Backoff, RowViews, WaitPolicy, check_dispatch_args
from vllm_afd.transport.slot_plane import (
    CONTROL_PREFIX,
    AttentionPlane,
    ControlBlock,
    FFNPlane,
    HostPlaneMemory,
    Part,
    PlaneError,
    PlaneHandle,
    PlaneLayout,
    PlaneMemory,
    reap_stale_control_blocks,
)

logger = logging.getLogger("vllm.afd")
WAITS = ("host", "device")


def plane_memory(spec: TransportSpec) -> PlaneMemory:
    """The plane's memory in this process: the current GPU's where CUDA is, else the host's."""
    if torch.cuda.is_available():
        from vllm_afd.transport.slot_plane_cuda import CudaPlaneMemory

        return CudaPlaneMemory(torch.cuda.current_device())
    device_waits = spec.config.get("waits", "host") == "device"
    return HostPlaneMemory(spec.timeout_s, device_waits=device_waits)


class SlotsAttentionTransport(AttentionTransport):
    """Attention endpoint: maps every FFN rank's control block (``spec.addresses``) and data
    buffer; dispatches only inside announced steps (``begin_step``)."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        super().__init__(spec, rank)
        if not 0 <= rank < spec.num_attention_ranks:
            raise ValueError(f"attention rank {rank} outside [0, {spec.num_attention_ranks})")
        if len(spec.addresses) != spec.num_ffn_ranks:
            raise ValueError(
                f"slots transport needs one address per FFN rank ({spec.num_ffn_ranks}), got "
                f"{spec.addresses!r}"
            )
        layout = PlaneLayout.of(spec)
        self.controls = [_attach(f, a, layout, spec) for f, a in enumerate(spec.addresses)]
        self._creators = [_creator(f, c) for f, c in enumerate(self.controls)]
        self.memory = plane_memory(spec)
        self.plane = AttentionPlane(layout, self.memory, rank, [c.handle for c in self.controls])
        self._rows = RowViews(torch.arange(spec.max_tokens))
        self._positions: dict[int, int] = {}
        self._busy = [False] * spec.num_slots

    def _announce(self, schedule: StepSchedule) -> None:
        """Raise what the last step's device waits recorded, then start ``schedule``'s step
        (a step abandoned half-way leaves its slots to this one). A CUDA-graph capture touches
        neither: reading the device word would sync inside the capture, and a step word set
        there would be baked into the graph; each replay's own announcement sets it."""
        if schedule.mode != Mode.CAPTURE:
            self.memory.check()
            self.plane.begin(schedule.step)
        self._positions = {layer: i for i, layer in enumerate(schedule.layers)}
        self._busy = [False] * self.spec.num_slots
        for control in self.controls:
            control.announce(self.rank, schedule)

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle:
        """See ``AttentionTransport.dispatch``: every row to every FFN rank, in slot
        ``microbatch``, as the layer's use of the announced step.

        Raises:
            ProtocolError: outside an announced step, or past what it announced.
        """
        spec, schedule = self.spec, self.schedule
        n = check_dispatch_args(spec, x, topk_ids)
        position = self._positions.get(layer)
        if schedule is None or position is None:
            raise ProtocolError(
                f"slots transport: attention rank {self.rank} dispatched layer {layer} outside "
                f"an announced step (schedule: {schedule}); the FFN ranks serve announced steps"
            )
        tokens = schedule.microbatch_tokens
        if not 0 <= microbatch < min(len(tokens), spec.num_slots) or n > tokens[microbatch]:
            raise ProtocolError(
                f"slots transport: attention rank {self.rank} dispatched {n} tokens of "
                f"microbatch {microbatch}; step {schedule.step} announced {list(tokens)}"
            )
        if self._busy[microbatch]:
            raise RuntimeError(
                f"slot {microbatch} is busy: combine its dispatch before dispatching again"
            )
        state = self.plane.dispatch(microbatch, position, x, topk_ids, topk_weights)
        self._busy[microbatch] = True
        rows = self._rows[n]
        index = {f: rows for f in range(spec.num_ffn_ranks)}
        return DispatchHandle(
            layer, n, spec.hidden_size, spec.dtype, index, state, self.step, microbatch
        )

    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        hook, receive = self.combine_hook(handle)
        hook()
        return receive()

    def combine_hook(self, handle: DispatchHandle):
        """See ``AttentionTransport.combine_hook``: the plane's waits, then its sum."""
        state: PlaneHandle | None = handle.state
        if state is None:
            raise ValueError(f"handle of layer {handle.layer} was already combined")
        handle.state = None
        hook, receive = self.plane.combine_hook(state, self._watch)

        def wait() -> None:
            try:
                hook()
            except PlaneError as error:
                self._busy[state.slot] = False
                if error.found < 0:
                    raise FFNServeError(str(error)) from None
                raise ProtocolError(f"slots transport: {error}") from None
            except BaseException:
                self._busy[state.slot] = False
                raise

        def received() -> torch.Tensor:
            out = receive()
            self._busy[state.slot] = False
            return out

        return wait, received

    def _watch(self) -> None:
        """While a host wait blocks: ``FFNRankLost`` for an FFN rank that closed its endpoint
        or died."""
        creators = zip(self.controls, self._creators, strict=True)
        for f, (control, creator) in enumerate(creators):
            if control.closed:
                raise FFNRankLost(f, f"FFN rank {f} (pid {creator.pid}) closed its slots endpoint")
            if creator.died():
                raise FFNRankLost(f, f"FFN rank {f} (pid {creator.pid}) died")

    def close(self) -> None:
        for control in self.controls:
            control.close()
        self.controls = []
        self.memory.close()


def _attach(ffn_rank: int, name: str, layout: PlaneLayout, spec: TransportSpec) -> ControlBlock:
    try:
        return ControlBlock.attach(name, layout, spec.moe_layers)
    except FileNotFoundError:
        raise TransportError(
            f"FFN rank {ffn_rank}: control block {name!r} not found (FFN rank not started, or "
            "already gone)"
        ) from None
    except UnsafeFileError as exc:
        raise TransportError(f"FFN rank {ffn_rank}: {exc}") from None


def _creator(ffn_rank: int, control: ControlBlock) -> Creator:
    """FFN rank ``ffn_rank``'s process, watched (``host.Creator``)."""
    creator = Creator.watch(control.pid, control.pid_namespace)
    if creator is None:
        raise TransportError(
            f"FFN rank {ffn_rank}: its process (pid {control.pid}) of control block "
            f"{control.name!r} is dead"
        )
    return creator


#: One use of a slot: ``(layer, slot, parts)``.
Use = tuple[int, int, tuple[Part, ...]]


@dataclass
class Step:
    """The FFN side's current step: the uses of its slots, in order, and who is left out."""

    schedules: dict[int, StepSchedule]
    #: Layer by layer, the microbatches of a layer in turn.
    uses: list[Use]
    next: int = 0
    dropped: set[int] = field(default_factory=set)

    @property
    def shape(self) -> tuple[Use, ...]:
        """What a CUDA graph of the whole step is keyed by (the step number is not in it: it
        is a device word the graph reads)."""
        return tuple(self.uses)

    @classmethod
    def of(cls, schedules: dict[int, StepSchedule]) -> Step:
        layers = sorted({layer for s in schedules.values() for layer in s.layers})
        slots = max((len(s.microbatch_tokens) for s in schedules.values()), default=0)
        uses = []
        for layer in layers:
            for slot in range(slots):
                parts = tuple(
                    Part(a, s.microbatch_tokens[slot], s.layers.index(layer))
                    for a, s in sorted(schedules.items())
                    if layer in s.layers and slot < len(s.microbatch_tokens)
                )
                if parts:
                    uses.append((layer, slot, parts))
        return cls(schedules, uses)


class StepGraphs:
    """Whole FFN steps as CUDA graphs, one per step shape (``Step.shape``: the uses of the
    step, each attention rank's rows and layer positions). A shape seen once runs eagerly (it
    warms the kernels up); seen again, it is captured (a capture runs nothing), then replayed,
    and replayed from then on. The step number is a device word the graph reads, set before
    each replay (``FFNPlane.begin``), so a replay serves the step announced, with no Python on
    the token path. At most ``limit`` graphs (each holds its own memory pool); shapes past it
    run eagerly. NOT YET RUN ON A GPU (the device check captures and replays the same stream
    of plane operations, and this class around the slots endpoints, with a PyTorch reference
    MoE: ``testing/slot_plane_check.py``)."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._seen: set[tuple] = set()

    def run(self, shape: tuple, step: Callable[[], None]) -> None:
        graph = self._graphs.get(shape)
        if graph is None:
            if shape not in self._seen or len(self._graphs) >= self.limit:
                self._seen.add(shape)
                step()
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self._graphs[shape] = graph
        graph.replay()


class _MovedOn(Exception):
    """An attention rank announced a newer step while the FFN side waited for this one."""


class SlotsFFNTransport(FFNTransport):
    """FFN endpoint: owns its data buffer and control block; serves announced steps (module
    docstring). ``recv`` returns one use of a slot: every attention rank's request of it."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        super().__init__(spec, rank)
        problem = shm_platform_problem()
        if problem is not None:
            raise RuntimeError(problem)
        requested = spec.addresses[rank] if rank < len(spec.addresses) else ""
        prefix = requested or CONTROL_PREFIX
        reap_stale_control_blocks(prefix)
        self.memory = plane_memory(spec)
        self.plane = FFNPlane(PlaneLayout.of(spec), self.memory, rank)
        self.control = ControlBlock.create(
            self.plane.layout, spec.moe_layers, self.plane.handle, prefix, rank
        )
        self._served = [0] * spec.num_attention_ranks  # the last step taken, per rank
        self._step: Step | None = None
        self._first_seen: float | None = None  # a step announced while others are awaited
        self._left_out: set[int] = set()  # ranks left out of a step (logged once each)
        self._backoff = Backoff(WaitPolicy())
        self._closing = False

    @property
    def address(self) -> str:
        return self.control.name

    @property
    def serves_steps(self) -> bool:
        """Whole steps (``FFNTransport.serves_steps``) where waits are the device's: a wait
        there cannot leave a rank out of the rest of a step, and a step can be a CUDA graph."""
        return self.memory.records_waits

    def next_step(self, timeout_s: float) -> Step | None:
        """The next announced step (``recv``'s rule for who is in it), its step words set;
        ``None`` when none came within ``timeout_s``."""
        return self._next_step(time.perf_counter() + timeout_s)

    def serve_use(self, slot: int, parts: tuple[Part, ...], forward) -> None:
        """One use of a step in stream order (``FFNPlane.serve``): every part's rows in one
        ``forward(x, topk_ids, topk_weights, out)``, every answer published."""
        self.plane.serve(slot, parts, forward)

    def fail_uses(self, uses: list[Use], message: str) -> None:
        """Answer every part of ``uses`` with ``message``: their attention ranks' waits end
        (recorded as failed) instead of spinning to their bound."""
        for _, slot, parts in uses:
            for part in parts:
                self.plane.fail(slot, part, message)

    def end_step(self) -> None:
        """The step is served: what its device waits recorded is logged (the attention ranks
        that moved on see their own)."""
        self._step = None
        try:
            self.memory.check()
        except FFNTimeout as exc:
            logger.warning("AFD FFN rank %d: %s", self.rank, exc)

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """The next use of a slot of the current step (or of the next announced step, waiting
        up to ``timeout_s`` for one): one request per attention rank that sent it. Inside a
        step a rank's request is awaited up to ``spec.timeout_s``; a rank that does not send
        it, or moves on, is left out of the rest of the step."""
        deadline = time.perf_counter() + timeout_s
        while True:
            if self._step is None:
                self._step = self._next_step(deadline)
                if self._step is None:
                    return []
            step = self._step
            if step.next == len(step.uses):
                self.end_step()
                continue
            layer, slot, parts = step.uses[step.next]
            step.next += 1
            requests = [
                request
                for part in parts
                if part.attention_rank not in step.dropped
                and (request := self._take(step, layer, slot, part)) is not None
            ]
            if requests:
                return requests

    def _next_step(self, deadline: float) -> Step | None:
        """Every attention rank's next schedule, or those announced when half of
        ``timeout_s`` passed since the first; ``None`` if none came by ``deadline``."""
        everyone = self.spec.num_attention_ranks
        self._backoff.reset()
        while True:
            fresh = {}
            for a in range(everyone):
                if self.control.announced_step(a) > self._served[a]:
                    schedule = self.control.schedule(a)
                    if schedule is not None and schedule.step > self._served[a]:
                        fresh[a] = schedule
            now = time.perf_counter()
            if fresh:
                self._first_seen = self._first_seen or now
                if len(fresh) == everyone or now - self._first_seen > self.spec.timeout_s / 2:
                    self._first_seen = None
                    return self._start(fresh)
            if now >= deadline:
                return None
            self._backoff.pause()

    def _start(self, fresh: dict[int, StepSchedule]) -> Step:
        missing = set(range(self.spec.num_attention_ranks)) - set(fresh)
        for a in missing - self._left_out:
            logger.warning(
                "AFD FFN rank %d: attention rank %d announced no step within %.0f s of the "
                "others; serving them without it",
                self.rank,
                a,
                self.spec.timeout_s / 2,
            )
        self._left_out |= missing
        running = {}
        for a, schedule in fresh.items():
            self._served[a] = schedule.step
            if schedule.mode == Mode.CAPTURE:  # recorded, not sent: nothing to wait for
                continue
            self.plane.begin(a, schedule.step)
            running[a] = schedule
        return Step.of(running)

    def _take(self, step: Step, layer: int, slot: int, part: Part) -> FFNRequest | None:
        """``part``'s request as an ``FFNRequest`` (views of its slot), or ``None`` when its
        attention rank did not send it (it is left out of the rest of the step)."""
        a = part.attention_rank
        schedule = step.schedules[a]
        try:
            view = self.plane.take(slot, part, lambda: self._check_current(a, schedule.step))
        except (PlaneError, FFNTimeout, _MovedOn) as why:
            step.dropped.add(a)
            logger.warning(
                "AFD FFN rank %d: attention rank %d left step %d at layer %d (%s); serving "
                "the others",
                self.rank,
                a,
                schedule.step,
                layer,
                why or type(why).__name__,
            )
            return None
        x, ids, weights, out = view.rows(part.rows)
        return FFNRequest(
            a, layer, x, ids, weights, (slot, part), out, schedule.step, slot, schedule
        )

    def _check_current(self, attention_rank: int, step: int) -> None:
        """While a host wait blocks: end it when the endpoint closes, or when the rank
        announced another step (it abandoned this one)."""
        if self._closing:
            raise _MovedOn("the endpoint is closing")
        if self.control.announced_step(attention_rank) != step:
            raise _MovedOn(f"it announced step {self.control.announced_step(attention_rank)}")

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """See ``FFNTransport.reply``; ``out`` may be ``request.reply_buffer`` itself."""
        slot, part = request.reply_key
        buffer = request.reply_buffer
        if out is not buffer:
            if out.shape != buffer.shape:
                raise ValueError(f"reply must be {list(buffer.shape)}, got {list(out.shape)}")
            buffer.copy_(out)
        self.plane.answer(slot, part)

    def reply_error(self, request: FFNRequest, message: str) -> None:
        """See ``FFNTransport.reply_error``: the text goes into the slot's ``out``; the rank is
        left out of the rest of the step (its forward fails)."""
        slot, part = request.reply_key
        self.plane.fail(slot, part, message)
        if self._step is not None:
            self._step.dropped.add(part.attention_rank)

    def close(self) -> None:
        """Mark the control block closed (waiting attention ranks fail fast), unlink it and
        the data buffer."""
        if self._closing:
            return
        self._closing = True
        self.control.close(creator=True)
        self.memory.close()


class SlotsBackend(Backend):
    """The slot plane: host memory on CPUs, device memory (CUDA IPC, Triton flags) on GPUs."""

    name = "slots"
    attention = SlotsAttentionTransport
    ffn = SlotsFFNTransport
    supports_failover = False
    scales_live = False
    isolates_requests = False
    shares_group = False
    needs_steps = True
    settings = {"waits": str}

    @classmethod
    def config_problem(cls, config) -> str | None:
        problem = super().config_problem(config)
        if problem is None and config.get("waits", "host") not in WAITS:
            return f"slots setting waits takes one of {', '.join(WAITS)}, got {config['waits']!r}"
        return problem

    @classmethod
    def host_problem(cls) -> str | None:
        """The control block's seqlock relies on x86-64 store order, as shm does."""
        return shm_platform_problem()

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        if attention_device == ffn_device:
            return None
        return (
            f"slots: the slot plane lives in one kind of memory; this deployment has attention "
            f"ranks on {attention_device} and FFN ranks on {ffn_device} (--afd-ffn-device)"
        )

    @classmethod
    def reap_stale(cls) -> list[str]:
        return reap_stale_control_blocks()
