"""One AFD server for the module, as a user starts it: `vllm-afd serve MODEL --afd-ratio 2:1`.

The ratio alone gives two data-parallel attention ranks behind one API server and one FFN
rank (shared-memory transport, chunked prefill and prefix caching on), started with default
settings (no ``VLLM_AFD_*`` or ``RAY_AUTH_*`` variable), vLLM's drain mode
(``--shutdown-timeout``) and the AFD readiness route allowlisted (``VLLM_PLUGINS=afd``). The
tests run in file order on it, each leaving it serving:

1. the one flag gives two data-parallel attention ranks; admin calls take the admin token the
   server logged, not a loopback address;
2. concurrent requests of different lengths return colocated's greedy tokens;
3. ``/metrics`` carries the AFD series, attention and FFN side agreeing;
4. every listening socket is on loopback and Ray's are token-authenticated even there;
5. the FFN rank is SIGKILLed, then SIGSTOPped (a hung rank), under streaming load: failover
   replaces it and every stream ends with colocated's text; readiness (``/afd/ready``) is 503
   until the replacement serves, liveness (``/health``) stays 200 throughout (``make
   test-optional`` kills it twice more);
6. last, SIGTERM with streams in flight: every stream completes, then nothing is left
   (processes, Ray's daemons, no new file in /dev/shm, metrics blocks).

A SIGKILL of the whole process group, then a SIGTERM to it: test_stop_e2e.py (``make test-all``).

With failover off, a lost FFN rank fails requests fast: test_ffn_failure.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from failoverlib import PROMPTS, STREAM_TOKENS, colocated_job, kill, lose_the_ffn_rank_under_streams
from listenerlib import grpc_answer, http_status, listeners, process_name
from serverlib import Server, http_request, session_processes

from tests.unit.metrics.metrics_testlib import value
from vllm_afd.host import SHM_DIR, is_loopback
from vllm_afd.metrics import blocks

pytestmark = pytest.mark.slow

MAX_TOKENS = [24, 16, 20, 12]  # the concurrent requests: the first four prompts


def _metrics_blocks() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(blocks.PREFIX)}


@pytest.fixture(scope="module")
def server(tiny_qwen3, run_once, tmp_path_factory):
    """The server, and as ``server.colocated`` colocated greedy runs of every prompt, computed
    while the server starts (shorter requests compare with a prefix)."""
    before, shm_before = _metrics_blocks(), set(os.listdir(SHM_DIR))
    with pytest.MonkeyPatch.context() as env:  # default settings: nothing of ours or Ray's
        for name in list(os.environ):
            if name.startswith(("RAY_AUTH", "VLLM_AFD_")) or name == "PROMETHEUS_MULTIPROC_DIR":
                env.delenv(name)
        srv = Server(
            tiny_qwen3,
            tmp_path_factory.mktemp("server") / "server.log",
            extra=("--afd-ratio", "2:1", "--shutdown-timeout", "120"),
            env={"VLLM_PLUGINS": "afd"},  # vLLM's allowlist: our general and endpoint plugin
        )
    srv.metrics_blocks_before, srv.shm_before = before, shm_before
    try:
        srv.colocated = run_once(colocated_job(tiny_qwen3))
        srv.wait_healthy()
        yield srv
    finally:
        try:
            srv.terminate()
        finally:
            srv.kill_leftovers()


@pytest.fixture(scope="module")
def colocated(server) -> dict:
    return server.colocated


def test_one_flag_gives_two_data_parallel_attention_ranks(server):
    log = server.log.read_text()
    assert "2 data-parallel attention ranks" in log
    assert "AFD on: 2 attention rank(s) : 1 FFN rank(s)" in log
    assert "--afd-transport auto -> shm" in log  # the default, for a CPU host
    # /afd/status (VLLM_PLUGINS=afd): the live group, and why the planner has no ratio here
    status, body = http_request(server.url + "/afd/status", headers=server.admin_headers())
    assert status == 200, body
    assert (body["ratio"], body["num_ffn_ranks"], body["transport"]) == ("2:1", 1, "shm")
    assert body["ffn_ranks"][0]["state"] == "up" and body["problems"] == []
    assert "VLLM_AFD_PLAN_HARDWARE" in body["recommendation"]["error"]  # CPU: none given


def test_admin_calls_take_the_admin_token_and_nothing_else(server):
    """No ``--api-key``: from loopback, with no credential, ``POST /afd/scale`` is refused and
    ``/afd/status`` says only what a readiness probe learns; with the token the server logged,
    a scale is taken (a bad body is refused naming what is wrong, before anything starts)."""
    status, body = http_request(server.url + "/afd/scale", {"num_ffn_ranks": 2})
    assert status == 401 and "admin token" in body, body
    wrong = {"Authorization": "Bearer " + "0" * 64}
    assert http_request(server.url + "/afd/scale", {"num_ffn_ranks": 2}, headers=wrong)[0] == 401
    status, body = http_request(server.url + "/afd/status")
    assert status == 200 and (body["afd"], body["ready"]) == (True, True), body
    assert not {"ffn_ranks", "scale_events", "problems"} & set(body), body
    admin = server.admin_headers()
    status, body = http_request(server.url + "/afd/scale", {"num_ffn_rank": 2}, headers=admin)
    assert status == 400 and "unknown field(s) ['num_ffn_rank']" in body, body
    status, body = http_request(server.url + "/afd/scale", {"num_ffn_ranks": 1}, headers=admin)
    assert status == 200 and body["scale"] is None, body  # the size it has: nothing to do


def test_concurrent_requests_match_colocated(server, colocated):
    with concurrent.futures.ThreadPoolExecutor(len(MAX_TOKENS)) as pool:
        replies = list(pool.map(server.complete, PROMPTS, MAX_TOKENS))
    for i, ((status, body), n) in enumerate(zip(replies, MAX_TOKENS, strict=True)):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == colocated["token_ids"][i][:n], i


def _scrape(server: Server) -> str:
    status, text = http_request(server.url + "/metrics")
    assert status == 200
    return text


def _settled_scrape(server: Server, limit_s: float = 10.0) -> str:
    """/metrics once two scrapes 0.5 s apart agree on the plugin's series (an idle DP rank's
    last dummy step may still be counted on one side when the requests have returned; the
    process and Python series of the scrape itself move on every scrape)."""

    def afd_series(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("vllm_afd_")]

    deadline = time.monotonic() + limit_s
    text = _scrape(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = _scrape(server)
        if afd_series(again) == afd_series(text):
            return again
        text = again
    return text


def test_metrics_carry_the_afd_series(server):
    for prompt in ("hello world", "1 2 3 4", "the experts"):
        assert server.complete(prompt, 8)[0] == 200
    text = _settled_scrape(server)
    assert "vllm:" in text  # vLLM's own metrics are still there
    assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0, model_name=server.model) == 1.0
    tokens = sum(
        value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=layer) for layer in (0, 1)
    )
    assert tokens > 0
    assert value(text, "vllm_afd_ffn_service_seconds_count", ffn_rank=0) > 0
    assert value(text, "vllm_afd_ffn_service_seconds_sum", ffn_rank=0) > 0
    assert value(text, "vllm_afd_ffn_layer_service_seconds_sum", ffn_rank=0, layer=1) > 0
    ffn_in = value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in")
    assert ffn_in > 0
    # Both attention ranks' series, which must account for every row the FFN rank served.
    ranks = (0, 1)
    sent = [
        value(text, "vllm_afd_dispatched_tokens_total", attention_rank=a, ffn_rank=0) for a in ranks
    ]
    assert all(s > 0 for s in sent), sent  # the idle rank's dummy steps go through AFD too
    assert sum(sent) == tokens
    for a in ranks:
        # vLLM's labels too: the served model's name, the attention rank's engine (its DP rank)
        exposed = value(
            text,
            "vllm_afd_exposed_ffn_seconds_count",
            attention_rank=a,
            model_name=server.model,
            engine=a,
        )
        assert exposed > 0
        value(text, "vllm:num_requests_running", model_name=server.model, engine=a)  # vLLM's
        assert value(text, "vllm_afd_transport_errors_total", attention_rank=a, kind="timeout") == 0
    bytes_sent = sum(
        value(text, "vllm_afd_transport_bytes_total", attention_rank=a, direction="sent")
        for a in ranks
    )
    assert bytes_sent == ffn_in


#: Ray's gRPC listeners without the token answer UNAUTHENTICATED: GCS, raylet (node manager and
#: object manager), the driver (the front-end) and the FFN rank's worker at least.
MIN_RAY_GRPC_LISTENERS = 5


def _answer(listener: tuple[psutil.Process, int]) -> tuple[str | None, int | None, str]:
    """(gRPC status without the token, else HTTP status, process) of one listener."""
    proc, port = listener
    code = grpc_answer(port)
    return code, None if code else http_status(port), process_name(proc)


def test_no_listener_off_loopback_and_ray_requires_its_token(server):
    found = listeners(session_processes(server.proc.pid))
    table = "\n".join(f"{ip}:{port} {process_name(p)}" for p, ip, port in found)
    assert found, "no listener found: the session scan is broken"
    off = [(ip, port, process_name(p)) for p, ip, port in found if not is_loopback(ip)]
    assert off == [], f"listeners off loopback:\n{table}"
    probed = [(proc, port) for proc, _ip, port in found if port != server.port]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(probed))) as pool:  # a silent port: 2-4 s
        answers = dict(zip((port for _, port in probed), pool.map(_answer, probed), strict=True))
    ray_grpc = [a for a in answers.values() if a[0] is not None]
    assert len(ray_grpc) >= MIN_RAY_GRPC_LISTENERS, answers
    assert all(code == "UNAUTHENTICATED" for code, _, _ in ray_grpc), answers
    http = {port: a for port, a in answers.items() if a[0] is None and a[1] is not None}
    for port, (_, status, name) in http.items():
        if status == 200:  # only the autoscaler's read-only metrics may answer
            assert "monitor.py" in name, f"unauthenticated HTTP on {port}: {name}"
        else:
            assert status == 401, f"{port} {name}: HTTP {status}"
    assert "RAY_AUTH_MODE=disabled" not in server.log.read_text()


def _metric(server: Server, name: str) -> float:
    """The sum of a /metrics family's samples (all labels)."""
    text = _scrape(server)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _replacements(server: Server) -> list[float]:
    return [
        float(s) for s in re.findall(r"FFN rank 0 replaced in ([\d.]+)s", server.log.read_text())
    ]


def test_ffn_rank_killed_then_stopped_under_streaming_load_loses_nothing(server, colocated):
    before = len(_replacements(server))
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        lose_the_ffn_rank_under_streams(server, colocated, kill(sig))
    took = _replacements(server)[before:]
    assert len(took) == 2 and max(took) < 60.0, took
    assert "stopped: no heartbeat for" in server.log.read_text()
    assert _metric(server, "vllm_afd_ffn_failovers_total") == len(_replacements(server))
    assert _metric(server, "vllm_afd_redispatched_requests_total") > 0
    assert http_request(server.url + "/health")[0] == 200


@pytest.mark.full
@pytest.mark.optional
def test_ffn_rank_killed_twice_more_in_a_row_loses_nothing(server, colocated):
    """Repeated losses: a replacement killed within 30 s of its start continues the backoff
    streak (a delayed restart), and still nothing is lost. Outside the full tier's budget
    (33 s): the test before it loses a rank and then its replacement, and the streak's delays
    are tests/unit/test_ffn_health.py's."""
    before = len(_replacements(server))
    for _ in range(2):
        lose_the_ffn_rank_under_streams(server, colocated, kill(signal.SIGKILL))
    took = _replacements(server)[before:]
    assert len(took) == 2 and max(took) < 60.0, took
    assert _metric(server, "vllm_afd_ffn_failovers_total") == len(_replacements(server))
    assert http_request(server.url + "/health")[0] == 200


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


def _dead_writer(name: str) -> bool:
    """Still there and its writer is gone (blocks of other live servers on the host are not)."""
    snapshot = blocks.read_block(name)
    return snapshot is not None and not snapshot.alive()


def test_sigterm_under_load_drains_every_request_then_nothing_is_left(server, colocated):
    """SIGTERM with streams in flight and vLLM's drain mode (``--shutdown-timeout`` > 0; 0, the
    default, aborts them): every stream ends with its whole text, then the FFN group stops and
    nothing is left (processes, Ray's daemons, the deployment's /dev/shm segments and metrics
    blocks, the killed FFN ranks' included)."""
    segments = _afd_segments(p.pid for p in session_processes(server.proc.pid))
    assert segments, "no vllm_afd_* segment mapped by the server's processes"
    started = [threading.Event() for _ in PROMPTS]

    def stream(i: int):
        return server.stream(PROMPTS[i], STREAM_TOKENS, on_chunk=started[i].set)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [pool.submit(stream, i) for i in range(len(PROMPTS))]
        for event in started:
            assert event.wait(60), "a stream produced no token"
        server.proc.send_signal(signal.SIGTERM)
        results = [s.result(timeout=300) for s in streams]
    for i, result in enumerate(results):
        assert result.status == 200, (i, result.error)
        assert result.text == colocated["texts"][i], i
    server.proc.wait(timeout=150)
    log = server.log.read_text()
    assert server.proc.returncode == 0, log[-3000:]
    assert "mode=drain" in log
    server.assert_nothing_left(30)
    assert not [s for s in segments if Path("/dev/shm", s).exists()]
    assert not set(os.listdir(SHM_DIR)) - server.shm_before  # vLLM's queues and locks too
    stale = [n for n in _metrics_blocks() - server.metrics_blocks_before if _dead_writer(n)]
    assert not stale, f"metrics blocks left behind by the server: {stale}"
