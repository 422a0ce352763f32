"""The host time per step on both sides (``bench/ffn_step_bench.py``): it drives the executor's
real ``_serve_step`` over the real endpoint, one shape throughout, folds the steps into the
stats as the executor does, and times an attention rank's announcements to FFN ranks that take
every step."""

from __future__ import annotations

import json

from vllm_afd.bench import ffn_step_bench


def test_the_bench_serves_every_step_of_one_shape_and_writes_json(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert (
        ffn_step_bench.main(
            [
                "--attention-ranks",
                "2",
                "--ffn-ranks",
                "2",
                "--layers",
                "3",
                "--steps",
                "30",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    written = json.loads(out.read_text())
    [row] = written["rows"]
    assert row["attention_ranks"] == 2 and row["moe_layers"] == 3 and row["steps"] == 27
    assert row["graph_keys"] == 1  # every step replayed the one shape
    assert row["median_us"] > 0 and row["p90_us"] >= row["median_us"]
    assert row["stats_fold_us"] is not None
    [announce] = written["announce"]
    assert announce["ffn_ranks"] == 2 and announce["steps"] == 27 and announce["median_us"] > 0
    assert capsys.readouterr().out.count("| 2 | 3 | 2 |") == 2
