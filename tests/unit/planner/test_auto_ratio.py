"""``--afd-ratio auto``: the planner's choice of FFN ranks for the attention ranks given."""

import pytest

from vllm_afd.config import MoEModelInfo
from vllm_afd.errors import AFDConfigError
from vllm_afd.planner.auto_ratio import candidate_ffn_ranks, recommend_for_deployment

INFO = MoEModelInfo("Qwen3MoeForCausalLM", 2, 8, 2, 128, 64, (0, 1))


def test_candidates_divide_ranks_and_experts():
    assert candidate_ffn_ranks(INFO, 4) == [1, 2, 4]
    assert candidate_ffn_ranks(INFO, 6) == [1, 2]
    assert candidate_ffn_ranks(INFO, 1) == [1]


def test_auto_picks_a_feasible_split_and_says_why(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    attn, ffn, line = recommend_for_deployment(
        INFO, 4, tiny_qwen3, context=512, max_batch=16, platform_is_cpu=True
    )
    assert attn == 4 and ffn in (1, 2, 4)
    assert "analytical model on h200" in line and "tok/s per device" in line


def test_auto_on_cpu_without_hardware_is_a_clear_error(tiny_qwen3, monkeypatch):
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    monkeypatch.delenv("VLLM_AFD_PLAN_PROFILE", raising=False)
    with pytest.raises(AFDConfigError, match="VLLM_AFD_PLAN_PROFILE"):
        recommend_for_deployment(
            INFO, 2, tiny_qwen3, context=512, max_batch=16, platform_is_cpu=True
        )


def test_auto_counts_the_speculative_draft(qwen3_30b_dir, monkeypatch):
    """With a draft of d tokens every request sends 1 + d tokens per step through the FFN:
    on a Qwen3-30B-A3B-sized model the predicted step is longer than without speculation, and
    the line says d."""
    import re

    info = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    steps = {}
    for d in (0, 3):
        _, _, line = recommend_for_deployment(
            info, 4, qwen3_30b_dir, 4096, max_batch=64, platform_is_cpu=True, draft_length=d
        )
        assert f"d={d}," in line
        steps[d] = float(re.search(r"step ([0-9.]+) ms", line).group(1))
    assert steps[3] > steps[0]


def _cpu_profile(path):
    """A profile file with a ``"cpu"`` section (as `vllm-afd profile` writes one)."""
    import json

    from test_planner_cpu import FIT  # a fitted CPU rank of known terms

    from vllm_afd.planner.cpu import cpu_fit_to_dict

    path.write_text(json.dumps({"cpu": cpu_fit_to_dict(FIT)}))
    return FIT


def test_the_cpu_build_predicts_with_the_profile_s_cpu_step_model(
    tiny_qwen3, tmp_path, monkeypatch
):
    """On the CPU build a profile `vllm-afd profile` wrote is predicted with its CPU step model
    (``planner.cpu.predict_afd``, no hardware file needed), at the batch and context asked
    for, for every count asked for: more FFN ranks than attention ranks too."""
    from vllm_afd.planner import load_hf_config
    from vllm_afd.planner.auto_ratio import predict_ffn_counts
    from vllm_afd.planner.cpu import predict_afd

    fit = _cpu_profile(tmp_path / "p.json")
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", str(tmp_path / "p.json"))
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    model = load_hf_config(tiny_qwen3)
    steps = {}
    for batch, context in ((2.75, 100.0), (4.0, 100.0), (4.0, 900.0)):
        got = predict_ffn_counts(
            INFO, 1, tiny_qwen3, context, batch, True, counts=[1, 2, 3], microbatches=1
        )
        assert got.model.startswith("CPU step model (") and "cpu-1t" in got.model
        assert [c.ratio for c in got.candidates] == ["1:1", "1:2"]
        assert "cannot be split evenly over 3" in got.unpredicted[3]
        expected = predict_afd(fit, model, batch, 1.0, 1, context, 1).step_s
        assert got.candidates[0].step_ms == pytest.approx(1e3 * expected)
        steps[batch, context] = got.candidates[0].step_ms
    # the prediction follows the batch and the context
    assert steps[2.75, 100.0] < steps[4.0, 100.0] < steps[4.0, 900.0]


def test_the_loop_refits_tau_from_the_round_trips_served(tiny_qwen3, tmp_path, monkeypatch):
    """The round trips a deployment served refit A2's tau: a round trip 0.5 ms longer than
    the profile's F(m) raises every count's predicted step by 0.5 ms per MoE layer (tau is per
    round trip), the median of the windows given (one outlier changes nothing), never below 0;
    where the CPU build models a device, served round trips are no measure of it."""
    from vllm_afd.planner import load_hf_config
    from vllm_afd.planner.analytical import ffn_service
    from vllm_afd.planner.auto_ratio import ServedRoundTrip, predict_ffn_counts

    fit = _cpu_profile(tmp_path / "p.json")
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", str(tmp_path / "p.json"))
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    model = load_hf_config(tiny_qwen3)

    def predict(*served):
        got = predict_ffn_counts(
            INFO, 1, tiny_qwen3, 100.0, 4.0, True, counts=[1, 2], microbatches=1, served=served
        )
        return got.model, [c.step_ms for c in got.candidates]

    plain, steps = predict()
    f_m = ffn_service(model, fit.hardware, 4.0, 1)  # 4 tokens on 1 FFN rank
    slow = ServedRoundTrip(1, 4.0, f_m + 0.5e-3)
    said, refitted = predict(slow, ServedRoundTrip(1, 4.0, 1.0), slow)
    tau = fit.hardware.dispatch_intercept + 0.5e-3
    assert said == f"{plain}, tau {tau * 1e6:.0f} us as served over 3 window(s) " + (
        f"(profiled {fit.hardware.dispatch_intercept * 1e6:.0f} us)"
    )
    for before, after in zip(steps, refitted, strict=True):
        assert after - before == pytest.approx(0.5 * model.num_moe_layers)
    _, fast = predict(ServedRoundTrip(2, 2.0, 0.0))  # faster than the weights stream: tau 0
    assert fast[0] < steps[0]
    _, at_zero = predict(ServedRoundTrip(2, 2.0, -1.0))
    assert at_zero == fast
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", "")
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    device = predict_ffn_counts(INFO, 1, tiny_qwen3, 100.0, 4.0, True, counts=[1], served=(slow,))
    assert device.model == "analytical model on h200"


def test_the_loop_rescales_the_cpu_attention_side_to_the_one_served(
    tiny_qwen3, tmp_path, monkeypatch
):
    """The attention side a deployment served rescales the CPU step model's A and D_V: served
    at 1.2 times the model's (at each window's own batch and context), every count's step
    grows by 0.2 times the model's attention side, with one and with two microbatches; the
    median of the windows given (one outlier changes nothing); not where the CPU build models
    a device."""
    from vllm_afd.planner import load_hf_config
    from vllm_afd.planner.auto_ratio import ServedAttention, predict_ffn_counts
    from vllm_afd.planner.cpu import predict_afd

    fit = _cpu_profile(tmp_path / "p.json")
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", str(tmp_path / "p.json"))
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    model = load_hf_config(tiny_qwen3)

    def predict(k, *served):
        got = predict_ffn_counts(
            INFO,
            1,
            tiny_qwen3,
            100.0,
            4.0,
            True,
            counts=[1],
            microbatches=k,
            attention_served=served,
        )
        return got.model, got.candidates[0].step_ms / 1e3

    def as_served(k, batch, context, factor):
        p = predict_afd(fit, model, batch, 1.0, 1, context, k)
        return ServedAttention(batch, context, factor * (p.attention_s + p.aux_s))

    for k in (1, 2):
        plain, step = predict(k)
        windows = (as_served(k, 2.0, 50.0, 1.2), as_served(k, 3.0, 80.0, 9.0))
        said, rescaled = predict(k, *windows, as_served(k, 4.0, 300.0, 1.2))
        assert said == f"{plain}, attention x1.20 as served over 3 window(s)"
        p = predict_afd(fit, model, 4.0, 1.0, 1, 100.0, k)
        if k == 1:  # in series: the attention side's share of the step grows by a fifth
            assert rescaled - step == pytest.approx(0.2 * (p.attention_s + p.aux_s))
        else:
            assert rescaled > step
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", "")
    device = predict_ffn_counts(
        INFO, 1, tiny_qwen3, 100.0, 4.0, True, counts=[1], attention_served=windows
    )
    assert "as served" not in device.model


def test_the_advisor_refits_tau_from_the_windows_before_the_one_it_predicts(
    tiny_qwen3, tmp_path, monkeypatch
):
    """A window's prediction is the planner's with tau as served in the undisturbed windows
    before it (never its own measurement): the first window is predicted from the profile."""
    from vllm_afd.placement.autoscale import Advisor, Deployment, Policy, Window
    from vllm_afd.transport import TransportSpec

    _cpu_profile(tmp_path / "p.json")
    monkeypatch.setenv("VLLM_AFD_PLAN_PROFILE", str(tmp_path / "p.json"))
    monkeypatch.delenv("VLLM_AFD_RUNTIME", raising=False)  # the advisor's thread ends at once
    advisor = Advisor(Deployment(INFO, 1, tiny_qwen3, True, microbatches=1), Policy(False, 60, 0.1))
    spec = TransportSpec("shm", 1, 1, 8, 16, 2, 16, addresses=("a",))
    window = Window(10.0, 20, 9.0, 4.0, 100.0, 2.0, 3.0, 1.2)
    scaled = Window(10.0, 20, 9.0, 4.0, 100.0, 2.0, 9.0, 1.2, "a scale of the FFN pool")
    said = [advisor.advise(spec, w)["model"] for w in (window, scaled, window, window)]
    assert "as served" not in said[0]
    assert "us as served over 1 window(s) (profiled 100 us), attention x" in said[1], said[1]
    assert "over 1 window(s)" in said[2]  # the disturbed window refits nothing
    assert "over 2 window(s)" in said[3]
    advisor.stop()
