"""Secure by default: every listening socket of a `vllm-afd serve` started with default
settings is on loopback, and Ray's are token-authenticated even there (slow).

Which listeners a server has (Ray 2.60, local instance started by the FFN group, loopback
because it runs in Ray's single-machine mode; see placement.py):

=====================  =========  ==============================================
process                protocol   without the token
=====================  =========  ==============================================
gcs_server             gRPC       UNAUTHENTICATED
raylet (2 ports)       gRPC       UNAUTHENTICATED (node manager, object manager)
every Ray worker and   gRPC       UNAUTHENTICATED (core worker service)
the front-end (driver)
ray::RuntimeEnvAgent   HTTP       401
autoscaler monitor     HTTP       200: read-only Prometheus counters, loopback only
vLLM API server        HTTP       the OpenAI API on --host (127.0.0.1 here)
=====================  =========  ==============================================

Listeners of the process group's own (gloo pairs, vLLM's sockets) must be on loopback too;
note that torch's ``TCPStore`` server (a ``tcp://`` init method) listens on every interface
whatever host the init method names, so a process group of ours needs a ``file://`` store.
"""

from __future__ import annotations

import http.client
import ipaddress
import os

import psutil
import pytest
from serverlib import Server, session_processes

pytestmark = pytest.mark.slow

#: One method of each Ray gRPC service a listener may serve (an unknown method is answered
#: UNIMPLEMENTED before authentication is looked at).
RAY_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.ObjectManagerService/Pull",
    "/ray.rpc.CoreWorkerService/NumPendingTasks",
)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _grpc_answer(port: int) -> str | None:
    """The status of a tokenless call to the first Ray service this port serves; None if it
    speaks no gRPC (or serves none of them)."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in RAY_METHODS:
            call = channel.unary_unary(method)
            try:
                call(b"", timeout=2)
                return "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
                if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    return None  # not HTTP/2 (gloo, ZMQ, HTTP/1)
                if code != "UNIMPLEMENTED":
                    return code
    return None


def _http_status(port: int) -> int | None:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/")
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None


def _listeners(sid: int) -> list[tuple[psutil.Process, str, int]]:
    found = []
    for proc in session_processes(sid):
        try:
            connections = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [
            (proc, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN
        ]
    return found


def _name(proc: psutil.Process) -> str:
    """The full command line: checks below match on it, so never truncate (paths vary)."""
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.NoSuchProcess:
        return "?"


@pytest.mark.timeout(600)
def test_no_listener_off_loopback_and_ray_requires_its_token(tiny_qwen3, tmp_path, monkeypatch):
    for name in list(os.environ):  # default settings: nothing of ours or Ray's auth given
        if name.startswith(("RAY_AUTH", "VLLM_AFD_")):
            monkeypatch.delenv(name)
    server = Server(tiny_qwen3, tmp_path / "serve.log", ("--afd-ratio", "1:1"))
    try:
        server.wait_healthy()
        assert server.complete("hello", 2)[0] == 200
        listeners = _listeners(server.proc.pid)
        table = "\n".join(f"{ip}:{port} {_name(p)}" for p, ip, port in listeners)
        assert listeners, "no listener found: the session scan is broken"
        off = [(ip, port, _name(p)) for p, ip, port in listeners if not _loopback(ip)]
        assert off == [], f"listeners off loopback:\n{table}"
        answers = {}
        for proc, _ip, port in listeners:
            if port == server.port:
                continue
            grpc_code = _grpc_answer(port)
            answers[port] = (grpc_code, None if grpc_code else _http_status(port), _name(proc))
        ray_grpc = [a for a in answers.values() if a[0] is not None]
        assert len(ray_grpc) >= 5, f"expected GCS, 2 raylet, driver, FFN worker:\n{answers}"
        assert all(code == "UNAUTHENTICATED" for code, _, _ in ray_grpc), answers
        http = {port: a for port, a in answers.items() if a[0] is None and a[1] is not None}
        for port, (_, status, name) in http.items():
            if status == 200:  # only the autoscaler's read-only metrics may answer
                assert "monitor.py" in name, f"unauthenticated HTTP on {port}: {name}"
            else:
                assert status == 401, f"{port} {name}: HTTP {status}"
        assert "RAY_AUTH_MODE=disabled" not in server.log.read_text()
    finally:
        server.terminate()
        server.kill_leftovers()
