"""Every backend whose FFN side serves requests as they come, with FFN and attention endpoints in
this one process: the slot plane on host memory (``shm``, ``slots``) and over NIXL.

The FFN side is driven by hand (``recv`` then ``reply``) between ``dispatch`` and ``combine``,
which makes batching, ordering and the protocol checks deterministic.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transport_testlib import EXPERTS, expected, make_spec, recv_all, routing, while_serving

from vllm_afd.errors import FFNServeError, FFNTimeout, TransportError
from vllm_afd.testing.reference import LocalMoE
from vllm_afd.transport import create_attention_transport

pytestmark = pytest.mark.timeout(60)
#: ... and an out-of-tree one: shm's endpoints, counting their rounds (``COUNTING``).
BACKENDS = ["shm", "slots", "nixl", "counting"]
#: The slot plane's backends (on host memory here, mirrored through NIXL for nixl).
PLANE = ["shm", "slots", "nixl", "counting"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ffn_recv_batches_all_attention_ranks(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 2, 1))
    inputs = [routing(5, lb.spec, seed=a) for a in range(2)]
    handles = [att.dispatch(7, *inputs[a]) for a, att in enumerate(lb.attention)]
    requests = lb.serve(expect=2)
    assert sorted((r.src_rank, r.layer, r.x.shape[0]) for r in requests) == [(0, 7, 5), (1, 7, 5)]
    for a, att in enumerate(lb.attention):
        assert torch.equal(att.combine(handles[a]), expected(lb.spec, *inputs[a]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_outstanding_handles_answered_in_any_order(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 2, num_slots=3))
    att = lb.attention[0]
    inputs = [routing(n, lb.spec, seed=n) for n in (3, 9, 1)]
    handles = [att.dispatch(layer, *inputs[layer], microbatch=layer) for layer in range(3)]
    with pytest.raises(RuntimeError, match="num_slots|busy"):
        att.dispatch(3, *inputs[0], microbatch=2)
    for rank, endpoint in enumerate(lb.ffn):
        forward = LocalMoE.for_rank(EXPERTS, lb.spec, rank)
        requests = recv_all(endpoint, sum(rank in h.token_index for h in handles))
        layers = [r.layer for r in requests]
        assert layers == sorted(layers)  # dispatch order
        for request in reversed(requests):
            endpoint.reply(request, forward(request.x, request.topk_ids, request.topk_weights))
    for i in (1, 2, 0):
        assert torch.equal(att.combine(handles[i]), expected(lb.spec, *inputs[i]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_sends_nothing(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 2, dtype=torch.bfloat16))
    att = lb.attention[0]
    x, ids, weights = routing(0, lb.spec, seed=0)
    out = att.combine(att.dispatch(0, x, ids, weights))
    assert out.shape == (0, lb.spec.hidden_size) and out.dtype == torch.bfloat16
    assert lb.serve() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_without_tokens_gets_no_message(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 2))
    att = lb.attention[0]
    x, _, weights = routing(4, lb.spec, seed=3)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])  # all on FFN rank 0
    handle = att.dispatch(0, x, ids, weights)
    assert list(handle.token_index) == [0]
    assert [r.x.shape[0] for r in lb.serve()] == [4]
    assert torch.equal(att.combine(handle), expected(lb.spec, x, ids, weights))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_spec_is_refused(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 1))
    wrong = dataclasses.replace(lb.spec, hidden_size=16)
    if backend in PLANE:
        with pytest.raises(ValueError, match="TransportSpec|layout"):
            while_serving(lb.ffn, lambda: create_attention_transport(wrong, 0))
        return
    with pytest.raises(TransportError, match="rejected this attention rank: spec mismatch"):
        lb.connect(0, wrong)  # the FFN rank answers the HELLO with a REJECT at connect


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_reply_fails_that_request_only(backend: str, loopback) -> None:
    """An FFN rank that fails one request: its combine raises at once with the FFN's text; the
    slot and the other requests are unharmed, and a long text is cut to what fits."""
    lb = loopback(make_spec(backend, 1, 2, timeout_s=30.0))
    att = lb.attention[0]
    inputs = [routing(6, lb.spec, seed=s) for s in (1, 2)]
    bad, good = att.dispatch(3, *inputs[0]), att.dispatch(4, *inputs[1], microbatch=1)
    for rank, endpoint in enumerate(lb.ffn):
        forward = LocalMoE.for_rank(EXPERTS, lb.spec, rank)
        for request in recv_all(endpoint, 2):
            if request.layer == 3 and rank == 1:
                endpoint.reply_error(request, "layer 3: KeyError: 'x'" + " pad" * 100_000)
            else:
                endpoint.reply(request, forward(request.x, request.topk_ids, request.topk_weights))
    with pytest.raises(FFNServeError, match=r"^FFN rank 1: layer 3: KeyError: 'x' pad") as info:
        att.combine(bad)
    assert len(str(info.value)) < 400_000
    assert torch.equal(att.combine(good), expected(lb.spec, *inputs[1]))
    again = att.dispatch(5, *inputs[0])  # both slots are free again, and answers are answers
    lb.serve(expect=1)
    assert torch.equal(att.combine(again), expected(lb.spec, *inputs[0]))


@pytest.mark.parametrize("backend", PLANE)
def test_plane_closed_ffn_fails_fast(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 1, timeout_s=30.0))
    att = lb.attention[0]
    handle = att.dispatch(0, *routing(2, lb.spec, seed=0))
    lb.ffn[0].close()
    with pytest.raises(TransportError, match="FFN rank 0 .*closed"):
        att.combine(handle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_misuse_is_reported(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 1))
    att = lb.attention[0]
    x, ids, weights = routing(2, lb.spec, seed=0)
    with pytest.raises(ValueError, match="max_tokens"):
        att.dispatch(0, *routing(lb.spec.max_tokens + 1, lb.spec, seed=0))
    with pytest.raises(ValueError, match="x must be"):
        att.dispatch(0, x.double(), ids, weights)
    handle = att.dispatch(0, x, ids, weights)
    (request,) = recv_all(lb.ffn[0], 1)
    with pytest.raises(ValueError, match="reply must be"):
        lb.ffn[0].reply(request, torch.zeros(3, lb.spec.hidden_size))
    lb.ffn[0].reply(request, request.x)
    att.combine(handle)
    with pytest.raises(ValueError, match="already combined"):
        att.combine(handle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reply_buffer_shape_and_ownership(backend: str, loopback) -> None:
    lb = loopback(make_spec(backend, 1, 1, dtype=torch.bfloat16))
    att = lb.attention[0]
    x, ids, weights = routing(5, lb.spec, seed=4)
    handle = att.dispatch(2, x, ids, weights)
    (request,) = recv_all(lb.ffn[0], 1)
    buffer = request.reply_buffer
    assert buffer.shape == (5, lb.spec.hidden_size) and buffer.dtype == torch.bfloat16
    assert buffer.data_ptr() != request.x.data_ptr()
    forward = LocalMoE.for_rank(EXPERTS, lb.spec, 0)
    out = forward(request.x, request.topk_ids, request.topk_weights, buffer)
    assert out is buffer
    lb.ffn[0].reply(request, out)
    assert torch.equal(att.combine(handle), expected(lb.spec, x, ids, weights))


@pytest.mark.parametrize("backend", PLANE)
def test_plane_reply_with_its_buffer_copies_nothing(backend: str, loopback, monkeypatch) -> None:
    lb = loopback(make_spec(backend, 1, 1))
    att = lb.attention[0]
    copies: list[torch.Tensor] = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        copies.append(self)
        return real_copy(self, src, *args, **kwargs)

    for into_buffer in (True, False):
        inputs = routing(3, lb.spec, seed=int(into_buffer))
        handle = att.dispatch(int(not into_buffer), *inputs)
        (request,) = recv_all(lb.ffn[0], 1)
        answer = request.x * 2
        if into_buffer:
            request.reply_buffer.copy_(answer)
            answer = request.reply_buffer
        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
        lb.ffn[0].reply(request, answer)
        monkeypatch.undo()
        assert len(copies) == (0 if into_buffer else 1)
        copies.clear()
        assert torch.equal(att.combine(handle), inputs[0] * 2)


@pytest.mark.parametrize("backend", PLANE)
def test_plane_superseded_request_computed_in_place_is_dropped(backend: str, loopback) -> None:
    """A late in-place answer to a timed-out request leaves the slot's next request intact."""
    lb = loopback(make_spec(backend, 1, 1, timeout_s=0.2, num_slots=1))
    att = lb.attention[0]
    first = routing(4, lb.spec, seed=1)
    handle = att.dispatch(0, *first)
    (stale,) = recv_all(lb.ffn[0], 1)
    with pytest.raises(FFNTimeout, match="did not answer"):
        att.combine(handle)
    second = routing(4, lb.spec, seed=2)
    handle = att.dispatch(1, *second)
    forward = LocalMoE.for_rank(EXPERTS, lb.spec, 0)
    out = forward(stale.x, stale.topk_ids, stale.topk_weights, stale.reply_buffer)
    lb.ffn[0].reply(stale, out)  # superseded: dropped, its value not published
    (fresh,) = recv_all(lb.ffn[0], 1)
    assert fresh.layer == 1
    out = forward(fresh.x, fresh.topk_ids, fresh.topk_weights, fresh.reply_buffer)
    lb.ffn[0].reply(fresh, out)
    assert torch.equal(att.combine(handle), expected(lb.spec, *second))
