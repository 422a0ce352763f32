"""The CPU step-period predictions (planner.cpu): colocated, AFD k = 1 in series, k = 2 Eq. 3
with the pipeline's fill/drain."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_afd.planner.cpu import (
    CpuFit,
    cpu_fit_from_dict,
    cpu_fit_to_dict,
    load_cpu_fit,
    predict_afd,
    predict_colocated,
)
from vllm_afd.planner.hardware import Hardware
from vllm_afd.planner.models import ModelSpec

MODEL = ModelSpec(
    name="tiny",
    num_layers=2,
    num_experts=8,
    top_k=2,
    hidden_size=128,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=32,
    expert_bytes_per_param=4,
)
# One CPU rank: 10 GB/s, 50 GFLOP/s, u = 1, u_c = 0.5, tau = 100 us.
HW = Hardware(
    name="cpu-1t",
    hbm_bandwidth=10e9,
    hbm_capacity=8e9,
    num_sms=1,
    sm_bandwidth=10e9,
    fp8_flops=50e9,
    bf16_flops=50e9,
    bandwidth_efficiency=1.0,
    gemm_efficiency=0.5,
    dispatch_intercept=100e-6,
    gpus_per_node=2,
    nvlink_domain=2,
)
FIT = CpuFit(attention=(50e-6, 2e-6, 1e-9), aux=(2e-3, 50e-6), kernel=(80e-6, 3e-6), hardware=HW)
WEIGHT_S = 8 * 3 * 128 * 64 * 4 / 10e9  # W / (u BW), all experts on one FFN rank
TOKEN_S = 6 * 128 * 64 * 2 / (0.5 * 50e9)  # 6 H I K / (u_c P)


def attention(n: float, c: float) -> float:
    return 50e-6 + 2e-6 * n + 1e-9 * n * c


def test_colocated_sums_attention_kernel_and_aux():
    p = predict_colocated(FIT, MODEL, batch=16, context=160)
    expected = 2e-3 + 50e-6 * 16 + 2 * attention(16, 160) + 2 * (80e-6 + 3e-6 * 16)
    assert p.step_s == pytest.approx(expected)
    assert p.attention_s + p.aux_s + p.ffn_s == pytest.approx(p.step_s)


def test_afd_k1_is_attention_transport_experts_in_series():
    p = predict_afd(FIT, MODEL, batch=16, ratio=1, ffn_ranks=1, context=160, microbatches=1)
    ffn = 100e-6 + WEIGHT_S + 16 * TOKEN_S
    assert p.ffn_s == pytest.approx(2 * ffn)
    assert p.step_s == pytest.approx(2e-3 + 50e-6 * 16 + 2 * attention(16, 160) + 2 * ffn)
    # two attention ranks per FFN rank double the routed tokens, not the fixed part
    p2 = predict_afd(FIT, MODEL, batch=16, ratio=2, ffn_ranks=1, context=160)
    assert p2.ffn_s - p.ffn_s == pytest.approx(2 * 16 * TOKEN_S)


def test_afd_k2_is_the_papers_max_form_plus_the_pipeline_drain():
    p = predict_afd(FIT, MODEL, batch=16, ratio=1, ffn_ranks=1, context=160, microbatches=2)
    stage_a = attention(8, 160) + (2e-3 + 50e-6 * 8) / 2
    stage_e = 100e-6 + WEIGHT_S + 8 * TOKEN_S
    assert stage_a > stage_e  # attention-bound: the last FFN call drains after all attention
    assert p.step_s == pytest.approx(2 * 2 * stage_a + stage_e)
    slow_ffn = dataclasses.replace(FIT, hardware=dataclasses.replace(HW, dispatch_intercept=5e-3))
    q = predict_afd(slow_ffn, MODEL, 16, 1, 1, 160, microbatches=2)
    ffn = 5e-3 + WEIGHT_S + 8 * TOKEN_S
    assert q.step_s == pytest.approx(4 * ffn + stage_a)  # FFN-bound: the first attention fills


def test_afd_rejects_bad_inputs():
    with pytest.raises(ValueError, match="microbatches"):
        predict_afd(FIT, MODEL, 16, 1, 1, 160, microbatches=3)
    with pytest.raises(ValueError, match="batch"):
        predict_afd(FIT, MODEL, 0, 1, 1, 160)


def test_cpu_fit_roundtrip_through_a_profile_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "x", "cpu": cpu_fit_to_dict(FIT)}))
    assert load_cpu_fit(path) == FIT
    with pytest.raises(ValueError, match="incomplete"):
        cpu_fit_from_dict({"attention": [1, 2, 3]})
    with pytest.raises(ValueError, match="malformed"):  # A(n, c) has three terms
        cpu_fit_from_dict(cpu_fit_to_dict(FIT) | {"attention": [1e-5, 2e-6]})
    path.write_text("{}")
    with pytest.raises(ValueError, match="no 'cpu' section"):
        load_cpu_fit(path)
