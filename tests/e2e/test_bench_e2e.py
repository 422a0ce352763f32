"""`vllm-afd bench` end to end: a small bench (colocated, DP2 x EP2, AFD 1:1) and the JSON it
writes."""

from __future__ import annotations

import json
import math

import pytest

from vllm_afd.bench import ab


@pytest.mark.slow
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
