"""The soak benchmark's report (pure functions, synthetic records; no server).

The soak itself (a server, clients, SIGKILLs) is a benchmark: ``python -m vllm_afd.bench.soak``.
"""

from __future__ import annotations

import pytest

from vllm_afd.bench.soak import (
    Kill,
    Record,
    Scale,
    _parser,
    format_report,
    itl_windows,
    latency_stats,
    parse_failovers,
    parse_metrics,
    percentile,
    summarize,
    windows,
)

MAX = 8


def _ok(client: int, start: float, end: float, correct: bool = True) -> Record:
    return Record(client, start, end, 200, tokens=MAX, correct=correct, max_gap=0.1)


def test_percentile_interpolates_between_ranks():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_windows_split_requests_around_kills():
    kills = [50.0, 100.0]
    spans = _ok(0, 45.0, 55.0)  # spans the first kill
    spans_both = _ok(1, 40.0, 110.0)  # spans both
    early = _ok(2, 0.0, 40.0)  # ends exactly margin before the first kill: steady
    near_before = _ok(3, 30.0, 41.0)  # ends 9 s before it: neither
    near_after = _ok(4, 55.0, 70.0)  # starts 5 s after it: neither
    between = _ok(5, 60.0, 90.0)  # 10 s from both kills: steady
    late = _ok(0, 111.0, 120.0)
    records = [spans, spans_both, early, near_before, near_after, between, late]
    got = windows(records, kills, margin=10.0)
    assert got["in_flight"] == [spans, spans_both]
    assert got["steady"] == [early, between, late]


def test_a_request_ending_at_the_kill_is_not_in_flight():
    record = _ok(0, 10.0, 50.0)
    assert windows([record], [50.0])["in_flight"] == []
    assert windows([record], [49.9])["in_flight"] == [record]


def test_without_kills_every_request_is_steady():
    records = [_ok(0, 0.0, 1.0), _ok(1, 0.5, 3.0)]
    assert windows(records, [])["steady"] == records
    assert windows(records, [])["in_flight"] == []


def test_summary_counts_completed_failed_and_wrong():
    records = [
        _ok(0, 0.0, 2.0),
        _ok(1, 0.0, 4.0, correct=False),  # all tokens, other text: wrong (and completed)
        Record(2, 1.0, 1.5, 0, error="ConnectionResetError()"),  # no answer: failed
        Record(3, 1.0, 3.0, 200, tokens=MAX - 1, correct=False),  # cut short: failed
        Record(4, 1.0, 3.0, 500, tokens=MAX, error="HTTP 500"),  # an error status: failed
    ]
    summary = summarize(records, [], MAX, duration_s=4.0)
    assert (summary.completed, summary.failed, summary.wrong) == (2, 3, 1)
    assert summary.tokens_per_s == pytest.approx(2 * MAX / 4.0)
    # latency over the completed requests only: 2.0 and 4.0 s
    assert summary.latency["all"]["p50_s"] == pytest.approx(3.0)
    assert summary.latency["all"]["p99_s"] == pytest.approx(3.98)


def test_summary_latency_per_window():
    kills = [50.0]
    records = [_ok(i, 30.0 + i, 60.0 + i) for i in range(3)]  # in flight: 30, 30, 30 s
    records += [_ok(i, 0.0, 2.0 + i) for i in range(3)]  # steady: 2, 3, 4 s
    records.append(Record(5, 45.0, 52.0, 0, error="reset"))  # in flight, failed
    summary = summarize(records, kills, MAX)
    flight, steady = summary.latency["in_flight"], summary.latency["steady"]
    assert (flight["requests"], flight["completed"], flight["failed"]) == (4, 3, 1)
    assert flight["p50_s"] == pytest.approx(30.0)
    assert (steady["requests"], steady["failed"]) == (3, 0)
    assert steady["p50_s"] == pytest.approx(3.0)
    assert steady["p99_s"] == pytest.approx(3.98)


def test_latency_stats_of_no_completed_request_is_empty():
    stats = latency_stats([Record(0, 0.0, 1.0, 0, error="refused")], MAX)
    assert stats["p50_s"] is None and stats["failed"] == 1 and stats["completed"] == 0


def test_parse_failovers_pairs_replacement_time_with_streak():
    log = "\n".join(
        [
            "INFO AFD: FFN rank 0 up: pid 11 on host, experts [0, 8), 1.00 MiB, address a",
            "WARNING AFD: FFN rank 0 (pid 11) died; replacing it (failure 1 in a row)",
            "WARNING AFD: FFN rank 1 (pid 12) died; replacing it (failure 4 in a row)",
            "WARNING AFD: FFN rank 1 replaced in 2.0s (failover 1; it had died)",
            "WARNING AFD: FFN rank 0 replaced in 8.3s (failover 1; it had died)",
            "WARNING AFD: FFN rank 0 (pid 13) died; replacing it (failure 2 in a row)",
            "WARNING AFD: FFN rank 0 replaced in 10.5s (failover 2; it had died)",
            "WARNING AFD: FFN rank 0 replaced in 1.5s (failover 3; it had died)",  # no streak line
        ]
    )
    assert parse_failovers(log) == [(8.3, 1), (10.5, 2), (1.5, None)]
    assert parse_failovers(log, rank=1) == [(2.0, 4)]
    assert parse_failovers("nothing here") == []


def test_parse_metrics_keeps_the_failover_series_only():
    text = "\n".join(
        [
            "# HELP vllm_afd_ffn_failovers_total Times the FFN rank was lost",
            'vllm_afd_ffn_failovers_total{ffn_rank="0"} 2.0',
            'vllm_afd_ffn_failovers_created{ffn_rank="0"} 1.7e9',
            'vllm_afd_ffn_recovery_seconds_sum{ffn_rank="0"} 16.5',
            'vllm_afd_ffn_recovery_seconds_count{ffn_rank="0"} 2.0',
            'vllm_afd_redispatched_requests_total{attention_rank="1"} 7.0',
            'vllm_afd_dispatched_tokens_total{attention_rank="0",ffn_rank="0"} 99.0',
        ]
    )
    assert parse_metrics(text) == {
        'vllm_afd_ffn_failovers_total{ffn_rank="0"}': 2.0,
        'vllm_afd_ffn_recovery_seconds_sum{ffn_rank="0"}': 16.5,
        'vllm_afd_ffn_recovery_seconds_count{ffn_rank="0"}': 2.0,
        'vllm_afd_redispatched_requests_total{attention_rank="1"}': 7.0,
    }


def test_report_has_the_counts_windows_and_one_line_per_failover():
    settings = {
        "model_name": "tiny",
        "ratio": "2:1",
        "clients": 2,
        "minutes": 1.0,
        "ffn_rank": 0,
        "kill_every": 40.0,
        "max_tokens": MAX,
        "margin": 10.0,
    }
    records = [_ok(0, 35.0, 45.0), _ok(1, 0.0, 20.0, correct=False)]
    kills = [Kill(at=40.0, pid=4242, detect_s=0.3, replaced_s=8.3, streak=1, in_flight=1)]
    text = format_report(settings, summarize(records, [40.0], MAX), kills, {"m": 1.0})
    assert "2 completed, 0 failed (lost), 1 wrong text" in text
    assert "steady (>= 10 s from kills)" in text
    failover_lines = [line for line in text.splitlines() if "4242" in line]
    assert len(failover_lines) == 1 and "8.3" in failover_lines[0]
    assert "  m 1" in text


def _streaming(start: float, gaps: list[float]) -> Record:
    times, t = [], start
    for gap in gaps:
        t += gap
        times.append(t)
    return Record(0, start, t, 200, tokens=len(gaps), correct=True, chunk_times=times)


def test_itl_windows_split_chunk_gaps_before_during_and_after_a_scale():
    # chunks every 0.125 s until 20 s, 0.5 s gaps while the scale runs (to 22 s), then 0.125 s
    record = _streaming(10.0, [0.125] * 80 + [0.5] * 4 + [0.125] * 80)
    found = itl_windows([record], began=19.99, ended=22.01, margin=5.0)
    assert found["before"]["gaps"] == 40 and found["after"]["gaps"] == 40
    assert found["during"]["gaps"] == 5 and found["during"]["p50_ms"] == pytest.approx(500)
    assert found["before"]["p99_ms"] == pytest.approx(125)
    assert itl_windows([], 1.0, 2.0)["during"] == {"gaps": 0, "p50_ms": None, "p99_ms": None}


def test_report_of_a_scaling_soak_has_one_line_per_scale_with_its_latency():
    settings = {
        "model_name": "tiny",
        "ratio": "1:1",
        "clients": 1,
        "minutes": 1.0,
        "ffn_rank": 0,
        "kill_every": 20.0,
        "max_tokens": MAX,
        "margin": 5.0,
        "scale_to": [2, 1],
    }
    record = _streaming(10.0, [0.125] * 80 + [0.5] * 4 + [0.125] * 80)
    scale = Scale(at=19.99, to_ranks=2, status=200, took_s=2.02, stall_s=0.0049)
    scale.itl = itl_windows([record], 19.99, 22.01, 5.0)
    text = format_report(settings, summarize([record], [20.0], MAX), [], {}, [scale])
    assert "scale the FFN pool to 2, 1 every 20 s" in text and "in flight at a scale" in text
    (line,) = [line for line in text.splitlines() if line.startswith("1 ")]
    assert "200" in line and "4.9" in line and "125/125" in line and "500/500" in line
    assert "failover" not in text


def test_scale_to_takes_a_list_of_counts():
    assert _parser().parse_args(["--scale-to", "2,1"]).scale_to == (2, 1)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--scale-to", "2,0"])
