"""Placement, autoscale: the planner in the loop (``--afd-autoscale``).

The best A:F moves with the load (FastAFD: longer contexts make attention slower, so one FFN
rank hides behind more attention ranks). The process that holds the FFN group runs an
``Advisor`` thread that, every window (``min(10 s, --afd-autoscale-interval / 3)``):

1. reads what the deployment measured since the last window (``measure``): the attention
   ranks' decode steps (the step period, from one decode step's start to the next's, with
   its requests and context: patch W1 records them in each rank's stats block), their exposed
   FFN time per round trip, and the FFN ranks' service time per layer batch; a window that
   holds a scale or a failover (the FFN directory's failover counts and states), or is read
   while a scale is under way, is marked ``disturbed``;
2. asks the planner (``planner.auto_ratio.predict_ffn_counts``, the model fitted for the
   platform: the CPU step model of a ``vllm-afd profile`` file on the CPU build, the
   analytical model on GPUs) what every FFN rank count the experts allow would give at the
   measured batch and context, more FFN ranks than attention ranks included, and why it
   cannot predict a count; with A2's tau refitted from the round trips served in the last
   ``SERVED_WINDOWS`` undisturbed windows before this one (``Window.served``), and the CPU
   step model's attention side rescaled to theirs (``Window.served_attention``), since the
   profile, measured on an idle machine, is not what serving pays;
3. decides (``decide``): scale to the planner's best count when it promises at least
   ``--afd-autoscale-margin`` more tokens/s per device than the live one, in two undisturbed
   windows in a row, and the last scale (its own or a ``POST /afd/scale``) is at least
   ``--afd-autoscale-interval`` old; otherwise hold, saying why (a disturbed window is never
   decided on);
4. publishes the window, the predictions and the decision (``directory.publish_advice``:
   ``/afd/status`` answers it as ``live``, ``/metrics`` as gauges), logs a decision that
   changed, and with ``--afd-autoscale`` applies a scale (``scaling.scale_ffn_group``).

A window with too little in it (fewer than ``MIN_STEPS`` decode steps: an idle server; or the
first on a new pool, whose counters start at 0) publishes nothing: the last advice stands.

Without ``--afd-autoscale`` it only advises. The measured step period stands next to the
planner's predicted step for the live count (``/metrics``: ``vllm_afd_window_step_seconds``
and ``vllm_afd_planner_predicted_step_seconds``), which is how far to trust the
recommendation (on the CPU build the planner needs ``VLLM_AFD_PLAN_PROFILE``, the file
``vllm-afd profile`` writes). On the GPU plane the same loop holds: the blocks are host
memory written by the same hooks, and a scale is the same protocol (``scaling.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_afd import envs
from vllm_afd.config import AFDConfig, MoEModelInfo
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import cpu_stolen_times
from vllm_afd.metrics.blocks import (
    _A_ROUND_TRIPS,
    _A_SECONDS,
    _F_SECONDS,
    A_STEP_CONTEXT,
    A_STEP_REQUESTS,
    A_STEP_SECONDS,
    A_STEPS,
)
from vllm_afd.planner.auto_ratio import (
    Candidate,
    ServedAttention,
    ServedRoundTrip,
    candidate_ffn_ranks,
    predict_ffn_counts,
)
from vllm_afd.transport import TransportSpec, directory

logger = logging.getLogger("vllm.afd")
#: Longest measurement window (seconds); a shorter ``--afd-autoscale-interval`` shortens it.
WINDOW_S = 10.0
#: Decode steps (all attention ranks) a window needs before it is planned on.
MIN_STEPS = 8
#: Undisturbed windows whose served round trips refit the planner's tau (their median).
SERVED_WINDOWS = 3


@dataclass(frozen=True)
class Totals:
    """The deployment's counters, summed over its ranks, at one moment (``read_totals``)."""

    #: The FFN pool the counters belong to (its addresses): a new pool restarts them.
    pool: tuple[str, ...]
    steps: float = 0.0
    step_s: float = 0.0
    requests: float = 0.0
    context: float = 0.0
    round_trips: float = 0.0
    exposed_s: float = 0.0
    ffn_batches: float = 0.0
    ffn_s: float = 0.0
    #: This host's CPU time stolen by its hypervisor, and the whole (``host.cpu_stolen_times``).
    cpu_stolen: float = 0.0
    cpu_total: float = 0.0
    #: Failovers of the pool's FFN ranks so far (their directory entries).
    failovers: int = 0
    #: FFN ranks not ``up`` (being replaced, given up on).
    unsettled: int = 0
    #: A scale of the FFN pool was under way (``scaling.in_progress``): its new pool starts on
    #: the same hosts, so a window it overlaps is no measure of the load, even before the switch.
    scaling: bool = False


def read_totals(spec: TransportSpec) -> Totals:
    """``Totals`` of the deployment ``spec`` from its stats blocks (a missing block adds 0)
    and its FFN directory."""
    from vllm_afd.metrics.collector import read_deployment
    from vllm_afd.placement.scaling import in_progress

    blocks = read_deployment(spec)
    attention = [b.scalars for b in blocks.attention if b is not None]
    ffn = [b for b in blocks.ffn if b is not None]
    ranks = directory.entries(spec.directory, spec.num_ffn_ranks) if spec.directory else []
    stolen, total = cpu_stolen_times()
    return Totals(
        tuple(spec.addresses),
        steps=sum(s[A_STEPS] for s in attention),
        step_s=sum(s[A_STEP_SECONDS] for s in attention),
        requests=sum(s[A_STEP_REQUESTS] for s in attention),
        context=sum(s[A_STEP_CONTEXT] for s in attention),
        round_trips=sum(s[_A_ROUND_TRIPS] for s in attention),
        exposed_s=sum(s[_A_SECONDS] for s in attention),
        ffn_batches=sum(sum(b.hist) for b in ffn),
        ffn_s=sum(b.scalars[_F_SECONDS] for b in ffn),
        cpu_stolen=stolen,
        cpu_total=total,
        failovers=sum(e.failovers for e in ranks if e is not None),
        unsettled=sum(e is not None and e.state != directory.UP for e in ranks),
        scaling=in_progress() is not None,
    )


@dataclass(frozen=True)
class Window:
    """What the deployment measured over one window (means over its decode steps)."""

    seconds: float
    steps: int
    #: Period of one decode step on an attention rank (its start to the next step's start).
    step_ms: float
    #: Requests per decode step and attention rank (the planner's b_A).
    batch: float
    #: Context tokens per request.
    context: float
    #: Attention time per layer: the step less its exposed FFN time, over the model's layers.
    attention_ms: float
    #: Time an attention rank waited for the FFN ranks per round trip (not hidden by overlap).
    exposed_ffn_ms: float
    #: FFN service time per layer batch on an FFN rank.
    ffn_ms: float
    #: What in the window makes it no measure of the steady load (a scale, a failover), or "".
    disturbed: str = ""
    #: Share of this host's CPU time its hypervisor took (a VM's noisy neighbours): shown
    #: next to the step (``bench.planner_loop``), not acted on.
    cpu_stolen: float = 0.0

    def served(
        self, attention_ranks: int, ffn_ranks: int, microbatches: int, draft_length: int = 0
    ) -> ServedRoundTrip | None:
        """The FFN round trip as served in this window, for the planner's tau refit; ``None``
        where the window cannot show it (disturbed, or hidden behind the other microbatch).

        One microbatch: the attention rank waits out the whole round trip, so the exposed
        time is the round trip. Two: it runs the other microbatch's stage (half the attention
        time per layer) before it waits, so the round trip is that stage plus the exposed
        time, seen only where the wait is at least a tenth of the stage."""
        if self.disturbed:
            return None
        from vllm_afd.planner.cpu import modelled_microbatches

        k = modelled_microbatches(microbatches)
        tokens = self.batch * (1 + draft_length) * attention_ranks / ffn_ranks / k
        if k == 1:
            return ServedRoundTrip(ffn_ranks, tokens, self.exposed_ffn_ms / 1e3)
        stage_ms = self.attention_ms / 2
        if self.exposed_ffn_ms < 0.1 * stage_ms:
            return None
        return ServedRoundTrip(ffn_ranks, tokens, (stage_ms + self.exposed_ffn_ms) / 1e3)

    def served_attention(self, num_layers: int) -> ServedAttention | None:
        """The attention side of a step as served in this window, for the planner's rescaling
        of it; ``None`` for a disturbed window."""
        if self.disturbed:
            return None
        return ServedAttention(self.batch, self.context, self.attention_ms * num_layers / 1e3)


#: ``Totals`` fields that are counters (the rest say what the pool is and how it is doing).
_COUNTERS = tuple(
    f.name
    for f in dataclasses.fields(Totals)
    if f.name not in ("pool", "failovers", "unsettled", "scaling")
)


def measure(before: Totals, after: Totals, seconds: float, num_layers: int) -> Window | None:
    """The ``Window`` between two ``Totals``; ``None`` when there is too little to plan on
    (fewer than ``MIN_STEPS`` decode steps).

    A window in which the pool changed (a scale: the new pool's counters start at 0) is
    measured on the new pool's counters alone; one in which an FFN rank failed over or was not
    up is measured too (a replaced rank's counters restart: its totals then count from 0);
    both are marked ``disturbed``, and so is one read while a scale was under way at either
    end (its new pool starting on the same hosts slows the live one before any switch)."""
    if after.pool != before.pool:
        before = Totals(after.pool, cpu_stolen=before.cpu_stolen, cpu_total=before.cpu_total)
        disturbed = f"a scale of the FFN pool to {len(after.pool)} rank(s)"
    elif after.scaling or before.scaling:
        disturbed = "a scale of the FFN pool under way"
    elif after.failovers != before.failovers or after.unsettled or before.unsettled:
        disturbed = "a failover of an FFN rank"
    else:
        disturbed = ""
    delta = {}
    for name in _COUNTERS:
        now, then = getattr(after, name), getattr(before, name)
        delta[name] = now - then if now >= then else now  # a counter restarted at 0
    if delta["steps"] < MIN_STEPS:
        return None
    steps = delta["steps"]
    step_ms = 1e3 * delta["step_s"] / steps
    exposed_per_step_ms = 1e3 * delta["exposed_s"] / steps
    return Window(
        seconds=seconds,
        steps=int(steps),
        step_ms=step_ms,
        batch=delta["requests"] / steps,
        context=delta["context"] / max(1.0, delta["requests"]),
        attention_ms=max(0.0, step_ms - exposed_per_step_ms) / max(1, num_layers),
        exposed_ffn_ms=1e3 * delta["exposed_s"] / max(1.0, delta["round_trips"]),
        ffn_ms=1e3 * delta["ffn_s"] / max(1.0, delta["ffn_batches"]),
        cpu_stolen=delta["cpu_stolen"] / delta["cpu_total"] if delta["cpu_total"] > 0 else 0.0,
        disturbed=disturbed,
    )


@dataclass(frozen=True)
class Policy:
    """``--afd-autoscale`` and its settings."""

    enabled: bool
    interval_s: float
    margin: float

    @classmethod
    def of(cls, afd: AFDConfig) -> Policy:
        return cls(afd.autoscale, afd.autoscale_interval, afd.autoscale_margin)

    @property
    def window_s(self) -> float:
        return min(WINDOW_S, self.interval_s / 3)


@dataclass(frozen=True)
class Decision:
    """What ``decide`` chose: ``target`` FFN ranks to scale to (``None``: hold), the rule
    that decided (``RULES``) and why, in words."""

    target: int | None
    rule: str
    reason: str


#: ``Decision.rule`` values: scale, or why not (the advice adds ``no_planner``: no prediction).
RULES = ("scale", "best", "margin", "unconfirmed", "off", "interval", "infeasible", "disturbed")


def decide(
    live: int,
    candidates: Sequence[Candidate],
    policy: Policy,
    best_before: int | None,
    since_last_scale_s: float,
    unpredicted: Mapping[int, str] | None = None,
    disturbed: str = "",
) -> Decision:
    """The decision for the planner's ``candidates`` at the measured load, ``live`` FFN ranks
    serving now. ``best_before``: the best count of the previous window (a recommendation
    must hold for two windows in a row); ``unpredicted``: why the planner has no candidate for
    the other counts; ``disturbed``: what makes the window no measure of the load (then it
    holds)."""
    unpredicted = unpredicted or {}
    if disturbed:
        return Decision(None, "disturbed", f"the window holds {disturbed}: not decided on")
    if not candidates:
        why = "; ".join(f"{f} FFN rank(s): {text}" for f, text in unpredicted.items())
        return Decision(
            None, "infeasible", f"the planner predicts no FFN rank count ({why or 'none asked'})"
        )
    best = max(candidates, key=lambda c: c.tokens_per_device)
    now = next((c for c in candidates if c.num_ffn_ranks == live), None)
    if now is best:
        return Decision(None, "best", f"the live {_told(best)} is the planner's best")
    gain = math.inf if now is None else best.tokens_per_device / now.tokens_per_device - 1
    versus = (
        f"the live {live} FFN rank(s), not predicted ({unpredicted.get(live, 'not asked')})"
        if now is None
        else _told(now)
    )
    why = f"the planner prefers {_told(best)} to {versus}: {_percent(gain)}"
    if gain < policy.margin:
        return Decision(None, "margin", f"{why} < the margin {_percent(policy.margin)}")
    if best_before != best.num_ffn_ranks:
        return Decision(None, "unconfirmed", f"{why}; waiting for a second window to agree")
    if not policy.enabled:
        return Decision(None, "off", f"{why}; --afd-autoscale is off")
    if since_last_scale_s < policy.interval_s:
        return Decision(
            None,
            "interval",
            f"{why}; the last scale is {since_last_scale_s:.0f} s old < "
            f"--afd-autoscale-interval {policy.interval_s:g} s",
        )
    return Decision(best.num_ffn_ranks, "scale", f"{why} >= the margin {_percent(policy.margin)}")


def _told(c: Candidate) -> str:
    return (
        f"{c.ratio} ({c.num_ffn_ranks} FFN rank(s): predicted step {c.step_ms:.2f} ms, "
        f"{c.tokens_per_device:.0f} tok/s per device)"
    )


def _percent(x: float) -> str:
    return "+inf%" if math.isinf(x) else f"{100 * x:+.0f}%"


@dataclass(frozen=True)
class Deployment:
    """What the planner needs of this deployment besides the measured load."""

    info: MoEModelInfo
    attention_ranks: int
    model_dir: str
    platform_is_cpu: bool
    draft_length: int = 0
    microbatches: int = 1


class Advisor:
    """The loop of the module docstring, on a daemon thread; it ends with the FFN group (no
    ``VLLM_AFD_RUNTIME`` any more) or at ``stop``."""

    def __init__(self, deployment: Deployment, policy: Policy) -> None:
        self.deployment, self.policy = deployment, policy
        self.started = time.time()
        self._stop = threading.Event()
        self._best_before: int | None = None
        self._last_said: tuple | None = None
        #: The served round trips of the last undisturbed windows (``Window.served``).
        self._served: deque[ServedRoundTrip] = deque(maxlen=SERVED_WINDOWS)
        #: Their attention side (``Window.served_attention``).
        self._attention: deque[ServedAttention] = deque(maxlen=SERVED_WINDOWS)
        self._thread = threading.Thread(target=self._run, name="afd-advisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        before, at = None, time.monotonic()
        while not self._stop.wait(self.policy.window_s):
            spec = _live_spec()
            if spec is None:
                return  # the FFN group stopped (``lifecycle.stop_ffn_group``)
            if not spec.directory:
                continue
            try:
                now, then = read_totals(spec), at
                at = time.monotonic()
                layers = self.deployment.info.num_layers
                window = None if before is None else measure(before, now, at - then, layers)
                before = now
                if window is None:  # too little measured: the last advice stands
                    continue
                advice = self.advise(spec, window)
                directory.publish_advice(spec.directory, advice)
                self._say(advice)
                if advice["action"] == "scale":  # the next window is the new pool's first
                    self._scale(advice["recommended"]["num_ffn_ranks"])
            except Exception:  # noqa: BLE001 - the advisor never takes serving down
                logger.exception("AFD autoscale: the planner loop failed this window")

    def advise(self, spec: TransportSpec, window: Window) -> dict[str, Any]:
        """The advice for ``window`` on the live pool ``spec`` (JSON-ready)."""
        d = self.deployment
        advice: dict[str, Any] = {
            "at": time.time(),
            "num_ffn_ranks": spec.num_ffn_ranks,
            "autoscale": self.policy.enabled,
            "window": dataclasses.asdict(window),
            "model": None,
            "candidates": [],
            "unpredicted": {},
            "recommended": None,
            "action": "hold",
        }
        try:
            predictions = predict_ffn_counts(
                d.info,
                d.attention_ranks,
                d.model_dir,
                context=window.context,
                batch=window.batch,
                platform_is_cpu=d.platform_is_cpu,
                draft_length=d.draft_length,
                what="the planner in the loop",
                counts=candidate_ffn_ranks(d.info, d.attention_ranks, whole_ratios=False),
                microbatches=d.microbatches,
                served=tuple(self._served),
                attention_served=tuple(self._attention),
            )
        except (AFDConfigError, ValueError, OSError) as exc:
            advice.update(rule="no_planner", reason=f"no planner prediction: {exc}")
            return advice
        # this window refits tau for the next ones, not for its own prediction
        served = window.served(
            d.attention_ranks, spec.num_ffn_ranks, d.microbatches, d.draft_length
        )
        if served is not None:
            self._served.append(served)
        attention = window.served_attention(d.info.num_layers)
        if attention is not None:
            self._attention.append(attention)
        candidates = predictions.candidates
        decision = decide(
            spec.num_ffn_ranks,
            candidates,
            self.policy,
            self._best_before,
            time.time() - self._last_scale_at(spec),
            predictions.unpredicted,
            window.disturbed,
        )
        best = predictions.best()
        # a recommendation holds for two undisturbed windows in a row
        self._best_before = None if best is None or window.disturbed else best.num_ffn_ranks
        advice.update(
            model=predictions.model,
            candidates=[dataclasses.asdict(c) for c in candidates],
            unpredicted={str(f): why for f, why in predictions.unpredicted.items()},
            recommended=None
            if best is None
            else {"num_ffn_ranks": best.num_ffn_ranks, "ratio": best.ratio},
            action="hold" if decision.target is None else "scale",
            rule=decision.rule,
            reason=decision.reason,
        )
        return advice

    def _last_scale_at(self, spec: TransportSpec) -> float:
        """``time.time()`` the pool last changed shape (its start, or the last scale's end)."""
        pool = directory.read_pool(spec.directory)
        ends = [e["at"] + e["took_s"] for e in (pool.events if pool else ())]
        return max([self.started, *ends])

    def _say(self, advice: dict[str, Any]) -> None:
        """Log a decision that changed (not every window's)."""
        key = (advice["rule"], advice["recommended"])
        if key == self._last_said:
            return
        self._last_said = key
        w = advice["window"]
        live = next(
            (c for c in advice["candidates"] if c["num_ffn_ranks"] == advice["num_ffn_ranks"]),
            None,
        )
        predicted = "" if live is None else f" (predicted {live['step_ms']:.2f} ms)"
        measured = (
            f" [measured: batch {w['batch']:.1f}/attention rank, context {w['context']:.0f}, "
            f"step {w['step_ms']:.2f} ms{predicted}, attention {w['attention_ms']:.3f} ms/layer, "
            f"FFN {w['ffn_ms']:.3f} ms/layer batch]"
        )
        logger.info("AFD autoscale: %s: %s%s", advice["action"], advice["reason"], measured)

    def _scale(self, count: int) -> None:
        from vllm_afd.placement.scaling import ScaleError, scale_ffn_group

        try:
            event = scale_ffn_group(count)
        except ScaleError as exc:
            logger.warning("AFD autoscale: the scale to %d FFN rank(s) failed: %s", count, exc)
            return
        if event is not None:
            logger.info(
                "AFD autoscale: now %d FFN rank(s) (was %d), scaled in %.1f s, switch stall "
                "%.1f ms",
                event.to_ranks,
                event.from_ranks,
                event.took_s,
                1e3 * event.stall_s,
            )


def _live_spec() -> TransportSpec | None:
    runtime = envs.VLLM_AFD_RUNTIME
    return TransportSpec.from_json(runtime) if runtime else None


_ADVISOR: Advisor | None = None


def start_advisor(deployment: Deployment, afd: AFDConfig) -> Advisor:
    """Start this process's advisor (stopping a previous one)."""
    global _ADVISOR
    stop_advisor()
    _ADVISOR = Advisor(deployment, Policy.of(afd))
    return _ADVISOR


def stop_advisor() -> None:
    """Stop this process's advisor, if any. Idempotent."""
    global _ADVISOR
    advisor, _ADVISOR = _ADVISOR, None
    if advisor is not None:
        advisor.stop()
