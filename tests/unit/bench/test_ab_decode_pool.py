"""`vllm-afd bench --kv-transfer-config`: parsing, the jobs of every configuration, the decode
driver's prompt accounting (vLLM's ``num_cached_tokens``, the prefill phase), the rows and the
printed table (no vLLM engine).

The end-to-end run is tests/e2e/test_bench_e2e.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_afd import config as afd_config
from vllm_afd.bench import ab, decode
from vllm_afd.bench.metrics import BenchConfig, build_rows

POOL = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}


def _settings(argv: list[str]) -> dict:
    return ab.settings_from_args(ab.build_parser().parse_args(["--model", "/m", *argv]))


# -- the flag --------------------------------------------------------------------------------------


def test_kv_transfer_config_is_vllms_json_and_names_the_connector():
    extra = {**POOL, "kv_connector_extra_config": {"fill_mean": 0.02, "fill_std": 0.0}}
    settings = _settings(["--kv-transfer-config", json.dumps(extra)])
    assert settings["kv_transfer_config"] == extra
    assert ab.kv_connector(settings) == "DecodeBenchConnector"
    plain = _settings([])
    assert "kv_transfer_config" not in plain and ab.kv_connector(plain) is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{kv_connector: DecodeBenchConnector}", "not JSON"),
        ('["DecodeBenchConnector"]', "JSON object"),
        ('{"kv_role": "kv_both"}', '"kv_connector"'),
        ('{"kv_connector": 3, "kv_role": "kv_both"}', '"kv_connector"'),
        ('{"kv_connector": " ", "kv_role": "kv_both"}', '"kv_connector"'),
        ('{"kv_connector": "DecodeBenchConnector"}', '"kv_role"'),
        ('{"kv_connector": "DecodeBenchConnector", "kv_role": "both"}', "kv_both"),
    ],
)
def test_a_bad_kv_transfer_config_is_refused(capsys, text, words):
    with pytest.raises(SystemExit) as exc:
        ab.build_parser().parse_args(["--kv-transfer-config", text])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-transfer-config" in err and words in err


def test_the_roles_are_vllms():
    from typing import get_args

    from vllm.config.kv_transfer import KVRole

    assert set(ab.KV_ROLES) == set(get_args(KVRole))


# -- jobs and engine arguments ---------------------------------------------------------------------


def test_every_configuration_gets_the_kv_transfer_config_and_nothing_else_changes():
    argv = ["--ratios", "1:1,2:1", "--ep-sizes", "2"]
    pool, plain = _settings([*argv, "--kv-transfer-config", json.dumps(POOL)]), _settings(argv)
    configs = ab.build_configs(pool)
    assert [c.kind for c in configs] == ["colocated", "wide-ep", "afd", "afd", "afd", "afd"]
    assert [c.name for c in configs] == [c.name for c in ab.build_configs(plain)]
    for config in configs:
        job, base = ab.job_for(config, pool), ab.job_for(config, plain)
        assert job.pop("kv_transfer_config") == POOL, config.name
        assert "kv_transfer_config" not in base and job == base, config.name


def test_engine_kwargs_pass_the_kv_transfer_config_only_when_given():
    job = {"model": "/m", "batch": 4}
    assert "kv_transfer_config" not in decode._engine_kwargs(job)
    kwargs = decode._engine_kwargs({**job, "kv_transfer_config": POOL})
    assert kwargs["kv_transfer_config"] == POOL
    assert kwargs["enable_prefix_caching"] is False  # cached prompt tokens are the connector's


# -- the decode driver's records -------------------------------------------------------------------


class _Out:
    def __init__(self, rid: str, tokens: list[int], cached: int | None) -> None:
        self.request_id, self.num_cached_tokens = rid, cached
        self.outputs = [SimpleNamespace(token_ids=tokens)]


def _driver() -> decode.Driver:
    driver = object.__new__(decode.Driver)  # no engine: the record keeping only
    driver.job, driver.timers = {}, decode.StepTimers()
    return driver


def test_a_step_record_counts_started_requests_and_keeps_cached_tokens():
    driver, cached = _driver(), {}
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    first = driver._record([_Out("a", [1], 255), _Out("b", [2], 255)], tokens, 0.01, cached)
    assert first["started"] == 2 and first["decoding"] == 0 and first["new"] == 2
    second = driver._record([_Out("a", [3], 255), _Out("c", [4], None)], tokens, 0.01, cached)
    assert second["started"] == 3 and second["decoding"] == 1
    assert cached == {"a": 255, "b": 255}  # c's output did not say
    plain = driver._record([_Out("a", [5], 7)], tokens, 0.01)  # without a dict: nothing kept
    assert plain["started"] == 3 and cached == {"a": 255, "b": 255}


# -- prefill accounting, rows and table ------------------------------------------------------------


def _run(prefill_steps: int, cached: int, batch: int = 4, prompt_len: int = 256) -> dict:
    """``prefill_steps`` steps (the last one starts the last request), then steady steps."""
    steps = [
        {"decoding": 0, "dt": 0.010, "new": 1, "started": min(batch - 1, i + 1)}
        for i in range(prefill_steps - 1)
    ]
    steps.append({"decoding": 0, "dt": 0.010, "new": 1, "started": batch})
    steps += [{"decoding": batch, "dt": 0.004, "new": batch, "started": batch}] * 8
    return {
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens": [[1]] * batch,
        "ffn_window": {},
        "prompt_cached_tokens": [cached] * batch,
    }


def test_prefill_summary_counts_what_the_prompts_cost():
    pool = ab.prefill_summary([_run(1, 255), _run(1, 255)])
    assert pool["prompt_tokens"] == 256 and pool["prompt_tokens_cached"] == 255
    assert pool["prompt_tokens_computed"] == pytest.approx(1.0)
    assert pool["prefill_steps"] == 1 and pool["prefill_ms"] == pytest.approx(10.0)
    computed = ab.prefill_summary([_run(3, 0), _run(5, 0)])
    assert computed["prompt_tokens_computed"] == 256 and computed["prompt_tokens_cached"] == 0
    assert computed["prefill_steps"] == 4 and computed["prefill_ms"] == pytest.approx(40.0)


def test_prefill_summary_of_records_without_the_fields_is_empty():
    old = _run(2, 0)
    del old["prompt_cached_tokens"]
    old["steps"] = [{k: v for k, v in s.items() if k != "started"} for s in old["steps"]]
    assert ab.prefill_summary([old]) == {}
    unknown = _run(2, 0)
    unknown["prompt_cached_tokens"] = [None] * 4  # vLLM did not say: no claim either way
    assert "prompt_tokens_computed" not in ab.prefill_summary([unknown])


def test_measure_names_the_connector_the_engines_ran():
    config = BenchConfig("wide EP2", "wide-ep", 2, data_parallel=2, per_rank_batch=4)
    ready = [
        {"first_request": 0, "startup_s": 1.0, "kv_connector": "DecodeBenchConnector"},
        {"first_request": 4, "startup_s": 1.0, "kv_connector": "DecodeBenchConnector"},
    ]
    m = ab.measure(config, ready, [[_run(1, 255), _run(1, 255)]], skip=2)
    assert m.extra["kv_connector"] == "DecodeBenchConnector"
    assert m.extra["prompt_tokens_computed"] == pytest.approx(1.0)
    for info in ready:
        info["kv_connector"] = None
    plain = ab.measure(config, ready, [[_run(3, 0), _run(3, 0)]], skip=2)
    assert "kv_connector" not in plain.extra and plain.extra["prefill_steps"] == 3


def test_an_unsafe_connector_with_microbatches_reads_unsupported():
    """The product's own refusal (``config._check_kv_transfer``), as a child would report it."""
    afd = afd_config.AFDConfig.from_dict({"ratio": "1:1", "microbatches": 2})
    kv = SimpleNamespace(kv_connector="LMCacheConnectorV1", kv_connector_extra_config={})
    with pytest.raises(afd_config.AFDConfigError) as refused:
        afd_config._check_kv_transfer(SimpleNamespace(kv_transfer_config=kv), afd)
    child = RuntimeError(f"Traceback ...\nvllm_afd.config.AFDConfigError: {refused.value}")
    k2 = BenchConfig("afd 1:1 k2", "afd", 1, 1, microbatches=2)
    assert ab.failure(k2, child).status.startswith("unsupported: ")
    k1 = BenchConfig("afd 1:1 k1", "afd", 1, 1, microbatches=1)
    assert ab.failure(k1, child).status.startswith("failed: ")
    safe = SimpleNamespace(kv_connector="DecodeBenchConnector", kv_connector_extra_config={})
    afd_config._check_kv_transfer(SimpleNamespace(kv_transfer_config=safe), afd)  # no raise


def _measured(name: str, kind: str, ffn: int, run: dict, connector: str | None):
    config = BenchConfig(name, kind, 1, ffn, per_rank_batch=4, ratio="1:1" if ffn else None)
    ready = [{"first_request": 0, "startup_s": 1.0, "kv_connector": connector}]
    return ab.measure(config, ready, [[run]], skip=2)


def test_main_prints_the_connector_and_the_prompt_cost_and_writes_them(
    tmp_path, monkeypatch, capsys
):
    connector = "DecodeBenchConnector"
    ms = [
        _measured("colocated", "colocated", 0, _run(1, 255), connector),
        _measured("afd 1:1 k1", "afd", 1, _run(1, 255), connector),
    ]
    monkeypatch.setattr(ab, "run_all", lambda configs, settings, log_dir: ms)
    out = tmp_path / "ab.json"
    argv = ["--model", "/m", "--ratios", "1:1", "--microbatches", "1", "--ep-sizes", "none"]
    argv += ["--kv-transfer-config", json.dumps(POOL), "--json", str(out)]
    with pytest.raises(SystemExit) as exc:
        ab.main([*argv, "--log-dir", str(tmp_path / "logs")])
    assert exc.value.code == 0
    data = json.loads(out.read_text())
    assert data["settings"]["kv_transfer_config"] == POOL
    for row in data["rows"]:
        assert row["kv_connector"] == connector and row["prompt_tokens_computed"] == 1.0, row
        assert row["prefill_steps"] == 1 and row["prefill_ms"] == pytest.approx(10.0)
    text = capsys.readouterr().out
    assert '{"kv_connector":"DecodeBenchConnector","kv_role":"kv_both"}' in text
    lines = [ln for ln in text.splitlines() if ln.startswith(("colocated ", "afd 1:1 k1 "))]
    assert [ln.split()[-6:] for ln in lines] == [[connector, "1.0", "of", "256", "1", "10.00"]] * 2


def test_prefill_table_marks_what_was_not_measured():
    rows = build_rows([_measured("colocated", "colocated", 0, _run(3, 0), None)])
    rows.append({"name": "afd 1:1 k2", "status": "failed: x"})
    text = ab.prefill_table(rows, {"kv_transfer_config": POOL})
    colocated, failed = text.splitlines()[3], text.splitlines()[4]
    assert colocated.split() == ["colocated", "-", "256.0", "of", "256", "3", "30.00"]
    assert failed.split() == ["afd", "1:1", "k2", "-", "-", "-", "-"]
