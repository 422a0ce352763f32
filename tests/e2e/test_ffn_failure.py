"""An FFN rank that stops, fails or dies with failover off, seen through the server: `/health`
and the in-flight request (failover itself: test_server.py).

One server at 1:1 with ``--afd-failover-timeout 0`` and the fault-injection file configured
(``VLLM_AFD_FAULT_FILE``, absent at first), under ``--fail-on-environ-validation``. A
SIGSTOPped FFN rank turns `/health` to 503 within 2 s through its heartbeat (its pid is alive,
so a pid check alone would not see it) and back to 200 on SIGCONT. Then the fault file makes
the FFN rank's serve loop raise: the in-flight request fails within 2 s, alone (the attention
rank sends it again by itself and it fails there too), with the FFN's error text in the server
log; `/health` turns 503 (a rank that failed requests heals only with failover) while the engine
serves on, and stopping the server leaves no process behind. Without failover a lost FFN rank
fails the combine at once (``FFNRankLost``: tests/unit/transport/test_failover.py,
test_processes.py).

A second server, with failover on (the default), shows that an error in the serve loop is a
failover: the fault file reading ``once`` makes the FFN rank raise on one layer batch while six
streams are in flight; the supervisor replaces the rank, the attention rank sends the batch once
more, to the replacement, and every stream ends with colocated's text and tokens. Then the
fault file reading ``rows>=20`` poisons one long request: it fails alone while the streams end
with colocated's text, `/health` is back to 200 and the server serves on.

A third server runs on the slot plane with the device's waits (``slots``, ``waits: device``:
the CPU stand-in of every GPU's), failover on: an FFN rank SIGKILLed under six streams is
replaced; the requests of the step its death spoiled fail with that step's output (a device
wait cannot send a use again), every other stream ends with colocated's text, and once
readiness is back every prompt gets colocated's tokens.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from failoverlib import (
    PROMPTS,
    STREAM_TOKENS,
    colocated_job,
    fail_once,
    lose_the_ffn_rank_under_streams,
    streams_around,
)
from serverlib import Server, http_request

pytestmark = [pytest.mark.slow, pytest.mark.full]

#: The slot plane with the device's waits (every GPU's; here the CPU stand-in).
DEVICE_WAITS = ("--afd-transport", "slots", "--afd-transport-config", '{"waits": "device"}')


@pytest.fixture(scope="module")
def servers(tiny_qwen3, run_once, tmp_path_factory) -> Iterator[tuple[Server, Server, Server]]:
    """This module's three servers, started side by side (a start is mostly its processes'
    imports, on either core), all up before the first test: failover off, then on, then on
    with the device's waits."""
    started: list[Server] = []
    try:
        for name, flags, plugins in (
            ("ffn_failure", ("--afd-failover-timeout", "0"), {}),
            ("ffn_error_failover", (), {"VLLM_PLUGINS": "afd"}),
            ("stepped_failover", DEVICE_WAITS, {"VLLM_PLUGINS": "afd"}),
        ):
            tmp = tmp_path_factory.mktemp(name)
            srv = Server(
                tiny_qwen3,
                tmp / "server.log",
                # vLLM refuses to start on a VLLM_* variable it does not know (patch E1 declares
                # ours)
                extra=("--afd-ratio", "1:1", *flags, "--fail-on-environ-validation"),
                env={"VLLM_AFD_FAULT_FILE": str(tmp / "fault"), **plugins},
            )
            srv.fault = tmp / "fault"
            started.append(srv)
        started[1].colocated = run_once(colocated_job(tiny_qwen3))
        for srv in started:
            srv.wait_healthy()
        yield started[0], started[1], started[2]
    finally:
        for srv in started:
            try:
                srv.terminate()
            finally:
                srv.kill_leftovers()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    """The 1:1 server with failover off."""
    return servers[0]


def _health(server: Server) -> int | str:
    try:
        return http_request(server.url + "/health", timeout=5)[0]
    except OSError:
        return "down"


def _seconds_until(server: Server, want, limit_s: float) -> float:
    """Seconds until `/health` satisfies ``want`` (polled every 0.1 s), or ``inf``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if want(_health(server)):
            return time.monotonic() - start
        time.sleep(0.1)
    return float("inf")


def test_a_stopped_ffn_rank_shows_in_health_within_2s(server):
    assert server.complete("hello world", 4)[0] == 200
    pid = server.ffn_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        took = _seconds_until(server, lambda h: h == 503, 10.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 2.0, f"/health saw the stopped FFN rank after {took:.1f}s"
    assert _seconds_until(server, lambda h: h == 200, 10.0) < 10.0
    assert server.complete("hello world", 4)[0] == 200


def test_an_ffn_serve_error_fails_the_request_at_once_and_the_engine_serves_on(server):
    server.fault.touch()
    start = time.monotonic()
    try:
        status, body = server.complete("hello world", 8, timeout=60.0)
        took = time.monotonic() - start
    finally:
        server.fault.unlink()
    assert status >= 500, body
    assert took < 2.0, f"the failing request took {took:.1f}s"
    log = server.log.read_text()
    failed = "failed: an FFN rank fails its tokens: FFN rank 0: layer 0: RuntimeError: injected"
    assert failed in log, log[-3000:]
    # the rank that failed requests is unhealthy until restarted (no failover to heal it) ...
    assert _seconds_until(server, lambda h: h != 200, 10.0) < 10.0
    # ... but the engine core lives: the next request, without the fault, completes
    assert server.complete("hello world", 4)[0] == 200
    server.terminate()
    server.assert_nothing_left(30)


@pytest.fixture(scope="module")
def failover_server(servers) -> Server:
    """The 1:1 server with failover on and the fault file configured (absent at first), and as
    ``colocated`` the colocated runs of failoverlib's prompts."""
    return servers[1]


def test_an_ffn_serve_error_under_streams_is_a_failover_that_loses_nothing(failover_server):
    server = failover_server
    for attempt in (1, 2):
        try:
            lose_the_ffn_rank_under_streams(server, server.colocated, fail_once(server.fault))
            break
        except AssertionError:
            # on a starved machine every stream's first chunk may reach this test's client
            # only after generation: the fault was armed when nothing was left to serve (its
            # file unread). Nothing was tested then: once more (CI, 2026-12-07)
            if attempt == 2 or not server.fault.exists():
                raise
            server.fault.unlink()
    assert not server.fault.exists(), "the fault did not fire"
    log = server.log.read_text()
    assert "failed serving a request" in log, log[-3000:]
    assert "FFN rank 0 replaced in" in log
    assert server.complete("hello world", 4)[0] == 200


#: A prompt whose prefill chunks reach the fault's row count (``rows>=20``) on their own; the
#: streams' decode steps (6 rows) do not.
POISON = "An FFN rank fails every batch this request is in, wherever it goes. " * 8


def test_a_request_an_ffn_error_follows_fails_alone_and_the_server_serves_on(failover_server):
    """The fault file reading ``rows>=20`` armed once six streams decode, then a request with a
    long prompt: it fails (after its batch went once more, to a replacement, and then each of
    the batch's requests alone), with the FFN's error text in the log; every stream ends with
    colocated's text and tokens, `/health` is back to 200, and the server serves on."""
    server = failover_server
    started = [threading.Event() for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [
            pool.submit(server.stream, p, STREAM_TOKENS, on_chunk=started[i].set)
            for i, p in enumerate(PROMPTS)
        ]
        for event in started:
            assert event.wait(60), "a stream produced no token"
        server.fault.write_text("rows>=20")
        try:
            status, body = server.complete(POISON, 8, timeout=120.0)
        finally:
            server.fault.unlink()
        results = [s.result(timeout=300) for s in streams]
    assert status != 200, body
    for i, result in enumerate(results):
        assert result.status == 200, (i, result.error)
        assert result.token_ids == server.colocated["token_ids"][i], i
        assert result.text == server.colocated["texts"][i], i
    log = server.log.read_text()
    assert re.search(r"request \S+ failed: an FFN rank fails its tokens: .*injected fault", log)
    assert _seconds_until(server, lambda h: h == 200, 60.0) < 60.0
    assert server.complete("hello world", 4)[0] == 200


@pytest.fixture(scope="module")
def stepped_server(servers) -> Server:
    """1:1 on the slot plane with the device's waits, failover on (the default)."""
    return servers[2]


def test_with_the_device_waits_a_killed_ffn_rank_is_replaced_and_the_server_serves_on(
    stepped_server, failover_server
):
    server, colocated = stepped_server, failover_server.colocated
    for attempt in (1, 2):
        pid = server.ffn_pid()
        kill = functools.partial(os.kill, pid, signal.SIGKILL)
        _, results, (killed_at, _) = streams_around(server, kill)
        failed = [i for i, r in enumerate(results) if r.status != 200 or r.error]
        for i, result in enumerate(results):
            if i not in failed:  # a stream none of whose steps the death spoiled
                assert result.token_ids == colocated["token_ids"][i], i
                assert result.text == colocated["texts"][i], i
        # replaced (logged once up) and ready again
        deadline = time.monotonic() + 60
        while server.ffn_pid() == pid or http_request(server.url + "/afd/ready")[0] != 200:
            assert time.monotonic() < deadline, "no replacement ready within 60 s"
            time.sleep(0.2)
        if failed or [r for r in results if r.times and r.times[-1] > killed_at]:
            break
        # on a starved machine every stream may end before the kill comes from the client's
        # thread (as in the serve-error test above): nothing was tested, once more
        assert attempt == 1, "the death hit no stream in flight"
    log = server.log.read_text()
    assert f"FFN rank 0 (pid {pid}) died; replacing it" in log, log[-3000:]
    assert "FFN rank 0 replaced in" in log, log[-3000:]
    if failed:  # failed with the loss, not with wrong tokens
        assert re.search(rf"FFN rank 0 \(pid {pid}\) died \(steps [0-9-]+\); failing", log)
        for i in failed:
            assert "died" in results[i].error or results[i].status >= 500, results[i]
    # the replacement serves colocated's tokens
    for i, prompt in enumerate(PROMPTS):
        status, reply = server.complete(prompt, 16)
        assert status == 200, reply
        assert reply["choices"][0]["token_ids"] == colocated["token_ids"][i][:16], i
