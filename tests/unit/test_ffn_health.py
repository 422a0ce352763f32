"""``/health``'s view of the FFN ranks (``placement.ffn_group_problems``) and failover's
supervisor (``placement.Supervisor``), from the FFN directory, the pid, the heartbeat, the
busy-since word and the failure count in each rank's stats block."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from vllm_afd import placement
from vllm_afd.metrics.blocks import F_BUSY_SINCE, F_FAILURES, F_HEARTBEAT, FFNStatsBlock
from vllm_afd.placement import HEARTBEAT_TIMEOUT_S, Supervisor, ffn_group_problems, restart_delay
from vllm_afd.transport import TransportSpec
from vllm_afd.transport import directory as ffn_directory
from vllm_afd.transport.base import AttentionTransport
from vllm_afd.transport.directory import FAILED, RECOVERING, UP, RankEntry
from vllm_afd.transport.slots import SlotsBackend

HOST = socket.gethostname()


def _spec(tmp_path, address: str = "unused", failover_s: float = 0.0) -> TransportSpec:
    return TransportSpec(
        "shm",
        1,
        1,
        8,
        16,
        2,
        4,
        timeout_s=5.0,
        addresses=(address,),
        directory=str(tmp_path),
        failover_s=failover_s,
    )


def _problems() -> list[str]:
    return [p.text for p in ffn_group_problems()]


def _publish(tmp_path, pid: int, address: str = "unused", state: str = UP, **kw) -> None:
    ffn_directory.publish(str(tmp_path), RankEntry(0, 1, state, address, HOST, pid, **kw))


@pytest.fixture
def rank_block(monkeypatch, tmp_path):
    """This process posing as FFN rank 0 of a deployment: its directory entry and stats block."""
    address = f"afdhealthtest{os.getpid()}"
    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path, address).to_json())
    _publish(tmp_path, os.getpid(), address)
    block = FFNStatsBlock(address, 0, [0, 1])
    yield block
    block.close()


def _set(block: FFNStatsBlock, word: int, value: float) -> None:
    block.d[block._o_scalars + word] = value


def test_a_beating_idle_rank_is_healthy(rank_block):
    rank_block.beat()
    assert _problems() == []


def test_a_running_rank_without_heartbeat_is_stopped_only_once_frozen(rank_block):
    """A running process whose heartbeat is late was starved of the CPU (a loaded host); only
    past ``FROZEN_TIMEOUT_S`` is it called stopped."""
    _set(rank_block, F_HEARTBEAT, time.monotonic() - HEARTBEAT_TIMEOUT_S - 0.5)
    assert _problems() == []
    _set(rank_block, F_HEARTBEAT, time.monotonic() - placement.FROZEN_TIMEOUT_S - 0.5)
    (problem,) = _problems()
    assert problem.startswith(f"FFN rank 0 (pid {os.getpid()}) stopped: no heartbeat for")


def test_a_sigstopped_rank_is_stopped_after_one_second(monkeypatch, tmp_path):
    """A process in state T (SIGSTOP) is called stopped once its heartbeat is 1 s old."""
    import signal

    address = f"afdhealthstop{os.getpid()}"
    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path, address).to_json())
    child = _sleeper()
    block = FFNStatsBlock(address, 0, [0, 1])
    try:
        _publish(tmp_path, child.pid, address)
        _set(block, F_HEARTBEAT, time.monotonic() - HEARTBEAT_TIMEOUT_S - 0.5)
        assert _problems() == []  # running: only late
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not placement.health.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (problem,) = _problems()
        assert problem.startswith(f"FFN rank 0 (pid {child.pid}) stopped: no heartbeat for 1.")
    finally:
        block.close()
        child.kill()
        child.wait()


def test_a_rank_busy_past_the_timeout_is_wedged(rank_block):
    rank_block.beat()
    rank_block.set_busy(time.monotonic() - 6.0)
    (problem,) = _problems()
    assert "wedged: one layer batch running for 6." in problem and "timeout_s=5" in problem
    rank_block.set_busy(time.monotonic())
    assert _problems() == []


def test_a_rank_that_failed_a_request_stays_unhealthy(rank_block):
    rank_block.beat()
    rank_block.record_failure(3)
    assert _problems() == [f"FFN rank 0 (pid {os.getpid()}) failed 3 request(s)"]
    assert rank_block.d[rank_block._o_scalars + F_FAILURES] == 3
    assert rank_block.d[rank_block._o_scalars + F_BUSY_SINCE] == 0


def test_dead_recovering_and_failed_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path).to_json())
    _publish(tmp_path, 999999999)
    assert _problems() == ["FFN rank 0 (pid 999999999) died"]
    _publish(tmp_path, 999999999, state=RECOVERING, reason="FFN rank 0 (pid 9) died")
    assert _problems() == ["FFN rank 0 is being replaced: FFN rank 0 (pid 9) died"]
    _publish(tmp_path, 0, state=FAILED, reason="FFN rank 0 failed 5 times in a row")
    assert _problems() == ["FFN rank 0 failed 5 times in a row"]
    monkeypatch.delenv("VLLM_AFD_RUNTIME")
    assert _problems() == []


def test_liveness_fails_only_on_what_failover_cannot_heal(monkeypatch, tmp_path):
    """``healing``: what ``/health`` (liveness) lets pass and ``/afd/ready`` does not."""

    def healing() -> list[bool]:
        return [p.healing for p in ffn_group_problems()]

    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path, failover_s=60.0).to_json())
    _publish(tmp_path, 999999999)
    assert healing() == [True]  # lost: the supervisor replaces it within one interval
    _publish(tmp_path, 999999999, state=RECOVERING, reason="FFN rank 0 (pid 9) died")
    assert healing() == [True]
    _publish(tmp_path, 0, state=FAILED, reason="FFN rank 0 failed 5 times in a row")
    assert healing() == [False]
    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path, failover_s=0.0).to_json())
    _publish(tmp_path, 999999999)
    assert healing() == [False]  # failover off: nothing will replace it
    for backend, covered in (("slots", True), (f"{__name__}:NoFailover", False)):
        spec = _spec(tmp_path, failover_s=60.0)
        spec = dataclasses.replace(spec, backend=backend, config={"waits": "device"})
        monkeypatch.setenv("VLLM_AFD_RUNTIME", spec.to_json())
        assert healing() == [covered], backend  # whole steps fail over; a bare backend not


class NoFailover(SlotsBackend):
    """``slots`` with an attention endpoint that cannot link a replacement (no
    ``Reconnects``): no failover."""

    name = "no-failover"

    @classmethod
    def endpoints(cls, settings):
        return AttentionTransport, super().endpoints(settings)[1]


def test_a_rank_that_failed_requests_heals_only_with_failover(rank_block, monkeypatch, tmp_path):
    """The supervisor replaces a rank that failed a request (``failover.Supervisor``)."""
    spec = _spec(tmp_path, f"afdhealthtest{os.getpid()}", failover_s=60.0)
    monkeypatch.setenv("VLLM_AFD_RUNTIME", spec.to_json())
    rank_block.beat()
    rank_block.record_failure(1)
    assert [p.healing for p in ffn_group_problems()] == [True]
    monkeypatch.setenv("VLLM_AFD_RUNTIME", dataclasses.replace(spec, failover_s=0.0).to_json())
    assert [p.healing for p in ffn_group_problems()] == [False]


def test_restart_delays_back_off():
    assert [restart_delay(n) for n in range(1, 6)] == [0, 1, 3, 7, 15]
    assert restart_delay(50) == placement.FAILOVER_MAX_DELAY_S


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


class _Group:
    """What the supervisor uses of an ``FFNGroup``; each start runs a new sleeper process."""

    def __init__(self, spec: TransportSpec, fail_starts: int = 0) -> None:
        self.spec, self.actors, self.infos = spec, [None], [{}]
        self.procs: list[subprocess.Popen] = []
        self.fail_starts = fail_starts

    def start_rank(self, rank: int) -> None:
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("no room")
        self.procs.append(_sleeper())
        self.infos[rank] = {
            "rank": rank,
            "pid": self.procs[-1].pid,
            "host": HOST,
            "address": f"replacement{len(self.procs)}",
            "experts": [0, 8],
            "param_bytes": 0,
        }


def _wait_for(tmp_path, state: str, timeout_s: float = 10.0) -> RankEntry:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = ffn_directory.lookup(str(tmp_path), 0)
        done = entry is not None and entry.state == state
        if done and (state == FAILED or entry.incarnation > 1):
            return entry
        time.sleep(0.05)
    raise AssertionError(f"no {state} entry: {ffn_directory.lookup(str(tmp_path), 0)}")


def test_the_supervisor_replaces_a_killed_rank_and_publishes_it(tmp_path):
    first = _sleeper()
    group = _Group(_spec(tmp_path))
    _publish(tmp_path, first.pid, address="first")
    supervisor = Supervisor(group)
    try:
        killed = time.monotonic()
        first.kill()
        first.wait()
        entry = _wait_for(tmp_path, UP)
        assert time.monotonic() - killed < 5.0
        assert (entry.incarnation, entry.address, entry.failovers) == (2, "replacement1", 1)
        assert entry.pid == group.procs[0].pid and 0 < entry.recovery_s < 5.0
        assert entry.reason == f"FFN rank 0 (pid {first.pid}) died"
        assert placement.failover.supervised_pid(entry.pid)  # the replacement's
    finally:
        supervisor.stop()
        for proc in group.procs:
            proc.kill()
            proc.wait()


def test_the_supervisor_gives_up_after_failures_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(placement.failover, "FAILOVER_MAX_STREAK", 2)
    first = _sleeper()
    group = _Group(_spec(tmp_path), fail_starts=5)
    _publish(tmp_path, first.pid)
    supervisor = Supervisor(group)
    try:
        first.kill()
        first.wait()
        entry = _wait_for(tmp_path, FAILED)
        assert "FFN rank 0 failed 2 times in a row" in entry.reason
        assert "its replacement did not start (no room)" in entry.reason
        assert group.fail_starts == 3 and not group.procs  # two starts tried, 0 s then 1 s
    finally:
        supervisor.stop()


def test_a_streak_counts_failures_of_one_cause(tmp_path):
    """A death, then seconds later a failed request: two causes, two streaks of one (no
    back-off); the same failure again grows the streak (the replacement waits 1 s)."""
    from vllm_afd.placement.failover import failure_cause

    assert failure_cause("FFN rank 0 (pid 7) stopped: no heartbeat for 1.2s") == "stopped"
    assert failure_cause("FFN rank 2 (pid 7, Ray node ab) died: ActorDiedError") == "died"
    first = _sleeper()
    group = _Group(_spec(tmp_path))
    _publish(tmp_path, first.pid)
    supervisor = Supervisor(group)
    try:
        streaks = []
        for cause in ("died", "failed serving a request", "failed serving a request"):
            entry = ffn_directory.lookup(str(tmp_path), 0)
            supervisor._fail_over(entry, f"FFN rank 0 (pid {entry.pid}) {cause}")
            streaks.append(supervisor._streak[0])
        assert streaks == [1, 1, 2]
        assert ffn_directory.lookup(str(tmp_path), 0).failovers == 3
    finally:
        supervisor.stop()
        for proc in [first, *group.procs]:
            proc.kill()
            proc.wait()


class _SlowGroup(_Group):
    """A replacement that takes ``start_s`` to start (a raylet gone with the front-end's
    process group: its start cannot finish)."""

    def __init__(self, spec: TransportSpec, start_s: float) -> None:
        super().__init__(spec)
        self.start_s, self.starting = start_s, threading.Event()
        self.spans: list[tuple[float, float]] = []  # each start's, as it ended

    def start_rank(self, rank: int) -> None:
        self.starting.set()
        began = time.monotonic()
        time.sleep(self.start_s)
        super().start_rank(rank)
        self.spans.append((began, time.monotonic()))


def test_ranks_lost_together_are_replaced_side_by_side(tmp_path):
    """Two FFN ranks lost at once (a node that held both) are replaced concurrently: each
    replacement's start begins before the other's ended, and both are published."""
    start_s = 1.0
    spec = dataclasses.replace(_spec(tmp_path), num_ffn_ranks=2, addresses=("unused0", "unused1"))
    group = _SlowGroup(spec, start_s=start_s)
    group.actors, group.infos = [None, None], [{}, {}]
    firsts = [_sleeper(), _sleeper()]
    for rank, first in enumerate(firsts):
        ffn_directory.publish(str(tmp_path), RankEntry(rank, 1, UP, "first", HOST, first.pid))
    supervisor = Supervisor(group)
    try:
        for first in firsts:
            first.kill()
            first.wait()
        deadline = time.monotonic() + 10 * start_s
        entries = []
        while time.monotonic() < deadline:
            entries = ffn_directory.entries(str(tmp_path), 2)
            if all(e.state == UP and e.incarnation == 2 for e in entries):
                break
            time.sleep(0.05)
        assert all(e.state == UP and e.incarnation == 2 for e in entries), entries
        (began0, ended0), (began1, ended1) = group.spans
        assert max(began0, began1) < min(ended0, ended1), group.spans
        assert {e.pid for e in entries} == {p.pid for p in group.procs}
    finally:
        supervisor.stop()
        for proc in group.procs:
            proc.kill()
            proc.wait()


def test_a_supervisor_stopped_mid_replacement_returns_at_once_and_kills_it_later(tmp_path):
    """A stop (the front-end exiting) waits at most ``STOP_WAIT_S`` for a replacement being
    started, and the replacement, once started, is killed and never published."""
    first = _sleeper()
    group = _SlowGroup(_spec(tmp_path), start_s=placement.failover.STOP_WAIT_S + 2.0)
    _publish(tmp_path, first.pid, address="first")
    supervisor = Supervisor(group)
    try:
        first.kill()
        first.wait()
        assert group.starting.wait(10)
        began = time.monotonic()
        supervisor.stop()
        assert time.monotonic() - began < placement.failover.STOP_WAIT_S + 0.5
        deadline = time.monotonic() + 10
        while not group.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.procs, "the replacement did not start"
        assert group.procs[0].wait(timeout=10) == -signal.SIGKILL
        entry = ffn_directory.lookup(str(tmp_path), 0)
        assert entry.state == RECOVERING and entry.incarnation == 1, entry
    finally:
        supervisor.stop()
        for proc in group.procs:
            proc.kill()
            proc.wait()


class _Engine:
    """``app.state.engine_client`` as the readiness route uses it."""

    def __init__(self, dead: bool = False) -> None:
        self.dead = dead

    async def check_health(self) -> None:
        if self.dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError("engine core died")


def test_the_readiness_route_answers_every_problem_and_a_dead_engine(monkeypatch, tmp_path):
    """``GET /afd/ready`` as vLLM's endpoint-plugin API attaches it (``placement/routes.py``)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_afd.placement.routes import DEAD_ENGINE, AFDEndpoints

    app = FastAPI()
    AFDEndpoints().attach_router(app)
    app.state.engine_client = _Engine()
    client = TestClient(app)
    monkeypatch.setenv("VLLM_AFD_RUNTIME", _spec(tmp_path, failover_s=60.0).to_json())
    _publish(tmp_path, os.getpid())
    assert client.get("/afd/ready").json() == {"ready": True}
    _publish(tmp_path, 999999999, state=RECOVERING, reason="FFN rank 0 (pid 9) died")
    answer = client.get("/afd/ready")  # healing: liveness passes it, readiness does not
    assert answer.status_code == 503
    assert answer.json()["problems"] == ["FFN rank 0 is being replaced: FFN rank 0 (pid 9) died"]
    _publish(tmp_path, os.getpid())
    app.state.engine_client = _Engine(dead=True)
    answer = client.get("/afd/ready")
    assert answer.status_code == 503 and answer.json()["problems"] == [DEAD_ENGINE]


def test_vllm_loads_the_readiness_route_when_allowlisted(monkeypatch):
    from vllm.plugins import load_endpoint_plugins

    from vllm_afd.placement.routes import AFDEndpoints

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert load_endpoint_plugins(("generate",)) == []  # opt-in, as every endpoint plugin
    monkeypatch.setenv("VLLM_PLUGINS", "afd")
    (plugin,) = load_endpoint_plugins(("generate",))
    assert isinstance(plugin, AFDEndpoints)


def test_the_status_route_shows_the_live_group_and_the_planners_ratio(monkeypatch, tmp_path):
    import json

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_afd import envs
    from vllm_afd.placement.routes import AFDEndpoints

    app = FastAPI()
    AFDEndpoints().attach_router(app)
    app.state.afd_admin_tokens = ["admin-token-of-this-deployment"]
    client = TestClient(app)
    admin = {"Authorization": "Bearer admin-token-of-this-deployment"}
    monkeypatch.delenv("VLLM_AFD_RUNTIME", raising=False)
    assert client.get("/afd/status").json() == {"afd": False}
    spec = dataclasses.replace(_spec(tmp_path, failover_s=60.0), num_attention_ranks=2)
    monkeypatch.setenv("VLLM_AFD_RUNTIME", spec.to_json())
    monkeypatch.setenv(envs.FRONT_END, json.dumps({"recommendation": {"ratio": "2:1"}}))
    _publish(tmp_path, 999999999, state=RECOVERING, reason="FFN rank 0 (pid 9) died", failovers=2)
    for headers in ({}, {"Authorization": "Bearer wrong"}):  # what a readiness probe learns
        anonymous = client.get("/afd/status", headers=headers).json()
        assert anonymous.pop("detail").startswith("the full status takes")
        assert anonymous == {"afd": True, "ready": False}
    status = client.get("/afd/status", headers=admin).json()
    assert status["ready"] is False
    assert (status["num_attention_ranks"], status["num_ffn_ranks"], status["ratio"]) == (
        2,
        1,
        "2:1",
    )
    assert status["transport"] == "shm" and status["recommendation"] == {"ratio": "2:1"}
    (rank,) = status["ffn_ranks"]
    assert (rank["state"], rank["failovers"], rank["pid"]) == ("recovering", 2, 999999999)
    assert status["problems"] == ["FFN rank 0 is being replaced: FFN rank 0 (pid 9) died"]


def test_ray_s_report_of_a_replaced_rank_s_death_is_not_printed(tmp_path, capsys):
    """R1: the raylet's "worker died" report, OOM-killer guesses and all, is left out for a
    rank a supervisor watches (the plugin logs the loss itself); every other report prints."""
    from ray._private import worker

    from vllm_afd.patches.ray_errors import reports_a_supervised_death

    report = (
        "A worker died or was killed while executing a task by an unexpected system error. "
        "(Worker's Lease ID: ab, Worker PID: {pid}) Some common causes include: (1) the "
        "process was killed by the OOM killer due to high memory usage"
    )
    assert reports_a_supervised_death(
        {"pid": "raylet", "lines": [report.format(pid=7)]}, {7}.__contains__
    )
    assert not reports_a_supervised_death(
        {"pid": "raylet", "lines": [report.format(pid=8)]}, {7}.__contains__
    )
    assert not reports_a_supervised_death(
        {"pid": 7, "lines": [report.format(pid=7)]}, {7}.__contains__
    )
    supervisor = Supervisor(_Group(_spec(tmp_path)))  # applies R1
    try:
        placement.failover._SUPERVISED.add(424242)
        for pid in (424242, 434343):
            line = {"lines": [report.format(pid=pid)], "pid": "raylet", "is_err": False}
            worker.print_to_stdstream(line, ignore_prefix=False)
        printed = capsys.readouterr()
        assert "434343" in printed.out + printed.err
        assert "424242" not in printed.out + printed.err
    finally:
        supervisor.stop()
        placement.failover._SUPERVISED.discard(424242)
