"""Ping-pong microbatching: the hand-off scheduler, alone and with a real transport.

The scheduler tests drive ``PingPong`` with fake "model forwards" that log what they do per
layer (attention, dispatch, combine), so the interleaving across microbatches is checked
exactly; then the same jobs run against a live shm FFN endpoint served by a thread. The
end-to-end tests are in tests/e2e/test_offline.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from vllm_afd.microbatch import MicrobatchAborted, PingPong, current_microbatch, overlap_point

pytestmark = pytest.mark.timeout(120)


class FakeModel:
    """``layers`` MoE layers; a dispatch is outstanding until its combine."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.log: list[tuple[str, int, int]] = []
        self.outstanding: list[int] = []
        self.max_outstanding = 0

    def forward(self, tokens: int) -> int:
        mb = current_microbatch()
        for layer in range(self.layers):
            self.log.append(("attn", mb, layer))
            self.outstanding.append(mb)
            self.max_outstanding = max(self.max_outstanding, len(self.outstanding))
            self.log.append(("dispatch", mb, layer))
            overlap_point()
            assert self.outstanding.pop(0) == mb, "combines must come back in dispatch order"
            self.log.append(("combine", mb, layer))
        return tokens


def expected_log(k: int, layers: int) -> list[tuple[str, int, int]]:
    """DBO's ping-pong: mb i's layer-L combine comes right after mb i-1's layer-L dispatch."""
    log = []
    for layer in range(layers + 1):
        for mb in range(k):
            if layer > 0:
                log.append(("combine", mb, layer - 1))
            if layer < layers:
                log += [("attn", mb, layer), ("dispatch", mb, layer)]
    return log


@pytest.fixture
def pool():
    pool = PingPong(3)
    yield pool
    pool.close()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ping_pong_order(pool: PingPong, k: int) -> None:
    model = FakeModel(layers=4)
    sizes = [3, 2, 2][:k]  # odd split: the first microbatch takes the extra token
    results = pool.run([lambda n=n: model.forward(n) for n in sizes])
    assert results == sizes
    assert model.log == expected_log(k, 4)
    assert model.max_outstanding == k


def test_zero_token_microbatch_finishes_without_yielding(pool: PingPong) -> None:
    """A microbatch that never reaches an overlap point must not stall the others."""
    model = FakeModel(layers=3)
    results = pool.run([lambda: model.forward(4), lambda: 0, lambda: model.forward(3)])
    assert results == [4, 0, 3]
    order = [(kind, mb) for kind, mb, layer in model.log if layer == 0]
    assert order == [
        ("attn", 0),
        ("dispatch", 0),
        ("attn", 2),
        ("dispatch", 2),
        ("combine", 0),
        ("combine", 2),
    ]


def test_resume_hook_runs_on_every_hand_back(pool: PingPong) -> None:
    """``resume[i]`` restores microbatch i's globals (vLLM's forward context) on its thread."""
    current = {}
    seen = []

    def job(i: int) -> None:
        for _ in range(3):
            seen.append((i, current["ctx"], threading.current_thread().name))
            overlap_point()

    resume = [lambda i=i: current.update(ctx=f"ctx{i}") for i in range(2)]
    pool.run([lambda: job(0), lambda: job(1)], resume)
    assert all(f"ctx{i}" == ctx for i, ctx, _ in seen)
    assert len({name for _, _, name in seen}) == 2


def test_error_aborts_the_others_and_pool_survives(pool: PingPong) -> None:
    aborted = []

    def waits_forever() -> None:
        try:
            while True:
                overlap_point()
        except MicrobatchAborted:
            aborted.append(True)
            raise

    def fails() -> None:
        overlap_point()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pool.run([waits_forever, fails, waits_forever])
    assert aborted == [True, True]
    model = FakeModel(layers=2)
    assert pool.run([lambda: model.forward(1), lambda: model.forward(1)]) == [1, 1]


def test_overlap_point_outside_a_step_is_a_no_op(pool: PingPong) -> None:
    overlap_point()
    assert current_microbatch() is None
    assert pool.run([current_microbatch, current_microbatch]) == [0, 1]
    with pytest.raises(ValueError):
        pool.run([lambda: None] * 4)


def test_microbatches_through_a_live_shm_transport() -> None:
    """k=3 microbatches share one attention endpoint with ``num_slots=3``; every layer's
    answer equals the dense reference, whatever order the FFN thread serves them in."""
    from vllm_afd.testing.reference import LocalMoE, ScaleExperts, reference_moe_combine
    from vllm_afd.transport import TransportSpec, create_attention_transport, create_ffn_transport
    from vllm_afd.transport.control import StepSchedule

    spec = TransportSpec(
        backend="shm",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=32,
        top_k=2,
        max_tokens=16,
        num_slots=3,
        timeout_s=10.0,
        addresses=("afdmbtest_",),
    )
    experts = ScaleExperts(torch.arange(1.0, 9.0) / 4)
    ffn = create_ffn_transport(spec, 0)
    spec = dataclasses.replace(spec, addresses=(ffn.address,))
    attention = create_attention_transport(spec, 0)
    attention.begin_step(StepSchedule(1, (5, 0, 4), (0, 1, 2, 3)))
    stop = threading.Event()

    def serve() -> None:
        forward = LocalMoE.for_rank(experts, spec, 0)
        while not stop.is_set():
            for request in ffn.recv(0.01):
                time.sleep(0.001)  # the FFN stage takes a while: microbatches pile up
                ffn.reply(request, forward(request.x, request.topk_ids, request.topk_weights))

    def microbatch(tokens: int, seed: int) -> bool:  # microbatch ``seed``
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, spec.hidden_size, generator=gen)
        for layer in range(4):
            ids = torch.rand(tokens, spec.num_experts, generator=gen).topk(2, dim=1).indices
            weights = torch.full((tokens, 2), 0.5)
            handle = attention.dispatch(layer, x, ids, weights, seed)
            overlap_point()
            out = attention.combine(handle)
            expected = reference_moe_combine(x, ids, weights, experts, spec.num_experts)
            assert torch.equal(out, expected)
            x = x + out
        return True

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    pool = PingPong(3)
    try:
        assert (
            pool.run([lambda: microbatch(5, 0), lambda: microbatch(0, 1), lambda: microbatch(4, 2)])
            == [True] * 3
        )
    finally:
        pool.close()
        stop.set()
        server.join(5)
        attention.close()
        ffn.close()
