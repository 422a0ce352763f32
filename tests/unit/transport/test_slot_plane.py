"""The slot plane (``transport/slot_plane.py``) through its host memory: layout, the protocol
between threads and between processes, driven by vLLM's own ubatch threads (one yield per MoE
layer; the product's op with two yields and receive hooks: tests/unit/test_gpu_microbatching.py),
the bounded wait, and the device check's CPU run (its device steps SKIP here, so it cannot
rot)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transport_testlib import mappings

from tests.unit.ubatchlib import run_ubatch_threads
from vllm_afd.errors import FFNRankLost, FFNTimeout, StepsFailed
from vllm_afd.host import session_pids
from vllm_afd.testing import slot_plane_check, slots_check
from vllm_afd.testing.reference import (
    LocalMoE,
    ScaleExperts,
    SiluMulExperts,
    reference_moe_combine,
)
from vllm_afd.testing.slot_plane_check import combine, dispatch
from vllm_afd.transport.base import TransportSpec
from vllm_afd.transport.slot_plane import (
    LINE,
    POSITION_BITS,
    AnswerViews,
    AttentionPlane,
    FFNPlane,
    Part,
    PlaneLayout,
    SlotViews,
    step_word,
)
from vllm_afd.transport.slot_plane_host import HostPlaneMemory

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]


def _spans(buffer: torch.Tensor, tensors) -> list[tuple[int, int]]:
    spans = []
    for t in tensors:
        start = t.data_ptr() - buffer.data_ptr()
        assert start % LINE == 0
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= buffer.numel()
    return spans


def test_layout_keeps_flags_and_parts_apart_and_aligned():
    layout = PlaneLayout(3, 2, 5, 24, 3, torch.bfloat16)
    requests = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    views = [SlotViews(requests, layout, a, s) for a in range(3) for s in range(2)]
    _spans(requests, [t for v in views for t in (v.request, v.x, v.ids, v.weights)])
    answers = torch.zeros(layout.answer_bytes, dtype=torch.uint8)
    _spans(
        answers,
        [
            t
            for s in range(2)
            for t in (AnswerViews(answers, layout, s).response, AnswerViews(answers, layout, s).out)
        ],
    )
    # one microbatch's slots lie together: slot 0 of every attention rank, then slot 1
    assert layout.slot_offset(2, 0) < layout.slot_offset(0, 1)
    with pytest.raises(ValueError, match="PlaneLayout.max_tokens must be at least 1, got 0"):
        PlaneLayout(1, 2, 0, 8, 2, torch.float32)


def _link(ffn: list[FFNPlane], layout, memory, ranks: int) -> list[AttentionPlane]:
    """``ranks`` attention planes mapping every FFN plane's request buffer, each FFN plane
    mapping their answer buffers (one process: what control blocks carry between two)."""
    attention = [AttentionPlane(layout, memory, a, [p.handle for p in ffn]) for a in range(ranks)]
    for f, plane in enumerate(ffn):
        for a, peer in enumerate(attention):
            plane.attach_answers(a, peer.answer_handles[f])
    return attention


def _spec(attention: int, ffn: int, slots: int = 2) -> TransportSpec:
    return TransportSpec("slots", attention, ffn, 8, 16, 2, 6, torch.float32, num_slots=slots)


def _silu_experts() -> SiluMulExperts:
    g = torch.Generator().manual_seed(3)
    return SiluMulExperts(
        torch.randn(8, 16, 16, generator=g) / 4, torch.randn(8, 16, 8, generator=g) / 3
    )


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 16, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, 2, generator=g)


@pytest.mark.parametrize(
    ("experts", "exact"),
    [
        (ScaleExperts(torch.arange(1.0, 9.0)), True),
        (_silu_experts(), False),
    ],
)
def test_two_attention_ranks_and_two_ffn_ranks_get_the_reference_moe(experts, exact):
    """Every token goes to both FFN ranks; each computes its experts over the gathered rows of
    both attention ranks; each attention rank sums the two answers (threads, host memory)."""
    spec = _spec(attention=2, ffn=2)
    layout = PlaneLayout.of(spec)
    memory = HostPlaneMemory(timeout_s=20)
    ffn = [FFNPlane(layout, memory, f) for f in range(2)]
    attention = _link(ffn, layout, memory, 2)
    rows = [[6, 3], [2, 5]]  # per use of slot 0 (layer position 0, 1): each rank's tokens
    forwards = [LocalMoE.for_rank(experts, spec, f) for f in range(2)]
    for plane in ffn:
        for a in range(2):
            plane.begin(a, 7)
    for plane in attention:
        plane.begin(7)

    def serve(f: int) -> None:
        for position, use in enumerate(rows):
            parts = [Part(a, n, position) for a, n in enumerate(use)]
            ffn[f].serve(0, parts, lambda x, i, w, out, f=f: forwards[f](x, i, w, out))

    servers = [threading.Thread(target=serve, args=(f,)) for f in range(2)]
    for t in servers:
        t.start()
    got, want = {}, {}
    for use, counts in enumerate(rows):
        handles = []
        for a, n in enumerate(counts):
            x, ids, weights = _routing(n, seed=10 * use + a)
            want[use, a] = reference_moe_combine(x, ids, weights, experts, 8, 2)
            handles.append(dispatch(attention[a], 0, use, x, ids, weights))
        for a, h in enumerate(handles):
            got[use, a] = combine(attention[a], h)
    for t in servers:
        t.join(20)
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)


def test_a_restarted_front_ends_answer_buffer_takes_the_old_ones_place_unmapped():
    """A front-end restarted (an attention rank's new life: a new engine, a front-end of a
    shared FFN group joining again) offers a new answer buffer: the FFN rank answers into it,
    exactly, and unmaps the old one (else each restart would hold its pages for the FFN
    rank's life)."""
    spec = _spec(attention=1, ffn=1)
    layout = PlaneLayout.of(spec)
    experts = ScaleExperts(torch.arange(1.0, 9.0))
    ffn_memory = HostPlaneMemory(timeout_s=5.0)
    ffn = FFNPlane(layout, ffn_memory, 0)
    olds = []
    for life in range(3):
        memory = HostPlaneMemory(timeout_s=5.0)
        plane = AttentionPlane(layout, memory, 0, [ffn.handle])
        ffn.attach_answers(0, plane.answer_handles[0])
        assert mappings(plane.answer_handles[0]) == 2  # its creator's and the FFN rank's
        step = plane.last_step() + 1
        plane.begin(step)
        ffn.begin(0, step)
        x = _routing(4, seed=life)
        handle = dispatch(plane, 0, 0, *x)
        ffn.serve(0, [Part(0, 4, 0)], LocalMoE.for_rank(experts, spec, 0))
        assert torch.equal(combine(plane, handle), reference_moe_combine(*x, experts, 8, 1))
        olds.append(plane.answer_handles[0])
        memory.close()  # the front-end's life ends: its mapping goes with its views
        del plane, handle
        assert [mappings(old) for old in olds[:-1]] == [0] * life  # the FFN rank's too
    ffn_memory.close()


def test_dbo_order_is_the_alternation_of_two_ubatch_threads():
    assert slot_plane_check.dbo_order(2) == [
        ("D", 0, 0),
        ("D", 1, 0),
        ("C", 0, 0),
        ("D", 0, 1),
        ("C", 1, 0),
        ("D", 1, 1),
        ("C", 0, 1),
        ("C", 1, 1),
    ]
    assert slot_plane_check.dbo_order(1, microbatches=1) == [("D", 0, 0), ("C", 0, 0)]


@pytest.mark.parametrize("microbatches", [1, 2])
def test_an_ffn_process_serves_the_toy_model_identically_to_one_process(microbatches):
    """Two processes, host memory, float32: the residual toy model of the device check, in
    vLLM's DBO order for two microbatches, bit for bit the one-process reference."""
    result = slot_plane_check.run_pair("host", torch.float32, steps=2, microbatches=microbatches)
    assert result == {"max_abs_error": 0.0, "steps_checked": 2}


def test_a_combine_nobody_answers_fails_within_the_timeout_naming_the_flag():
    layout = PlaneLayout.of(_spec(attention=1, ffn=1))
    memory = HostPlaneMemory(timeout_s=0.2)
    ffn = FFNPlane(layout, memory, 0)
    (attention,) = _link([ffn], layout, memory, 1)
    x, ids, weights = _routing(3, seed=1)
    attention.begin(1)
    handle = dispatch(attention, 1, 0, x, ids, weights)
    with pytest.raises(FFNTimeout, match="response of FFN rank 0 to attention rank 0, slot 1"):
        combine(attention, handle)
    with pytest.raises(ValueError, match=r"send of 7 tokens: allowed 0\.\.6"):
        dispatch(attention, 0, 0, *_routing(7, seed=2))


def test_the_device_check_fits_five_minutes():
    assert sum(limit for _, limit in slot_plane_check.STEPS) <= 300


#: Imported at start by every interpreter that has its folder on ``PYTHONPATH`` (``site``):
#: makes ``import vllm`` fail, as on the device machine, which has PyTorch and Triton only.
NO_VLLM = """
import importlib.abc, sys

class _NoVLLM(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"{name}: not installed on the device machine (test)")

sys.meta_path.insert(0, _NoVLLM())
"""


def test_the_device_check_runs_on_cpu_with_its_device_steps_skipped(tmp_path):
    """As the device machine runs it: ``python -m vllm_afd.testing.slot_plane_check`` in a
    fresh interpreter where vLLM cannot be imported, in it or in the processes it spawns."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_VLLM)
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(site), str(REPO)))}
    blocked = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True)
    assert b"not installed on the device machine" in blocked.stderr
    args = ["--json", str(out), "--limit-scale", "3"]
    check = [sys.executable, "-m", "vllm_afd.testing.slot_plane_check", *args]
    done = subprocess.run(check, env=env, capture_output=True, text=True)  # steps: bounded
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    for host in ("host-plane", "host-slots"):
        assert report[host]["status"] == "PASS"
        assert report[host]["result"]["max_abs_error"] == 0.0
    assert report["host-plane"]["result"]["replaced_at"] == 2  # a lost FFN child's replacement
    # the announced capture is no step served; on the host every step runs eagerly
    assert report["host-slots"]["result"]["ffn_eager_steps"] == 4
    death = report["host-peer-death"]
    assert death["status"] == "PASS" and "died" in death["result"]["raised"]
    assert death["result"]["waits_ended_s"] <= slots_check.PEER_DEATH_BOUND_S
    device = "PASS" if torch.cuda.is_available() else "SKIP"
    cuda = (
        "cuda-ipc-probe",
        "cuda-plane",
        "cuda-graphs",
        "cuda-slots",
        "cuda-round-trip",
        "cuda-peer-death",
        "cuda-stalled-peer",
    )
    assert {report[s]["status"] for s in cuda} == {device}
    two = "PASS" if torch.cuda.device_count() > 1 else "SKIP"
    assert report["cuda-two-gpus"]["status"] == two


#: A step that hangs holding a multiprocessing queue (its semaphores in ``/dev/shm``, its
#: resource tracker a child of its own); prints the semaphores' names.
_HANGING_STEP = """
import multiprocessing as mp, time
queue = mp.get_context("spawn").Queue()
print(*(lock._semlock.name for lock in (queue._rlock, queue._wlock, queue._sem)), flush=True)
time.sleep(600)
"""


def test_a_step_stopped_at_its_timeout_leaves_no_process_and_no_semaphore():
    proc = subprocess.Popen(
        [sys.executable, "-c", _HANGING_STEP],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 3, names
        semaphores = [Path("/dev/shm") / ("sem." + name.lstrip("/")) for name in names]
        assert all(path.exists() for path in semaphores), semaphores
        assert len(session_pids(proc.pid)) == 2  # the step and its resource tracker
        slot_plane_check.stop_session(proc.pid)
        assert proc.wait(5) == -signal.SIGTERM
        assert session_pids(proc.pid) == []
        assert not [path for path in semaphores if path.exists()]
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.wait()


def _run_ubatches(monkeypatch, layers: int, moe_layer) -> tuple[list, dict, list, object]:
    """Two microbatches of the toy model through the plane on vLLM's own DBO machinery
    (``ubatchlib.run_ubatch_threads``), with an FFN thread serving
    layer by layer, each layer's microbatches in turn. ``moe_layer(ubatching, attention, model,
    calls, ubatch, layer, x) -> x`` is one MoE layer of the attention side."""
    from vllm.v1.worker import ubatching

    rows, hidden = 4, slot_plane_check.HIDDEN
    layout = PlaneLayout(1, 2, rows, hidden, slot_plane_check.TOP_K, torch.float32)
    memory = HostPlaneMemory(timeout_s=20)
    ffn = FFNPlane(layout, memory, 0)
    (attention,) = _link([ffn], layout, memory, 1)
    model = slot_plane_check.ToyMoE(torch.float32, torch.device("cpu"), layers)
    calls = []
    inputs = [torch.randn(rows, hidden) for _ in range(2)]

    def body(ubatch, x):
        for layer in range(layers):
            x = moe_layer(ubatching, attention, model, calls, ubatch, layer, x)
        return x

    forwards = [model.experts(layer) for layer in range(layers)]
    slot_plane_check.ffn_begin(ffn, 1)
    attention.begin(1)
    server = threading.Thread(target=slot_plane_check.ffn_step, args=(ffn, forwards, rows, 2))
    server.start()
    results = run_ubatch_threads(monkeypatch, inputs, body)
    server.join(20)
    return calls, results, inputs, model


def test_vllms_own_ubatch_threads_drive_the_plane_in_dbo_order(monkeypatch):
    """One yield between each dispatch and its combine: the calls come in ``dbo_order``'s
    order, and the answers are the one-process reference's, bit for bit."""

    def moe_layer(ubatching, attention, model, calls, ubatch, layer, x):
        handle = dispatch(attention, ubatch, layer, x, *model.route(layer, x))
        calls.append(("D", ubatch, layer))
        ubatching.dbo_yield()
        out = combine(attention, handle)
        calls.append(("C", ubatch, layer))
        return x + out

    calls, results, inputs, model = _run_ubatches(monkeypatch, 3, moe_layer)
    assert calls == slot_plane_check.dbo_order(3)
    for mb, x0 in enumerate(inputs):
        assert torch.equal(results[mb], model.reference(x0)[0])


class _CountingMemory(HostPlaneMemory):
    """Host memory with the device's waits that publishes every send (as device memory
    does, ``stores_on_host`` off) and counts each protocol operation by the thread calling it."""

    stores_on_host = False

    def __init__(self) -> None:
        super().__init__(timeout_s=10.0, device_waits=True)
        self.calls: dict[tuple[str, str], int] = {}
        self._inside = threading.local()

    def _count(self, operation: str) -> None:
        if getattr(self._inside, "operation", False):
            return  # host memory's publish signals, its wait_sum waits: one operation each
        key = (threading.current_thread().name, operation)
        self.calls[key] = self.calls.get(key, 0) + 1

    def _one(self, operation: str, run):
        self._count(operation)
        outer = getattr(self._inside, "operation", False)
        self._inside.operation = True
        try:
            return run()
        finally:
            self._inside.operation = outer

    def publish(self, dsts, srcs, flag, step, position) -> None:
        self._one(
            "publish",
            lambda: super(_CountingMemory, self).publish(dsts, srcs, flag, step, position),
        )

    def publish_all(self, dsts, srcs, flags, steps, positions, missed=None) -> None:
        self._one(
            "publish_all",
            lambda: super(_CountingMemory, self).publish_all(
                dsts, srcs, flags, steps, positions, missed
            ),
        )

    def wait_gather(self, flags, steps, positions, srcs, dsts, what, missed=None):
        return self._one(
            "wait_gather",
            lambda: super(_CountingMemory, self).wait_gather(
                flags, steps, positions, srcs, dsts, what, missed
            ),
        )

    def wait_sum(self, flags, steps, position, srcs, out, what):
        return self._one(
            "wait_sum",
            lambda: super(_CountingMemory, self).wait_sum(flags, steps, position, srcs, out, what),
        )

    def signal(self, flag, step, position, failed=False, missed=None) -> None:
        self._count("signal")
        super().signal(flag, step, position, failed, missed)

    def wait(self, flag, step, position, what, missed=None):
        self._count("wait")
        return super().wait(flag, step, position, what, missed)


@pytest.mark.parametrize(("attention_ranks", "ffn_ranks"), [(1, 1), (2, 1), (2, 2)])
def test_a_use_is_one_protocol_operation_per_side_and_direction(attention_ranks, ffn_ranks):
    """Through the memory interface, one use (a layer of one microbatch, fixed shapes) is, per
    attention rank, one ``publish`` per FFN rank (payload and flag: one kernel on a device) and
    one ``wait_sum`` of every FFN rank's answer (one kernel); on each FFN rank one wait for
    every attention rank's request (``wait_gather``, their rows side by side for one forward:
    one kernel) and one answer to all (a ``signal`` after experts that wrote in place, or a
    ``publish_all`` of each rank's share of the forward: one kernel), around the MoE kernel."""
    memory = _CountingMemory()
    spec = _spec(attention=attention_ranks, ffn=ffn_ranks)
    layout = PlaneLayout.of(spec)
    ffns = [FFNPlane(layout, memory, f) for f in range(ffn_ranks)]
    planes = _link(ffns, layout, memory, attention_ranks)
    experts = ScaleExperts(torch.arange(1.0, 9.0) / 4)
    parts = [Part(a, 3, 0) for a in range(attention_ranks)]
    servers = [
        threading.Thread(
            target=ffn.serve,
            args=(0, parts, LocalMoE.for_rank(experts, spec, f)),
            name=f"ffn{f}",
        )
        for f, ffn in enumerate(ffns)
    ]
    for ffn in ffns:
        for a in range(attention_ranks):
            ffn.begin(a, 1)
    for plane in planes:
        plane.begin(1)
    for server in servers:
        server.start()
    handles, inputs = [], []
    for plane in planes:
        x, ids, weights = _routing(3, seed=plane.rank)
        inputs.append((x, ids, weights))
        handles.append(dispatch(plane, 0, 0, x, ids, weights))
    outs = [combine(plane, handle) for plane, handle in zip(planes, handles, strict=True)]
    for server in servers:
        server.join(10)
    memory.check()
    for out, (x, ids, weights) in zip(outs, inputs, strict=True):
        assert torch.equal(out, reference_moe_combine(x, ids, weights, experts, 8, ffn_ranks))
    me = threading.current_thread().name
    alone = attention_ranks == 1
    expected = {(me, "publish"): attention_ranks * ffn_ranks, (me, "wait_sum"): attention_ranks}
    for f in range(ffn_ranks):
        expected[f"ffn{f}", "wait" if alone else "wait_gather"] = 1
        expected[f"ffn{f}", "signal" if alone else "publish_all"] = 1
    assert memory.calls == expected
    memory.close()


def test_recorded_waits_are_read_without_a_sync_once_per_failure_and_outlive_an_abort():
    """``check`` reads the failed waits' word in host memory, with no device sync, so the host
    may be a step ahead of the device (vLLM's async scheduling): a failure is raised once, at
    the first check after its wait ended, and a later failure of a step that check covered
    (the device still running it) is not raised again; after an abort, the check announcing
    step S raises why, leaves the waits of earlier steps aborted (the device may still run
    them: each would spin to its bound) and lets those of S wait."""
    memory = HostPlaneMemory(timeout_s=0.2, device_waits=True)
    buffer, _ = memory.create(64)
    flag, step = buffer[:8].view(torch.int64), step_word(memory.device)
    step.fill_(1 << POSITION_BITS)
    memory.wait(flag, step, 0, "an answer that never comes")  # gives up: recorded
    with pytest.raises(StepsFailed, match=r"a wait of step 1 \(layer position 0\) ended") as e:
        memory.check(2)
    assert isinstance(e.value.cause, FFNTimeout) and e.value.steps == range(1, 2)
    memory.wait(flag, step, 3, "another use of step 1, ended after the check")
    memory.check(3)  # covered by the raise for step 1
    memory.abort(FFNRankLost(0, "FFN rank 0 died"))
    step.fill_(3 << POSITION_BITS)
    start = time.perf_counter()
    memory.wait(flag, step, 0, "a use of step 3 when its peer died")
    with pytest.raises(StepsFailed, match="FFN rank 0 died") as e:
        memory.check(4)
    assert isinstance(e.value.cause, FFNRankLost) and e.value.steps == range(3, 4)
    memory.wait(flag, step, 1, "a use of step 3 the device still runs")  # aborted still
    assert time.perf_counter() - start < 0.15  # neither wait spun to its 0.2 s bound
    step.fill_(4 << POSITION_BITS)
    flag.fill_((4 << POSITION_BITS) + 1)
    memory.wait(flag, step, 0, "an answer of step 4")  # waits, and finds it
    memory.check(5)  # nothing new: step 3's aborted waits were covered by the abort's raise
    memory.close()


def test_a_steps_failed_waits_are_raised_once_its_sampled_tokens_are_ready():
    """``check_through(S)`` (W1 calls it once vLLM synchronized on step S's sampled tokens,
    S's device work done) raises for a failed wait of S or earlier, naming the steps it may
    have spoiled, and covers them: the next announcement raises nothing more for them. A
    failure of a later step (the host ran ahead) waits for its own check. A watchdog's
    abort is raised there too and stays for the announcement, which replaces the lost FFN
    rank (``StepsFailed`` naming no step: their requests failed already)."""
    memory = HostPlaneMemory(timeout_s=0.2, device_waits=True)
    buffer, _ = memory.create(64)
    flag, step = buffer[:8].view(torch.int64), step_word(memory.device)
    step.fill_(2 << POSITION_BITS)
    memory.wait(flag, step, 1, "an answer of step 2 that never comes")  # recorded
    memory.check_through(1)  # step 1's output is clean
    with pytest.raises(StepsFailed, match=r"a wait of step 2 \(layer position 1\)") as e:
        memory.check_through(2)
    assert isinstance(e.value.cause, FFNTimeout) and e.value.steps == range(2, 3)
    memory.check_through(2)  # once
    memory.check(3)  # covered
    step.fill_(4 << POSITION_BITS)
    memory.wait(flag, step, 0, "an answer of step 4, the host a step ahead")
    memory.check_through(3)  # not step 3's
    memory.lag = 1  # CUDA: the host a step ahead of the device
    with pytest.raises(StepsFailed, match="a wait of step 4") as e:
        memory.check_through(4)
    assert e.value.steps == range(3, 5)
    memory.check(5)
    memory.abort(FFNRankLost(0, "FFN rank 0 died"))
    step.fill_(5 << POSITION_BITS)
    memory.wait(flag, step, 0, "a use of step 5 when its peer died")  # ends at once
    with pytest.raises(StepsFailed, match="FFN rank 0 died") as e:
        memory.check_through(5)
    assert isinstance(e.value.cause, FFNRankLost) and e.value.steps == range(5, 6)  # 4: covered
    with pytest.raises(StepsFailed, match="FFN rank 0 died") as e:
        memory.check(6)  # the announcement: failover, with no step's requests to fail
    assert isinstance(e.value.cause, FFNRankLost) and not e.value.steps
    step.fill_(6 << POSITION_BITS)
    flag.fill_((6 << POSITION_BITS) + 1)
    memory.wait(flag, step, 0, "an answer of step 6")  # waits, and finds it
    memory.check_through(6)
    memory.check(7)
    memory.close()


@pytest.mark.parametrize("attention_ranks", [1, 2])
def test_an_ffn_wait_that_gave_up_answers_with_an_error_not_with_stale_rows(attention_ranks):
    """With the device's waits an FFN rank whose wait for a request gave up (its attention
    rank stalled past the bound) still runs the use, on what its slot held (a kernel cannot
    branch the host's way); its answer to that rank must be an error answer, so that the late
    request's own wait records a failure (its step's requests fail) instead of taking an
    answer computed from stale rows, which nothing would ever flag. The other ranks' answers
    of the use are exact."""
    ffn_memory = HostPlaneMemory(timeout_s=0.3, device_waits=True)
    memories = [HostPlaneMemory(timeout_s=5.0, device_waits=True) for _ in range(attention_ranks)]
    spec = _spec(attention=attention_ranks, ffn=1)
    layout = PlaneLayout.of(spec)
    ffn = FFNPlane(layout, ffn_memory, 0)
    planes = [AttentionPlane(layout, m, a, [ffn.handle]) for a, m in enumerate(memories)]
    for a, plane in enumerate(planes):
        ffn.attach_answers(a, plane.answer_handles[0])
        ffn.begin(a, 1)
        plane.begin(1)
    experts = ScaleExperts(torch.arange(1.0, 9.0) / 4)
    inputs = [_routing(3, seed=a) for a in range(attention_ranks)]
    # the slot holds rows of an earlier use: what the FFN rank computes on when it gives up
    dispatch(planes[0], 0, 0, *_routing(3, seed=9))
    planes[0].begin(2)
    ffn.begin(0, 2)
    handles = {a: dispatch(planes[a], 0, 0, *inputs[a]) for a in range(1, attention_ranks)}
    parts = [Part(a, 3, 0) for a in range(attention_ranks)]
    ffn.serve(0, parts, LocalMoE.for_rank(experts, spec, 0))  # rank 0's request: given up
    with pytest.raises(FFNTimeout, match="a wait of step 2"):
        ffn_memory.check()  # the FFN rank's own record of it (logged at its step's end)
    late = dispatch(planes[0], 0, 0, *inputs[0])  # rank 0 resumes: its request comes now
    combine(planes[0], late)
    with pytest.raises(StepsFailed, match=r"a wait of step 2 \(layer position 0\)"):
        memories[0].check(3)  # not a stale answer taken as its own
    for a, handle in handles.items():
        out = combine(planes[a], handle)
        assert torch.equal(out, reference_moe_combine(*inputs[a], experts, 8, 1))
        memories[a].check(2)
    for memory in (ffn_memory, *memories):
        memory.close()


def test_the_device_checks_stalled_peer_runs_on_the_host():
    """The device check's ``cuda-stalled-peer`` on host memory (the same function, the
    device's wait semantics): the stalled step fails on attention rank 0 through the FFN
    process's error answer (rank 1's request, awaited after rank 0's gave up, comes within
    its own bound here and is served); every output nothing flagged is exact."""
    result = slots_check.run_stalled_peer("host", torch.float32)
    assert "a wait of step 2 (layer position 1)" in result["raised"]["rank 0 step 2"], result
    assert result["max_abs_error"] == 0.0


def test_the_tables_a_cuda_graph_captured_outlive_the_cache(monkeypatch):
    """A graph keeps only its fused kernels' table addresses: past the cache's bound the
    tables no capture read are dropped, those a capture read are kept (``TritonWaits._table``,
    no Triton needed)."""
    from vllm_afd.transport import slot_plane_cuda

    class Tables(slot_plane_cuda.TritonWaits):
        device = torch.device("cpu")
        capturing = False

        def _capturing(self) -> bool:
            return self.capturing

    monkeypatch.setattr(slot_plane_cuda, "_MAX_TABLES", 2)
    memory = Tables()
    captured = memory._table([(1, 2)])  # built by the eager run before the capture
    memory.capturing = True
    assert memory._table([(1, 2)]) is captured  # the capture reads it
    assert memory._table([(3, 4)]) is None  # a capture cannot build one
    memory.capturing = False
    eager = [memory._table([(i, i)]) for i in range(10, 14)]
    assert memory._table([(1, 2)]) is captured  # kept across every drop
    assert memory._table([(13, 13)]) is eager[-1]
    assert len(memory._tables) <= 1 + 2
    assert torch.equal(captured, torch.tensor([[1, 2]]))


def test_a_lost_buffer_is_dropped_on_a_gpu_only_after_the_work_that_may_address_it(monkeypatch):
    """``CudaPlaneMemory.readdress``: the caller drops the lost FFN rank's buffer (closing its
    CUDA IPC mapping) once it returns, so it rewrites the captured tables, then waits for the
    device, where the spoiled steps' sends may still run (no GPU needed: the sync is
    recorded)."""
    from vllm_afd.transport import slot_plane_cuda

    synced: list[tuple[torch.device, list[int]]] = []
    memory = object.__new__(slot_plane_cuda.CudaPlaneMemory)  # no CUDA here to make one
    memory.device = torch.device("cpu")  # the tables' device; the sync's is recorded
    lost, replacement = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    table = memory._table([(lost.data_ptr() + 8, 5)])
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device: synced.append((device, table[0].tolist()))
    )
    memory.readdress(lost, replacement)
    assert synced == [(memory.device, [replacement.data_ptr() + 8, 5])]
