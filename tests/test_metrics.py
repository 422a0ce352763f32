"""AFD metrics: shared stats blocks across processes, the Prometheus collector, clean-up, and
(slow) ``/metrics`` of a running ``vllm-afd serve``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.serverlib import free_port, session_processes
from vllm_afd import metrics

JOIN_TIMEOUT_S = 20.0


def _addresses(n: int) -> tuple[str, ...]:
    """Unique fake transport addresses (so parallel test runs never share block names)."""
    tag = uuid.uuid4().hex[:8]
    return tuple(f"test_{tag}_{f}" for f in range(n))


def _spec(addresses, num_attention: int) -> dict:
    return {
        "num_attention_ranks": num_attention,
        "num_ffn_ranks": len(addresses),
        "addresses": list(addresses),
    }


def _our_blocks(addresses) -> list[str]:
    names = {metrics.ffn_block_name(a, f) for f, a in enumerate(addresses)}
    names |= {metrics.attention_block_name(addresses, a) for a in range(8)}
    return sorted(n for n in os.listdir(metrics.SHM_DIR) if n in names)


def _scrape(spec) -> str:
    registry = CollectorRegistry()
    registry.register(metrics.AFDCollector(spec))
    return generate_latest(registry).decode()


def _value(text: str, name: str, **labels) -> float:
    """The value of the one sample ``name{labels}`` in exposition ``text``."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if found == {k: str(v) for k, v in labels.items()}:
            return float(match.group(3))
    raise KeyError(f"{name}{labels} not in output")


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


def _writer_main(addresses, num_attention, ready, done) -> None:
    """Child: one FFN block and one attention block, some records, then wait."""
    from vllm_afd import metrics as m

    ffn = m.FFNStatsBlock(addresses[0], 0, layers=[0, 1])
    ffn.record_layer(0, requests=2, tokens=10, bytes_in=1000, bytes_out=800, seconds=0.002)
    ffn.record_layer(1, requests=1, tokens=4, bytes_in=400, bytes_out=320, seconds=0.0003)
    ffn.record_layer(1, requests=1, tokens=6, bytes_in=600, bytes_out=480, seconds=3.0)
    attn = m.AttentionStatsBlock(addresses, num_attention - 1)
    attn.record_round_trip(1, {0: 3, 1: 5}, 700, 300, 0.0001)
    attn.record_round_trip(5, [2, 0], 200, 100, 0.02)
    attn.record_error("timeout")
    attn.record_error("ffn_dead")
    attn.record_error("ffn_dead")
    attn.record_error("no such kind")
    ready.set()
    done.wait(JOIN_TIMEOUT_S)
    ffn.close()
    attn.close()


def _start_writer(ctx, addresses, num_attention=2):
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_writer_main, args=(addresses, num_attention, ready, done))
    proc.start()
    assert ready.wait(JOIN_TIMEOUT_S), "writer did not start"
    return proc, done


def _stop(proc) -> None:
    proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(JOIN_TIMEOUT_S)


def test_runtime_env_name_matches_placement():
    from vllm_afd import placement

    assert metrics.RUNTIME_ENV == placement.RUNTIME_ENV


def test_counters_cross_processes_and_writer_unlinks(ctx):
    addresses = _addresses(2)
    proc, done = _start_writer(ctx, addresses)
    try:
        ffn = metrics.read_block(metrics.ffn_block_name(addresses[0], 0))
        attn = metrics.read_block(metrics.attention_block_name(addresses, 1))
        assert ffn is not None and attn is not None
        assert (ffn.role, ffn.rank, ffn.pid) == (metrics.ROLE_FFN, 0, proc.pid)
        assert ffn.alive() and not ffn.closed
        assert ffn.scalars[:5] == [4.0, 20.0, 2000.0, 1600.0, pytest.approx(3.0023)]
        assert ffn.layers == {0: (1.0, 0.002, 10.0), 1: (2.0, pytest.approx(3.0003), 10.0)}
        assert sum(ffn.hist) == 3 and ffn.hist[-1] == 1  # 3 s is above every bound
        assert (attn.role, attn.rank) == (metrics.ROLE_ATTENTION, 1)
        assert attn.peers == [5.0, 5.0]
        assert attn.scalars[:8] == [2.0, 10.0, 900.0, 400.0, pytest.approx(0.0201), 1, 2, 1]
        assert set(attn.layers) == {1, 5}
    finally:
        done.set()
        _stop(proc)
    assert proc.exitcode == 0
    assert _our_blocks(addresses) == []


def test_collector_output_and_alive_flips_when_ffn_process_dies(ctx):
    addresses = _addresses(2)
    spec = _spec(addresses, num_attention=2)
    proc, _ = _start_writer(ctx, addresses)
    try:
        text = _scrape(spec)
        assert _value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
        assert _value(text, "vllm_afd_ffn_rank_alive", ffn_rank=1) == 0.0  # never started
        assert _value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=1) == 10.0
        assert _value(text, "vllm_afd_ffn_requests_total", ffn_rank=0) == 4.0
        assert _value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in") == 2000.0
        assert _value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="out") == 1600.0
        assert _value(text, "vllm_afd_ffn_layer_service_seconds_count", ffn_rank=0, layer=1) == 2
        assert _value(text, "vllm_afd_ffn_service_seconds_bucket", ffn_rank=0, le="0.0025") == 2.0
        assert _value(text, "vllm_afd_ffn_service_seconds_bucket", ffn_rank=0, le="+Inf") == 3
        assert _value(text, "vllm_afd_ffn_service_seconds_sum", ffn_rank=0) == pytest.approx(3.0023)
        # Attention rank 1 recorded; rank 0 has no block and reads zero.
        assert _value(text, "vllm_afd_dispatched_tokens_total", attention_rank=1, ffn_rank=1) == 5
        assert _value(text, "vllm_afd_dispatched_tokens_total", attention_rank=0, ffn_rank=0) == 0
        assert _value(text, "vllm_afd_transport_bytes_total", attention_rank=1, direction="sent")
        assert _value(text, "vllm_afd_transport_errors_total", attention_rank=1, kind="ffn_dead")
        assert _value(text, "vllm_afd_transport_errors_total", attention_rank=1, kind="other") == 1
        assert _value(text, "vllm_afd_exposed_ffn_seconds_count", attention_rank=1) == 2.0
        assert _value(text, "vllm_afd_layer_exposed_ffn_seconds_count", attention_rank=1, layer=5)
        assert "# TYPE vllm_afd_ffn_service_seconds histogram" in text
        assert "# TYPE vllm_afd_transport_errors_total counter" in text

        os.kill(proc.pid, signal.SIGKILL)  # no clean-up: the blocks stay behind
        _stop(proc)
        text = _scrape(spec)
        assert _value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 0.0
        assert _value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=1) == 10.0  # kept
        assert len(_our_blocks(addresses)) == 2
        reaped = metrics.reap_stale_blocks()  # as the next writer on this host would
        assert metrics.ffn_block_name(addresses[0], 0) in reaped
        assert metrics.attention_block_name(addresses, 1) in reaped
        assert _our_blocks(addresses) == []
    finally:
        if proc.is_alive():
            proc.kill()
            _stop(proc)
        metrics.unlink_deployment_blocks(spec)


def test_front_end_unlinks_blocks_of_live_writers(ctx):
    addresses = _addresses(1)
    spec = _spec(addresses, num_attention=2)
    proc, done = _start_writer(ctx, addresses)
    try:
        assert len(_our_blocks(addresses)) == 2
        unlinked = metrics.unlink_deployment_blocks(spec)
        assert len(unlinked) == 2 and _our_blocks(addresses) == []
        assert _value(_scrape(spec), "vllm_afd_ffn_rank_alive", ffn_rank=0) == 0.0
    finally:
        done.set()
        _stop(proc)
    assert proc.exitcode == 0  # the writer's own unlink finds nothing and does not fail


def test_close_marks_closed_and_unlinks():
    addresses = _addresses(1)
    block = metrics.FFNStatsBlock(addresses[0], 0, layers=[3])
    snapshot = metrics.read_block(block.name)
    assert snapshot is not None and snapshot.alive() and snapshot.layers == {3: (0, 0, 0)}
    block.close()
    block.close()  # idempotent
    assert metrics.read_block(block.name) is None
    block.record_layer(3, 1, 1, 1, 1, 0.1)  # a late record after close does not fail


def test_module_recorder_follows_runtime_env(monkeypatch):
    first, second = _addresses(2), _addresses(2)
    monkeypatch.setenv(metrics.RUNTIME_ENV, json.dumps(_spec(first, 2)))
    try:
        metrics.record_round_trip(0, {0: 2, 1: 1}, 10, 5, 0.001, rank=1)
        metrics.record_error("timeout", rank=1)
        name = metrics.attention_block_name(first, 1)
        snapshot = metrics.read_block(name)
        assert snapshot.peers == [2.0, 1.0] and snapshot.scalars[metrics._A_ERRORS] == 1.0
        # A new deployment in this process (group restarted): a new block, the old one goes.
        monkeypatch.setenv(metrics.RUNTIME_ENV, json.dumps(_spec(second, 2)))
        metrics.record_round_trip(0, [0, 4], 10, 5, 0.001, rank=1)
        assert metrics.read_block(name) is None
        assert metrics.read_block(metrics.attention_block_name(second, 1)).peers == [0.0, 4.0]
        monkeypatch.delenv(metrics.RUNTIME_ENV)
        metrics.record_round_trip(0, [1, 1], 1, 1, 0.0, rank=1)  # AFD not running: a no-op
    finally:
        metrics.close_attention_block()
    assert _our_blocks(first) == [] and _our_blocks(second) == []


def test_record_combine_takes_tokens_and_bytes_from_handle_and_endpoint():
    import types

    import torch

    from vllm_afd.transport import DispatchHandle, TransportSpec

    def endpoint(addresses):
        spec = TransportSpec(
            backend="shm",
            num_attention_ranks=1,
            num_ffn_ranks=2,
            num_experts=8,
            hidden_size=16,
            top_k=2,
            max_tokens=8,
            dtype=torch.bfloat16,
            addresses=addresses,
        )
        return types.SimpleNamespace(spec=spec, rank=0)

    first, second = _addresses(2), _addresses(2)
    ep = endpoint(first)
    handle = DispatchHandle(1, 5, 16, torch.bfloat16, {0: torch.arange(3), 1: torch.arange(2)})
    try:
        metrics.record_combine(ep, handle, 0.004)
        metrics.record_combine(ep, handle, 0.002)
        metrics.record_combine(ep, DispatchHandle(1, 0, 16, torch.bfloat16, {}), 0.0)  # empty
        snapshot = metrics.read_block(metrics.attention_block_name(first, 0))
        assert snapshot.peers == [6.0, 4.0]
        # round trips, tokens, sent (bf16 rows + ids + weights), received, exposed seconds
        assert snapshot.scalars[:5] == [2, 10, 10 * (32 + 16), 10 * 32, pytest.approx(0.006)]
        assert snapshot.layers == {1: (2.0, pytest.approx(0.006), 10.0)}
        # A new endpoint (the FFN group restarted): its deployment's block, the old one goes.
        metrics.record_combine(endpoint(second), handle, 0.001)
        assert metrics.read_block(metrics.attention_block_name(first, 0)) is None
        assert metrics.read_block(metrics.attention_block_name(second, 0)).peers == [3.0, 2.0]
    finally:
        metrics.close_attention_block()
    assert _our_blocks(first) == [] and _our_blocks(second) == []


def test_collector_reports_nothing_without_runtime(monkeypatch):
    monkeypatch.delenv(metrics.RUNTIME_ENV, raising=False)
    registry = CollectorRegistry()
    registry.register(metrics.AFDCollector())
    assert "vllm_afd_" not in generate_latest(registry).decode()


def test_error_kind():
    from vllm_afd.transport import TransportError

    assert (
        metrics.error_kind(TransportError("FFN rank 0 (pid 1) did not answer within timeout_s=30"))
        == "timeout"
    )
    assert metrics.error_kind(TransportError("FFN rank 0 (pid 1) died")) == "ffn_dead"
    assert metrics.error_kind(TransportError("FFN rank 1: connection lost (x)")) == "ffn_dead"
    assert metrics.error_kind(ValueError("x")) == "other"
    assert metrics.round_trip_bytes(3, 128, 4, 2) == (3 * 128 * 4 + 3 * 2 * 8, 3 * 128 * 4)


def test_patch_puts_collector_in_every_metrics_registry(monkeypatch, tmp_path):
    import prometheus_client
    from prometheus_client import multiprocess
    from vllm.v1.metrics import prometheus

    metrics.patch_metrics_registries()
    metrics.patch_metrics_registries()  # idempotent
    addresses = _addresses(1)
    monkeypatch.setenv(metrics.RUNTIME_ENV, json.dumps(_spec(addresses, 1)))
    block = metrics.FFNStatsBlock(addresses[0], 0, layers=[0])
    alive = 'vllm_afd_ffn_rank_alive{ffn_rank="0"} 1.0'
    try:
        # Several API servers: vLLM's registry and the instrumentator's per-scrape one.
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        assert alive in generate_latest(prometheus.get_prometheus_registry()).decode()
        ephemeral = CollectorRegistry()
        multiprocess.MultiProcessCollector(ephemeral)
        assert alive in generate_latest(ephemeral).decode()
        # One API server: the global registry, with one collector.
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        assert prometheus.get_prometheus_registry() is prometheus_client.REGISTRY
        text = generate_latest(prometheus_client.REGISTRY).decode()
        assert text.count("# TYPE vllm_afd_ffn_rank_alive gauge") == 1 and alive in text
    finally:
        block.close()
        for collector in list(prometheus_client.REGISTRY._collector_to_names):
            if isinstance(collector, metrics.AFDCollector):
                prometheus_client.REGISTRY.unregister(collector)
        metrics._REGISTERED.discard(prometheus_client.REGISTRY)


def test_ffn_executor_writes_its_block(tiny_qwen3):
    """A real FFN executor (tiny model, shm transport) serving one dispatch."""
    import torch

    from vllm_afd.ffn.executor import FFNExecutor
    from vllm_afd.transport import TransportSpec, create_attention_transport

    config = json.loads((Path(tiny_qwen3) / "config.json").read_text())
    spec = TransportSpec(
        backend="shm",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=config["hidden_size"],
        top_k=2,
        max_tokens=16,
        timeout_s=10.0,
        addresses=(f"afdmetricstest{os.getpid()}_",),
    )
    executor = FFNExecutor(spec, 0, tiny_qwen3, "torch")
    name = metrics.ffn_block_name(executor.address, 0)
    endpoint = None
    try:
        assert metrics.read_block(name).layers == {0: (0, 0, 0), 1: (0, 0, 0)}
        executor.start()
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        x = torch.randn(5, spec.hidden_size)
        ids = torch.tensor([[0, 7]] * 5, dtype=torch.int32)
        weights = torch.full((5, 2), 0.5)
        endpoint.combine(endpoint.dispatch(1, x, ids, weights))
        snapshot = metrics.read_block(name)
        assert snapshot.layers[1][0] == 1 and snapshot.layers[1][2] == 5
        assert snapshot.scalars[:4] == [1, 5, 5 * (128 * 4 + 16), 5 * 128 * 4]
        assert executor.stats.snapshot()["tokens"] == 5  # the in-process view still works
        text = _scrape(spec)
        assert _value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()
    assert metrics.read_block(name) is None


# --------------------------------------------------------------------------------------------
# End to end: /metrics of `vllm-afd serve`
# --------------------------------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_serve_exposes_afd_metrics(tiny_qwen3, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop(metrics.RUNTIME_ENV, None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    flags = "--afd-ratio 1:1 --host 127.0.0.1 --dtype float32 --max-model-len 256 --enforce-eager"
    args = ["serve", tiny_qwen3, *flags.split(), "--port", str(port)]
    cmd = [str(Path(sys.executable).with_name("vllm-afd")), *args]
    before = _stats_blocks()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300  # vLLM start-up: ~60 s idle, minutes when loaded
        while True:
            assert proc.poll() is None, _tail(tmp_path / "serve.log")
            try:
                if _get(f"{base}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, _tail(tmp_path / "serve.log")
            time.sleep(1)
        for prompt in ("hello world", "1 2 3 4", "the experts"):
            out = _post(
                f"{base}/v1/completions", {"model": tiny_qwen3, "prompt": prompt, "max_tokens": 8}
            )
            assert out["choices"][0]["text"] is not None
        status, text = _get(f"{base}/metrics")
        assert status == 200
        assert "vllm:" in text  # vLLM's own metrics are still there
        assert _value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
        tokens = sum(
            _value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=layer) for layer in (0, 1)
        )
        assert tokens > 0
        assert _value(text, "vllm_afd_ffn_service_seconds_count", ffn_rank=0) > 0
        assert _value(text, "vllm_afd_ffn_service_seconds_sum", ffn_rank=0) > 0
        assert _value(text, "vllm_afd_ffn_layer_service_seconds_sum", ffn_rank=0, layer=1) > 0
        assert _value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in") > 0
        # Attention-side series exist; they count once attention.py records round trips.
        sent = _value(text, "vllm_afd_dispatched_tokens_total", attention_rank=0, ffn_rank=0)
        if sent:
            assert sent == tokens  # 1:1: every token row went to the only FFN rank
            assert _value(text, "vllm_afd_exposed_ffn_seconds_count", attention_rank=0) > 0
            assert _value(
                text, "vllm_afd_transport_bytes_total", attention_rank=0, direction="sent"
            ) == _value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in")
        assert (
            _value(text, "vllm_afd_transport_errors_total", attention_rank=0, kind="timeout") == 0
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        finally:
            for child in session_processes(proc.pid):  # never leave any behind
                child.kill()
            log.close()
    left = [n for n in _stats_blocks() - before if _dead_writer(n)]
    assert not left, f"stats blocks left behind by the server: {left}"


def _dead_writer(name: str) -> bool:
    """Still there and its writer is gone (blocks of other live servers on the host are not)."""
    snapshot = metrics.read_block(name)
    return snapshot is not None and not snapshot.alive()


def _stats_blocks() -> set[str]:
    return {n for n in os.listdir(metrics.SHM_DIR) if n.startswith(metrics.PREFIX)}


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
