"""`vllm-afd bench --speculative-config`: parsing, jobs, the window's tokens per step, vLLM's
acceptance counters in the rows, the table and the planner's draft length (no vLLM engine).

The end-to-end run is tests/e2e/test_bench_e2e.py.
"""

from __future__ import annotations

import json

import pytest

from vllm_afd.bench import ab, decode, report
from vllm_afd.bench.metrics import BenchConfig, Measurement, build_rows, spec_summary

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _settings(argv: list[str]) -> dict:
    return ab.settings_from_args(ab.build_parser().parse_args(["--model", "/m", *argv]))


# -- the flag --------------------------------------------------------------------------------------


def test_speculative_config_is_vllms_json_and_gives_the_draft_length():
    settings = _settings(["--speculative-config", json.dumps(NGRAM)])
    assert settings["speculative_config"] == NGRAM and ab.draft_length(settings) == 3
    plain = _settings([])
    assert "speculative_config" not in plain and ab.draft_length(plain) == 0


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{method: ngram}", "not JSON"),
        ('["ngram"]', "JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "draft length"),
    ],
)
def test_a_bad_speculative_config_is_refused(capsys, text, words):
    with pytest.raises(SystemExit) as exc:
        ab.build_parser().parse_args(["--speculative-config", text])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--speculative-config" in err and words in err


def test_every_configuration_gets_the_speculative_config():
    settings = _settings(["--speculative-config", json.dumps(NGRAM), "--batch", "256"])
    configs = ab.build_configs(settings)
    assert [c.kind for c in configs] == ["colocated", "wide-ep", "afd", "afd", "afd", "afd"]
    for config in configs:
        job = ab.job_for(config, settings)
        assert job["speculative_config"] == NGRAM, config.name
        # a verify step schedules 1 + d tokens per request
        assert job["max_num_batched_tokens"] >= config.engine_batch * 4, config.name
    plain = _settings(["--batch", "256"])
    job = ab.job_for(ab.build_configs(plain)[0], plain)
    assert "speculative_config" not in job and job["max_num_batched_tokens"] == 512


def test_engine_kwargs_log_stats_only_with_speculation():
    job = {"model": "/m", "batch": 4}
    assert decode._engine_kwargs(job)["disable_log_stats"] is True
    assert "speculative_config" not in decode._engine_kwargs(job)
    spec = decode._engine_kwargs({**job, "speculative_config": NGRAM})
    assert spec["speculative_config"] == NGRAM and spec["disable_log_stats"] is False
    assert decode.draft_length({**job, "speculative_config": NGRAM}) == 3
    assert decode.draft_length(job) == 0


# -- the decode driver's step records --------------------------------------------------------------


class _Out:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.outputs = [type("C", (), {"token_ids": tokens})()]


def _driver(job: dict) -> decode.Driver:
    driver = object.__new__(decode.Driver)  # no engine: the record keeping only
    driver.job, driver.timers = job, decode.StepTimers()
    return driver


def test_a_verify_step_decodes_every_request_that_emits_tokens():
    driver = _driver({"speculative_config": NGRAM})
    tokens = {"a": [1], "b": [2], "c": []}
    outputs = [_Out("a", [5, 6, 7, 8]), _Out("b", [9]), _Out("c", [3])]
    record = driver._record(outputs, tokens, 0.01)
    assert record["decoding"] == 2 and record["new"] == 6  # c emitted its first token
    assert tokens["a"] == [1, 5, 6, 7, 8]


def test_the_ffn_window_ends_before_a_request_could_complete(monkeypatch):
    monkeypatch.setattr(decode, "_ffn_stats", lambda: [{"step": "snapshot"}])
    driver = _driver({"speculative_config": NGRAM, "skip": 1})
    ffn: dict = {}
    record = {"decoding": 2}
    driver._maybe_snapshot(record, {"a": [0] * 5, "b": [0] * 3}, 16, 4, ffn)
    assert ffn["first_step"] == 4 and "after" not in ffn
    # 12 of 16 tokens: one more verify step (up to 1 + 3 tokens) could complete it
    driver._maybe_snapshot(record, {"a": [0] * 12, "b": [0] * 9}, 16, 7, ffn)
    assert ffn["last_step"] == 7 and ffn["after"] == [{"step": "snapshot"}]
    plain, ffn = _driver({"skip": 1}), {}
    plain._maybe_snapshot(record, {"a": [0] * 12, "b": [0] * 9}, 16, 7, ffn)
    assert "after" not in ffn  # without speculation: at output_len - 1 tokens, as before


# -- measurement and rows --------------------------------------------------------------------------


def _run(new_per_request: list[float], batch: int = 4, counts: dict | None = None) -> dict:
    """Prefill, then steady steps emitting ``new_per_request`` tokens per request each."""
    steps = [{"decoding": 0, "dt": 0.05, "new": batch}]
    steps += [{"decoding": batch, "dt": 0.004, "new": int(n * batch)} for n in new_per_request]
    run = {"steps": steps, "tokens": [[1]] * batch, "ffn_window": {}}
    if counts is not None:
        run["spec_decode"] = counts
    return run


def test_measure_counts_the_tokens_each_step_emits_and_sums_the_counters():
    config = BenchConfig("wide EP2", "wide-ep", 2, data_parallel=2, per_rank_batch=4)
    ready = [{"first_request": 0, "startup_s": 1.0}, {"first_request": 4, "startup_s": 1.0}]
    counts = {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 12.0}
    # minus the first 2 steady steps and the last: rank 0's window emits 2, 2, 3 tokens per
    # request and step, rank 1's 1, 1, 1; two rounds of both
    rank0 = _run([1, 1, 2, 2, 3, 4], counts=counts)
    rank1 = _run([1, 1, 1, 1, 1, 4], counts=counts)
    m = ab.measure(config, ready, [[rank0, rank1], [rank0, rank1]], skip=2)
    assert m.extra["tokens_per_step"] == pytest.approx(2 * (2 + 2 + 3 + 3) / (4 * 3))
    assert m.extra["spec_decode"] == {"drafts": 40, "draft_tokens": 120, "accepted_tokens": 48}
    assert m.extra["acceptance_rate"] == pytest.approx(0.4)
    assert m.extra["mean_acceptance_length"] == pytest.approx(1 + 48 / 40)
    plain = ab.measure(config, ready, [[_run([1] * 6), _run([1] * 6)]], skip=2)
    assert "tokens_per_step" not in plain.extra and "spec_decode" not in plain.extra


def test_spec_summary_where_nothing_was_drafted():
    nothing = spec_summary({"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0})
    assert nothing == {"acceptance_rate": None, "mean_acceptance_length": None}


def _m(name, kind, step_ms, tau, attn=1, ffn=0, dp=1, accepted=0.5) -> Measurement:
    config = BenchConfig(
        name,
        kind,
        attention_ranks=attn,
        ffn_ranks=ffn,
        data_parallel=dp,
        expert_parallel=dp > 1,
        per_rank_batch=16,
        ratio=f"{attn}:{ffn}" if ffn else None,
    )
    counts = {"drafts": 100.0, "draft_tokens": 300.0, "accepted_tokens": 300.0 * accepted}
    period = {"median_ms": step_ms, "p90_ms": step_ms, "mean_ms": step_ms, "intervals": 50}
    extra = {"tokens_per_step": tau, "spec_decode": counts, **spec_summary(counts)}
    return Measurement(config, period=period, extra=extra)


def _spec_rows() -> list[dict]:
    return build_rows(
        [
            _m("colocated", "colocated", 8.0, tau=2.0),
            _m("wide EP2", "wide-ep", 16.0, tau=2.2, attn=2, dp=2),
            _m("afd 1:1 k1", "afd", 6.0, tau=2.5, ffn=1),
        ]
    )


def test_rows_count_accepted_tokens_and_split_s_all_with_the_token_gain():
    base, wide, afd = _spec_rows()
    assert base["baseline"] and base["tok_s"] == pytest.approx(16 * 2.0 / 0.008)
    assert afd["tok_s_per_device"] == pytest.approx(16 * 2.5 / 0.006 / 2)
    assert afd["token_gain"] == pytest.approx(1.25)
    product = afd["batch_gain"] * afd["token_gain"] * afd["overlap_gain"] * 0.5
    assert afd["s_all"] == pytest.approx(product) == pytest.approx(afd["eq2_s_all"])
    assert afd["s_att"] == pytest.approx(2 * afd["s_all"])
    assert wide["s_all"] == pytest.approx(1.1 * 0.5)  # token gain 1.1, half the step rate
    assert afd["acceptance_rate"] == pytest.approx(0.5)
    assert afd["mean_acceptance_length"] == pytest.approx(2.5)
    plain = [_m("colocated", "colocated", 8.0, 1.0), _m("afd", "afd", 6.0, 1.0, ffn=1)]
    for m in plain:
        m.extra.clear()  # no speculation: the rows keep their keys and values
    rows = build_rows(plain)
    assert not _SPEC_KEYS & (set(rows[0]) | set(rows[1]))
    assert rows[1]["tok_s"] == pytest.approx(16 / 0.006)
    assert rows[1]["eq2_s_all"] == pytest.approx(rows[1]["s_all"])


def test_table_shows_acceptance_only_with_speculation():
    rows = _spec_rows()
    text = report.format_plain(rows)
    head, afd = text.splitlines()[0], text.splitlines()[4]
    assert "tok/step" in head and "acc %" in head and "acc len" in head
    assert "batch x tok x overlap x r/(r+1)" in head
    assert "2.50" in afd and "50.0" in afd and "1.00 x 1.250 x 1.333 x 0.500" in afd
    plain = [{k: v for k, v in r.items() if k not in _SPEC_KEYS} for r in rows]
    plain_head = report.format_plain(plain).splitlines()[0]
    assert "tok/step" not in plain_head and "acc %" not in plain_head
    assert "batch x overlap x r/(r+1)" in plain_head
    settings = {"model": "/m", "prompt_len": 8, "output_len": 8, "threads": 1, "rounds": 1}
    assert "speculative" not in report.header({**settings, "dtype": "float32"})
    spec_header = report.header({**settings, "dtype": "float32", "speculative_config": NGRAM})
    assert '"num_speculative_tokens":3' in spec_header


_SPEC_KEYS = {
    "tokens_per_step",
    "spec_decode",
    "acceptance_rate",
    "mean_acceptance_length",
    "token_gain",
}


# -- the planner's draft length --------------------------------------------------------------------


def _profile(tmp_path) -> str:
    from vllm_afd.planner.cpu import CpuFit, cpu_fit_to_dict
    from vllm_afd.planner.hardware import Hardware

    hw = Hardware("cpu-1t", 10e9, 8e9, 1, 10e9, 50e9, 50e9, 1.0, 0.5, 100e-6, 2, 2)
    fit = CpuFit((50e-6, 2e-6, 1e-9), (2e-3, 50e-6), (80e-6, 3e-6), hw)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "x", "cpu": cpu_fit_to_dict(fit)}))
    return str(path)


def test_predictions_verify_one_plus_d_positions_per_request(tmp_path):
    from vllm_afd.planner.cpu import load_cpu_fit, predict_afd, predict_colocated
    from vllm_afd.planner.models import get_model

    profile = _profile(tmp_path)
    settings = {"model": "qwen3-235b-a22b", "prompt_len": 128, "output_len": 64, "threads": 1}
    plain, spec = _spec_rows()[::2], _spec_rows()[::2]
    ab.add_predictions(plain, settings, profile, cpus=2)
    ab.add_predictions(spec, {**settings, "speculative_config": NGRAM}, profile, cpus=2)
    fit, model = load_cpu_fit(profile), get_model("qwen3-235b-a22b")
    assert spec[0]["predicted_ms"] == pytest.approx(
        1e3 * predict_colocated(fit, model, 16 * 4, 160).step_s
    )
    assert spec[1]["predicted_ms"] == pytest.approx(
        1e3 * predict_afd(fit, model, 16, 1.0, 1, 160, 1, draft_length=3).step_s
    )
    assert spec[1]["predicted_ms"] > plain[1]["predicted_ms"]
    for k in (1, 2):  # d positions per request: the same as 1 + d times the requests
        assert predict_afd(fit, model, 8, 1.0, 1, 160, k, draft_length=3) == predict_afd(
            fit, model, 32, 1.0, 1, 160, k
        )
    with pytest.raises(ValueError, match="draft_length"):
        predict_afd(fit, model, 8, 1.0, 1, 160, 1, draft_length=-1)


def test_main_writes_the_acceptance_to_the_json(tmp_path, monkeypatch):
    measurements = [
        _m("colocated", "colocated", 8.0, 2.0),
        _m("afd 1:1 k1", "afd", 6.0, 2.0, ffn=1),
    ]
    for m in measurements:
        m.identical, m.extra["tokens_by_request"] = True, {0: [1]}
    seen = {}

    def run_all(configs, settings, log_dir):
        seen["jobs"] = [ab.job_for(c, settings) for c in configs]
        return measurements

    monkeypatch.setattr(ab, "run_all", run_all)
    out = tmp_path / "ab.json"
    argv = ["--model", "/m", "--ratios", "1:1", "--microbatches", "1", "--ep-sizes", "none"]
    argv += ["--speculative-config", json.dumps(NGRAM), "--json", str(out)]
    with pytest.raises(SystemExit) as exc:
        ab.main([*argv, "--log-dir", str(tmp_path / "logs")])
    assert exc.value.code == 0
    assert all(job["speculative_config"] == NGRAM for job in seen["jobs"])
    data = json.loads(out.read_text())
    assert data["settings"]["speculative_config"] == NGRAM
    afd = data["rows"][1]
    assert afd["acceptance_rate"] == pytest.approx(0.5) and afd["tokens_per_step"] == 2.0
    assert afd["spec_decode"]["drafts"] == 100.0 and afd["token_gain"] == pytest.approx(1.0)
