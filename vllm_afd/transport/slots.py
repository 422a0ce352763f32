"""The slot plane's backends: ``shm`` (one CPU host, host memory) and ``slots`` (the memory of
the attention ranks' device: host memory on CPUs, device memory shared by CUDA IPC on GPUs,
``slot_plane_cuda.py``). One protocol (``slot_plane.py``) and one attention endpoint
(``endpoint.AttentionEndpoint``) for both; what differs is how the FFN side serves, chosen by
the wait semantics (``waits``):

* host waits (CPUs; ``shm``, and ``slots`` by default there): ``PlaneFFN`` serves what is
  pending, each attention rank's requests as they come (``base.ServesRequests``), and the
  attention side sends each FFN rank only the rows routed to it. A wait that fails raises at
  once, so a lost FFN rank is seen within ``slot_plane.WATCH_INTERVAL_S``: failover, live
  scaling, request isolation and FFN groups shared by several front-ends all work here, as
  the attention endpoint and the executor provide them for every backend that serves requests.
* the device's waits (every GPU; ``waits: device`` on CPU, the stand-in of the GPU layer's
  host-side logic): ``SteppedPlaneFFN`` serves whole announced steps in stream order
  (``base.ServesSteps``), every row to every FFN rank, so that on a GPU a step is one CUDA
  graph per step shape (``ffn/step_graphs.py``). Each FFN rank waits until every attention
  rank announced its next step (its ``StepSchedule`` in the FFN rank's control block; vLLM's
  data-parallel ranks step together, idle ones with a dummy batch), then walks the union of
  their schedules (``control.Step``). A rank that has not announced within half of
  ``timeout_s`` after the first is left out of that step (logged) and served in a later one.
  Waits record where they fail and raise at the next step boundary: of the pool features above
  failover is claimed there (a lost FFN rank is replaced; the requests of the step its loss
  spoiled fail), the others not yet (``Backend.features``; docs/architecture.md, "The slot
  plane").

A backend of the plane on another memory subclasses these endpoints and supplies the memory
(``_make_memory``), the control block (``_make_control``, ``_connect``) and how an FFN process
is watched (``_watch``): ``nixl.py``, across hosts.

Where the attention ranks run on GPUs, ``waits`` is the device's (``resolve_settings``).
There is no Python relay and no hub: the schedule is a few words in shared memory, read once
per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import torch

from vllm_afd.errors import TransportError
from vllm_afd.host import shm_platform_problem
from vllm_afd.transport.base import (
    AttentionTransport,
    Backend,
    FFNRequest,
    FFNTransport,
    ServesRequests,
    ServesSteps,
    TransportSpec,
    UseForward,
)
from vllm_afd.transport.control import Mode, Part, Step, StepSchedule, StepShape, Use
from vllm_afd.transport.control_block import ControlBlock, reap_stale_control_blocks
from vllm_afd.transport.endpoint import AttentionEndpoint, device_waits, plane_memory
from vllm_afd.transport.slot_plane import (
    CPU_WORD,
    PLANE_PREFIX,
    ROWS_WORD,
    FFNPlane,
    PlaneLayout,
    PlaneMemory,
    SlotViews,
    value_use,
)
from vllm_afd.transport.slot_plane_failures import RecordedWaits
from vllm_afd.transport.slot_plane_host import HostWords
from vllm_afd.transport.wait import Backoff, WaitPolicy, current_cpu

logger = logging.getLogger("vllm.afd")
WAITS = ("host", "device")
#: Step shapes an FFN endpoint serving whole steps keeps built (``SteppedPlaneFFN._step``).
_MAX_SHAPES = 1024


class _PlaneFFN(FFNTransport):
    """What both FFN endpoints of the plane own: the request buffer and the control block, named
    ``<prefix>...`` (``spec.addresses[rank]`` when given, else ``PLANE_PREFIX``); and the
    attention ranks' answer buffers they map (``_map_answers``)."""

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank)
        self._wait = wait or WaitPolicy()
        self.memory = self._make_memory()
        self.plane = FFNPlane(PlaneLayout.of(spec), self.memory, rank)
        self.control = self._make_control()
        self._closing = False
        #: Per attention rank, the generation of the answer buffer mapped (0: none).
        self._answers = [0] * spec.num_attention_ranks

    @property
    def _prefix(self) -> str:
        """Its segments' name prefix: ``spec.addresses[rank]`` when given."""
        requested = self.spec.addresses[self.rank] if self.rank < len(self.spec.addresses) else ""
        return requested or PLANE_PREFIX

    def _make_memory(self) -> PlaneMemory:
        problem = shm_platform_problem()
        if problem is not None:
            raise RuntimeError(problem)
        reap_stale_control_blocks(self._prefix)
        return plane_memory(self.spec, self._prefix + "data_")

    def _make_control(self) -> ControlBlock:
        layout, handle = self.plane.layout, self.plane.handle
        return ControlBlock.create(layout, self.spec.moe_layers, handle, self._prefix, self.rank)

    def _map_answers(self, attention_rank: int) -> bool:
        """Map ``attention_rank``'s answer buffer if it offered a new one (a first, or a
        restarted front-end's); returns whether it did."""
        if self.control.answers_generation(attention_rank) == self._answers[attention_rank]:
            return False
        offered = self.control.answers(attention_rank)
        if offered is None:
            return False
        self._answers[attention_rank], handle = offered
        self.plane.attach_answers(attention_rank, handle)
        return True

    @property
    def address(self) -> str:
        return self.control.name

    def close(self) -> None:
        """Mark the control block closed (waiting attention ranks fail fast), unlink it and
        the request buffer."""
        if self._closing:
            return
        self._closing = True
        self.control.close(creator=True)
        self.memory.close()


class PlaneFFN(_PlaneFFN, ServesRequests):
    """FFN endpoint serving what is pending (host memory): a request flag whose value changed
    is a request; its step and position come from the value, its layer from its sender's
    announced schedule, its rows from the row-count word. Requests are views of their slot:
    valid until ``reply``."""

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank, wait)
        memory = self.memory
        if not isinstance(memory, HostWords) or memory.device_waits:
            raise ValueError(
                "slot plane: serving requests as they come needs host memory and host waits "
                "(waits: host); device memory serves whole steps"
            )
        #: Per (attention rank, slot): its slot views and request line.
        self._channels: list[tuple[int, int, SlotViews, memoryview]] = []
        for s, views in enumerate(self.plane.slots):
            for a, view in enumerate(views):
                assert view.request_words is not None  # host memory
                self._channels.append((a, s, view, view.request_words))
        self._seen = [0] * len(self._channels)
        #: Per attention rank: the step schedule last read from its control block.
        self._schedules: list[StepSchedule | None] = [None] * spec.num_attention_ranks
        self._backoff = Backoff(self._wait, pump=memory.pump)
        self._push = memory.push
        self._idle = False
        self._cpu = -1

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """See ``ServesRequests.recv``: every pending request, in dispatch order per rank."""
        cpu = self._cpu = current_cpu()
        requests = self._poll()
        if requests:
            self._idle = False
            return requests
        if not self._idle:  # first wait after serving: start again from the spin stage
            self._idle = True
            self._backoff.reset()
        # spin only if no attention rank last dispatched from the CPU this one runs on
        self._backoff.set_spin(all(line[CPU_WORD] != cpu for *_, line in self._channels))
        deadline = time.perf_counter() + timeout_s
        while True:
            now = self._backoff.pause()
            requests = self._poll()
            if requests:
                self._idle = False
                return requests
            if now >= deadline:
                return []

    def _poll(self) -> list[FFNRequest]:
        requests = []
        seen = self._seen
        for i, (a, slot, view, request) in enumerate(self._channels):
            value = request[0]
            if value == seen[i]:
                continue
            seen[i] = value
            made = self._request(i, a, slot, view, value, request[ROWS_WORD])
            if made is not None:
                requests.append(made)
        if len(requests) > 1:
            requests.sort(key=lambda r: (r.src_rank, _reply_key(r)[1], r.microbatch))
        return requests

    def _request(
        self, i: int, a: int, slot: int, view: SlotViews, value: int, rows: int
    ) -> FFNRequest | None:
        """The request of value ``value`` in channel ``i``, or ``None`` when it is refused with
        an error answer (a row count out of range, a use its sender's schedule does not have),
        stale (its sender already announced a newer step: nobody waits for it) or without an
        answer buffer (its sender offers one before its first step)."""
        step, position = value_use(value)
        schedule = self._schedules[a]
        if schedule is None or schedule.step != step:
            schedule = self._schedules[a] = self.control.schedule(a)
            self._map_answers(a)
        if (schedule is not None and schedule.step > step) or not self.plane.answers[a]:
            return None
        why = None
        if not 0 <= rows <= self.spec.max_tokens:
            why = f"corrupted request header: {rows} tokens, allowed 0..{self.spec.max_tokens}"
        elif schedule is None or schedule.step != step:
            why = f"step {step} was never announced (last: {schedule})"
        elif not 0 <= position < len(schedule.layers):
            why = f"position {position} is not in step {step}'s layers {list(schedule.layers)}"
        if why is not None:
            self._answer(i, value, None, failed=why)
            return None
        x, ids, weights = view.rows(rows)
        out = self.plane.answers[a][slot].rows(rows)
        layer = schedule.layers[position]  # type: ignore[union-attr]
        return FFNRequest(a, layer, x, ids, weights, (i, value), out, step, slot, schedule)

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """See ``ServesRequests.reply``; ``out``: ``[N, H]``, converted to ``spec.dtype``, or
        ``request.reply_buffer`` itself (already in place: nothing is copied)."""
        i, value = _reply_key(request)
        buffer = request.reply_buffer
        assert buffer is not None
        if out is not buffer:
            if out.shape != buffer.shape:
                raise ValueError(f"reply must be {list(buffer.shape)}, got {list(out.shape)}")
            buffer.copy_(out)
        self._answer(i, value, buffer)

    def reply_error(self, request: FFNRequest, message: str) -> None:
        """See ``ServesRequests.reply_error``: the text goes into the answer's ``out``."""
        i, value = _reply_key(request)
        self._answer(i, value, None, failed=message)

    def _answer(
        self, i: int, value: int, out: torch.Tensor | None, failed: str | None = None
    ) -> None:
        """Publish the answer to ``value`` in channel ``i`` (its ``out`` written), or an
        error answer with the text ``failed``; nothing for a request superseded meanwhile (its
        attention rank gave up on it and reused the slot)."""
        a, slot, _, request = self._channels[i]
        if request[0] != value:
            return
        answer = self.plane.answers[a][slot]
        if failed is not None:
            out = answer.write_error(failed)
        response = answer.response_words
        assert response is not None  # host memory
        response[CPU_WORD] = self._cpu
        response[0] = -value if failed is not None else value  # after the payload (TSO)
        if self._push is not None:
            regions = (out,) if out is not None and out.numel() else ()
            self._push(regions, answer.response_line[: CPU_WORD + 1])


class SteppedPlaneFFN(_PlaneFFN, ServesSteps):
    """FFN endpoint serving whole announced steps in stream order (module docstring)."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        super().__init__(spec, rank)
        self._served = [0] * spec.num_attention_ranks  # the last step taken, per rank
        self._first_seen: float | None = None  # a step announced while others are awaited
        self._left_out: set[int] = set()  # ranks left out of a step (logged once each)
        self._buffers = 0  # answer buffers mapped so far: in a step's shape (``Step.shape``)
        self._shapes: dict[tuple[StepShape, bool], Step] = {}
        self._backoff = Backoff(self._wait, pump=self.memory.pump)

    def next_step(self, timeout_s: float) -> Step | None:
        """Every attention rank's next schedule, or those announced when half of
        ``timeout_s`` passed since the first, their step words set; ``None`` if none came
        within ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        everyone = self.spec.num_attention_ranks
        self._backoff.reset()
        while True:
            fresh = {}
            for a in range(everyone):
                # its next step, in order (the ring: control_block.py); usually the one after
                served = self._served[a]
                words = self.control.schedule_words(a, served + 1)
                if words is None:
                    ahead = [s for s in self.control.announced_steps(a) if s > served]
                    words = self.control.schedule_words(a, min(ahead)) if ahead else None
                if words is not None:
                    fresh[a] = words
            now = time.perf_counter()
            if fresh:
                self._first_seen = self._first_seen or now
                if len(fresh) == everyone or now - self._first_seen > self.spec.timeout_s / 2:
                    self._first_seen = None
                    return self._start(fresh)
            if now >= deadline:
                return None
            self._backoff.pause()

    def _start(self, fresh: dict[int, tuple[int, ...]]) -> Step:
        """Start the step of the schedules ``fresh`` (their words, by attention rank)."""
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
        running, captures = [], []
        for a, words in fresh.items():
            self._served[a] = words[0]
            self.control.take(a, words[0])
            if self._map_answers(a):
                self._buffers += 1
            if words[1] == Mode.CAPTURE:  # recorded, not sent: nothing to wait for
                captures.append((a, (int(Mode.RUN), *words[2:])))  # as its replays will run
                continue
            self.plane.begin(a, words[0])
            running.append((a, words[1:]))
        if captures and not running:  # the step the captured graphs' replays will announce
            return self._step((self._buffers, tuple(captures)), True)
        return self._step((self._buffers, tuple(running)))

    def _step(self, shape: StepShape, capture: bool = False) -> Step:
        """The ``Step`` of ``shape``, built once per shape (decoding the schedules and laying
        out their uses costs about a millisecond at 7 attention ranks and 48 layers, a cache
        lookup a microsecond: docs/benchmarks.md). At ``_MAX_SHAPES`` shapes the cache starts
        again (prefill chunks of every size are shapes too)."""
        step = self._shapes.get((shape, capture))
        if step is None:
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes.clear()
            schedules = {a: StepSchedule.from_words((1, *rest)) for a, rest in shape[1]}
            step = self._shapes[shape, capture] = Step.of(schedules, shape, capture)
        return step

    def serve_use(self, slot: int, parts: tuple[Part, ...], forward: UseForward) -> None:
        """One use of a step in stream order (``FFNPlane.serve``): every part's rows in one
        ``forward(x, topk_ids, topk_weights, out)``, every answer published."""
        self.plane.serve(slot, parts, forward)

    def fail_uses(self, uses: Sequence[Use], message: str) -> None:
        """Answer every part of ``uses`` with ``message``: their attention ranks' waits end
        (recorded as failed) instead of spinning to their bound."""
        for _, slot, parts in uses:
            for part in parts:
                self.plane.fail(slot, part, message)

    def interrupt(self) -> None:
        """A device wait watches nothing but the abort word: set it."""
        if isinstance(self.memory, RecordedWaits):
            self.memory.abort(TransportError(f"FFN rank {self.rank} is stopping"))

    def end_step(self) -> None:
        """The step is served: what its device waits recorded is logged (the attention ranks
        that moved on see their own), as is an ``interrupt`` that ended them."""
        try:
            self.memory.check()
        except TransportError as exc:
            logger.warning("AFD FFN rank %d: %s", self.rank, exc)


class SlotsBackend(Backend):
    """The slot plane: host memory on CPUs, device memory (CUDA IPC, Triton flags) on GPUs;
    FFN ranks serve requests as they come with host waits, whole steps with the device's."""

    name = "slots"
    attention = AttentionEndpoint
    ffn = PlaneFFN
    needs_steps = True
    maps_peer_gpu_memory = True
    settings: ClassVar[Mapping[str, type]] = {"waits": str}

    @classmethod
    def endpoints(
        cls, settings: Mapping[str, Any]
    ) -> tuple[type[AttentionTransport], type[FFNTransport]]:
        if device_waits(settings):
            return cls.attention, SteppedPlaneFFN
        return cls.attention, cls.ffn

    @classmethod
    def config_problem(cls, config: Mapping[str, Any]) -> str | None:
        problem = super().config_problem(config)
        if problem is None and config.get("waits", "host") not in WAITS:
            return f"slots setting waits takes one of {', '.join(WAITS)}, got {config['waits']!r}"
        return problem

    @classmethod
    def resolve_settings(cls, settings: Mapping[str, Any], attention_device: str) -> dict[str, Any]:
        """On GPUs waits are the device's (a kernel cannot raise)."""
        if attention_device == "cpu":
            return dict(settings)
        return {**settings, "waits": "device"}

    @classmethod
    def host_problem(cls) -> str | None:
        """Host memory and the control block's seqlock rely on x86-64 store order."""
        return shm_platform_problem()

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        if attention_device == ffn_device:
            return None
        return (
            f"{cls.name}: the slot plane lives in one kind of memory; this deployment has "
            f"attention ranks on {attention_device} and FFN ranks on {ffn_device} "
            "(--afd-ffn-device)"
        )

    @classmethod
    def reap_stale(cls) -> list[str]:
        return reap_stale_control_blocks()


def _reply_key(request: FFNRequest) -> tuple[int, int]:
    """The plane's ``reply_key``: (channel, request value)."""
    return cast("tuple[int, int]", request.reply_key)


class ShmBackend(SlotsBackend):
    """One CPU host: the slot plane on host memory, FFN ranks serving requests as they come."""

    name = "shm"
    maps_peer_gpu_memory = False  # host memory only
    settings: ClassVar[Mapping[str, type]] = {}

    @classmethod
    def resolve_settings(cls, settings: Mapping[str, Any], attention_device: str) -> dict[str, Any]:
        return dict(settings)  # host waits on host memory, whatever the device

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        if attention_device == "cpu":
            return None
        return (
            f"{cls.name}: hidden states travel through host memory, which cannot serve a "
            f"{attention_device.upper()} model; use --afd-transport slots on GPUs"
        )
