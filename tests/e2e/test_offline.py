"""AFD through the offline ``LLM`` API: greedy outputs token-identical to colocated (float32).

Each configuration runs in a fresh process (``vllm_afd.bench.offline_run``), with chunked
prefill and prefix caching on, prompts of different lengths (one longer than the chunk size,
two sharing a long prefix) submitted together, and the default two ping-pong microbatches.
``make test`` runs 1:1 and 1:2 (shared experts); ``make test-all`` adds tensor-parallel
attention ranks (on the slot plane), FFN ranks bound to CPUs, the slot plane over NIXL and a
backend named by module path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_afd.bench.offline_run import run_generation

pytestmark = pytest.mark.slow

SHARED = "In a distributed serving system the attention layers keep the KV cache while " * 3
PROMPTS = [
    "hello world",
    SHARED + "the experts",
    SHARED + "the router",
    "def f(x):\n    return x * 2\n" * 12,  # longer than the 64-token prefill chunk
    "1 2 3",
]


MAX_TOKENS = 24


def _job(model: str, afd: dict | None, tp: int = 1) -> dict:
    return {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "afd": afd,
        "tensor_parallel_size": tp,
        "max_num_batched_tokens": 64,
    }


@pytest.fixture(scope="module")
def qwen3_runs(tiny_qwen3, run_pair) -> tuple[dict, dict]:
    """Colocated and AFD 1:1 at the defaults (two microbatches); AFD with a ``VLLM_AFD_*``
    variable set and vLLM's ``fail_on_environ_validation`` (patch E1 declares ours)."""
    afd = _job(tiny_qwen3, {"ratio": "1:1"}) | {
        "env": {"VLLM_AFD_POLL_MS": "20"},  # the default, set
        "engine_args": {"fail_on_environ_validation": True},
    }
    return run_pair(_job(tiny_qwen3, None), afd)


@pytest.fixture(scope="module")
def colocated_qwen3(qwen3_runs):
    return qwen3_runs[0]


@pytest.fixture(scope="module")
def afd_qwen3(qwen3_runs):
    return qwen3_runs[1]


def _assert_same_tokens(afd: dict, colocated: dict) -> None:
    assert len(afd["token_ids"]) == len(PROMPTS)
    for i, (a, c) in enumerate(zip(afd["token_ids"], colocated["token_ids"], strict=True)):
        assert a == c, f"prompt {i}: AFD {a} != colocated {c}"


def test_afd_1_1_matches_colocated_and_splits_weights(afd_qwen3, colocated_qwen3):
    result = afd_qwen3
    _assert_same_tokens(result, colocated_qwen3)
    # The split: the attention rank holds no routed-expert bytes, the FFN rank holds all of them.
    (ffn,) = result["ffn"]
    assert ffn["experts"] == [0, 8]
    expert_bytes = 2 * 8 * 3 * 128 * 64 * 4  # layers * experts * (gate, up, down) * H * I * fp32
    assert ffn["param_bytes"] == expert_bytes
    assert (
        result["attention_param_bytes"] == colocated_qwen3["attention_param_bytes"] - expert_bytes
    )
    # The FFN rank served every layer of every step, prefill chunks included.
    assert set(ffn["per_layer_calls"]) == {"0", "1"}
    assert ffn["tokens"] >= sum(len(t) for t in result["token_ids"])


def test_decode_steps_are_split_into_two_microbatches(afd_qwen3):
    """Each of the MAX_TOKENS - 1 decode steps of the five sequences sent two requests per MoE
    layer (one microbatch sends one, plus a handful of prefill chunks)."""
    (ffn,) = afd_qwen3["ffn"]
    num_layers = len(ffn["per_layer_calls"])
    assert ffn["requests"] >= num_layers * 2 * (MAX_TOKENS - 1)
    assert ffn["later_microbatch_requests"] >= num_layers * (MAX_TOKENS - 1)


@pytest.mark.full
def test_afd_2_1_two_tp_attention_ranks_on_the_slot_plane(tiny_qwen3, colocated_qwen3, afd_qwen3):
    """The slots transport: every step's schedule announces each TP rank's share of rows, and
    the FFN rank serves both ranks' rows of each layer and microbatch in one batch."""
    result = run_generation(_job(tiny_qwen3, {"ratio": "2:1", "transport": "slots"}, tp=2))
    _assert_same_tokens(result, colocated_qwen3)
    assert len(result["ffn"]) == 1
    # Two attention ranks: each holds its tensor-parallel shard of the attention-side weights
    # and sends the FFN rank its share of every step's rows (``remote_experts_impl``), so each
    # token reaches the FFN exactly once, as at TP1.
    assert result["attention_param_bytes"] < 0.75 * afd_qwen3["attention_param_bytes"]
    (ffn,), (ffn_tp1,) = result["ffn"], afd_qwen3["ffn"]
    by_source = {int(rank): n for rank, n in ffn["requests_by_source"].items()}  # JSON keys
    assert sorted(by_source) == [0, 1], by_source
    assert by_source[1] >= len(ffn["per_layer_calls"]) * (MAX_TOKENS - 1), by_source
    assert ffn["tokens"] == ffn_tp1["tokens"], (ffn, ffn_tp1)


@pytest.mark.full
def test_afd_1_2_mixtral_two_ffn_ranks_bound_to_their_cpus(tiny_mixtral, run_pair):
    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    job = _job(tiny_mixtral, {"ratio": "1:2"}) | {"env": {"VLLM_AFD_FFN_CPUS": f"{first}|{last}"}}
    colocated, result = run_pair(_job(tiny_mixtral, None), job)
    _assert_same_tokens(result, colocated)
    assert [f["experts"] for f in result["ffn"]] == [[0, 4], [4, 8]]
    assert all(f["tokens"] > 0 for f in result["ffn"])
    assert [f["cpus"] for f in result["ffn"]] == [[first], [last]]


@pytest.mark.full
def test_nixl_and_an_out_of_tree_backend_match_colocated(
    tiny_qwen3, colocated_qwen3, run_pair, tmp_path
):
    """The slot plane over NIXL on one host, and a backend written in one test file
    (``counting_backend.py``) named by module path, which no product module knows, with a
    setting of its own (``--afd-transport-config``): every combine and every FFN reply went
    through it."""
    root = str(Path(__file__).parents[2])
    counting = {
        "ratio": "1:1",
        "transport": "tests.e2e.counting_backend:CountingShm",
        "transport_config": {"counts_dir": str(tmp_path)},
    }
    env = {"PYTHONPATH": root}
    nixl, custom = run_pair(
        _job(tiny_qwen3, {"ratio": "1:1", "transport": "nixl"}),
        _job(tiny_qwen3, counting) | {"env": env},
    )
    _assert_same_tokens(nixl, colocated_qwen3)
    assert nixl["ffn"][0]["address"].startswith("nixl:")
    _assert_same_tokens(custom, colocated_qwen3)
    (ffn,) = custom["ffn"]
    replies = int((tmp_path / "ffn0").read_text())
    combines = int((tmp_path / "attention0").read_text())
    assert replies == ffn["requests"] > 0, (replies, ffn)
    assert combines >= replies, (combines, replies)


def test_afd_1_2_qwen2_moe_shared_experts_with_microbatches(tiny_qwen2_moe, run_pair):
    """A gated shared expert on the attention side while two microbatches (the default)
    interleave at the routing boundary: each keeps its own shared-expert output (M7)."""
    colocated, result = run_pair(_job(tiny_qwen2_moe, None), _job(tiny_qwen2_moe, {"ratio": "1:2"}))
    _assert_same_tokens(result, colocated)
    assert [f["experts"] for f in result["ffn"]] == [[0, 4], [4, 8]]
    assert all(f["tokens"] > 0 and f["later_microbatch_requests"] > 0 for f in result["ffn"])
