"""Failover of FFN ranks on other Ray nodes (``placement.failover.RayWatch``): their pid and
stats block are not readable from the front-end, so the supervisor asks each rank through Ray
(``FFNRank.problem``) and takes a dead actor (its process or its node), a call unanswered for
``FROZEN_TIMEOUT_S`` and the rank's own answer as the loss; then replaces it as any other.

A real local Ray (token authentication, as the product starts it) runs stand-in actors that
answer as told; the e2e side (a node of a two-node cluster killed under streams) is
tests/e2e/test_ray_cluster.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vllm_afd.placement import failover
from vllm_afd.placement.failover import RayWatch, Supervisor
from vllm_afd.transport import TransportSpec
from vllm_afd.transport import directory as ffn_directory
from vllm_afd.transport.directory import UP, RankEntry

OTHER_NODE = "f" * 56  # a Ray node id that is not this driver's
ENTRY = RankEntry(0, 1, UP, "first", "other-host", 4242)


class _Rank:
    """Stands in for ``FFNRank`` on another node: answers ``problem`` as told, after
    ``hang_s``."""

    def __init__(self) -> None:
        self.answer: tuple[str | None, float] = (None, 0.0)
        self.hang_s = 0.0

    def tell(self, answer: tuple[str | None, float], hang_s: float = 0.0) -> None:
        self.answer, self.hang_s = answer, hang_s

    def problem(self, entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
        time.sleep(self.hang_s)
        return self.answer


@pytest.fixture(scope="module")
def ray_rank():
    """``ray_rank()``: a new stand-in rank actor on a local Ray instance (stopped after)."""
    import sys

    import ray
    from ray import cloudpickle

    from vllm_afd.placement.cluster import ensure_ray
    from vllm_afd.placement.credentials import release_credentials

    assert ensure_ray(None, num_cpus=2)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers lack tests/
    made = []

    def new():
        made.append(ray.remote(_Rank).options(num_cpus=0, max_concurrency=2).remote())
        return made[-1]

    try:
        yield new
    finally:
        for actor in made:
            ray.kill(actor)
        ray.shutdown()
        release_credentials()


def _until(watch: RayWatch, want: str, timeout_s: float = 15.0) -> str:
    """Ask as the supervisor does until the problem says ``want`` (an answer to a call made
    before the actor was told otherwise may come first)."""
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        seen, _ = watch.problem(ENTRY, 1.0)
        if seen is not None and want in seen:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"no problem {want!r} within {timeout_s}s; the last: {seen!r}")


def test_the_watch_sees_an_answer_a_silence_and_a_death(ray_rank, monkeypatch):
    import ray

    actor = ray_rank()
    here = ray.get_runtime_context().get_node_id()
    group = SimpleNamespace(actors=[actor], infos=[{"node": here}])
    watch = RayWatch(group)
    assert not watch.watches(0)  # on the front-end's node: the local checks cover it
    group.infos[0]["node"] = OTHER_NODE
    assert watch.watches(0)
    for _ in range(20):  # healthy: the calls come back with no problem
        assert watch.problem(ENTRY, 1.0) == (None, 0.0)
        time.sleep(0.02)
    ray.get(actor.tell.remote(("FFN rank 0 (pid 4242) stopped: no heartbeat for 12.0s", 0.0)))
    _until(watch, "stopped: no heartbeat for 12.0s")  # the rank's own view
    monkeypatch.setattr(failover, "FROZEN_TIMEOUT_S", 1.0)
    ray.get(actor.tell.remote((None, 0.0), hang_s=30.0))
    silent = _until(watch, "gave no answer through Ray for")
    assert f"FFN rank 0 (pid 4242, Ray node {OTHER_NODE[:12]})" in silent
    ray.kill(actor)  # its process (or node) is gone: the call in flight fails
    assert "died: " in _until(watch, f"FFN rank 0 (pid 4242, Ray node {OTHER_NODE[:12]}) died")


def test_the_supervisor_replaces_a_rank_on_another_node_that_died(ray_rank, tmp_path):
    import ray

    spec = TransportSpec("shm", 1, 1, 8, 16, 2, 16, directory=str(tmp_path), failover_s=60.0)
    started = []

    class Group:
        def __init__(self) -> None:
            self.spec, self.actors = spec, [ray_rank()]
            self.infos = [{"node": OTHER_NODE}]

        def start_rank(self, rank: int) -> None:  # Ray places it where there is room
            started.append(rank)
            self.actors[rank] = ray_rank()
            self.infos[rank] = {
                "rank": rank,
                "pid": 4343,
                "host": "another-host",
                "address": "replacement",
                "experts": [0, 8],
                "param_bytes": 0,
                "node": "e" * 56,
            }

    group = Group()
    ffn_directory.publish(spec.directory, ENTRY)
    supervisor = Supervisor(group)
    try:
        time.sleep(0.5)
        assert ffn_directory.lookup(spec.directory, 0) == ENTRY  # healthy: left alone
        lost = group.actors[0]
        ray.kill(lost)
        deadline = time.monotonic() + 15
        while ffn_directory.lookup(spec.directory, 0).incarnation == 1:
            assert time.monotonic() < deadline, ffn_directory.lookup(spec.directory, 0)
            time.sleep(0.05)
        entry = ffn_directory.lookup(spec.directory, 0)
        assert (entry.state, entry.host, entry.address, entry.failovers) == (
            UP,
            "another-host",
            "replacement",
            1,
        )
        assert "FFN rank 0 (pid 4242, Ray node ffffffffffff) died" in entry.reason
        assert started == [0]
    finally:
        supervisor.stop()
