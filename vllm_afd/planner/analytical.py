"""The FastAFD per-layer model (arXiv 2611.07149 Section 4, App. C) as planner-spec.md fixes it.

One AFD decode step runs two ping-pong microbatches of n = b_A / 2 requests. In every layer one
microbatch's attention stage T_a overlaps the other's FFN stage T_e on the FFN pool, so

    T_A = T_draft + 2 * sum_l max(T_a,l, T_e,l)                                   (Eq. 3)
    T_a = kappa * A_l(n) + D_V / L        (A6; kappa = 1, D_V from the d = 0 profile otherwise)
    T_e = F(m) = tau + W / (u BW) + m * 6 H I K / (u_c P),   m = r n q             (A2)

with A_l the wave model (A1) for full attention and 1.3677 us per request for Qwen3.5's
gated-delta layers; W = E * 3 H I bytes / (FFN GPUs). Hybrid models take the max per layer type
before summing. The colocated (wide-EP) step uses the same pieces on one batch of b_V requests:

    T_V = T_draft + sum_l (kappa * A_l(b_V) + D_V / L + F_EP(b_V q)),   W_EP = E * 3 H I / EP

which is the planner's own extension (the paper measures T_V); a measured T_V from the profile
replaces it. Units are seconds throughout; `ratio` r is attention GPUs per FFN GPU, so r:1 node
ratios with equal node sizes give the same r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_afd.planner.hardware import Hardware
from vllm_afd.planner.models import ModelSpec
from vllm_afd.planner.profile_io import ProfilePoint

FULL = "full"
LINEAR = "linear"


def round_half_up(x: float) -> int:
    """Block counts are rounded to integers (n may be fractional when b_A is odd)."""
    return int(math.floor(x + 0.5))


# -- attention (A1) -----------------------------------------------------------------------------


def wave_time(blocks: int, block_bytes: float, hw: Hardware) -> float:
    """A1: N blocks of B_blk bytes over S_SM SMs; a partial wave costs at least B_blk / BW_SM."""
    full_waves, rest = divmod(blocks, hw.num_sms)
    t = full_waves * hw.num_sms * block_bytes / hw.effective_bandwidth
    if rest:
        t += max(rest * block_bytes / hw.effective_bandwidth, block_bytes / hw.sm_bandwidth)
    return t


def attention_blocks(model: ModelSpec, n: float) -> int:
    return round_half_up(n * model.kv_blocks_per_request)


def attention_block_bytes(model: ModelSpec, context: int) -> float:
    return model.kv_block_bytes_per_token * (context + model.attn_offset_tokens)


def full_attention_time(model: ModelSpec, hw: Hardware, context: int, n: float) -> float:
    return wave_time(attention_blocks(model, n), attention_block_bytes(model, context), hw)


def linear_attention_time(model: ModelSpec, hw: Hardware, n: float) -> float:
    """Gated-delta decode: the spec's constant, else one read and one write of the state."""
    if model.linear_request_time is not None:
        return model.linear_request_time * n
    return n * 2 * model.linear_state_bytes_per_layer / hw.effective_bandwidth


def attention_time(model: ModelSpec, hw: Hardware, kind: str, context: int, n: float) -> float:
    """A_l(n) for a layer of `kind` (FULL or LINEAR), seconds."""
    if kind == LINEAR:
        return linear_attention_time(model, hw, n)
    return full_attention_time(model, hw, context, n)


# -- FFN service (A2) ---------------------------------------------------------------------------


def expert_flops_rate(model: ModelSpec, hw: Hardware) -> float:
    """P for the expert GEMMs: the FP8 rate for 8-bit or narrower experts (their scales make
    them slightly over 1 byte per parameter), the BF16 rate for 16-bit and wider ones."""
    return hw.fp8_flops if model.expert_bytes_per_param < 2 else hw.bf16_flops


def ffn_fixed_time(model: ModelSpec, hw: Hardware, ffn_gpus: int) -> float:
    """F_0 = tau + W / (u BW): the intercept of A2."""
    weight_bytes = model.expert_bytes_per_layer / ffn_gpus
    return hw.dispatch_intercept + weight_bytes / hw.effective_bandwidth


def ffn_token_time(model: ModelSpec, hw: Hardware) -> float:
    """c = 6 H I K / (u_c P): the slope of A2, seconds per routed token."""
    flops = 6 * model.hidden_size * model.moe_intermediate_size * model.top_k
    return flops / (hw.gemm_efficiency * expert_flops_rate(model, hw))


def ffn_service(model: ModelSpec, hw: Hardware, tokens: float, ffn_gpus: int) -> float:
    """A2: F(m) for m routed tokens per FFN GPU, seconds."""
    return ffn_fixed_time(model, hw, ffn_gpus) + tokens * ffn_token_time(model, hw)


# -- step period (Eq. 3) ------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share an attention kind and whether they have routed experts."""

    kind: str
    count: int
    moe: bool = True


def layer_groups(model: ModelSpec) -> tuple[LayerGroup, ...]:
    groups = (
        LayerGroup(FULL, model.num_full_layers - model.num_dense_layers),
        LayerGroup(FULL, model.num_dense_layers, moe=False),
        LayerGroup(LINEAR, model.num_linear_layers),
    )
    return tuple(g for g in groups if g.count > 0)


@dataclass(frozen=True)
class StageTimes:
    """Per-layer stage times of one layer group, seconds."""

    group: LayerGroup
    attention_s: float
    """T_a = kappa * A_l(n) + D_V / L."""
    ffn_s: float
    """T_e = F(r n q); 0 for layers without routed experts."""

    @property
    def covered(self) -> bool:
        return self.ffn_s <= self.attention_s

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.ffn_s - self.attention_s)


@dataclass(frozen=True)
class StepPrediction:
    """Eq. 3 evaluated: T_A = T_draft + 2 * sum over layers of max(T_a, T_e)."""

    stages: tuple[StageTimes, ...]
    draft_s: float = 0.0

    @property
    def step_s(self) -> float:
        layers = sum(s.group.count * max(s.attention_s, s.ffn_s) for s in self.stages)
        return self.draft_s + 2 * layers

    @property
    def covered(self) -> bool:
        """True when the FFN stage hides behind attention in every layer (T_e <= T_a)."""
        return all(s.covered for s in self.stages)

    @property
    def exposed_ffn_s(self) -> float:
        """T_exp = 2 * sum_l max(0, T_e - T_a): FFN time left on the critical path."""
        return 2 * sum(s.group.count * s.exposed_s for s in self.stages)


def afd_step(
    model: ModelSpec,
    hw: Hardware,
    point: ProfilePoint,
    batch: float,
    ratio: float,
    ffn_gpus: int,
) -> StepPrediction:
    """Predicted AFD step for b_A = `batch` per attention GPU at `ratio` attention GPUs per FFN
    GPU, with D_V, kappa, d and the draft times taken from the profile `point`."""
    _check_positive(batch=batch, ratio=ratio, ffn_gpus=ffn_gpus)
    n = batch / 2
    routed = ratio * n * (point.draft_length + 1)
    ffn = ffn_service(model, hw, routed, ffn_gpus)
    aux = point.dv_ms / 1e3 / model.num_layers
    stages = tuple(
        StageTimes(
            group=g,
            attention_s=point.kappa * attention_time(model, hw, g.kind, point.context, n) + aux,
            ffn_s=ffn if g.moe else 0.0,
        )
        for g in layer_groups(model)
    )
    return StepPrediction(stages=stages, draft_s=point.draft_time_s(batch))


def colocated_step(
    model: ModelSpec, hw: Hardware, point: ProfilePoint, batch: float, ep: int
) -> float:
    """Modeled wide-EP step T_V (seconds) for b_V = `batch` per GPU at expert parallelism `ep`."""
    _check_positive(batch=batch, ep=ep)
    q = point.draft_length + 1
    moe = ffn_service(model, hw, batch * q, ep)
    aux = point.dv_ms / 1e3 / model.num_layers
    total = point.draft_time_s(batch)
    for g in layer_groups(model):
        attention = point.kappa * attention_time(model, hw, g.kind, point.context, batch)
        total += g.count * (attention + aux + (moe if g.moe else 0.0))
    return total


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


# -- throughput, decomposition, win condition, coverage ------------------------------------------


def afd_tokens_per_gpu(batch: float, step_s: float, ratio: float, acceptance: float = 1.0) -> float:
    """X_all = r / (r + 1) * b_A * a / T_A: decode tokens/s per GPU counting FFN GPUs."""
    return ratio / (ratio + 1) * batch * acceptance / step_s


def attention_tokens_per_gpu(batch: float, step_s: float, acceptance: float = 1.0) -> float:
    """Decode tokens/s per attention GPU (FFN GPUs not counted)."""
    return batch * acceptance / step_s


@dataclass(frozen=True)
class Decomposition:
    """Eq. 2: S_all = batch gain * overlap gain * disaggregation cost."""

    batch_gain: float
    """b_A / b_V."""
    overlap_gain: float
    """T_V / T_A."""
    ratio: float

    @property
    def disaggregation_cost(self) -> float:
        """r / (r + 1): the share of GPUs that hold KV cache and emit tokens."""
        return self.ratio / (self.ratio + 1)

    @property
    def s_att(self) -> float:
        return self.batch_gain * self.overlap_gain

    @property
    def s_all(self) -> float:
        return self.s_att * self.disaggregation_cost

    @property
    def wins(self) -> bool:
        """Win condition (Eq. 4): (b_A / b_V)(T_V / T_A) > 1 + 1/r, i.e. S_all > 1."""
        return self.s_att > 1 + 1 / self.ratio


def decompose(
    afd_batch: float, afd_step_s: float, base_batch: float, base_step_s: float, ratio: float
) -> Decomposition:
    _check_positive(afd_batch=afd_batch, afd_step_s=afd_step_s, base_batch=base_batch)
    _check_positive(base_step_s=base_step_s, ratio=ratio)
    return Decomposition(afd_batch / base_batch, base_step_s / afd_step_s, ratio)


def coverage_boundary(
    model: ModelSpec, hw: Hardware, point: ProfilePoint, batch: float, ffn_gpus: int
) -> float:
    """The largest ratio r (continuous) with T_e(r) <= T_a in every MoE layer; 0 if none.

    T_e grows linearly in r (A2) and T_a does not depend on r, so per layer group
    r* = (T_a - F_0) / (n q c), and the boundary is the smallest over groups.
    """
    step = afd_step(model, hw, point, batch, ratio=1.0, ffn_gpus=ffn_gpus)
    per_ratio = batch / 2 * (point.draft_length + 1) * ffn_token_time(model, hw)
    fixed = ffn_fixed_time(model, hw, ffn_gpus)
    bounds = [(s.attention_s - fixed) / per_ratio for s in step.stages if s.group.moe]
    return max(0.0, min(bounds))
