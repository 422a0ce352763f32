"""Failover on the attention side (``endpoint.py``): a lost FFN rank's requests go to its
replacement, on every backend that claims it (``Feature.FAILOVER``).

FFN ranks run in child processes (``FFNCluster``); the test plays the front-end's supervisor: it
kills a rank while requests wait on it (or once it failed one: an exception in its serve loop),
starts a replacement and publishes it in the FFN directory.
Every combine then returns exactly the reference result, the requests the lost rank
had not answered are counted as sent again, and the next step runs on the replacement.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from transport_testlib import LAYERS, make_spec, mappings, routing

from vllm_afd.errors import FFNRankLost, FFNServeError, StepsFailed, TransportError
from vllm_afd.testing.ffn import DelayedForward, FailingForward
from vllm_afd.testing.reference import LocalMoE, ScaleExperts, reference_moe_combine
from vllm_afd.transport import create_attention_transport
from vllm_afd.transport import directory as ffn_directory
from vllm_afd.transport.control import Mode, StepSchedule
from vllm_afd.transport.control_block import SCHEDULE_RING
from vllm_afd.transport.directory import FAILED, RECOVERING, UP, RankEntry

pytestmark = pytest.mark.timeout(90)
#: The slot plane on host memory (``shm`` is the same endpoints), over NIXL, and the out-of-tree
#: counting backend (``transport_testlib.COUNTING``).
BACKENDS = ["slots", "nixl", "counting"]
SCALES = ScaleExperts(torch.arange(1.0, 9.0) / 4)


def _entry(
    rank: int, incarnation: int, state: str, address: str = "", pid: int = 0, host="host", **kw
):
    return RankEntry(rank, incarnation, state, address, host, pid, **kw)


def _forward(spec, rank: int) -> LocalMoE:
    return LocalMoE.for_rank(SCALES, spec, rank)


def _step_is_exact(att, spec, tokens: int, seed: int) -> None:
    """One use of every MoE layer of ``att``'s announced step: each combine is the reference."""
    for layer in LAYERS:
        x = routing(tokens, spec, seed=seed + layer)
        out = att.combine(att.dispatch(layer, *x))
        assert torch.equal(out, reference_moe_combine(*x, SCALES, 8, spec.num_ffn_ranks)), layer


def _answer_memory(att) -> list[int] | None:
    """Where the slot plane's answers land: this attention rank's own buffers."""
    if not hasattr(att, "plane"):
        return None
    return [view.out.data_ptr() for views in att.plane.answers for view in views]


def _cluster(start_ffn, backend: str, tmp_path, delay_rank1: float, failover_s: float = 20.0):
    spec = make_spec(backend, 1, 2, directory=str(tmp_path), failover_s=failover_s)
    forwards = [_forward(spec, 0), DelayedForward(_forward(spec, 1), delay_s=delay_rank1)]
    cluster = start_ffn(spec, forwards)
    for rank, address in enumerate(cluster.spec.addresses):
        ffn_directory.publish(str(tmp_path), _entry(rank, 1, UP, address))
    return spec, cluster


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_of_a_killed_rank_are_answered_by_its_replacement(backend, start_ffn, tmp_path):
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=30.0)
    att = cluster.connect(0)
    att.begin_step(StepSchedule(att.step + 1, (8, 8), (0,), Mode.RUN))
    inputs = [routing(8, spec, seed=s) for s in (1, 2)]
    handles = [att.dispatch(0, *inputs[mb], microbatch=mb) for mb in (0, 1)]
    assert all(set(h.token_index) == {0, 1} for h in handles)
    answers = _answer_memory(att)
    lost = [att.controls[1].name, att.controls[1].handle]  # on shm: its segments' names

    def supervise() -> None:  # what placement's supervisor does, by hand
        cluster.kill(1)
        ffn_directory.publish(str(tmp_path), _entry(1, 1, RECOVERING, reason="killed"))
        address, pid = cluster.replace(1, _forward(spec, 1))
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, failovers=1))

    threading.Timer(0.3, supervise).start()
    for mb in (1, 0):
        out = att.combine(handles[mb])
        assert torch.equal(out, reference_moe_combine(*inputs[mb], SCALES, 8, 2)), mb
    assert (att.replacements, att.redispatched) == (1, 2)
    assert att.addresses[1] != cluster.spec.addresses[1]
    assert _answer_memory(att) == answers  # the replacement answered into the same memory

    att.begin_step(StepSchedule(att.step + 1, (5,), (0,), Mode.RUN))  # on the replacement
    x = routing(5, spec, seed=3)
    assert torch.equal(att.combine(att.dispatch(0, *x)), reference_moe_combine(*x, SCALES, 8, 2))
    assert att.redispatched == 2
    if backend == "nixl":  # the lost rank's mirrors went with it (``NixlPlaneMemory.forget``)
        peers = {peer for _, _, peer in att.nixl._registered.values()} - {None}
        assert peers == set(att._agents.values()) and len(peers) == 2
    else:  # the lost rank's control block and request buffer are unmapped (no pages held)
        assert [mappings(name) for name in lost] == [0, 0]
        assert mappings(att.controls[1].name) == mappings(att.controls[1].handle) == 1


@pytest.mark.parametrize("backend", [*BACKENDS, "slots-device"])
def test_a_rank_lost_before_the_attention_rank_linked_it_is_awaited(backend, start_ffn, tmp_path):
    """An FFN rank that died while the engine started (before its attention ranks first
    linked it) is a loss like any other: the attention endpoint waits for its replacement
    and links that, instead of failing the engine's start; the first step is exact."""
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=0.0)
    cluster.kill(1)
    cluster.current[1].join(5)

    def supervise() -> None:  # what placement's supervisor does, by hand
        ffn_directory.publish(str(tmp_path), _entry(1, 1, RECOVERING, reason="died"))
        address, pid = cluster.replace(1, _forward(spec, 1))
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, failovers=1))

    threading.Timer(0.3, supervise).start()
    att = create_attention_transport(cluster.spec, 0)
    try:
        assert att.addresses[1] != cluster.spec.addresses[1]
        att.begin_step(StepSchedule(att.step + 1, (8,), LAYERS, Mode.RUN))
        _step_is_exact(att, spec, 8, seed=0)
    finally:
        att.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replacement_dead_on_arrival_is_passed_over_for_the_next(backend, start_ffn, tmp_path):
    """A replacement that died before the attention rank linked it (published ``up``, then
    gone) is a loss of its own: the attention rank awaits the next incarnation and links
    that; the requests the lost rank had not answered are answered exactly."""
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=30.0)
    att = cluster.connect(0)
    x = routing(8, spec, seed=1)
    handle = att.dispatch(0, *x)

    def supervise() -> None:  # what placement's supervisor does, by hand
        cluster.kill(1)
        address, pid = cluster.replace(1, _forward(spec, 1))
        cluster.kill(1)  # the replacement, dead on arrival
        cluster.current[1].join(5)
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, failovers=1))
        time.sleep(0.5)
        address, pid = cluster.replace(1, _forward(spec, 1))
        ffn_directory.publish(str(tmp_path), _entry(1, 3, UP, address, pid, failovers=2))

    threading.Timer(0.3, supervise).start()
    assert torch.equal(att.combine(handle), reference_moe_combine(*x, SCALES, 8, 2))
    assert att.replacements == 1 and att._incarnation[1] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_the_supervisor_gave_up_on_fails_at_once(backend, start_ffn, tmp_path):
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=30.0)
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(8, spec, seed=0))
    reason = "FFN rank 1 failed 6 times in a row; the last: died"
    ffn_directory.publish(str(tmp_path), _entry(1, 6, FAILED, reason=reason))
    threading.Timer(0.3, cluster.kill, args=(1,)).start()
    start = time.monotonic()
    with pytest.raises(TransportError, match="failed 6 times in a row") as failure:
        att.combine(handle)
    assert not isinstance(failure.value, FFNRankLost)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_replacement_within_the_failover_timeout_fails_clearly(backend, start_ffn, tmp_path):
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=30.0, failover_s=1.0)
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(8, spec, seed=0))
    threading.Timer(0.3, cluster.kill, args=(1,)).start()
    start = time.monotonic()
    with pytest.raises(TransportError, match="no replacement up within 1s"):
        att.combine(handle)
    assert 1.0 < time.monotonic() - start < 6.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_directory_a_lost_rank_is_an_error(backend, start_ffn, tmp_path):
    spec = make_spec(backend, 1, 1)
    cluster = start_ffn(spec, [DelayedForward(_forward(spec, 0), delay_s=30.0)])
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(4, spec, seed=0))
    threading.Timer(0.3, cluster.kill, args=(0,)).start()
    with pytest.raises(FFNRankLost, match="FFN rank 0"):
        att.combine(handle)


def _failing_cluster(start_ffn, backend: str, tmp_path, host: str):
    """FFN rank 1 fails every request (its serve loop raises), on ``host``."""
    spec = make_spec(backend, 1, 2, directory=str(tmp_path), failover_s=20.0)
    cluster = start_ffn(spec, [_forward(spec, 0), FailingForward("bad batch")])
    for rank, address in enumerate(cluster.spec.addresses):
        ffn_directory.publish(str(tmp_path), _entry(rank, 1, UP, address, host=host))
    return spec, cluster


def _replace_rank_1(cluster, spec, tmp_path, forward) -> threading.Thread:
    """What the supervisor does once rank 1 failed a request (its stats block says so)."""

    def supervise() -> None:
        time.sleep(0.3)
        cluster.kill(1)
        address, pid = cluster.replace(1, forward)
        host = socket.gethostname()
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, host, failovers=1))

    thread = threading.Thread(target=supervise)
    thread.start()
    return thread


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_an_ffn_rank_failed_goes_to_its_replacement(backend, start_ffn, tmp_path):
    """An exception in an FFN rank's serve loop is a failover: the request goes once more, to
    the replacement, and the combine returns the reference result."""
    spec, cluster = _failing_cluster(start_ffn, backend, tmp_path, socket.gethostname())
    att = cluster.connect(0)
    x = routing(8, spec, seed=4)
    handle = att.dispatch(0, *x)
    assert set(handle.token_index) == {0, 1}
    supervisor = _replace_rank_1(cluster, spec, tmp_path, _forward(spec, 1))
    out = att.combine(handle)
    supervisor.join()
    assert torch.equal(out, reference_moe_combine(*x, SCALES, 8, 2))
    assert (att.replacements, att.redispatched) == (1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_that_fails_on_the_replacement_too_fails_with_the_ffn_error(
    backend, start_ffn, tmp_path
):
    spec, cluster = _failing_cluster(start_ffn, backend, tmp_path, socket.gethostname())
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(8, spec, seed=5))
    supervisor = _replace_rank_1(cluster, spec, tmp_path, FailingForward("bad batch again"))
    with pytest.raises(FFNServeError, match="FFN rank 1: RuntimeError: bad batch again"):
        att.combine(handle)
    supervisor.join()
    assert (att.replacements, att.redispatched) == (1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_request_of_a_rank_on_another_host_goes_to_its_replacement(
    backend, start_ffn, tmp_path
):
    """The supervisor watches ranks on other hosts through Ray (``failover.RayWatch``): a
    request one failed goes to its replacement as on this host."""
    spec, cluster = _failing_cluster(start_ffn, backend, tmp_path, "another-host")
    att = cluster.connect(0)
    x = routing(8, spec, seed=6)
    handle = att.dispatch(0, *x)
    supervisor = _replace_rank_1(cluster, spec, tmp_path, _forward(spec, 1))
    out = att.combine(handle)
    supervisor.join()
    assert torch.equal(out, reference_moe_combine(*x, SCALES, 8, 2))
    assert (att.replacements, att.redispatched) == (1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_the_supervisor_declared_lost_is_left_while_it_lives(backend, start_ffn, tmp_path):
    """A rank on a node that died (or was cut off, or wedged) closes no connection and does not
    die: the attention rank's wait sees the supervisor's verdict in the FFN directory (within
    the slot plane's ``WATCH_INTERVAL_S``) and sends what it
    had not answered to the replacement; the old process is never heard from again (here it is
    alive, 30 s late)."""
    spec, cluster = _cluster(start_ffn, backend, tmp_path, delay_rank1=30.0)
    wedged = cluster.current[1]
    att = cluster.connect(0)
    x = routing(8, spec, seed=7)
    handle = att.dispatch(0, *x)

    def supervise() -> None:  # the node is gone: no kill reaches it
        reason = "FFN rank 1 (pid 9, Ray node abc) died: its node died"
        ffn_directory.publish(str(tmp_path), _entry(1, 1, RECOVERING, reason=reason))
        time.sleep(0.3)
        address, pid = cluster.replace(1, _forward(spec, 1))
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, failovers=1))

    threading.Timer(0.3, supervise).start()
    start = time.monotonic()
    out = att.combine(handle)
    assert time.monotonic() - start < 10.0
    assert torch.equal(out, reference_moe_combine(*x, SCALES, 8, 2))
    assert (att.replacements, att.redispatched) == (1, 1)
    wedged.kill()  # it would answer 30 s late: not worth the teardown's 5 s wait


@pytest.mark.parametrize("sampled", [False, True], ids=["announced", "sampled"])
def test_with_the_device_waits_a_killed_rank_fails_its_step_and_the_replacement_serves_on(
    sampled, start_ffn, tmp_path
):
    """With the device's waits a lost rank's uses cannot be sent again within their step (on a
    GPU a captured graph replays them): the watchdog ends the step's waits once the rank died,
    the next announcement links the replacement (failover) and raises ``StepsFailed`` naming
    that step (the attention session fails its requests), and the step announced again runs
    on the replacement. Where the step's sampled tokens were read first (W1:
    ``check_sampled``), that read names the step, and the announcement, which still links
    the replacement, names none. The lost rank's control block stays mapped until the
    watchdog's next look (its thread may be reading it as the replacement is linked)."""
    spec = make_spec("slots-device", 1, 2, directory=str(tmp_path), failover_s=20.0)
    forwards = [_forward(spec, 0), DelayedForward(_forward(spec, 1), delay_s=30.0)]
    cluster = start_ffn(spec, forwards)
    for rank, address in enumerate(cluster.spec.addresses):
        ffn_directory.publish(str(tmp_path), _entry(rank, 1, UP, address))
    # not ``cluster.connect``: the FFN ranks serve whole steps, each use of which must come
    att = create_attention_transport(cluster.spec, 0)

    def supervise() -> None:  # what placement's supervisor does, by hand
        cluster.kill(1)
        address, pid = cluster.replace(1, _forward(spec, 1))
        ffn_directory.publish(str(tmp_path), _entry(1, 2, UP, address, pid, failovers=1))

    lost = [att.controls[1].name, att.controls[1].handle]  # its segments' names
    try:
        att.begin_step(StepSchedule(1, (8,), LAYERS, Mode.RUN))
        threading.Timer(0.3, supervise).start()
        start = time.perf_counter()
        for layer in LAYERS:
            att.combine(att.dispatch(layer, *routing(8, spec, seed=layer)))  # recorded
        assert time.perf_counter() - start < spec.timeout_s  # ended by the watchdog
        died = r"FFN rank 1 \(pid \d+\) died"
        if sampled:
            with pytest.raises(StepsFailed, match=died) as failed:
                att.check_sampled(1)
            assert failed.value.steps == range(1, 2)
        with pytest.raises(StepsFailed, match=died) as failed:
            att.begin_step(StepSchedule(2, (5,), LAYERS, Mode.RUN))
        assert failed.value.steps == (range(2, 2) if sampled else range(1, 2))
        assert att.replacements == 1 and att.addresses[1] != cluster.spec.addresses[1]
        # the watchdog's thread, which may have taken the lost rank's block just before the
        # replacement's took its place, unmaps it at its next look (50 ms), and lives on
        assert mappings(lost[1]) == 0  # the request buffer at once
        deadline = time.monotonic() + 5.0
        while mappings(lost[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mappings(lost[0]) == 0 and att._watching.is_alive()
        # the failed step goes nowhere again: the replacement is not told of it (it would
        # wait for uses that never come), only of the step announced next
        assert att.controls[1].announced_steps(0) == [0] * SCHEDULE_RING
        att.begin_step(StepSchedule(2, (5,), LAYERS, Mode.RUN))  # announced again: served
        _step_is_exact(att, spec, 5, seed=3)
    finally:
        att.close()


def test_a_loss_the_announcement_recovered_from_is_not_recovered_again(start_ffn, tmp_path):
    """With the device's waits, an announcement that finds its FFN rank dead while the rank's
    ring of schedules is full (``_await_ring``: an attention rank steps ahead, as during CUDA
    graph captures) links the replacement itself; the watchdog, which saw the same death
    meanwhile, aborted the step's waits. The next announcement raises that abort
    (``StepsFailed``, the spoiled step's requests fail) without waiting for yet another
    replacement of a rank already replaced (before: ``--afd-failover-timeout`` later, a
    ``TransportError``), and the step after runs on the replacement."""
    spec = make_spec("slots-device", 1, 1, directory=str(tmp_path), failover_s=5.0)
    cluster = start_ffn(spec, [_forward(spec, 0)])
    ffn_directory.publish(str(tmp_path), _entry(0, 1, UP, cluster.spec.addresses[0]))
    att = create_attention_transport(cluster.spec, 0)

    def supervise() -> None:  # what placement's supervisor does, by hand
        cluster.kill(0)
        time.sleep(0.5)  # the watchdog looks every 50 ms: it sees the death meanwhile
        address, pid = cluster.replace(0, _forward(spec, 0))
        ffn_directory.publish(str(tmp_path), _entry(0, 2, UP, address, pid, failovers=1))

    try:
        for step in range(1, SCHEDULE_RING + 2):  # the rank takes step 1 and waits for its uses
            att.begin_step(StepSchedule(step, (8,), LAYERS, Mode.CAPTURE))
        threading.Timer(0.3, supervise).start()
        # the ring is full: this announcement waits for the rank to take step 2, and links
        # the replacement once the rank died
        att.begin_step(StepSchedule(SCHEDULE_RING + 2, (8,), LAYERS, Mode.RUN))
        assert att.replacements == 1
        for layer in LAYERS:  # served by the replacement; the watchdog's abort fails them
            att.combine(att.dispatch(layer, *routing(8, spec, seed=layer)))
        start = time.perf_counter()
        with pytest.raises(StepsFailed, match=r"FFN rank 0 \(pid \d+\) died"):
            att.begin_step(StepSchedule(SCHEDULE_RING + 3, (5,), LAYERS, Mode.RUN))
        assert time.perf_counter() - start < spec.failover_s and att.replacements == 1
        att.begin_step(StepSchedule(SCHEDULE_RING + 3, (5,), LAYERS, Mode.RUN))
        _step_is_exact(att, spec, 5, seed=3)
    finally:
        att.close()
