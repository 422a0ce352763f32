"""A live scale, front-end side: what ``POST /afd/scale`` refuses before anything starts
(``placement/scaling.py``), and who may ask (``placement/routes.py``).

The scale itself (a new pool started by Ray, the attention ranks switched under streams, the
old pool stopped) runs in tests/e2e/test_real_model_e2e.py; the attention side's switch in
tests/unit/test_pool_switch.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_afd.config import AFDConfig
from vllm_afd.host import SHM_DIR
from vllm_afd.placement import lifecycle, routes, scaling
from vllm_afd.placement.cluster import FFNGroup, GroupRequest
from vllm_afd.transport import TransportSpec


@pytest.fixture
def group(tiny_qwen3, monkeypatch) -> FFNGroup:
    """A running group as the front-end holds it (no process behind it): 1 FFN rank, 8 experts."""
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    spec = TransportSpec("shm", 1, 1, info.num_experts, info.hidden_size, info.top_k, 16)
    afd = AFDConfig.from_dict({"ratio": "1:1"})
    request = GroupRequest(afd, info, tiny_qwen3, 1, 16, spec.dtype)
    running = FFNGroup(spec, [], [], None, False, spec, tiny_qwen3, "cpu", request=request)
    monkeypatch.setattr(lifecycle, "_GROUP", running)
    return running


@pytest.mark.parametrize(
    ("count", "reason"),
    [
        (3, "cannot be split evenly over 3 FFN ranks"),
        (16, "has only 8 routed experts"),
        (0, "0 FFN ranks"),
        ("2", "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_a_count_the_experts_cannot_split_into_is_refused_naming_the_field(group, count, reason):
    with pytest.raises(scaling.ScaleError) as refused:
        scaling.scale_ffn_group(count)
    assert refused.value.status == 400
    assert "num_ffn_ranks" in str(refused.value) and reason in str(refused.value)
    assert "[1, 2, 4, 8]" in str(refused.value)


def test_the_size_the_pool_has_is_no_scale(group):
    assert scaling.scale_ffn_group(1) is None


def test_a_step_serving_backend_or_no_group_cannot_scale(group, monkeypatch):
    stepped = dataclasses.replace(group.spec, backend="slots", config={"waits": "device"})
    monkeypatch.setattr(group, "spec", stepped)
    with pytest.raises(scaling.ScaleError, match="slots cannot change its FFN pool live") as e:
        scaling.scale_ffn_group(2)
    assert e.value.status == 409
    monkeypatch.setattr(lifecycle, "_GROUP", None)
    with pytest.raises(scaling.ScaleError, match="no FFN group of this front-end") as e:
        scaling.scale_ffn_group(2)
    assert e.value.status == 409


def test_one_scale_at_a_time(group):
    with scaling._SCALING:
        with pytest.raises(scaling.ScaleError, match="another scale") as busy:
            scaling.scale_ffn_group(2)
    assert busy.value.status == 409


def test_a_scale_the_front_ends_stop_overtook_stops_its_new_pool(group, monkeypatch, tmp_path):
    """``stop_ffn_group`` (shutdown) runs while the new pool starts: the scale adopts nothing,
    stops the new pool itself, and answers 503; the stopped front-end has no group again."""
    new = dataclasses.replace(group, spec=dataclasses.replace(group.spec, num_ffn_ranks=2))
    stopped = []

    def launch(spec, afd, model_dir, device):
        monkeypatch.setattr(lifecycle, "_GROUP", None)  # what stop_ffn_group does meanwhile
        return new

    monkeypatch.setattr(lifecycle, "_launch", launch)
    monkeypatch.setattr(lifecycle, "_ffn_directory", lambda epoch: str(tmp_path / f"ffn{epoch}"))
    monkeypatch.setattr(lifecycle, "supervise", lambda pool: None)
    monkeypatch.setattr(lifecycle, "stop_ranks", lambda pool: stopped.append(pool) or [])
    monkeypatch.delenv("VLLM_AFD_RUNTIME", raising=False)
    with pytest.raises(scaling.ScaleError, match="stopped its FFN group") as refused:
        scaling.scale_ffn_group(2)
    assert refused.value.status == 503
    assert stopped == [new] and lifecycle.current_group() is None
    assert "VLLM_AFD_RUNTIME" not in os.environ and not lifecycle.DRAINING


def test_a_stop_after_the_adoption_stops_the_replaced_pool_too(group, monkeypatch):
    """Once a scale adopted its new pool, the replaced one is on ``DRAINING`` until the scale
    stops it (``stop_replaced``): a stop of the group meanwhile stops both, and the scale then
    stops nothing twice."""
    new = dataclasses.replace(group, owns_ray=False)
    stopped = []
    monkeypatch.setattr(lifecycle, "stop_ranks", lambda pool: stopped.append(pool) or [])
    monkeypatch.setattr(lifecycle, "release_credentials", lambda: None)
    monkeypatch.setattr(lifecycle, "DRAINING", [])
    assert lifecycle.adopt(new, replacing=group) and lifecycle.DRAINING == [group]
    lifecycle.stop_ffn_group()
    assert stopped == [group, new] and not lifecycle.DRAINING
    lifecycle.stop_replaced(group)  # the scale's turn: nothing left to stop
    assert stopped == [group, new]


def test_stopping_a_pool_after_ray_went_calls_no_actor(group, monkeypatch):
    """``stop_ranks`` once Ray is shut down (a stop overtook the scale): no actor call, which
    would start a new Ray; the pool's stats blocks are still unlinked."""
    import ray

    called, unlinked = [], []

    class Gone:
        def __getattr__(self, name):
            called.append(name)
            raise AttributeError(name)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "kill", lambda actor: called.append("kill"))
    monkeypatch.setattr("vllm_afd.metrics.blocks.unlink_deployment_blocks", unlinked.append)
    lifecycle.stop_ranks(dataclasses.replace(group, actors=[Gone()]))
    assert not called and unlinked == [group.spec]


def test_a_rank_whose_stop_did_not_complete_leaves_no_segment(group, monkeypatch):
    """A rank Ray ended without its stop (its raylet died before the front-end stopped: the
    stop never reached it) leaves its segments, its resource tracker dead with it; the
    front-end's stop unlinks them once the rank exited, and logs it."""
    import ray

    script = (
        "import os, sys, time, torch\n"
        "from vllm_afd.transport.control_block import ControlBlock\n"
        "from vllm_afd.transport.slot_plane import PlaneLayout\n"
        "block = ControlBlock.create(PlaneLayout(1, 1, 4, 8, 2, torch.float32), (0,), 'h')\n"
        "print(block.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        name = rank.stdout.readline().strip()
        assert os.path.exists(f"{SHM_DIR}/{name}")
        info = {"pid": rank.pid, "host": socket.gethostname()}
        monkeypatch.setattr(ray, "is_initialized", lambda: False)  # Ray went: no stop call
        monkeypatch.setattr(lifecycle, "release_credentials", lambda: None)
        monkeypatch.setattr(lifecycle, "_GROUP", dataclasses.replace(group, infos=[info]))
        threading.Timer(0.3, os.killpg, (rank.pid, signal.SIGKILL)).start()  # Ray ends it
        lifecycle.stop_ffn_group()
        assert not os.path.exists(f"{SHM_DIR}/{name}")
    finally:
        rank.kill()
        rank.wait(10)


def _client(keys: list[str], host: str) -> TestClient:
    app = FastAPI()
    app.include_router(routes.router)
    app.state.afd_admin_tokens = keys
    return TestClient(app, client=(host, 50000))


def test_scaling_takes_a_bearer_token_the_server_takes(group):
    """The admin token or the API key, as vLLM's ``/v1`` takes its keys; nothing else."""
    client = _client(["s3cret-api-key", "admin-token"], "127.0.0.1")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic admin-token"}):
        answer = client.post("/afd/scale", json={"num_ffn_ranks": 3}, headers=headers)
        assert answer.status_code == 401, answer.text
        assert "admin token" in answer.json()["error"] and "--api-key" in answer.json()["error"]
    for token in ("s3cret-api-key", "admin-token"):
        headers = {"Authorization": f"Bearer {token}"}
        answer = client.post("/afd/scale", json={"num_ffn_ranks": 3}, headers=headers)
        assert answer.status_code == 400 and "num_ffn_ranks 3" in answer.json()["error"]


def test_loopback_alone_may_not_scale(group):
    """A client's address proves nothing (a proxy, a sidecar, a port-forward is local)."""
    for host in ("127.0.0.1", "10.1.2.3"):
        answer = _client(["admin-token"], host).post("/afd/scale", json={"num_ffn_ranks": 1})
        assert answer.status_code == 401, answer.text
    answer = _client([], "127.0.0.1").post("/afd/scale", json={"num_ffn_ranks": 1})
    assert answer.status_code == 401, answer.text
    headers = {"Authorization": "Bearer admin-token"}
    answer = _client(["admin-token"], "10.1.2.3").post(
        "/afd/scale", json={"num_ffn_ranks": 1}, headers=headers
    )
    assert answer.status_code == 200 and answer.json()["scale"] is None, answer.text


#: Bodies an operator might send by mistake (or an attacker on purpose), and what the answer
#: must name. Each is refused with 400 before anything starts.
BAD_BODIES = [
    (b'{"num_ffn_ranks": 2, "extra": 1}', "unknown field(s) ['extra']"),
    (b'{"num_ffn_rank": 2}', "unknown field(s) ['num_ffn_rank']"),
    (b"{}", "num_ffn_ranks is missing"),
    (b"[2]", "the body is a JSON list"),
    (b"2", "the body is a JSON int"),
    (b"null", "the body is a JSON NoneType"),
    (b"", "the body is not JSON"),
    (b"num_ffn_ranks=2", "the body is not JSON"),
    (b'{"num_ffn_ranks": ' + b"9" * 4000 + b"}", "an integer of 4000 digits; one of [1, 2, 4, 8]"),
    (b'{"num_ffn_ranks": -' + b"9" * 40 + b"}", "an integer of 40 digits"),
    (b'{"num_ffn_ranks": 2.5}', "must be an integer, one of [1, 2, 4, 8], not 2.5"),
    (b'{"num_ffn_ranks": "2"}', "must be an integer"),
    (b'{"num_ffn_ranks": 1e400}', "must be an integer"),
    (b'{"num_ffn_ranks": 3}', "num_ffn_ranks 3: "),
    (b"[" * 2000 + b"]" * 2000, "the body nests too deep"),
    (b'{"a": ' * 3000 + b"1" + b"}" * 3000, "the body has 21001 bytes, at most 4096"),
    (b'{"num_ffn_ranks": ' + b" " * 5000 + b"2}", "at most 4096"),
]


@pytest.mark.parametrize(("body", "named"), BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_a_bad_scale_body_is_answered_400_naming_what_is_wrong(group, body, named):
    headers = {"Authorization": "Bearer admin-token", "Content-Type": "application/json"}
    answer = _client(["admin-token"], "127.0.0.1").post("/afd/scale", content=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"], answer.json()["error"]


def _group_file(tmp_path, **fields) -> str:
    """A group file of `vllm-afd ffn-server` (only what ``vllm-afd scale`` reads)."""
    import json

    from vllm_afd.placement import shared

    path = tmp_path / "group.json"
    path.write_text(json.dumps({"format": shared.GROUP_FILE_FORMAT, **fields}))
    path.chmod(0o600)
    return str(path)


def test_vllm_afd_scale_reaches_the_ffn_server_through_its_private_directory(
    group, tmp_path, monkeypatch
):
    """``request_scale`` (``vllm-afd scale``) drops a request; the ffn-server's loop
    (``answer_scale_requests``) carries it out with the checks ``POST /afd/scale`` makes and
    answers next to it; nothing is left in the directory."""
    import os
    import threading

    requests = tmp_path / "scale"
    requests.mkdir(mode=0o700)
    path = _group_file(tmp_path, scale_requests=str(requests))
    scaled = []

    def fake_scale(old, count, timeout_s):  # the pool start and switch: the e2e test's
        scaled.append(count)
        group.spec = dataclasses.replace(group.spec, num_ffn_ranks=count)
        return scaling.ScaleEvent(2, old.spec.num_ffn_ranks, count, 0.0, 1.5, 0.004)

    monkeypatch.setattr(scaling, "_scale", fake_scale)
    stop = threading.Event()

    def ffn_server():
        while not stop.wait(0.01):
            scaling.answer_scale_requests(str(requests))

    server = threading.Thread(target=ffn_server)
    server.start()
    try:
        reply = scaling.request_scale(path, 2, timeout_s=10)
        assert reply["status"] == 200 and reply["num_ffn_ranks"] == 2, reply
        assert reply["ratio"] == "1:2" and reply["scale"]["took_s"] == 1.5
        reply = scaling.request_scale(path, 3, timeout_s=10)
        assert reply["status"] == 400 and "num_ffn_ranks 3" in reply["error"], reply
        assert "[1, 2, 4, 8]" in reply["error"]
        assert scaling.request_scale(path, 2, timeout_s=10)["scale"] is None  # the size it has
        # a request file the server may not trust (group-readable) is refused like a bad body
        # written whole under another name first: the server's loop may take it at once
        (requests / "x.tmp").write_text('{"num_ffn_ranks": 4}')
        (requests / "x.tmp").chmod(0o644)
        (requests / "x.tmp").rename(requests / "x.request")
        deadline = 50
        while not (requests / "x.answer").exists() and deadline:
            stop.wait(0.1)
            deadline -= 1
        assert '"status": 400' in (requests / "x.answer").read_text()
        (requests / "x.answer").unlink()
    finally:
        stop.set()
        server.join()
    assert scaled == [2] and os.listdir(requests) == []


def test_vllm_afd_scale_without_an_answer_withdraws_its_request(tmp_path):
    requests = tmp_path / "scale"
    requests.mkdir(mode=0o700)
    path = _group_file(tmp_path, scale_requests=str(requests))
    with pytest.raises(scaling.ScaleError, match="did not answer within 0.3s") as late:
        scaling.request_scale(path, 2, timeout_s=0.3)
    assert late.value.status == 504 and list(requests.iterdir()) == []
    from vllm_afd.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="takes no scale requests"):
        scaling.request_scale(_group_file(tmp_path), 2, timeout_s=0.3)
    with pytest.raises(AFDConfigError, match="vllm-afd scale .*no such file"):
        scaling.request_scale(str(tmp_path / "missing.json"), 2, timeout_s=0.3)


def test_a_shared_groups_scale_waits_for_the_ranks_front_ends_hold(tmp_path, monkeypatch):
    """An ffn-server group's scale waits for the attention ranks live front-ends leased (one
    on another host counts), not for free ones or a dead front-end's."""
    import json
    import os
    import socket

    from vllm_afd.host import process_start_time
    from vllm_afd.placement import shared
    from vllm_afd.transport import directory

    (tmp_path / "ffn").mkdir()
    spec = TransportSpec("shm", 4, 1, 8, 16, 2, 16, directory=str(tmp_path / "ffn"))
    assert shared.served_attention_ranks(spec) == [0, 1, 2, 3]  # a front-end's own group
    leases = tmp_path / "leases"
    leases.mkdir()
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    holders = {
        1: {**me, "start": process_start_time(os.getpid())},
        2: {**me, "start": -1},  # its front-end died
        3: {"host": "other-host", "pid": 1, "start": 1},
    }
    for rank, holder in holders.items():
        (leases / f"rank{rank}").write_text(json.dumps(holder))
    monkeypatch.setattr(shared, "_SERVED_LEASES", str(leases))
    assert shared.served_attention_ranks(spec) == [1, 3]
    directory.publish_switch(spec.directory, directory.Switch(1, 2, 0.003))
    assert scaling._wait_for_switches(spec, 2, 0.2) is None  # rank 3 has not switched
    directory.publish_switch(spec.directory, directory.Switch(3, 2, 0.001))
    switched = scaling._wait_for_switches(spec, 2, 0.2)
    assert switched is not None and [s.rank for s in switched] == [1, 3]


def test_a_scale_under_way_shows_in_the_status_until_it_ends(group, monkeypatch):
    """A scale whose client gave up runs on: ``/afd/status`` shows it while it runs."""
    import threading

    from vllm_afd.placement import scaling

    started, release = threading.Event(), threading.Event()

    def slow_scale(old, count, switch_timeout_s):
        started.set()
        release.wait(10)
        raise scaling.ScaleError(503, "the new pool did not start")

    monkeypatch.setattr(scaling, "_scale", slow_scale)
    worker = threading.Thread(target=scaling.answer, args=(b'{"num_ffn_ranks": 2}',))
    worker.start()
    try:
        assert started.wait(10)
        under_way = scaling.in_progress()
        assert under_way is not None
        assert (under_way["from_ranks"], under_way["to_ranks"]) == (1, 2)
    finally:
        release.set()
        worker.join(10)
    assert scaling.in_progress() is None
