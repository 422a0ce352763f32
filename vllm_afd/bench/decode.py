"""The decode driver that runs inside one benchmark child: fixed batch, per-step timestamps.

    python -m vllm_afd.bench.decode '{"model": ..., "batch": 16, "prompt_len": 128, ...}'
    (then one JSON command per stdin line: {"cmd": "run", "tag": "r0"} ... {"cmd": "exit"})

The paper's protocol (FastAFD A.1) on one engine: ``batch`` requests of exactly ``prompt_len``
prompt tokens and ``output_len`` output tokens (``ignore_eos``) are added together, with
``max_num_seqs == batch`` so every slot is occupied; the driver calls ``LLMEngine.step()`` itself
and timestamps the end of every step, recording how many requests were decoding in it. The child
stays up between decodes, answering each stdin command with one ``RESULT_PREFIX`` line, so that
the parent can interleave configurations decode by decode (``bench.launch``). The
parent (``bench.ab``) picks the steady-state window from those records (``bench.window``): steps
in which every request emits a token (exactly one; with a ``speculative_config``, one to
``1 + d``: the step records how many, ``new``), after prefill, minus a few transition steps and
the final step. Driving ``step()`` directly works for every layout used here: in-process single
rank, tensor parallel (multiprocess executor), and offline SPMD data parallel (one child per DP
rank, ``VLLM_DP_*`` environment), where ranks step in lockstep.

For AFD runs the FFN group's counters are read at the window's first and last step, so the
parent gets the FFN service time and the number of FFN requests per layer and step (which tells
whether microbatching is in effect). With ``instrument`` set, the core-attention modules and the
routed experts are timed through wrappers (eager mode only), which is how ``vllm-afd profile``
splits the colocated step into attention, MoE and the auxiliary rest D_V.

With a ``speculative_config`` (vLLM's, e.g. n-gram) the engine logs stats, and every decode
reports vLLM's speculative counters over it (``spec_decode``: drafts, draft tokens, accepted
tokens; ``offline_run.spec_decode_counts``, read through ``LLM.get_metrics``).

With a ``kv_transfer_config`` (vLLM's, e.g. ``DecodeBenchConnector``, which fills a new
request's KV with constants instead of computing the prompt) the engine runs that connector;
every decode reports each request's ``num_cached_tokens`` (``prompt_cached_tokens``: prompt
tokens vLLM did not compute; prefix caching is off, so these are the connector's), and every
step record counts the requests past their prompt (``started``), which gives the prefill phase.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

from vllm_afd import envs
from vllm_afd.bench.offline_run import param_bytes, spec_decode_counts
from vllm_afd.host import bind_process

RESULT_PREFIX = "VLLM_AFD_BENCH "
#: CPUs ("0,1") this child binds itself to before it starts anything (``launch.core_plan``).


def prompt_tokens(index: int, length: int, vocab: int, seed: int = 0) -> list[int]:
    """Deterministic pseudo-random prompt ``index`` of ``length`` ids in ``[8, vocab - 8)``."""
    import random

    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(8, max(9, vocab - 8)) for _ in range(length)]


class StepTimers:
    """Wall time spent in core attention, in routed experts and in the decoder layers as a
    whole during the current step (``layers_s`` minus the other two is the layers' own host
    work; the step minus ``layers_s`` is the per-step work outside the layers)."""

    def __init__(self) -> None:
        self.attention_s = 0.0
        self.moe_s = 0.0
        self.layers_s = 0.0

    def take(self) -> dict[str, float]:
        out = {"attn_s": self.attention_s, "moe_s": self.moe_s, "layers_s": self.layers_s}
        self.attention_s = self.moe_s = self.layers_s = 0.0
        return out


def decoder_layers(model) -> list:
    """The decoder layers of a vLLM model: the children of its ``layers`` ModuleList."""
    import torch

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def instrument(model, timers: StepTimers) -> int:
    """Wrap core attention (``Attention`` modules), routed experts (``forward_modular``) and
    the decoder layers.

    Under AFD the routed experts are ``AFDRoutedExperts``, whose ``forward_modular`` is the
    remote call (dispatch + FFN service + combine, as long as the attention rank waits for it).
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    try:
        from vllm.model_executor.layers.attention import Attention
    except ImportError:  # older layout
        from vllm.attention.layer import Attention

    wrapped = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.forward = _timed(module.forward, timers, "attention")
            wrapped += 1
        elif isinstance(module, RoutedExperts):
            module.forward_modular = _timed(module.forward_modular, timers, "moe")
            wrapped += 1
    for layer in decoder_layers(model):
        layer.forward = _timed(layer.forward, timers, "layer")
        wrapped += 1
    return wrapped


def _timed(fn, timers: StepTimers, kind: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - start
        if kind == "attention":
            timers.attention_s += dt
        elif kind == "layer":
            timers.layers_s += dt
        else:
            timers.moe_s += dt
        return out

    return wrapper


def _engine_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        seed=0,
        max_model_len=job.get("max_model_len", 512),
        max_num_seqs=job["batch"],
        enforce_eager=True,
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        enable_expert_parallel=job.get("enable_expert_parallel", False),
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=job.get("max_num_batched_tokens", 512),
        disable_log_stats=True,
    )
    if job.get("dp"):
        # One process per DP rank (TP1): vLLM would otherwise add a worker process per rank,
        # whose idle polling competes for the two cores.
        kwargs["distributed_executor_backend"] = "uni"
    if job.get("afd"):
        kwargs["additional_config"] = {"afd": job["afd"]}
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
        kwargs["disable_log_stats"] = False  # the acceptance counters (every config alike)
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = job["kv_transfer_config"]
    return kwargs


def draft_length(job: dict[str, Any]) -> int:
    """Tokens the job's speculative config drafts per request and step (0 without one)."""
    spec = job.get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens") or 0)


def _ffn_stats() -> list[dict] | None:
    from vllm_afd.placement import current_group

    group = current_group()
    return None if group is None else group.stats()


class Driver:
    """One engine and the fixed-batch decode loop."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM

        from vllm_afd.patches import cpu_comm

        cpu_comm.apply()  # DP / wide EP on CPU (also installed by the plugin when wired)
        self.job = job
        start = time.perf_counter()
        self.llm = LLM(**_engine_kwargs(job))
        self.startup_s = time.perf_counter() - start
        self.engine = self.llm.llm_engine
        self.vocab = self.engine.model_config.get_vocab_size()
        self.timers = StepTimers()
        self.wrapped = 0
        if job.get("instrument") and job.get("tensor_parallel_size", 1) == 1:
            model = self.engine.model_executor.driver_worker.worker.model_runner.model
            self.wrapped = instrument(model, self.timers)

    def run(self, batch: int, prompt_len: int, output_len: int, first: int, tag: str) -> dict:
        """Decode ``batch`` requests (indices ``first..first+batch-1``); per-step records."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0.0,
            max_tokens=output_len,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        seed = self.job.get("seed", 0)
        ids = [f"{tag}-{first + i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            prompt = {"prompt_token_ids": prompt_tokens(first + i, prompt_len, self.vocab, seed)}
            self.engine.add_request(rid, prompt, params)
        if not self.job.get("speculative_config"):
            return self._loop(ids, output_len)
        before = spec_decode_counts(self.llm)
        run = self._loop(ids, output_len)
        after = spec_decode_counts(self.llm)
        run["spec_decode"] = {key: after[key] - before[key] for key in after}
        return run

    def _loop(self, ids: list[str], output_len: int) -> dict:
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        cached: dict[str, int] = {}
        steps: list[dict] = []
        ffn: dict[str, Any] = {}
        self.timers.take()
        last = time.perf_counter()
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.perf_counter()
            record = self._record(outputs, tokens, now - last, cached)
            steps.append(record)
            last = self._maybe_snapshot(record, tokens, output_len, len(steps) - 1, ffn)
        return {
            "steps": steps,
            "tokens": [tokens[r] for r in ids],
            "ffn_window": ffn,
            "prompt_cached_tokens": [cached.get(r) for r in ids],
        }

    def _record(
        self, outputs, tokens: dict[str, list[int]], dt: float, cached: dict | None = None
    ) -> dict:
        """One step's record; ``cached`` collects each request's ``num_cached_tokens`` (prompt
        tokens vLLM did not compute: prefix-cache hits, off here, or loaded by a KV connector)."""
        before = {rid: len(t) for rid, t in tokens.items()}
        for out in outputs:
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.outputs[0].token_ids)
                hit = getattr(out, "num_cached_tokens", None)
                if cached is not None and hit is not None:
                    cached[out.request_id] = max(hit, cached.get(out.request_id, 0))
        # a request decodes when it had its first token and emits more: exactly one without
        # speculation, 1 to 1 + d (the accepted draft tokens and the bonus token) with it
        decoding = sum(1 for rid, t in tokens.items() if before[rid] >= 1 and len(t) > before[rid])
        new = sum(len(t) for t in tokens.values()) - sum(before.values())
        started = sum(1 for t in tokens.values() if t)  # requests past their prompt
        return {
            "dt": dt,
            "decoding": decoding,
            "new": new,
            "started": started,
            **self.timers.take(),
        }

    def _maybe_snapshot(self, record, tokens, output_len, index, ffn) -> float:
        """Read the FFN counters at the window edges; returns the time the next step starts.

        The window starts after the ``skip``-th step in which every request decodes and ends
        with the last step before the first request completes (that final step is excluded),
        the same rule ``window.steady_window`` applies to the timestamps. With speculation a
        step emits up to ``1 + d`` tokens per request, so the window's FFN counters end at the
        first step after which a request could complete (up to ``d`` steps early).
        """
        if record["decoding"] != len(tokens):
            return time.perf_counter()
        ffn["steady_seen"] = ffn.get("steady_seen", 0) + 1
        edges = []
        if ffn["steady_seen"] == self.job.get("skip", 2):
            edges.append(("before", "first_step"))
        if max(len(t) for t in tokens.values()) >= output_len - 1 - draft_length(self.job):
            edges.append(("after", "last_step"))
        for key, step_key in edges:
            stats = _ffn_stats()
            if stats is not None and key not in ffn:
                ffn[key], ffn[step_key] = stats, index
        return time.perf_counter()


def ready_info(driver: Driver, first: int) -> dict[str, Any]:
    """What the parent needs once: start-up time, threads, parameter bytes, FFN ranks."""
    import torch

    config = driver.engine.vllm_config
    return {
        "event": "ready",
        "first_request": first,
        "startup_s": driver.startup_s,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "instrumented_modules": driver.wrapped,
        "async_scheduling": bool(getattr(config.scheduler_config, "async_scheduling", False)),
        "attention_param_bytes": driver.llm.collective_rpc(param_bytes)[0],
        "ffn": _ffn_infos(),
        "kv_connector": getattr(config.kv_transfer_config, "kv_connector", None),
        "num_layers": config.model_config.hf_config.num_hidden_layers,
    }


def serve(job: dict[str, Any], commands, emit) -> None:
    """Start the engine, warm up, report ready, then run one decode per ``run`` command.

    ``commands`` yields JSON lines: ``{"cmd": "run", "tag": str}`` with optional ``batch``,
    ``prompt_len``, ``output_len`` overrides (the engine's ``max_num_seqs`` stays the job's
    batch), or ``{"cmd": "exit"}``. ``emit(dict)`` sends one result line to the parent.
    """
    driver = Driver(job)
    first = job.get("first_request", 0)
    driver.run(min(job["batch"], 2), job["prompt_len"], 4, first, "warmup")
    emit(ready_info(driver, first))
    for line in commands:
        cmd = json.loads(line)
        if cmd.get("cmd") != "run":
            break
        batch = cmd.get("batch", job["batch"])
        plen, olen = (
            cmd.get("prompt_len", job["prompt_len"]),
            cmd.get("output_len", job["output_len"]),
        )
        run = driver.run(batch, plen, olen, first, cmd.get("tag", "run"))
        emit({"event": "run", "batch": batch, "prompt_len": plen, "output_len": olen, **run})


def _ffn_infos() -> list[dict]:
    from vllm_afd.placement import current_group

    group = current_group()
    return [] if group is None else [dict(info) for info in group.infos]


def stats_delta(before: list[dict], after: list[dict]) -> list[dict[str, Any]]:
    """Per FFN rank: counters accumulated between two ``FFNGroup.stats()`` snapshots."""
    out = []
    for b, a in zip(before, after, strict=True):
        per_layer = defaultdict(float)
        calls = defaultdict(int)
        for layer, value in a["per_layer_s"].items():
            per_layer[str(layer)] = value - b["per_layer_s"].get(layer, 0.0)
        for layer, value in a["per_layer_calls"].items():
            calls[str(layer)] = value - b["per_layer_calls"].get(layer, 0)
        out.append(
            {
                "requests": a["requests"] - b["requests"],
                "tokens": a["tokens"] - b["tokens"],
                "busy_s": a["busy_s"] - b["busy_s"],
                "per_layer_s": dict(per_layer),
                "per_layer_calls": dict(calls),
            }
        )
    return out


def _emit(message: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(message), flush=True)


def main() -> None:
    cpus = envs.VLLM_AFD_BENCH_CPUS
    if cpus:
        bind_process(cpus)
    serve(json.loads(sys.argv[1]), sys.stdin, _emit)


if __name__ == "__main__":
    main()
