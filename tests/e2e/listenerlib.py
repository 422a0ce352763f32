"""Helpers of the listener scan (test_server.py): a session's listening sockets, and what each
answers without credentials.

Which listeners a server has (Ray 2.60, local instance started by the FFN group, loopback
because it runs in Ray's single-machine mode; see placement/credentials.py):

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

import psutil

#: One method of each Ray gRPC service a listener may serve (an unknown method is answered
#: UNIMPLEMENTED before authentication is looked at).
RAY_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.ObjectManagerService/Pull",
    "/ray.rpc.CoreWorkerService/NumPendingTasks",
)


def grpc_answer(port: int) -> str | None:
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


def http_status(port: int) -> int | None:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/")
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None


def listeners(procs: list[psutil.Process]) -> list[tuple[psutil.Process, str, int]]:
    """(process, ip, port) of every listening inet socket of ``procs``."""
    found = []
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [
            (proc, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN
        ]
    return found


def process_name(proc: psutil.Process) -> str:
    """The full command line: checks match on it, so never truncate (paths vary)."""
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.NoSuchProcess:
        return "?"
