"""Failover under streaming load, seen as a client sees it: lose the FFN rank (a signal, or an
error in its serve loop) once every stream has begun, then check that readiness showed the loss
and came back, liveness never failed, the rank was replaced, and every stream ended with
colocated's exact text and tokens."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import threading
import time
from collections.abc import Callable

import psutil
from serverlib import Server, http_request

from vllm_afd.bench.soak import PROMPTS  # the soak benchmark streams the same prompts

STREAM_TOKENS = 300  # streams long enough to be in flight at the loss


def colocated_job(model: str) -> dict:
    """The colocated run of every prompt to ``STREAM_TOKENS`` tokens (shorter requests compare
    with a prefix): one ``run_once`` job for every module that streams these prompts."""
    return {"model": model, "prompts": PROMPTS, "max_tokens": STREAM_TOKENS}


#: How a test loses the FFN rank whose pid it is given; its name is in the assert messages.
Loss = Callable[[int], None]


def kill(sig: signal.Signals) -> Loss:
    """Send ``sig`` to the FFN rank."""
    return _named(lambda pid: os.kill(pid, sig), sig.name)


def fail_once(fault_file) -> Loss:
    """Make the rank's serve loop raise once (``VLLM_AFD_FAULT_FILE`` reading ``once``)."""
    return _named(lambda pid: fault_file.write_text("once"), "serve error")


def _named(loss: Callable[[int], None], name: str) -> Loss:
    loss.__name__ = name
    return loss


def _status(server: Server, path: str) -> int | str:
    try:
        return http_request(server.url + path, timeout=5)[0]
    except OSError as exc:
        return type(exc).__name__


def _probe_through_the_failover(server: Server, limit_s: float) -> tuple[float, float, list]:
    """Poll ``/afd/ready`` and ``/health`` every 50 ms from a loss until readiness is back:
    the seconds until readiness failed and until it was back (``inf``: not within
    ``limit_s``), and every ``/health`` answer seen meanwhile."""
    start, lost, health = time.monotonic(), float("inf"), []
    while time.monotonic() - start < limit_s:
        ready = _status(server, "/afd/ready")
        health.append(_status(server, "/health"))
        now = time.monotonic() - start
        if ready != 200:
            lost = min(lost, now)
        elif lost < float("inf"):
            return lost, now, health
        time.sleep(0.05)
    return lost, float("inf"), health


def lose_the_ffn_rank_under_streams(server: Server, colocated: dict, loss: Loss) -> None:
    """``loss`` of the FFN rank once each stream of ``STREAM_TOKENS`` tokens (one per prompt)
    has begun (its first chunk; chunks are not tokens: vLLM merges the outputs of a stream
    whose reader lags): readiness shows the loss within 2 s and is back once a
    replacement serves (within 60 s), liveness never fails, and every stream ends with
    colocated's exact text and tokens."""
    name = loss.__name__
    pid = server.ffn_pid()
    chunks = [0] * len(PROMPTS)  # each written by its stream's thread only
    lock, lost = threading.Lock(), threading.Event()
    lost_at = float("inf")

    def tick(i: int) -> None:
        # The loss comes from the stream whose first chunk completes the set, so that stream
        # is in flight at the loss whatever the scheduler does to this test's threads (a
        # polling main thread once woke only after every stream had ended).
        nonlocal lost_at
        chunks[i] += 1
        with lock:
            if all(chunks) and not lost.is_set():
                loss(pid)
                lost_at = time.monotonic()
                lost.set()

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [
            pool.submit(server.stream, p, STREAM_TOKENS, on_chunk=functools.partial(tick, i))
            for i, p in enumerate(PROMPTS)
        ]
        assert lost.wait(60), ("no first chunk on every stream within 60 s", chunks)
        not_ready, ready_again, health = _probe_through_the_failover(server, 60.0)
        results = [s.result(timeout=300) for s in streams]
    assert not_ready < 2.0, f"{name}: /afd/ready saw the loss after {not_ready:.1f}s"
    assert ready_again < 60.0, f"{name}: /afd/ready not back within 60 s"
    assert set(health) == {200}, f"{name}: /health answered {sorted(set(map(str, health)))}"
    replaced = time.monotonic() + 60  # logged just after the attention ranks may go on
    while server.ffn_pid() == pid and time.monotonic() < replaced:
        time.sleep(0.2)
    assert server.ffn_pid() != pid, f"{name}: no replacement logged in 60 s"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    in_flight = [r for r in results if r.times and r.times[0] < lost_at < r.times[-1]]
    assert in_flight, (name, "no stream in flight at the loss", chunks, [r.status for r in results])
    for i, result in enumerate(results):
        assert result.status == 200, (name, i, result.text[-500:])
        assert result.token_ids == colocated["token_ids"][i], (name, i)
        assert result.text == colocated["texts"][i], (name, i)


def streams_around(
    server: Server,
    action: Callable[[], object],
    prompts: list[str] = PROMPTS,
    max_tokens: int = STREAM_TOKENS,
) -> tuple[object, list, tuple]:
    """Stream every prompt (``max_tokens`` tokens each) and run ``action`` in a thread of its
    own once every stream has begun (started from the stream whose first chunk completes the
    set, as ``lose_the_ffn_rank_under_streams`` does); returns its result, the streams'
    results and the ``time.monotonic()`` span it ran in."""
    chunks = [0] * len(prompts)
    lock, done = threading.Lock(), threading.Event()
    outcome: dict = {}

    def run() -> None:
        start = time.monotonic()
        try:
            outcome["result"] = action()
        finally:
            outcome["span"] = (start, time.monotonic())
            done.set()

    def tick(i: int) -> None:
        chunks[i] += 1
        with lock:
            if all(chunks) and "thread" not in outcome:
                outcome["thread"] = threading.Thread(target=run, daemon=True)
                outcome["thread"].start()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = [
            pool.submit(server.stream, p, max_tokens, on_chunk=functools.partial(tick, i))
            for i, p in enumerate(prompts)
        ]
        results = [s.result(timeout=600) for s in streams]
    assert done.wait(600), ("the action did not end", chunks)
    return outcome.get("result"), results, outcome["span"]
