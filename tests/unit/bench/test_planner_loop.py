"""``bench/planner_loop.py``: a window's row is the measured step next to the prediction for
the live FFN rank count, as ``/metrics`` and ``/afd/status`` give them."""

from __future__ import annotations

import pytest

from vllm_afd.bench.planner_loop import window_row


def test_a_row_pairs_the_measured_step_with_the_live_count_s_prediction():
    metrics = {
        'vllm_afd_window_step_seconds{model_name="m"}': 0.1,
        'vllm_afd_window_batch_requests{model_name="m"}': 2.0,
        'vllm_afd_window_context_tokens{model_name="m"}': 80.0,
        'vllm_afd_window_disturbed{model_name="m"}': 0.0,
        'vllm_afd_planner_predicted_step_seconds{model_name="m",num_ffn_ranks="1"}': 0.09,
        'vllm_afd_planner_predicted_step_seconds{model_name="m",num_ffn_ranks="2"}': 0.05,
    }
    status = {
        "num_ffn_ranks": 2,
        "ratio": "1:2",
        "live": {"window": {"disturbed": ""}, "rule": "best", "reason": "r", "model": "CPU"},
    }
    row = window_row("after scale to 2", {"status": status, "metrics": metrics})
    assert (row["measured_ms"], row["predicted_ms"]) == (pytest.approx(100), pytest.approx(50))
    assert row["predicted_over_measured"] == pytest.approx(0.5)
    assert (row["batch"], row["context"], row["ratio"], row["disturbed"]) == (2, 80, "1:2", "")
    status["live"]["window"]["disturbed"] = "a scale of the FFN pool to 2 rank(s)"
    status["num_ffn_ranks"] = 3  # a count with no prediction: none, not another count's
    row = window_row("x", {"status": status, "metrics": metrics})
    assert row["predicted_ms"] is None and row["disturbed"].startswith("a scale")
