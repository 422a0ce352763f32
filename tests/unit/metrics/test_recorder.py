"""The attention side's recorder: one block per process, following the running deployment."""

from __future__ import annotations

import json

import pytest

from tests.unit.metrics.metrics_testlib import new_addresses, our_blocks, spec_dict
from vllm_afd import envs
from vllm_afd.metrics import blocks, recorder


def test_module_recorder_follows_runtime_env(monkeypatch):
    first, second = new_addresses(2), new_addresses(2)
    monkeypatch.setenv(envs.RUNTIME, json.dumps(spec_dict(first, 2)))
    try:
        recorder.attention_block(1).record_round_trip(0, {0: 2, 1: 1}, 10, 5, 0.001)
        recorder.record_error("timeout", rank=1)
        name = blocks.attention_block_name(first, 1)
        snapshot = blocks.read_block(name)
        assert snapshot.peers == [2.0, 1.0] and snapshot.scalars[blocks._A_ERRORS] == 1.0
        # A new deployment in this process (group restarted): a new block, the old one goes.
        monkeypatch.setenv(envs.RUNTIME, json.dumps(spec_dict(second, 2)))
        recorder.attention_block(1).record_round_trip(0, [0, 4], 10, 5, 0.001)
        assert blocks.read_block(name) is None
        assert blocks.read_block(blocks.attention_block_name(second, 1)).peers == [0.0, 4.0]
        monkeypatch.delenv(envs.RUNTIME)
        assert recorder.attention_block(1) is None  # AFD not running: nothing to record into
    finally:
        recorder.close_attention_block()
    assert our_blocks(first) == [] and our_blocks(second) == []


def test_record_combine_takes_tokens_and_bytes_from_handle_and_endpoint():
    import types

    import torch

    from vllm_afd.transport import DispatchHandle, TransportSpec

    def endpoint(addresses):
        spec = TransportSpec(
            backend="shm",
            num_attention_ranks=1,
            num_ffn_ranks=2,
            num_experts=8,
            hidden_size=16,
            top_k=2,
            max_tokens=8,
            dtype=torch.bfloat16,
            addresses=addresses,
        )
        return types.SimpleNamespace(spec=spec, rank=0)

    first, second = new_addresses(2), new_addresses(2)
    ep = endpoint(first)
    handle = DispatchHandle(1, 5, 16, torch.bfloat16, {0: torch.arange(3), 1: torch.arange(2)})
    try:
        recorder.endpoint_block(ep).record_combine(handle, 0.004)
        recorder.endpoint_block(ep).record_combine(handle, 0.002)
        recorder.endpoint_block(ep).record_combine(
            DispatchHandle(1, 0, 16, torch.bfloat16, {}), 0.0
        )
        snapshot = blocks.read_block(blocks.attention_block_name(first, 0))
        assert snapshot.peers == [6.0, 4.0]
        # round trips, tokens, sent (bf16 rows + ids + weights), received, exposed seconds
        assert snapshot.scalars[:5] == [2, 10, 10 * (32 + 16), 10 * 32, pytest.approx(0.006)]
        assert snapshot.layers == {1: (2.0, pytest.approx(0.006), 10.0)}
        # A new endpoint (the FFN group restarted): its deployment's block, the old one goes.
        recorder.endpoint_block(endpoint(second)).record_combine(handle, 0.001)
        assert blocks.read_block(blocks.attention_block_name(first, 0)) is None
        assert blocks.read_block(blocks.attention_block_name(second, 0)).peers == [3.0, 2.0]
    finally:
        recorder.close_attention_block()
    assert our_blocks(first) == [] and our_blocks(second) == []


def test_error_kind():
    from vllm_afd.errors import FFNServeError, FFNTimeout, TransportError

    assert recorder.error_kind(FFNTimeout("FFN rank 0 (pid 1) did not answer")) == "timeout"
    # by type, not by words: a message that mentions a timeout is not one
    assert recorder.error_kind(TransportError("FFN rank 0: timeout_s=30, died")) == "ffn_dead"
    assert recorder.error_kind(TransportError("FFN rank 0 (pid 1) died")) == "ffn_dead"
    assert recorder.error_kind(FFNServeError("FFN rank 0: layer 1: timeout")) == "ffn_error"
    assert recorder.error_kind(TransportError("FFN rank 1: connection lost (x)")) == "ffn_dead"
    assert recorder.error_kind(ValueError("x")) == "other"
