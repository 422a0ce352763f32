"""AFD through the OpenAI server: `vllm-afd serve MODEL --afd-ratio 2:1` (the one flag).

One server for the module (the ratio alone gives two data-parallel attention ranks, one FFN
rank, shared-memory
transport, chunked prefill and prefix caching on). Concurrent requests of different lengths must
return the greedy tokens of colocated serving; then the FFN rank is killed three times and
stopped once under streaming load: failover replaces it and every stream ends with colocated's
text (with failover
off, a lost FFN rank fails requests fast: test_ffn_failure.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import psutil
import pytest
from serverlib import Server, http_request

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


def _metric(server: Server, name: str) -> float:
    """The sum of a /metrics family's samples (all labels)."""
    text = http_request(server.url + "/metrics")[1]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _seconds_until_unhealthy(server: Server, limit_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            if http_request(server.url + "/health", timeout=5)[0] != 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.05)
    return float("inf")


def test_ffn_rank_killed_three_times_and_stopped_once_under_streaming_load_loses_nothing(
    server, tiny_qwen3
):
    """Failover: SIGKILL of the FFN rank while 6 streams of 300 tokens decode, three times,
    then SIGSTOP (a hung rank: its pid lives); each time the loss shows in /health within 2 s,
    a replacement serves within 60 s, and every stream ends with colocated's exact text and
    tokens."""
    prompts = [*PROMPTS, "Failover keeps every request", "one two three four five six"]
    colocated = run_generation({"model": tiny_qwen3, "prompts": prompts, "max_tokens": 300})
    for event, sig in enumerate([signal.SIGKILL] * 3 + [signal.SIGSTOP]):
        pid = server.ffn_pid()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = [pool.submit(server.stream, p, 300) for p in prompts]
            time.sleep(1.5)
            os.kill(pid, sig)
            lost_at = time.monotonic()
            detected = _seconds_until_unhealthy(server, 10.0)
            results = [s.result(timeout=300) for s in streams]
        assert detected < 2.0, f"{sig.name} {event}: /health saw the loss after {detected:.1f}s"
        replaced = time.monotonic() + 60  # logged just after the attention ranks may go on
        while server.ffn_pid() == pid and time.monotonic() < replaced:
            time.sleep(0.2)
        assert server.ffn_pid() != pid, f"{sig.name} {event}: no replacement logged in 60 s"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        in_flight = [r for r in results if r.times and r.times[0] < lost_at < r.times[-1]]
        assert in_flight, f"{sig.name} {event}: no stream was in flight at the loss"
        for i, result in enumerate(results):
            assert result.status == 200, (event, i, result.text[-500:])
            assert result.token_ids == colocated["token_ids"][i], (event, i)
            assert result.text == colocated["texts"][i], (event, i)
    log = server.log.read_text()
    took = [float(s) for s in re.findall(r"FFN rank 0 replaced in ([\d.]+)s", log)]
    assert len(took) == 4 and max(took) < 60.0, took
    assert "stopped: no heartbeat for" in log
    assert _metric(server, "vllm_afd_ffn_failovers_total") == 4
    assert _metric(server, "vllm_afd_redispatched_requests_total") > 0
    assert http_request(server.url + "/health")[0] == 200
