"""Pure functions: token split per FFN rank, combine of partials, staged waiting, the reference
itself."""

from __future__ import annotations

import pytest
import torch
from transport_testlib import make_spec, routing

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError
from vllm_afd.testing.reference import (
    LocalMoE,
    ScaleExperts,
    SiluMulExperts,
    reference_moe_combine,
)
from vllm_afd.transport import DispatchHandle, TransportSpec, wait
from vllm_afd.transport.endpoint import combine_partials, split_by_ffn_rank
from vllm_afd.transport.wait import Backoff, WaitPolicy


def test_split_contiguous_placement() -> None:
    spec = make_spec("shm", 1, 4)  # 8 experts, 2 per FFN rank
    topk_ids = torch.tensor([[0, 1], [2, 7], [6, 7], [1, 4]])
    split = split_by_ffn_rank(spec, topk_ids)
    assert list(split) == [0, 1, 2, 3]
    assert split[0].tolist() == [0, 3]
    assert split[1].tolist() == [1]
    assert split[2].tolist() == [3]
    assert split[3].tolist() == [1, 2]
    assert all(rows.dtype == torch.int64 for rows in split.values())


def test_split_skips_idle_ranks_and_empty_batch() -> None:
    spec = make_spec("shm", 1, 2)
    assert list(split_by_ffn_rank(spec, torch.tensor([[0, 3], [1, 2]]))) == [0]
    assert split_by_ffn_rank(spec, torch.empty(0, 2, dtype=torch.int64)) == {}
    assert split_by_ffn_rank(make_spec("shm", 1, 1), torch.tensor([[5, 6]]))[0].tolist() == [0]


def test_combine_partials_sums_in_original_order() -> None:
    rows = {0: torch.tensor([0, 2]), 1: torch.tensor([1, 2])}
    handle = DispatchHandle(0, 3, 2, torch.float32, rows)
    partials = {0: torch.tensor([[1.0, 1.0], [3.0, 3.0]]), 1: torch.tensor([[2.0, 2], [4, 4]])}
    out = combine_partials(handle, partials)
    assert out.tolist() == [[1, 1], [2, 2], [7, 7]]


def test_combine_partials_empty() -> None:
    handle = DispatchHandle(0, 0, 16, torch.bfloat16, {})
    out = combine_partials(handle, {})
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("num_ffn", [1, 2, 4])
def test_reference_equals_per_token_definition(num_ffn: int) -> None:
    spec = make_spec("shm", 1, num_ffn)
    x, ids, weights = routing(6, spec, seed=1)
    experts = SiluMulExperts(torch.randn(8, 16, 32) / 6, torch.randn(8, 32, 8) / 3)
    out = reference_moe_combine(x, ids, weights, experts, 8, num_ffn)
    for t in range(6):
        row = sum(weights[t, k] * experts(int(ids[t, k]), x[t : t + 1])[0] for k in range(2))
        torch.testing.assert_close(out[t], row, rtol=1e-5, atol=1e-6)


def test_local_moe_masks_non_local_experts() -> None:
    spec = make_spec("shm", 1, 2)
    experts = ScaleExperts(torch.arange(1.0, 9.0))
    local = LocalMoE.for_rank(experts, spec, rank=1)  # experts 4..7
    x = torch.ones(2, 32)
    ids = torch.tensor([[0, 5], [1, 2]], dtype=torch.int32)
    out = local(x, ids, torch.tensor([[0.5, 0.5]] * 2))
    assert out[0].unique().tolist() == [0.5 * 6.0]
    assert out[1].abs().sum() == 0


def poll_ms(monkeypatch, text: str | None) -> float:
    """``envs.VLLM_AFD_POLL_MS`` with the variable set to ``text`` (``None``: unset)."""
    if text is None:
        monkeypatch.delenv(envs.POLL_MS, raising=False)
    else:
        monkeypatch.setenv(envs.POLL_MS, text)
    return envs.VLLM_AFD_POLL_MS


def test_poll_window_comes_from_the_environment(monkeypatch) -> None:
    assert poll_ms(monkeypatch, None) == poll_ms(monkeypatch, " ") == envs.DEFAULT_POLL_MS
    assert poll_ms(monkeypatch, "5") == pytest.approx(5.0) and poll_ms(monkeypatch, "0") == 0.0
    for bad in ("fast", "-1", "inf", "nan"):
        with pytest.raises(AFDConfigError, match=f"{envs.POLL_MS}={bad!r}.*>= 0"):
            poll_ms(monkeypatch, bad)
    monkeypatch.setenv(envs.POLL_MS, "7.5")
    assert WaitPolicy().yield_s == pytest.approx(7.5e-3)  # read when a policy is made


def test_backoff_polls_through_the_window_then_sleeps_doubling(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(wait.time, "sleep", slept.append)
    polling = Backoff(WaitPolicy(spin_s=0.0, yield_s=3600.0))
    for _ in range(100):
        polling.pause()
    assert slept == []  # inside the poll window: never asleep
    idle = Backoff(WaitPolicy(spin_s=0.0, yield_s=0.0, sleep_min_s=1e-4, sleep_max_s=3e-4))
    for _ in range(4):
        idle.pause()
    assert slept == [1e-4, 2e-4, 3e-4, 3e-4]
    idle.reset()
    idle.pause()
    assert slept[-1] == 1e-4  # a new wait starts from the shortest sleep again


def test_a_wait_past_its_idle_second_naps_longer(monkeypatch) -> None:
    """An idle endpoint (no request for ``idle_s``) sleeps up to ``idle_sleep_s`` at a time,
    not ``sleep_max_s``: it keeps a fraction of the CPU an idle pool would burn."""
    slept: list[float] = []
    now = [0.0]
    monkeypatch.setattr(wait.time, "sleep", slept.append)
    monkeypatch.setattr(wait.time, "perf_counter", lambda: now[0])
    policy = WaitPolicy(spin_s=0.0, yield_s=0.0, sleep_min_s=1e-4, sleep_max_s=2e-4)
    backoff = Backoff(policy)
    for _ in range(3):
        backoff.pause()
    assert slept == [1e-4, 2e-4, 2e-4]  # within the idle second: naps of at most 200 us
    now[0] = policy.idle_s
    for _ in range(6):
        backoff.pause()
    assert slept[3:] == [2e-4, 4e-4, 8e-4, 1e-3, 1e-3, 1e-3]
    backoff.reset()  # a request came: the next wait naps short again
    backoff.pause()
    assert slept[-1] == 1e-4


def test_spec_json_round_trip_and_expert_ranges() -> None:
    spec = make_spec("shm", 2, 4, dtype=torch.bfloat16, moe_layers=(1, 3, 5))
    back = TransportSpec.from_json(spec.to_json())
    assert back == spec and isinstance(back.moe_layers, tuple)
    assert [spec.expert_range(f) for f in range(4)] == [range(2 * f, 2 * f + 2) for f in range(4)]
    assert spec.ffn_rank_table.tolist() == [e // 2 for e in range(spec.num_experts)]
    assert all(e in spec.expert_range(int(spec.ffn_rank_table[e])) for e in range(8))
