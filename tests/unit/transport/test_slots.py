"""The ``slots`` backend (``transport/slots.py``) on host memory, with both wait semantics (host:
requests served as they come; the device's: whole steps, the CPU stand-in of the GPU layer):
steps of several attention and FFN ranks against the reference, every attention rank's rows of
a use in one FFN batch of a step served whole, errors, a rank that abandons a step or never
announces one, a dead FFN rank, the device's recorded waits, the control block, and what the
backend refuses. The contract every backend that serves requests keeps (loopback, processes,
control, failover) is tested over slots there."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from transport_testlib import EXPERTS, expected, routing

from vllm_afd.errors import FFNRankLost, FFNServeError, FFNTimeout, ProtocolError, StepsFailed
from vllm_afd.testing.ffn import DelayedForward, serve_ffn
from vllm_afd.testing.reference import LocalMoE
from vllm_afd.transport import (
    Feature,
    TransportSpec,
    backend,
    create_attention_transport,
    create_ffn_transport,
)
from vllm_afd.transport.base import ServesSteps
from vllm_afd.transport.control import Mode, Step, StepSchedule
from vllm_afd.transport.control_block import SCHEDULE_RING, ControlBlock
from vllm_afd.transport.slot_plane import PlaneLayout

pytestmark = pytest.mark.timeout(120)
LAYERS = (1, 3, 4)


def _spec(attention: int = 2, ffn: int = 2, **overrides) -> TransportSpec:
    fields = dict(
        backend="slots",
        num_attention_ranks=attention,
        num_ffn_ranks=ffn,
        num_experts=8,
        hidden_size=32,
        top_k=2,
        max_tokens=16,
        timeout_s=10.0,
        moe_layers=LAYERS,
    )
    return TransportSpec(**{**fields, **overrides})


class Group:
    """FFN endpoints served by threads (the reference loop), attention endpoints attached."""

    def __init__(self, spec: TransportSpec, forward=None) -> None:
        self.ffn = [create_ffn_transport(spec, f) for f in range(spec.num_ffn_ranks)]
        self.spec = dataclasses.replace(spec, addresses=tuple(f.address for f in self.ffn))
        self.attention = [
            create_attention_transport(self.spec, a) for a in range(spec.num_attention_ranks)
        ]
        #: per recv: (attention rank, rows) of its requests
        self.batches: list[list[tuple[int, int]]] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._serve, args=(f, forward), daemon=True)
            for f in range(spec.num_ffn_ranks)
        ]
        for t in self.threads:
            t.start()

    def _serve(self, f: int, forward) -> None:
        endpoint = self.ffn[f]
        forward = forward or LocalMoE.for_rank(EXPERTS, self.spec, f)
        if isinstance(endpoint, ServesSteps):
            self._serve_steps(endpoint, forward)
            return
        recv = endpoint.recv

        def recording(timeout_s):
            requests = recv(timeout_s)
            if requests:
                self.batches.append([(r.src_rank, r.x.shape[0]) for r in requests])
            return requests

        endpoint.recv = recording
        serve_ffn(endpoint, forward, self.stop.is_set)

    def _serve_steps(self, endpoint: ServesSteps, forward) -> None:
        """Whole steps, as ``FFNExecutor._serve_step`` serves them (eagerly, on the host)."""
        while not self.stop.is_set():
            step = endpoint.next_step(0.05)
            if step is None:
                continue
            for _, slot, parts in step.uses:
                endpoint.serve_use(slot, parts, forward)
                self.batches.append([(p.attention_rank, p.rows) for p in parts])
            endpoint.end_step()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)
        for endpoint in self.attention + self.ffn:
            endpoint.close()


@pytest.fixture
def group():
    made = []

    def make(spec, forward=None) -> Group:
        made.append(Group(spec, forward))
        return made[-1]

    yield make
    for g in made:
        g.close()


def _step(endpoint, step: int, tokens: tuple[int, ...], seed: int, layers=LAYERS) -> dict:
    """One step of ``endpoint``: per layer, dispatch every microbatch, then combine them (the
    order of two microbatches taking turns); returns ``{(layer, mb): (got, want)}``."""
    endpoint.begin_step(StepSchedule(step, tokens, layers))
    results = {}
    for layer in layers:
        handles = {}
        for mb, n in enumerate(tokens):
            x, ids, weights = routing(n, endpoint.spec, seed + 10 * layer + mb)
            handles[mb] = (endpoint.dispatch(layer, x, ids, weights, mb), (x, ids, weights))
        for mb, (handle, inputs) in handles.items():
            results[layer, mb] = (endpoint.combine(handle), expected(endpoint.spec, *inputs))
    return results


def _run_ranks(endpoints, body) -> list:
    """``body(a, endpoint)`` on a thread per attention rank; their results, errors raised."""
    out, errors = [None] * len(endpoints), []

    def run(a):
        try:
            out[a] = body(a, endpoints[a])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in range(len(endpoints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("waits", ["host", "device"])
def test_steps_of_two_attention_and_two_ffn_ranks_match_the_reference(group, waits):
    """Three steps of two microbatches (a TP rank's empty share among them), every answer
    exactly the reference's; served whole (the device's waits), each FFN batch holds both
    attention ranks' rows of a use, all of them (fixed shapes)."""
    g = group(_spec(config={"waits": waits}))
    sizes = [[(5, 3), (16, 1), (2, 0)], [(4, 4), (7, 2), (1, 6)]]

    def body(a, endpoint):
        got = {}
        for step, tokens in enumerate(sizes[a], start=1):
            got.update({(step, *k): v for k, v in _step(endpoint, step, tokens, 100 * a).items()})
        return got

    for per_rank in _run_ranks(g.attention, body):
        for key, (got, want) in per_rank.items():
            assert torch.equal(got, want), key
    if waits == "host":  # served as they come, each FFN rank only the rows routed to it
        assert g.batches and all(rows <= 16 for b in g.batches for _, rows in b)
        return
    # 3 steps x 3 layers x 2 microbatches per FFN rank, each one batch of both attention ranks,
    # each rank's rows as it announced them
    assert len(g.batches) == 2 * 3 * 3 * 2
    assert all(sorted(rank for rank, _ in b) == [0, 1] for b in g.batches)
    sent = sum(n for rank in sizes for tokens in rank for n in tokens)
    assert sum(rows for b in g.batches for _, rows in b) == 2 * len(LAYERS) * sent


def test_an_error_answer_fails_that_rank_only_and_the_next_step_is_served(group):
    def forward(x, ids, weights, out):
        if x.shape[0] == 9:  # attention rank 0's rows in step 1
            raise RuntimeError("poisoned rows")
        return LocalMoE.for_rank(EXPERTS, g.spec, 0)(x, ids, weights, out)

    g = group(_spec(ffn=1), forward)
    sizes = [(9,), (3,)]

    def body(a, endpoint):
        try:
            _step(endpoint, 1, sizes[a], a)
        except FFNServeError as error:
            outcome = str(error)
        else:
            outcome = "ok"
        return outcome, _step(endpoint, 2, (2,), 50 + a)

    (first, second), (other, other_second) = _run_ranks(g.attention, body)
    assert "FFN rank 0: RuntimeError: poisoned rows" in first
    assert other == "ok"
    for got, want in [*second.values(), *other_second.values()]:
        assert torch.equal(got, want)


@pytest.mark.parametrize("waits", ["host", "device"])
def test_a_rank_that_abandons_a_step_is_left_out_at_once(group, waits):
    """Attention rank 0 leaves step 1 after its first layer (as after an error); an FFN rank
    serving whole steps stops waiting for it when it announces step 2 (a flag past the awaited
    value), long before the timeout, and serves on."""
    g = group(_spec(attention=1, ffn=1, timeout_s=30.0, config={"waits": waits}))
    endpoint = g.attention[0]
    endpoint.begin_step(StepSchedule(1, (4,), LAYERS))
    x, ids, weights = routing(4, endpoint.spec, 1)
    endpoint.combine(endpoint.dispatch(LAYERS[0], x, ids, weights))
    start = time.perf_counter()
    results = _step(endpoint, 2, (3,), 7)
    assert time.perf_counter() - start < 10
    for got, want in results.values():
        assert torch.equal(got, want)


def test_a_rank_that_announces_no_step_is_left_out_after_half_the_timeout(group):
    g = group(_spec(timeout_s=2.0, ffn=1, config={"waits": "device"}))
    results = _step(g.attention[0], 1, (3,), 5)  # attention rank 1 never announces
    for got, want in results.values():
        assert torch.equal(got, want)
    assert all([rank for rank, _ in b] == [0] for b in g.batches)


def test_device_waits_record_a_failed_wait_and_raise_it_at_the_next_announcement():
    spec = _spec(attention=1, ffn=1, timeout_s=0.3, config={"waits": "device"})
    ffn = create_ffn_transport(spec, 0)  # never served
    endpoint = create_attention_transport(dataclasses.replace(spec, addresses=(ffn.address,)), 0)
    try:
        endpoint.begin_step(StepSchedule(1, (2,), LAYERS))
        x, ids, weights = routing(2, spec, 3)
        endpoint.combine(endpoint.dispatch(LAYERS[0], x, ids, weights))  # no raise: recorded
        with pytest.raises(StepsFailed, match=r"a wait of step 1 \(layer position 0\) ended") as e:
            endpoint.begin_step(StepSchedule(2, (2,), LAYERS))
        assert isinstance(e.value.cause, FFNTimeout) and e.value.steps == range(1, 2)
        endpoint.begin_step(StepSchedule(3, (2,), LAYERS))  # checked once
        # a CUDA-graph capture neither reads the device word nor sets the step word
        endpoint.combine(endpoint.dispatch(LAYERS[0], x, ids, weights))  # recorded again
        word = int(endpoint.plane.step)
        endpoint.begin_step(StepSchedule(4, (2,), LAYERS, Mode.CAPTURE))
        assert int(endpoint.plane.step) == word
        with pytest.raises(StepsFailed, match=r"a wait of step 3 \(layer position 0\) ended"):
            endpoint.begin_step(StepSchedule(5, (2,), LAYERS))
    finally:
        endpoint.close()
        ffn.close()


def test_a_dead_ffn_process_ends_every_device_wait_of_the_step_at_once(start_ffn):
    """The device's waits cannot watch the FFN process: the attention endpoint's watchdog does,
    and aborts them (``RecordedWaits.abort``). The FFN rank is killed while it computes the
    step's first use: the step's six waits end within a watch interval or two instead of each
    spinning to the timeout, and the next announcement raises the loss, naming the rank."""
    spec = _spec(attention=1, ffn=1, timeout_s=20.0, config={"waits": "device"})
    forward = DelayedForward(LocalMoE.for_rank(EXPERTS, spec, 0), delay_s=60.0)
    cluster = start_ffn(spec, [forward])
    endpoint = create_attention_transport(cluster.spec, 0)
    try:
        endpoint.begin_step(StepSchedule(1, (2, 2), LAYERS))
        threading.Timer(0.3, cluster.kill, args=(0,)).start()
        start = time.perf_counter()
        for layer in LAYERS:
            handles = [endpoint.dispatch(layer, *routing(2, spec, mb), mb) for mb in (0, 1)]
            for handle in handles:
                endpoint.combine(handle)  # recorded, not raised: a device wait
        assert time.perf_counter() - start < spec.timeout_s  # one wait's bound, for six
        with pytest.raises(FFNRankLost, match=r"FFN rank 0 \(pid \d+\) died"):
            endpoint.begin_step(StepSchedule(2, (2,), LAYERS))
    finally:
        endpoint.close()


def test_a_closed_ffn_rank_fails_the_wait_within_the_watch_interval():
    spec = _spec(attention=1, ffn=1, timeout_s=30.0)
    ffn = create_ffn_transport(spec, 0)
    endpoint = create_attention_transport(dataclasses.replace(spec, addresses=(ffn.address,)), 0)
    try:
        endpoint.begin_step(StepSchedule(1, (2,), LAYERS))
        handle = endpoint.dispatch(LAYERS[0], *routing(2, spec, 3))
        ffn.close()
        start = time.perf_counter()
        with pytest.raises(FFNRankLost, match="FFN rank 0 .* closed its endpoint"):
            endpoint.combine(handle)
        assert time.perf_counter() - start < 5
    finally:
        endpoint.close()


def test_misuse_is_refused_naming_what_was_announced():
    spec = _spec(attention=1, ffn=1)
    ffn = create_ffn_transport(spec, 0)
    endpoint = create_attention_transport(dataclasses.replace(spec, addresses=(ffn.address,)), 0)
    try:
        x, ids, weights = routing(3, spec, 1)
        with pytest.raises(ProtocolError, match="outside an announced step"):
            endpoint.dispatch(1, x, ids, weights)
        endpoint.begin_step(StepSchedule(1, (2, 2), LAYERS))
        with pytest.raises(ProtocolError, match=r"dispatched 3 tokens of microbatch 0; step 1 "):
            endpoint.dispatch(1, x, ids, weights)
        with pytest.raises(ProtocolError, match="layer 2 outside an announced step"):
            endpoint.dispatch(2, x[:2], ids[:2], weights[:2])
        endpoint.dispatch(1, x[:2], ids[:2], weights[:2])
        with pytest.raises(RuntimeError, match="slot 0 is busy"):
            endpoint.dispatch(3, x[:2], ids[:2], weights[:2])
        wrong = dataclasses.replace(spec, addresses=(ffn.address,), max_tokens=8)
        with pytest.raises(ValueError, match="disagree on the TransportSpec"):
            create_attention_transport(wrong, 0)
    finally:
        endpoint.close()
        ffn.close()


def test_what_the_backend_takes_and_refuses():
    slots = backend("slots")
    assert slots.config_problem({"waits": "device"}) is None
    assert "waits takes one of host, device, got 'gpu'" in slots.config_problem({"waits": "gpu"})
    assert "takes no setting foo" in slots.config_problem({"foo": 1})
    assert slots.device_problem("cpu", "cpu") is None
    assert slots.device_problem("cuda", "cuda") is None
    assert "attention ranks on cuda and FFN ranks on cpu" in slots.device_problem("cuda", "cpu")
    assert slots.features({"waits": "device"}) == {Feature.FAILOVER}
    assert Feature.FAILOVER in slots.features({"waits": "host"})


def test_a_schedule_read_while_it_is_written_is_not_taken():
    layout = PlaneLayout(2, 2, 4, 8, 2, torch.float32)
    block = ControlBlock.create(layout, LAYERS, "data-handle", "afdtestctl_", 0)
    try:
        peer = ControlBlock.attach(block.name, layout, LAYERS)
        assert peer.handle == "data-handle" and peer.schedule(1) is None
        schedule = StepSchedule(4, (3, 1), LAYERS)
        peer.announce(1, schedule)
        assert block.schedule(1) == schedule and block.announced_step(1) == 4
        base = block._base(1)
        block.words[base] = 0  # a writer between its first and its last store
        assert block.schedule(1) is None and block.announced_step(1) == 0
        peer.announce(1, schedule)
        # an attention rank's answer buffer: offered, offered again (a restarted front-end)
        assert block.answers(0) is None and block.answers_generation(0) == 0
        peer.offer_answers(0, "answers-a")
        assert block.answers(0) == (2, "answers-a") and block.answers(1) is None
        peer.offer_answers(0, "answers-b")
        assert block.answers(0) == (4, "answers-b") and block.schedule(1) == schedule
        block.words[block._answer_word(0)] = 5  # a writer half-way
        assert block.answers(0) is None
        peer.close()
        with pytest.raises(ValueError, match="has layout"):
            ControlBlock.attach(block.name, PlaneLayout(2, 2, 4, 8, 3, torch.float32), LAYERS)
    finally:
        block.close(creator=True)


def test_a_step_shape_is_laid_out_once_and_handed_out_again():
    """An FFN rank serving whole steps decodes the schedules and lays out a step's uses once
    per shape (the step numbers are not in it: they are device words), so every step of a
    shape gets the same ``Step``; other tokens, or an answer buffer offered again make another
    shape. The attention ranks' capture of a graph comes as the step its replays will
    announce (``Step.capture``: each rank's schedule as a step to run, nothing to serve)."""
    spec = _spec(attention=2, ffn=1, config={"waits": "device"})
    ffn = create_ffn_transport(spec, 0)
    assert isinstance(ffn, ServesSteps)
    layout = ffn.plane.layout
    block = ControlBlock.attach(ffn.address, layout, LAYERS)

    def announce(step: int, tokens: list[tuple[int, ...]], mode: Mode = Mode.RUN):
        for a, counts in enumerate(tokens):
            block.announce(a, StepSchedule(step, counts, LAYERS, mode))
        served = ffn.next_step(1.0)
        ffn.end_step()
        return served

    try:
        first = announce(1, [(3, 2), (4, 1)])
        assert (
            first.uses
            == Step.of(
                {0: StepSchedule(1, (3, 2), LAYERS), 1: StepSchedule(1, (4, 1), LAYERS)},
                first.shape,
            ).uses
        )
        assert [len(parts) for _, _, parts in first.uses] == [2] * 2 * len(LAYERS)
        assert announce(2, [(3, 2), (4, 1)]) is first
        assert [int(w) >> 16 for w in ffn.plane.steps] == [2, 2]  # each rank's step word
        other = announce(3, [(3, 2), (4, 2)])
        assert other is not first and other.shape != first.shape
        assert not first.capture
        capture = announce(4, [(8, 8), (8, 8)], Mode.CAPTURE)  # recorded, not sent
        assert capture.capture and [int(w) >> 16 for w in ffn.plane.steps] == [3, 3]  # unset
        replay = announce(5, [(8, 8), (8, 8)])
        assert not replay.capture and replay.shape == capture.shape
        assert replay.uses == capture.uses and len(replay.uses) == 2 * len(LAYERS)
        assert announce(6, [(3, 2), (4, 1)]) is first
        _, handle = ffn.memory.create(layout.answer_bytes)  # a restarted front-end's
        block.offer_answers(1, handle)
        again = announce(7, [(3, 2), (4, 1)])
        assert again is not first and again.uses == first.uses
        assert again.shape[0] == first.shape[0] + 1  # graphs write into the buffers they saw
    finally:
        block.close()
        ffn.close()


def test_the_ring_keeps_the_last_schedules_and_what_the_ffn_rank_took():
    layout = PlaneLayout(2, 2, 4, 8, 2, torch.float32)
    block = ControlBlock.create(layout, LAYERS, "data-handle", "afdtestctl_", 0)
    try:
        peer = ControlBlock.attach(block.name, layout, LAYERS)
        schedules = {s: StepSchedule(s, (s,), LAYERS) for s in range(1, 6)}
        for s in (1, 2, 3):
            peer.announce(0, schedules[s])
        assert sorted(block.announced_steps(0)) == [0, 1, 2, 3] and block.announced_step(0) == 3
        assert [StepSchedule.from_words(block.schedule_words(0, s)) for s in (1, 2, 3)] == [
            schedules[1],
            schedules[2],
            schedules[3],
        ]
        assert block.schedule(0) == schedules[3] and block.schedule_words(0, 4) is None
        assert block.announced_steps(1) == [0] * SCHEDULE_RING  # the other rank's ring
        peer.announce(0, schedules[4])
        assert peer.untaken(0, 5) == 1  # step 5 would write over step 1, not taken yet
        block.take(0, 1)
        assert peer.untaken(0, 5) == 0 and peer.taken_word(0)[0] == 1
        peer.announce(0, schedules[5])
        assert block.schedule_words(0, 1) is None and block.schedule(0) == schedules[5]
        peer.close()
    finally:
        block.close(creator=True)


def test_steps_announced_ahead_are_served_in_order_and_a_slow_ranks_capture_is_not_lost():
    """Attention rank 0 captures a graph (no device sync) and announces its next warm-up before
    rank 1 announced its own capture: the FFN rank serving whole steps still takes the capture
    of both, then the warm-up, each rank's steps in order."""
    spec = _spec(attention=2, ffn=1, config={"waits": "device"})
    ffn = create_ffn_transport(spec, 0)
    assert isinstance(ffn, ServesSteps)
    block = ControlBlock.attach(ffn.address, ffn.plane.layout, LAYERS)
    try:
        block.announce(0, StepSchedule(1, (4,), LAYERS, Mode.CAPTURE))
        block.announce(0, StepSchedule(2, (2,), LAYERS))
        block.announce(1, StepSchedule(1, (4,), LAYERS, Mode.CAPTURE))
        capture = ffn.next_step(1.0)
        assert capture is not None and capture.capture
        assert [block.taken_word(a)[0] for a in (0, 1)] == [1, 1]
        ffn.end_step()
        block.announce(1, StepSchedule(2, (2,), LAYERS))
        warm_up = ffn.next_step(1.0)
        assert warm_up is not None and not warm_up.capture
        assert {part.rows for _, _, parts in warm_up.uses for part in parts} == {2}
        assert [int(w) >> 16 for w in ffn.plane.steps] == [2, 2]
        ffn.end_step()
        assert ffn.next_step(0.05) is None  # nothing more announced
    finally:
        block.close()
        ffn.close()


def test_an_attention_rank_a_full_ring_ahead_waits_for_the_ffn_rank_then_times_out():
    """With the device's waits an attention rank announces a step into its ring only once the
    FFN rank took the step it replaces: it waits (here the FFN rank takes step 1 meanwhile),
    and fails after ``timeout_s`` naming the ring where the FFN rank takes nothing."""
    spec = _spec(attention=1, ffn=1, timeout_s=1.0, config={"waits": "device"})
    ffn = create_ffn_transport(spec, 0)
    assert isinstance(ffn, ServesSteps)
    endpoint = create_attention_transport(dataclasses.replace(spec, addresses=(ffn.address,)), 0)
    try:
        for s in range(1, SCHEDULE_RING + 1):  # captures: no device sync, nothing sent
            endpoint.begin_step(StepSchedule(s, (2,), LAYERS, Mode.CAPTURE))
        threading.Timer(0.2, lambda: ffn.next_step(1.0)).start()  # takes step 1
        start = time.perf_counter()
        endpoint.begin_step(StepSchedule(SCHEDULE_RING + 1, (2,), LAYERS, Mode.CAPTURE))
        assert 0.1 < time.perf_counter() - start < 1.0
        start = time.perf_counter()
        with pytest.raises(FFNTimeout, match=r"did not take step 2 .* ring of 4 .* is full"):
            endpoint.begin_step(StepSchedule(SCHEDULE_RING + 2, (2,), LAYERS, Mode.CAPTURE))
        assert 0.9 < time.perf_counter() - start < 5
    finally:
        endpoint.close()
        ffn.close()
