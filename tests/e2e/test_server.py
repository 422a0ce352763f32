"""AFD through the OpenAI server: `vllm-afd serve MODEL --afd-ratio 2:1` (the one flag).

One server for the module (the ratio alone gives two data-parallel attention ranks, one FFN
rank, shared-memory
transport, chunked prefill and prefix caching on). Concurrent requests of different lengths must
return the greedy tokens of colocated serving; then the FFN rank is killed mid-request: the
request must fail within a bounded time, /health must turn 503, and shutting the server down
must leave no process behind.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest
from serverlib import Server, http_request, session_processes

from vllm_afd.bench.offline_run import run_generation

pytestmark = pytest.mark.slow

PROMPTS = [
    "hello world",
    "The attention ranks keep the KV cache while the FFN ranks " * 4,
    "The attention ranks keep the KV cache while the FFN ranks hold experts",
    "def g(n):\n    return [i * i for i in range(n)]\n" * 6,
]
MAX_TOKENS = [24, 16, 20, 12]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill_leftovers()


def test_one_flag_gives_two_data_parallel_attention_ranks(server):
    log = server.log.read_text()
    assert "2 data-parallel attention ranks" in log
    assert "AFD on: 2 attention rank(s) : 1 FFN rank(s)" in log


def test_concurrent_requests_match_colocated(server, tiny_qwen3):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(server.complete, PROMPTS, MAX_TOKENS))
    colocated = [
        run_generation({"model": tiny_qwen3, "prompts": [p], "max_tokens": n})["token_ids"][0]
        for p, n in zip(PROMPTS[:2], MAX_TOKENS[:2], strict=True)
    ]
    for (status, body), expected in zip(replies, colocated, strict=False):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected
    for (status, body), n in zip(replies, MAX_TOKENS, strict=True):
        assert status == 200 and len(body["choices"][0]["token_ids"]) == n


def test_ffn_death_fails_requests_fast_and_leaves_nothing(server):
    pid = server.ffn_pid()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(server.complete, PROMPTS[0], 400, 60.0)
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        status, body = inflight.result(timeout=60)
    assert status >= 500, body
    assert time.monotonic() - killed_at < 30, "the in-flight request hung after the FFN died"
    deadline = time.monotonic() + 30
    health = None
    while time.monotonic() < deadline:
        try:
            health = http_request(server.url + "/health", timeout=5)[0]
        except OSError:
            health = "down"  # the server shut itself down: also not healthy
        if health != 200:
            break
        time.sleep(1)
    assert health != 200
    server.terminate()
    deadline = time.monotonic() + 30
    while (left := session_processes(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]
