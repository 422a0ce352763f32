"""`vllm-afd bench`: window selection, the paper's arithmetic, output (pure functions).

The end-to-end run is tests/e2e/test_bench_e2e.py; the CPU shims it relies on are tested in
tests/unit/patches/test_cpu_comm.py.
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_afd.bench import ab, report
from vllm_afd.bench.metrics import (
    BenchConfig,
    Measurement,
    best_colocated,
    build_rows,
    prediction_error,
    speedups,
    throughput,
)
from vllm_afd.bench.window import (
    percentile,
    period_stats,
    steady_window,
    window_intervals,
)

# -- steady-state window --------------------------------------------------------------------------


def _decoding_trace(batch: int = 4) -> list[int]:
    """Chunked prefill (0, 2, 3 decoding), 8 steady steps, then completions (3, 1)."""
    return [0, 2, 3] + [batch] * 8 + [3, 1]


def test_window_skips_prefill_transition_and_first_completion():
    idx = steady_window(_decoding_trace(), batch=4, skip=2)
    # steady steps are 3..10; drop the first two (3, 4) and the last (10: first completion)
    assert idx == [5, 6, 7, 8, 9]


def test_window_cap_and_invalid_skip():
    assert steady_window(_decoding_trace(), batch=4, skip=1, max_steps=3) == [4, 5, 6]
    assert steady_window([0, 1, 2], batch=4, skip=1) == []
    with pytest.raises(ValueError, match="skip"):
        steady_window(_decoding_trace(), batch=4, skip=0)


def test_window_intervals_take_the_window_steps_dt():
    steps = [{"decoding": d, "dt": 0.001 * (i + 1)} for i, d in enumerate(_decoding_trace())]
    assert window_intervals(steps, batch=4, skip=2) == pytest.approx(
        [0.006, 0.007, 0.008, 0.009, 0.010]
    )


def test_period_stats_median_p90_mean():
    stats = period_stats([0.001, 0.002, 0.003, 0.004, 0.100])
    assert stats.median_s == pytest.approx(0.003)
    assert stats.mean_s == pytest.approx(0.022)
    assert stats.p90_s == pytest.approx(percentile([1, 2, 3, 4, 100], 90) / 1000)
    assert percentile([1, 2, 3, 4, 100], 90) == pytest.approx(61.6)
    assert stats.to_dict()["intervals"] == 5
    with pytest.raises(ValueError, match="no steady"):
        period_stats([])


# -- S_all, S_att and Eq. 2 ------------------------------------------------------------------------


def _m(name, kind, step_ms, attn=1, ffn=0, b=16, dp=1, tp=1, k=1) -> Measurement:
    config = BenchConfig(
        name,
        kind,
        attention_ranks=attn,
        ffn_ranks=ffn,
        data_parallel=dp,
        tensor_parallel=tp,
        per_rank_batch=b,
        microbatches=k,
        expert_parallel=dp > 1,
        ratio=f"{attn}:{ffn}" if ffn else None,
    )
    return Measurement(
        config,
        period={
            "median_ms": step_ms,
            "p90_ms": step_ms * 1.1,
            "mean_ms": step_ms,
            "intervals": 100,
        },
    )


def test_throughput_counts_all_and_attention_devices():
    afd = _m("afd 2:1", "afd", 5.0, attn=2, ffn=1, tp=2)
    x = throughput(afd.config, 0.005)
    assert x["tok_s"] == pytest.approx(32 / 0.005)
    assert x["tok_s_per_device"] == pytest.approx(32 / 0.005 / 3)
    assert x["tok_s_per_attention_device"] == pytest.approx(16 / 0.005)
    assert afd.config.engine_batch == 32 and afd.config.layout() == "TP2 + 1 FFN"


def test_speedups_follow_eq2_and_the_baseline_is_the_best_colocated():
    base = _m("colocated", "colocated", 4.0)
    wide = _m("wide EP2", "wide-ep", 10.0, attn=2, dp=2)
    afd = _m("afd 1:1", "afd", 3.0, attn=1, ffn=1, b=20)
    assert best_colocated([wide, base, afd]) is base
    s = speedups(afd, base)
    assert s["batch_gain"] == pytest.approx(20 / 16)
    assert s["overlap_gain"] == pytest.approx(4 / 3)
    assert s["disaggregation_cost"] == pytest.approx(0.5)
    expected = (20 / 0.003 / 2) / (16 / 0.004)
    assert s["s_all"] == pytest.approx(expected)
    assert s["s_all"] == pytest.approx(s["batch_gain"] * s["overlap_gain"] * 0.5)
    assert s["s_att"] == pytest.approx(2 * s["s_all"])
    assert s["eq2_s_all"] == pytest.approx(s["s_all"])
    wide_s = speedups(wide, base)
    assert wide_s["s_all"] == pytest.approx(0.4) and wide_s["disaggregation_cost"] is None


def test_build_rows_marks_baseline_and_skips_failed_rows():
    rows = build_rows(
        [
            _m("colocated", "colocated", 4.0),
            Measurement(
                BenchConfig("afd 1:1 k2", "afd", 1, 1, microbatches=2),
                status="unsupported: microbatches=2 not in effect",
            ),
        ]
    )
    assert rows[0]["baseline"] is True and rows[0]["s_all"] == pytest.approx(1.0)
    assert rows[1]["baseline"] is False and "step_ms" not in rows[1] and "s_all" not in rows[1]
    assert prediction_error(4.4, 4.0) == pytest.approx(10.0)


# -- configurations, microbatch detection, failures ------------------------------------------------


def _settings(**overrides) -> dict:
    settings = dict(ab.DEFAULTS, model="/m", afd_batch=16) | overrides
    return settings


def test_build_configs_and_jobs():
    configs = ab.build_configs(_settings())
    assert [c.name for c in configs] == [
        "colocated",
        "wide EP2",
        "afd 1:1 k1",
        "afd 1:1 k2",
        "afd 2:1 k1",
        "afd 2:1 k2",
    ]
    assert [c.devices for c in configs] == [1, 2, 2, 2, 3, 3]
    wide, afd21 = ab.job_for(configs[1], _settings()), ab.job_for(configs[5], _settings())
    assert wide["dp"] == {"size": 2} and wide["enable_expert_parallel"] and wide["batch"] == 16
    assert afd21["afd"] == {"ratio": "2:1", "microbatches": 2}
    assert afd21["tensor_parallel_size"] == 2 and afd21["batch"] == 32
    assert not afd21["instrument"] and ab.job_for(configs[0], _settings())["instrument"]
    with_ray = ab.job_for(configs[2], _settings(ray_address="127.0.0.1:1"))
    assert with_ray["afd"]["ray_address"] == "127.0.0.1:1"


def test_core_plan_gives_every_rank_its_own_cpus():
    from vllm_afd.bench.launch import core_plan

    assert core_plan(1, 1, 1, cpus=[4, 5]) == ([[4]], [[5]])
    assert core_plan(2, 1, 2, cpus=list(range(8))) == ([[0, 1], [2, 3]], [[4, 5]])
    assert core_plan(2, 1, 1, cpus=[0, 1]) is None  # 3 ranks on 2 CPUs: left to the scheduler
    assert core_plan(1, 0, 1, cpus=[3]) == ([[3]], [])


def test_job_env_binds_what_the_plan_says():
    from vllm_afd.bench.launch import job_env

    tp1 = job_env({"cpus": [[0]], "ffn_cpus": [[1]]}, threads=1)
    assert tp1["VLLM_AFD_BENCH_CPUS"] == "0" and tp1["VLLM_AFD_FFN_CPUS"] == "1"
    dp = job_env({"cpus": [[0], [1]], "dp": {"size": 2, "port": 1}}, threads=1, dp_rank=1)
    assert dp["VLLM_AFD_BENCH_CPUS"] == "1" and "VLLM_AFD_FFN_CPUS" not in dp
    tp2 = job_env({"tensor_parallel_size": 2, "cpus": [[0, 1], [2, 3]], "ffn_cpus": [[4]]}, 2)
    assert tp2["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and tp2["VLLM_AFD_FFN_CPUS"] == "4"
    assert "VLLM_AFD_BENCH_CPUS" not in tp2  # vLLM binds its TP workers itself


def test_pair_schedule_alternates_each_config_with_the_baseline():
    actions = ab.pair_schedule(3, 2)
    assert actions == [
        ("start", 0),
        ("start", 1),
        ("decode", 0, 0),
        ("decode", 1, 0),
        ("decode", 1, 1),
        ("decode", 0, 1),
        ("stop", 1),
        ("start", 2),
        ("decode", 0, 0),
        ("decode", 2, 0),
        ("decode", 2, 1),
        ("decode", 0, 1),
        ("stop", 2),
        ("stop", 0),
    ]
    alone = ab.pair_schedule(1, 2)
    assert alone == [("start", 0), ("decode", 0, 0), ("decode", 0, 1), ("stop", 0)]


def _run(k_requests: float, steps: int = 10, layers: int = 2) -> dict:
    before = [
        {
            "requests": 0,
            "tokens": 0,
            "busy_s": 0.0,
            "per_layer_s": {"0": 0.0, "1": 0.0},
            "per_layer_calls": {"0": 0, "1": 0},
        }
    ]
    calls = int(steps * k_requests)
    after = [
        {
            "requests": calls * layers,
            "tokens": 0,
            "busy_s": 0.002 * steps,
            "per_layer_s": {"0": 0.001 * steps, "1": 0.001 * steps},
            "per_layer_calls": {"0": calls, "1": calls},
        }
    ]
    decoding = [0] + [4] * (steps + 4)
    return {
        "steps": [{"decoding": d, "dt": 0.004, "attn_s": 0.0005, "moe_s": 0.001} for d in decoding],
        "tokens": [[1, 2], [3, 4], [5, 6], [7, 8]],
        "ffn_window": {"before": before, "after": after, "first_step": 2, "last_step": 2 + steps},
    }


def test_measure_flags_microbatches_not_in_effect():
    config = BenchConfig("afd 1:1 k2", "afd", 1, 1, per_rank_batch=4, microbatches=2)
    ready = [{"first_request": 0, "startup_s": 1.0}]
    m = ab.measure(config, ready, [[_run(1.0)]], skip=2)
    assert m.status.startswith("unsupported: microbatches=2 not in effect")
    assert m.extra["microbatches_effective"] == pytest.approx(1.0)
    assert m.extra["ffn_busy_ms_per_step"] == pytest.approx(2.0)
    assert m.extra["aux_ms"] == pytest.approx(2.5)
    ok = ab.measure(config, ready, [[_run(2.0)]], skip=2)
    assert ok.status == "ok" and ok.step_s == pytest.approx(0.004)


def test_failure_reports_unsupported_microbatches_or_failed():
    k2 = BenchConfig("afd 1:1 k2", "afd", 1, 1, microbatches=2)
    refused = ab.failure(k2, RuntimeError("...\nAFDConfigError: --afd-microbatches: must be 1"))
    assert refused.status.startswith("unsupported:") and not refused.ok
    crashed = ab.failure(k2, RuntimeError("Traceback\nRuntimeError: worker died"))
    assert crashed.status == "failed: RuntimeError: worker died"


def test_compare_tokens_request_by_request():
    base, afd = _m("colocated", "colocated", 4.0), _m("afd", "afd", 3.0, ffn=1)
    base.extra["tokens_by_request"] = {0: [1, 2], 1: [3, 4]}
    afd.extra["tokens_by_request"] = {0: [1, 2], 1: [3, 5], 7: [9]}
    ab.compare_tokens([base, afd])
    assert afd.identical is False and afd.compared_requests == 2
    afd.extra["tokens_by_request"][1] = [3, 4]
    ab.compare_tokens([base, afd])
    assert afd.identical is True and base.identical is True


def test_cli_rejects_bad_ratio(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.build_parser().parse_args(["--ratios", "2-1"])
    assert exc.value.code == 2 and "--ratios" in capsys.readouterr().err
    assert ab.build_parser().parse_args(["--ep-sizes", "none"]).ep_sizes == []


# -- table and JSON --------------------------------------------------------------------------------


def _rows() -> list[dict]:
    afd = _m("afd 1:1 k1", "afd", 3.0, ffn=1)
    afd.identical = False
    rows = build_rows([_m("colocated", "colocated", 4.0), afd])
    rows[1] |= {"predicted_ms": 3.3, "error_pct": 10.0}
    return rows


def test_errors_scaled_to_the_baseline_remove_machine_drift():
    rows = build_rows(
        [
            _m("colocated", "colocated", 4.0),
            _m("afd 1:1 k1", "afd", 5.0, ffn=1),
            _m("wide EP2", "wide-ep", 9.0, dp=2),
        ]
    )
    assert rows[0]["baseline"] and not rows[1]["baseline"]
    rows[0] |= {"predicted_ms": 3.2, "error_pct": -20.0}  # the machine is 25% slower today
    rows[1] |= {"predicted_ms": 4.0, "error_pct": -20.0}  # wide EP (rows[2]) has no prediction
    ab.add_baseline_scaled_errors(rows)
    assert rows[0]["error_scaled_pct"] == pytest.approx(0.0)
    assert rows[1]["predicted_scaled_ms"] == pytest.approx(5.0)
    assert rows[1]["error_scaled_pct"] == pytest.approx(0.0)
    assert "error_scaled_pct" not in rows[2]
    unscaled = [{"status": "ok", "step_ms": 5.0, "predicted_ms": 4.0}]
    ab.add_baseline_scaled_errors(unscaled)  # no baseline prediction: nothing to scale by
    assert "error_scaled_pct" not in unscaled[0]


def test_predictions_skip_the_error_where_ranks_share_cores(tmp_path):
    from vllm_afd.planner.cpu import CpuFit, cpu_fit_to_dict
    from vllm_afd.planner.hardware import Hardware

    hw = Hardware("cpu-1t", 10e9, 8e9, 1, 10e9, 50e9, 50e9, 1.0, 0.5, 100e-6, 2, 2)
    fit = CpuFit((50e-6, 2e-6, 1e-9), (2e-3, 50e-6), (80e-6, 3e-6), hw)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"format": "x", "cpu": cpu_fit_to_dict(fit)}))
    rows = build_rows(
        [
            _m("colocated", "colocated", 4.0),
            _m("afd 1:1 k1", "afd", 5.0, ffn=1),
            _m("afd 2:1 k1", "afd", 9.0, attn=2, ffn=1, tp=2),
        ]
    )
    settings = {"model": "qwen3-235b-a22b", "prompt_len": 128, "output_len": 64, "threads": 1}
    ab.add_predictions(rows, settings, str(profile), cpus=2)
    assert all(r["predicted_ms"] > 0 for r in rows)
    assert "error_pct" in rows[1] and "error_scaled_pct" in rows[1]
    over = rows[2]
    assert "error_pct" not in over and "error_scaled_pct" not in over
    assert "3 ranks x 1 thread(s) on 2 CPUs" in over["prediction_note"]
    assert "afd 2:1 k1: 3 ranks" in report.format_plain(rows)  # printed under the table


def test_plain_table_columns_and_markers():
    text = report.format_plain(_rows())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["config", "layout", "dev"] and "pred ms" in lines[0]
    assert "baseline" in lines[2] and "NO" in lines[3] and "+10.0" in lines[3]
    assert "0.667" in lines[3]  # S_all of 1:1 at 4/3 overlap gain
    no_pred = report.format_plain(build_rows([_m("colocated", "colocated", 4.0)]))
    assert "pred ms" not in no_pred


def test_main_writes_json_table_and_plot(tmp_path, monkeypatch, capsys):
    measurements = [_m("colocated", "colocated", 4.0), _m("afd 1:1 k1", "afd", 3.0, ffn=1)]
    for m in measurements:
        m.identical, m.extra["tokens_by_request"] = True, {0: [1]}
    monkeypatch.setattr(ab, "run_all", lambda configs, settings, log_dir: measurements)
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    with pytest.raises(SystemExit) as exc:
        ab.main(
            [
                "--model",
                "/m",
                "--json",
                str(out),
                "--plot",
                str(png),
                "--log-dir",
                str(tmp_path / "logs"),
            ]
        )
    assert exc.value.code == 0
    data = json.loads(out.read_text())
    assert data["settings"]["ratios"] == ["1:1", "2:1"]
    afd = data["rows"][1]
    assert afd["s_all"] == pytest.approx(2 / 3) and "tokens_by_request" not in afd
    assert png.stat().st_size > 1000
    assert "afd 1:1 k1" in capsys.readouterr().out


@pytest.mark.parametrize(("given", "used"), [(None, "1"), ("3", "3")])
def test_offline_run_by_hand_caps_the_kv_cache_unless_told(monkeypatch, capsys, given, used):
    """``python -m vllm_afd.bench.offline_run JOB`` run by hand gets the small KV cache its
    parent would give it (vLLM's CPU build otherwise sizes it from the host's memory)."""
    from vllm_afd.bench import offline_run

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    if given is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = given
    monkeypatch.setattr(os, "environ", env)  # what main sets stays out of this process
    monkeypatch.setattr(offline_run, "_generate", lambda job: {"kv": os.environ[job["key"]]})
    monkeypatch.setattr("sys.argv", ["offline_run", json.dumps({"key": "VLLM_CPU_KVCACHE_SPACE"})])
    offline_run.main()
    line = capsys.readouterr().out.strip()
    assert json.loads(line.removeprefix(offline_run.RESULT_PREFIX)) == {"kv": used}
