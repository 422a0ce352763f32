"""The tcp transport's peer authentication and bounds (``transport/auth.py``, ``tcp.py``):
forged, replayed and malformed HELLOs are refused without touching a live attention rank,
unauthenticated connections are bounded in number and time, and a peer that never reads its
replies is dropped once its queue passes the bound."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from transport_testlib import expected, make_spec, routing

from vllm_afd.errors import TransportError
from vllm_afd.host import write_private_file
from vllm_afd.transport import auth, tcp

pytestmark = pytest.mark.timeout(60)


def _serve_once(lb, x, ids, weights):
    """One round trip of the live attention rank 0 through the loopback."""
    att = lb.attention[0]
    handle = att.dispatch(0, x, ids, weights)
    lb.serve(expect=1)
    return att.combine(handle)


def _pump(endpoint, seconds: float) -> list:
    """Keep the FFN endpoint's ``recv`` going for ``seconds``; the requests that arrived."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        got += endpoint.recv(0.01)
    return got


class RawPeer:
    """A hand-driven client of an FFN rank: reads the CHALLENGE, sends what the test says."""

    def __init__(self, address: str, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5.0)
        self.sock.connect(tcp.parse_address(address))

    def challenge(self, endpoint) -> bytes:
        """The FFN's nonce (the FFN side sends it from ``recv``)."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(self.frame()), daemon=True)
        thread.start()
        while thread.is_alive():
            assert endpoint.recv(0.01) == []
        kind, body = result[0]
        assert kind == tcp._CHALLENGE and len(body) == auth.NONCE_BYTES
        return body

    def frame(self) -> tuple[int, bytes]:
        header = tcp._HEADER.unpack(tcp._recv_exact(self.sock, tcp._HEADER.size))
        return header[1], tcp._recv_exact(self.sock, header[4])

    def hello(self, spec, rank: int, secret: bytes, ffn_nonce: bytes, nonce: bytes) -> bytes:
        fields = tcp._HELLO.pack(*tcp._hello_fields(spec, rank))
        body = fields + nonce + auth.hello_mac(secret, ffn_nonce, fields, nonce)
        return bytes(tcp._header(tcp._HELLO_KIND, 0, 0, len(body), 0)) + body

    def closed_by_peer(self, endpoint, seconds: float = 2.0) -> bool:
        """True once the FFN side closed this connection (while its recv keeps going)."""
        self.sock.setblocking(False)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            endpoint.recv(0.01)
            try:
                while data := self.sock.recv(65536):
                    del data
                return True  # end of file
            except BlockingIOError:
                continue
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("secret", [None, b"not the deployment's secret, 32B"])
def test_forged_hello_is_refused_and_the_live_rank_is_unharmed(loopback, tcp_secret, secret):
    """A HELLO for a live attention rank's rank, built from public facts (the layout) but
    without the secret, gets a REJECT; the live rank's connection keeps working."""
    lb = loopback(make_spec("tcp", 1, 1))
    x, ids, weights = routing(3, lb.spec, seed=0)
    assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))
    forger = RawPeer(lb.spec.addresses[0])
    try:
        nonce = forger.challenge(lb.ffn[0])
        if secret is None:  # no MAC at all: zeros where it goes
            fields = tcp._HELLO.pack(*tcp._hello_fields(lb.spec, 0))
            body = fields + bytes(auth.NONCE_BYTES + auth.MAC_BYTES)
            frame = bytes(tcp._header(tcp._HELLO_KIND, 0, 0, len(body), 0)) + body
        else:
            frame = forger.hello(lb.spec, 0, secret, nonce, auth.new_nonce())
        forger.sock.sendall(frame)
        assert lb.ffn[0].recv(0.2) == []
        kind, body = forger.frame()
        assert kind == tcp._REJECT and b"authentication failed" in body
        assert forger.closed_by_peer(lb.ffn[0])
    finally:
        forger.close()
    x, ids, weights = routing(5, lb.spec, seed=1)
    assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))


def test_replayed_hello_is_refused(loopback, tcp_secret):
    """A HELLO that was valid on one connection fails on the next: it answers another nonce."""
    lb = loopback(make_spec("tcp", 1, 1))
    secret = auth.load_secret()
    first = RawPeer(lb.spec.addresses[0])
    second = RawPeer(lb.spec.addresses[0])
    try:
        recorded = first.hello(lb.spec, 0, secret, first.challenge(lb.ffn[0]), auth.new_nonce())
        second.challenge(lb.ffn[0])
        second.sock.sendall(recorded)
        assert lb.ffn[0].recv(0.2) == []
        kind, body = second.frame()
        assert kind == tcp._REJECT and b"authentication failed" in body
    finally:
        first.close()
        second.close()
    x, ids, weights = routing(2, lb.spec, seed=2)
    assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))


def test_an_ffn_rank_without_the_secret_is_not_trusted(loopback, tmp_path, monkeypatch):
    """Mutual: the attention rank checks the WELCOME, so an FFN side with another secret (a
    process that took over the port) fails the connect, naming the variable."""
    lb = loopback(make_spec("tcp", 1, 1))
    other = write_private_file(str(tmp_path / "other"), auth.new_secret())
    monkeypatch.setenv("VLLM_AFD_AUTH_FILE", other)
    with pytest.raises(TransportError, match="rejected this attention rank: authentication"):
        lb.connect(0)


def test_unauthenticated_connections_are_bounded(loopback, monkeypatch):
    """Idle connections that never authenticate: past ``MAX_UNAUTHENTICATED`` the oldest are
    closed, after ``HANDSHAKE_TIMEOUT_S`` all are; a live attention rank serves throughout."""
    monkeypatch.setattr(tcp, "MAX_UNAUTHENTICATED", 4)
    lb = loopback(make_spec("tcp", 1, 1))
    ffn = lb.ffn[0]
    idle = []
    try:
        for _ in range(6):
            idle.append(RawPeer(lb.spec.addresses[0]))
            assert _pump(ffn, 0.05) == []
        assert len(ffn._pending) == 4
        assert [peer.closed_by_peer(ffn, 0.5) for peer in idle[:2]] == [True, True]
        x, ids, weights = routing(4, lb.spec, seed=3)
        assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))
        monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT_S", 0.2)
        assert [peer.closed_by_peer(ffn, 2.0) for peer in idle[2:]] == [True] * 4
        assert not ffn._pending
    finally:
        for peer in idle:
            peer.close()
    x, ids, weights = routing(4, lb.spec, seed=4)
    assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))


@pytest.mark.parametrize(
    ("kind", "size"),
    [
        (tcp._HELLO_KIND, 2**31 - 1),  # a HELLO announcing 2 GiB
        (tcp._HELLO_KIND, -1),
        (tcp._REQUEST, 64),  # a request before authenticating
    ],
)
def test_oversized_or_early_frames_are_refused(loopback, kind, size):
    lb = loopback(make_spec("tcp", 1, 1))
    peer = RawPeer(lb.spec.addresses[0])
    try:
        peer.challenge(lb.ffn[0])
        peer.sock.sendall(bytes(tcp._header(kind, 0, 0, size, 1)))
        assert peer.closed_by_peer(lb.ffn[0])
        assert not lb.ffn[0]._pending and list(lb.ffn[0]._peers) == [0]
    finally:
        peer.close()
    x, ids, weights = routing(1, lb.spec, seed=5)
    assert torch.equal(_serve_once(lb, x, ids, weights), expected(lb.spec, x, ids, weights))


def test_a_peer_that_never_reads_is_dropped(loopback, tcp_secret):
    """An authenticated attention rank that sends requests but never reads the answers: once
    its queued replies pass ``max_outbox_bytes`` the FFN rank drops it and serves on."""
    spec = make_spec("tcp", 2, 1, hidden_size=1024, max_tokens=64)
    lb = loopback(spec)
    ffn = lb.ffn[0]
    lb.attention[1].close()  # rank 1's place goes to the peer that does not read
    peer = RawPeer(lb.spec.addresses[0], rcvbuf=4096)
    secret = auth.load_secret()
    peer.sock.sendall(peer.hello(lb.spec, 1, secret, peer.challenge(ffn), auth.new_nonce()))
    assert _pump(ffn, 0.2) == []
    assert 1 in ffn._peers
    rows = lb.spec.max_tokens
    x = torch.zeros(rows, lb.spec.hidden_size)
    ids = torch.zeros(rows, lb.spec.top_k, dtype=torch.int32)
    weights = torch.zeros(rows, lb.spec.top_k)
    body = x.numpy().tobytes() + ids.numpy().tobytes() + weights.numpy().tobytes()
    limit = tcp.max_outbox_bytes(lb.spec)
    count = 8 * limit // (rows * lb.spec.hidden_size * 4) + 64  # beyond any kernel buffer

    def flood() -> None:
        try:
            for seq in range(1, count + 1):
                peer.sock.sendall(bytes(tcp._header(tcp._REQUEST, seq % 2, 0, rows, seq)) + body)
        except OSError:
            pass  # dropped

    queued_at_drop: list[int] = []
    drop = ffn._drop

    def recording_drop(dropped) -> None:
        queued_at_drop.append(sum(len(view) for view in dropped.outbox))
        drop(dropped)

    ffn._drop = recording_drop
    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 30
        replied = 0
        while 1 in ffn._peers and time.monotonic() < deadline:
            for request in ffn.recv(0.01):
                ffn.reply(request, torch.zeros(request.x.shape[0], lb.spec.hidden_size))
                replied += request.x.numel() * 4
        assert 1 not in ffn._peers, "the FFN rank kept a peer that never reads"
        assert replied > limit, "dropped before its replies could pass the bound"
        assert queued_at_drop and queued_at_drop[0] > limit  # dropped for its queue
    finally:
        peer.close()
        sender.join(10)
    x, ids, weights = routing(3, lb.spec, seed=6)
    att = lb.attention[0]
    handle = att.dispatch(0, x, ids, weights)
    lb.serve(expect=1)
    assert torch.equal(att.combine(handle), expected(lb.spec, x, ids, weights))


def test_secret_file_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_AFD_AUTH_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="VLLM_AFD_AUTH_FILE=.*cannot use it"):
        auth.load_secret()
    loose = tmp_path / "loose"
    loose.write_bytes(auth.new_secret())
    loose.chmod(0o644)
    monkeypatch.setenv("VLLM_AFD_AUTH_FILE", str(loose))
    with pytest.raises(ValueError, match="mode 0o644"):
        auth.load_secret()
    short = write_private_file(str(tmp_path / "short"), b"abc")
    monkeypatch.setenv("VLLM_AFD_AUTH_FILE", short)
    with pytest.raises(ValueError, match="at least 16"):
        auth.load_secret()
    link = tmp_path / "link"
    link.symlink_to(write_private_file(str(tmp_path / "good"), auth.new_secret()))
    monkeypatch.setenv("VLLM_AFD_AUTH_FILE", str(link))
    with pytest.raises(ValueError, match="cannot use it"):
        auth.load_secret()
    monkeypatch.delenv("VLLM_AFD_AUTH_FILE")
    with pytest.raises(ValueError, match="VLLM_AFD_AUTH_FILE is unset"):
        auth.load_secret()
