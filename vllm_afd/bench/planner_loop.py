"""The planner in the loop against what a live server measures (issue 43's check).

    python -m vllm_afd.bench.planner_loop --profile P.json [--model DIR] [--ratio 1:1]
        [--microbatches 2] [--batches 2,4] [--windows 2] [--scale-to 2] [--max-tokens 96]
        [--json loop.json]

One ``vllm-afd serve MODEL --afd-ratio A:F`` (default: the trained SmolLM2-MoE at 1:1) with the
planner inputs ``vllm-afd profile`` wrote (``VLLM_AFD_PLAN_PROFILE``: on the CPU build the
advisor predicts with the profile's CPU step model). For each ``--batches`` size ``b``, ``b``
clients stream greedy completions back to back; after one window to settle, ``--windows``
windows of the advisor (``placement.autoscale``, one every 10 s) are read from ``/metrics``:
the measured decode step (``vllm_afd_window_step_seconds``) next to the planner's prediction
for the live FFN rank count (``vllm_afd_planner_predicted_step_seconds``), with the window's
batch, context and ``vllm_afd_window_disturbed``. Then, under the last load, ``POST
/afd/scale`` to ``--scale-to`` FFN ranks, and the windows until one is undisturbed: the live
count and its prediction after the scale.

Prints a table and writes JSON; exits 1 if a request failed or the server gave no window. The
10% agreement is read from the table, never asserted (the VM's speed drifts minutes apart).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_afd import envs
from vllm_afd.bench.server import ServeProcess, exit_on_sigterm, http_request
from vllm_afd.bench.soak import client_prompt, parse_metrics

#: The advisor's gauges read per window (``metrics.collector``).
SERIES = (
    "vllm_afd_window_step_seconds",
    "vllm_afd_window_batch_requests",
    "vllm_afd_window_context_tokens",
    "vllm_afd_window_disturbed",
    "vllm_afd_planner_predicted_step_seconds",
)


class Load:
    """``clients`` threads streaming greedy completions back to back until ``stop``."""

    def __init__(self, server: ServeProcess, clients: int, max_tokens: int) -> None:
        self.server, self.max_tokens = server, max_tokens
        self.errors: list[str] = []  # of the requests that failed
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(c,), daemon=True) for c in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, client: int) -> None:
        while not self._stop.is_set():
            try:
                got = self.server.stream(client_prompt(client), self.max_tokens)
                ok = got.status == 200 and len(got.token_ids) == self.max_tokens
                error = got.error
            except (OSError, ValueError) as exc:
                ok, error = False, repr(exc)
            if not ok:
                self.errors.append(error[:300])
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)


def _status(server: ServeProcess) -> tuple[dict, float | None]:
    """The full ``/afd/status`` and when its latest advice was published (``None``: none)."""
    status, body = http_request(server.url + "/afd/status", headers=server.admin_headers())
    body = body if status == 200 and isinstance(body, dict) else {}
    live = body.get("live")
    return body, live.get("at") if live else None


def next_window(server: ServeProcess, after: float | None, timeout_s: float = 60.0) -> dict:
    """The advisor's next window after the one published at ``after``, as ``/metrics`` and
    ``/afd/status`` give it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body, at = _status(server)
        if at is not None and at != after:
            metrics = parse_metrics(str(http_request(server.url + "/metrics")[1]), SERIES)
            return {"at": at, "status": body, "metrics": metrics}
        time.sleep(0.5)
    raise TimeoutError(f"no advisor window in {timeout_s:g} s:\n{server.tail()}")


def window_row(phase: str, window: dict) -> dict[str, Any]:
    """One table row: the measured window and the prediction for the live count."""
    status, metrics = window["status"], window["metrics"]
    live = status["num_ffn_ranks"]

    def gauge(name: str, labels: str = "") -> float | None:
        pattern = re.compile(rf"^{name}\{{[^}}]*{labels}[^}}]*\}}$")
        return next((v for k, v in metrics.items() if pattern.match(k)), None)

    measured = gauge("vllm_afd_window_step_seconds")
    predicted = gauge("vllm_afd_planner_predicted_step_seconds", f'num_ffn_ranks="{live}"')
    advice = status.get("live") or {}
    parts = advice.get("window", {})
    return {
        "phase": phase,
        "num_ffn_ranks": live,
        "ratio": status["ratio"],
        "batch": gauge("vllm_afd_window_batch_requests"),
        "context": gauge("vllm_afd_window_context_tokens"),
        "measured_ms": None if measured is None else 1e3 * measured,
        "predicted_ms": None if predicted is None else 1e3 * predicted,
        "predicted_over_measured": None if not (measured and predicted) else predicted / measured,
        # the window's parts (ms): attention per layer, exposed FFN wait and FFN service
        **{k: parts.get(k) for k in ("attention_ms", "exposed_ffn_ms", "ffn_ms", "cpu_stolen")},
        "disturbed": parts.get("disturbed", ""),
        "rule": advice.get("rule"),
        "reason": advice.get("reason"),
        "model": advice.get("model"),
    }


def run(server: ServeProcess, args: argparse.Namespace, say: Callable[[str], None]) -> dict:
    rows: list[dict] = []
    at = _status(server)[1]
    load = None
    errors: list[str] = []
    try:
        for batch in args.batches:
            if load is not None:
                load.stop()
                errors += load.errors
            load = Load(server, batch, args.max_tokens)
            at = next_window(server, at)["at"]  # settles: it may hold the previous load
            for _ in range(args.windows):
                window = next_window(server, at)
                at = window["at"]
                rows.append(window_row(f"{batch} streams", window))
                say(_row_text(rows[-1]))
        if args.scale_to:
            status, body = http_request(
                server.url + "/afd/scale",
                {"num_ffn_ranks": args.scale_to},
                timeout=600,
                headers=server.admin_headers(),
            )
            say(f"planner_loop: scale to {args.scale_to}: HTTP {status}")
            if status != 200:
                raise RuntimeError(f"the scale failed: {body}")
            # the windows holding the scale (marked), then ``--windows`` undisturbed ones
            undisturbed = 0
            for _ in range(args.windows + 4):
                window = next_window(server, at)
                at = window["at"]
                rows.append(window_row(f"after scale to {args.scale_to}", window))
                say(_row_text(rows[-1]))
                undisturbed += not rows[-1]["disturbed"]
                if undisturbed == args.windows:
                    break
    finally:
        if load is not None:
            load.stop()
            errors += load.errors
    return {"rows": rows, "failed_requests": len(errors), "errors": errors}


def _row_text(row: dict) -> str:
    def f(value, spec="{:.2f}"):
        return "-" if value is None else spec.format(value)

    return (
        f"{row['phase']:<18} {row['ratio']:>5} {f(row['batch']):>6}"
        f" {f(row['context'], '{:.0f}'):>7}"
        f" {f(row['measured_ms']):>9} {f(row['predicted_ms']):>9}"
        f" {f(row['predicted_over_measured'], '{:.3f}'):>10}"
        f" {f(row.get('attention_ms'), '{:.3f}'):>10} {f(row.get('exposed_ffn_ms'), '{:.3f}'):>8}"
        f" {f(row.get('ffn_ms'), '{:.3f}'):>6} {f(row.get('cpu_stolen'), '{:.1%}'):>7}"
        f"  {row['disturbed'] or '-'}"
    )


HEADER = (
    f"{'phase':<18} {'A:F':>5} {'batch':>6} {'context':>7} {'meas ms':>9} {'pred ms':>9} "
    f"{'pred/meas':>10} {'attn/layer':>10} {'exposed':>8} {'ffn':>6} {'stolen':>7}  disturbed"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_afd.bench.planner_loop")
    p.add_argument("--profile", required=True, help="a profile `vllm-afd profile` wrote")
    p.add_argument("--model", help="model directory (default: the trained SmolLM2-MoE)")
    p.add_argument("--ratio", default="1:1", help="--afd-ratio A:F (default 1:1)")
    p.add_argument("--microbatches", type=int, default=2, help="--afd-microbatches (2)")
    p.add_argument("--batches", default="2,4", help="streams per load step (default 2,4)")
    p.add_argument(
        "--windows", type=int, default=2, help="windows per load, and after the scale (2)"
    )
    p.add_argument("--scale-to", type=int, default=2, help="FFN ranks to scale to (0: none)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per request (96)")
    p.add_argument("--json", default="planner_loop.json", help="result file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.windows < 1 or args.max_tokens < 1:
        raise SystemExit("planner_loop: --batches, --windows and --max-tokens must be >= 1")
    if args.model is None:
        from vllm_afd.bench.real_model import default_real_model

        args.model = str(default_real_model())
    json_path = Path(args.json)
    log = json_path.with_suffix(".server.log")
    env = {"VLLM_PLUGINS": "afd", envs.PLAN_PROFILE: str(Path(args.profile).resolve())}
    flags = ("--afd-ratio", args.ratio, "--afd-microbatches", str(args.microbatches))
    exit_on_sigterm()  # its ``finally`` stops the server
    server = ServeProcess(args.model, log, flags, env=env)
    print(f"planner_loop: server pid {server.proc.pid} on {server.url}, log {log}", flush=True)
    try:
        server.wait_healthy(timeout=600.0)
        print(HEADER, flush=True)
        result = run(server, args, lambda text: print(text, flush=True))
    finally:
        leftovers = server.stop()
    rows = result["rows"]
    print("\n" + HEADER)
    for row in rows:
        print(_row_text(row))
    steady = [
        r
        for r in rows
        if r["phase"].endswith("streams") and not r["disturbed"] and r["predicted_over_measured"]
    ]
    within = [r for r in steady if abs(r["predicted_over_measured"] - 1) <= 0.10]
    print(f"\nundisturbed steady-load windows within 10%: {len(within)} of {len(steady)}")
    after = [r for r in rows if not r["phase"].endswith("streams") and not r["disturbed"]]
    if after:
        last = after[-1]
        measured, predicted = (last[k] or math.nan for k in ("measured_ms", "predicted_ms"))
        print(
            f"after the scale: {last['num_ffn_ranks']} FFN rank(s) live, measured "
            f"{measured:.2f} ms, predicted {predicted:.2f} ms"
        )
    if rows and rows[-1].get("model"):
        print(f"planner: {rows[-1]['model']}")
    settings = {k: getattr(args, k) for k in vars(args)}
    json_path.write_text(
        json.dumps({"settings": settings, **result, "leftovers": leftovers}, indent=1)
    )
    print(f"planner_loop: wrote {json_path}")
    return 1 if result["failed_requests"] or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
