"""`vllm-afd plan`: the planner's command line.

    vllm-afd plan --model M --hardware H --context C [options]    table per ratio (or --json)
    vllm-afd plan predict --candidates FILE.csv [--hardware H]    Eq. 3 for each CSV row

`add_plan_parser(subparsers)` adds the `plan` subcommand to a host CLI; the host calls
`args.func(args)`, which returns the exit code. `main(argv)` runs standalone
(`python -m vllm_afd.planner.cli plan ...`; the leading `plan` may be left out). Flags are parsed
and checked here only; every invalid input exits with status 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from vllm_afd.planner.analytical import afd_step
from vllm_afd.planner.hardware import HARDWARE_PRESETS, Hardware, get_hardware
from vllm_afd.planner.memory import MemoryAssumptions
from vllm_afd.planner.models import MODEL_PRESETS, ModelSpec, get_model
from vllm_afd.planner.planning import PlanRequest, PlanResult, RatioPrediction, plan
from vllm_afd.planner.profile_io import ProfilePoint, format_context, load_profile, parse_context

PREDICT_COLUMNS = ("model", "context", "d", "ratio", "batch", "dv_ms", "kappa", "t_draft_ms")


class InputError(Exception):
    """An invalid input found after parsing; `flag` names the option at fault."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}" if flag else message)


# -- argument types (argparse turns ArgumentTypeError into exit 2 naming the flag) ---------------


def _type(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a converter so that its ValueError becomes argparse's 'argument --flag: ...' exit 2."""

    def convert(text: str) -> Any:
        try:
            return fn(text)
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = fn.__name__
    return convert


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers like 1,3,5, got {text!r}")
    return values


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"no such file: {text}")
    return path


# -- parser -------------------------------------------------------------------------------------


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `plan` (and `plan predict`) to an argparse subparsers object; returns the parser."""
    parser = subparsers.add_parser(
        "plan",
        help="predict AFD throughput per attention:FFN ratio and recommend one",
        description="Predict AFD decode throughput per ratio with the FastAFD model and pick "
        "the ratio with the highest tokens/s per GPU counting all GPUs.",
    )
    _add_workload_flags(parser)
    _add_deployment_flags(parser)
    actions = parser.add_subparsers(dest="plan_action", metavar="{predict}")
    predict = _add_predict_parser(actions)
    parser.set_defaults(func=lambda args: run(args, parser, predict))
    return parser


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    models, hardware = ", ".join(MODEL_PRESETS), ", ".join(HARDWARE_PRESETS)
    add("--model", type=_type(get_model), help=f"preset ({models}) or config.json / model dir")
    add(
        "--hardware",
        type=_type(get_hardware),
        default="gb200",
        help=f"preset ({hardware}) or a .yaml/.json file (default gb200)",
    )
    add("--context", type=_type(parse_context), help="prompt tokens, e.g. 8K")
    add("--output-len", type=_type(int), default=1024, help="output tokens (default 1024)")
    add("--draft-length", type=_type(int), default=0, help="speculative draft length d")
    add("--acceptance", type=_type(float), default=1.0, help="accepted tokens per step (1)")
    add("--profile", type=_type(_existing_file), help="colocated profile JSON/CSV")
    add("--dv-ms", type=_type(float), help="D_V in ms (overrides the profile)")
    add("--kappa", type=_type(_positive_float), help="speculative attention factor")


def _add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--ratios", type=_type(_int_list), help="attention GPUs per FFN GPU, e.g. 1,3,5")
    add("--ffn-gpus", type=_type(_positive_int), help="FFN pool size")
    add("--batch", type=_type(_positive_int), help="b_A override (per attention GPU)")
    add("--no-tune-batch", action="store_true", help="keep the KV-full b_A")
    add("--baseline-ep", type=_type(_int_list), help="wide-EP widths to model, e.g. 16,32")
    add("--baseline-batch", type=_type(_positive_int), help="measured wide-EP batch b_V")
    add("--baseline-step-ms", type=_type(_positive_float), help="measured wide-EP step T_V")
    add("--tolerance", type=_type(_positive_float), default=0.10, help="NFP tolerance (0.10)")
    add("--reserved-gb", type=_type(float), default=2.0, help="HBM kept from KV cache (2 GB)")
    add("--json", action="store_true", help="print JSON instead of a table")
    add("--plot", type=Path, help="write throughput/speedup vs ratio to a PNG")


def _add_predict_parser(actions: Any) -> argparse.ArgumentParser:
    predict = actions.add_parser("predict", help="predicted step (ms) for candidate rows")
    add = predict.add_argument
    add(
        "--candidates",
        type=_type(_existing_file),
        required=True,
        help=f"CSV with columns {','.join(PREDICT_COLUMNS)} (kappa, t_draft_ms may be empty)",
    )
    add("--hardware", type=_type(get_hardware), default="gb200", dest="hw", metavar="HARDWARE")
    add(
        "--ffn-gpus",
        type=_type(_positive_int),
        dest="pool",
        metavar="N",
        help="FFN pool size (default: the hardware's pool, else GPUs per node)",
    )
    return predict


def build_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="vllm-afd")
    add_plan_parser(root.add_subparsers(dest="command", required=True))
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        argv.insert(0, "plan")
    args = build_parser().parse_args(argv)
    return args.func(args)


def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    predict_parser: argparse.ArgumentParser,
) -> int:
    """Run `plan` or `plan predict`; input errors exit 2 through the matching parser."""
    try:
        if args.plan_action == "predict":
            return _run_predict(args, sys.stdout)
        return _run_plan(args, sys.stdout)
    except InputError as exc:
        (predict_parser if args.plan_action == "predict" else parser).error(str(exc))
    return 2  # not reached: parser.error exits


# -- plan ---------------------------------------------------------------------------------------


def _request(args: argparse.Namespace) -> PlanRequest:
    missing = [f for f, v in (("--model", args.model), ("--context", args.context)) if v is None]
    if missing:
        raise InputError("", f"the following arguments are required: {', '.join(missing)}")
    if (args.baseline_batch is None) != (args.baseline_step_ms is None):
        raise InputError("--baseline-batch", "goes together with --baseline-step-ms")
    try:
        return PlanRequest(
            model=args.model,
            hardware=args.hardware,
            context=args.context,
            output_len=args.output_len,
            draft_length=args.draft_length,
            acceptance=args.acceptance,
            ratios=args.ratios,
            ffn_gpus=args.ffn_gpus,
            batch=args.batch,
            tune_batch=not args.no_tune_batch,
            baseline_eps=args.baseline_ep,
            baseline_batch=args.baseline_batch,
            baseline_step_ms=args.baseline_step_ms,
            tolerance=args.tolerance,
            memory=MemoryAssumptions(reserved_bytes=args.reserved_gb * 1e9),
        )
    except ValueError as exc:
        raise InputError(_flag_of(str(exc)), str(exc)) from None


def _flag_of(message: str) -> str:
    """The CLI flag behind a `PlanRequest.<field>` / `MemoryAssumptions.<field>` message."""
    for prefix in ("PlanRequest.", "MemoryAssumptions."):
        if message.startswith(prefix):
            field = message[len(prefix) :].split(" ", 1)[0]
            renamed = {"reserved_bytes": "reserved_gb", "baseline_eps": "baseline_ep"}
            return "--" + renamed.get(field, field).replace("_", "-")
    return ""


def _run_plan(args: argparse.Namespace, out: TextIO) -> int:
    req = _request(args)
    profile = None
    if args.profile is not None:
        try:
            profile = load_profile(args.profile, model=req.model.name)
        except ValueError as exc:
            raise InputError("--profile", str(exc)) from None
    try:
        result = plan(req, profile=profile, dv_ms=args.dv_ms, kappa=args.kappa)
    except ValueError as exc:
        hint = "; pass --dv-ms or a --profile that covers it" if "no point" in str(exc) else ""
        raise InputError("", f"{exc}{hint}") from None
    if args.json:
        out.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        out.write(format_table(result))
    if args.plot is not None:
        write_plot(result, args.plot)
        if not args.json:
            out.write(f"plot written to {args.plot}\n")
    return 0


def _ratio(row: RatioPrediction) -> str:
    return f"{row.ratio:g}:1"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: PlanResult) -> str:
    """The human-readable plan: inputs, one line per ratio, the recommendation, NFP, notes."""
    req, hw, p = result.request, result.hardware, result.point
    calibrated = "calibrated" if hw.calibrated else "not calibrated"
    lines = [
        f"AFD plan: {req.model.name} on {hw.name} ({calibrated}), context "
        f"{format_context(req.context)} + {req.output_len} out, d={req.draft_length}",
        f"D_V {p.dv_ms:.3f} ms, kappa {p.kappa:.4f} from {result.dv_source}; "
        f"KV-full b_A {result.max_batch}",
        _baseline_line(result),
        "",
        f"{'A:F':>6} {'GPUs':>7} {'b_A':>5} {'step ms':>8} {'tok/s/GPU':>10} "
        f"{'tok/s/attn':>10} {'S_all':>6} {'S_att':>6}  covered",
    ]
    for row in result.rows:
        lines.append(
            f"{_ratio(row):>6} {row.attn_gpus:>3}+{row.ffn_gpus:<3} {row.batch:>5} "
            f"{row.step_ms:>8.2f} {row.tokens_per_gpu:>10.1f} {row.tokens_per_attn_gpu:>10.1f} "
            f"{_num(row.s_all, '.3f'):>6} {_num(row.s_att, '.3f'):>6}  "
            f"{'yes' if row.covered else 'no (FFN exposed)'}"
        )
    lines += ["", *_summary_lines(result), "notes:", *(f"  - {n}" for n in result.notes)]
    return "\n".join(lines) + "\n"


def _baseline_line(result: PlanResult) -> str:
    b = result.baseline
    if b is None:
        return "baseline: none fits (S_all not computed)"
    return (
        f"baseline: wide EP{b.ep}, b_V {b.batch}, {b.step_ms:.2f} ms/step, "
        f"{b.tokens_per_gpu:.1f} tok/s/GPU ({b.source})"
    )


def _summary_lines(result: PlanResult) -> list[str]:
    rec, att, ffn = result.recommended, result.attention_budget, result.ffn_budget
    line = (
        f"recommended: {_ratio(rec)} ({rec.attn_gpus} attention + {rec.ffn_gpus} FFN GPUs), "
        f"b_A {rec.batch}, {rec.step_ms:.2f} ms/step, {rec.tokens_per_gpu:.1f} tok/s/GPU"
    )
    d = rec.decomposition
    if d is not None and result.baseline is not None:  # a decomposition is against it
        line += (
            f", S_all {d.s_all:.3f} = batch {d.batch_gain:.3f} x overlap {d.overlap_gain:.3f} "
            f"x cost {d.disaggregation_cost:.3f} ({'wins' if d.wins else 'does not win'}"
            f" against the {result.baseline.source} baseline)"
        )
    return [
        line,
        f"coverage boundary at b_A {rec.batch}: FFN hidden in every layer up to "
        f"r = {result.coverage_boundary:.2f}",
        f"near-free parallelism ({att.tolerance:.0%} tolerance): attention q <= {att.positions} "
        f"(idle-compute estimate {att.idle_compute}) -> draft length <= "
        f"{result.recommended_draft_length}; FFN <= {ffn.positions} routed tokens per FFN GPU "
        f"(idle-compute {ffn.idle_compute}); recommended ratio routes {rec.routed_tokens:.0f}"
        f"{'' if rec.ffn_near_free else ' (beyond near-free)'}",
    ]


def write_plot(result: PlanResult, path: Path) -> None:
    """Throughput and speedup against the ratio, coverage boundary and recommendation marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot", "needs matplotlib (pip install 'vllm-afd[plot]')") from None
    ratios = [r.ratio for r in result.rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(ratios, [r.tokens_per_gpu for r in result.rows], "o-", label="tok/s per GPU (all)")
    left.plot(ratios, [r.tokens_per_attn_gpu for r in result.rows], "s--", label="per attn GPU")
    left.set_ylabel("decode tokens/s per GPU")
    if result.baseline is not None:
        left.axhline(result.baseline.tokens_per_gpu, color="gray", lw=1, label="wide EP")
        right.plot(ratios, [r.s_all for r in result.rows], "o-", label="S_all")
        right.plot(ratios, [r.s_att for r in result.rows], "s--", label="S_att")
        right.axhline(1.0, color="gray", lw=1)
    right.set_ylabel("speedup over wide EP")
    rec = result.recommended
    for ax in (left, right):
        ax.axvline(result.coverage_boundary, color="tab:red", ls=":", label="coverage boundary")
        ax.axvline(rec.ratio, color="tab:green", lw=0.8, label=f"recommended {rec.ratio:g}:1")
        ax.set_xlabel("attention GPUs per FFN GPU (r)")
        ax.legend(fontsize=8)
    req = result.request
    title = f"{req.model.name} on {result.hardware.name}, {format_context(req.context)}"
    fig.suptitle(f"{title}, d={req.draft_length}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- plan predict -------------------------------------------------------------------------------


def _run_predict(args: argparse.Namespace, out: TextIO) -> int:
    hw: Hardware = args.hw
    pool = args.pool or hw.ffn_pool_gpus or hw.gpus_per_node
    with open(args.candidates, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in PREDICT_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise InputError("--candidates", f"{args.candidates} lacks column(s) {missing}")
        rows = list(reader)
        fields = list(reader.fieldnames or ()) + ["predicted_ms"]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for line, row in enumerate(rows, start=2):
        try:
            step_ms = predict_row_ms(row, hw, pool)
        except ValueError as exc:
            raise InputError("--candidates", f"{args.candidates} line {line}: {exc}") from None
        writer.writerow(row | {"predicted_ms": f"{step_ms:.4f}"})
    return 0


def predict_row_ms(row: dict[str, str], hw: Hardware, ffn_gpus: int) -> float:
    """Eq. 3 for one candidate row (model, context, d, ratio, batch, dv_ms, kappa, t_draft_ms)."""
    model: ModelSpec = get_model(row["model"])
    point = ProfilePoint(
        context=parse_context(row["context"]),
        dv_ms=float(row["dv_ms"]),
        draft_length=int(row["d"]),
        kappa=float(row["kappa"]) if (row.get("kappa") or "").strip() else 1.0,
        t_draft_rest_ms=float(row["t_draft_ms"]) if (row.get("t_draft_ms") or "").strip() else None,
    )
    step = afd_step(model, hw, point, float(row["batch"]), float(row["ratio"]), ffn_gpus)
    return step.step_s * 1e3


if __name__ == "__main__":
    sys.exit(main())
