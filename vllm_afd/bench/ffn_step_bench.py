"""The FFN rank's host time per step when it serves whole announced steps (issue 41, item 4:
the host off the step boundary), on this machine's CPU:

    python -m vllm_afd.bench.ffn_step_bench [--attention-ranks 1 7] [--layers 48 94] \\
        [--json out.json]

On a GPU an FFN rank serving whole steps (``SteppedPlaneFFN``, the device's waits) replays
one CUDA graph per step shape, so the Python that remains per step is the executor's
``_serve_step`` around the replay: reading every attention rank's schedule from the control
block, the step's uses and its graph key, the end of the step, and the step's accounting.
It lies between an attention rank's announcement and the replay that serves it, so each
microsecond of it is a bubble in the FFN GPU's stream at every step.

Measured here with the real endpoint (host memory, ``waits: device``) and the real
``FFNExecutor._serve_step``, the replay stood in by a graph cache whose ``run`` returns at once
(a captured step's Python does not run on a replay); the attention ranks' announcements are
written into the control block before each step, outside the time. No expert is loaded (the
executor is built bare: ``_bare_executor``). The table prints the median and 90th percentile
per step in microseconds, and what folding the steps served into the stats costs once (the
executor does it every ``ACCOUNT_EVERY_S`` and when idle; "-" where a step took its own
accounting, before that); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_afd.ffn.executor import FFNExecutor, FFNStats
from vllm_afd.transport import TransportSpec, create_ffn_transport
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


def measure(attention_ranks: int, layers: int, microbatches: int, steps: int) -> dict[str, Any]:
    """Per-step host time of ``_serve_step`` for ``attention_ranks`` ranks announcing steps of
    ``layers`` MoE layers in ``microbatches`` microbatches (16 tokens each)."""
    moe_layers = tuple(range(3, 3 + layers))  # a dense prefix, as DeepSeek-V3's three
    spec = TransportSpec(
        backend="slots",
        num_attention_ranks=attention_ranks,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=64,
        top_k=2,
        max_tokens=16,
        num_slots=microbatches,
        moe_layers=moe_layers,
        config={"waits": "device"},
    )
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
    times = sorted(times[steps // 10 :])  # the first tenth warms up
    return {
        "attention_ranks": attention_ranks,
        "moe_layers": layers,
        "microbatches": microbatches,
        "steps": len(times),
        "median_us": statistics.median(times) * 1e6,
        "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6,
        "graph_keys": len(replays.shapes),
        "stats_fold_us": flush_us,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention-ranks", type=int, nargs="+", default=[1, 7])
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
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
