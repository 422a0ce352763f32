"""FFN-rank kernel and memory benchmark: the FFN service against vLLM's colocated MoE kernel.

    python -m vllm_afd.bench.ffn_kernel_bench [--tokens 1 16 64 256] [--ffn-ranks 1 2]
                                              [--memory] [--out bench.json]

**Kernel table** (default). One tiny random MoE model (``bench/tiny_models.py``, by default a
Qwen3-MoE of hidden 1024, 32 experts of 512, top-8, 2 layers, float32: 201 MiB of experts per
layer, so the expert GEMMs dominate every per-call overhead). In one process, on the same
tokens, routing and checkpoint:

* ``colocated``: the model loaded the way a stock vLLM worker loads it (``get_model``, no AFD:
  the plugin's layers are vLLM's when ``additional_config`` has no ``afd``), and each MoE
  layer's ``RoutedExperts.forward_modular(x, topk_weights, topk_ids)``, the call vLLM's
  ``MoERunner`` makes after ``select_experts``: the layer's quant method, all experts, no
  expert parallelism.
* ``ffn F=1``: ``ExpertKernel`` over the layers of FFN rank 0 of 1
  (``ffn.weights.load_routed_experts``), exactly what an FFN rank computes per request.
* ``ffn F=2``: both ranks of 2, each its share; per call the slower rank (``max``, the service
  time with the ranks in parallel) and both together (``sum``, the work).

Per token count the rows take every call in turn (the paths rotate their order from repeat to
repeat, the MoE layers alternate as in a decode, so caches and the VM's drift treat them
alike); each time is the median over ``--repeats`` calls per layer after ``--warmup``. The
ratios are FFN / colocated. Before anything is timed the FFN outputs are checked against the
colocated output: F = 1 must be bit-identical when the kernels are (``exact``), else within
``_tolerance`` of the largest output value; so must F = 2's shares, summed. A mismatch stops
the run: no
number is reported for a path that computes something else.

**Memory table** (``--memory``). Per FFN rank count F, FFN rank 0 loads its experts
(``load_routed_experts``) in a fresh process. With vLLM imported and the engine config built,
the process resets its peak RSS (``/proc/self/clear_refs`` 5: VmHWM := VmRSS; without it
``ru_maxrss``, whose peak then includes the imports) and reads the RSS; after loading, the
peak (VmHWM) minus that RSS is the loading peak, set against the bytes of the expert
parameters the rank holds (``ffn.weights.expert_bytes``). A thread samples anonymous and
file-backed RSS every few milliseconds and the loader's phases are marked (NaN fill,
checkpoint read, per-layer ``process_weights_after_loading``), so the table says in which phase
the peak falls and how much of it is the checkpoint's mapped file pages (``file``) rather than
allocated memory (``anon``).

Numbers measured here: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_TOKENS = (1, 16, 64, 256)
DEFAULT_FFN_RANKS = (1, 2)
#: The default model: experts dominate both the kernel's time and the rank's memory.
DEFAULT_MODEL = {
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "top_k": 8,
    "num_layers": 2,
    "dtype": "float32",
}
#: The FFN F = 1 service time target against the colocated kernel (issue 10, item 7).
TARGET_RATIO = 1.1
#: Peak loading memory target against the rank's expert bytes (issue 10, item 5).
TARGET_MEMORY = 1.2
_CHILD_MARK = "FFN_MEMORY_RESULT "
_SAMPLE_S = 0.002
_MiB = 2**20


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vllm_afd.bench.ffn_kernel_bench",
        description="FFN-rank expert service time against vLLM's colocated MoE kernel, and an "
        "FFN rank's peak memory while loading against its expert bytes.",
    )
    p.add_argument("--model", help="checkpoint directory (default: build the tiny model below)")
    p.add_argument("--hidden-size", type=int, default=DEFAULT_MODEL["hidden_size"])
    p.add_argument(
        "--moe-intermediate-size", type=int, default=DEFAULT_MODEL["moe_intermediate_size"]
    )
    p.add_argument("--num-experts", type=int, default=DEFAULT_MODEL["num_experts"])
    p.add_argument("--top-k", type=int, default=DEFAULT_MODEL["top_k"])
    p.add_argument("--num-layers", type=int, default=DEFAULT_MODEL["num_layers"])
    p.add_argument("--dtype", default=DEFAULT_MODEL["dtype"], choices=["float32", "bfloat16"])
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS), metavar="T")
    p.add_argument(
        "--ffn-ranks",
        nargs="+",
        type=int,
        default=list(DEFAULT_FFN_RANKS),
        metavar="F",
        help="FFN rank counts (each must divide the experts)",
    )
    p.add_argument("--threads", type=int, default=1, help="PyTorch threads (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per layer and path")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per layer and path")
    p.add_argument("--memory", action="store_true", help="also measure loading memory")
    p.add_argument("--no-kernel", dest="kernel", action="store_false", help="skip the kernels")
    p.add_argument("--out", "--json", dest="out", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    for f in args.ffn_ranks:
        if f < 1 or args.num_experts % f:
            p.error(f"--ffn-ranks {f} must divide --num-experts {args.num_experts}")
    if min(args.tokens) < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--tokens, --repeats and --threads must be >= 1, --warmup >= 0")
    return args


def bench_model(args: argparse.Namespace) -> Path:
    """``--model``, or the tiny model of the arguments (built once, cached)."""
    if args.model:
        return Path(args.model)
    from vllm_afd.bench.tiny_models import default_tiny_model

    return default_tiny_model(
        arch="qwen3_moe",
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        num_layers=args.num_layers,
        dtype=args.dtype,
    )


def model_info(model_dir: Path):
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    return moe_model_info(AutoConfig.from_pretrained(model_dir))


# ----------------------------------------------------------------------------- kernels


@contextlib.contextmanager
def _cpu_accelerator_noop() -> Iterator[None]:
    """vLLM's loader calls ``torch.accelerator.empty_cache``, which raises on a host without an
    accelerator; vLLM's CPU model runner makes it a no-op for the same reason. Restored after."""
    import torch

    if torch.accelerator.is_available():
        yield
        return
    saved = torch.accelerator.empty_cache
    torch.accelerator.empty_cache = lambda *a, **k: None
    try:
        yield
    finally:
        torch.accelerator.empty_cache = saved


def colocated_layers(model_dir: Path, dtype) -> dict:
    """Layer number -> the ``RoutedExperts`` of the model as stock vLLM loads it (all experts,
    no expert parallelism), and the vLLM config it was built under."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_afd.ffn import weights

    config = weights.engine_config(model_dir, dtype)
    with set_current_vllm_config(config), _cpu_accelerator_noop():
        weights._ensure_world()
        model = get_model(vllm_config=config)
    layers = {
        extract_layer_index(name): module
        for name, module in model.named_modules()
        if isinstance(module, RoutedExperts)
    }
    if not layers:
        raise ValueError(f"{model_dir}: the model has no routed-expert layers")
    return dict(sorted(layers.items()))


def routing(tokens: int, hidden: int, num_experts: int, top_k: int, dtype, seed: int):
    """``x [T, H]``, distinct ``topk_ids [T, K]`` (int32) and normalised float32 weights."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    scores = torch.rand(tokens, num_experts, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, ids, (weights / weights.sum(-1, keepdim=True)).float()


def _tolerance(dtype) -> float:
    """Largest error allowed, relative to the largest output value (sums of shares round)."""
    import torch

    return 1e-6 if dtype == torch.float32 else 2e-2


def check_outputs(
    colocated: Callable, ffn: dict[int, list[Callable]], layers, tokens: int, info, dtype
) -> dict[int, bool]:
    """Per FFN rank count: True if its output equals the colocated one bit for bit, False if
    only within ``_tolerance`` of the largest output value (float rounding of a sum of shares).
    Raises AssertionError otherwise."""
    import torch

    exact: dict[int, bool] = {}
    tol = _tolerance(dtype)
    for layer in layers:
        x, ids, w = routing(tokens, info.hidden_size, info.num_experts, info.top_k, dtype, 7)
        want = colocated(layer, x, ids, w)
        if not want.abs().max() > 0:
            raise AssertionError(f"layer {layer}: the colocated output is all zeros")
        for f, kernels in ffn.items():
            got = kernels[0](layer, x, ids, w)
            for kernel in kernels[1:]:
                got = got + kernel(layer, x, ids, w)
            same = torch.equal(got, want)
            err = (got.float() - want.float()).abs().max().item()
            if not same and err > tol * want.abs().max().item():
                raise AssertionError(
                    f"FFN F={f} layer {layer} T={tokens}: output differs from the colocated "
                    f"kernel's (max abs error {err:.3g}); refusing to time a different result"
                )
            exact[f] = exact.get(f, True) and same
    return exact


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_point(
    colocated: Callable,
    ffn: dict[int, list[Callable]],
    layers: list[int],
    tokens: int,
    info,
    dtype,
    warmup: int,
    repeats: int,
) -> dict:
    """Median per-layer-call times (us) of every path for ``tokens`` tokens.

    Each repeat calls every path once per MoE layer; the paths' order rotates between
    repeats. F > 1: per call the slowest rank and the sum of the ranks."""
    x, ids, w = routing(tokens, info.hidden_size, info.num_experts, info.top_k, dtype, tokens)
    paths: list[tuple[str, Callable]] = [("colocated", colocated)]
    paths += [(f"ffn{f}", kernels) for f, kernels in ffn.items()]
    samples: dict[str, list[float]] = {"colocated": []}
    for f in ffn:
        samples[f"ffn{f}_max"], samples[f"ffn{f}_sum"] = [], []
    for rep in range(warmup + repeats):
        order = paths[rep % len(paths) :] + paths[: rep % len(paths)]
        for layer in layers:
            for name, path in order:
                kernels = [path] if name == "colocated" else path
                dt = [_timed(lambda k=k, n=layer: k(n, x, ids, w)) for k in kernels]
                if rep < warmup:
                    continue
                if name == "colocated":
                    samples[name].append(dt[0])
                else:
                    samples[f"{name}_max"].append(max(dt))
                    samples[f"{name}_sum"].append(sum(dt))
    return {key: statistics.median(v) * 1e6 for key, v in samples.items()}


def run_kernels(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    """The kernel table's rows, one per token count."""
    import torch

    from vllm_afd.ffn.executor import ExpertKernel
    from vllm_afd.ffn.weights import expert_bytes, load_routed_experts

    dtype = getattr(torch, args.dtype)
    info = model_info(model_dir)
    coloc_layers = colocated_layers(model_dir, dtype)
    moe_layers = list(coloc_layers)

    def colocated(layer, x, ids, w):
        return coloc_layers[layer].forward_modular(x, w, ids)

    ffn: dict[int, list[Callable]] = {}
    held: dict[int, int] = {}
    for f in args.ffn_ranks:
        ranks = [load_routed_experts(model_dir, r, f, dtype) for r in range(f)]
        held[f] = max(expert_bytes(layers) for layers in ranks)
        ffn[f] = [ExpertKernel(layers) for layers in ranks]
        if sorted(ranks[0]) != moe_layers:
            raise AssertionError(f"F={f}: FFN layers {sorted(ranks[0])}, colocated {moe_layers}")
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            exact = check_outputs(colocated, ffn, moe_layers, tokens, info, dtype)
            t = time_point(
                colocated, ffn, moe_layers, tokens, info, dtype, args.warmup, args.repeats
            )
            row = {"tokens": tokens, "colocated_us": t["colocated"]}
            for f in ffn:
                row[f"ffn{f}_max_us"] = t[f"ffn{f}_max"]
                row[f"ffn{f}_sum_us"] = t[f"ffn{f}_sum"]
                row[f"ffn{f}_max_ratio"] = t[f"ffn{f}_max"] / t["colocated"]
                row[f"ffn{f}_sum_ratio"] = t[f"ffn{f}_sum"] / t["colocated"]
                row[f"ffn{f}_exact"] = exact[f]
                row[f"ffn{f}_expert_bytes"] = held[f]
            rows.append(row)
            print(format_kernel_row(row, list(ffn)), flush=True)
    return rows


def kernel_header(ffn_ranks: list[int]) -> str:
    cells = ["T", "colocated us"]
    for f in ffn_ranks:
        cells += (
            [f"F={f} us", f"F={f} x", "exact"]
            if f == 1
            else [
                f"F={f} max us",
                f"F={f} max x",
                f"F={f} sum us",
                f"F={f} sum x",
            ]
        )
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def format_kernel_row(row: dict, ffn_ranks: list[int]) -> str:
    cells = [str(row["tokens"]), f"{row['colocated_us']:.1f}"]
    for f in ffn_ranks:
        if f == 1:
            exact = "yes" if row["ffn1_exact"] else "allclose"
            cells += [f"{row['ffn1_max_us']:.1f}", f"{row['ffn1_max_ratio']:.3f}", exact]
        else:
            cells += [
                f"{row[f'ffn{f}_max_us']:.1f}",
                f"{row[f'ffn{f}_max_ratio']:.3f}",
                f"{row[f'ffn{f}_sum_us']:.1f}",
                f"{row[f'ffn{f}_sum_ratio']:.3f}",
            ]
    return "| " + " | ".join(cells) + " |"


# ----------------------------------------------------------------------------- memory


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, bytes (0 where absent)."""
    out = dict.fromkeys(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"), 0)
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    """VmHWM := VmRSS (Linux clear_refs 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Sampler:
    """RSS (anon, file) every ``_SAMPLE_S`` on a thread, and phase marks; peaks per phase."""

    def __init__(self) -> None:
        self.phase = "start"
        self.peaks: dict[str, dict[str, int]] = {}
        self.order: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, phase: str) -> None:
        with self._lock:
            self._sample()
            self.phase = phase
            self._sample()

    def _sample(self) -> None:
        s = _status()
        peak = self.peaks.get(self.phase)
        if peak is None:
            self.order.append(self.phase)
            peak = self.peaks[self.phase] = {"rss": 0, "anon": 0, "file": 0}
        peak["rss"] = max(peak["rss"], s["VmRSS"])
        peak["anon"] = max(peak["anon"], s["RssAnon"])
        peak["file"] = max(peak["file"], s["RssFile"] + s["RssShmem"])

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            with self._lock:
                self._sample()

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.mark("end")


def _instrument(weights, sampler: _Sampler) -> Callable[[], None]:
    """Phase marks in ``ffn.weights``' steps, this process only; returns the undo."""
    saved = {n: getattr(weights, n) for n in ("_materialise", "_checkpoint", "_check_loaded")}
    read = saved["_checkpoint"]

    def materialise(layer, device):
        if sampler.phase != "nan_fill":
            sampler.mark("nan_fill")
        return saved["_materialise"](layer, device)

    def checkpoint(model_dir, local):
        sampler.mark("read_checkpoint")
        yield from read(model_dir, local)
        sampler.mark("checkpoint_closed")

    processed = [0]

    def check_loaded(name, layer):
        processed[0] += 1
        sampler.mark(f"process_layer_{processed[0]}")  # process_weights_after_loading follows
        return saved["_check_loaded"](name, layer)

    weights._materialise = materialise
    weights._checkpoint = checkpoint
    weights._check_loaded = check_loaded

    def undo() -> None:
        for name, fn in saved.items():
            setattr(weights, name, fn)

    return undo


def memory_child(model_dir: str, rank: int, num_ranks: int, dtype_name: str, threads: int) -> None:
    """In a fresh process: FFN rank ``rank`` of ``num_ranks`` loads its experts; prints one
    JSON line (``_CHILD_MARK``) with the RSS before, the peak and after, and per-phase peaks."""
    import resource

    import torch
    import vllm  # noqa: F401  (imported before the baseline, as the brief's protocol says)

    from vllm_afd.ffn import weights

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    weights.engine_config(model_dir, dtype)  # built once: its imports are in the baseline
    gc.collect()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset = _reset_peak()
    before = _status()
    sampler = _Sampler()
    undo = _instrument(weights, sampler)
    start = time.perf_counter()
    with sampler:
        layers = weights.load_routed_experts(model_dir, rank, num_ranks, dtype)
    load_s = time.perf_counter() - start
    undo()
    gc.collect()
    after = _status()
    peak = after["VmHWM"] if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "rank": rank,
        "num_ranks": num_ranks,
        "expert_bytes": weights.expert_bytes(layers),
        "layers": len(layers),
        "rss_before": before["VmRSS"],
        "anon_before": before["RssAnon"],
        "file_before": before["RssFile"] + before["RssShmem"],
        "peak_rss": peak,
        "peak_source": "VmHWM after clear_refs" if reset else "ru_maxrss",
        "maxrss_before": maxrss_before,
        "rss_after": after["VmRSS"],
        "anon_after": after["RssAnon"],
        "load_s": load_s,
        "phases": [{"phase": p, **sampler.peaks[p]} for p in sampler.order],
    }
    print(_CHILD_MARK + json.dumps(result), flush=True)


def measure_memory(model_dir: Path, num_ranks: int, args: argparse.Namespace) -> dict:
    """``memory_child`` for FFN rank 0 of ``num_ranks`` in a fresh interpreter; its row."""
    code = (
        "import sys; from vllm_afd.bench.ffn_kernel_bench import memory_child; "
        "memory_child(sys.argv[1], 0, int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))"
    )
    cmd = [sys.executable, "-c", code, str(model_dir), str(num_ranks), args.dtype]
    cmd += [str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_CHILD_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"memory child (F={num_ranks}) failed with status {proc.returncode}:\n"
            + proc.stderr[-3000:]
        )
    r = json.loads(lines[-1][len(_CHILD_MARK) :])
    w = r["expert_bytes"]
    r["peak_delta"] = r["peak_rss"] - r["rss_before"]
    r["after_delta"] = r["rss_after"] - r["rss_before"]
    r["peak_ratio"] = r["peak_delta"] / w
    r["after_ratio"] = r["after_delta"] / w
    top = max(r["phases"], key=lambda p: p["rss"])
    r["peak_phase"] = top["phase"]
    r["peak_phase_anon_delta"] = top["anon"] - r["anon_before"]
    r["peak_phase_file_delta"] = top["file"] - r["file_before"]
    r["peak_anon_delta"] = max(p["anon"] for p in r["phases"]) - r["anon_before"]
    r["peak_anon_ratio"] = r["peak_anon_delta"] / w
    return r


MEMORY_HEADER = (
    "| F | expert MiB | before MiB | peak +MiB | peak / experts | anon peak +MiB | "
    "anon / experts | after +MiB | peak phase (anon + file +MiB) | load s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_memory_row(r: dict) -> str:
    mib = _MiB
    cells = (
        str(r["num_ranks"]),
        f"{r['expert_bytes'] / mib:.1f}",
        f"{r['rss_before'] / mib:.0f}",
        f"{r['peak_delta'] / mib:.1f}",
        f"{r['peak_ratio']:.2f}",
        f"{r['peak_anon_delta'] / mib:.1f}",
        f"{r['peak_anon_ratio']:.2f}",
        f"{r['after_delta'] / mib:.1f}",
        f"{r['peak_phase']} ({r['peak_phase_anon_delta'] / mib:.0f} + "
        f"{r['peak_phase_file_delta'] / mib:.0f})",
        f"{r['load_s']:.1f}",
    )
    return "| " + " | ".join(cells) + " |"


# ----------------------------------------------------------------------------- main


def _machine() -> dict:
    import torch

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = bench_model(args)
    info = model_info(model_dir)
    result: dict = {
        "machine": _machine(),
        "args": vars(args),
        "model": {
            "dir": str(model_dir),
            "hidden_size": info.hidden_size,
            "num_experts": info.num_experts,
            "top_k": info.top_k,
            "moe_layers": list(info.moe_layers),
        },
        "targets": {"ffn1_ratio": TARGET_RATIO, "memory_ratio": TARGET_MEMORY},
    }
    print(
        f"model {model_dir}: {info.num_experts} experts, top-{info.top_k}, "
        f"hidden {info.hidden_size}, {len(info.moe_layers)} MoE layers, {args.dtype}, "
        f"{args.threads} thread(s)"
    )
    if args.kernel:
        print(kernel_header(args.ffn_ranks), flush=True)
        result["kernel"] = run_kernels(model_dir, args)
        worst = max(r["ffn1_max_ratio"] for r in result["kernel"]) if 1 in args.ffn_ranks else None
        result["kernel_summary"] = {"ffn1_worst_ratio": worst}
        if worst is not None:
            print(f"F=1 / colocated: worst {worst:.3f} (target <= {TARGET_RATIO})")
    if args.memory:
        print(MEMORY_HEADER, flush=True)
        result["memory"] = []
        for f in args.ffn_ranks:
            row = measure_memory(model_dir, f, args)
            result["memory"].append(row)
            print(format_memory_row(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
