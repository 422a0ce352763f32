"""`vllm-afd profile`: the fits recover known constants from synthetic timings; the files it
writes are read back by the planner (profile, CPU section, hardware)."""

from __future__ import annotations

import argparse
import contextlib
import time

import pytest

from vllm_afd.bench import calibrate as profiler
from vllm_afd.planner.cpu import load_cpu_fit, predict_colocated
from vllm_afd.planner.hardware import load_hardware
from vllm_afd.planner.models import ModelSpec
from vllm_afd.planner.profile_io import load_profile

BW, P = 10e9, 50e9
FLOPS = 6 * 128 * 64 * 2  # 6 H I K of the tiny model
W_FULL = 8 * 3 * 128 * 64 * 4


def test_least_squares_and_lines_are_exact_on_exact_data():
    assert profiler.fit_line([1, 2, 3], [5, 7, 9]) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="at least 2 points"):
        profiler.fit_line([1], [2])


def test_fit_attention_recovers_a0_a1_a2():
    a = (40e-6, 3e-6, 2e-9)
    points = [(n, c, a[0] + a[1] * n + a[2] * n * c) for n in (1, 4, 16, 32) for c in (64, 256)]
    assert profiler.fit_attention(points) == pytest.approx(a, rel=1e-6)


def _synthetic(tau=100e-6, u=0.5, u_c=0.25, u_c_kernel=0.4, k0=10e-6):
    kernel = [
        (m, w, k0 + w / (u * BW) + m * FLOPS / (u_c_kernel * P))
        for w in (W_FULL, W_FULL / 2, W_FULL / 4)
        for m in (1, 8, 32, 128)
    ]
    remote = [(m, tau + W_FULL / (u * BW) + m * FLOPS / (u_c * P)) for m in (1, 8, 32, 128)]
    return kernel, remote


def test_fit_experts_recovers_tau_u_and_u_c():
    kernel, remote = _synthetic()
    fit = profiler.fit_experts(kernel, remote, W_FULL, FLOPS, BW, P)
    assert fit.tau_s == pytest.approx(100e-6, rel=1e-6)
    assert fit.bandwidth_efficiency == pytest.approx(0.5, rel=1e-6)
    assert fit.gemm_efficiency == pytest.approx(0.25, rel=1e-6)
    assert fit.kernel_gemm_efficiency == pytest.approx(0.4, rel=1e-6)
    assert fit.kernel_intercept_s == pytest.approx(10e-6, rel=1e-6) and fit.notes == ()


def test_fit_experts_clamps_cache_resident_weights_and_notes_it():
    kernel, remote = _synthetic(u=4.0)  # weights read 4x faster than streaming bandwidth
    fit = profiler.fit_experts(kernel, remote, W_FULL, FLOPS, BW, P)
    assert fit.bandwidth_efficiency == 1.0 and any("clamped to 1" in n for n in fit.notes)
    # the intercept keeps the true remote intercept: tau + W / (1 * BW) == f0
    assert fit.tau_s + W_FULL / BW == pytest.approx(fit.remote_intercept_s)


def test_fit_experts_keeps_the_remote_intercept_when_tau_would_be_negative():
    kernel, remote = _synthetic()  # u = 0.5 from the kernel's weight slope, tau = 100 us
    fast = [(m, t - 150e-6) for m, t in remote]  # the remote rank reads its weights faster
    fit = profiler.fit_experts(kernel, fast, W_FULL, FLOPS, BW, P)
    assert fit.tau_s == 0.0 and any("tau 0" in n for n in fit.notes)
    assert 0.5 < fit.bandwidth_efficiency <= 1.0
    # F(m) reproduces the remote samples it was fitted from
    assert fit.tau_s + W_FULL / (fit.bandwidth_efficiency * BW) == pytest.approx(
        fit.remote_intercept_s
    )


def _steps(aux=2e-3, attn=5e-4, moe=3e-4, batch=4, noisy=0):
    steps = [{"decoding": 0, "dt": 0.05, "attn_s": 0.01, "moe_s": 0.01}]
    steps += [{"decoding": batch, "dt": aux + attn + moe, "attn_s": attn, "moe_s": moe}] * 8
    steps[5] = dict(steps[5], dt=steps[5]["dt"] + noisy)
    return steps


def test_step_components_split_the_step_into_attention_moe_and_aux():
    c = profiler.step_components(_steps(noisy=0.5), batch=4, skip=2)
    assert c["step_s"] == pytest.approx(2.8e-3) and c["aux_s"] == pytest.approx(2e-3)
    assert c["attention_s"] == pytest.approx(5e-4) and c["moe_s"] == pytest.approx(3e-4)
    runs = [_steps(), _steps(aux=4e-3), _steps(aux=3e-3)]
    # the median by default: the typical step, what the bench's median step period measures
    assert profiler.pooled_components(runs, 4, 2)["aux_s"] == pytest.approx(3e-3)
    assert profiler.pooled_components(runs, 4, 2, q=0.25)["aux_s"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="no steady"):
        profiler.step_components(_steps()[:1], batch=4, skip=2)
    assert "layer_aux_s" not in c  # no decoder-layer timings in these steps


def test_step_components_split_aux_at_the_decoder_layers():
    steps = [dict(s, layers_s=s["attn_s"] + s["moe_s"] + 1.2e-3) for s in _steps()]
    c = profiler.step_components(steps, batch=4, skip=2)
    assert c["aux_s"] == pytest.approx(2e-3) and c["layer_aux_s"] == pytest.approx(1.2e-3)


def test_sampler_interleaves_and_takes_medians():
    calls = []
    sampler = profiler.Sampler({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    sampler.run_pass(2, warmup_s=0)
    sampler.run_pass(2, warmup_s=0)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2
    assert {k: len(v) for k, v in sampler.samples.items()} == {"a": 4, "b": 4}
    assert set(sampler.quantiles()) == {"a", "b"}
    sampler.run_pass(1, warmup_s=0.005)  # untimed calls for 5 ms, then one timed call each
    assert calls.count("a") > 6 and {k: len(v) for k, v in sampler.samples.items()} == {
        "a": 5,
        "b": 5,
    }


def test_sampler_runs_before_ahead_of_every_timed_call_untimed():
    calls = []
    sampler = profiler.Sampler(
        {"a": lambda: calls.append("a")}, before=lambda: (calls.append("gap"), time.sleep(0.02))
    )
    calls.clear()  # the warm-up call
    sampler.run_pass(2, warmup_s=0)
    assert calls == ["gap", "a", "gap", "a"]
    assert max(sampler.samples["a"]) < 0.02  # the 20 ms before each call is not in its sample


def test_kernel_samples_take_the_moe_layers_in_turn(tiny_qwen3, monkeypatch):
    import torch
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info
    from vllm_afd.ffn import executor as ffn_executor

    calls = []

    class SpyKernel:
        def __init__(self, layers):
            self.layers = sorted(layers)

        def __call__(self, layer, x, ids, weights):
            calls.append((self.layers, layer))

    monkeypatch.setattr(ffn_executor, "ExpertKernel", SpyKernel)
    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    first, second = info.moe_layers[:2]
    sampler = profiler.kernel_sampler(tiny_qwen3, info, [4], [1], torch.float32)
    sampler.run_pass(2, warmup_s=0)  # after the warm-up call: 3 calls
    assert calls == [(list(info.moe_layers), layer) for layer in (first, second, first)]


@pytest.mark.slow
@pytest.mark.full
def test_the_remote_ffn_is_timed_through_announced_steps(tiny_qwen3):
    """The profile's remote FFN service: an FFN executor in a child process behind the real
    transport, timed from the attention side over the MoE layers in turn, each step of them
    announced as a decode announces it (the slot plane refuses a use outside one)."""
    import torch
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    remote = profiler.RemoteFFN(tiny_qwen3, info, [1, 16], torch.float32, threads=1)
    with remote as sampler:
        sampler.run_pass(3, warmup_s=0)
        step = remote.endpoint.step
        medians = sampler.quantiles(0.5)
    assert set(medians) == {1.0, 16.0} and all(0 < t < 1 for t in medians.values())
    # 2 x (3 + 1 warm-up) calls over the model's MoE layers in turn: a step per pass of them
    assert step == -(-8 // len(info.moe_layers))
    assert remote.proc.exitcode is not None  # the FFN child stopped with it


def test_kernel_samples_hold_each_share_of_the_experts(tiny_qwen3):
    """W per FFN-rank share is that share's expert bytes of one layer (1, 2 and 4 ranks)."""
    import torch
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    sampler = profiler.kernel_sampler(tiny_qwen3, info, [1, 4], [1, 2, 4], torch.float32)
    full = info.num_experts * 3 * info.hidden_size * info.moe_intermediate_size * 4
    assert sorted(sampler.calls) == sorted(
        (float(m), float(full // f)) for f in (1, 2, 4) for m in (1, 4)
    )
    sampler.run_pass(1, warmup_s=0)
    assert all(len(v) == 1 for v in sampler.samples.values())


def _points():
    """Engine points generated from known per-layer attention, MoE and D_V fits (2 layers)."""
    out = []
    for c in (64, 256):
        for n in (1, 4, 16, 32):
            mid = c + 12
            attn = 2 * (40e-6 + 3e-6 * n + 2e-9 * n * mid)
            moe = 2 * (80e-6 + 2e-6 * n)
            aux = 1.5e-3 + 40e-6 * n
            layer_aux = 2 * (300e-6 + 5e-6 * n)
            out.append(
                {
                    "batch": n,
                    "context": c,
                    "context_mid": mid,
                    "attention_s": attn,
                    "moe_s": moe,
                    "aux_s": aux,
                    "layer_aux_s": layer_aux,
                    "step_s": attn + moe + aux,
                }
            )
    return out


def test_profile_files_round_trip_through_the_planner(tmp_path):
    fits = profiler.fit_colocated(_points(), num_layers=2, num_moe_layers=2)
    assert fits["attention"] == pytest.approx((40e-6, 3e-6, 2e-9), rel=1e-6)
    assert fits["kernel"] == pytest.approx((80e-6, 2e-6), rel=1e-6)
    assert fits["aux"] == pytest.approx((1.5e-3, 40e-6), rel=1e-6)
    assert fits["layer_aux"] == pytest.approx((300e-6, 5e-6), rel=1e-6)
    kernel, remote = _synthetic()
    fit = profiler.fit_experts(kernel, remote, W_FULL, FLOPS, BW, P)
    hw = profiler.cpu_hardware({"read_bandwidth": BW, "flop_rate": P}, fit, threads=1)
    assert hw.calibrated and hw.dispatch_intercept == pytest.approx(100e-6) and hw.num_sms == 1
    from vllm_afd.planner.cpu import CpuFit, cpu_fit_to_dict

    cpu = CpuFit(fits["attention"], fits["aux"], fits["kernel"], hw)
    profile = profiler.build_profile("tiny", _points(), 16, fits, hw, fit)
    out, hw_out = tmp_path / "p.json", tmp_path / "p.hardware.json"
    profiler.write_outputs(out, hw_out, profile, cpu_fit_to_dict(cpu), hw)
    loaded = load_profile(out)
    assert [p.context for p in loaded.points] == [64, 256]
    point = loaded.point(64)
    assert point.profile_batch == 16 and point.baseline_ep == 1
    assert point.dv_ms == pytest.approx((1.5e-3 + 40e-6 * 16) * 1e3)
    assert loaded.dispatch_intercept_us == pytest.approx(100.0)
    assert load_hardware(hw_out) == hw and load_cpu_fit(out) == cpu
    model = ModelSpec("tiny", 2, 8, 2, 128, 64, 4, 2, 32, expert_bytes_per_param=4)
    measured = next(p for p in _points() if p["batch"] == 16 and p["context"] == 64)
    predicted = predict_colocated(load_cpu_fit(out), model, 16, measured["context_mid"])
    assert predicted.step_s == pytest.approx(measured["step_s"], rel=1e-6)


def test_parser_defaults_and_bad_lists():
    args = profiler.build_parser().parse_args([])
    assert args.batches == [1, 4, 8, 16, 32] and args.threads == 1 and args.passes == 4
    with pytest.raises(argparse.ArgumentTypeError):
        profiler._ints("4,zero")
    assert args.ffn_gap_ms == profiler.DEFAULT_FFN_GAP_MS
    assert profiler.build_parser().parse_args(["--ffn-gap-ms", "0"]).ffn_gap_ms == 0.0
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="milliseconds >= 0"):
            profiler._milliseconds(bad)


class _Group:
    """What ``EngineSweep`` does with its ``ChildGroup`` when it ends."""

    def __init__(self, log_dir) -> None:
        self.log_dir, self.closed = log_dir, False

    def start(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fails", [False, True])
def test_the_profile_leaves_its_engine_logs_only_when_it_failed(tmp_path, fails, capsys):
    """``vllm-afd profile`` leaves nothing in the temporary directory; a failed sweep keeps
    its engine's logs and names them."""
    logs = tmp_path / "vllm_afd_profile_x"
    logs.mkdir()
    (logs / "profile-colocated.rank0.log").write_text("engine output")
    sweep = object.__new__(profiler.EngineSweep)
    sweep.group = _Group(logs)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext(), sweep:
        if fails:
            raise RuntimeError("the engine died")
    assert sweep.group.closed and logs.exists() == fails
    assert (str(logs) in capsys.readouterr().err) == fails
