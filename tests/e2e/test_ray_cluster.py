"""The FFN group on a given Ray cluster (--afd-ray-address) of three nodes on this machine (a
head without CPUs, two nodes of one CPU each: three raylets), with token authentication whose
token the user passes through (``RAY_AUTH_TOKEN_PATH``).

The FFN ranks may run on other hosts, so ``--afd-transport auto`` takes the slot plane over NIXL,
with UCX kept on its tcp transport (``UCX_TLS=tcp,self``, as between two hosts): the data plane
across Ray nodes is what the suite runs. Under six streams of 300 tokens the node holding the
FFN rank dies (every process of that
node's session killed: its raylet and the rank): the supervisor sees the loss (the pid, and
through Ray: ``failover.RayWatch``), Ray places the rank's bundle on the other node, the
replacement starts there, and every stream ends with colocated's text. No listener of the
server or its FFN rank is off loopback without authentication (UCX's are on loopback).
Stopping the server leaves the cluster running (the deployment only joined it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from failoverlib import colocated_job, lose_the_ffn_rank_under_streams
from listenerlib import grpc_answer, listeners, process_name
from serverlib import Server, session_processes

from vllm_afd.host import is_loopback

pytestmark = [pytest.mark.slow, pytest.mark.full]

#: UCX on its tcp transport alone, as between two hosts (the nodes' FFN ranks and the server).
UCX_TCP = {"UCX_TLS": "tcp,self"}
#: The cluster's GCS declares a node dead after 4 missed health checks 0.5 s apart (Ray's
#: defaults take about 15 s), so that its bundles are placed again soon.
HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}


def _free_port() -> int:
    for port in range(26000, 27000):  # above Ray's default worker-port range (10002-19999)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port")


@pytest.fixture
def ray_token(tmp_path) -> str:
    from vllm_afd.host import write_private_file

    return write_private_file(str(tmp_path / "ray_token"), os.urandom(32).hex().encode())


def _ray_start(log: Path, token: str, *args: str) -> subprocess.Popen:
    """``ray start ... --block``: one node, in a session of its own (its raylet and workers)."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": token,
        **UCX_TCP,
        **HEALTH_CHECKS,
    }
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", *args, "--block"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill_session(sid: int) -> None:
    """Kill every process of session ``sid`` (one node of this test's cluster; never `ray
    stop`)."""
    for proc in session_processes(sid):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


#: What ``ray start`` prints once its node is in the cluster.
STARTED = "Ray runtime started."


def _joined_node(log: Path, token: str, *args: str, tries: int = 2) -> subprocess.Popen:
    """A node's ``ray start`` once the node is in the cluster; one that times out joining
    (``The current node timed out during startup``: a busy GCS on two cores) is started once
    more, so that the test has the two nodes it kills one of."""
    for attempt in range(tries):
        node = _ray_start(log, token, *args)
        deadline = time.monotonic() + 120
        while node.poll() is None and time.monotonic() < deadline:
            if STARTED in log.read_text():
                return node
            time.sleep(0.5)
        _kill_session(node.pid)
        node.wait(timeout=30)
        if attempt + 1 < tries:
            log.rename(log.with_suffix(f".try{attempt + 1}.log"))
    raise AssertionError(f"a Ray node did not join the cluster:\n{log.read_text()[-2000:]}")


@pytest.fixture
def cluster(tmp_path, ray_token):
    """The head's address and the two CPU nodes' ``ray start`` processes."""
    port = _free_port()
    common = ("--node-ip-address", "127.0.0.1", "--disable-usage-stats")
    head = _ray_start(
        tmp_path / "head.log",
        ray_token,
        "--head",
        "--port",
        str(port),
        "--num-cpus",
        "0",
        "--include-dashboard",
        "false",
        *common,
    )
    nodes: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert head.poll() is None and time.monotonic() < deadline, (
                tmp_path / "head.log"
            ).read_text()[-2000:]
            time.sleep(1)
        address = f"127.0.0.1:{port}"
        for i in range(2):  # one after the other: two at once can overload the GCS
            args = (ray_token, "--address", address, "--num-cpus", "1", *common)
            nodes.append(_joined_node(tmp_path / f"node{i}.log", *args))
        yield address, head, nodes
    finally:
        for proc in (*nodes, head):
            _kill_session(proc.pid)
            proc.wait(timeout=30)


def test_a_node_holding_the_ffn_rank_dies_under_streams_and_nothing_is_lost(
    tiny_qwen3, run_once, cluster, ray_token, tmp_path
):
    address, head, nodes = cluster
    server = Server(
        tiny_qwen3,
        tmp_path / "server.log",
        extra=("--afd-ratio", "1:1", "--afd-ray-address", address),
        # the user's token, passed through (RAY_AUTH_MODE defaults to token when one is given)
        env={"RAY_AUTH_TOKEN_PATH": ray_token, "VLLM_PLUGINS": "afd", **UCX_TCP},
    )
    try:
        colocated = run_once(colocated_job(tiny_qwen3))
        server.wait_healthy()
        assert "--afd-transport auto -> nixl" in server.log.read_text()
        # NIXL's agents (UCX's tcp listener in the engine core and in the FFN rank): on
        # loopback; off it only Ray's gRPC servers (a cluster's, not single-machine mode),
        # which answer a call without the token UNAUTHENTICATED
        ffn = psutil.Process(server.ffn_pid())
        found = listeners([*session_processes(server.proc.pid), ffn])
        assert any(p.pid == ffn.pid for p, _, _ in found), "the FFN rank listens nowhere"
        off = [(ip, port, process_name(p)) for p, ip, port in found if not is_loopback(ip)]
        open_ = [
            (ip, port, name) for ip, port, name in off if grpc_answer(port) != "UNAUTHENTICATED"
        ]
        assert open_ == [], f"listeners off loopback without authentication: {open_}"
        sessions = [node.pid for node in nodes]
        first = os.getsid(server.ffn_pid())
        assert first in sessions, "the FFN rank runs on neither CPU node"
        other = next(s for s in sessions if s != first)

        def node_dies(pid: int) -> None:
            _kill_session(first)

        node_dies.__name__ = "the node's death"
        lose_the_ffn_rank_under_streams(server, colocated, node_dies)
        assert os.getsid(server.ffn_pid()) == other, "the replacement is not on the other node"
        log = server.log.read_text()
        assert "AFD: FFN rank 0 replaced in" in log, log[-3000:]
    finally:
        try:
            server.terminate()
        finally:
            server.kill_leftovers()
    # The deployment only joined the cluster: stopping it leaves the cluster running.
    assert head.poll() is None
    assert socket.socket().connect_ex(("127.0.0.1", int(address.split(":")[1]))) == 0
