"""Graceful shutdown: SIGTERM to an AFD server leaves no process behind, and with vLLM's drain
mode (``--shutdown-timeout``) every request in flight completes first.

Explicit `--data-parallel-size 2` makes vLLM start two API server processes (its multi-server
mode), the shape in which Ray's own SIGTERM handler used to take shutdown away from vLLM.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import signal
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from serverlib import Server, session_processes

pytestmark = pytest.mark.slow


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


PROMPTS = ["hello world", "The FFN ranks hold the experts", "def f(x):", "1 2 3 4", "Paris is"]
MAX_TOKENS = 96


def _stream(url: str, model: str, prompt: str, started: threading.Event) -> tuple[str, str]:
    """One streaming completion read to its end: (text, finish_reason); ``started`` is set at
    the first token."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    text, finish = [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: ") :])["choices"][0]
        text.append(choice["text"])
        finish = choice.get("finish_reason") or finish
        started.set()
    conn.close()
    return "".join(text), finish


def _afd_segments(pids) -> set[str]:
    """The ``/dev/shm/vllm_afd_*`` segments mapped by these processes."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(re.findall(r"/dev/shm/(vllm_afd_\S+)", maps))
    return found


def test_sigterm_under_load_drains_every_request(tiny_qwen3, tmp_path):
    """SIGTERM with streams in flight and vLLM's drain mode (``--shutdown-timeout`` > 0; 0, the
    default, aborts them): every stream ends with its whole text, then the FFN group stops and
    nothing is left (processes, Ray's daemons, the deployment's /dev/shm segments)."""
    server = Server(
        tiny_qwen3,
        tmp_path / "server.log",
        # The one-flag shape (two DP attention ranks behind one API server). With several API
        # servers (an explicit --data-parallel-size), vLLM 0.32 stops the API servers' engine
        # clients first and their streams hang until the launcher kills them (stock vLLM).
        extra=("--afd-ratio", "2:1", "--shutdown-timeout", "120"),
    )
    try:
        server.wait_healthy()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            expected = list(pool.map(lambda p: server.complete(p, MAX_TOKENS), PROMPTS))
        expected_texts = [body["choices"][0]["text"] for _, body in expected]
        segments = _afd_segments(p.pid for p in session_processes(server.proc.pid))
        assert segments, "no vllm_afd_* segment mapped by the server's processes"
        started = [threading.Event() for _ in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [
                pool.submit(_stream, server.url, server.model, p, e)
                for p, e in zip(PROMPTS, started, strict=True)
            ]
            for event in started:
                assert event.wait(60), "a stream produced no token"
            server.proc.send_signal(signal.SIGTERM)
            results = [s.result(timeout=150) for s in streams]
        for (text, finish), want in zip(results, expected_texts, strict=True):
            assert finish == "length"
            assert text == want
        server.proc.wait(timeout=150)
        log = server.log.read_text()
        assert server.proc.returncode == 0, log[-3000:]
        assert "mode=drain" in log
        deadline = time.monotonic() + 30
        while (left := session_processes(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]
        assert not [s for s in segments if Path("/dev/shm", s).exists()]
    finally:
        server.kill_leftovers()
