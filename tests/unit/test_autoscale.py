"""The planner in the loop (``placement/autoscale.py``): what the attention and FFN ranks
measure (patch W1's decode steps, the round trips), the planner's prediction at that load, the
decision with its hysteresis, and the advice ``/afd/status`` and ``/metrics`` answer.

The FFN pool it scales is tests/unit/test_scaling.py's and the e2e scale test's; here
``scale_ffn_group`` is replaced by a recorder, the blocks are written in this process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from vllm_afd.config import AFDConfig, MoEModelInfo
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import cpu_stolen_times
from vllm_afd.metrics.blocks import AttentionStatsBlock, FFNStatsBlock
from vllm_afd.patches.request_errors import decode_step
from vllm_afd.placement import autoscale, scaling
from vllm_afd.placement.autoscale import Advisor, Deployment, Policy, decide, measure
from vllm_afd.planner.auto_ratio import Candidate, planner_inputs, predict_ffn_counts
from vllm_afd.transport import TransportSpec, directory

#: Qwen3-30B-A3B (``qwen3_30b_dir``): on an H200 the planner's best A:F for 2 attention ranks
#: moves from 1:1 at short contexts to 2:1 at long ones (FastAFD: attention grows with context).
INFO = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))
ON = Policy(enabled=True, interval_s=60.0, margin=0.1)


@pytest.fixture
def qwen3_30b(qwen3_30b_dir, monkeypatch) -> str:
    monkeypatch.setenv("VLLM_AFD_PLAN_HARDWARE", "h200")
    return qwen3_30b_dir


def _candidate(ffn: int, tokens_per_device: float) -> Candidate:
    return Candidate(ffn, f"{2 // ffn}:1", 64, 10.0, tokens_per_device, True)


TWO = [_candidate(1, 1000.0), _candidate(2, 1300.0)]  # 2 FFN ranks promise +30%


@pytest.mark.parametrize(
    ("live", "candidates", "policy", "before", "age", "rule"),
    [
        (2, TWO, ON, 2, 1e9, "best"),
        (1, [_candidate(1, 1000.0), _candidate(2, 1050.0)], ON, 2, 1e9, "margin"),
        (1, TWO, ON, None, 1e9, "unconfirmed"),
        (1, TWO, ON, 1, 1e9, "unconfirmed"),
        (1, TWO, Policy(False, 60.0, 0.1), 2, 1e9, "off"),
        (1, TWO, ON, 2, 30.0, "interval"),
        (1, [], ON, 2, 1e9, "infeasible"),
    ],
)
def test_the_loop_holds_and_says_why(live, candidates, policy, before, age, rule):
    decision = decide(live, candidates, policy, before, age)
    assert decision.target is None and decision.rule == rule
    assert decision.rule in autoscale.RULES


def test_the_loop_scales_once_a_gain_over_the_margin_holds_for_two_windows():
    decision = decide(1, TWO, ON, best_before=2, since_last_scale_s=61.0)
    assert (decision.target, decision.rule) == (2, "scale")
    assert "+30%" in decision.reason and ">= the margin +10%" in decision.reason
    assert "1:1 (2 FFN rank(s)" in decision.reason


def test_a_live_count_the_planner_cannot_predict_is_left_for_its_best_saying_why():
    """A pool scaled by hand to a count the planner has no prediction for (it leaves the
    NVLink domain, say): the advice says why and moves to the best predicted count."""
    why = {4: "2 attention + 4 FFN GPUs exceed the h100 NVLink domain of 4 GPUs"}
    decision = decide(4, [_candidate(1, 1000.0)], ON, 1, 1e9, unpredicted=why)
    assert (decision.target, decision.rule) == (1, "scale")
    assert "the live 4 FFN rank(s), not predicted (2 attention + 4 FFN GPUs" in decision.reason


def test_no_prediction_says_why_for_each_count():
    why = {1: "the profile covers contexts 128-2048, not 9000", 2: "the same"}
    decision = decide(1, [], ON, None, 1e9, unpredicted=why)
    assert decision.rule == "infeasible"
    assert "1 FFN rank(s): the profile covers contexts 128-2048, not 9000" in decision.reason


def test_a_disturbed_window_is_not_decided_on():
    """A window that holds a scale or a failover holds, whatever the planner prefers."""
    decision = decide(1, TWO, ON, 2, 1e9, disturbed="a failover of an FFN rank")
    assert (decision.target, decision.rule) == (None, "disturbed")
    assert "a failover of an FFN rank" in decision.reason


def test_the_planner_moves_the_ratio_with_the_context(qwen3_30b):
    """What the loop acts on: at 64 requests per attention rank the best FFN rank count for
    2 attention ranks is 4 (1:2, more FFN ranks than attention ranks) at a 2K context and 1
    (2:1) at 16K, on an H200; every count the experts allow is asked for, and the counts past
    the NVLink domain are left out saying so."""
    best = {}
    counts = autoscale.candidate_ffn_ranks(INFO, 2, whole_ratios=False)
    assert counts == [1, 2, 4, 8, 16, 32, 64, 128]
    for context in (2048, 16384):
        predictions = predict_ffn_counts(
            INFO, 2, qwen3_30b, context, batch=64, platform_is_cpu=True, counts=counts
        )
        assert predictions.model == "analytical model on h200"
        assert [c.num_ffn_ranks for c in predictions.candidates] == [1, 2, 4]
        assert "NVLink domain of 8 GPUs" in predictions.unpredicted[8]
        assert predictions.candidates[2].ratio == "1:2"
        best[context] = predictions.best().ratio
    assert best == {2048: "1:2", 16384: "2:1"}


def test_without_planner_inputs_autoscale_names_its_flag(monkeypatch):
    monkeypatch.delenv("VLLM_AFD_PLAN_HARDWARE", raising=False)
    monkeypatch.delenv("VLLM_AFD_PLAN_PROFILE", raising=False)
    with pytest.raises(AFDConfigError, match="--afd-autoscale on the CPU build needs"):
        planner_inputs(True, "--afd-autoscale")
    assert planner_inputs(False, "--afd-autoscale").model == "analytical model on h200"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"ratio": "1:1", "autoscale": "yes"}, "--afd-autoscale "),
        ({"ratio": "1:1", "autoscale_interval": 0}, "--afd-autoscale-interval"),
        ({"ratio": "1:1", "autoscale_interval": "inf"}, "--afd-autoscale-interval"),
        ({"ratio": "1:1", "autoscale_margin": -0.1}, "--afd-autoscale-margin"),
        ({"join": "/g.json", "autoscale": True}, "not with --afd-join"),
        (
            {
                "ratio": "1:1",
                "transport": "slots",
                "transport_config": {"waits": "device"},
                "autoscale": True,
            },
            "cannot change its FFN",
        ),
    ],
)
def test_bad_autoscale_settings_are_refused_naming_the_flag(raw, field):
    with pytest.raises(AFDConfigError, match=field):
        AFDConfig.from_dict(raw)


def test_autoscale_settings_parse_from_flags_text():
    afd = AFDConfig.from_dict(
        {"ratio": "2:1", "autoscale": "true", "autoscale_interval": "6", "autoscale_margin": "0"}
    )
    assert (afd.autoscale, afd.autoscale_interval, afd.autoscale_margin) == (True, 6.0, 0.0)
    assert Policy.of(afd).window_s == 2.0
    assert Policy.of(AFDConfig.from_dict({"ratio": "2:1"})).window_s == autoscale.WINDOW_S


def _scheduled(new=(), cached=(), drafts=None):
    """A SchedulerOutput's fields ``decode_step`` reads: ``cached`` (request id, computed
    tokens, scheduled tokens), ``new`` request ids (prefills)."""
    scheduled = {r: n for r, _, n in cached} | {r: 5 for r in new}
    return SimpleNamespace(
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_new_reqs=list(new),
        scheduled_spec_decode_tokens=drafts or {},
        scheduled_cached_reqs=SimpleNamespace(num_computed_tokens=[c for _, c, _ in cached]),
    )


def test_only_decode_steps_are_measured():
    assert decode_step(_scheduled(cached=[("a", 100, 1), ("b", 40, 1)])) == (2, 142)
    drafts = {"a": [7, 8]}  # a speculative draft of 2: 3 tokens scheduled
    assert decode_step(_scheduled(cached=[("a", 100, 3)], drafts=drafts)) == (1, 103)
    assert decode_step(_scheduled(new=["p"], cached=[("a", 100, 1)])) is None  # a prefill
    assert decode_step(_scheduled(cached=[("a", 100, 32)])) is None  # a prefill chunk
    assert decode_step(_scheduled()) is None  # an empty step
    assert decode_step(None) is None  # sample_tokens' argument


@pytest.fixture
def deployment(tmp_path):
    """Blocks of a 2-attention-rank, 1-FFN-rank deployment, written in this process."""
    tag = uuid.uuid4().hex[:8]
    ffn_dir = tmp_path / "ffn"
    ffn_dir.mkdir()
    spec = TransportSpec(
        "shm", 2, 1, 128, 2048, 8, 16, addresses=(f"test_{tag}_0",), directory=str(ffn_dir)
    )
    attention = [AttentionStatsBlock(spec.addresses, a) for a in range(2)]
    ffn = FFNStatsBlock(spec.addresses[0], 0, layers=range(48))
    yield spec, attention, ffn
    for block in (*attention, ffn):
        block.close()


def _load(attention, ffn, steps: int, batch: int, context: int) -> None:
    """``steps`` decode steps of 10 ms on each attention rank, 48 round trips each of 0.05 ms
    exposed FFN time, each served in 0.1 ms."""
    for _ in range(steps):
        for block in attention:
            block.record_step(0.010, batch, batch * context)
            for layer in range(48):
                block.record_round_trip(layer, [batch], 0, 0, 0.00005)
                ffn.record_layer(layer, 1, batch, 0, 0, 0.0001)


def test_a_window_is_what_the_ranks_measured_in_it(deployment):
    spec, attention, ffn = deployment
    _load(attention, ffn, steps=3, batch=2, context=50)  # before the window
    before = autoscale.read_totals(spec)
    _load(attention, ffn, steps=5, batch=6, context=900)
    window = measure(before, autoscale.read_totals(spec), 10.0, num_layers=48)
    assert window is not None and window.steps == 10
    assert window.batch == pytest.approx(6) and window.context == pytest.approx(900)
    assert window.step_ms == pytest.approx(10.0)
    assert window.exposed_ffn_ms == pytest.approx(0.05)
    assert window.ffn_ms == pytest.approx(0.1)
    # the step less its 48 exposed waits, over the model's 48 layers
    assert window.attention_ms == pytest.approx((10.0 - 48 * 0.05) / 48)


def test_a_window_says_how_much_of_the_host_s_cpu_its_hypervisor_took(deployment):
    spec, attention, ffn = deployment
    stolen, total = cpu_stolen_times()
    assert total > 0 and 0 <= stolen <= total  # /proc/stat's first line, since boot
    _load(attention, ffn, steps=10, batch=2, context=50)
    after = autoscale.read_totals(spec)
    before = dataclasses.replace(after, steps=0, cpu_stolen=100, cpu_total=10_000)
    after = dataclasses.replace(after, cpu_stolen=150, cpu_total=11_000)
    assert measure(before, after, 10.0, 48).cpu_stolen == pytest.approx(0.05)
    # a scale restarts the pool's counters, not the host's
    moved = dataclasses.replace(after, pool=("another", "pool"), steps=8, step_s=0.4)
    assert measure(before, moved, 10.0, 48).cpu_stolen == pytest.approx(0.05)


def test_too_few_steps_is_no_window_and_a_scale_or_a_failover_is_marked(deployment, monkeypatch):
    spec, attention, ffn = deployment
    before = autoscale.read_totals(spec)
    _load(attention, ffn, steps=1, batch=2, context=50)  # 2 steps < MIN_STEPS
    assert measure(before, autoscale.read_totals(spec), 10.0, 48) is None
    _load(attention, ffn, steps=10, batch=2, context=50)
    after = autoscale.read_totals(spec)
    assert measure(before, after, 10.0, 48).disturbed == ""
    # a scale: the new pool's counters (from 0) are the window, marked
    moved = dataclasses.replace(after, pool=("another", "pool"), steps=8, step_s=0.4)
    window = measure(after, moved, 10.0, 48)
    assert window.disturbed == "a scale of the FFN pool to 2 rank(s)"
    assert (window.steps, window.step_ms) == (8, pytest.approx(50.0))
    # a scale under way at either end of a window, before any switch: its new pool starts on
    # the same hosts, so the live pool's steps are slower than the load makes them
    assert autoscale.read_totals(spec).scaling is False
    monkeypatch.setattr(scaling, "_UNDER_WAY", {"from_ranks": 1, "to_ranks": 2, "since": 0.0})
    under_way = autoscale.read_totals(spec)
    assert under_way.scaling is True
    for ends in ((before, under_way), (dataclasses.replace(before, scaling=True), after)):
        assert measure(*ends, 10.0, 48).disturbed == "a scale of the FFN pool under way"
    monkeypatch.setattr(scaling, "_UNDER_WAY", None)
    # a failover: the directory counts it; the replaced rank's counters restart at 0
    entry = directory.RankEntry(0, 1, directory.RECOVERING, spec.addresses[0], "h", 1)
    directory.publish(spec.directory, entry)
    assert autoscale.read_totals(spec).unsettled == 1
    assert measure(before, autoscale.read_totals(spec), 10.0, 48).disturbed.startswith("a failover")
    directory.publish(spec.directory, dataclasses.replace(entry, state="up", failovers=1))
    restarted = dataclasses.replace(
        autoscale.read_totals(spec), steps=after.steps + 8, ffn_batches=48, ffn_s=0.0096
    )
    window = measure(after, restarted, 10.0, 48)
    assert window.disturbed == "a failover of an FFN rank"
    assert window.ffn_ms == pytest.approx(0.2)  # the restarted counters, from 0


def test_a_decode_step_is_recorded_in_the_sessions_block(deployment):
    """W1 gives the worker's session each step's start; the session records a decode step's
    period into its rank's block, which the planner in the loop reads."""
    from vllm_afd.attention.session import AttentionSession

    spec, attention, _ = deployment
    session = AttentionSession("test", None, 0, 1, attention[1], None)
    session.periods.started(5.0, (3, 300))
    session.periods.started(5.02, (3, 303))
    totals = autoscale.read_totals(spec)
    assert (totals.steps, totals.requests, totals.context) == (1, 3, 300)
    assert totals.step_s == pytest.approx(0.02)


def test_a_decode_step_is_timed_from_its_start_to_the_next_one():
    """W1 records a decode step's period (the engine's whole loop), once the next step starts
    and decodes too; a step that adds requests (after an idle engine) records none."""
    from vllm_afd.attention.session import StepPeriods

    recorded = []
    periods = StepPeriods(lambda *a: recorded.append(a))
    periods.started(10.0, (2, 200))
    periods.started(10.5, (2, 202))  # records the first: 0.5 s
    periods.started(11.25, None)  # a prefill (the engine may have idled before it): nothing
    periods.started(99.0, (3, 300))  # after the prefill: nothing
    periods.started(99.1, (3, 303))
    assert recorded == [(0.5, 2, 200), (pytest.approx(0.1), 3, 300)]


class _Pools:
    """FFN pools of a 2-attention-rank deployment as a live scale leaves them: each its own
    addresses, blocks and FFN directory (``ffn``, ``ffn2``, ...); ``scale`` stands in for
    ``scaling.scale_ffn_group`` (the new pool is live at once, its scale in ``pool.json``)."""

    def __init__(self, root) -> None:
        self.root, self.blocks, self.calls, self.times = root, [], [], []
        self.context = 2048
        self.live = self._pool(1)

    def _pool(self, ffn_ranks: int):
        epoch = len(self.calls) + 1
        where = self.root / ("ffn" if epoch == 1 else f"ffn{epoch}")
        where.mkdir()
        tag = uuid.uuid4().hex[:8]
        addresses = tuple(f"test_{tag}_{f}" for f in range(ffn_ranks))
        spec = TransportSpec(
            "shm", 2, ffn_ranks, 128, 2048, 8, 16, addresses=addresses, directory=str(where)
        )
        attention = [AttentionStatsBlock(addresses, a) for a in range(2)]
        ffn = FFNStatsBlock(addresses[0], 0, layers=range(48))
        self.blocks += [*attention, ffn]
        os.environ["VLLM_AFD_RUNTIME"] = spec.to_json()
        return spec, attention, ffn

    def scale(self, count: int):
        self.calls.append(count)
        self.times.append(time.time())
        old = self.live[0]
        self.live = self._pool(count)
        event = {"epoch": len(self.calls) + 1, "at": time.time(), "took_s": 0.0, "stall_s": 0.0}
        directory.publish_pool(old.directory, directory.Pool(event["epoch"], "", (event,)))
        self.context = 65536  # from now on the load has long contexts

    def load(self, stop: threading.Event) -> None:
        while not stop.is_set():
            _, attention, ffn = self.live
            _load(attention, ffn, steps=10, batch=64, context=self.context)
            time.sleep(0.02)


def test_the_advisor_follows_the_load_from_short_to_long_contexts(
    tmp_path, qwen3_30b, monkeypatch, caplog
):
    """The whole loop on 2 attention ranks at 2:1 (1 FFN rank): under a 2K-context load it
    scales to 1:2 (4 FFN ranks); once the contexts grow to 64K it scales back to 2:1, not
    sooner than the interval after the first scale, and not on the window that holds the
    scale. Each decision is logged with why, and the advice has the measured window next to
    the prediction."""
    monkeypatch.setenv("VLLM_AFD_RUNTIME", "")
    pools = _Pools(tmp_path)
    monkeypatch.setattr(scaling, "scale_ffn_group", pools.scale)
    caplog.set_level("INFO", logger="vllm.afd")
    stop = threading.Event()
    writer = threading.Thread(target=pools.load, args=(stop,), daemon=True)
    writer.start()
    advisor = Advisor(Deployment(INFO, 2, qwen3_30b, True), Policy(True, 0.6, 0.1))
    try:
        deadline = time.monotonic() + 30
        while len(pools.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        advisor.stop()
        stop.set()
        writer.join(5)
        for block in pools.blocks:
            block.close()
    assert pools.calls == [4, 1], caplog.text
    assert pools.times[1] - pools.times[0] >= 0.6  # --afd-autoscale-interval
    said = [r.getMessage() for r in caplog.records if "AFD autoscale: scale:" in r.getMessage()]
    assert len(said) == 2, said
    assert "the planner prefers 1:2 (4 FFN rank(s)" in said[0] and "context 2048" in said[0]
    assert "the planner prefers 2:1 (1 FFN rank(s)" in said[1] and "context 65536" in said[1]
    advice = directory.read_advice(pools.live[0].directory)
    assert advice["rule"] == "scale" and advice["recommended"] == {
        "num_ffn_ranks": 1,
        "ratio": "2:1",
    }
    window = advice["window"]
    assert window["batch"] == pytest.approx(64) and window["context"] == pytest.approx(65536)
    assert window["step_ms"] == pytest.approx(10.0)
    assert {c["num_ffn_ranks"] for c in advice["candidates"]} == {1, 2, 4}
    assert advice["model"] == "analytical model on h200" and "8" in advice["unpredicted"]
    held = [r.getMessage() for r in caplog.records if "the window holds a scale" in r.getMessage()]
    assert held, caplog.text


def test_the_advice_is_in_metrics(deployment):
    """``/metrics``: the planner's choice and prediction per FFN rank count, the measured
    window next to it, the rule that decided; each attention rank's decode steps."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_afd.metrics.collector import AFDCollector

    spec, attention, _ = deployment
    attention[0].record_step(0.5, 4, 400)
    advice = {
        "rule": "margin",
        "recommended": {"num_ffn_ranks": 1, "ratio": "2:1"},
        "candidates": [
            {"num_ffn_ranks": 1, "step_ms": 12.5, "tokens_per_device": 1000.0},
            {"num_ffn_ranks": 2, "step_ms": 10.0, "tokens_per_device": 950.0},
        ],
        "window": {"step_ms": 11.0, "batch": 4.0, "context": 100.0, "ffn_ms": 0.2},
    }
    directory.publish_advice(spec.directory, advice)
    registry = CollectorRegistry()
    registry.register(AFDCollector(spec))
    text = generate_latest(registry).decode()
    for line in (
        'vllm_afd_planner_recommended_ffn_ranks{model_name=""} 1.0',
        'vllm_afd_planner_predicted_step_seconds{model_name="",num_ffn_ranks="1"} 0.0125',
        'vllm_afd_planner_predicted_tokens_per_device{model_name="",num_ffn_ranks="2"} 950.0',
        'vllm_afd_window_step_seconds{model_name=""} 0.011',
        'vllm_afd_window_batch_requests{model_name=""} 4.0',
        'vllm_afd_window_ffn_layer_seconds{model_name=""} 0.0002',
        'vllm_afd_autoscale_rule{model_name="",rule="margin"} 1.0',
        'vllm_afd_decode_step_seconds_count{attention_rank="0",engine="",model_name=""} 1.0',
        'vllm_afd_decode_step_seconds_sum{attention_rank="0",engine="",model_name=""} 0.5',
    ):
        assert line in text, line


def test_another_api_server_reads_the_live_pool_after_a_scale(tmp_path, monkeypatch):
    """An API server other than the scaling front-end keeps the spec it was started with in
    ``VLLM_AFD_RUNTIME``: health and status read the pool serving now from ``pool.json`` (the
    old pool's ranks, stopped, are no problem), and before any scale the variable's own."""
    from vllm_afd.placement.health import ffn_group_problems

    (tmp_path / "ffn").mkdir()
    (tmp_path / "ffn2").mkdir()
    old = TransportSpec(
        "shm", 2, 2, 8, 16, 2, 16, addresses=("a", "b"), directory=str(tmp_path / "ffn")
    )
    new = TransportSpec(
        "shm", 2, 1, 8, 16, 2, 16, addresses=("c",), directory=str(tmp_path / "ffn2")
    )
    assert directory.live_runtime(old.to_json()) == old.to_json()
    gone = directory.RankEntry(0, 1, directory.UP, "a", socket.gethostname(), 2**22 + 7)
    directory.publish(old.directory, gone)
    monkeypatch.setenv("VLLM_AFD_RUNTIME", old.to_json())
    assert ffn_group_problems(), "the old pool's stopped rank is a problem before the scale"
    directory.publish_pool(old.directory, directory.Pool(2, new.to_json()))
    assert TransportSpec.from_json(directory.live_runtime(old.to_json())) == new
    assert ffn_group_problems() == []


def test_a_window_shows_the_round_trip_served_where_it_can():
    """One microbatch: the exposed wait is the whole round trip; two: the other microbatch's
    stage (half the attention time per layer) plus the wait, unless the wait is under a tenth
    of the stage (the round trip hid); a disturbed window shows none. Tokens per FFN rank:
    the batch over the ratio, per microbatch, times the positions of a speculative step."""
    from vllm_afd.planner.auto_ratio import ServedRoundTrip

    window = autoscale.Window(10.0, 20, 90.0, 4.0, 100.0, 2.0, 1.5, 1.2)
    assert window.served(1, 1, 1) == ServedRoundTrip(1, 4.0, pytest.approx(1.5e-3))
    assert window.served(2, 1, 2, draft_length=1) == ServedRoundTrip(1, 8.0, pytest.approx(2.5e-3))
    hidden = dataclasses.replace(window, exposed_ffn_ms=0.05)
    assert hidden.served(1, 1, 2) is None and hidden.served(1, 1, 1) is not None
    assert dataclasses.replace(window, disturbed="a failover").served(1, 1, 1) is None


def test_a_window_shows_the_attention_side_served_unless_disturbed():
    """The attention side per step: the attention time per layer over the model's layers, at
    the window's batch and context; none from a disturbed window."""
    from vllm_afd.planner.auto_ratio import ServedAttention

    window = autoscale.Window(10.0, 20, 90.0, 4.0, 100.0, 2.0, 1.5, 1.2)
    assert window.served_attention(30) == ServedAttention(4.0, 100.0, pytest.approx(0.06))
    assert dataclasses.replace(window, disturbed="a scale").served_attention(30) is None
