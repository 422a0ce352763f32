"""Near-free parallelism (NFP): how many positions a stage runs at almost the cost of one.

He et al. (EMNLP Findings 2026, arXiv 2605.30851; only the abstract is available to us) define
NFP as the largest number of positions a module executes within a latency tolerance of one
position, and find that it is set by hardware balance *and* kernel granularity, while the
idle-compute (roofline) intuition over-predicts it by 2.4-23x in most settings. This module is our
reading of that principle, applied to the two AFD stages:

- Attention stage, positions = q verified positions per request (draft length d = q - 1). A decode
  attention block serves q * G query rows (G = query heads per KV head) in tiles of `attn_tile_m`
  rows. Latency = the KV read (A1 wave model) + the MMA work of the padded tiles at the BF16 rate,
  quantized in waves of blocks over the SMs. Extra positions are free while they fill the partly
  empty tile (granularity slack) and cost a tile's compute once they open a new one.
- FFN stage, positions = routed tokens per FFN GPU (m = r n q). Latency = A2's intercept + the
  expert GEMMs in tiles of `gemm_tile_m` x `gemm_tile_n` at the calibrated rate u_c P, quantized
  in waves over the SMs; it tends to A2's slope as m grows. The calibrated u_c already absorbs
  per-expert tile padding at profiled loads, so tiles are counted over the packed rows.
- Idle-compute estimate, beside each: latency = max(bytes / BW, positions * FLOPs / P) at peak
  rates (hardware balance only): positions are free up to the ridge point times (1 + tolerance).

Both stage models assume latency rises additively with compute (no hiding behind memory), which is
what the fitted A2 shows on real kernels. Checked against the paper's measured kappa (Table A13):
at 10% tolerance the attention model gives NFP q = 4 for Qwen3 (G = 16; measured kappa(q=4) <= 1.05
and kappa(q=8) = 1.06-1.15) and q = 10 for MiniMax-M2.5 (G = 6; measured kappa(q=8) <= 1.04). As a
kappa estimate it overshoots at small batches (Qwen3 16K: 1.27 predicted, 1.06 measured), where a
single partial wave hides more compute than the additive model allows. Tile sizes are hardware
fields: set them to the kernels you run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from vllm_afd.planner.analytical import (
    attention_block_bytes,
    attention_blocks,
    expert_flops_rate,
    ffn_fixed_time,
    wave_time,
)
from vllm_afd.planner.hardware import Hardware
from vllm_afd.planner.models import ModelSpec

DEFAULT_TOLERANCE = 0.10
_SEARCH_LIMIT = 1 << 24


@dataclass(frozen=True)
class NearFreeBudget:
    """The NFP of one stage under a latency tolerance."""

    stage: str
    unit: str
    tolerance: float
    positions: int
    """NFP predicted from hardware balance and kernel granularity."""
    idle_compute: int
    """The idle-compute (roofline) estimate, for comparison."""
    base_latency_s: float
    """Predicted latency at one position."""

    def __post_init__(self) -> None:
        if self.tolerance <= 0:
            raise ValueError("NearFreeBudget.tolerance must be > 0")
        if self.positions < 1 or self.idle_compute < 1:
            raise ValueError("NearFreeBudget.positions and idle_compute must be >= 1")

    @property
    def over_prediction(self) -> float:
        """How many times the idle-compute estimate exceeds the principle's NFP."""
        return self.idle_compute / self.positions


def near_free_positions(
    latency: Callable[[int], float], tolerance: float, limit: int = _SEARCH_LIMIT
) -> int:
    """Largest p <= limit with latency(p) <= (1 + tolerance) * latency(1); latency must be
    non-decreasing in p."""
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    budget = (1 + tolerance) * latency(1)
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if latency(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _idle_compute_positions(memory_s: float, compute_per_position_s: float, tol: float) -> int:
    """Roofline: max(memory, p * compute) <= (1 + tol) * max(memory, compute)."""
    base = max(memory_s, compute_per_position_s)
    return max(1, int(math.floor((1 + tol) * base / compute_per_position_s)))


# -- attention stage ----------------------------------------------------------------------------


def attention_flops_per_row_token(model: ModelSpec) -> float:
    """MMA ops per query row per context token: QK^T plus PV."""
    if model.is_mla:
        return 2 * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
    return 4 * model.head_dim


def attention_latency(model: ModelSpec, hw: Hardware, context: int, n: float, q: int) -> float:
    """Full-attention layer time for n requests verifying q positions each, seconds."""
    blocks = attention_blocks(model, n)
    tokens = context + model.attn_offset_tokens
    memory = wave_time(blocks, attention_block_bytes(model, context), hw)
    tiles = math.ceil(q * model.gqa_group / hw.attn_tile_m)
    tile_ops = hw.attn_tile_m * attention_flops_per_row_token(model) * tokens
    waves = math.ceil(blocks / hw.num_sms)
    return memory + waves * tiles * tile_ops / (hw.bf16_flops / hw.num_sms)


def predicted_kappa(model: ModelSpec, hw: Hardware, context: int, n: float, q: int) -> float:
    """kappa(q) = attention time at q positions over 1 position (the profile's kappa)."""
    return attention_latency(model, hw, context, n, q) / attention_latency(model, hw, context, n, 1)


def attention_nfp(
    model: ModelSpec,
    hw: Hardware,
    context: int,
    n: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> NearFreeBudget:
    """NFP of the attention stage in verified positions q per request (full-attention layers)."""
    n = max(n, 1.0)

    def latency(q: int) -> float:
        return attention_latency(model, hw, context, n, q)

    tokens = context + model.attn_offset_tokens
    per_row = attention_flops_per_row_token(model) * tokens
    memory = attention_block_bytes(model, context) / hw.hbm_bandwidth
    compute = model.gqa_group * per_row / hw.bf16_flops
    return NearFreeBudget(
        stage="attention",
        unit="verified positions q per request",
        tolerance=tolerance,
        positions=near_free_positions(latency, tolerance, limit=4096),
        idle_compute=_idle_compute_positions(memory, compute, tolerance),
        base_latency_s=latency(1),
    )


# -- FFN stage ----------------------------------------------------------------------------------


def ffn_latency(model: ModelSpec, hw: Hardware, ffn_gpus: int, tokens: int) -> float:
    """FFN service for `tokens` routed tokens per FFN GPU with tile and wave granularity."""
    rows = tokens * model.top_k
    m_tiles = math.ceil(rows / hw.gemm_tile_m)
    sm_rate = hw.gemm_efficiency * expert_flops_rate(model, hw) / hw.num_sms
    h, i = model.hidden_size, model.moe_intermediate_size
    total = ffn_fixed_time(model, hw, ffn_gpus)
    for n_dim, k_dim in ((2 * i, h), (h, i)):  # gate+up, then down
        tiles = m_tiles * math.ceil(n_dim / hw.gemm_tile_n)
        tile_time = 2 * hw.gemm_tile_m * hw.gemm_tile_n * k_dim / sm_rate
        total += math.ceil(tiles / hw.num_sms) * tile_time
    return total


def ffn_nfp(
    model: ModelSpec, hw: Hardware, ffn_gpus: int, tolerance: float = DEFAULT_TOLERANCE
) -> NearFreeBudget:
    """NFP of the FFN stage in routed tokens per FFN GPU."""

    def latency(m: int) -> float:
        return ffn_latency(model, hw, ffn_gpus, m)

    flops = 6 * model.hidden_size * model.moe_intermediate_size * model.top_k
    memory = model.expert_bytes_per_layer / ffn_gpus / hw.hbm_bandwidth
    return NearFreeBudget(
        stage="ffn",
        unit="routed tokens per FFN GPU",
        tolerance=tolerance,
        positions=near_free_positions(latency, tolerance),
        idle_compute=_idle_compute_positions(
            memory, flops / expert_flops_rate(model, hw), tolerance
        ),
        base_latency_s=latency(1),
    )


def recommend_draft_length(budget: NearFreeBudget) -> int:
    """The largest draft length whose verification stays near-free on attention: q_NFP - 1."""
    if budget.stage != "attention":
        raise ValueError("recommend_draft_length needs the attention-stage budget")
    return budget.positions - 1
