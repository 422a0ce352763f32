"""``vllm-afd profile``: measure the planner's inputs on the local vLLM backend (CPU here).

    vllm-afd profile [--model DIR] [--out cpu_profile.json] [--threads 1] [--ffn-gap-ms 2]

FastAFD's model needs, per model and hardware, a colocated profile (D_V, the auxiliary time
outside attention and routed experts) and fitted constants of the FFN service A2 (tau, u, u_c).
On the CPU it also needs the attention time itself, because the GPU wave model (A1) does not
describe a CPU. What is measured, with ``--threads`` threads per rank (one rank = one "device"):

1. hardware: streaming read bandwidth (a large ``sum``) and the float32 GEMM rate (a large
   ``matmul``), written as a planner hardware file (``Hardware`` fields, SI units);
2. the expert kernel alone (``ffn.weights.load_routed_experts`` +
   ``ffn.executor.ExpertKernel``: the model's own MoE layers as FFN rank 0 builds them, no
   engine), over routed tokens m and over the weight bytes W an FFN rank holds (1, 2, 4 FFN
   ranks' shares), the MoE layers taking turns as in a decode (``layer_turns``):
   K(m, W) = k0 + W / (u BW) + m c_k  ->  u (bandwidth efficiency) and the GEMM efficiency
   u_c,kernel = 6 H I K / (c_k P);
3. the remote FFN service: an ``FFNExecutor`` in a child process behind the real transport,
   timed from the attention side (dispatch + combine, layers in turn, each call ``--ffn-gap-ms``
   after the previous one as in a decode, ``RemoteFFN``): F(m) = f0 + m c_r  ->
   tau = f0 - W/(u BW) and u_c = 6 H I K / (c_r P) (the per-token transport copies are folded
   into u_c, as the paper folds everything per token into it);
4. the colocated engine (one rank, stock vLLM, eager) over batch n and context c with core
   attention and routed experts timed inside each step (``bench.decode``): per step
   T = L A(n, c) + L_moe K_V(n) + D_V(n), fitted as A = a0 + a1 n + a2 n c per layer,
   K_V = k0 + k1 n per layer, D_V = d0 + d1 n; the decoder layers are timed too, which tells
   how much of D_V is host work inside each layer, O = o0 + o1 n (``layer_aux``, reported in
   the profile's measurements): the fixed cost every extra microbatch repeats.

Steps 2 and 3 are sampled between the engine decodes of step 4, over several passes, so that a
burst of load from other users of the machine (which multiplies a cross-process round trip by
ten on two shared cores) lands on a minority of every component's samples, and every component
is the median of its samples (``quantile``): the typical step under the machine's usual load,
which is what a decode (and `vllm-afd bench`, which reports medians) sees.

The profile file is ``planner.profile_io``'s format (points: D_V and the measured colocated step
at the profile batch per context; fit: tau, u_c, u) plus a ``"cpu"`` section with the fitted CPU
terms that ``planner.cpu`` predicts CPU step periods from, and the raw measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- least squares and the fits (pure, tested on synthetic data) ---------------------------------


def least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Coefficients minimising ||rows @ coef - y||; ValueError when underdetermined."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} points to fit, got {a.shape[0]}")
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return [float(c) for c in coef]


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of y = intercept + slope x."""
    c0, c1 = least_squares([[1.0, v] for v in x], y)
    return c0, c1


def fit_attention(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(a0, a1, a2) of A(n, c) = a0 + a1 n + a2 n c from (n, c, seconds) points."""
    a0, a1, a2 = least_squares([[1.0, n, n * c] for n, c, _ in points], [t for *_, t in points])
    return a0, a1, a2


@dataclass(frozen=True)
class ExpertFit:
    """A2 constants recovered from kernel and remote timings (SI units)."""

    tau_s: float
    bandwidth_efficiency: float
    gemm_efficiency: float
    kernel_gemm_efficiency: float
    kernel_intercept_s: float
    remote_intercept_s: float
    notes: tuple[str, ...] = ()


def fit_experts(
    kernel: list[tuple[float, float, float]],
    remote: list[tuple[float, float]],
    weight_bytes: float,
    flops_per_token: float,
    bandwidth: float,
    flop_rate: float,
) -> ExpertFit:
    """Fit tau, u and u_c (see the module docstring, steps 2 and 3).

    ``kernel``: (m, W bytes, seconds) of the local kernel; ``remote``: (m, seconds) of the remote
    service with all ``weight_bytes`` on one FFN rank; ``flops_per_token`` = 6 H I K.
    Efficiencies are clamped to (0, 1] and tau to >= 0, with a note when a clamp bites; F(m)
    keeps the remote samples' intercept whenever u <= 1 allows it.
    """
    notes = []
    k0, k_w, k_c = least_squares([[1.0, w, m] for m, w, _ in kernel], [t for *_, t in kernel])
    u = 1.0 if k_w <= 0 else 1.0 / (k_w * bandwidth)
    if k_w <= 0 or u > 1:
        notes.append(f"weight-read slope {k_w:.3g} s/B gives u={u:.3g}; clamped to 1")
        u = 1.0
    f0, c_r = fit_line([m for m, _ in remote], [t for _, t in remote])
    tau = f0 - weight_bytes / (u * bandwidth)
    if tau < 0:
        # The remote service reads its weights faster than the kernel's slope says (they stay
        # in cache between layers): keep F's intercept f0 by raising u, not by dropping tau.
        raised = 1.0 if f0 <= 0 else min(1.0, weight_bytes / (f0 * bandwidth))
        notes.append(f"tau {tau * 1e6:.1f} us < 0: tau 0, u {u:.3g} -> {raised:.3g}")
        tau, u = max(0.0, f0 - weight_bytes / (raised * bandwidth)), raised
    u_c = _efficiency(flops_per_token, c_r, flop_rate, "remote", notes)
    u_c_kernel = _efficiency(flops_per_token, k_c, flop_rate, "kernel", notes)
    return ExpertFit(tau, u, u_c, u_c_kernel, k0, f0, tuple(notes))


def _efficiency(flops: float, slope: float, rate: float, what: str, notes: list[str]) -> float:
    if slope <= 0:
        notes.append(f"{what} per-token slope {slope:.3g} s <= 0; u_c set to 1")
        return 1.0
    value = flops / (slope * rate)
    if value > 1:
        notes.append(f"{what} u_c {value:.3g} > 1 clamped to 1")
    return min(1.0, value)


#: Default ``--ffn-gap-ms``: one layer of a decode on the development machine, outside the routed
#: experts, is 1.5 ms (default tiny model, batch 16) to 4 ms (FFN-heavy recipe, batch 64).
DEFAULT_FFN_GAP_MS = 2.0

#: Quantile the profile takes of every pooled set of samples (see ``quantile``).
PROFILE_QUANTILE = 0.5


def quantile(values, q: float = PROFILE_QUANTILE) -> float:
    """The ``q`` quantile (linear interpolation) of ``values``.

    On the two shared development cores a burst of someone else's work multiplies a
    cross-process round trip by ten and the host part of a step by two, for seconds to minutes.
    Samples are spread over the whole profile, and their median ignores such bursts as long as
    they cover less than half of the time: it is the typical step that a decode, and the bench's
    median step period, see. A lower quantile describes an idle machine instead: with
    ``q = 0.25`` the default tiny model's colocated step came out 12% below the median, and the
    planner predicted every bench row 10-20% short.
    """
    from vllm_afd.bench.window import percentile

    return percentile(list(values), 100 * q)


def pooled_components(
    runs: list[list[dict]], batch: int, skip: int, q: float = PROFILE_QUANTILE
) -> dict[str, float]:
    """``step_components`` over the window steps of several decodes pooled together."""
    from vllm_afd.bench.window import steady_window

    window = []
    for steps in runs:
        idx = steady_window([s["decoding"] for s in steps], batch, skip)
        window += [steps[i] for i in idx]
    return step_components(window, batch, skip=0, q=q)


def step_components(steps: list[dict], batch: int, skip: int, q: float = 0.5) -> dict[str, float]:
    """Quantile ``q`` (median by default) over the steady window of the step, its core
    attention, routed experts and D_V (seconds).

    D_V of a step is what is neither core attention nor routed experts (``dt - attn - moe``);
    a quantile keeps a preempted step (another user of the machine) out of every component.
    With decoder-layer timings (``layers_s``), ``layer_aux_s`` is the part of D_V spent inside
    the decoder layers (projections, norms, router, their host work), summed over the layers.
    """
    from vllm_afd.bench.window import steady_window

    idx = steady_window([s["decoding"] for s in steps], batch, skip) if skip else range(len(steps))
    window = [steps[i] for i in idx]
    if not window:
        raise ValueError(f"no steady decode window at batch {batch}; raise --output-len")
    components = {
        "step_s": quantile((s["dt"] for s in window), q),
        "attention_s": quantile((s["attn_s"] for s in window), q),
        "moe_s": quantile((s["moe_s"] for s in window), q),
        "aux_s": quantile((s["dt"] - s["attn_s"] - s["moe_s"] for s in window), q),
    }
    if all(s.get("layers_s") for s in window):
        components["layer_aux_s"] = quantile(
            (s["layers_s"] - s["attn_s"] - s["moe_s"] for s in window), q
        )
    return components


# -- measurements --------------------------------------------------------------------------------


class Sampler:
    """Wall times of a few zero-argument calls, sampled in interleaved passes.

    Every pass times each call ``reps`` times; the profiler runs a pass of every sweep (kernel,
    remote service, engine) in turn, so load from other users of the machine falls on all of
    them alike, and the medians over all passes discard its bursts.
    """

    def __init__(
        self, calls: dict[Any, Callable[[], Any]], before: Callable[[], Any] | None = None
    ) -> None:
        self.calls = calls
        self.before = before
        """Untimed, before every timed call (``RemoteFFN``: the attention side's work)."""
        self.samples: dict[Any, list[float]] = {key: [] for key in calls}
        for fn in calls.values():  # warm-up
            fn()

    def run_pass(self, reps: int, warmup_s: float = 0.02) -> None:
        """Time every call ``reps`` times, after ``warmup_s`` of untimed calls of each.

        The warm-up matters for the remote service: after a second of idleness the first few
        milliseconds of round trips are slow (the FFN rank's waiting has backed off to sleeping,
        and both processes get rescheduled), which a decoding engine, calling it every layer,
        never sees.
        """
        for key, fn in self.calls.items():
            end = time.perf_counter() + warmup_s
            while time.perf_counter() < end:
                fn()
            for _ in range(reps):
                if self.before is not None:
                    self.before()
                start = time.perf_counter()
                fn()
                self.samples[key].append(time.perf_counter() - start)

    def quantiles(self, q: float = PROFILE_QUANTILE) -> dict[Any, float]:
        """Quantile ``q`` of each call's samples (see ``quantile``)."""
        return {key: quantile(v, q) for key, v in self.samples.items() if v}


def measure_hardware(threads: int, mib: int = 256, reps: int = 10) -> dict[str, float]:
    """Read bandwidth (bytes/s) and float32 GEMM rate (FLOP/s) with ``threads`` threads.

    Both are capabilities, so the fastest of ``reps`` runs counts (a run slowed by another
    user's process says nothing about the hardware).
    """
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    read_s = min(_time_once(lambda: x.sum()) for _ in range(reps))
    mm_s = min(_time_once(lambda: a @ b) for _ in range(reps))
    return {"read_bandwidth": x.nbytes / read_s, "flop_rate": 2 * n**3 / mm_s}


def _time_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _routing(m: int, num_experts: int, top_k: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(m)])
    weights = torch.rand(m, top_k, generator=gen)
    return ids.to(torch.int32), (weights / weights.sum(1, keepdim=True)).float()


def kernel_sampler(model_dir: str, info, tokens: list[int], ffn_counts: list[int], dtype):
    """Sampler of the local expert kernel of one layer, keyed (m, W bytes), per FFN-rank share.

    Per share, FFN rank 0 of ``f`` ranks (its layers and kernel, as an FFN rank runs them), with
    tokens routed to its experts only (global ids ``0 .. E/f - 1``).
    """
    import torch

    from vllm_afd.ffn import executor
    from vllm_afd.ffn.weights import expert_bytes, load_routed_experts

    calls = {}
    for f in ffn_counts:
        local = info.num_experts // f
        layers = load_routed_experts(model_dir, 0, f, dtype)
        first = info.moe_layers[0]
        w_bytes = expert_bytes({first: layers[first]})
        kernel = executor.ExpertKernel(layers)
        turns = layer_turns(info.moe_layers)
        for m in tokens:
            x = torch.randn(m, info.hidden_size).to(dtype)
            ids, weights = _routing(m, local, min(info.top_k, local), seed=m)
            key = (float(m), float(w_bytes))
            calls[key] = lambda k=kernel, t=turns, x=x, i=ids, w=weights: k(next(t), x, i, w)
    return Sampler(calls)


def busy_wait(seconds: float) -> None:
    """Keep this CPU busy for ``seconds`` (stands in for the attention side's own work)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def layer_turns(moe_layers) -> Iterator[int]:
    """The MoE layers in turn, as a decode calls them.

    One layer called again and again keeps its experts in the core's caches, which a decode
    never does: measured on the FFN-heavy tiny model (2 layers of 6 MiB), a layer took 1.02 ms
    called alone and 1.19 ms with the two layers taking turns.
    """
    return itertools.cycle(moe_layers)


def _ffn_child(spec_json: str, model_dir: str, threads: int, cpus: list[int] | None, conn) -> None:
    """Process entry: one FFN rank (the product's executor) serving until told to stop (a
    message or the parent's end of ``conn`` closed: unlike an event, a pipe cannot leave the
    parent waiting for a child that died or is stopped)."""
    import torch

    from vllm_afd.ffn.executor import FFNExecutor
    from vllm_afd.host import bind_process
    from vllm_afd.transport import TransportSpec

    if cpus:
        bind_process(cpus)
    torch.set_num_threads(threads)
    executor = FFNExecutor(TransportSpec.from_json(spec_json), 0, model_dir, "cpu")
    executor.start()
    conn.send(executor.address)
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    executor.stop()


class RemoteFFN:
    """An ``FFNExecutor`` (all experts, shm transport) in a child process, and a Sampler of
    dispatch + remote experts + combine from this process, keyed by routed tokens m.

    Every timed call comes ``gap_s`` after the previous one, this process busy in between, as
    a decode's MoE layers come one layer of attention-side work apart. Back-to-back calls find
    the FFN rank's caches warm, which a decode never does: on the development machine a round
    trip of the default tiny model (16 tokens) took 0.06 ms back to back and 0.15 ms 1.5 ms
    after the previous one (the FFN rank polling all along), and the FFN-heavy model's
    (64 tokens) 1.2-1.3 ms against 1.45-1.55 ms 3 ms after.
    """

    def __init__(
        self,
        model_dir: str,
        info,
        tokens: list[int],
        dtype,
        threads: int,
        cpus: list[int] | None = None,
        gap_s: float = 0.0,
    ) -> None:
        from vllm_afd.transport import TransportSpec

        self.info, self.tokens, self.dtype, self.gap_s = info, tokens, dtype, gap_s
        self.spec = TransportSpec(
            "shm",
            1,
            1,
            info.num_experts,
            info.hidden_size,
            info.top_k,
            max_tokens=max(tokens),
            dtype=dtype,
        )
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_ffn_child,
            daemon=True,
            args=(self.spec.to_json(), model_dir, threads, cpus, child),
        )
        self.endpoint = None

    def __enter__(self) -> Sampler:
        import dataclasses

        import torch

        from vllm_afd.bench.transport_bench import step_layers
        from vllm_afd.transport import create_attention_transport

        self.proc.start()
        if not self.conn.poll(300):
            self.__exit__()
            raise RuntimeError("profiler: the FFN executor child did not start within 300 s")
        spec = dataclasses.replace(self.spec, addresses=(self.conn.recv(),))
        endpoint = self.endpoint = create_attention_transport(spec, 0)
        # the MoE layers in turn, a step of them all announced as a decode announces its steps
        turns = step_layers(endpoint, spec, max(self.tokens), tuple(self.info.moe_layers))
        calls = {}
        for m in self.tokens:
            x = torch.randn(m, self.info.hidden_size).to(self.dtype)
            ids, weights = _routing(m, self.info.num_experts, self.info.top_k, seed=m)
            calls[float(m)] = lambda x=x, i=ids, w=weights: endpoint.combine(
                endpoint.dispatch(turns(), x, i, w)
            )
        return Sampler(calls, before=lambda: busy_wait(self.gap_s))

    def pause(self) -> None:
        """Stop the FFN child (SIGSTOP) while the engine decodes: an idle FFN rank polls, and
        that background work would be charged to the colocated engine's steps."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)

    def __exit__(self, *exc) -> None:
        self.resume()
        if self.endpoint is not None:
            self.endpoint.close()
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class EngineSweep:
    """The colocated engine (one rank, instrumented) decoding every (n, c) point once a pass."""

    def __init__(
        self,
        model_dir: str,
        batches: list[int],
        contexts: list[int],
        output_len: int,
        threads: int,
        dtype: str,
        skip: int = 2,
        cpus: list[int] | None = None,
    ) -> None:
        from vllm_afd.bench.launch import ChildGroup

        job = {
            "name": "profile-colocated",
            "model": model_dir,
            "dtype": dtype,
            "batch": max(batches),
            "prompt_len": max(contexts),
            "output_len": output_len,
            "skip": skip,
            "max_model_len": max(contexts) + output_len + 16,
            "max_num_batched_tokens": max(512, max(batches)),
            "instrument": True,
        }
        if cpus:
            job["cpus"] = [cpus]
        self.output_len, self.skip = output_len, skip
        self.group = ChildGroup(job, threads, Path(tempfile.mkdtemp(prefix="vllm_afd_profile_")))
        self.steps: dict[tuple[int, int], list[list[dict]]] = {
            (n, c): [] for c in contexts for n in batches
        }

    def __enter__(self) -> EngineSweep:
        self.group.start()
        return self

    def __exit__(self, kind, *exc) -> None:
        """Stop the engine; its log directory goes unless the sweep failed (then its logs
        say why, and the error names the directory)."""
        self.group.close()
        if kind is None:
            shutil.rmtree(self.group.log_dir, ignore_errors=True)
        else:
            print(f"vllm-afd profile: the engine's logs: {self.group.log_dir}", file=sys.stderr)

    def run_pass(self, between: Callable[[], None] = lambda: None) -> None:
        """Decode every point once, calling ``between`` after each decode."""
        for (n, c), runs in self.steps.items():
            command = {
                "cmd": "run",
                "tag": f"p{len(runs)}-{n}-{c}",
                "batch": n,
                "prompt_len": c,
                "output_len": self.output_len,
            }
            (run,) = self.group.run(command)
            runs.append(run["steps"])
            between()

    def points(self) -> list[dict[str, float]]:
        """Per (n, c): window medians of step, attention, routed experts and D_V (seconds)."""
        return [
            pooled_components(runs, n, self.skip)
            | {"batch": n, "context": c, "context_mid": c + self.output_len / 2}
            for (n, c), runs in self.steps.items()
        ]


# -- assembling the profile ----------------------------------------------------------------------


def cpu_hardware(hw: dict[str, float], fit: ExpertFit, threads: int):
    """The planner ``Hardware`` of one CPU rank (``threads`` cores) with the fitted A2 constants.

    GPU-only fields get their CPU meaning: ``num_sms`` = threads, ``sm_bandwidth`` = bandwidth per
    thread, ``fp8_flops`` = ``bf16_flops`` = the measured float32 GEMM rate (the planner picks the
    rate by expert bytes per parameter; the CPU kernels run the checkpoint's float32/bf16).
    """
    from vllm_afd.planner.hardware import Hardware

    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(
        name=f"cpu-{threads}t",
        hbm_bandwidth=hw["read_bandwidth"],
        hbm_capacity=ram * threads / cores,
        num_sms=threads,
        sm_bandwidth=hw["read_bandwidth"] / threads,
        fp8_flops=hw["flop_rate"],
        bf16_flops=hw["flop_rate"],
        bandwidth_efficiency=fit.bandwidth_efficiency,
        gemm_efficiency=fit.gemm_efficiency,
        dispatch_intercept=fit.tau_s,
        gpus_per_node=max(1, cores // threads),
        nvlink_domain=max(2, cores // threads),
        calibrated=True,
        source=f"vllm-afd profile on {platform.node()} ({platform.processor() or 'cpu'}), "
        f"{time.strftime('%Y-%m-%d')}",
    )


def fit_colocated(points: list[dict[str, float]], num_layers: int, num_moe_layers: int) -> dict:
    """Attention (per layer), colocated MoE kernel (per layer), D_V and, with decoder-layer
    timings, the per-layer part of D_V (``layer_aux``) fits from engine points."""
    attention = fit_attention(
        [(p["batch"], p["context_mid"], p["attention_s"] / num_layers) for p in points]
    )
    kernel = fit_line([p["batch"] for p in points], [p["moe_s"] / num_moe_layers for p in points])
    aux = fit_line([p["batch"] for p in points], [p["aux_s"] for p in points])
    fits = {"attention": attention, "kernel": kernel, "aux": aux}
    if all("layer_aux_s" in p for p in points):
        fits["layer_aux"] = fit_line(
            [p["batch"] for p in points], [p["layer_aux_s"] / num_layers for p in points]
        )
    return fits


def build_profile(
    model_name: str, points: list[dict], profile_batch: int, fits: dict, hw, fit: ExpertFit
):
    """The planner's ``ColocatedProfile``: one point per context at the profile batch."""
    from vllm_afd.planner.profile_io import ColocatedProfile, ProfilePoint

    rows = []
    for c in sorted({p["context"] for p in points}):
        at_c = [p for p in points if p["context"] == c]
        p = min(at_c, key=lambda q: abs(q["batch"] - profile_batch))
        rows.append(
            ProfilePoint(
                context=int(c),
                dv_ms=max(0.0, p["aux_s"]) * 1e3,
                profile_batch=int(p["batch"]),
                baseline_ep=1,
                baseline_batch=int(p["batch"]),
                baseline_step_ms=p["step_s"] * 1e3,
            )
        )
    return ColocatedProfile(
        model=model_name,
        hardware=hw.name,
        points=tuple(rows),
        dispatch_intercept_us=fit.tau_s * 1e6,
        gemm_efficiency=fit.gemm_efficiency,
        bandwidth_efficiency=fit.bandwidth_efficiency,
        source="vllm-afd profile",
    )


def write_outputs(out: Path, hw_out: Path, profile, cpu_section: dict, hw) -> None:
    """The profile JSON (planner format + ``cpu`` section) and the hardware JSON."""
    import dataclasses

    from vllm_afd.planner.profile_io import profile_to_dict

    data = profile_to_dict(profile) | {"cpu": cpu_section}
    out.write_text(json.dumps(data, indent=2) + "\n")
    hw_out.write_text(json.dumps(dataclasses.asdict(hw), indent=2) + "\n")


# -- command line ----------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    return values


def _milliseconds(text: str) -> float:
    from vllm_afd.envs import non_negative_number

    value = non_negative_number(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-afd profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="MoE model directory (default: the tiny Qwen3-MoE)")
    p.add_argument("--out", default="cpu_profile.json", help="profile JSON to write")
    p.add_argument("--hardware-out", help="hardware JSON (default: OUT with .hardware.json)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=_ints, default=[1, 4, 8, 16, 32], help="colocated batches")
    p.add_argument("--contexts", type=_ints, default=[64, 256], help="prompt lengths")
    p.add_argument("--profile-batch", type=int, default=16, help="b_p of the profile points")
    p.add_argument(
        "--tokens",
        type=_ints,
        default=[1, 4, 8, 16, 32, 64, 128],
        help="routed tokens m of the FFN sweeps",
    )
    p.add_argument(
        "--ffn-gap-ms",
        type=_milliseconds,
        default=DEFAULT_FFN_GAP_MS,
        help="attention-side time before each timed remote FFN call: the time a decode spends "
        "between two MoE layers (%(default)s)",
    )
    p.add_argument("--output-len", type=int, default=24, help="decode steps per engine point")
    p.add_argument("--reps", type=int, default=80, help="timed calls per kernel/remote point")
    p.add_argument("--passes", type=int, default=4, help="interleaved passes over every sweep")
    return p


def _stage(bar, text: str) -> None:
    bar.set_postfix_str(text)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm import tqdm

    from vllm_afd.bench.launch import core_plan
    from vllm_afd.bench.tiny_models import default_tiny_model
    from vllm_afd.config import moe_model_info
    from vllm_afd.planner.cpu import CpuFit, cpu_fit_to_dict
    from vllm_afd.planner.models import get_model

    model_dir = args.model or str(default_tiny_model())
    spec = get_model(model_dir)
    from transformers import AutoConfig

    info = moe_model_info(AutoConfig.from_pretrained(model_dir))
    dtype = getattr(torch, args.dtype)
    ffn_counts = [f for f in (1, 2, 4) if info.num_experts % f == 0]
    bar = tqdm(total=2 + args.passes, desc="vllm-afd profile", file=sys.stderr)
    _stage(bar, "hardware")
    hw_meas = measure_hardware(args.threads)
    bar.update()
    _stage(bar, "starting the FFN executor and the colocated engine")
    kernel = kernel_sampler(model_dir, info, args.tokens, ffn_counts, dtype)
    slots = args.passes * len(args.batches) * len(args.contexts)
    per_slot = max(1, args.reps // slots)
    # one device per rank, as in `vllm-afd bench`: the engine and this process (the attention
    # side of the remote samples) on the attention rank's CPUs, the FFN child on its own
    plan = core_plan(1, 1, args.threads)
    attention_cpus, ffn_cpus = (plan[0][0], plan[1][0]) if plan else (None, None)
    ffn = RemoteFFN(
        model_dir, info, args.tokens, dtype, args.threads, ffn_cpus, args.ffn_gap_ms * 1e-3
    )
    allowed = os.sched_getaffinity(0)
    with (
        ffn as remote,
        EngineSweep(
            model_dir,
            args.batches,
            args.contexts,
            args.output_len,
            args.threads,
            args.dtype,
            cpus=attention_cpus,
        ) as engine,
        _bound(attention_cpus, allowed),
    ):
        bar.update()
        ffn.pause()
        for i in range(args.passes):
            _stage(bar, f"pass {i + 1}/{args.passes}: engine, expert kernel, remote FFN")
            # kernel and remote samples are taken between engine decodes, spread over the whole
            # profile, so a burst of load from other users cannot own any one component
            engine.run_pass(between=lambda: _sample(ffn, kernel, remote, per_slot))
            bar.update()
    bar.close()
    points = engine.points()
    kernel_times = [(m, w, t) for (m, w), t in kernel.quantiles().items()]
    remote_times = sorted(remote.quantiles().items())
    itemsize = dtype.itemsize
    weight_bytes = info.num_experts * 3 * info.hidden_size * info.moe_intermediate_size * itemsize
    flops = 6 * info.hidden_size * info.moe_intermediate_size * info.top_k
    fit = fit_experts(
        kernel_times,
        remote_times,
        weight_bytes,
        flops,
        hw_meas["read_bandwidth"],
        hw_meas["flop_rate"],
    )
    hw = cpu_hardware(hw_meas, fit, args.threads)
    fits = fit_colocated(points, spec.num_layers, spec.num_moe_layers)
    cpu = CpuFit(fits["attention"], fits["aux"], fits["kernel"], hw, args.threads)
    profile = build_profile(spec.name, points, args.profile_batch, fits, hw, fit)
    section = cpu_fit_to_dict(cpu) | {
        "measurements": {
            "hardware": hw_meas,
            "kernel": kernel_times,
            "remote": remote_times,
            "quantile": PROFILE_QUANTILE,
            "colocated": points,
            "layer_aux": fits.get("layer_aux"),
        },
        "expert_fit": dataclasses_asdict(fit),
    }
    out = Path(args.out)
    hw_out = Path(args.hardware_out or out.with_suffix("").as_posix() + ".hardware.json")
    write_outputs(out, hw_out, profile, section, hw)
    print_summary(out, hw_out, hw_meas, fit, fits, points)


@contextlib.contextmanager
def _bound(cpus: list[int] | None, allowed: set[int]):
    """This process on ``cpus`` (if any) for the block, then back on ``allowed``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _sample(ffn: RemoteFFN, kernel: Sampler, remote: Sampler, reps: int) -> None:
    """One slot of kernel and remote samples between two engine decodes."""
    kernel.run_pass(reps)
    ffn.resume()
    remote.run_pass(reps)
    ffn.pause()


def dataclasses_asdict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def print_summary(out, hw_out, hw_meas, fit: ExpertFit, fits: dict, points: list[dict]) -> None:
    a0, a1, a2 = fits["attention"]
    d0, d1 = fits["aux"]
    k0, k1 = fits["kernel"]
    print(f"profile   {out}\nhardware  {hw_out}")
    print(
        f"CPU rank: read {hw_meas['read_bandwidth'] / 1e9:.1f} GB/s, "
        f"GEMM {hw_meas['flop_rate'] / 1e9:.1f} GFLOP/s (float32)"
    )
    print(
        f"A2 fit: tau {fit.tau_s * 1e6:.1f} us, u {fit.bandwidth_efficiency:.3f}, "
        f"u_c {fit.gemm_efficiency:.4f} (kernel alone {fit.kernel_gemm_efficiency:.4f}); "
        f"remote intercept {fit.remote_intercept_s * 1e6:.1f} us, "
        f"kernel intercept {fit.kernel_intercept_s * 1e6:.1f} us"
    )
    print(f"attention/layer: {a0 * 1e6:.1f} us + {a1 * 1e6:.2f} us*n + {a2 * 1e9:.3f} ns*n*c")
    print(
        f"colocated MoE/layer: {k0 * 1e6:.1f} us + {k1 * 1e6:.2f} us*n;  "
        f"D_V: {d0 * 1e3:.3f} ms + {d1 * 1e6:.1f} us*n"
    )
    if "layer_aux" in fits:
        o0, o1 = fits["layer_aux"]
        print(f"  of which inside each layer: {o0 * 1e6:.1f} us + {o1 * 1e6:.2f} us*n")
    for note in fit.notes:
        print(f"note: {note}")
    print(f"{'n':>4} {'c':>5} {'step ms':>8} {'attn ms':>8} {'moe ms':>8} {'D_V ms':>8}")
    for p in points:
        print(
            f"{p['batch']:>4} {p['context']:>5} {p['step_s'] * 1e3:>8.3f} "
            f"{p['attention_s'] * 1e3:>8.3f} {p['moe_s'] * 1e3:>8.3f} {p['aux_s'] * 1e3:>8.3f}"
        )


if __name__ == "__main__":
    main()
