"""`vllm-afd plan` end to end through main(argv)."""

from __future__ import annotations

import argparse
import csv
import io
import json

import pytest

from vllm_afd.planner.cli import add_plan_parser, main

CANDIDATES = """model,context,d,ratio,batch,dv_ms,kappa,t_draft_ms
MiniMax-M2.5,4K,0,1,156,3.831,,
MiniMax-M2.5,8K,0,15,76,3.640,,
Qwen3,4K,0,7,198,5.789,,
Qwen3.5,8K,0,3,373,7.223,,
minimax-m2.5,4K,3,4,126,5.0788,1.032,2.5
"""
EXPECTED_MS = [34.047, 30.794, 47.649, 51.127]


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_table_lists_every_ratio_and_the_recommendation(capsys):
    out = run(
        capsys,
        "plan",
        "--model",
        "qwen3-235b-a22b",
        "--hardware",
        "gb200",
        "--context",
        "8K",
        "--ratios",
        "1,3,5,7,9",
    )
    assert out.count(":1 ") >= 5
    for ratio in ("1:1", "3:1", "5:1", "7:1", "9:1"):
        assert ratio in out
    assert "recommended: 7:1 (28 attention + 4 FFN GPUs)" in out
    assert "coverage boundary" in out and "near-free parallelism" in out
    assert "S_all" in out and "covered" in out


def test_json_is_parseable_and_complete(capsys):
    out = run(capsys, "--model", "minimax-m2.5", "--context", "16K", "--json")  # no "plan"
    data = json.loads(out)
    assert data["model"] == "minimax-m2.5" and data["hardware"] == {
        "name": "gb200",
        "calibrated": True,
    }
    assert len(data["ratios"]) == 17
    best = max(data["ratios"], key=lambda r: r["tokens_per_gpu"])
    assert data["recommended"]["ratio"] == best["ratio"]
    for row in data["ratios"]:
        expected = row["batch_gain"] * row["overlap_gain"] * row["disaggregation_cost"]
        assert row["s_all"] == pytest.approx(expected)
    assert data["near_free"]["recommended_draft_length"] >= 0
    assert data["profile"]["dv_ms"] == 3.507


def test_batch_and_profile_flags(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "format": "vllm-afd-colocated-profile",
                "version": 1,
                "model": "qwen3-235b-a22b",
                "hardware": "gb200",
                "points": [{"context": 4096, "dv_ms": 5.789}],
            }
        )
    )
    out = run(
        capsys,
        "--model",
        "Qwen3",
        "--context",
        "4K",
        "--ratios",
        "7",
        "--batch",
        "198",
        "--profile",
        str(profile),
        "--json",
    )
    (row,) = json.loads(out)["ratios"]
    assert row["batch"] == 198 and row["step_ms"] == pytest.approx(47.649, abs=0.01)


def test_predict_round_trips_the_candidates(capsys, tmp_path):
    path = tmp_path / "candidates.csv"
    path.write_text(CANDIDATES)
    out = run(capsys, "plan", "predict", "--candidates", str(path))
    rows = list(csv.DictReader(io.StringIO(out)))
    inputs = list(csv.DictReader(io.StringIO(CANDIDATES)))
    assert len(rows) == len(inputs)
    for got, given in zip(rows, inputs, strict=True):
        assert {k: got[k] for k in given} == given  # the input columns come back unchanged
    for got, expected in zip(rows, EXPECTED_MS, strict=False):
        assert float(got["predicted_ms"]) == pytest.approx(expected, abs=0.01)
    spec = float(rows[4]["predicted_ms"])
    assert spec > 2.5  # includes T_draft = 2.5 ms


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    out = run(capsys, "--model", "qwen3.5-397b-a17b", "--context", "8K", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {path}" in out


@pytest.mark.parametrize(
    ("argv", "flag", "hint"),
    [
        (["--model", "gpt-9", "--context", "4K"], "--model", "allowed: minimax-m2.5"),
        (["--model", "qwen3", "--hardware", "tpu", "--context", "4K"], "--hardware", "gb200"),
        (["--model", "qwen3", "--context", "4Q"], "--context", "4K"),
        (["--model", "qwen3", "--context", "4K", "--ratios", "0,3"], "--ratios", "1,3,5"),
        (["--model", "qwen3", "--context", "4K", "--batch", "-3"], "--batch", "positive"),
        (["--model", "qwen3", "--context", "4K", "--acceptance", "0.5"], "--acceptance", ">= 1"),
        (["--context", "4K"], "--model", "required"),
        (
            ["--model", "qwen3", "--context", "4K", "--baseline-batch", "90"],
            "--baseline-batch",
            "--baseline-step-ms",
        ),
        (["--model", "qwen3", "--context", "32K"], "", "profiled contexts"),
        (
            [
                "--model",
                "qwen3-30b-a3b",
                "--hardware",
                "h200",
                "--context",
                "8K",
                "--ffn-gpus",
                "3",
            ],
            "--ffn-gpus",
            "must divide 128 (1, 2, 4, 8",
        ),
        (
            ["--model", "qwen3", "--context", "4K", "--profile", "/nonexistent.json"],
            "--profile",
            "no such file",
        ),
    ],
)
def test_bad_inputs_exit_2_naming_the_flag(capsys, argv, flag, hint):
    err = fails(capsys, *argv)
    assert flag in err and hint in err


def test_dense_config_exits_2_naming_the_file(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 16,
            }
        )
    )
    err = fails(capsys, "--model", str(config), "--context", "4K")
    assert "argument --model" in err and str(config) in err and "no routed experts" in err


def test_predict_errors_name_the_line(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("model,context,d,ratio,batch,dv_ms,kappa,t_draft_ms\nllama,4K,0,1,10,1,,\n")
    err = fails(capsys, "predict", "--candidates", str(path))
    assert "--candidates" in err and "line 2" in err and "unknown model 'llama'" in err
    short = tmp_path / "short.csv"
    short.write_text("model,context\nQwen3,4K\n")
    assert "lacks column(s)" in fails(capsys, "predict", "--candidates", str(short))


def test_add_plan_parser_plugs_into_a_host_cli(capsys):
    host = argparse.ArgumentParser(prog="vllm-afd")
    add_plan_parser(host.add_subparsers(dest="command", required=True))
    args = host.parse_args(
        ["plan", "--model", "qwen3", "--context", "8K", "--ratios", "7", "--json"]
    )
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["ratio"] == 7


def test_planner_sources_import_no_heavy_or_reference_code():
    """The model modules are pure; only the two bridges to a running system (calibrate: the
    profile tool, auto_ratio: --afd-ratio auto) may touch torch and vLLM."""
    import ast
    from pathlib import Path

    import vllm_afd.planner as planner

    root = Path(planner.__file__).parent
    bridges = {"calibrate.py", "auto_ratio.py"}
    for source in root.glob("*.py"):
        if source.name in bridges:
            continue
        text = source.read_text()
        assert "/work/shared" not in text, source
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("torch", "vllm"), (source, name)
