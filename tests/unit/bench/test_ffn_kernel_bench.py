"""The FFN kernel / memory benchmark (bench/ffn_kernel_bench.py) at its smallest size: the JSON
it writes, FFN outputs equal to vLLM's colocated kernel, and its refusal to time a path that
computes something else. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_afd.bench import ffn_kernel_bench as kb

#: The default tiny Qwen3-MoE (hidden 128, 8 experts of 64, top-2), shared with other tests.
TINY = ["--hidden-size", "128", "--num-experts", "8", "--top-k", "2"]
TINY += ["--moe-intermediate-size", "64"]


def test_kernel_table_json_and_equal_outputs(tmp_path, capsys):
    out = tmp_path / "kernel.json"
    argv = TINY + ["--tokens", "1", "5", "--repeats", "1", "--warmup", "0", "--out", str(out)]
    assert kb.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["args"]["threads"] == 1 and result["model"]["num_experts"] == 8
    rows = result["kernel"]
    assert [r["tokens"] for r in rows] == [1, 5]
    for row in rows:
        assert row["ffn1_exact"] is True  # the same kernel on the same weights: bit-identical
        for key in ("colocated_us", "ffn1_max_us", "ffn2_max_us", "ffn2_sum_us"):
            assert row[key] > 0, key
        assert row["ffn2_sum_us"] >= row["ffn2_max_us"]
        assert row["ffn1_max_ratio"] == pytest.approx(row["ffn1_max_us"] / row["colocated_us"])
        assert row["ffn2_expert_bytes"] * 2 == row["ffn1_expert_bytes"]
    assert result["kernel_summary"]["ffn1_worst_ratio"] == max(r["ffn1_max_ratio"] for r in rows)
    assert "| T | colocated us |" in capsys.readouterr().out


def test_check_outputs_refuses_a_different_result():
    info = type("Info", (), {"hidden_size": 8, "num_experts": 4, "top_k": 2})()

    def colocated(layer, x, ids, w):
        return x * 2

    def half(layer, x, ids, w):
        return x

    assert kb.check_outputs(
        colocated, {1: [colocated], 2: [half, half]}, [0], 3, info, torch.float32
    ) == {1: True, 2: True}

    def close(layer, x, ids, w):
        return x * 2 + 1e-7

    assert kb.check_outputs(colocated, {1: [close]}, [0], 3, info, torch.float32) == {1: False}

    def wrong(layer, x, ids, w):
        return x * 2.1

    with pytest.raises(AssertionError, match="refusing"):
        kb.check_outputs(colocated, {1: [wrong]}, [0], 3, info, torch.float32)


def test_loader_reopens_files_and_yields_each_tensor_once(tiny_qwen3, monkeypatch):
    """``_checkpoint`` reopens a file every ``_MAPPED_BYTES`` (bounded mapped memory) and still
    yields exactly the tensors of one reading, with this rank's experts only."""
    from safetensors.torch import load_file

    from vllm_afd.ffn import weights

    whole = {}
    for path in weights._checkpoint_files(Path(tiny_qwen3)):
        whole.update(load_file(str(path)))
    monkeypatch.setattr(weights, "_MAPPED_BYTES", 1)  # reopen after every tensor
    got = list(weights._checkpoint(Path(tiny_qwen3), {4, 5, 6, 7}))
    names = [name for name, _ in got]
    assert len(names) == len(set(names))
    assert not [n for n in names if ".experts.0." in n] and any(".experts.4." in n for n in names)
    for name, tensor in got:
        assert torch.equal(tensor, whole[name]), name


def test_memory_child_reports_peak_against_expert_bytes(tiny_qwen3):
    args = kb.parse_args(TINY + ["--memory", "--ffn-ranks", "2"])
    row = kb.measure_memory(tiny_qwen3, 2, args)
    assert row["num_ranks"] == 2
    assert row["expert_bytes"] == 2 * 4 * 3 * 128 * 64 * 4  # 2 layers x 4 experts, float32
    assert row["peak_rss"] >= row["rss_after"] and row["peak_delta"] >= 0
    assert row["peak_ratio"] == pytest.approx(row["peak_delta"] / row["expert_bytes"])
    phases = [p["phase"] for p in row["phases"]]
    assert {"nan_fill", "read_checkpoint", "process_layer_1", "end"} <= set(phases)
    assert kb.format_memory_row(row).startswith("| 2 |")
