"""What a killed deployment leaves in ``/dev/shm`` besides our own segments: vLLM's
multiprocessing queues and locks (``psm_*``, ``sem.mp-*``), which Python's resource tracker
unlinks unless it is killed with them. The front-end records the ones its processes map
(``health.SegmentLedger``); the next start reclaims those that no live process maps
(``host.reap_private_dirs``), and nothing else."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from multiprocessing import shared_memory

import pytest

from vllm_afd.host import LEDGER, PRIVATE_PREFIX, SHM_DIR, reap_private_dirs
from vllm_afd.placement.health import SegmentLedger, reap_dead_deployments


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return tmp_path


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def _segment(name: str) -> str:
    """A file in /dev/shm named like multiprocessing's, mapped by no process."""
    with open(os.path.join(SHM_DIR, name), "xb") as f:
        f.write(b"\0" * 64)
    return name


def _hold_a_segment(names, stop) -> None:
    """A child of the front-end (an engine core): maps a queue of its own until told."""
    shm = shared_memory.SharedMemory(create=True, size=4096)
    names.put(shm.name)
    stop.wait(60)
    shm.close()
    shm.unlink()


def test_the_ledger_records_what_this_process_and_its_children_map(tmp_path):
    ctx = multiprocessing.get_context("fork")
    names, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_hold_a_segment, args=(names, stop))
    child.start()
    mine = shared_memory.SharedMemory(create=True, size=4096)
    lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, as vLLM's
    semaphore = "sem." + lock._semlock.name.lstrip("/")
    ledger = SegmentLedger(str(tmp_path), interval_s=3600)  # looked at by hand
    try:
        theirs = names.get(timeout=30)
        assert theirs != mine.name
        assert {mine.name, theirs, semaphore} <= ledger.record()
        listed = (tmp_path / LEDGER).read_text().split()
        assert {mine.name, theirs} <= set(listed) and len(set(listed)) == len(listed)
        assert (tmp_path / LEDGER).stat().st_mode & 0o777 == 0o600
        later = shared_memory.SharedMemory(create=True, size=4096)
        try:
            assert later.name in ledger.record()
            listed = (tmp_path / LEDGER).read_text().split()
            assert later.name in listed and listed.count(mine.name) == 1
        finally:
            later.close()
            later.unlink()
    finally:
        ledger.stop()
        stop.set()
        child.join(10)
        mine.close()
        mine.unlink()


def test_a_dead_front_ends_ledger_is_reclaimed_and_nothing_else(tmpdir_env):
    """Of what the dead front-end's ledger names, only its own unmapped multiprocessing files
    go: a file a live process maps stays, a name of another form is never followed, a file the
    ledger does not name stays, and so does a live front-end's ledger."""
    token = os.urandom(4).hex()
    dead = tmpdir_env / f"{PRIVATE_PREFIX}{_dead_pid()}_abc"
    dead.mkdir(mode=0o700)
    left = [_segment(f"psm_{token}a"), _segment(f"sem.mp-{token}b")]
    mapped = shared_memory.SharedMemory(create=True, size=4096)  # a live process maps it
    unnamed = _segment(f"psm_{token}c")  # no ledger names it
    outside = tmpdir_env / "victim"
    outside.write_text("x")
    ledger = [*left, mapped.name, f"psm_{token}gone", "../../" + str(outside), "/etc/passwd"]
    (dead / LEDGER).write_text("\n".join(ledger) + "\n")
    os.chmod(dead / LEDGER, 0o600)
    live = tmpdir_env / f"{PRIVATE_PREFIX}{os.getpid()}_def"
    live.mkdir(mode=0o700)
    kept = _segment(f"psm_{token}d")
    (live / LEDGER).write_text(kept + "\n")
    os.chmod(live / LEDGER, 0o600)
    try:
        dirs, segments = reap_private_dirs()
        assert dirs == [str(dead)] and sorted(segments) == sorted(left)
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in left)
        for name in (mapped.name, unnamed, kept):
            assert os.path.exists(os.path.join(SHM_DIR, name)), name
        assert outside.exists() and live.exists()
    finally:
        mapped.close()
        mapped.unlink()
        for name in (unnamed, kept, *left):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def test_the_start_says_what_it_reclaimed_in_one_line(tmpdir_env, caplog, monkeypatch):
    from vllm_afd.placement import health

    # the host's own dead segments of ours (header-checked reapers) are not this test's
    monkeypatch.setattr(health, "reap_dead_segments", lambda: ["vllm_afd_plane_x"])
    dead = tmpdir_env / f"{PRIVATE_PREFIX}{_dead_pid()}_abc"
    dead.mkdir(mode=0o700)
    name = _segment(f"psm_{os.urandom(4).hex()}")
    (dead / LEDGER).write_text(name + "\n")
    os.chmod(dead / LEDGER, 0o600)
    with caplog.at_level("INFO", logger="vllm.afd"):
        removed = reap_dead_deployments()
    assert name in removed and str(dead) in removed
    lines = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
    assert len(lines) == 1 and "2 file(s) in /dev/shm" in lines[0], lines
    assert "1 private directory" in lines[0]


def test_one_ledger_per_front_end_whether_it_started_or_joined_its_group(tmp_path):
    """``keep_ledger`` (a start and a join both call it) keeps one ledger; ``drop_ledger``
    (the stop) ends it."""
    from vllm_afd.placement import health

    health.keep_ledger(str(tmp_path))
    try:
        first = health._LEDGER
        health.keep_ledger(str(tmp_path / "other"))
        assert health._LEDGER is first and first.path == str(tmp_path / LEDGER)
        assert first._thread.is_alive()
    finally:
        health.drop_ledger()
    assert health._LEDGER is None and not first._thread.is_alive()
    health.drop_ledger()  # idempotent
