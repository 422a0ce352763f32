"""A live scale, attention side: the hook switches to a newly published FFN pool at a step
boundary (``AttentionSession.switch_pending``), and its answers stay those of the old pool.

Real FFN ranks (reference serve loops in threads, ``LocalMoE`` experts) on every backend that
claims live scaling (the slot plane on host memory and over NIXL): pool 1 has one rank, pool
2 two (each holding half the experts). The pool is published as
``placement/scaling.py`` does (``directory.publish_pool``); the session's watcher switches an
idle rank by itself, and a rank inside a step (``STEP_LOCK`` held, as the runner holds it: W1)
switches before its next step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from vllm_afd import envs
from vllm_afd.attention import session as sessions
from vllm_afd.attention.layer import remote_experts_impl
from vllm_afd.testing.ffn import serve_ffn
from vllm_afd.testing.reference import LocalMoE, SiluMulExperts
from vllm_afd.transport import TransportSpec, create_ffn_transport, directory


class _OneRank:
    world_size, rank_in_group = 1, 0


def _wait(condition, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass
class _Counted:
    """An FFN rank's forward that counts the requests it computed."""

    inner: LocalMoE
    calls: int = 0

    def __call__(self, x, topk_ids, topk_weights, out=None):
        self.calls += 1
        return self.inner(x, topk_ids, topk_weights, out)


class _Rank:
    """A reference FFN rank (``testing.ffn.serve_ffn``) in a thread: its shm endpoint and
    forward (``LocalMoE``: pure torch, as thread-safe as separate processes)."""

    def __init__(self, spec: TransportSpec, rank: int, experts: SiluMulExperts) -> None:
        self.transport = create_ffn_transport(spec, rank)
        self.forward = _Counted(LocalMoE.for_rank(experts, spec, rank))
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=serve_ffn, args=(self.transport, self.forward, self.stop.is_set), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.transport.close()


@pytest.fixture(params=["shm", "nixl"])
def pools(request, tmp_path, monkeypatch):
    """The hook connected to pool 1 (one FFN rank); yields (session, the pools' specs, their
    ranks, inputs, layers). Pool 2 (two ranks, half the experts each) runs, not published."""
    from vllm.distributed import parallel_state

    hidden, experts, layers = 32, 8, (0, 1)
    gen = torch.Generator().manual_seed(0)
    weights = SiluMulExperts(
        torch.randn(experts, 32, hidden, generator=gen) / 4,
        torch.randn(experts, hidden, 16, generator=gen) / 4,
    )
    base = TransportSpec(
        backend=request.param,
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=experts,
        hidden_size=hidden,
        top_k=2,
        max_tokens=16,
        moe_layers=layers,
    )
    specs, ranks = [], []
    for epoch, count in ((1, 1), (2, 2)):
        (tmp_path / f"ffn{epoch}").mkdir()
        spec = dataclasses.replace(
            base,
            num_ffn_ranks=count,
            directory=str(tmp_path / f"ffn{epoch}"),
        )
        started = [_Rank(spec, r, weights) for r in range(count)]
        specs.append(
            dataclasses.replace(spec, addresses=tuple(r.transport.address for r in started))
        )
        ranks.append(started)
    monkeypatch.setenv(envs.RUNTIME, specs[0].to_json())
    for name in ("get_tp_group", "get_dp_group"):
        monkeypatch.setattr(parallel_state, name, _OneRank)
    monkeypatch.setattr(sessions, "_SESSION", None)
    session = sessions.open_session()
    x = torch.randn(6, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(6)])
    routing = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
    try:
        yield session, specs, ranks, (x, routing, ids.to(torch.int32)), layers
    finally:
        sessions.close_session()
        for started in ranks:
            for rank in started:
                rank.close()


def _served(rank: _Rank) -> int:
    return rank.forward.calls


def test_an_idle_rank_switches_to_a_new_pool_and_gets_the_same_answers(pools):
    session, specs, ranks, inputs, layers = pools
    before = remote_experts_impl(*inputs, layers[0])
    assert _wait(lambda: _served(ranks[0][0]) == 1)
    directory.publish_pool(specs[0].directory, directory.Pool(2, specs[1].to_json()))
    # no step runs: the watcher switches by itself, and says so
    assert _wait(lambda: session.epoch == 2), "the idle rank did not switch"
    # the switch is written just after the epoch changes (``AttentionSession.switch_pending``)
    assert _wait(lambda: directory.switches(specs[0].directory, range(1))[0] is not None)
    (switch,) = directory.switches(specs[0].directory, range(1))
    assert switch is not None and switch.epoch == 2 and switch.stall_s > 0
    assert session.endpoint.spec.num_ffn_ranks == 2
    after = remote_experts_impl(*inputs, layers[0])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    # the new pool's two ranks served it (each owns half the experts), the old one did not
    assert _wait(lambda: all(_served(e) == 1 for e in ranks[1]))
    assert _served(ranks[0][0]) == 1


def test_a_rank_inside_a_step_switches_before_its_next_step(pools):
    session, specs, ranks, inputs, layers = pools
    before = remote_experts_impl(*inputs, layers[0])
    with session.step(None):  # as the runner holds it for a whole step (W1)
        directory.publish_pool(specs[0].directory, directory.Pool(2, specs[1].to_json()))
        assert _wait(lambda: session.pending is not None), "the watcher did not see the pool"
        # connected ahead, outside the step: the switch only swaps endpoints
        pool, ahead = session.pending
        assert pool.epoch == 2 and len(ahead.controls) == 2
        time.sleep(3 * sessions.POOL_POLL_S)
        assert session.epoch == 1  # not in the middle of the step
        remote_experts_impl(*inputs, layers[1])
        assert session.epoch == 2  # the op's call began a new step: it switched first
        assert session.endpoint is ahead
    assert _wait(lambda: all(_served(e) == 1 for e in ranks[1]))
    assert _served(ranks[0][0]) == 1
    torch.testing.assert_close(
        remote_experts_impl(*inputs, layers[0]), before, rtol=1e-5, atol=1e-6
    )


def test_a_pool_that_cannot_be_reached_leaves_the_rank_on_its_own(pools, caplog):
    session, specs, ranks, inputs, layers = pools
    nowhere = {"shm": ("afd_nosuchsegment0", "afd_nosuchsegment1"), "nixl": ("nixl:nowhere",) * 2}
    gone = dataclasses.replace(specs[1], addresses=nowhere[specs[1].backend])
    directory.publish_pool(specs[0].directory, directory.Pool(2, gone.to_json()))
    assert _wait(lambda: session.watcher.given_up == 2)
    assert session.epoch == 1 and "cannot switch to FFN pool 2" in caplog.text
    assert directory.switches(specs[0].directory, range(1)) == [None]
    remote_experts_impl(*inputs, layers[0])  # still serves on pool 1
    assert _wait(lambda: _served(ranks[0][0]) == 1)
