"""plan() and recommend_ratio(): ratio selection, baselines, overrides, profiles."""

from __future__ import annotations

import pytest

from vllm_afd.planner import (
    ColocatedProfile,
    PlanRequest,
    ProfilePoint,
    afd_step,
    get_hardware,
    plan,
    recommend_ratio,
)
from vllm_afd.planner.memory import attention_batch, ffn_fits
from vllm_afd.planner.planning import apply_calibration, best_batch_prediction, resolve_point

# The paper's measured best ratio per workload (Table 1; candidates odd 1..17).
PAPER_BEST = [
    ("minimax-m2.5", 4096, 9),
    ("minimax-m2.5", 8192, 15),
    ("minimax-m2.5", 16384, 17),
    ("qwen3-235b-a22b", 4096, 5),
    ("qwen3-235b-a22b", 8192, 7),
    ("qwen3-235b-a22b", 16384, 11),
    ("qwen3.5-397b-a17b", 4096, 5),
    ("qwen3.5-397b-a17b", 8192, 5),
    ("qwen3.5-397b-a17b", 16384, 5),
]
ODD = tuple(range(1, 18, 2))


@pytest.mark.parametrize(("model", "context", "best"), PAPER_BEST)
def test_zero_measurement_selection_lands_within_one_step(gb200, model, context, best):
    from vllm_afd.planner import get_model

    result = plan(PlanRequest(get_model(model), gb200, context, ratios=ODD))
    assert abs(result.recommended.ratio - best) <= 2


def test_default_candidates_fill_the_rack(gb200, qwen3):
    result = plan(PlanRequest(qwen3, gb200, 8192))
    assert [r.ratio for r in result.rows] == list(range(1, 18))
    assert all(r.ffn_gpus == 4 and r.attn_gpus == 4 * r.ratio for r in result.rows)
    best = max(result.rows, key=lambda r: r.tokens_per_gpu)
    assert result.recommended is best
    # Rows below the coverage boundary are covered, rows above are not.
    for row in result.rows:
        assert row.covered == (row.ratio <= result.coverage_boundary)


def test_batch_override_is_used_as_is(gb200, minimax):
    result = plan(PlanRequest(minimax, gb200, 8192, ratios=(15,), batch=76))
    (row,) = result.rows
    assert row.batch == 76 and result.max_batch == 76
    assert row.step_ms == pytest.approx(30.794, abs=0.01)  # the spec's worked value
    assert row.tokens_per_gpu == pytest.approx(15 / 16 * 76 / (row.step_ms / 1e3))


def test_batch_tuning_never_loses_throughput(gb200, minimax):
    tuned = plan(PlanRequest(minimax, gb200, 8192))
    full = plan(PlanRequest(minimax, gb200, 8192, tune_batch=False))
    for a, b in zip(tuned.rows, full.rows, strict=True):
        assert a.tokens_per_gpu >= b.tokens_per_gpu - 1e-9
        assert 0.8 * full.max_batch <= a.batch <= full.max_batch
    assert all(r.batch == full.max_batch for r in full.rows)


def test_user_baseline_gives_the_decomposition(gb200, qwen3):
    req = PlanRequest(
        qwen3,
        gb200,
        4096,
        ratios=(7,),
        batch=198,
        baseline_eps=(16,),
        baseline_batch=180,
        baseline_step_ms=50.0,
    )
    result = plan(req, dv_ms=5.789)
    (row,) = result.rows
    assert result.baseline.source == "user" and result.baseline.ep == 16
    d = row.decomposition
    assert d.batch_gain == pytest.approx(198 / 180)
    assert d.overlap_gain == pytest.approx(50.0 / 47.649, rel=1e-4)
    assert row.s_all == pytest.approx(d.batch_gain * d.overlap_gain * 7 / 8)
    assert row.s_all == pytest.approx(row.tokens_per_gpu / result.baseline.tokens_per_gpu)
    assert d.wins == (row.s_all > 1)


def test_modeled_baseline_picks_the_best_width(gb200, qwen3):
    result = plan(PlanRequest(qwen3, gb200, 8192, baseline_eps=(4, 16)))
    assert result.baseline.source == "modeled" and result.baseline.ep in (4, 16)
    only4 = plan(PlanRequest(qwen3, gb200, 8192, baseline_eps=(4,))).baseline
    only16 = plan(PlanRequest(qwen3, gb200, 8192, baseline_eps=(16,))).baseline
    assert result.baseline.tokens_per_gpu == max(only4.tokens_per_gpu, only16.tokens_per_gpu)


def test_profile_baseline_and_fit_are_applied(gb200, qwen3):
    profile = ColocatedProfile(
        model="qwen3-235b-a22b",
        hardware="gb200",
        points=(
            ProfilePoint(8192, 5.513, baseline_ep=16, baseline_batch=96, baseline_step_ms=38.0),
        ),
        dispatch_intercept_us=60.0,
        gemm_efficiency=0.25,
    )
    result = plan(PlanRequest(qwen3, gb200, 8192, ratios=(7,), batch=105), profile=profile)
    assert result.baseline.source == "profile" and result.baseline.step_ms == 38.0
    assert result.hardware.dispatch_intercept == pytest.approx(60e-6)
    slower = afd_step(qwen3, result.hardware, result.point, 105, 7, 4).step_s * 1e3
    assert result.rows[0].step_ms == pytest.approx(slower)
    assert slower > plan(PlanRequest(qwen3, gb200, 8192, ratios=(7,), batch=105)).rows[0].step_ms


def test_calibration_marks_hardware_calibrated():
    h200 = get_hardware("h200")
    half = ColocatedProfile("m", "h200", (ProfilePoint(4096, 1.0),), dispatch_intercept_us=30.0)
    both = ColocatedProfile("m", "h200", (ProfilePoint(4096, 1.0),), 30.0, 0.4)
    assert not apply_calibration(h200, half).calibrated
    assert apply_calibration(h200, both).calibrated


def test_speculative_decoding_lowers_the_best_ratio(gb200, minimax):
    standard = plan(PlanRequest(minimax, gb200, 16384))
    spec = plan(PlanRequest(minimax, gb200, 16384, draft_length=3, acceptance=1.8))
    assert spec.point.draft_length == 3 and spec.point.kappa == pytest.approx(0.9914)
    assert spec.recommended.ratio < standard.recommended.ratio
    assert spec.coverage_boundary < standard.coverage_boundary / 3
    assert any("T_draft" in n for n in spec.notes)


def test_unprofiled_model_falls_back_with_a_note(gb200, qwen3):
    renamed = qwen3.__class__(**{**qwen3.__dict__, "name": "my-moe"})
    result = plan(PlanRequest(renamed, gb200, 4096))
    assert result.dv_source.startswith("roofline")
    assert 0 < result.point.dv_ms < 5.789  # a lower bound on the measured 5.789 ms
    assert any("roofline lower bound" in n for n in result.notes)


def test_plan_errors_are_clear(gb200, qwen3):
    with pytest.raises(ValueError, match="profiled contexts"):
        plan(PlanRequest(qwen3, gb200, 32768))
    with pytest.raises(ValueError, match="fewer than 2 requests"):
        plan(PlanRequest(qwen3, gb200, 4 << 20), dv_ms=5.0)
    with pytest.raises(ValueError, match="PlanRequest.acceptance"):
        PlanRequest(qwen3, gb200, 4096, acceptance=0.5)


def test_recommend_ratio_splits_the_given_devices(gb200, qwen3):
    attn, ffn, prediction = recommend_ratio("qwen3-235b-a22b", "gb200", "8K", 32)
    assert attn + ffn == 32 and 128 % ffn == 0
    assert (prediction.attn_gpus, prediction.ffn_gpus) == (attn, ffn)
    point, _ = resolve_point(qwen3, gb200, 8192, 0)
    max_batch = attention_batch(qwen3, gb200, 8192, 1024)
    tried = 0
    for pool in (1, 2, 4, 8, 16):
        if ffn_fits(qwen3, gb200, pool):
            row = best_batch_prediction(qwen3, gb200, point, 32 - pool, pool, max_batch)
            assert prediction.tokens_per_gpu >= row.tokens_per_gpu - 1e-9
            tried += 1
    assert tried == 4  # one GPU cannot hold the 227 GB of experts
    with pytest.raises(ValueError, match="no split of 2 ranks"):
        recommend_ratio("qwen3.5-397b-a17b", "h100", "8K", 2)
    with pytest.raises(ValueError, match="total_ranks"):
        recommend_ratio(qwen3, "gb200", 8192, 1)
