"""Steady-state decode window and step-period statistics (pure functions).

FastAFD (A.1) measures the decode step period T over a steady window: after the last prefill
step, with every slot occupied, ending at the first completion. The decode driver records, per
engine step, its wall-clock duration ``dt`` (end of the previous step to end of this one) and how
many requests emitted a token having already emitted one before (``decoding``; exactly one
token each without speculative decoding, up to ``1 + d`` with it). Here:

* a step is *steady* when ``decoding == batch`` (every request decodes; no prefill in it);
* the window is the steady steps minus the first ``skip`` (the transition right after prefill:
  allocator growth, the last prefill's stragglers) and minus the last one (the step in which the
  first requests complete), optionally capped at ``max_steps`` (keeps KV length near nominal);
* the step period is taken from the window's ``dt`` values: median and p90, mean as the paper.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def steady_window(
    decoding: Sequence[int], batch: int, skip: int = 2, max_steps: int | None = None
) -> list[int]:
    """Indices of the window's steps, given per-step ``decoding`` counts.

    Raises ValueError for ``skip < 1`` (the first steady step follows the last prefill and is
    never representative) or ``batch < 1``.
    """
    if skip < 1:
        raise ValueError(f"skip must be >= 1 steady step, got {skip}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    steady = [i for i, n in enumerate(decoding) if n == batch]
    window = steady[skip:-1]
    return window[:max_steps] if max_steps is not None else window


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class PeriodStats:
    """Step period over a window (seconds) and how many intervals it rests on."""

    median_s: float
    p90_s: float
    mean_s: float
    count: int

    def to_dict(self) -> dict[str, float]:
        return {
            "median_ms": self.median_s * 1e3,
            "p90_ms": self.p90_s * 1e3,
            "mean_ms": self.mean_s * 1e3,
            "intervals": self.count,
        }


def period_stats(intervals: Sequence[float]) -> PeriodStats:
    """Median, p90 and mean of step intervals (seconds); ValueError when empty."""
    if not intervals:
        raise ValueError("no steady decode steps: raise --output-len or lower --skip")
    return PeriodStats(
        median_s=statistics.median(intervals),
        p90_s=percentile(intervals, 90),
        mean_s=statistics.fmean(intervals),
        count=len(intervals),
    )


def window_intervals(
    steps: Sequence[dict], batch: int, skip: int = 2, max_steps: int | None = None
) -> list[float]:
    """The ``dt`` of the window's steps, from the decode driver's step records."""
    idx = steady_window([s["decoding"] for s in steps], batch, skip, max_steps)
    return [steps[i]["dt"] for i in idx]


def window_mean(steps: Sequence[dict], key: str, batch: int, skip: int = 2) -> float | None:
    """Mean of a per-step field (``attn_s``, ``moe_s``) over the window; None if absent."""
    idx = steady_window([s["decoding"] for s in steps], batch, skip)
    values = [steps[i][key] for i in idx if key in steps[i]]
    return statistics.fmean(values) if values else None
