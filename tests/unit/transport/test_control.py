"""The control plane (``transport/control.py``): schedules on the wire, tags checked on both
sides, and a mismatch that names both sides instead of corrupting a result."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transport_testlib import EXPERTS, expected, make_spec, recv_all, routing

from vllm_afd.testing.reference import LocalMoE
from vllm_afd.transport import create_attention_transport, create_ffn_transport
from vllm_afd.transport.control import (
    WIRE_MICROBATCHES,
    Mode,
    ScheduleChecker,
    StepSchedule,
    Tag,
    schedule_words,
)

pytestmark = pytest.mark.timeout(60)
BACKENDS = ["shm", "slots", "nixl", "counting"]
#: DeepSeek-like: layer 0 dense, then MoE layers; numbers past 64 take a second bitmap word.
LAYERS = (1, 2, 3, 63, 64, 93)


def test_schedule_round_trips_through_words():
    schedule = StepSchedule(7, (3, 2, 5), LAYERS, Mode.CAPTURE)
    size = schedule_words(LAYERS)
    words = schedule.words(size)
    assert len(words) == size == 3 + WIRE_MICROBATCHES + 2
    assert StepSchedule.from_words(words) == schedule
    with pytest.raises(ValueError, match="does not fit"):
        schedule.words(schedule_words((1, 2)))
    with pytest.raises(ValueError, match="microbatches"):
        StepSchedule(1, (1,) * (WIRE_MICROBATCHES + 1), LAYERS)
    with pytest.raises(ValueError, match="ascending"):
        StepSchedule(1, (1,), (3, 1))


def test_config_microbatches_fit_the_wire():
    from vllm_afd.config import MAX_MICROBATCHES

    assert MAX_MICROBATCHES <= WIRE_MICROBATCHES


def test_checker_accepts_the_two_microbatch_order_and_refuses_each_mismatch():
    checker = ScheduleChecker(0, LAYERS)
    schedule = StepSchedule(4, (3, 2), LAYERS)
    # D,D,C,C: microbatch 0 and 1 of each layer, layers in the model's order
    for layer in LAYERS:
        for mb in (0, 1):
            assert checker.check(0, Tag(4, layer, mb), 2, schedule) is None
    refused = {
        "its last announced step is 4": (Tag(3, 1, 0), 1),
        "step 4 has 2 microbatch(es)": (Tag(4, 1, 2), 1),
        "3 tokens, the microbatch has 2": (Tag(4, 1, 1), 3),
        "layer 0 is not an MoE layer here": (Tag(4, 0, 0), 1),
    }
    for why, (tag, n) in refused.items():
        message = checker.check(1, tag, n, schedule)
        prefix = f"FFN rank 0 refused a request from attention rank 1 tagged ({tag}): "
        assert message.startswith(prefix) and why in message, message
    fresh = ScheduleChecker(2, LAYERS)
    assert fresh.check(0, Tag(4, 3, 0), 1, schedule) is None
    assert "layer 3 of this microbatch came before it" in fresh.check(0, Tag(4, 2, 0), 1, schedule)
    assert fresh.check(0, Tag(4, 2, 1), 1, schedule) is None  # the other microbatch is its own
    shorter = StepSchedule(5, (1,), (1, 2))  # a step that visits fewer layers (e.g. a draft's)
    assert "visits layers [1, 2]" in fresh.check(0, Tag(5, 3, 0), 1, shorter)
    # a producer that never announces a step: step 0, checked against the MoE layers only
    assert fresh.check(3, Tag(0, 93, 0), 100, None) is None
    assert "step 2 was never announced" in fresh.check(3, Tag(2, 93, 0), 1, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_carry_the_announced_schedule_and_answers_their_tag(backend, loopback):
    lb = loopback(make_spec(backend, 1, 2, moe_layers=LAYERS))
    att = lb.attention[0]
    inputs = [routing(4, lb.spec, seed=s) for s in (0, 1)]
    first = att.step + 1  # the loopback announced one step already
    for step in (first, first + 1):
        schedule = StepSchedule(step, (4, 4), LAYERS)
        att.begin_step(schedule)
        handles = [att.dispatch(63, *inputs[mb], microbatch=mb) for mb in (0, 1)]
        for rank, endpoint in enumerate(lb.ffn):
            forward = LocalMoE.for_rank(EXPERTS, lb.spec, rank)
            count = sum(rank in h.token_index for h in handles)
            for request in recv_all(endpoint, count):
                assert (request.step, request.layer) == (step, 63)
                assert request.schedule == schedule
                endpoint.reply(request, forward(request.x, request.topk_ids, request.topk_weights))
        for mb, handle in enumerate(handles):
            assert (handle.step, handle.microbatch) == (step, mb)
            assert torch.equal(att.combine(handle), expected(lb.spec, *inputs[mb]))
    with pytest.raises(ValueError, match=f"step {step} announced after step {step}"):
        att.begin_step(StepSchedule(step, (1,), LAYERS))


def test_the_plane_keeps_each_attention_rank_schedule_apart():
    """Each attention rank's schedule words are its own."""
    spec = make_spec("shm", 2, 1, moe_layers=LAYERS)
    ffn = create_ffn_transport(spec, 0)
    spec = dataclasses.replace(spec, addresses=(ffn.address,))
    atts = [create_attention_transport(spec, a) for a in range(2)]
    try:
        for a, att in enumerate(atts):
            att.begin_step(StepSchedule(1, (3 + a,), LAYERS))
            att.dispatch(1, *routing(2, spec, seed=a))
        requests = recv_all(ffn, 2)
        assert sorted(r.schedule.microbatch_tokens for r in requests) == [(3,), (4,)]
    finally:
        for endpoint in [*atts, ffn]:
            endpoint.close()
