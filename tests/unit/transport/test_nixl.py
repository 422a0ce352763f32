"""The slot plane over NIXL (``transport/nixl.py``) where it differs from shared memory: a peer's
buffer is a mirror whose stores travel as NIXL notifications (payloads inline) or WRITEs the
notification follows (large payloads), the owner storing each line's flag last; UCX listens on
loopback unless told otherwise; addresses and handles that are not ours are refused by name.

The protocol itself runs over NIXL in the contract suite (test_loopback, test_control,
test_processes, test_failover: ``nixl`` among their backends).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import pytest
import torch
from transport_testlib import expected, make_spec, routing

from vllm_afd.errors import TransportError
from vllm_afd.transport import backend
from vllm_afd.transport.nixl import INLINE_BYTES, NixlAddress, NixlPlaneMemory

pytestmark = pytest.mark.timeout(60)


def _until(done, *memories: NixlPlaneMemory, timeout_s: float = 10.0) -> None:
    """Pump ``memories`` (every side's progress, as their waits make it) until ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "nothing arrived"
        for memory in memories:
            memory.pump()


def test_a_pushed_line_lands_after_its_payload_flag_last_inline_and_by_write():
    owner, writer = NixlPlaneMemory(5.0), NixlPlaneMemory(5.0, reads_on_attach=False)
    try:
        buffer, handle = owner.create(4 * INLINE_BYTES)
        writer.connect(owner.metadata)
        _until(lambda: writer.name in owner._peers, owner, writer)
        mirror = writer.attach(handle, buffer.numel())
        line, flag = mirror[:24].view(torch.int64), buffer[:8].view(torch.int64)
        for payload in (1024, 2 * INLINE_BYTES):  # inline in the notification, then a WRITE
            region = mirror[128 : 128 + payload]
            region.copy_(torch.randint(0, 255, (payload,), dtype=torch.uint8))
            line.copy_(torch.tensor([payload, 7, 9]))
            writer.push((region,), line)
            _until(lambda p=payload: int(flag) == p, owner, writer)
            assert buffer[:24].view(torch.int64).tolist() == [payload, 7, 9]
            assert torch.equal(buffer[128 : 128 + payload], region)
    finally:
        writer.close()
        owner.close()


def test_a_malformed_store_is_dropped_whole_and_serving_goes_on(caplog):
    """A notification naming bytes outside the owner's buffers, or cut short, stores nothing
    (not even its regions that fit) and is logged; the owner's pump goes on."""
    from vllm_afd.transport.nixl import _HEADER, _REGION, _STORES

    owner, writer = NixlPlaneMemory(5.0), NixlPlaneMemory(5.0, reads_on_attach=False)
    try:
        buffer, _ = owner.create(1024)
        writer.connect(owner.metadata)
        _until(lambda: writer.name in owner._peers, owner, writer)
        base, line = buffer.data_ptr(), (7).to_bytes(8, "little")
        bad = [
            _HEADER.pack(base, 1, 1) + _REGION.pack(base + 1000, 64) + line + b"x" * 64,
            _HEADER.pack(base, 1, 1) + _REGION.pack(base + 64, 8) + line + b"x" * 4,
            _HEADER.pack(base + 4096, 1, 0) + line,
            _HEADER.pack(base, 3, 0) + line,
        ]
        for message in bad:
            writer.agent.send_notif(owner.name, _STORES + message)
        good = _HEADER.pack(base, 1, 1) + _REGION.pack(base + 64, 8) + line + b"y" * 8
        writer.agent.send_notif(owner.name, _STORES + good)
        _until(lambda: int(buffer[:8].view(torch.int64)) == 7, owner, writer)
        assert bytes(buffer[64:72].tolist()) == b"y" * 8
        assert buffer[8:64].eq(0).all() and buffer[72:].eq(0).all()
        assert caplog.text.count("dropped a malformed store from") == len(bad)
    finally:
        writer.close()
        owner.close()


def test_a_closed_peer_is_forgotten_and_its_mirrors_deregistered():
    """A peer that says it closes is forgotten: the mirrors of its buffers are deregistered
    at the next pump, and a push into one is dropped, not an error."""
    owner, writer = NixlPlaneMemory(5.0), NixlPlaneMemory(5.0, reads_on_attach=False)
    try:
        buffer, handle = owner.create(1024)
        writer.connect(owner.metadata)
        _until(lambda: writer.name in owner._peers, owner, writer)
        mirror = writer.attach(handle, buffer.numel())
        assert [peer for _, _, peer in writer._registered.values()] == [owner.name]
        owner.close()
        _until(lambda: not writer._registered, writer)
        assert owner.name in writer.gone and writer._mirrors == []
        writer.push((), mirror[:8].view(torch.int64))  # dropped
    finally:
        writer.close()


def test_a_peer_replaced_without_a_word_is_forgotten_when_its_replacement_takes_its_place():
    """A peer gone without saying so (killed) is forgotten once another peer's buffer takes
    the place of its own (``readdress``: a lost FFN rank's replacement, a restarted
    front-end): its mirrors are deregistered at the next pump."""
    old, new = NixlPlaneMemory(5.0), NixlPlaneMemory(5.0)
    writer = NixlPlaneMemory(5.0, reads_on_attach=False)
    try:
        mirrors = []
        for owner in (old, new):
            buffer, handle = owner.create(1024)
            writer.connect(owner.metadata)
            _until(lambda o=owner: writer.name in o._peers, owner, writer)
            mirrors.append(writer.attach(handle, buffer.numel()))
        writer.readdress(*mirrors)
        _until(lambda: len(writer._registered) == 1, writer)
        assert [peer for _, _, peer in writer._registered.values()] == [new.name]
        assert old.name not in writer.gone and writer._peers == [new.name]
    finally:
        for memory in (writer, new, old):
            memory.close()


def test_large_requests_and_answers_go_by_write_and_come_out_exact(loopback):
    """64 tokens x 1024 float32: 256 KiB each way, over ``INLINE_BYTES``."""
    lb = loopback(make_spec("nixl", 1, 1, hidden_size=1024, max_tokens=64))
    att, ffn = lb.attention[0], lb.ffn[0]
    inputs = routing(64, lb.spec, seed=5)
    assert inputs[0].numel() * 4 > INLINE_BYTES
    handle = att.dispatch(0, *inputs)
    requests: list = []
    _until(lambda: requests.extend(ffn.recv(0.001)) or requests, att.memory, ffn.memory)
    (request,) = requests
    ffn.reply(request, expected(lb.spec, request.x, request.topk_ids, request.topk_weights))
    answer = att.plane.answers[0][0].response_words
    _until(lambda: answer[0] != 0, att.memory, ffn.memory)
    assert torch.equal(att.combine(handle), expected(lb.spec, *inputs))


def test_ucx_listens_on_loopback_only_unless_told():
    """A NIXL agent of ours opens UCX's tcp listener on loopback alone by default (UCX would
    listen on every interface, unauthenticated); an operator's ``UCX_NET_DEVICES`` wins."""
    script = (
        "import os, psutil\n"
        "from vllm_afd.transport.nixl import NixlPlaneMemory\n"
        "m = NixlPlaneMemory(5.0)\n"
        "m.create(4096)\n"
        "print(os.environ['UCX_NET_DEVICES'], sorted({c.laddr.ip for c in "
        "psutil.Process().net_connections('inet') if c.status == 'LISTEN'}))\n"
        "m.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    devices, listening = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert devices == "lo"
    assert listening == "['127.0.0.1']", out.stdout


def test_foreign_addresses_and_handles_are_refused_by_name():
    with pytest.raises(TransportError, match="not an FFN rank's address"):
        NixlAddress.parse("vllm_afd_plane_123")
    with pytest.raises(TransportError, match="not an FFN rank's address"):
        NixlAddress.parse("nixl:bm90IGpzb24=")
    memory = NixlPlaneMemory(1.0)
    try:
        with pytest.raises(TransportError, match="not a buffer handle"):
            memory.attach("somewhere", 64)
        with pytest.raises(TransportError, match="not of the 64 bytes"):
            memory.attach("agent|4096|128", 64)
    finally:
        memory.close()
    address = NixlAddress("a", b"\x00meta", "a|1|2", 2)
    assert NixlAddress.parse(str(address)) == address


def test_the_backend_serves_cpu_ranks_and_says_why_not_gpus():
    nixl = backend("nixl")
    assert nixl.host_problem() is None  # make venv installs NIXL
    assert nixl.device_problem("cpu", "cpu") is None
    assert "not built yet" in (nixl.device_problem("cuda", "cuda") or "")


_OWNER = """
import base64, sys, time
from vllm_afd.transport.nixl import NixlPlaneMemory
memory = NixlPlaneMemory(5.0)
buffer, handle = memory.create(4096)
print("OWNER", base64.b64encode(memory.metadata).decode(), handle, flush=True)
while True:
    memory.pump()
    time.sleep(0.001)
"""


def test_a_push_to_a_peer_that_died_is_dropped_and_logged_not_raised(caplog):
    """An attention rank may send to an FFN rank in the moment it died, before its loss is
    seen: the push is lost (failover sends the use again), never an exception in the engine."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    writer = NixlPlaneMemory(5.0, reads_on_attach=False)
    try:
        line = ""
        while not line.startswith("OWNER "):  # NIXL logs to stdout too
            line = owner.stdout.readline()
            assert line, "the owner process ended"
        _, metadata, handle = line.split()
        writer.connect(base64.b64decode(metadata))
        mirror = writer.attach(handle, 4096)
        flag = mirror[:24].view(torch.int64)
        writer.push((mirror[128:256],), flag)  # reaches a live peer
        owner.kill()
        owner.wait(10)
        with caplog.at_level("WARNING", logger="vllm.afd"):
            for _ in range(20):  # until UCX sees the connection gone
                writer.push((mirror[128:256],), flag)
                writer.push((), flag)
                time.sleep(0.05)
        assert "went away" in caplog.text
        assert caplog.text.count("went away") == 1  # once per peer
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        writer.close()
