"""Stats blocks against other users of the host: the names are derived (guessable), so a
planted file must neither be read (spoofed counters, a large sparse file read at every scrape)
nor keep a rank from serving, and dead writers' blocks are reaped."""

from __future__ import annotations

import os

import pytest

from tests.unit.metrics.metrics_testlib import new_addresses
from vllm_afd.host import SHM_DIR, UnsafeFileError
from vllm_afd.metrics import blocks


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def test_reader_refuses_files_that_are_not_our_blocks():
    addresses = new_addresses(1)
    block = blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    try:
        assert blocks.read_block(block.name) is not None
        os.chmod(_path(block.name), 0o644)  # e.g. another user's copy: not 0600
        assert blocks.read_block(block.name) is None
        os.chmod(_path(block.name), 0o600)
        if os.geteuid() == 0:
            os.chown(_path(block.name), 65534, 65534)
            assert blocks.read_block(block.name) is None
            os.chown(_path(block.name), 0, 0)
        link = f"{blocks.PREFIX}link_{os.getpid()}"
        os.symlink(_path(block.name), _path(link))
        try:
            assert blocks.read_block(link) is None  # never followed
        finally:
            os.unlink(_path(link))
        os.truncate(_path(block.name), 1 << 30)  # sparse: its size no longer fits its header
        assert blocks.read_block(block.name) is None
    finally:
        block.close()


def test_a_forged_header_cannot_make_a_reader_allocate():
    name = f"{blocks.PREFIX}forged_{os.getpid()}"
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        header = [0] * 16
        header[0], header[1] = blocks._MAGIC, blocks._VERSION
        header[8], header[9], header[10] = 1 << 40, 0, len(blocks.BUCKETS)  # 2^40 layers
        os.write(fd, b"".join(v.to_bytes(8, "little", signed=True) for v in header))
        os.ftruncate(fd, 1 << 30)
        assert blocks.read_block(name) is None
    finally:
        os.close(fd)
        os.unlink(_path(name))


def test_a_planted_block_name_disables_metrics_only(monkeypatch):
    """Another user's file under the name: the writer refuses it (the FFN rank then serves
    without metrics, ``ffn.executor._open_stats_block``), it never adopts or reads it."""
    addresses = new_addresses(1)
    name = blocks.ffn_block_name(addresses[0], 0)
    with open(_path(name), "wb") as fh:
        fh.write(b"\0" * 128)
    os.chmod(_path(name), 0o644)
    try:
        with pytest.raises(UnsafeFileError, match="not this user's"):
            blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    finally:
        os.unlink(_path(name))


def test_a_stale_block_of_ours_under_the_name_is_reaped_and_replaced(monkeypatch):
    addresses = new_addresses(1)
    stale = blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    stale._finalizer.detach()  # as if SIGKILLed: the file stays
    words = memoryview(stale._mm).cast("q")
    words[blocks._H_PID] = 2**22 + 12345  # no such process
    monkeypatch.setattr(blocks, "reap_stale_blocks", lambda: [])  # a race: not reaped before
    block = blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    try:
        snapshot = blocks.read_block(block.name)
        assert snapshot is not None and snapshot.pid == os.getpid()
    finally:
        block.close()
        words.release()


def test_reaping_covers_dead_writers_blocks():
    addresses = new_addresses(1)
    stale = blocks.FFNStatsBlock(addresses[0], 0, layers=[0])
    stale._finalizer.detach()
    words = memoryview(stale._mm).cast("q")
    words[blocks._H_PID] = 2**22 + 12345
    words.release()
    assert stale.name in blocks.reap_stale_blocks()
    assert not os.path.exists(_path(stale.name))
