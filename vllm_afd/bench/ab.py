"""``vllm-afd bench``: A/B of AFD against colocated vLLM on one workload, in the paper's terms.

    vllm-afd bench [--recipe NAME] [--model DIR] [--ratios 1:1,2:1] [--microbatches 1,2]
                   [--ep-sizes 2] [--batch 16] [--prompt-len 128] [--output-len 64]
                   [--speculative-config JSON] [--kv-transfer-config JSON]
                   [--profile P.json] [--json out.json] [--plot out.png]

``--recipe`` names a complete configuration from ``bench.recipes``; flags override it.

Configurations, each in fresh processes (``bench.launch``), run on the same workload:

* ``colocated``: stock vLLM, one rank (TP1);
* ``wide EP``: colocated DP x EP (offline SPMD, one process per DP rank), ``--ep-sizes``;
* ``afd A:F kK``: AFD at every ratio and microbatch count; A attention ranks (tensor parallel when
  A > 1: data-parallel attention ranks need the OpenAI server's single front-end to share one FFN
  group, which this offline harness does not drive) and F FFN ranks.

Protocol (FastAFD A.1): ``--batch`` requests per attention rank with exactly ``--prompt-len``
prompt and ``--output-len`` output tokens, all added together with ``max_num_seqs`` equal to the
batch (every slot occupied); the child drives ``LLMEngine.step()`` and timestamps every step
(``bench.decode``); prefill is excluded and the period comes from the steady window
(``bench.window``), pooled over ``--rounds`` decodes per configuration. The single-rank colocated
baseline runs throughout; every other configuration is started, decoded ``--rounds`` times in
alternation with the baseline, and stopped (``pair_schedule``), so that load from other users of
a shared machine falls on both sides of each comparison alike while idle configurations add no
background work of their own.

Reported per configuration: devices, per-rank batch, step period (median, p90), tokens/s per
device (all devices and attention devices only), S_all and S_att against the best colocated
configuration and Eq. 2's split (``bench.metrics``), whether the greedy tokens are identical to
single-rank colocated, and with ``--profile`` the planner's CPU prediction (``planner.cpu``) and
its error. A microbatch count the product does not apply is reported as
unsupported (the FFN counters show how many requests per layer and step arrived).

``--speculative-config`` (vLLM's JSON, e.g. ``'{"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 3}'``) applies the same speculation to every configuration, so that S_all
and S_att compare AFD with speculation against the same speculation colocated and on wide EP.
A step then emits 1 to 1 + d tokens per request: tokens/s counts the tokens emitted (tau per
request and step over the window, ``tok/step``), and each configuration reports vLLM's
acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts)
over its decodes. The planner's predictions verify 1 + d positions per request
(d = ``num_speculative_tokens``).

``--kv-transfer-config`` (vLLM's JSON) gives every configuration's engine the same KV connector,
e.g. ``'{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}'``, which fills each new
request's KV with constants instead of computing its prompt: the A/B of a decode pool (long
prompts without a prefill instance; the tokens are meaningless but must still be the same in
every layout, which all read the same constants). Every row names the connector its engine ran
(``kv_connector``) and says what the prompts cost (``prefill_summary``): prompt tokens computed
per request (the prompt minus vLLM's ``num_cached_tokens``) and the prefill phase's steps and
milliseconds; with a connector the table is followed by these columns. AFD with more than one
microbatch refuses connectors not known to be microbatch-safe
(``config.MICROBATCH_SAFE_KV_CONNECTORS``): such rows read unsupported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_afd.bench.metrics import (
    BenchConfig,
    Measurement,
    build_rows,
    prediction_error,
    spec_summary,
)
from vllm_afd.bench.recipes import BenchRecipe, get_recipe, recipe_names
from vllm_afd.bench.window import period_stats, window_intervals
from vllm_afd.config import json_object_arg


def _ratio(text: str) -> tuple[int, int]:
    from vllm_afd.config import parse_ratio
    from vllm_afd.errors import AFDConfigError

    try:
        ratio = parse_ratio(text)
    except AFDConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if ratio is None:
        raise argparse.ArgumentTypeError("'auto' is not a benchmark ratio; give A:F")
    return ratio


def _list(convert):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [convert(t) for t in items]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _ep_sizes(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else _list(_positive)(text)


def _speculative_config(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON; the bench needs its draft length d."""
    spec = json_object_arg(text)
    d = spec.get("num_speculative_tokens")
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise argparse.ArgumentTypeError(
            f"needs num_speculative_tokens >= 1 (the draft length d), got {text!r}"
        )
    return spec


#: vLLM's ``KVTransferConfig.kv_role`` values (``vllm.config.kv_transfer.KVRole``).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _kv_transfer_config(text: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` JSON: an object naming a ``kv_connector`` and, as vLLM
    requires with one, a ``kv_role`` (checked here so that no engine is started to refuse it)."""
    try:
        kv = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(kv, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    name = kv.get("kv_connector")
    if not isinstance(name, str) or not name.strip():
        raise argparse.ArgumentTypeError(
            f'needs "kv_connector" (a connector name, e.g. "DecodeBenchConnector"), got {text!r}'
        )
    if kv.get("kv_role") not in KV_ROLES:
        raise argparse.ArgumentTypeError(
            f'needs "kv_role", one of {", ".join(KV_ROLES)} (vLLM requires it with a '
            f"kv_connector; a decode pool is kv_both), got {text!r}"
        )
    return kv


def kv_connector(settings: dict[str, Any]) -> str | None:
    """The connector every configuration runs (None without ``--kv-transfer-config``)."""
    return (settings.get("kv_transfer_config") or {}).get("kv_connector")


def draft_length(settings: dict[str, Any]) -> int:
    """d: tokens drafted per request and step (0 without ``--speculative-config``)."""
    spec = settings.get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens") or 0)


def _recipe(name: str) -> BenchRecipe:
    try:
        return get_recipe(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-afd bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="MoE model directory (default: the tiny Qwen3-MoE)")
    p.add_argument(
        "--recipe",
        type=_recipe,
        metavar="NAME",
        help=f"named configuration (vllm_afd/bench/recipes.py): {', '.join(recipe_names())}",
    )
    p.add_argument("--ratios", type=_list(_ratio), default=None, help="AFD A:F list (1:1,2:1)")
    p.add_argument("--microbatches", type=_list(_positive), default=None, help="k list (1,2)")
    p.add_argument(
        "--ep-sizes",
        type=_ep_sizes,
        default=None,
        help="colocated wide-EP widths (DP x EP), e.g. 2; 'none' skips them",
    )
    p.add_argument("--batch", type=_positive, default=None, help="requests per rank (16)")
    p.add_argument(
        "--afd-batch",
        type=_positive,
        default=None,
        help="requests per AFD attention rank (default: --batch)",
    )
    p.add_argument("--prompt-len", type=_positive, default=None, help="prompt tokens (128)")
    p.add_argument("--output-len", type=_positive, default=None, help="output tokens (64)")
    p.add_argument(
        "--rounds", type=_positive, default=None, help="interleaved decodes per configuration (5)"
    )
    p.add_argument("--skip", type=_positive, default=None, help="steady steps dropped (2)")
    p.add_argument("--threads", type=_positive, default=None, help="threads per rank (1)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help="vLLM's speculative config, applied to every configuration "
        '(\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}\')',
    )
    p.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        default=None,
        metavar="JSON",
        help="vLLM's KV transfer config, applied to every configuration: a decode pool with "
        '\'{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}\'',
    )
    p.add_argument("--profile", help="CPU profile from `vllm-afd profile` (adds predictions)")
    p.add_argument("--json", dest="json_path", help="write rows and settings as JSON")
    p.add_argument("--plot", help="write a PNG of tokens/s per device and S_all")
    p.add_argument("--log-dir", help="children's logs (default: a temporary directory)")
    return p


DEFAULTS: dict[str, Any] = {
    "ratios": [(1, 1), (2, 1)],
    "microbatches": [1, 2],
    "ep_sizes": [2],
    "batch": 16,
    "afd_batch": None,
    "prompt_len": 128,
    "output_len": 64,
    "rounds": 5,
    "skip": 2,
    "threads": 1,
    "dtype": "float32",
}


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < recipe < flags given on the command line."""
    settings = dict(DEFAULTS)
    if args.recipe:
        settings |= args.recipe.settings()
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    settings["model"] = args.model or settings.get("model")
    spec = getattr(args, "speculative_config", None) or settings.get("speculative_config")
    if spec:  # absent without speculation: the settings (and their JSON) stay as they were
        settings["speculative_config"] = spec
    kv = getattr(args, "kv_transfer_config", None) or settings.get("kv_transfer_config")
    if kv:  # likewise absent without a connector
        settings["kv_transfer_config"] = kv
    settings["afd_batch"] = settings["afd_batch"] or settings["batch"]
    return settings


def build_configs(settings: dict[str, Any]) -> list[BenchConfig]:
    """Colocated TP1, wide EP per width, AFD per (ratio, k), in that order."""
    b = settings["batch"]
    configs = [BenchConfig("colocated", "colocated", attention_ranks=1, per_rank_batch=b)]
    for ep in settings["ep_sizes"] or []:
        configs.append(
            BenchConfig(
                f"wide EP{ep}",
                "wide-ep",
                attention_ranks=ep,
                data_parallel=ep,
                expert_parallel=True,
                per_rank_batch=b,
            )
        )
    for attn, ffn in settings["ratios"]:
        for k in settings["microbatches"]:
            configs.append(
                BenchConfig(
                    f"afd {attn}:{ffn} k{k}",
                    "afd",
                    attention_ranks=attn,
                    ffn_ranks=ffn,
                    tensor_parallel=attn,
                    per_rank_batch=settings["afd_batch"],
                    microbatches=k,
                    ratio=f"{attn}:{ffn}",
                )
            )
    return configs


def job_for(config: BenchConfig, settings: dict[str, Any]) -> dict[str, Any]:
    """The decode driver's job for one configuration."""
    job: dict[str, Any] = {
        "name": config.name,
        "model": settings["model"],
        "dtype": settings["dtype"],
        "batch": config.engine_batch,
        "prompt_len": settings["prompt_len"],
        "output_len": settings["output_len"],
        "skip": settings["skip"],
        "max_model_len": settings["prompt_len"] + settings["output_len"] + 16,
        "max_num_batched_tokens": max(512, config.engine_batch * (1 + draft_length(settings))),
        "tensor_parallel_size": config.tensor_parallel,
        "enable_expert_parallel": config.expert_parallel,
        "instrument": config.tensor_parallel == 1,
    }
    if config.data_parallel > 1:
        job["dp"] = {"size": config.data_parallel}
    if settings.get("speculative_config"):
        job["speculative_config"] = settings["speculative_config"]
    if settings.get("kv_transfer_config"):
        job["kv_transfer_config"] = settings["kv_transfer_config"]
    from vllm_afd.bench.launch import core_plan

    plan = core_plan(config.attention_ranks, config.ffn_ranks, settings["threads"])
    if plan is not None:
        job["cpus"], job["ffn_cpus"] = plan
    if config.kind == "afd":
        job["afd"] = {"ratio": config.ratio, "microbatches": config.microbatches}
        if settings.get("ray_address"):
            job["afd"]["ray_address"] = settings["ray_address"]
    return job


# -- turning children's results into a measurement ------------------------------------------------


def ffn_window_summary(runs: list[dict], config: BenchConfig) -> dict[str, float] | None:
    """FFN counters over the windows: service time per step and requests per layer-step."""
    from vllm_afd.bench.decode import stats_delta

    steps = requests = busy = calls = layer_s = 0.0
    layers: set[str] = set()
    for run in runs:
        w = run.get("ffn_window") or {}
        if "before" not in w or "after" not in w:
            continue
        delta = stats_delta(w["before"], w["after"])[0]  # FFN rank 0 (ranks are symmetric)
        steps += w["last_step"] - w["first_step"]
        requests += delta["requests"]
        busy += delta["busy_s"]
        calls += sum(delta["per_layer_calls"].values())
        layer_s += sum(delta["per_layer_s"].values())
        layers |= set(delta["per_layer_calls"])
    if not steps or not layers:
        return None
    per_layer_step = requests / (steps * len(layers))
    return {
        "ffn_busy_ms_per_step": 1e3 * busy / steps,
        "ffn_layer_service_ms": 1e3 * layer_s / max(calls, 1),
        "ffn_requests_per_layer_step": per_layer_step,
        "microbatches_effective": per_layer_step / config.attention_ranks,
    }


def step_breakdown(runs: list[dict], batch: int, skip: int) -> dict[str, float]:
    """Window medians of core attention, routed experts (remote under AFD) and the rest, per
    step in ms, when the child timed them (single-process ranks; not tensor parallel)."""
    from vllm_afd.bench.window import steady_window

    window = []
    for run in runs:
        steps = run["steps"]
        window += [steps[i] for i in steady_window([s["decoding"] for s in steps], batch, skip)]
    if not window or not any(s.get("attn_s") for s in window):
        return {}
    med = statistics.median
    return {
        "attention_ms": 1e3 * med(s["attn_s"] for s in window),
        "experts_ms": 1e3 * med(s["moe_s"] for s in window),
        "aux_ms": 1e3 * med(s["dt"] - s["attn_s"] - s["moe_s"] for s in window),
    }


def speculation_summary(runs: list[dict], batch: int, skip: int) -> dict[str, Any]:
    """With speculation: tokens per request and step over the windows (tau), and vLLM's
    counters summed over every decode and rank with the acceptance they give; {} without."""
    from vllm_afd.bench.window import steady_window

    if not any("spec_decode" in run for run in runs):
        return {}
    new = steps = 0
    for run in runs:
        window = steady_window([s["decoding"] for s in run["steps"]], batch, skip)
        new += sum(run["steps"][i]["new"] for i in window)
        steps += len(window)
    keys = ("drafts", "draft_tokens", "accepted_tokens")
    counts = {k: sum(run.get("spec_decode", {}).get(k, 0) for run in runs) for k in keys}
    out: dict[str, Any] = {"spec_decode": counts, **spec_summary(counts)}
    if steps:
        out["tokens_per_step"] = new / (steps * batch)
    return out


def prefill_summary(runs: list[dict]) -> dict[str, Any]:
    """What the prompts cost, from the decode driver's records ({} from older records).

    ``prompt_tokens_computed``: prompt tokens per request minus vLLM's ``num_cached_tokens``
    (tokens it did not compute; prefix caching is off in the bench, so with a connector these
    are the connector's), mean over requests and decodes; ``prompt_tokens_cached`` the rest.
    The prefill phase of a decode runs from its first step through the step in which its last
    request emits its first token (with chunked prefill, early requests decode in it too):
    ``prefill_steps`` and ``prefill_ms`` (its wall time, a connector's KV fill included) are
    medians over the decodes.
    """
    out: dict[str, Any] = {}
    cached = [
        (run["prompt_len"], c)
        for run in runs
        if "prompt_len" in run
        for c in run.get("prompt_cached_tokens") or []
        if c is not None
    ]
    if cached:
        out["prompt_tokens"] = statistics.fmean(p for p, _ in cached)
        out["prompt_tokens_cached"] = statistics.fmean(c for _, c in cached)
        out["prompt_tokens_computed"] = out["prompt_tokens"] - out["prompt_tokens_cached"]
    phases = []
    for run in runs:
        steps, n = run["steps"], len(run["tokens"])
        end = next((i for i, s in enumerate(steps) if s.get("started", -1) >= n), None)
        if end is not None:
            phases.append((end + 1, sum(s["dt"] for s in steps[: end + 1])))
    if phases:
        out["prefill_steps"] = statistics.median(k for k, _ in phases)
        out["prefill_ms"] = 1e3 * statistics.median(t for _, t in phases)
    return out


def tokens_by_request(ready: list[dict], first_round: list[dict]) -> dict[int, list[int]]:
    """Request index -> greedy tokens of the first decode (each DP rank holds its own range)."""
    out: dict[int, list[int]] = {}
    for info, run in zip(ready, first_round, strict=True):
        for i, tokens in enumerate(run["tokens"]):
            out[info["first_request"] + i] = tokens
    return out


def measure(
    config: BenchConfig, ready: list[dict], rounds: list[list[dict]], skip: int
) -> Measurement:
    """Pool the window intervals of every rank and round; FFN counters; microbatch check.

    ``ready`` holds each rank's start-up answer, ``rounds[i][rank]`` the decode of round i.
    Raises ValueError when no round has a steady window.
    """
    runs = [run for round_runs in rounds for run in round_runs]
    intervals: list[float] = []
    for run in runs:
        intervals += window_intervals(run["steps"], config.engine_batch, skip)
    m = Measurement(config, period=period_stats(intervals).to_dict())
    m.extra |= step_breakdown(runs, config.engine_batch, skip)
    m.extra |= speculation_summary(runs, config.engine_batch, skip)
    m.extra |= prefill_summary(runs)
    connectors = {info.get("kv_connector") for info in ready} - {None}
    if connectors:  # what the engines ran, not what was asked (absent without a connector)
        m.extra["kv_connector"] = ", ".join(sorted(connectors))
    m.extra["startup_s"] = max(info["startup_s"] for info in ready)
    m.extra["tokens_by_request"] = tokens_by_request(ready, rounds[0])
    ffn = ffn_window_summary(runs, config) if config.kind == "afd" else None
    if ffn:
        m.extra |= ffn
        k_eff = ffn["microbatches_effective"]
        if config.microbatches > 1 and k_eff < config.microbatches - 0.5:
            m.status = (
                f"unsupported: microbatches={config.microbatches} not in effect "
                f"(FFN saw {k_eff:.2f} requests per layer-step per attention rank)"
            )
    return m


def failure(config: BenchConfig, exc: Exception) -> Measurement:
    """A failed child: 'unsupported' when the product refused the microbatch count."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else text)
    if config.microbatches > 1 and "microbatch" in text.lower():
        return Measurement(config, status=f"unsupported: {reason[:160]}")
    return Measurement(config, status=f"failed: {reason[:160]}")


def compare_tokens(measurements: list[Measurement]) -> None:
    """Mark each configuration identical (or not) to single-rank colocated, request by request."""
    ref = next((m for m in measurements if m.config.kind == "colocated" and m.ok), None)
    if ref is None:
        return
    reference = ref.extra["tokens_by_request"]
    for m in measurements:
        tokens = m.extra.get("tokens_by_request")
        if not tokens:
            continue
        common = sorted(set(tokens) & set(reference))
        m.compared_requests = len(common)
        m.identical = bool(common) and all(tokens[i] == reference[i] for i in common)


# -- running ---------------------------------------------------------------------------------------


def pair_schedule(num_configs: int, rounds: int) -> list[tuple]:
    """The run's actions: the baseline (config 0) runs throughout; every other configuration is
    started, decoded ``rounds`` times alternating with the baseline, and stopped again.

    Actions: ``("start", i)``, ``("decode", i, round)``, ``("stop", i)``. Alternating with the
    baseline puts every configuration side by side with the one S_all is taken against, and
    keeping only two configurations alive keeps the idle ones' background work (pollers, Ray
    workers) off the measurement. Within a pair the order flips every round.
    """
    actions: list[tuple] = [("start", 0)]
    for i in range(1, num_configs):
        actions.append(("start", i))
        for r in range(rounds):
            pair = [(0, r), (i, r)] if r % 2 == 0 else [(i, r), (0, r)]
            actions += [("decode", c, rr) for c, rr in pair]
        actions.append(("stop", i))
    if num_configs == 1:
        actions += [("decode", 0, r) for r in range(rounds)]
    return actions + [("stop", 0)]


class Session:
    """The running children of the configurations; decodes; measurements at the end."""

    def __init__(self, configs: list[BenchConfig], settings: dict[str, Any], log_dir: Path):
        self.configs, self.settings, self.log_dir = configs, settings, log_dir
        self.groups: dict[str, Any] = {}
        self.ready: dict[str, list[dict]] = {}
        self.rounds: dict[str, list[list[dict]]] = {c.name: [] for c in configs}
        self.errors: dict[str, Exception] = {}

    def start(self, config: BenchConfig) -> None:
        from vllm_afd.bench.launch import ChildGroup

        group = ChildGroup(job_for(config, self.settings), self.settings["threads"], self.log_dir)
        self.groups[config.name] = group
        try:
            self.ready[config.name] = group.start()
        except Exception as exc:  # noqa: BLE001 - reported as the configuration's status
            self._fail(config, exc)

    def decode(self, config: BenchConfig, round_index: int) -> None:
        if config.name in self.errors:
            return
        try:
            tag = f"r{round_index}-{len(self.rounds[config.name])}"  # request ids stay unique
            answers = self.groups[config.name].run({"cmd": "run", "tag": tag})
            self.rounds[config.name].append(answers)
        except Exception as exc:  # noqa: BLE001
            self._fail(config, exc)

    def stop(self, config: BenchConfig) -> None:
        group = self.groups.pop(config.name, None)
        if group is not None:
            group.close()

    def _fail(self, config: BenchConfig, exc: Exception) -> None:
        self.errors[config.name] = exc
        self.stop(config)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()

    def measurement(self, config: BenchConfig) -> Measurement:
        if config.name in self.errors:
            return failure(config, self.errors[config.name])
        try:
            return measure(
                config, self.ready[config.name], self.rounds[config.name], self.settings["skip"]
            )
        except ValueError as exc:  # no steady window
            return Measurement(config, status=f"failed: {exc}")


def run_all(
    configs: list[BenchConfig], settings: dict[str, Any], log_dir: Path
) -> list[Measurement]:
    """Run ``pair_schedule`` over the configurations (config 0 the baseline), progress bar."""
    from tqdm import tqdm

    from vllm_afd.bench.launch import SharedRay

    ffn_ranks = sum(c.ffn_ranks for c in configs)  # logical CPUs: a lingering group can't block
    ray = SharedRay(num_cpus=max(os.cpu_count() or 1, ffn_ranks)) if ffn_ranks else None
    settings = {**settings, "ray_address": ray.address if ray else None}
    session = Session(configs, settings, log_dir)
    actions = pair_schedule(len(configs), settings["rounds"])
    bar = tqdm(total=len(actions), desc="vllm-afd bench", unit="step", file=sys.stderr)
    try:
        for action, index, *rest in actions:
            config = configs[index]
            label = f"round {rest[0] + 1}: " if rest else f"{action} "
            bar.set_postfix_str(label + config.name)
            getattr(session, action)(config, *rest)
            bar.update()
    finally:
        bar.close()
        session.close()
        if ray is not None:
            ray.close()
    return [session.measurement(c) for c in configs]


def add_predictions(
    rows: list[dict], settings: dict[str, Any], profile: str, cpus: int | None = None
) -> None:
    """The planner's CPU prediction and its error for every measured row.

    The planner's unit is a device; here a rank with ``threads`` cores of its own. A
    configuration with more rank cores than the ``cpus`` this bench may use (default: its
    affinity) time-shares cores, which the model does not describe: such a row gets the
    prediction for its layout with one device per rank and a ``prediction_note``, but no error.
    With a speculative config every rank verifies ``1 + d`` positions per request and step.
    """
    from vllm_afd.planner.cpu import load_cpu_fit, predict_afd, predict_colocated
    from vllm_afd.planner.models import get_model

    fit = load_cpu_fit(profile)
    model = get_model(settings["model"])
    context = settings["prompt_len"] + settings["output_len"] / 2
    cpus = cpus or len(os.sched_getaffinity(0))
    d = draft_length(settings)
    for row in rows:
        if "step_ms" not in row or row["kind"] == "wide-ep":
            continue
        cores = row["devices"] * settings["threads"]
        b = row["per_rank_batch"]
        if row["kind"] == "afd":
            k = 1 if row["status"].startswith("unsupported") else row["microbatches"]
            r = row["attention_ranks"] / row["ffn_ranks"]
            pred = predict_afd(fit, model, b, r, row["ffn_ranks"], context, min(k, 2), d)
        else:
            pred = predict_colocated(fit, model, b, context, d)
        row |= pred.to_dict()
        if cores > cpus:
            row["prediction_note"] = (
                f"{row['devices']} ranks x {settings['threads']} thread(s) on {cpus} CPUs share "
                "cores; the planner assumes a device per rank, so no error is given"
            )
            continue
        row["error_pct"] = prediction_error(row["predicted_ms"], row["step_ms"])
    add_baseline_scaled_errors(rows)


def add_baseline_scaled_errors(rows: list[dict]) -> None:
    """Errors of the predictions scaled by the colocated baseline's measured / predicted step.

    A profile describes the machine when it ran; on a shared VM the same colocated engine is
    10-20% slower or faster minutes later, and every configuration of a bench run moves with
    it. Scaling by the baseline measured side by side in the same run removes that drift and
    leaves the model's error on what the planner decides from, the step relative to colocated
    (``predicted_scaled_ms``, ``error_scaled_pct``; the raw ``error_pct`` stays).
    """
    base = next((r for r in rows if r.get("baseline") and "error_pct" in r), None)
    if base is None:
        return
    scale = base["step_ms"] / base["predicted_ms"]
    for row in rows:
        if "error_pct" in row:
            row["predicted_scaled_ms"] = row["predicted_ms"] * scale
            row["error_scaled_pct"] = prediction_error(row["predicted_scaled_ms"], row["step_ms"])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    if not settings["model"]:
        from vllm_afd.bench.tiny_models import default_tiny_model

        settings["model"] = str(default_tiny_model(**settings.get("tiny_model", {})))
    configs = build_configs(settings)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm_afd_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"[vllm-afd bench] model {settings['model']}; {len(configs)} configurations; "
        f"logs in {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    measurements = run_all(configs, settings, log_dir)
    compare_tokens(measurements)
    rows = build_rows(measurements)
    for row in rows:
        row.pop("tokens_by_request", None)
    if args.profile:
        add_predictions(rows, settings, args.profile)
    from vllm_afd.bench.report import print_table, write_plot

    print_table(rows, settings)
    if settings.get("kv_transfer_config"):
        print(prefill_table(rows, settings))
    report = {
        "settings": _jsonable(settings),
        "rows": rows,
        "wall_s": time.perf_counter() - start,
        "cpus": os.cpu_count(),
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(rows, args.plot)
    failed = [r for r in rows if r["status"].startswith("failed") or r["identical"] is False]
    sys.exit(1 if failed else 0)


def prefill_table(rows: list[dict], settings: dict[str, Any]) -> str:
    """The KV connector each configuration ran and what its prompts cost (printed with a
    ``--kv-transfer-config``, after the main table)."""
    kv = json.dumps(settings.get("kv_transfer_config"), separators=(",", ":"))
    head = ("config", "kv connector", "prompt computed / request", "prefill steps", "prefill ms")
    table = [head]
    for row in rows:
        computed = "-"
        if "prompt_tokens_computed" in row:
            computed = f"{row['prompt_tokens_computed']:.1f} of {row['prompt_tokens']:.0f}"
        steps = row.get("prefill_steps")
        ms = row.get("prefill_ms")
        table.append(
            (
                row["name"],
                row.get("kv_connector") or "-",
                computed,
                "-" if steps is None else f"{steps:g}",
                "-" if ms is None else f"{ms:.2f}",
            )
        )
    widths = [max(len(line[j]) for line in table) for j in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "-" * len(lines[0]))
    title = f"KV transfer config {kv} in every configuration; prompts:"
    return "\n".join([title] + [line.rstrip() for line in lines])


def _jsonable(settings: dict[str, Any]) -> dict[str, Any]:
    out = dict(settings)
    out["ratios"] = [f"{a}:{f}" for a, f in settings["ratios"]]
    return out
