"""Soak benchmark: FFN failover (or a live scale of the FFN pool) under sustained streaming load.

    python -m vllm_afd.bench.soak [--model DIR] [--ratio 2:1] [--transport NAME] [--clients 6]
                                  [--minutes 3] [--kill-every 45] [--scale-to N,N,...]
                                  [--max-tokens 128] [--json soak.json]

With ``--scale-to 2,1`` the soak scales the pool instead of killing a rank: every
``--kill-every`` seconds one ``POST /afd/scale`` to the next count, and the report gives each
scale's answer, time and step hold, and the inter-token latency (p50/p99 of the gaps between a
stream's chunks) in the ``--margin`` seconds before it, while it ran and after it
(``itl_windows``); every request is still checked against its reference.

Why a soak and not only the e2e test. ``tests/e2e/test_server.py`` kills and stops the FFN
rank (four losses in ``make test-all``), each under one fixed burst of six streams, and checks
that nothing is lost. That proves the
mechanism; it says nothing about what a user of a loaded server sees over minutes of repeated
failures: how long the server takes to notice, how long requests stall, whether the damage
stays inside the failover or leaks into the requests that follow, and whether anything (a
request, a token, a counter) goes astray when kills land at arbitrary points of a continuous
stream instead of 1.5 s after a burst started. This module measures that, as a benchmark: it
reports numbers and exits 1 if a request was lost or changed, but it has no thresholds.

What it does:

1. starts one ``vllm-afd serve MODEL --afd-ratio A:F`` on 127.0.0.1 in its own session
   (``ServeProcess``: the flags of the e2e suite's server, float32 so that greedy text is
   comparable request by request), and stops it at the end, whatever happened: SIGTERM, then
   SIGKILL for whatever is still alive in its session (Ray's daemons and workers, engine cores
   and FFN ranks all stay in the session the server started);
2. takes the reference: one streamed greedy completion per client prompt, one at a time, from
   the same server before any kill (the same engine, flags and sampling as the soak's requests;
   equality with colocated vLLM is the e2e suite's business, not this one's);
3. runs ``--clients`` threads, each sending its own prompt again and again as streamed greedy
   completions (temperature 0, ``ignore_eos``, ``--max-tokens`` tokens) for ``--minutes``;
4. every ``--kill-every`` seconds SIGKILLs FFN rank ``--ffn-rank``'s current process (the pid of
   the latest ``AFD: FFN rank R up: pid N`` line of the server log; SIGKILL because it is the
   failure nobody can clean up after: the OOM killer, a crashed driver), then polls readiness
   (``/afd/ready``; the server runs with ``VLLM_PLUGINS=afd``) every 0.1 s until it is not 200
   (detection) and until it is 200 again (liveness, ``/health``, stays 200 through a failover);
5. after the last client finished, reads the failover series of ``/metrics`` and the
   ``replaced in X s`` lines of the server log.

Recorded per request: client, start and end (seconds since the soak started), HTTP status
(0: no answer: connection refused or reset, timeout), tokens received, time to first token,
the longest gap between two chunks (the stall a failover causes), and whether text and token
ids equal the reference. A request is *completed* when it has status 200 and all its tokens,
*failed* (lost) otherwise, and *wrong* when completed with another text or other tokens.

Latency windows. Overall p50/p99 mixes the failovers' cost with ordinary queueing. The report
splits it: requests *in flight at a kill* (started before and finished after it) carry the
stall; *steady* requests started and finished at least ``--margin`` (10) seconds away from
every kill: the same server and load without the failover. The rest (started or finished near
a kill, but not spanning it) is counted in neither window.

Kill spacing. The supervisor counts a rank that dies within ``placement.FAILOVER_STABLE_S``
(30 s) of its start as failing again *in a row*: it waits 0, 1, 3, 7, 15 s before the 1st to
5th replacement of a streak and gives up on the rank after ``FAILOVER_MAX_STREAK`` (5), so that
a crash-looping rank does not restart forever. With ``--kill-every`` under 30 s plus the
recovery time, every kill continues the streak: the report shows the streak of each failover
(``failure N in a row`` in the log), and more than five such kills make the server give up on
the rank by design (the soak then reports failed requests).

The pure functions (``percentile`` from ``bench.window``, ``windows``, ``summarize``,
``parse_failovers``, ``parse_metrics``, ``format_report``) are unit-tested with synthetic
records in tests/unit/bench/test_soak.py; docs/benchmarks.md ("Soak: failover under load") has
a run's table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_afd.bench.server import ServeProcess, exit_on_sigterm, http_request
from vllm_afd.bench.window import percentile

#: One prompt per client (client i takes PROMPTS[i % len] plus its number): different lengths,
#: so that prefill chunks and decodes of several sizes are in flight when a kill lands.
PROMPTS = [
    "hello world",
    "The attention ranks keep the KV cache while the FFN ranks " * 4,
    "The attention ranks keep the KV cache while the FFN ranks hold experts",
    "def g(n):\n    return [i * i for i in range(n)]\n" * 6,
    "Failover keeps every request",
    "one two three four five six",
]
#: The metric families of the report (summed per label set as /metrics gives them).
METRIC_SERIES = (
    "vllm_afd_ffn_failovers_total",
    "vllm_afd_ffn_recovery_seconds_sum",
    "vllm_afd_ffn_recovery_seconds_count",
    "vllm_afd_redispatched_requests_total",
    "vllm_afd_ffn_ranks",
    "vllm_afd_ffn_pool_scale_seconds_count",
    "vllm_afd_ffn_pool_scale_seconds_sum",
    "vllm_afd_ffn_pool_scale_stall_seconds_sum",
)
HEALTH_POLL_S = 0.1


# -- records and pure report functions ------------------------------------------------------------


@dataclass
class Record:
    """One request: times in seconds since the soak started; ``status`` 0 for no answer."""

    client: int
    start: float
    end: float
    status: int
    tokens: int = 0
    correct: bool = False
    ttft: float | None = None
    max_gap: float | None = None
    error: str = ""
    #: When each chunk arrived (seconds since the soak started): the inter-token latencies
    #: around a scale (``itl_windows``; a chunk may carry several tokens when the reader lags).
    chunk_times: list[float] = field(default_factory=list)


@dataclass
class Kill:
    """One SIGKILL of the FFN rank and what followed (seconds; ``at`` since the soak started)."""

    at: float
    pid: int
    detect_s: float | None = None  # until /afd/ready was not 200
    healthy_again_s: float | None = None  # until /afd/ready was 200 again
    replaced_s: float | None = None  # the server log's "replaced in X s"
    streak: int | None = None  # the server log's "failure N in a row"
    in_flight: int = 0


@dataclass
class Scale:
    """One ``POST /afd/scale`` under the load (seconds; ``at`` since the soak started)."""

    at: float
    to_ranks: int
    status: int = 0
    took_s: float | None = None  # request to answer
    stall_s: float | None = None  # the server's longest step hold for the switch
    error: str = ""
    #: Inter-token latency before, during and after the scale (``itl_windows``).
    itl: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Summary:
    completed: int
    failed: int
    wrong: int
    latency: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens_per_s: float = 0.0


def completed(record: Record, max_tokens: int) -> bool:
    return record.status == 200 and record.tokens == max_tokens and not record.error


def in_flight_at(record: Record, at: float) -> bool:
    return record.start < at < record.end


def windows(
    records: Sequence[Record], kill_times: Sequence[float], margin: float = 10.0
) -> dict[str, list[Record]]:
    """``in_flight``: records spanning at least one kill; ``steady``: records whose whole
    [start, end] lies at least ``margin`` seconds from every kill (all of them without kills)."""
    in_flight = [r for r in records if any(in_flight_at(r, t) for t in kill_times)]
    steady = [
        r for r in records if all(r.end <= t - margin or r.start >= t + margin for t in kill_times)
    ]
    return {"in_flight": in_flight, "steady": steady}


def latency_stats(records: Sequence[Record], max_tokens: int) -> dict[str, Any]:
    """p50 and p99 end-to-end latency of the completed ``records``; counts of all of them."""
    done = [r.end - r.start for r in records if completed(r, max_tokens)]
    gaps = [r.max_gap for r in records if completed(r, max_tokens) and r.max_gap is not None]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": sum(not completed(r, max_tokens) for r in records),
        "wrong": sum(completed(r, max_tokens) and not r.correct for r in records),
        "p50_s": percentile(done, 50) if done else None,
        "p99_s": percentile(done, 99) if done else None,
        "max_gap_p99_s": percentile(gaps, 99) if gaps else None,
    }


def summarize(
    records: Sequence[Record],
    kill_times: Sequence[float],
    max_tokens: int,
    margin: float = 10.0,
    duration_s: float | None = None,
) -> Summary:
    """The counts and latency windows of the report (``tokens_per_s`` over ``duration_s``)."""
    overall = latency_stats(records, max_tokens)
    split = windows(records, kill_times, margin)
    tokens = sum(r.tokens for r in records if completed(r, max_tokens))
    return Summary(
        completed=overall["completed"],
        failed=overall["failed"],
        wrong=overall["wrong"],
        latency={
            "all": overall,
            "in_flight": latency_stats(split["in_flight"], max_tokens),
            "steady": latency_stats(split["steady"], max_tokens),
        },
        tokens_per_s=tokens / duration_s if duration_s else 0.0,
    )


def itl_windows(
    records: Sequence[Record], began: float, ended: float, margin: float = 10.0
) -> dict[str, dict[str, Any]]:
    """p50/p99 of the gaps between consecutive chunks of a stream (inter-token latency) that
    end in the ``margin`` seconds before a scale (``before``), while it ran (``during``: from
    the request to the answer, the new pool's start included) and in the ``margin`` seconds
    after (``after``)."""
    spans = {
        "before": (began - margin, began),
        "during": (began, ended),
        "after": (ended, ended + margin),
    }
    gaps: dict[str, list[float]] = {k: [] for k in spans}
    for record in records:
        times = record.chunk_times
        for a, b in zip(times, times[1:], strict=False):
            for key, (lo, hi) in spans.items():
                if lo <= b < hi:
                    gaps[key].append(b - a)
    return {
        key: {
            "gaps": len(found),
            "p50_ms": percentile(found, 50) * 1e3 if found else None,
            "p99_ms": percentile(found, 99) * 1e3 if found else None,
        }
        for key, found in gaps.items()
    }


_REPLACED = re.compile(r"AFD: FFN rank (\d+) replaced in ([\d.]+)s \(failover (\d+)")
_STREAK = re.compile(r"AFD: FFN rank (\d+)\b.*; replacing it \(failure (\d+) in a row\)")


def parse_failovers(log: str, rank: int = 0) -> list[tuple[float, int | None]]:
    """``(replaced in seconds, failure in a row)`` of FFN rank ``rank``'s failovers, in order
    (the streak from the ``replacing it`` line before each ``replaced in`` line)."""
    out: list[tuple[float, int | None]] = []
    streak: int | None = None
    for line in log.splitlines():
        found = _STREAK.search(line)
        if found and int(found[1]) == rank:
            streak = int(found[2])
        found = _REPLACED.search(line)
        if found and int(found[1]) == rank:
            out.append((float(found[2]), streak))
            streak = None
    return out


def parse_metrics(text: str, names: Sequence[str] = METRIC_SERIES) -> dict[str, float]:
    """``{'name{labels}': value}`` for every sample of ``names`` in Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        if key.split("{", 1)[0] in names:
            out[key] = float(value)
    return out


def _fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def format_report(
    settings: dict[str, Any],
    summary: Summary,
    kills: Sequence[Kill],
    metrics: dict[str, float],
    scales: Sequence[Scale] = (),
) -> str:
    """The plain-text report: counts, latency windows, one line per failover (or per scale,
    with the inter-token latency around it), the metrics."""
    s = settings
    event = (
        f"scale the FFN pool to {', '.join(map(str, s['scale_to']))} every {s['kill_every']:g} s"
        if s.get("scale_to")
        else f"kill FFN rank {s['ffn_rank']} every {s['kill_every']:g} s"
    )
    lines = [
        f"soak: {s['model_name']} at {s['ratio']} ({s.get('transport', 'auto')}), "
        f"{s['clients']} clients, "
        f"{s['minutes']:g} min, {event}, "
        f"{s['max_tokens']} tokens per request",
        f"requests: {summary.completed} completed, {summary.failed} failed (lost), "
        f"{summary.wrong} wrong text; {summary.tokens_per_s:.1f} tokens/s",
        "",
        f"{'window':<34}{'requests':>9}{'done':>6}{'failed':>7}{'wrong':>6}"
        f"{'p50 s':>8}{'p99 s':>8}{'gap p99 s':>10}",
    ]
    what = "scale" if s.get("scale_to") else "kill"
    names = {
        "all": "all",
        "in_flight": f"in flight at a {what}",
        "steady": f"steady (>= {s['margin']:g} s from {what}s)",
    }
    for key, name in names.items():
        w = summary.latency[key]
        lines.append(
            f"{name:<34}{w['requests']:>9}{w['completed']:>6}{w['failed']:>7}{w['wrong']:>6}"
            f"{_fmt(w['p50_s']):>8}{_fmt(w['p99_s']):>8}{_fmt(w['max_gap_p99_s']):>10}"
        )
    lines += ["", *(_scale_lines(scales, s["margin"]) if s.get("scale_to") else _kill_lines(kills))]
    lines += ["", "/metrics at the end:"]
    lines += [f"  {key} {value:g}" for key, value in metrics.items()] or ["  (none)"]
    return "\n".join(lines)


def _kill_lines(kills: Sequence[Kill]) -> list[str]:
    """One line per kill: when, its pid, requests in flight, detection, replacement, streak."""
    lines = [
        f"{'failover':<9}{'at s':>7}{'pid':>9}{'in flight':>10}{'detect s':>9}"
        f"{'replaced in s':>14}{'ready s':>10}{'streak':>7}",
    ]
    for i, k in enumerate(kills, 1):
        lines.append(
            f"{i:<9}{k.at:>7.1f}{k.pid:>9}{k.in_flight:>10}{_fmt(k.detect_s):>9}"
            f"{_fmt(k.replaced_s, '{:.1f}'):>14}{_fmt(k.healthy_again_s, '{:.1f}'):>10}"
            f"{_fmt(k.streak, '{}'):>7}"
        )
    if not kills:
        lines.append("(no kill)")
    return lines


def _scale_lines(scales: Sequence[Scale], margin: float) -> list[str]:
    """One line per scale: its answer, time, step hold and the inter-token latency p50/p99
    (ms) in the ``margin`` seconds before, while it ran, and in the ``margin`` seconds after."""
    lines = [
        f"{'scale':<7}{'at s':>7}{'to F':>6}{'status':>7}{'took s':>8}{'stall ms':>9}"
        f"   ITL p50/p99 ms: {'before':>13}{'during':>13}{'after':>13}"
        f"   (+-{margin:g} s)"
    ]
    for i, sc in enumerate(scales, 1):
        windows = [
            f"{_fmt(sc.itl.get(k, {}).get('p50_ms'), '{:.0f}')}/"
            f"{_fmt(sc.itl.get(k, {}).get('p99_ms'), '{:.0f}')}"
            for k in ("before", "during", "after")
        ]
        stall = None if sc.stall_s is None else sc.stall_s * 1e3
        lines.append(
            f"{i:<7}{sc.at:>7.1f}{sc.to_ranks:>6}{sc.status:>7}{_fmt(sc.took_s, '{:.1f}'):>8}"
            f"{_fmt(stall, '{:.1f}'):>9}   {'':>16}{windows[0]:>13}{windows[1]:>13}"
            f"{windows[2]:>13}"
        )
    if not scales:
        lines.append("(no scale)")
    return lines


# -- the soak -------------------------------------------------------------------------------------


def client_prompt(client: int) -> str:
    return f"{PROMPTS[client % len(PROMPTS)]} (client {client})"


def one_request(
    server: ServeProcess, client: int, max_tokens: int, t0: float, reference: dict | None
) -> Record:
    start = time.monotonic()
    try:
        got = server.stream(client_prompt(client), max_tokens)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a broken chunk
        return Record(client, start - t0, time.monotonic() - t0, 0, error=repr(exc)[:500])
    end = time.monotonic()
    times = got.times
    gaps = [b - a for a, b in zip([start, *times], times, strict=False)]
    correct = reference is not None and (
        got.text == reference["text"] and got.token_ids == reference["token_ids"]
    )
    return Record(
        client,
        start - t0,
        end - t0,
        got.status,
        tokens=len(got.token_ids),
        correct=correct,
        ttft=times[0] - start if times else None,
        max_gap=max(gaps) if gaps else None,
        error=got.error,
        chunk_times=[t - t0 for t in times],
    )


def _seconds_until(server: ServeProcess, ready: bool, limit_s: float) -> float | None:
    """Seconds until /afd/ready is (``ready``) 200 or not, polled every 0.1 s; None past limit."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if server.ready(timeout=2.0) == ready:
            return time.monotonic() - start
        time.sleep(HEALTH_POLL_S)
    return None


def run_soak(server: ServeProcess, args: argparse.Namespace) -> dict[str, Any]:
    """References, then the clients and the kills; returns records, kills, metrics, log."""
    references = {}
    for client in range(args.clients):
        got = server.stream(client_prompt(client), args.max_tokens)
        if got.status != 200 or len(got.token_ids) != args.max_tokens:
            raise RuntimeError(f"reference of client {client} failed: {got.error}")
        references[client] = {"text": got.text, "token_ids": got.token_ids}
    print(f"soak: {args.clients} references taken; load for {args.minutes:g} min", flush=True)

    records: list[Record] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60

    def client_loop(client: int) -> None:
        while time.monotonic() < deadline:
            record = one_request(server, client, args.max_tokens, t0, references[client])
            with lock:
                records.append(record)
            if record.status != 200:
                time.sleep(0.5)  # no hot loop against a server that refuses

    threads = [
        threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    kills: list[Kill] = []
    scales = _scale_under_load(server, args, t0, deadline) if args.scale_to else []
    last_pid = None
    next_kill = t0 + args.kill_every
    while next_kill < deadline and not args.scale_to:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        pid = server.ffn_pid(args.ffn_rank)
        while pid in (None, last_pid) and time.monotonic() < deadline:  # replacement not up
            time.sleep(0.5)
            pid = server.ffn_pid(args.ffn_rank)
        if pid in (None, last_pid):
            break
        os.kill(pid, signal.SIGKILL)
        kill = Kill(at=time.monotonic() - t0, pid=pid)
        kill.detect_s = _seconds_until(server, ready=False, limit_s=30.0)
        kill.healthy_again_s = _seconds_until(server, ready=True, limit_s=600.0)
        if kill.detect_s is not None and kill.healthy_again_s is not None:
            kill.healthy_again_s += kill.detect_s
        print(
            f"soak: kill {len(kills) + 1} at {kill.at:.1f}s (pid {pid}): not ready after "
            f"{_fmt(kill.detect_s)}s, ready again after {_fmt(kill.healthy_again_s)}s",
            flush=True,
        )
        kills.append(kill)
        last_pid = pid
        next_kill = max(next_kill + args.kill_every, time.monotonic())
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + 900)
    duration = time.monotonic() - t0
    try:
        metrics = parse_metrics(str(http_request(server.url + "/metrics", timeout=30)[1]))
    except OSError as exc:
        print(f"soak: /metrics did not answer: {exc}", flush=True)
        metrics = {}
    return {
        "references": references,
        "records": sorted(records, key=lambda r: r.start),
        "kills": kills,
        "scales": scales,
        "metrics": metrics,
        "duration_s": duration,
    }


def _scale_under_load(
    server: ServeProcess, args: argparse.Namespace, t0: float, deadline: float
) -> list[Scale]:
    """Every ``--kill-every`` seconds, ``POST /afd/scale`` to the next of ``--scale-to``."""
    scales: list[Scale] = []
    for count in args.scale_to:
        time.sleep(max(0.0, t0 + args.kill_every * (len(scales) + 1) - time.monotonic()))
        if time.monotonic() >= deadline:
            break
        scale = Scale(at=time.monotonic() - t0, to_ranks=count)
        try:
            status, body = http_request(
                server.url + "/afd/scale",
                {"num_ffn_ranks": count},
                timeout=600,
                headers=server.admin_headers(),
            )
        except OSError as exc:
            status, body = 0, repr(exc)
        scale.took_s = time.monotonic() - t0 - scale.at
        scale.status = status
        if status == 200 and isinstance(body, dict) and body.get("scale"):
            scale.stall_s = body["scale"]["stall_s"]
        elif status != 200:
            scale.error = str(body)[:500]
        print(
            f"soak: scale {len(scales) + 1} to {count} FFN rank(s) at {scale.at:.1f}s: "
            f"HTTP {status} after {scale.took_s:.1f}s",
            flush=True,
        )
        scales.append(scale)
    return scales


def attach_failovers(kills: Sequence[Kill], records: Sequence[Record], log: str, rank: int):
    """Fill each kill's in-flight count and the log's replacement time and streak (in order)."""
    failovers = parse_failovers(log, rank)
    for i, kill in enumerate(kills):
        kill.in_flight = sum(in_flight_at(r, kill.at) for r in records)
        if i < len(failovers):
            kill.replaced_s, kill.streak = failovers[i]


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--scale-to: {text!r} is not a list like 2,1")
    return counts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_afd.bench.soak",
        description="FFN failover under sustained streaming load (see the module docstring).",
    )
    parser.add_argument("--model", help="model directory (default: the tiny Qwen3-MoE)")
    parser.add_argument("--ratio", default="2:1", help="--afd-ratio A:F (default 2:1)")
    parser.add_argument(
        "--transport", default="auto", help="--afd-transport of the server (default auto)"
    )
    parser.add_argument("--clients", type=int, default=6, help="client threads (default 6)")
    parser.add_argument("--minutes", type=float, default=3.0, help="load duration (default 3)")
    parser.add_argument(
        "--kill-every", type=float, default=45.0, help="seconds between kills (default 45)"
    )
    parser.add_argument(
        "--scale-to",
        type=_counts,
        default=(),
        metavar="N,N,...",
        help="instead of kills, scale the FFN pool live (POST /afd/scale) to each of these FFN "
        "rank counts in turn, one every --kill-every seconds (e.g. 2,1)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--ffn-rank", type=int, default=0, help="the FFN rank to kill (0)")
    parser.add_argument(
        "--margin", type=float, default=10.0, help="seconds from any kill of a steady request"
    )
    parser.add_argument("--json", default="soak.json", help="result file (default soak.json)")
    parser.add_argument("--log", help="server log (default: next to --json, .server.log)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.clients < 1 or args.minutes <= 0 or args.kill_every <= 0 or args.max_tokens < 1:
        raise SystemExit("soak: --clients, --minutes, --kill-every, --max-tokens must be > 0")
    if args.model is None:
        from vllm_afd.bench.tiny_models import default_tiny_model

        args.model = str(default_tiny_model(arch="qwen3_moe"))
    json_path = Path(args.json)
    log = Path(args.log) if args.log else json_path.with_suffix(".server.log")
    settings = {
        key: getattr(args, key)
        for key in ("model", "ratio", "transport", "clients", "minutes", "kill_every", "max_tokens")
    } | {"ffn_rank": args.ffn_rank, "margin": args.margin, "server_log": str(log)}
    settings["scale_to"] = list(args.scale_to)
    settings["model_name"] = Path(args.model).name
    flags = ("--afd-ratio", args.ratio, "--afd-transport", args.transport)
    exit_on_sigterm()  # its ``finally`` stops the server
    server = ServeProcess(args.model, log, flags, env={"VLLM_PLUGINS": "afd"})
    print(f"soak: server pid {server.proc.pid} on {server.url}, log {log}", flush=True)
    leftovers: list[int] = []
    try:
        server.wait_healthy(timeout=600.0)
        result = run_soak(server, args)
    finally:
        leftovers = server.stop()
    kills, scales, records = result["kills"], result["scales"], result["records"]
    attach_failovers(kills, records, log.read_text(errors="replace"), args.ffn_rank)
    for scale in scales:
        ended = scale.at + (scale.took_s or 0.0)
        scale.itl = itl_windows(records, scale.at, ended, args.margin)
    events = [k.at for k in kills] + [sc.at for sc in scales]
    summary = summarize(records, events, args.max_tokens, args.margin, result["duration_s"])
    print(format_report(settings, summary, kills, result["metrics"], scales))
    if leftovers:
        print(f"soak: killed {len(leftovers)} process(es) left after SIGTERM: {leftovers}")
    json_path.write_text(
        json.dumps(
            {
                "settings": settings,
                "summary": asdict(summary),
                "kills": [asdict(k) for k in kills],
                "scales": [asdict(sc) for sc in scales],
                "metrics": result["metrics"],
                "duration_s": result["duration_s"],
                "references": result["references"],
                "records": [asdict(r) for r in records],
                "killed_after_sigterm": leftovers,
            },
            indent=1,
        )
    )
    print(f"soak: wrote {json_path}")
    return 1 if summary.failed or summary.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
