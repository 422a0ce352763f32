"""Every way a server stops leaves nothing behind (issue 44): an AFD server at 1:1 (its twelve
processes: the front-end, its engine core, Ray's daemons and workers, the FFN rank) stopped as a
process manager stops it.

- SIGKILL to the whole group (a grace period run out): what it leaves, the next start on the
  host reclaims and says so in one log line;
- SIGTERM to that server's whole process group (systemd's control-group stop, ``kill --
  -PGID``): every process of the deployment ends within 30 s, Ray's daemons and the FFN rank
  included, and /dev/shm is as it was before the first server started (ours, and vLLM's
  multiprocessing queues and locks).

A SIGTERM to the server process alone, with streams in flight, at 2:1 (two engine cores):
test_server.py (``make test``).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import tempfile
import time

import pytest
from serverlib import Server, session_processes

from vllm_afd.host import LEDGER, MP_SEGMENT_PREFIXES, PRIVATE_PREFIX, SHM_DIR

pytestmark = pytest.mark.slow


def _shm() -> set[str]:
    return set(os.listdir(SHM_DIR))


def _serving(model: str, log) -> Server:
    """A 1:1 server that answered one completion."""
    server = Server(model, log, extra=("--afd-ratio", "1:1"))
    server.wait_healthy()
    status, body = server.complete("The capital of France is", 4)
    assert status == 200, body
    return server


def _stop_group(server: Server, signum: int) -> None:
    """``signum`` to the server's whole process group; every process ends within 30 s."""
    pids = [p.pid for p in session_processes(server.proc.pid)]
    assert len(pids) > 8, "the deployment's processes (Ray's, engine cores, the FFN rank)"
    started = time.monotonic()
    os.killpg(server.proc.pid, signum)
    left = server.wait_session_empty(30)
    assert not left, [(p.pid, " ".join(p.cmdline())) for p in session_processes(server.proc.pid)]
    server.proc.wait(5)
    print(
        f"{signal.Signals(signum).name} to the group: {len(pids)} processes ended in "
        f"{time.monotonic() - started:.1f}s"
    )


def _ledger_of(server: Server) -> str:
    found = glob.glob(os.path.join(tempfile.gettempdir(), f"{PRIVATE_PREFIX}{server.proc.pid}_*"))
    assert len(found) == 1, found
    return os.path.join(found[0], LEDGER)


@pytest.mark.full
def test_a_group_sigkill_is_reclaimed_by_the_next_start_and_a_group_sigterm_leaves_nothing(
    tiny_qwen3, tmp_path
):
    before = _shm()
    first = _serving(tiny_qwen3, tmp_path / "first.log")
    try:
        made = _shm() - before
        theirs = {n for n in made if n.startswith(MP_SEGMENT_PREFIXES)}
        assert theirs, f"vLLM made no multiprocessing segment: {sorted(made)}"
        ledger, deadline = _ledger_of(first), time.monotonic() + 30
        while time.monotonic() < deadline:  # the front-end's ledger names them all
            if os.path.exists(ledger) and theirs <= set(open(ledger).read().split()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the ledger does not name {sorted(theirs)}")
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        assert not first.wait_session_empty(10)
    finally:
        first.kill_leftovers()
    left = _shm() - before
    assert theirs <= left, "a SIGKILL leaves vLLM's segments: else this test shows nothing"

    second = _serving(tiny_qwen3, tmp_path / "second.log")
    try:
        lines = re.findall(r"AFD: reclaimed what killed deployments left: .*", second.tail(10**9))
        assert len(lines) == 1, lines
        reclaimed = int(re.search(r"(\d+) file\(s\) in /dev/shm", lines[0]).group(1))
        assert reclaimed >= len(left), (lines, sorted(left))  # with earlier runs' leftovers
        assert not left & _shm(), sorted(left & _shm())
        _stop_group(second, signal.SIGTERM)
        assert not _shm() - before, sorted(_shm() - before)
    finally:
        second.kill_leftovers()
