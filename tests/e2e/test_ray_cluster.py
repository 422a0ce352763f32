"""The FFN group joins an existing Ray cluster given by --afd-ray-address: one with token
authentication, whose token the user passes through (``RAY_AUTH_TOKEN_PATH``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vllm_afd.bench.offline_run import run_generation

pytestmark = [pytest.mark.slow, pytest.mark.full]


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


@pytest.fixture
def ray_head(tmp_path, ray_token):
    port = _free_port()
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--node-ip-address",
            "127.0.0.1",
            "--include-dashboard",
            "false",
            "--block",
        ],
        env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": ray_token},
        stdout=(tmp_path / "head.log").open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert head.poll() is None and time.monotonic() < deadline, (
                tmp_path / "head.log"
            ).read_text()[-2000:]
            time.sleep(1)
        yield f"127.0.0.1:{port}", head
    finally:  # the cluster is this test's own: stop its session, never `ray stop`
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == head.pid:
                    proc.kill()
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                continue
        head.wait(timeout=30)


def test_ffn_group_runs_on_a_given_cluster(tiny_qwen3, ray_head, ray_token):
    address, head = ray_head
    job = {"model": tiny_qwen3, "prompts": ["hello world", "1 2 3"], "max_tokens": 8}
    colocated = run_generation(job)
    afd = {"ratio": "1:1", "ray_address": address}
    # The user's token, passed through (RAY_AUTH_MODE defaults to token when one is given).
    result = run_generation({**job, "afd": afd, "env": {"RAY_AUTH_TOKEN_PATH": ray_token}})
    assert result["token_ids"] == colocated["token_ids"]
    assert len(result["ffn"]) == 1
    # The deployment only joined the cluster: stopping it must leave the cluster running.
    host, port = address.split(":")
    assert head.poll() is None
    assert socket.socket().connect_ex((host, int(port))) == 0
