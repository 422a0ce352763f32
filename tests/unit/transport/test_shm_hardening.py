"""The slot plane on host memory (``shm``, ``slots``) against other users and corruption: planted
files never block an FFN rank nor get attached to, header words are checked, weakly ordered
CPUs are refused."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from transport_testlib import SHM_PREFIX, expected, make_spec, recv_all, routing

from vllm_afd import host
from vllm_afd.config import AFDConfig, check_this_host
from vllm_afd.errors import AFDConfigError, FFNServeError, FFNTimeout, ProtocolError, TransportError
from vllm_afd.transport import create_attention_transport, create_ffn_transport, slot_plane_host
from vllm_afd.transport.base import DispatchHandle
from vllm_afd.transport.control_block import reap_stale_control_blocks
from vllm_afd.transport.endpoint import combine_partials
from vllm_afd.transport.slot_plane import ROWS_WORD

pytestmark = pytest.mark.timeout(60)


def _plant(name: str, mode: int = 0o644) -> str:
    path = os.path.join(host.SHM_DIR, name)
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    os.chmod(path, mode)
    return path


def test_a_planted_name_does_not_keep_the_ffn_rank_from_starting(monkeypatch):
    names = iter(["data000000000000", "planted00000000", "fresh000000000000"])
    monkeypatch.setattr(slot_plane_host.secrets, "token_hex", lambda n: next(names))
    planted = _plant(f"{SHM_PREFIX}{os.getpid()}_f0_planted00000000")
    ffn = None
    try:
        ffn = create_ffn_transport(make_spec("shm", 1, 1), 0)
        assert ffn.address.endswith("_fresh000000000000")
    finally:
        if ffn is not None:
            ffn.close()
        os.unlink(planted)


@pytest.mark.parametrize("kind", ["mode", "link", "owner"])
def test_attach_refuses_a_segment_that_is_not_ours(kind, tmp_path):
    spec = make_spec("shm", 1, 1)
    ffn = create_ffn_transport(spec, 0)
    name = f"{SHM_PREFIX}planted_{kind}"
    path = os.path.join(host.SHM_DIR, name)
    try:
        if kind == "link":  # a link to our real segment: never followed
            os.symlink(os.path.join(host.SHM_DIR, ffn.address), path)
        else:
            os.link(os.path.join(host.SHM_DIR, ffn.address), path)  # the right size and header
            if kind == "mode":
                os.chmod(path, 0o644)
            elif os.geteuid() == 0:
                os.chown(path, 65534, 65534)
            else:
                pytest.skip("changing a file's owner needs root")
        spec = spec.__class__(**{**spec.__dict__, "addresses": (name,)})
        with pytest.raises(TransportError, match="refusing"):
            create_attention_transport(spec, 0)
    finally:
        if kind == "mode":
            os.chmod(path, 0o600)  # the hard link shares the real segment's inode
        elif kind == "owner" and os.geteuid() == 0:
            os.chown(path, 0, 0)
        os.unlink(path)
        ffn.close()


def test_a_segment_s_pages_are_allocated_at_its_creation_or_the_start_fails_saying_why(
    monkeypatch,
):
    """A segment is allocated when made, so that a full ``/dev/shm`` fails the start naming
    it and what to do, not a process with a SIGBUS when it first writes a page later."""
    name, mm = slot_plane_host.create_fresh(f"{SHM_PREFIX}{os.getpid()}_alloc_", 1 << 20)
    try:
        assert os.stat(os.path.join(host.SHM_DIR, name)).st_blocks * 512 >= 1 << 20
    finally:
        mm.close()
        host.unlink_segment(name)

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host.os, "posix_fallocate", full)
    before = set(os.listdir(host.SHM_DIR))
    with pytest.raises(OSError, match=r"no room in /dev/shm for a segment of .* --shm-size"):
        create_ffn_transport(make_spec("shm", 1, 1), 0)
    assert set(os.listdir(host.SHM_DIR)) <= before  # nothing half-made left


def test_reaping_reads_only_our_own_files():
    planted = _plant(f"{SHM_PREFIX}999999_f0_dead", mode=0o644)
    try:
        assert host.read_segment_header(os.path.basename(planted), 8) is None
        assert reap_stale_control_blocks(SHM_PREFIX) == []
        assert os.path.exists(planted)
    finally:
        os.unlink(planted)


def _line(att, handle, response: bool = False):
    """The int64 words of the request line of ``handle``'s slot on FFN rank 0 (or of the
    response line in the attention rank's answer buffer for it)."""
    if response:
        return att.memory.word(att.plane.answers[0][handle.microbatch].response_line)
    return att.memory.word(att.plane.slots[0][handle.microbatch].request_line)


def test_a_corrupted_request_count_is_answered_with_an_error(loopback):
    lb = loopback(make_spec("shm", 1, 1))
    att, ffn = lb.attention[0], lb.ffn[0]
    for layer, bad in enumerate((lb.spec.max_tokens + 1, -1)):
        x, ids, weights = routing(1, lb.spec, seed=0)
        handle = att.dispatch(layer, x, ids, weights)
        _line(att, handle)[ROWS_WORD] = bad  # before the FFN rank reads it
        assert ffn.recv(0.05) == []
        with pytest.raises(FFNServeError, match=f"corrupted request header: {bad} tokens"):
            att.combine(handle)
    x, ids, weights = routing(2, lb.spec, seed=1)
    handle = att.dispatch(2, x, ids, weights)
    lb.serve(expect=1)
    assert torch.equal(att.combine(handle), expected(lb.spec, x, ids, weights))


def test_an_answer_of_another_use_is_never_taken(loopback):
    """A response flag that carries another value than the use awaited (a stale or forged
    answer) is not the answer: the combine times out rather than read the slot."""
    lb = loopback(make_spec("shm", 1, 1, timeout_s=0.3))
    att, ffn = lb.attention[0], lb.ffn[0]
    x, ids, weights = routing(1, lb.spec, seed=2)
    handle = att.dispatch(0, x, ids, weights)
    (request,) = recv_all(ffn, 1)
    value = request.reply_key[1]
    for other in (value + 1, value - 1, -(value + 1)):
        _line(att, handle, response=True)[0] = other
    with pytest.raises(FFNTimeout, match="did not answer"):
        att.combine(handle)


def test_combine_checks_the_row_count_of_every_answer():
    handle = DispatchHandle(
        layer=4,
        num_tokens=1,
        hidden_size=2,
        dtype=torch.float32,
        token_index={0: torch.tensor([0])},
    )
    with pytest.raises(ProtocolError, match="FFN rank 0 answered 3 rows for the 1 token"):
        combine_partials(handle, {0: torch.zeros(3, 2)})


def test_weakly_ordered_cpus_refuse_shm(monkeypatch):
    monkeypatch.setattr(host, "STORE_ORDER_TSO", False)
    monkeypatch.setattr(host.platform, "machine", lambda: "aarch64")
    with pytest.raises(AFDConfigError, match=r"--afd-transport .*aarch64.*--afd-transport nixl"):
        check_this_host(AFDConfig(ratio=(1, 1), transport="shm"))
    check_this_host(AFDConfig(ratio=(1, 1), transport="nixl"))
    from vllm_afd.transport import auto_backend

    assert auto_backend("cpu", "cpu") == "nixl"  # the default, auto, takes nixl there
    with pytest.raises(RuntimeError, match="use --afd-transport nixl"):
        create_ffn_transport(make_spec("shm", 1, 1), 0)


_KILLED_OWNER = """
import os, signal, sys
from vllm_afd.transport.slot_plane_host import HostPlaneMemory
memory = HostPlaneMemory(prefix=sys.argv[1])
for _ in range(2):
    memory.create(4096)
print(" ".join(sorted(os.listdir("/dev/shm"))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_segments_of_a_killed_owner_go_with_its_process_family():
    """vLLM force-kills its engine cores as it stops: the answer buffers an attention rank
    created are unlinked by Python's resource tracker once the killed owner's family exited."""
    import subprocess
    import sys
    import time

    prefix = f"{SHM_PREFIX}killed_"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_OWNER, prefix], capture_output=True, text=True, timeout=60
    )
    made = {name for name in child.stdout.split() if name.startswith(prefix)}
    assert child.returncode == -9 and len(made) == 2, child.stderr
    deadline = time.monotonic() + 20
    while made & set(os.listdir(host.SHM_DIR)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not made & set(os.listdir(host.SHM_DIR))
