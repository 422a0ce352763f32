"""From inputs to a decision: predicted AFD throughput per ratio, the wide-EP baseline, S_all.

`plan()` evaluates the candidate ratios of one workload (model, hardware, context, draft length):
per ratio it sizes b_A from HBM (or takes the user's batch), predicts the step with Eq. 3 and the
per-GPU throughput, and divides by the best wide-EP setting to get S_all and its three factors.
The recommended ratio maximises X_all (throughput per GPU counting the FFN GPUs), the paper's
selection rule. `recommend_ratio()` does the same over the attention/FFN splits of a fixed number
of devices, for the serving side's `--afd-ratio auto`.

The profile point (D_V, kappa, draft times) comes, in order, from an explicit D_V, the user's
profile, the bundled paper profile (the three preset models, measured on GB200), or a roofline
lower bound on D_V that the result flags. Nothing here runs a model or imports vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from vllm_afd.config import ffn_ranks_problem
from vllm_afd.planner.analytical import (
    Decomposition,
    StageTimes,
    afd_step,
    afd_tokens_per_gpu,
    attention_tokens_per_gpu,
    colocated_step,
    coverage_boundary,
    decompose,
    ffn_fixed_time,
    ffn_token_time,
)
from vllm_afd.planner.hardware import Hardware, get_hardware
from vllm_afd.planner.memory import (
    DEFAULT_MEMORY,
    MemoryAssumptions,
    attention_batch,
    check_ffn_fits,
    colocated_batch,
    ffn_fits,
    ffn_pool_candidates,
)
from vllm_afd.planner.models import ModelSpec, get_model
from vllm_afd.planner.nfp import (
    DEFAULT_TOLERANCE,
    NearFreeBudget,
    attention_nfp,
    ffn_nfp,
    recommend_draft_length,
)
from vllm_afd.planner.profile_io import (
    ColocatedProfile,
    ProfilePoint,
    bundled_profile,
    format_context,
    parse_context,
)

TUNE_BATCH_FLOOR = 0.8
"""When tuning, b_A is searched in [0.8 * KV-full batch, KV-full batch]."""


@dataclass(frozen=True)
class PlanRequest:
    """One workload to plan. `ratios` are attention GPUs per FFN GPU (r:1 node ratios)."""

    model: ModelSpec
    hardware: Hardware
    context: int
    output_len: int = 1024
    draft_length: int = 0
    acceptance: float = 1.0
    """Mean accepted tokens per request per step (a); scales both engines alike."""
    ratios: tuple[int, ...] | None = None
    ffn_gpus: int | None = None
    batch: int | None = None
    """b_A override; None sizes it from HBM capacity."""
    tune_batch: bool = True
    baseline_eps: tuple[int, ...] | None = None
    baseline_batch: int | None = None
    baseline_step_ms: float | None = None
    tolerance: float = DEFAULT_TOLERANCE
    memory: MemoryAssumptions = DEFAULT_MEMORY

    def __post_init__(self) -> None:
        _require(self.context >= 1, "context", "must be >= 1 token")
        _require(self.output_len >= 0, "output_len", "must be >= 0")
        _require(self.draft_length >= 0, "draft_length", "must be >= 0")
        _require(self.acceptance >= 1, "acceptance", "must be >= 1 token per step")
        _require(self.tolerance > 0, "tolerance", "must be > 0")
        _require(self.batch is None or self.batch >= 2, "batch", "must be >= 2 (two microbatches)")
        _require(self.ffn_gpus is None or self.ffn_gpus >= 1, "ffn_gpus", "must be >= 1")
        _require(self.ratios is None or len(self.ratios) > 0, "ratios", "must not be empty")
        _require(all(r >= 1 for r in self.ratios or ()), "ratios", "must all be >= 1")
        _require(all(e >= 1 for e in self.baseline_eps or ()), "baseline_eps", "must be >= 1")
        pair = (self.baseline_batch is None, self.baseline_step_ms is None)
        _require(pair[0] == pair[1], "baseline_batch", "and baseline_step_ms go together")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"PlanRequest.{name} {message}")


@dataclass(frozen=True)
class Baseline:
    """The colocated wide-EP deployment AFD is compared against."""

    ep: int
    batch: int
    step_ms: float
    source: str
    """'modeled' (capacity + colocated step model), 'profile' (measured) or 'user'."""
    acceptance: float = 1.0

    @property
    def tokens_per_gpu(self) -> float:
        return self.batch * self.acceptance / (self.step_ms / 1e3)


@dataclass(frozen=True)
class RatioPrediction:
    """Predicted AFD operation at one attention:FFN split."""

    attn_gpus: int
    ffn_gpus: int
    batch: int
    step_ms: float
    exposed_ffn_ms: float
    tokens_per_gpu: float
    """X_all: tokens/s per GPU counting attention and FFN GPUs."""
    tokens_per_attn_gpu: float
    routed_tokens: float
    """m = r n q routed tokens per FFN GPU per layer and microbatch."""
    covered: bool
    """FFN stage hidden behind attention in every layer (T_e <= T_a)."""
    ffn_near_free: bool
    max_hidden_q: int
    """Largest q whose FFN stage would still hide behind attention at this ratio."""
    decomposition: Decomposition | None = None

    @property
    def ratio(self) -> float:
        return self.attn_gpus / self.ffn_gpus

    @property
    def s_all(self) -> float | None:
        return None if self.decomposition is None else self.decomposition.s_all

    @property
    def s_att(self) -> float | None:
        return None if self.decomposition is None else self.decomposition.s_att

    def to_dict(self) -> dict[str, Any]:
        row = {k: v for k, v in dataclasses.asdict(self).items() if k != "decomposition"}
        row["ratio"] = self.ratio
        d = self.decomposition
        if d is not None:
            row |= {
                "s_all": d.s_all,
                "s_att": d.s_att,
                "batch_gain": d.batch_gain,
                "overlap_gain": d.overlap_gain,
                "disaggregation_cost": d.disaggregation_cost,
                "wins": d.wins,
            }
        return row


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    hardware: Hardware
    """The hardware actually used (with the profile's fitted constants applied)."""
    point: ProfilePoint
    dv_source: str
    max_batch: int
    """KV-full b_A from HBM capacity (or the user's batch)."""
    baseline: Baseline | None
    rows: tuple[RatioPrediction, ...]
    coverage_boundary: float
    """Largest r with the FFN stage hidden in every layer, at the recommended row's b_A."""
    attention_budget: NearFreeBudget
    ffn_budget: NearFreeBudget
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def recommended(self) -> RatioPrediction:
        """The candidate with the highest X_all (the first one on ties)."""
        return max(self.rows, key=lambda r: r.tokens_per_gpu)

    @property
    def recommended_draft_length(self) -> int:
        return recommend_draft_length(self.attention_budget)

    def to_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "model": req.model.name,
            "hardware": {"name": self.hardware.name, "calibrated": self.hardware.calibrated},
            "context": req.context,
            "output_len": req.output_len,
            "draft_length": req.draft_length,
            "acceptance": req.acceptance,
            "profile": dataclasses.asdict(self.point) | {"source": self.dv_source},
            "max_batch": self.max_batch,
            "baseline": None if self.baseline is None else _baseline_dict(self.baseline),
            "ratios": [r.to_dict() for r in self.rows],
            "recommended": self.recommended.to_dict(),
            "coverage_boundary": self.coverage_boundary,
            "near_free": {
                "attention": dataclasses.asdict(self.attention_budget),
                "ffn": dataclasses.asdict(self.ffn_budget),
                "recommended_draft_length": self.recommended_draft_length,
            },
            "notes": list(self.notes),
        }


def _baseline_dict(baseline: Baseline) -> dict[str, Any]:
    return dataclasses.asdict(baseline) | {"tokens_per_gpu": baseline.tokens_per_gpu}


# -- inputs -------------------------------------------------------------------------------------


def apply_calibration(hw: Hardware, profile: ColocatedProfile | None) -> Hardware:
    """Replace tau, u_c and u by the profile's fits; calibrated when tau and u_c were fitted."""
    if profile is None:
        return hw
    changes: dict[str, Any] = {}
    if profile.dispatch_intercept_us is not None:
        changes["dispatch_intercept"] = profile.dispatch_intercept_us * 1e-6
    if profile.gemm_efficiency is not None:
        changes["gemm_efficiency"] = profile.gemm_efficiency
    if profile.bandwidth_efficiency is not None:
        changes["bandwidth_efficiency"] = profile.bandwidth_efficiency
    fitted = {"dispatch_intercept", "gemm_efficiency"} <= set(changes)
    return dataclasses.replace(hw, **changes, calibrated=hw.calibrated or fitted)


def estimate_dv_ms(model: ModelSpec, hw: Hardware) -> float:
    """Roofline lower bound on D_V: stream the attention-side weights (LM head included, input
    embedding excluded) once per microbatch pass. Real D_V is several times larger."""
    embed = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    weights = model.attention_side_bytes - embed * model.embedding_bytes_per_param
    return weights / hw.effective_bandwidth * 1e3


def resolve_point(
    model: ModelSpec,
    hw: Hardware,
    context: int,
    draft_length: int,
    profile: ColocatedProfile | None = None,
    dv_ms: float | None = None,
    kappa: float | None = None,
) -> tuple[ProfilePoint, str]:
    """The profile point for (context, d) and a word on where it came from."""
    if dv_ms is not None:
        point = ProfilePoint(context, dv_ms, draft_length, kappa if kappa is not None else 1.0)
        return point, "user (--dv-ms)"
    source = profile or bundled_profile(model.name)
    if source is not None:
        point = source.point(context, draft_length)
        if kappa is not None:
            point = dataclasses.replace(point, kappa=kappa)
        return point, source.source or "profile"
    estimate = ProfilePoint(context, estimate_dv_ms(model, hw), draft_length, kappa or 1.0)
    return estimate, "roofline lower bound (no profile)"


# -- the baseline -------------------------------------------------------------------------------


def default_eps(model: ModelSpec, hw: Hardware) -> tuple[int, ...]:
    """Powers of two up to the NVLink domain that divide E."""
    eps, ep = [], 1
    while ep <= hw.nvlink_domain:
        if model.num_experts % ep == 0:
            eps.append(ep)
        ep *= 2
    return tuple(eps)


def best_baseline(req: PlanRequest, hw: Hardware, point: ProfilePoint) -> Baseline | None:
    """The wide-EP setting with the highest tokens/s per GPU (user's, measured or modeled)."""
    a = req.acceptance
    if req.baseline_step_ms is not None:
        ep = (req.baseline_eps or (0,))[0]
        assert req.baseline_batch is not None  # they go together (PlanRequest checks it)
        return Baseline(ep, req.baseline_batch, req.baseline_step_ms, "user", a)
    if point.has_baseline:
        size, batch, step_ms = point.baseline_ep, point.baseline_batch, point.baseline_step_ms
        assert size is not None and batch is not None and step_ms is not None  # whole or none
        return Baseline(size, batch, step_ms, "profile", a)
    best: Baseline | None = None
    for ep in req.baseline_eps or default_eps(req.model, hw):
        batch = colocated_batch(
            req.model, hw, req.context, req.output_len, ep, req.memory, req.draft_length
        )
        if batch < 1:
            continue
        step_ms = colocated_step(req.model, hw, point, batch, ep) * 1e3
        candidate = Baseline(ep, batch, step_ms, "modeled", a)
        if best is None or candidate.tokens_per_gpu > best.tokens_per_gpu:
            best = candidate
    return best


# -- one ratio ----------------------------------------------------------------------------------


def _max_hidden_q(
    model: ModelSpec,
    hw: Hardware,
    stages: tuple[StageTimes, ...],
    ratio: float,
    batch: int,
    ffn_gpus: int,
) -> int:
    attention = min(s.attention_s for s in stages if s.group.moe)
    per_q = ratio * batch / 2 * ffn_token_time(model, hw)
    return max(0, int(math.floor((attention - ffn_fixed_time(model, hw, ffn_gpus)) / per_q)))


def predict_ratio(
    model: ModelSpec,
    hw: Hardware,
    point: ProfilePoint,
    attn_gpus: int,
    ffn_gpus: int,
    batch: int,
    *,
    acceptance: float = 1.0,
    baseline: Baseline | None = None,
    ffn_budget: NearFreeBudget | None = None,
) -> RatioPrediction:
    """Eq. 3 and the throughput at one split and one per-attention-GPU batch."""
    ratio = attn_gpus / ffn_gpus
    step = afd_step(model, hw, point, batch, ratio, ffn_gpus)
    routed = ratio * batch / 2 * (point.draft_length + 1)
    decomposition = None
    if baseline is not None:
        decomposition = decompose(batch, step.step_s, baseline.batch, baseline.step_ms / 1e3, ratio)
    return RatioPrediction(
        attn_gpus=attn_gpus,
        ffn_gpus=ffn_gpus,
        batch=batch,
        step_ms=step.step_s * 1e3,
        exposed_ffn_ms=step.exposed_ffn_s * 1e3,
        tokens_per_gpu=afd_tokens_per_gpu(batch, step.step_s, ratio, acceptance),
        tokens_per_attn_gpu=attention_tokens_per_gpu(batch, step.step_s, acceptance),
        routed_tokens=routed,
        covered=step.covered,
        ffn_near_free=ffn_budget is None or routed <= ffn_budget.positions,
        max_hidden_q=_max_hidden_q(model, hw, step.stages, ratio, batch, ffn_gpus),
        decomposition=decomposition,
    )


def best_batch_prediction(
    model: ModelSpec,
    hw: Hardware,
    point: ProfilePoint,
    attn_gpus: int,
    ffn_gpus: int,
    max_batch: int,
    tune: bool = True,
    **kwargs: Any,
) -> RatioPrediction:
    """The prediction at the KV-full batch, or (tune=True) at the batch in
    [0.8 * max_batch, max_batch] with the highest X_all, e.g. one that drops a partial wave."""
    low = max(2, math.ceil(TUNE_BATCH_FLOOR * max_batch)) if tune else max_batch
    best: RatioPrediction | None = None
    for batch in range(max_batch, low - 1, -1):
        row = predict_ratio(model, hw, point, attn_gpus, ffn_gpus, batch, **kwargs)
        if best is None or row.tokens_per_gpu > best.tokens_per_gpu:
            best = row
    assert best is not None
    return best


# -- plan and recommend -------------------------------------------------------------------------


def candidate_ratios(
    hw: Hardware, ffn_gpus: int, ratios: tuple[int, ...] | None
) -> tuple[int, ...]:
    """The ratios r with (r + 1) * ffn_gpus GPUs inside one NVLink domain: the user's, or every
    integer from 1 (GB200 with a 4-GPU pool: 1..17)."""
    top = hw.nvlink_domain // ffn_gpus - 1
    return tuple(r for r in ratios or range(1, top + 1) if r <= top)


def plan(
    req: PlanRequest,
    profile: ColocatedProfile | None = None,
    dv_ms: float | None = None,
    kappa: float | None = None,
) -> PlanResult:
    """Predict every candidate ratio of `req` and pick the best. Raises ValueError on inputs
    that admit no prediction (no request fits, no FFN pool fits, missing profile context)."""
    hw = apply_calibration(req.hardware, profile)
    point, source = resolve_point(
        req.model, hw, req.context, req.draft_length, profile, dv_ms, kappa
    )
    max_batch = req.batch or _kv_full_batch(req, hw)
    baseline = best_baseline(req, hw, point)
    if req.ffn_gpus:
        problem = ffn_ranks_problem(req.model.num_experts, req.ffn_gpus)
        if problem is not None:
            raise ValueError(f"--ffn-gpus: {problem}")
        check_ffn_fits(req.model, hw, req.ffn_gpus, req.memory)
    pools = (req.ffn_gpus,) if req.ffn_gpus else ffn_pool_candidates(req.model, hw, req.memory)
    options = [_pool_rows(req, hw, point, pool, max_batch, baseline) for pool in pools]
    options = [o for o in options if o[2]]
    if not options:
        raise ValueError(
            f"ratios {list(req.ratios or ())} with an FFN pool of {list(pools)} GPUs exceed the "
            f"{hw.name} NVLink domain of {hw.nvlink_domain} GPUs"
        )
    pool, ffn_budget, rows = max(options, key=lambda o: max(r.tokens_per_gpu for r in o[2]))
    best_batch = max(rows, key=lambda r: r.tokens_per_gpu).batch
    notes = _notes(req, hw, point, source, profile, baseline)
    if len(pools) > 1:
        notes += (f"FFN pool of {pool} GPUs chosen among {list(pools)} (best X_all)",)
    return PlanResult(
        request=req,
        hardware=hw,
        point=point,
        dv_source=source,
        max_batch=max_batch,
        baseline=baseline,
        rows=rows,
        coverage_boundary=coverage_boundary(req.model, hw, point, best_batch, pool),
        attention_budget=attention_nfp(req.model, hw, req.context, best_batch / 2, req.tolerance),
        ffn_budget=ffn_budget,
        notes=notes,
    )


def _pool_rows(
    req: PlanRequest,
    hw: Hardware,
    point: ProfilePoint,
    pool: int,
    max_batch: int,
    baseline: Baseline | None,
) -> tuple[int, NearFreeBudget, tuple[RatioPrediction, ...]]:
    budget = ffn_nfp(req.model, hw, pool, req.tolerance)
    rows = tuple(
        best_batch_prediction(
            req.model,
            hw,
            point,
            r * pool,
            pool,
            max_batch,
            tune=req.tune_batch and req.batch is None,
            acceptance=req.acceptance,
            baseline=baseline,
            ffn_budget=budget,
        )
        for r in candidate_ratios(hw, pool, req.ratios)
    )
    return pool, budget, rows


def _kv_full_batch(req: PlanRequest, hw: Hardware) -> int:
    batch = attention_batch(
        req.model, hw, req.context, req.output_len, req.memory, req.draft_length
    )
    if batch < 2:
        raise ValueError(
            f"fewer than 2 requests of {format_context(req.context)} + {req.output_len} tokens fit "
            f"an attention GPU of {hw.name}; pass a batch or a shorter context"
        )
    return batch


def _notes(
    req: PlanRequest,
    hw: Hardware,
    point: ProfilePoint,
    source: str,
    profile: ColocatedProfile | None,
    baseline: Baseline | None,
) -> tuple[str, ...]:
    notes = []
    if not hw.calibrated:
        notes.append(f"{hw.name}: tau and u_c are GB200 values, not fitted here (calibrated=False)")
    if source.startswith("roofline"):
        notes.append("no colocated profile: D_V is a roofline lower bound; pass --profile")
    elif source.startswith("bundled") and hw.name != "gb200":
        notes.append(f"D_V from the paper's GB200 profile applied to {hw.name}")
    if profile is not None and profile.hardware and profile.hardware != hw.name:
        notes.append(f"profile measured on {profile.hardware}, planning for {hw.name}")
    if point.interpolated:
        notes.append(f"profile point at {format_context(req.context)} interpolated in log2(c)")
    if req.draft_length and point.t_draft_att_ms is None and point.t_draft_rest_ms is None:
        notes.append("T_draft not in the profile: taken as 0 (optimistic for d > 0)")
    if baseline is None:
        notes.append("no wide-EP width fits this workload: S_all not computed")
    elif baseline.source == "modeled":
        notes.append(
            f"baseline wide EP{baseline.ep} is modeled, not measured: it has no wide-EP cost "
            "beyond tau (on the paper's workloads S_all came out 2-28% below the measured one), "
            "so S_all here is conservative; put a measured baseline in the profile for A/B"
        )
    if req.model.num_linear_layers:
        notes.append("attention NFP covers full-attention layers only")
    return tuple(notes)


def recommend_ratio(
    model: ModelSpec | str,
    hardware: Hardware | str,
    context: int | str,
    total_ranks: int,
    *,
    output_len: int = 1024,
    draft_length: int = 0,
    profile: ColocatedProfile | None = None,
    dv_ms: float | None = None,
    batch: int | None = None,
    acceptance: float = 1.0,
    memory: MemoryAssumptions = DEFAULT_MEMORY,
) -> tuple[int, int, RatioPrediction]:
    """Split `total_ranks` devices into (attention, FFN) ranks maximising X_all.

    An FFN pool size is a candidate when it divides the routed experts and holds them in HBM.
    Returns (attn_ranks, ffn_ranks, prediction); raises ValueError when no split is feasible.
    """
    model = get_model(model) if isinstance(model, str) else model
    hw = apply_calibration(
        get_hardware(hardware) if isinstance(hardware, str) else hardware, profile
    )
    context = parse_context(context)
    if total_ranks < 2:
        raise ValueError(
            f"total_ranks must be >= 2 (one attention and one FFN rank), got {total_ranks}"
        )
    point, _ = resolve_point(model, hw, context, draft_length, profile, dv_ms)
    max_batch = batch or attention_batch(model, hw, context, output_len, memory, draft_length)
    if max_batch < 2:
        raise ValueError(f"fewer than 2 requests of {context} tokens fit an attention GPU")
    best: RatioPrediction | None = None
    for ffn in range(1, total_ranks):
        if ffn_ranks_problem(model.num_experts, ffn) or not ffn_fits(model, hw, ffn, memory):
            continue
        attn = total_ranks - ffn
        tune = batch is None
        row = best_batch_prediction(
            model, hw, point, attn, ffn, max_batch, tune=tune, acceptance=acceptance
        )
        if best is None or row.tokens_per_gpu > best.tokens_per_gpu:
            best = row
    if best is None:
        raise ValueError(f"no split of {total_ranks} ranks holds the experts of {model.name}")
    return best.attn_gpus, best.ffn_gpus, best
