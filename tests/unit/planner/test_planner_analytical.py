"""The FastAFD model: worked values, Eq. 3 structure, decomposition, win condition, coverage."""

from __future__ import annotations

import math

import pytest

from vllm_afd.planner import MODEL_PRESETS, ProfilePoint, afd_step, coverage_boundary, decompose
from vllm_afd.planner.analytical import (
    afd_tokens_per_gpu,
    attention_time,
    colocated_step,
    ffn_fixed_time,
    ffn_service,
    ffn_token_time,
    full_attention_time,
    layer_groups,
    wave_time,
)

# planner-spec.md "Worked check values": model, context, r, b_A, D_V (ms), predicted T_A (ms).
WORKED = [
    ("minimax-m2.5", 4096, 1, 156, 3.831, 34.047),
    ("minimax-m2.5", 8192, 15, 76, 3.640, 30.794),
    ("qwen3-235b-a22b", 4096, 7, 198, 5.789, 47.649),
    ("qwen3.5-397b-a17b", 8192, 3, 373, 7.223, 51.127),
]


@pytest.mark.parametrize(("model", "context", "ratio", "batch", "dv_ms", "expected"), WORKED)
def test_worked_values_reproduce(gb200, model, context, ratio, batch, dv_ms, expected):
    step = afd_step(MODEL_PRESETS[model], gb200, ProfilePoint(context, dv_ms), batch, ratio, 4)
    assert step.step_s * 1e3 == pytest.approx(expected, abs=0.01)


def test_wave_model_full_and_partial_waves(gb200):
    block = 1e6
    one_wave = 152 * block / (0.89 * 7.93e12)
    assert wave_time(152, block, gb200) == pytest.approx(one_wave)
    # A tiny partial wave costs the per-SM floor B/BW_SM (no u), not k*B/(u BW).
    assert wave_time(153, block, gb200) == pytest.approx(one_wave + block / 107e9)
    # A big partial wave costs k*B/(u BW).
    assert wave_time(152 + 100, block, gb200) == pytest.approx(one_wave * (1 + 100 / 152))


def test_attention_blocks_round_fractional_requests(gb200, qwen3):
    # b_A odd -> n = 98.5 -> N = 394 blocks with 4 KV heads (no rounding needed) ...
    odd = full_attention_time(qwen3, gb200, 4096, 98.5)
    assert odd == pytest.approx(wave_time(394, 4 * 128 * (4096 + 256), gb200))
    # ... and a count like 2.5 blocks rounds half up.
    assert full_attention_time(qwen3, gb200, 4096, 0.625) == pytest.approx(
        wave_time(3, 4 * 128 * (4096 + 256), gb200)
    )


def test_ffn_service_matches_a2(gb200, qwen3):
    weights = 128 * 3 * 4096 * 1536 / 4
    expected = 42.834448717e-6 + weights / (0.89 * 7.93e12)
    expected += 100 * 6 * 4096 * 1536 * 8 / (0.3347407189 * 5e15)
    assert ffn_service(qwen3, gb200, 100, 4) == pytest.approx(expected)


def test_step_is_draft_plus_twice_the_per_layer_max(gb200, qwen3):
    point = ProfilePoint(8192, 5.513)
    step = afd_step(qwen3, gb200, point, 105, 7, 4)
    (stage,) = step.stages
    t_a = full_attention_time(qwen3, gb200, 8192, 52.5) + 5.513e-3 / 94
    t_e = ffn_service(qwen3, gb200, 7 * 52.5, 4)
    assert stage.attention_s == pytest.approx(t_a)
    assert stage.ffn_s == pytest.approx(t_e)
    assert step.step_s == pytest.approx(2 * 94 * max(t_a, t_e))
    assert step.exposed_ffn_s == pytest.approx(2 * 94 * max(0.0, t_e - t_a))


def test_hybrid_takes_the_max_per_layer_type(gb200, qwen35):
    assert [(g.kind, g.count) for g in layer_groups(qwen35)] == [("full", 15), ("linear", 45)]
    point, n = ProfilePoint(8192, 7.223), 186.5
    step = afd_step(qwen35, gb200, point, 373, 3, 4)
    aux = 7.223e-3 / 60
    t_full = attention_time(qwen35, gb200, "full", 8192, n) + aux
    t_gd = 1.3677e-6 * n + aux
    t_e = ffn_service(qwen35, gb200, 3 * n, 4)
    assert step.step_s == pytest.approx(2 * (15 * max(t_full, t_e) + 45 * max(t_gd, t_e)))
    # At r = 5 the FFN stage outlasts the gated-delta layers only; averaging the two attention
    # types first would hide that exposed time.
    t_e5 = ffn_service(qwen35, gb200, 5 * n, 4)
    assert t_gd < t_e5 < t_full
    step5 = afd_step(qwen35, gb200, point, 373, 5, 4)
    averaged = 2 * 60 * max((15 * t_full + 45 * t_gd) / 60, t_e5)
    assert step5.step_s == pytest.approx(2 * (15 * t_full + 45 * t_e5))
    assert step5.step_s > averaged


def test_speculative_multiplies_routed_tokens_and_scales_draft_time(gb200, minimax):
    plain = afd_step(minimax, gb200, ProfilePoint(4096, 5.0788), 126, 4, 4)
    spec = ProfilePoint(
        4096,
        5.0788,
        draft_length=3,
        kappa=1.032,
        profile_batch=63,
        t_draft_att_ms=1.0,
        t_draft_rest_ms=0.5,
    )
    step = afd_step(minimax, gb200, spec, 126, 4, 4)
    assert step.stages[0].ffn_s == pytest.approx(ffn_service(minimax, gb200, 4 * 63 * 4, 4))
    assert step.stages[0].attention_s > plain.stages[0].attention_s  # kappa > 1
    # T_draft = (b_A / b_p) T_draft,att + T_draft,rest = 2 * 1.0 + 0.5 ms
    assert step.draft_s == pytest.approx(2.5e-3)


def test_decomposition_identity_and_win_condition():
    for b_a, t_a, b_v, t_v, r in [(160, 0.030, 150, 0.033, 15), (190, 0.034, 186, 0.035, 3)]:
        d = decompose(b_a, t_a, b_v, t_v, r)
        assert d.s_all == pytest.approx(d.batch_gain * d.overlap_gain * r / (r + 1))
        x_afd = afd_tokens_per_gpu(b_a, t_a, r)
        assert d.s_all == pytest.approx(x_afd / (b_v / t_v))  # S_all is the throughput ratio
        assert d.s_att == pytest.approx(d.s_all * (r + 1) / r)
        assert d.wins == (d.s_all > 1)
    assert decompose(160, 0.030, 150, 0.033, 15).wins
    assert not decompose(190, 0.034, 186, 0.035, 3).wins


def test_coverage_boundary_separates_hidden_from_exposed(gb200, qwen3):
    point = ProfilePoint(8192, 5.513)
    boundary = coverage_boundary(qwen3, gb200, point, 105, 4)
    inside = afd_step(qwen3, gb200, point, 105, math.floor(boundary), 4)
    outside = afd_step(qwen3, gb200, point, 105, math.floor(boundary) + 1, 4)
    at = afd_step(qwen3, gb200, point, 105, boundary, 4)
    assert inside.covered and inside.exposed_ffn_s == 0
    assert not outside.covered and outside.exposed_ffn_s > 0
    assert at.stages[0].ffn_s == pytest.approx(at.stages[0].attention_s)
    # Below the boundary the step does not depend on r; above it grows.
    assert afd_step(qwen3, gb200, point, 105, 1, 4).step_s == pytest.approx(inside.step_s)
    assert outside.step_s > inside.step_s


def test_coverage_boundary_is_zero_when_ffn_never_hides(gb200, qwen35):
    # At a tiny batch the gated-delta stage is shorter than the FFN intercept F_0.
    assert ffn_fixed_time(qwen35, gb200, 4) > 1.3677e-6 * 2 + 7.223e-3 / 60
    assert coverage_boundary(qwen35, gb200, ProfilePoint(8192, 7.223), 4, 4) == 0.0


def test_colocated_step_runs_one_batch_with_ep_sharded_experts(gb200, qwen3):
    point = ProfilePoint(4096, 5.789)
    t_v = colocated_step(qwen3, gb200, point, 132, 4)
    per_layer = full_attention_time(qwen3, gb200, 4096, 132) + 5.789e-3 / 94
    per_layer += ffn_fixed_time(qwen3, gb200, 4) + 132 * ffn_token_time(qwen3, gb200)
    assert t_v == pytest.approx(94 * per_layer)
    assert colocated_step(qwen3, gb200, point, 132, 32) < t_v  # fewer expert bytes per GPU


@pytest.mark.parametrize("bad", [{"batch": 0}, {"ratio": 0}, {"ffn_gpus": 0}])
def test_afd_step_rejects_non_positive_inputs(gb200, qwen3, bad):
    args = {"batch": 100, "ratio": 3, "ffn_gpus": 4} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        afd_step(qwen3, gb200, ProfilePoint(4096, 5.0), **args)
