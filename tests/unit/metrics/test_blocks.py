"""Stats blocks: counters shared across processes, and who unlinks a block when."""

from __future__ import annotations

import pytest

from tests.unit.metrics.metrics_testlib import (
    new_addresses,
    our_blocks,
    scrape,
    spec_dict,
    start_writer,
    stop,
    value,
)
from vllm_afd.metrics import blocks


def test_counters_cross_processes_and_writer_unlinks(ctx):
    addresses = new_addresses(2)
    proc, done = start_writer(ctx, addresses)
    try:
        ffn = blocks.read_block(blocks.ffn_block_name(addresses[0], 0))
        attn = blocks.read_block(blocks.attention_block_name(addresses, 1))
        assert ffn is not None and attn is not None
        assert (ffn.role, ffn.rank, ffn.pid) == (blocks.ROLE_FFN, 0, proc.pid)
        assert ffn.alive() and not ffn.closed
        assert ffn.scalars[:5] == [4.0, 20.0, 2000.0, 1600.0, pytest.approx(3.0023)]
        assert ffn.layers == {0: (1.0, 0.002, 10.0), 1: (2.0, pytest.approx(3.0003), 10.0)}
        assert sum(ffn.hist) == 3 and ffn.hist[-1] == 1  # 3 s is above every bound
        assert (attn.role, attn.rank) == (blocks.ROLE_ATTENTION, 1)
        assert attn.peers == [5.0, 5.0]
        assert attn.scalars[:9] == [2.0, 10.0, 900.0, 400.0, pytest.approx(0.0201), 1, 2, 0, 1]
        assert set(attn.layers) == {1, 5}
    finally:
        done.set()
        stop(proc)
    assert proc.exitcode == 0
    assert our_blocks(addresses) == []


def test_front_end_unlinks_blocks_of_live_writers(ctx):
    addresses = new_addresses(1)
    spec = spec_dict(addresses, num_attention=2)
    proc, done = start_writer(ctx, addresses)
    try:
        assert len(our_blocks(addresses)) == 2
        unlinked = blocks.unlink_deployment_blocks(spec)
        assert len(unlinked) == 2 and our_blocks(addresses) == []
        assert value(scrape(spec), "vllm_afd_ffn_rank_alive", ffn_rank=0) == 0.0
    finally:
        done.set()
        stop(proc)
    assert proc.exitcode == 0  # the writer's own unlink finds nothing and does not fail


def test_close_marks_closed_and_unlinks():
    addresses = new_addresses(1)
    block = blocks.FFNStatsBlock(addresses[0], 0, layers=[3])
    snapshot = blocks.read_block(block.name)
    assert snapshot is not None and snapshot.alive() and snapshot.layers == {3: (0, 0, 0)}
    block.close()
    block.close()  # idempotent
    assert blocks.read_block(block.name) is None
    block.record_layer(3, 1, 1, 1, 1, 0.1)  # a late record after close does not fail


def test_calls_alike_recorded_at_once_count_each():
    """An FFN rank serving whole steps takes several steps of one shape at once
    (``FFNExecutor._account_steps``): ``calls`` calls of a layer, each in the histogram's
    bucket of the mean call."""
    addresses = new_addresses(1)
    block = blocks.FFNStatsBlock(addresses[0], 0, layers=[2])
    try:
        block.record_layer(2, 6, 48, 4800, 4000, 0.003, calls=3)  # three calls of 1 ms
        block.record_layer(2, 2, 16, 1600, 1300, 3.0)  # one of 3 s
        snapshot = blocks.read_block(block.name)
        assert snapshot is not None
        assert snapshot.layers == {2: (4.0, pytest.approx(3.003), 64.0)}
        assert sum(snapshot.hist) == 4 and snapshot.hist[-1] == 1
        bucket = snapshot.hist.index(3)  # the 1 ms calls' bucket, not the 3 ms one
        assert block._bounds[bucket] >= 0.001 and (bucket == 0 or block._bounds[bucket - 1] < 0.001)
    finally:
        block.close()
