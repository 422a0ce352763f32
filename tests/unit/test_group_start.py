"""A front-end starts its FFN group without waiting for it (``lifecycle.start_ffn_group``,
``wait=False``): vLLM's engine cores start meanwhile and wait for the group's spec in the file
``VLLM_AFD_RUNTIME`` names (``@<path>``), which says why when the group did not come up.

The whole start runs in every e2e server and offline test (the engine cores' model load waits
for the FFN ranks); here the hand-off and the group's two ends, without Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest

from vllm_afd import envs
from vllm_afd.placement import lifecycle
from vllm_afd.placement.cluster import FFNGroup
from vllm_afd.transport import TransportSpec, directory


@pytest.fixture
def starting(tmp_path, monkeypatch) -> str:
    """``VLLM_AFD_RUNTIME`` of a group that is starting: the path its spec will be written to."""
    path = directory.runtime_path(str(tmp_path / "ffn"))
    monkeypatch.setenv(envs.RUNTIME, envs.RUNTIME_FILE + path)
    return path


def _written(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _spec(tmp_path) -> TransportSpec:
    return TransportSpec("shm", 1, 1, 8, 16, 2, 16, directory=str(tmp_path / "ffn"))


def test_a_starting_group_has_no_spec_until_it_is_up(starting, tmp_path):
    assert envs.VLLM_AFD_RUNTIME is None and envs.runtime_starting()
    with pytest.raises(RuntimeError, match=r"did not come up within 0.1s \(.*runtime.json"):
        envs.runtime_json(timeout_s=0.1)
    spec = _spec(tmp_path).to_json()
    later = threading.Timer(0.2, directory.publish_runtime, (starting, spec))
    later.start()
    t0 = time.monotonic()
    assert envs.runtime_json(timeout_s=10.0) == spec  # waited for it
    assert 0.15 < time.monotonic() - t0 < 5.0
    assert envs.VLLM_AFD_RUNTIME == spec and not envs.runtime_starting()


def test_a_group_that_did_not_start_fails_its_waiters_at_once_with_the_reason(starting):
    directory.publish_runtime(starting, None, "ActorDiedError: experts cannot be built")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start: ActorDiedError: experts cannot be"):
        envs.runtime_json(timeout_s=60.0)
    assert time.monotonic() - t0 < 1.0
    assert envs.VLLM_AFD_RUNTIME is None and not envs.runtime_starting()


@pytest.fixture
def placed(tmp_path, monkeypatch) -> FFNGroup:
    """A group whose ranks were placed (no process behind it), as this front-end's group."""
    (tmp_path / "ffn").mkdir()
    spec = _spec(tmp_path)
    group = FFNGroup(spec, [], [], None, True, spec, "model", "cpu")
    monkeypatch.setattr(lifecycle, "_GROUP", group)
    monkeypatch.setenv(envs.RUNTIME, envs.RUNTIME_FILE + directory.runtime_path(spec.directory))
    return group


def test_a_group_that_comes_up_hands_its_spec_on(placed, monkeypatch):
    def up(group):
        group.spec = dataclasses.replace(group.spec, addresses=("plane_f0",))

    supervised = []
    monkeypatch.setattr(lifecycle, "_wait_up", up)
    monkeypatch.setattr(lifecycle, "supervise", supervised.append)
    lifecycle._come_up(placed, wait=False)
    assert supervised == [placed]
    assert TransportSpec.from_json(os.environ[envs.RUNTIME]).addresses == ("plane_f0",)
    path = directory.runtime_path(placed.spec.directory)
    assert _written(path) == {"spec": os.environ[envs.RUNTIME], "error": ""}


def test_a_group_that_does_not_come_up_is_stopped_and_says_why(placed, monkeypatch):
    """In the background: the reason is written for the engine cores, the ranks and the Ray it
    started are stopped, the group's directory stays for the front-end's exit. Waited for:
    the process's group is stopped and the error raised."""

    def down(group):
        raise TimeoutError("rank 0 did not build")

    stopped, shut = [], []
    monkeypatch.setattr(lifecycle, "_wait_up", down)
    monkeypatch.setattr(lifecycle, "stop_ranks", stopped.append)
    monkeypatch.setattr("ray.shutdown", lambda: shut.append(True))
    path = directory.runtime_path(placed.spec.directory)
    lifecycle._come_up(placed, wait=False)
    assert _written(path) == {"spec": None, "error": "TimeoutError: rank 0 did not build"}
    assert stopped == [placed] and shut == [True] and not placed.owns_ray
    assert lifecycle.current_group() is placed and os.path.isdir(placed.spec.directory)
    with pytest.raises(RuntimeError, match="did not start: TimeoutError: rank 0 did not build"):
        envs.runtime_json(timeout_s=60.0)

    monkeypatch.setattr(lifecycle, "release_credentials", lambda: None)
    with pytest.raises(TimeoutError, match="rank 0 did not build"):
        lifecycle._come_up(placed, wait=True)
    assert lifecycle.current_group() is None and envs.RUNTIME not in os.environ


def test_a_group_stopped_while_it_starts_is_not_handed_on(placed, monkeypatch):
    monkeypatch.setattr(lifecycle, "_wait_up", lambda group: None)
    monkeypatch.setattr(lifecycle, "_GROUP", None)  # the front-end stopped it meanwhile
    lifecycle._come_up(placed, wait=False)
    assert not os.path.exists(directory.runtime_path(placed.spec.directory))
    assert envs.runtime_starting()


def test_the_advisor_waits_for_a_starting_group(starting, tiny_qwen3):
    """The planner in the loop starts with the group: it waits while the group starts, and
    ends when the group did not start."""
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info
    from vllm_afd.placement.autoscale import Advisor, Deployment, Policy

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    advisor = Advisor(Deployment(info, 1, tiny_qwen3, True), Policy(False, 0.15, 0.1))
    try:
        time.sleep(0.3)
        assert advisor._thread.is_alive()
        directory.publish_runtime(starting, None, "no")
        advisor._thread.join(timeout=5.0)
        assert not advisor._thread.is_alive()
    finally:
        advisor.stop()
