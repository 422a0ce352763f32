"""The Prometheus collector: what a scrape reports, liveness, and the registries it joins."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.unit.metrics.metrics_testlib import (
    new_addresses,
    our_blocks,
    scrape,
    spec_dict,
    start_writer,
    stop,
    value,
)
from vllm_afd import envs
from vllm_afd.metrics import blocks, collector


def test_collector_output_and_alive_flips_when_ffn_process_dies(ctx):
    addresses = new_addresses(2)
    spec = spec_dict(addresses, num_attention=2)
    proc, _ = start_writer(ctx, addresses)
    try:
        text = scrape(spec)
        assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
        assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=1) == 0.0  # never started
        assert value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=1) == 10.0
        assert value(text, "vllm_afd_ffn_requests_total", ffn_rank=0) == 4.0
        assert value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in") == 2000.0
        assert value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="out") == 1600.0
        assert value(text, "vllm_afd_ffn_layer_service_seconds_count", ffn_rank=0, layer=1) == 2
        assert value(text, "vllm_afd_ffn_service_seconds_bucket", ffn_rank=0, le="0.0025") == 2.0
        assert value(text, "vllm_afd_ffn_service_seconds_bucket", ffn_rank=0, le="+Inf") == 3
        assert value(text, "vllm_afd_ffn_service_seconds_sum", ffn_rank=0) == pytest.approx(3.0023)
        # Attention rank 1 recorded; rank 0 has no block and reads zero.
        assert value(text, "vllm_afd_dispatched_tokens_total", attention_rank=1, ffn_rank=1) == 5
        assert value(text, "vllm_afd_dispatched_tokens_total", attention_rank=0, ffn_rank=0) == 0
        assert value(text, "vllm_afd_transport_bytes_total", attention_rank=1, direction="sent")
        assert value(text, "vllm_afd_transport_errors_total", attention_rank=1, kind="ffn_dead")
        assert value(text, "vllm_afd_transport_errors_total", attention_rank=1, kind="other") == 1
        assert value(text, "vllm_afd_exposed_ffn_seconds_count", attention_rank=1) == 2.0
        assert value(text, "vllm_afd_layer_exposed_ffn_seconds_count", attention_rank=1, layer=5)
        assert "# TYPE vllm_afd_ffn_service_seconds histogram" in text
        assert "# TYPE vllm_afd_transport_errors_total counter" in text

        os.kill(proc.pid, signal.SIGKILL)  # no clean-up: the blocks stay behind
        stop(proc)
        text = scrape(spec)
        assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 0.0
        assert value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=1) == 10.0  # kept
        assert len(our_blocks(addresses)) == 2
        reaped = blocks.reap_stale_blocks()  # as the next writer on this host would
        assert blocks.ffn_block_name(addresses[0], 0) in reaped
        assert blocks.attention_block_name(addresses, 1) in reaped
        assert our_blocks(addresses) == []
    finally:
        if proc.is_alive():
            proc.kill()
            stop(proc)
        blocks.unlink_deployment_blocks(spec)


def test_series_carry_vllms_model_name_and_engine_labels(monkeypatch):
    """``model_name`` on every series; ``engine`` (vLLM's engine index: the data-parallel rank
    in this front-end) on the attention side, empty for another front-end's ranks."""
    addresses = new_addresses(1)
    # this front-end: attention ranks 2..5 of the group, DP 2 x TP 2
    labels = collector.MetricLabels("qwen", 2, 4, tensor_parallel_size=2)
    monkeypatch.setenv(envs.FRONT_END, json.dumps(dataclasses.asdict(labels)))
    text = scrape(spec_dict(addresses, num_attention=6))
    sample = "vllm_afd_redispatched_requests_total"
    engines = {
        a: value(text, sample, attention_rank=a, model_name="qwen", engine=e)
        for a, e in [(0, ""), (1, ""), (2, 0), (3, 0), (4, 1), (5, 1)]
    }
    assert engines == dict.fromkeys(range(6), 0.0)
    assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0, model_name="qwen") == 0.0
    assert 'vllm_afd_ffn_rank_alive{ffn_rank="0",model_name="qwen"}' in text  # no engine there
    monkeypatch.setenv(envs.FRONT_END, "not json")  # unreadable: unlabelled, not broken
    assert (
        value(scrape(spec_dict(addresses, 1)), "vllm_afd_ffn_rank_alive", ffn_rank=0, model_name="")
        == 0
    )


def test_collector_reports_nothing_without_runtime(monkeypatch):
    monkeypatch.delenv(envs.RUNTIME, raising=False)
    registry = CollectorRegistry()
    registry.register(collector.AFDCollector())
    assert "vllm_afd_" not in generate_latest(registry).decode()


def test_patch_puts_collector_in_every_metrics_registry(monkeypatch, tmp_path):
    import prometheus_client
    from prometheus_client import multiprocess
    from vllm.v1.metrics import prometheus

    from vllm_afd.patches.metrics_registry import patch_metrics_registries

    patch_metrics_registries()
    patch_metrics_registries()  # idempotent
    addresses = new_addresses(1)
    monkeypatch.setenv(envs.RUNTIME, json.dumps(spec_dict(addresses, 1)))
    monkeypatch.setenv(envs.FRONT_END, json.dumps({"model_name": "tiny", "attention_ranks": 1}))
    block = blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    alive = 'vllm_afd_ffn_rank_alive{ffn_rank="0",model_name="tiny"} 1.0'
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
        for registered in list(prometheus_client.REGISTRY._collector_to_names):
            if isinstance(registered, collector.AFDCollector):
                prometheus_client.REGISTRY.unregister(registered)
        collector._REGISTERED.discard(prometheus_client.REGISTRY)


def test_a_rank_failover_gave_up_on_is_flagged(tmp_path):
    """``vllm_afd_ffn_rank_given_up`` (the alert of deploy/prometheus): from the FFN directory."""
    import socket

    from vllm_afd.transport import directory

    addresses = new_addresses(2)
    spec = {**spec_dict(addresses, num_attention=1), "directory": str(tmp_path)}
    entry = directory.RankEntry(1, 1, directory.FAILED, addresses[1], socket.gethostname(), 0)
    directory.publish(str(tmp_path), entry)
    text = scrape(spec)
    assert value(text, "vllm_afd_ffn_rank_given_up", ffn_rank=0) == 0.0
    assert value(text, "vllm_afd_ffn_rank_given_up", ffn_rank=1) == 1.0
