"""Helpers of the metrics tests: fake deployments, a writer process, scraping a collector."""

from __future__ import annotations

import os
import re
import uuid

from prometheus_client import CollectorRegistry, generate_latest

from vllm_afd.host import SHM_DIR
from vllm_afd.metrics.blocks import (
    AttentionStatsBlock,
    FFNStatsBlock,
    attention_block_name,
    ffn_block_name,
)
from vllm_afd.metrics.collector import AFDCollector

JOIN_TIMEOUT_S = 20.0
#: vLLM's labels on every AFD series (``metrics.collector``); ``value`` matches without them.
VLLM_LABELS = ("model_name", "engine")


def new_addresses(n: int) -> tuple[str, ...]:
    """Unique fake transport addresses (so parallel test runs never share block names)."""
    tag = uuid.uuid4().hex[:8]
    return tuple(f"test_{tag}_{f}" for f in range(n))


def spec_dict(addresses, num_attention: int) -> dict:
    return {
        "num_attention_ranks": num_attention,
        "num_ffn_ranks": len(addresses),
        "addresses": list(addresses),
    }


def our_blocks(addresses) -> list[str]:
    names = {ffn_block_name(a, f) for f, a in enumerate(addresses)}
    names |= {attention_block_name(addresses, a) for a in range(8)}
    return sorted(n for n in os.listdir(SHM_DIR) if n in names)


def scrape(spec) -> str:
    registry = CollectorRegistry()
    registry.register(AFDCollector(spec))
    return generate_latest(registry).decode()


def value(text: str, name: str, **labels) -> float:
    """The value of the one sample ``name{labels}`` in exposition ``text`` (``labels``: those
    the sample has, vLLM's ``model_name`` and ``engine`` aside unless given)."""
    wanted = {k: str(v) for k, v in labels.items()}
    found = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        has = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if {k: v for k, v in has.items() if k in wanted or k not in VLLM_LABELS} == wanted:
            found.append(float(match.group(3)))
    if len(found) != 1:
        raise KeyError(f"{name}{labels}: {len(found)} samples in output, expected one")
    return found[0]


def _writer_main(addresses, num_attention, ready, done) -> None:
    """Child: one FFN block and one attention block, some records, then wait."""
    ffn = FFNStatsBlock(addresses[0], 0, layers=[0, 1])
    ffn.record_layer(0, requests=2, tokens=10, bytes_in=1000, bytes_out=800, seconds=0.002)
    ffn.record_layer(1, requests=1, tokens=4, bytes_in=400, bytes_out=320, seconds=0.0003)
    ffn.record_layer(1, requests=1, tokens=6, bytes_in=600, bytes_out=480, seconds=3.0)
    attn = AttentionStatsBlock(addresses, num_attention - 1)
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


def start_writer(ctx, addresses, num_attention=2):
    """A child process writing one FFN and one attention block; returns (process, done)."""
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_writer_main, args=(addresses, num_attention, ready, done))
    proc.start()
    assert ready.wait(JOIN_TIMEOUT_S), "writer did not start"
    return proc, done


def stop(proc) -> None:
    proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(JOIN_TIMEOUT_S)
