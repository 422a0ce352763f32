"""The host time per step on both sides of the plane when FFN ranks serve whole announced steps
(issue 41, item 4: the host off the step boundary), on this machine's CPU:

    python -m vllm_afd.bench.ffn_step_bench [--attention-ranks 1 7] [--ffn-ranks 1 4] \\
        [--layers 48 94] [--json out.json]

On a GPU an FFN rank serving whole steps (``SteppedPlaneFFN``, the device's waits) replays
one CUDA graph per step shape, so the Python that remains per step is the executor's
``_serve_step`` around the replay: reading every attention rank's schedule from the control
block, the step's uses and its graph key, the end of the step, and the step's accounting.
It lies between an attention rank's announcement and the replay that serves it, so each
microsecond of it is a bubble in the FFN GPU's stream at every step. On the attention side
the announcement itself (``begin_step``: into every FFN rank's control block) comes before
each replay of the attention rank's own graph (patch G1).

Measured here with the real endpoints (host memory, ``waits: device``): the FFN side's
``FFNExecutor._serve_step``, the replay stood in by a graph cache whose ``run`` returns at
once (a captured step's Python does not run on a replay), the attention ranks' announcements
written into the control block before each step, outside the time, no expert loaded (the
executor is built bare: ``_bare_executor``); the attention side's ``begin_step`` to
``--ffn-ranks`` FFN ranks, which take each step outside the time. The tables print the
median and 90th percentile per step in microseconds, and for the FFN side what folding the
steps served into the stats costs once (the executor does it every ``ACCOUNT_EVERY_S`` and
when idle; "-" where a step took its own accounting, before that); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_afd.ffn.executor import FFNExecutor, FFNStats
from vllm_afd.transport import TransportSpec, create_attention_transport, create_ffn_transport
from vllm_afd.transport.base import ServesSteps
from vllm_afd.transport.control import StepSchedule
from vllm_afd.transport.control_block import ControlBlock


class _Replays:
    """Stands in for ``StepGraphs`` once every shape is captured: a replay runs no Python."""

    def __init__(self) -> None:
        self.shapes: dict[Any, int] = defaultdict(int)

    def run(self, shape: Any, step: Callable[[], None]) -> None:
        self.shapes[shape] += 1


def _bare_executor(spec: TransportSpec, transport: ServesSteps, replays: _Replays) -> FFNExecutor:
    """An ``FFNExecutor`` with the fields ``_serve_step`` reads and no experts."""
    executor = FFNExecutor.__new__(FFNExecutor)
    executor.spec, executor.rank = spec, 0
    executor.transport = transport  # type: ignore[assignment]
    executor.stats = FFNStats()
    executor._routing_bytes = spec.top_k * 8
    executor._fault_file = None
    executor.graphs = replays  # type: ignore[assignment]
    executor._unaccounted, executor._accounted_at = {}, -math.inf
    return executor


def _spec(attention_ranks: int, ffn_ranks: int, layers: int, microbatches: int) -> TransportSpec:
    """The slots plane with the device's waits; ``layers`` MoE layers after a dense prefix of
    three (as DeepSeek-V3's)."""
    return TransportSpec(
        backend="slots",
        num_attention_ranks=attention_ranks,
        num_ffn_ranks=ffn_ranks,
        num_experts=8 * ffn_ranks,
        hidden_size=64,
        top_k=2,
        max_tokens=16,
        num_slots=microbatches,
        moe_layers=tuple(range(3, 3 + layers)),
        config={"waits": "device"},
    )


def _summary(times: list[float]) -> dict[str, Any]:
    """Steps measured, median and 90th percentile in microseconds (the first tenth warms up)."""
    kept = sorted(times[len(times) // 10 :])
    return {
        "steps": len(kept),
        "median_us": statistics.median(kept) * 1e6,
        "p90_us": kept[int(0.9 * (len(kept) - 1))] * 1e6,
    }


def measure(attention_ranks: int, layers: int, microbatches: int, steps: int) -> dict[str, Any]:
    """Per-step host time of ``_serve_step`` for ``attention_ranks`` ranks announcing steps of
    ``layers`` MoE layers in ``microbatches`` microbatches (16 tokens each)."""
    spec = _spec(attention_ranks, 1, layers, microbatches)
    moe_layers = spec.moe_layers
    transport = create_ffn_transport(spec, 0)
    assert isinstance(transport, ServesSteps)
    replays = _Replays()
    executor = _bare_executor(spec, transport, replays)
    layout = transport.plane.layout  # type: ignore[attr-defined]
    block = ControlBlock.attach(transport.address, layout, moe_layers)
    tokens = (16,) * microbatches
    times = []
    try:
        for step in range(1, steps + 1):
            for a in range(attention_ranks):
                block.announce(a, StepSchedule(step, tokens, moe_layers))
            start = time.perf_counter()
            executor._serve_step(transport, 1.0)
            times.append(time.perf_counter() - start)
        flush_us = None  # folding the steps since the last fold into the stats, once
        if getattr(executor, "_unaccounted", None):
            start = time.perf_counter()
            executor._account_steps()
            flush_us = (time.perf_counter() - start) * 1e6
    finally:
        block.close()
        transport.close()
    return {
        "attention_ranks": attention_ranks,
        "moe_layers": layers,
        "microbatches": microbatches,
        **_summary(times),
        "graph_keys": len(replays.shapes),
        "stats_fold_us": flush_us,
    }


def measure_announce(ffn_ranks: int, layers: int, microbatches: int, steps: int) -> dict[str, Any]:
    """Per-step host time of an attention rank's ``begin_step`` to ``ffn_ranks`` FFN ranks, for
    steps of ``layers`` MoE layers in ``microbatches`` microbatches (16 tokens each)."""
    spec = _spec(1, ffn_ranks, layers, microbatches)
    moe_layers = spec.moe_layers
    ffns = [create_ffn_transport(spec, f) for f in range(ffn_ranks)]
    endpoint = create_attention_transport(
        dataclasses.replace(spec, addresses=tuple(f.address for f in ffns)), 0
    )
    tokens = (16,) * microbatches
    times = []
    try:
        for step in range(1, steps + 1):
            schedule = StepSchedule(step, tokens, moe_layers)
            start = time.perf_counter()
            endpoint.begin_step(schedule)
            times.append(time.perf_counter() - start)
            for ffn in ffns:  # each FFN rank takes the step (its ring stays free)
                assert isinstance(ffn, ServesSteps)
                ffn.next_step(1.0)
                ffn.end_step()
    finally:
        endpoint.close()
        for ffn in ffns:
            ffn.close()
    return {
        "ffn_ranks": ffn_ranks,
        "moe_layers": layers,
        "microbatches": microbatches,
        **_summary(times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention-ranks", type=int, nargs="+", default=[1, 7])
    parser.add_argument("--ffn-ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, nargs="+", default=[48, 94])
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [
        measure(a, n, args.microbatches, args.steps)
        for a in args.attention_ranks
        for n in args.layers
    ]
    print(
        "| attention ranks | MoE layers | microbatches | median us/step | p90 us/step "
        "| stats fold us |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        fold = "-" if r["stats_fold_us"] is None else f"{r['stats_fold_us']:.0f}"
        print(
            f"| {r['attention_ranks']} | {r['moe_layers']} | {r['microbatches']} | "
            f"{r['median_us']:.0f} | {r['p90_us']:.0f} | {fold} |"
        )
    announce = [
        measure_announce(f, n, args.microbatches, args.steps)
        for f in args.ffn_ranks
        for n in args.layers
    ]
    print("\n| FFN ranks | MoE layers | microbatches | announce median us | p90 us |")
    print("|---|---|---|---|---|")
    for r in announce:
        print(
            f"| {r['ffn_ranks']} | {r['moe_layers']} | {r['microbatches']} | "
            f"{r['median_us']:.1f} | {r['p90_us']:.1f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "announce": announce}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
