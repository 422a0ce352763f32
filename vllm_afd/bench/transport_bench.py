"""Transport micro-benchmark: per-layer dispatch + combine round trip beside the copy floor.

    python -m vllm_afd.bench.transport_bench [--json out.json] [--tokens 1 8 64] [--hidden 4096]

Setup. One attention rank (this process) and one FFN rank (a child process running the reference
FFN loop with ``EchoForward``: ``out = x * 2``, no expert compute), ``F = 1`` so every token
travels, ``top_k`` routing ids and weights riding along. Each process uses one PyTorch thread and,
by default, its own CPU (``--no-pin`` leaves placement to the scheduler: on two cores it then
often puts both on one CPU and every round trip pays for a context switch).

Measured. The wall time of ``combine(dispatch(layer, x, topk_ids, topk_weights))`` per iteration
(median and p90 after a warm-up), and the ``dispatch`` part alone.

Memory-copy floor. The same bytes copied the same number of times, in this process, with no
other work: four ``Tensor.copy_`` calls between preallocated uint8 buffers,

    1. request in    x | topk_ids | topk_weights  -> request buffer   T * (H * itemsize + 8 K) B
    2. request out   request buffer -> FFN-side tensor                 same
    3. answer in     FFN answer -> response buffer                     T * H * itemsize B
    4. answer out    response buffer -> result                          same

It includes PyTorch's per-call overhead (about 1 us a copy here), as a transport's copies do, but
no cross-process signalling, no cross-core cache-line transfers and no echo compute (reported on
its own as ``echo``: ``x * 2`` in this process). ``ratio`` = round-trip median / floor median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from vllm_afd.transport import TransportSpec, create_attention_transport
from vllm_afd.transport.reference import EchoForward, ffn_worker_main

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 512)
DEFAULT_HIDDEN = (128, 1024, 4096)
#: Messages up to this many tokens count as decode-sized in the summary.
DECODE_TOKENS = 64
_START_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vllm_afd.bench.transport_bench",
        description=("Round-trip latency of the CPU AFD transports against the memory-copy floor."),
    )
    p.add_argument("--backends", nargs="+", default=["shm", "tcp"], metavar="NAME")
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS), metavar="T")
    p.add_argument(
        "--hidden",
        "--sizes",
        nargs="+",
        type=int,
        default=list(DEFAULT_HIDDEN),
        metavar="H",
        help="hidden sizes (--sizes is an alias)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seconds", type=float, default=0.4, help="measuring time per point")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the attention and FFN processes to different CPUs",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(step: Callable[[], None], seconds: float, min_iters: int = 20) -> list[float]:
    """Per-call wall times (s) of ``step`` after a warm-up, for about ``seconds``."""
    for _ in range(10):
        step()
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while len(samples) < min_iters or (time.perf_counter() < end and len(samples) < 20000):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples


def copy_floor(
    num_tokens: int, hidden: int, dtype: torch.dtype, top_k: int, seconds: float
) -> list[float]:
    """Times of the four copies of one round trip (module docstring), in seconds."""
    request = num_tokens * (hidden * dtype.itemsize + 8 * top_k)
    response = num_tokens * hidden * dtype.itemsize
    src, req_buf, ffn_buf = (torch.ones(request, dtype=torch.uint8) for _ in range(3))
    answer, resp_buf, result = (torch.ones(response, dtype=torch.uint8) for _ in range(3))

    def round_trip() -> None:
        req_buf.copy_(src)
        ffn_buf.copy_(req_buf)
        resp_buf.copy_(answer)
        result.copy_(resp_buf)

    return _timed(round_trip, seconds / 2)


def _ffn_main(spec: TransportSpec, cpu: int | None, conn, stop_event) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ffn_worker_main(spec, 0, EchoForward(2.0), conn, stop_event, num_threads=1)


class EchoFFN:
    """The FFN rank in a child process; ``spec`` carries its address once started."""

    def __init__(self, ctx, spec: TransportSpec, cpu: int | None) -> None:
        self.stop_event = ctx.Event()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_ffn_main, args=(spec, cpu, child, self.stop_event), daemon=True
        )
        self.proc.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"{spec.backend} FFN rank did not start")
        self.spec = dataclasses.replace(spec, addresses=(parent.recv(),))

    def close(self) -> None:
        self.stop_event.set()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def measure_point(att, spec: TransportSpec, num_tokens: int, seconds: float) -> dict:
    """Round trip, dispatch-only and floor timings for one ``[T, H]`` message size."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(spec.dtype)
    ids = torch.randint(0, spec.num_experts, (num_tokens, spec.top_k), generator=gen)
    weights = torch.full((num_tokens, spec.top_k), 1.0 / spec.top_k)
    out = att.combine(att.dispatch(0, x, ids, weights))
    if not torch.equal(out, x * 2):
        raise AssertionError(f"{spec.backend}: echo mismatch at T={num_tokens}")
    dispatch_times: list[float] = []

    def round_trip() -> None:
        start = time.perf_counter()
        handle = att.dispatch(0, x, ids, weights)
        dispatch_times.append(time.perf_counter() - start)
        att.combine(handle)

    rt = _timed(round_trip, seconds)
    floor = copy_floor(num_tokens, spec.hidden_size, spec.dtype, spec.top_k, seconds)
    echo = _timed(lambda: x * 2.0, seconds / 4)
    us = 1e6
    return {
        "backend": spec.backend,
        "tokens": num_tokens,
        "hidden": spec.hidden_size,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "request_bytes": num_tokens * (spec.hidden_size * spec.dtype.itemsize + 8 * spec.top_k),
        "response_bytes": num_tokens * spec.hidden_size * spec.dtype.itemsize,
        "iters": len(rt),
        "rt_median_us": statistics.median(rt) * us,
        "rt_p90_us": _percentile(rt, 0.9) * us,
        "dispatch_median_us": statistics.median(dispatch_times) * us,
        "floor_median_us": statistics.median(floor) * us,
        "floor_p90_us": _percentile(floor, 0.9) * us,
        "echo_median_us": statistics.median(echo) * us,
    }


def run_backend(ctx, backend: str, args: argparse.Namespace, cpus: list[int] | None) -> list:
    """Every (hidden, tokens) point of one backend, one FFN process per hidden size."""
    results = []
    for hidden in args.hidden:
        spec = TransportSpec(
            backend=backend,
            num_attention_ranks=1,
            num_ffn_ranks=1,
            num_experts=64,
            hidden_size=hidden,
            top_k=args.top_k,
            max_tokens=max(args.tokens),
            dtype=getattr(torch, args.dtype),
            num_slots=2,
            timeout_s=30.0,
        )
        ffn = EchoFFN(ctx, spec, cpus[1] if cpus else None)
        att = create_attention_transport(ffn.spec, 0)
        try:
            for num_tokens in args.tokens:
                row = measure_point(att, ffn.spec, num_tokens, args.seconds)
                row["ratio"] = row["rt_median_us"] / row["floor_median_us"]
                results.append(row)
                print(format_row(row), flush=True)
        finally:
            att.close()
            ffn.close()
    return results


_COLUMNS = (
    "backend",
    "tokens",
    "hidden",
    "KiB",
    "rt_med_us",
    "rt_p90_us",
    "dispatch_us",
    "floor_us",
    "echo_us",
    "ratio",
)


def format_row(row: dict) -> str:
    kib = (row["request_bytes"] + row["response_bytes"]) / 1024
    cells = (
        row["backend"],
        row["tokens"],
        row["hidden"],
        f"{kib:.1f}",
        f"{row['rt_median_us']:.1f}",
        f"{row['rt_p90_us']:.1f}",
        f"{row['dispatch_median_us']:.1f}",
        f"{row['floor_median_us']:.1f}",
        f"{row['echo_median_us']:.1f}",
        f"{row['ratio']:.2f}",
    )
    return "  ".join(f"{c:>11}" for c in cells)


def summarize(results: list[dict]) -> dict:
    """Per backend: worst and median ratio over decode-sized messages (T <= DECODE_TOKENS)."""
    summary = {}
    for backend in sorted({r["backend"] for r in results}):
        ratios = [
            r["ratio"] for r in results if r["backend"] == backend and r["tokens"] <= DECODE_TOKENS
        ]
        if ratios:
            summary[backend] = {
                "decode_max_ratio": max(ratios),
                "decode_median_ratio": statistics.median(ratios),
            }
    return summary


def _machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2] if args.pin and len(allowed) >= 2 else None
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm_afd.transport.reference"])
    print("  ".join(f"{c:>11}" for c in _COLUMNS))
    results = []
    try:
        for backend in args.backends:
            results += run_backend(ctx, backend, args, cpus)
    finally:
        os.sched_setaffinity(0, allowed)
    summary = summarize(results)
    for backend, s in summary.items():
        print(
            f"{backend}: decode-sized (T <= {DECODE_TOKENS}) ratio to copy floor: "
            f"median {s['decode_median_ratio']:.2f}, worst {s['decode_max_ratio']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "machine": _machine(),
                    "args": vars(args),
                    "pinned_cpus": cpus,
                    "summary": summary,
                    "results": results,
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
