"""Graceful shutdown of vLLM's multi-API-server shape: SIGTERM leaves no process behind.

Explicit `--data-parallel-size 2` makes vLLM start two API server processes (its multi-server
mode), the shape in which Ray's own SIGTERM handler used to take shutdown away from vLLM. The
drain of streams in flight (``--shutdown-timeout``) is the last test of test_server.py.
"""

from __future__ import annotations

import time

import pytest
from serverlib import Server, session_processes

pytestmark = [pytest.mark.slow, pytest.mark.full]


def test_sigterm_stops_everything(tiny_qwen3, tmp_path):
    server = Server(
        tiny_qwen3,
        tmp_path / "server.log",
        extra=("--afd-ratio", "2:1", "--data-parallel-size", "2"),
    )
    try:
        server.wait_healthy()
        status, body = server.complete("hello world", 8)
        assert status == 200, body
        started = time.monotonic()
        server.terminate()
        assert server.proc.returncode == 0, server.log.read_text()[-3000:]
        assert time.monotonic() - started < 60
        deadline = time.monotonic() + 20
        while (left := session_processes(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]
    finally:
        server.kill_leftovers()
