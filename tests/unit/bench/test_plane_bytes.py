"""The data-plane bytes and buffer calculator (bench/plane_bytes.py): DeepEP's buffer formula
against the review's figures, the expected FFN ranks a token touches, and its CLI."""

from __future__ import annotations

import json
import math

import pytest

from vllm_afd.bench import plane_bytes
from vllm_afd.planner.models import MODEL_PRESETS


def test_deepep_buffer_matches_the_reviews_figures():
    # ../shared/design/reviews/gpu-path-2.md, finding 8: 4.06 GiB for Qwen3-30B-A3B at 7:1
    # (1024 virtual experts, 256 tokens), 8.1 GiB for Qwen3-235B at 7:1.
    assert plane_bytes.deepep_ll_buffer_bytes(256, 2048, 1024) / 2**30 == pytest.approx(
        4.06, abs=0.005
    )
    assert plane_bytes.deepep_ll_buffer_bytes(256, 4096, 1024) / 2**30 == pytest.approx(
        8.13, abs=0.005
    )
    assert plane_bytes.deepep_ll_buffer_bytes(256, 2048, 1024) % 128 == 0


def test_ffn_ranks_touched_counts_by_hand():
    assert plane_bytes.ffn_ranks_touched(128, 1, 8) == 1.0
    assert plane_bytes.ffn_ranks_touched(4, 2, 1) == pytest.approx(1.0)
    # E=4 on 2 ranks, top-2: both experts on one rank in 2 of the C(4,2)=6 pairs
    assert plane_bytes.ffn_ranks_touched(4, 2, 2) == pytest.approx(2 * (1 - 1 / 6))
    assert plane_bytes.ffn_ranks_touched(128, 4, 8) < 4


def test_a_row_sends_each_token_once_to_every_ffn_rank():
    """Fixed shapes: the slot plane sends every token to each of the F FFN ranks (not only to
    the ranks its experts are on, as the shm backend's filtered sends do)."""
    model = MODEL_PRESETS["qwen3-235b-a22b"]
    row = plane_bytes.plane_row(model, 28, 4, 128)
    hidden = 128 * model.hidden_size * 2
    assert row.slots_sent_bytes == 4 * (hidden + 128 * model.top_k * 8)
    assert row.slots_received_bytes == 4 * hidden
    assert row.ranks_touched < 4
    assert row.deepep_sent_bytes == row.deepep_received_bytes == model.top_k * hidden
    assert row.virtual_experts == 32 * 128 // 4
    assert 28 * 2 * hidden <= row.slots_ffn_buffer_bytes < 28 * 2 * 1.1 * hidden  # x of 2 slots
    assert 4 * 2 * hidden <= row.slots_attention_buffer_bytes < 4 * 2 * 1.1 * hidden  # out


def test_the_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plane.json"
    rows = plane_bytes.main(["--tokens", "64", "--out", str(out)])
    assert [(r.model, r.attention, r.ffn) for r in rows] == list(plane_bytes.DEPLOYMENTS)
    assert "| qwen3-30b-a3b | 7+1 | 64 |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data) == 2 and math.isclose(data[0]["ranks_touched"], 1.0)


@pytest.mark.parametrize("bad", ["qwen3-30b-a3b", "nope@7+1", "qwen3-30b-a3b@7+3"])
def test_a_bad_deployment_is_refused_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit):
        plane_bytes.main(["--deployment", bad])
    assert "--deployment" in capsys.readouterr().err
