"""Every backend whose FFN side serves requests as they come (the slot plane on host memory:
``shm`` is the same endpoints as ``slots`` there; over NIXL), every FFN rank in its own process.

Checks the results against the single-process reference (exactly for row-wise experts, to float32
rounding for gated-MLP experts), T = 0 and T = max_tokens, two outstanding microbatches, and the
failure paths: an FFN process killed while combine waits, and an FFN rank that stays silent.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transport_testlib import attach_and_exit, leftover_segments, make_spec, routing

from vllm_afd.errors import FFNTimeout, TransportError
from vllm_afd.testing.ffn import DelayedForward
from vllm_afd.testing.reference import (
    LocalMoE,
    ScaleExperts,
    SiluMulExperts,
    reference_moe_combine,
)

pytestmark = pytest.mark.timeout(60)
BACKENDS = ["slots", "nixl", "counting"]
SCALES = ScaleExperts(torch.arange(1.0, 9.0) / 4)


def local_forwards(experts, spec) -> list[LocalMoE]:
    return [LocalMoE.for_rank(experts, spec, f) for f in range(spec.num_ffn_ranks)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_attention", "num_ffn"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_matches_reference_exactly(backend: str, num_attention: int, num_ffn: int, start_ffn):
    spec = make_spec(backend, num_attention, num_ffn, dtype=torch.bfloat16)
    cluster = start_ffn(spec, local_forwards(SCALES, spec))
    ranks = [cluster.connect(a) for a in range(num_attention)]
    for step, num_tokens in enumerate([1, 0, spec.max_tokens, 7]):
        inputs = [routing(num_tokens, spec, seed=10 * step + a) for a in range(num_attention)]
        handles = [att.dispatch(step, *inputs[a]) for a, att in enumerate(ranks)]
        for a, att in enumerate(ranks):
            out = att.combine(handles[a])
            ref = reference_moe_combine(*inputs[a], SCALES, spec.num_experts, num_ffn)
            assert out.shape == (num_tokens, spec.hidden_size) and out.dtype == spec.dtype
            assert torch.equal(out, ref), f"attention rank {a}, T={num_tokens}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_mlp_experts_and_two_microbatches(backend: str, start_ffn) -> None:
    spec = make_spec(backend, 2, 2)
    gen = torch.Generator().manual_seed(0)
    experts = SiluMulExperts(
        torch.randn(8, 2 * 16, 32, generator=gen) / 6, torch.randn(8, 32, 16, generator=gen) / 4
    )
    cluster = start_ffn(spec, local_forwards(experts, spec))
    ranks = [cluster.connect(a) for a in range(2)]
    keys = [(a, mb) for a in range(2) for mb in (0, 1)]  # (attention rank, microbatch)
    inputs = {(a, mb): routing(5 + 20 * mb, spec, seed=2 * a + mb) for a, mb in keys}
    handles = {key: ranks[key[0]].dispatch(3, *inputs[key], key[1]) for key in inputs}
    for key in [(0, 1), (1, 1), (0, 0), (1, 0)]:  # second microbatch first
        out = ranks[key[0]].combine(handles[key])
        ref = reference_moe_combine(*inputs[key], experts, spec.num_experts, spec.num_ffn_ranks)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_ffn_rank_fails_combine_promptly(backend: str, start_ffn) -> None:
    spec = make_spec(backend, 1, 2, timeout_s=30.0)
    slow = [DelayedForward(f, delay_s=30.0) for f in local_forwards(SCALES, spec)]
    cluster = start_ffn(spec, slow)
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(8, spec, seed=0))
    assert set(handle.token_index) == {0, 1}
    threading.Timer(0.3, cluster.kill, args=(1,)).start()
    start = time.monotonic()
    with pytest.raises(TransportError, match="FFN rank 1"):
        att.combine(handle)  # waits for rank 0 first: rank 1's death must still be seen
    elapsed = time.monotonic() - start
    assert 0.25 < elapsed < 5.0, elapsed
    cluster.kill(0)  # still sleeping in its forward


@pytest.mark.parametrize("backend", BACKENDS)
def test_silent_ffn_rank_times_out(backend: str, start_ffn) -> None:
    spec = make_spec(backend, 1, 1, timeout_s=0.5)
    cluster = start_ffn(spec, [DelayedForward(local_forwards(SCALES, spec)[0], delay_s=3.0)])
    att = cluster.connect(0)
    handle = att.dispatch(0, *routing(2, spec, seed=0))
    start = time.monotonic()
    with pytest.raises(FFNTimeout, match="did not answer within timeout_s=0.5"):
        att.combine(handle)
    assert 0.45 < time.monotonic() - start < 2.5
    cluster.kill(0)  # still sleeping in its forward


def test_a_killed_plane_ffn_rank_s_segments_are_reaped(start_ffn) -> None:
    spec = make_spec("shm", 1, 1)
    cluster = start_ffn(spec, local_forwards(SCALES, spec))
    assert len(leftover_segments()) == 2  # its control block and its data buffer
    cluster.kill(0)
    cluster.procs[0].join(5)
    cluster.close()  # reaps segments whose creator is dead
    assert leftover_segments() == []


def test_a_plane_attacher_s_exit_keeps_the_segments(start_ffn, mp_ctx) -> None:
    spec = make_spec("shm", 1, 1)
    cluster = start_ffn(spec, local_forwards(SCALES, spec))
    child = mp_ctx.Process(target=attach_and_exit, args=(cluster.spec,))
    child.start()
    child.join(10)
    assert child.exitcode == 0
    assert len(leftover_segments()) == 2  # the attacher's exit did not unlink them
    att = cluster.connect(0)
    inputs = routing(3, spec, seed=0)
    out = att.combine(att.dispatch(0, *inputs))
    assert torch.equal(out, reference_moe_combine(*inputs, SCALES, spec.num_experts))
