"""`vllm-afd bench` end to end: a small bench (colocated, DP2 x EP2, AFD 1:1) and the JSON it
writes."""

from __future__ import annotations

import json
import math

import pytest

from vllm_afd.bench import ab

pytestmark = [pytest.mark.slow, pytest.mark.full]


def test_bench_end_to_end_small(tmp_path, tiny_qwen3):
    out = tmp_path / "ab.json"
    argv = [
        "--model",
        tiny_qwen3,
        "--ratios",
        "1:1",
        "--microbatches",
        "1",
        "--ep-sizes",
        "2",
        "--batch",
        "4",
        "--prompt-len",
        "32",
        "--output-len",
        "16",
        "--rounds",
        "2",
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with pytest.raises(SystemExit) as exc:
        ab.main(argv)
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert exc.value.code == 0, rows
    assert set(rows) == {"colocated", "wide EP2", "afd 1:1 k1"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["step_ms"] > 0 and row["step_p90_ms"] >= row["step_ms"]
        assert row["intervals"] >= 2 * (16 - 4) and math.isfinite(row["s_all"])
    afd = rows["afd 1:1 k1"]
    assert afd["devices"] == 2 and afd["disaggregation_cost"] == pytest.approx(0.5)
    assert afd["microbatches_effective"] == pytest.approx(1.0)
    assert afd["ffn_layer_service_ms"] > 0 and rows["wide EP2"]["compared_requests"] == 4


def test_bench_applies_speculation_to_every_configuration(tmp_path, tiny_qwen3):
    """n-gram d = 3 colocated and at AFD 1:1 with the default two microbatches: the same
    greedy tokens, vLLM's acceptance counters per configuration. The random model's text
    seldom repeats, so drafts are few (prompt_lookup_min 1 finds some) and none is accepted."""
    out = tmp_path / "spec.json"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec["prompt_lookup_max"] = 3
    argv = ["--model", tiny_qwen3, "--ratios", "1:1", "--microbatches", "2", "--ep-sizes", "none"]
    argv += ["--batch", "4", "--prompt-len", "64", "--output-len", "16", "--rounds", "1"]
    argv += ["--speculative-config", json.dumps(spec), "--json", str(out)]
    with pytest.raises(SystemExit) as exc:
        ab.main([*argv, "--log-dir", str(tmp_path / "logs")])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert exc.value.code == 0, rows
    assert data["settings"]["speculative_config"] == spec
    assert set(rows) == {"colocated", "afd 1:1 k2"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["spec_decode"]["drafts"] > 0, row  # the counters are read: drafts were made
        assert row["spec_decode"]["draft_tokens"] >= row["spec_decode"]["drafts"]
        assert 1.0 <= row["tokens_per_step"] <= 4.0 and math.isfinite(row["s_all"])
        assert row["acceptance_rate"] is not None and "token_gain" in row
    colocated, afd = rows["colocated"], rows["afd 1:1 k2"]
    assert afd["spec_decode"] == colocated["spec_decode"]  # same tokens, same drafts
    assert afd["microbatches_effective"] == pytest.approx(2.0)  # verify steps are split


def test_bench_runs_a_decode_pool_with_decode_bench_connector(tmp_path, tiny_qwen3):
    """vLLM's DecodeBenchConnector colocated and at AFD 1:1 with the default two microbatches:
    each prompt's KV is filled, not computed (one prompt token per request), in one step, and
    every layout decodes the same tokens from the same constants."""
    out = tmp_path / "pool.json"
    kv = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
    argv = ["--model", tiny_qwen3, "--ratios", "1:1", "--microbatches", "2", "--ep-sizes", "none"]
    argv += ["--batch", "4", "--prompt-len", "256", "--output-len", "16", "--rounds", "1"]
    argv += ["--kv-transfer-config", json.dumps(kv), "--json", str(out)]
    with pytest.raises(SystemExit) as exc:
        ab.main([*argv, "--log-dir", str(tmp_path / "logs")])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert exc.value.code == 0, rows
    assert data["settings"]["kv_transfer_config"] == kv
    assert set(rows) == {"colocated", "afd 1:1 k2"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["kv_connector"] == "DecodeBenchConnector", row
        assert row["prompt_tokens"] == 256 and row["prompt_tokens_computed"] == 1, row
        assert row["prefill_steps"] == 1 and row["intervals"] >= 16 - 4, row
    assert rows["afd 1:1 k2"]["microbatches_effective"] == pytest.approx(2.0)
