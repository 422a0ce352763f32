"""TCP transport: works across hosts (and is the fallback where shared memory is not an option).

Topology. Each FFN rank listens on ``host:port`` (``127.0.0.1`` and an ephemeral port unless
``spec.addresses[rank]`` asks for another ``host:port`` on the FFN side); its ``address`` is the
``host:port`` attention ranks connect to (the host name when bound to ``0.0.0.0``). Every
attention rank opens one connection to every FFN rank and introduces itself with a HELLO frame
carrying its rank and the layout fields of its spec; an FFN rank that disagrees answers with a
REJECT frame (its reason as text) and closes.

Authentication (``auth.py``: the deployment's shared secret, ``VLLM_AFD_AUTH_FILE``). On accept
the FFN rank sends a CHALLENGE (a fresh nonce); the HELLO must carry the HMAC of the secret over
that nonce, the layout fields and the attention rank's own nonce, and the FFN rank answers a
valid HELLO with a WELCOME (its own HMAC, which the attention rank checks) and anything else
with a REJECT. So a forged or replayed HELLO is refused, and it cannot replace a live attention
rank's connection: only an authenticated HELLO does (a restarted attention rank). Until then a
connection may send nothing but one HELLO of the exact size, allocates no buffer, and counts
against ``MAX_UNAUTHENTICATED`` (the oldest is closed when a new one would exceed it) and
``HANDSHAKE_TIMEOUT_S`` (closed when older). The attention rank's ``_connect`` runs the
handshake blocking, bounded by ``_CONNECT_TIMEOUT_S``: the FFN side answers from its ``recv``,
so an FFN rank must be serving while attention ranks connect. Authentication happens at connect
only; frames after it cost what they cost before.

Bounds. Every frame size is checked against the spec before its body is read (a REQUEST or
RESPONSE holds at most ``max_tokens`` rows, a SCHEDULE exactly the schedule words, a REJECT or
ERROR text at most ``MAX_TEXT_BYTES``); anything else closes the connection. Replies queued for
an attention rank that does not read are bounded (``max_outbox_bytes``: twice what its slots
can legitimately have outstanding); past that the FFN rank drops that connection and serves on.

Framing. Every frame is a fixed little-endian header ``(magic u32, kind u16, slot u16, layer i32,
num_tokens i32, seq i64, step i64, microbatch u16)`` followed by raw bytes:

    CHALLENGE nonce (``auth.NONCE_BYTES``), FFN -> attention, first frame of a connection
    HELLO     _HELLO struct (9 x int64) | attention nonce | HMAC (``auth.hello_mac``)
    WELCOME   HMAC (``auth.welcome_mac``), FFN -> attention: the HELLO was accepted
    SCHEDULE  the attention rank's next step (``control.StepSchedule.words``), ``num_tokens``
              bytes; ``step`` is the step
    REQUEST   x [n, H] spec.dtype | topk_ids [n, K] int32 | topk_weights [n, K] float32
    RESPONSE  out [n, H] spec.dtype
    REJECT    reason, utf-8, ``num_tokens`` bytes
    ERROR     serving the request ``seq`` in ``slot`` failed: the FFN rank's error text, utf-8,
              ``num_tokens`` bytes (at most ``MAX_TEXT_BYTES``)

A REQUEST carries its tag (``step``, ``layer``, ``microbatch``; ``control.Tag``) and its
RESPONSE or ERROR the same tag back.

Sockets are non-blocking with TCP_NODELAY. Receivers read straight into preallocated tensors
(``recv_into`` on byte views of their storage; a frame may arrive in any number of pieces);
senders gather the header and tensor bytes with one ``sendmsg``. ``x`` is sent without a copy when
every token goes to one FFN rank; otherwise the selected rows are gathered into a per-slot staging
buffer first.

No deadlock on large messages: while ``dispatch`` waits for a socket to take a big request it keeps
reading responses from every FFN rank, and the FFN side never blocks on a slow reader: replies that
do not fit in the socket buffer are queued and flushed from ``recv``. ``dispatch`` returns once the
kernel holds all bytes of the request.

Waiting. Both sides first poll their sockets without blocking, through the spin and yield
stages of ``WaitPolicy`` (as the slot plane does), then block in ``epoll``: a wake-up from
``epoll`` costs far more than a non-blocking poll (measured numbers: docs/benchmarks.md).

Failure. A closed or reset connection raises ``FFNRankLost`` naming the FFN rank at once
(SIGKILL of an FFN process closes its sockets; with failover, ``endpoint.py`` then connects to its
replacement: ``reconnect``); a silent FFN rank raises ``TransportError`` after
``spec.timeout_s``.
The FFN side drops a dead attention rank's connection and keeps serving the others; a reconnecting
attention rank replaces its old connection.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import cast

import torch

from vllm_afd.errors import (
    AFDConfigError,
    FFNRankLost,
    FFNServeError,
    FFNTimeout,
    ProtocolError,
    TransportError,
)
from vllm_afd.host import LOOPBACK, parse_address
from vllm_afd.transport import auth
from vllm_afd.transport.base import Backend, FFNRequest, ServesRequests, TransportSpec
from vllm_afd.transport.control import StepSchedule, Tag, answer_mismatch, schedule_words
from vllm_afd.transport.endpoint import AttentionEndpoint
from vllm_afd.transport.wait import Backoff, RowViews, WaitPolicy

DEFAULT_HOST = LOOPBACK

# magic, kind, slot, layer, num_tokens, seq, step, microbatch
_HEADER = struct.Struct("<IHHiiqqH6x")
#: A frame header as ``_HEADER.unpack`` returns it (its eight integers).
_Header = tuple[int, int, int, int, int, int, int, int]
# version, rank, A, slots, max_tokens, hidden, top_k, itemsize, schedule words
_HELLO = struct.Struct("<9q")
_MAGIC = 0x41464454  # "AFDT"
_VERSION = 3
_HELLO_KIND, _REQUEST, _RESPONSE, _REJECT, _ERROR, _SCHEDULE = 1, 2, 3, 4, 5, 6
_CHALLENGE, _WELCOME = 7, 8
#: HELLO body: the layout fields, the attention rank's nonce, its HMAC.
_HELLO_BODY = _HELLO.size + auth.NONCE_BYTES + auth.MAC_BYTES
#: Longest REJECT or ERROR text a peer accepts.
MAX_TEXT_BYTES = 16384
#: Connections an FFN rank keeps open before they authenticated (the oldest goes first).
MAX_UNAUTHENTICATED = 16
#: Seconds a connection may take to authenticate before the FFN rank closes it.
HANDSHAKE_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 10.0
#: How long an attention rank's wait blocks on its sockets before it looks in the FFN
#: directory for a rank the supervisor declared lost (``AttentionEndpoint._check_superseded``).
DIRECTORY_CHECK_S = 0.1


def _header(
    kind: int, slot: int, layer: int, size: int, seq: int, step: int = 0, microbatch: int = 0
) -> memoryview:
    """A frame header (``size``: tokens of a REQUEST or RESPONSE, bytes of other bodies)."""
    return memoryview(_HEADER.pack(_MAGIC, kind, slot, layer, size, seq, step, microbatch))


def _byte_view(t: torch.Tensor) -> memoryview:
    """Flat writable byte view of a contiguous tensor's memory (keeps the tensor alive)."""
    return t.view(-1).view(torch.uint8).numpy().data


def _hello_fields(spec: TransportSpec, rank: int) -> tuple[int, ...]:
    return (
        _VERSION,
        rank,
        spec.num_attention_ranks,
        spec.num_slots,
        spec.max_tokens,
        spec.hidden_size,
        spec.top_k,
        spec.dtype.itemsize,
        schedule_words(spec.moe_layers),
    )


def max_outbox_bytes(spec: TransportSpec) -> int:
    """Most reply bytes an FFN rank queues for one attention rank before dropping it: twice
    what its ``num_slots`` outstanding requests can be answered with."""
    answer = max(spec.max_tokens * spec.hidden_size * spec.dtype.itemsize, MAX_TEXT_BYTES)
    return 2 * spec.num_slots * (_HEADER.size + answer)


def _secret() -> bytes:
    """The deployment's shared secret, or ``TransportError`` saying why there is none."""
    try:
        return auth.load_secret()
    except AFDConfigError as exc:
        raise TransportError(f"tcp transport: {exc}") from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket (``ConnectionError`` if the peer closes first)."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        out += chunk
    return bytes(out)


def _recv_frame(sock: socket.socket, sizes: dict[int, tuple[int, int]]) -> tuple[int, bytes]:
    """One frame from a blocking socket: ``(kind, body)``; ``sizes`` maps each allowed kind to
    its (min, max) body bytes. Anything else raises ``ConnectionError``."""
    header = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    magic, kind, n = header[0], header[1], header[4]
    low, high = sizes.get(kind, (1, 0))
    if magic != _MAGIC or not low <= n <= high:
        raise ConnectionError(f"protocol error: unexpected frame {header} during the handshake")
    return kind, _recv_exact(sock, n)


def _open_socket(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class _Buffers:
    """One slot's preallocated ``[max_tokens, cols]`` tensor, its row views and byte view."""

    __slots__ = ("rows", "bytes", "row_bytes")

    def __init__(self, max_tokens: int, cols: int, dtype: torch.dtype) -> None:
        tensor = torch.empty(max_tokens, cols, dtype=dtype)
        self.rows = RowViews(tensor)
        self.bytes = _byte_view(tensor)
        self.row_bytes = cols * dtype.itemsize

    def wire(self, n: int) -> memoryview:
        return self.bytes[: n * self.row_bytes]


class _FrameReader:
    """Reads frames from a non-blocking socket: the header, then its body parts in place.

    ``targets(header)`` returns the writable byte views the body goes to (their lengths define
    the body); ``on_frame(header)`` runs as soon as a frame is complete, before the next header
    is looked at (a HELLO must allocate the buffers the next REQUEST goes to).
    """

    def __init__(
        self,
        sock: socket.socket,
        targets: Callable[[_Header], list[memoryview]],
        on_frame: Callable[[_Header], None],
    ) -> None:
        self.sock = sock
        self.targets = targets
        self.on_frame = on_frame
        self._head = bytearray(_HEADER.size)
        self._header: _Header | None = None
        self._parts: deque[memoryview] = deque()
        self._want = memoryview(self._head)

    def read(self) -> None:
        """Consume what the socket holds. Raises ``ConnectionError`` when the peer closed or
        sent garbage."""
        while True:
            try:
                n = self.sock.recv_into(self._want)
            except (BlockingIOError, InterruptedError):
                return
            if n == 0:
                raise ConnectionError("connection closed by peer")
            if n < len(self._want):
                self._want = self._want[n:]
                continue
            if self._header is None:
                self._header = _HEADER.unpack(self._head)
                if self._header[0] != _MAGIC:
                    raise ConnectionError("protocol error: bad frame magic")
                self._parts.extend(p for p in self.targets(self._header) if len(p))
            elif self._parts:
                self._parts.popleft()
            if self._parts:
                self._want = self._parts[0]
            else:
                header, self._header = self._header, None
                self._want = memoryview(self._head)
                self.on_frame(header)


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """Drop ``sent`` bytes from the front of a list of byte views."""
    while sent and views:
        if sent >= len(views[0]):
            sent -= len(views.pop(0))
        else:
            views[0] = views[0][sent:]
            sent = 0
    return views


def _send_some(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Send what the socket takes now; return what is left. Raises ``OSError`` on a dead peer."""
    try:
        sent = sock.sendmsg(views[:512])
    except (BlockingIOError, InterruptedError):
        return views
    return _advance(views, sent)


class _FFNPeer:
    """Attention side: the connection to one FFN rank and its per-slot response buffers."""

    def __init__(self, spec: TransportSpec, ffn_rank: int, sock: socket.socket) -> None:
        self.ffn_rank = ffn_rank
        self.sock = sock
        self.reader = _FrameReader(sock, self._targets, self._on_frame)
        num_slots, rows, hidden, top_k = (
            spec.num_slots,
            spec.max_tokens,
            spec.hidden_size,
            spec.top_k,
        )
        self.out = [_Buffers(rows, hidden, spec.dtype) for _ in range(num_slots)]
        self._x: list[_Buffers | None] = [None] * num_slots  # staging, only if a batch splits
        self.ids = [_Buffers(rows, top_k, torch.int32) for _ in range(num_slots)]
        self.weights = [_Buffers(rows, top_k, torch.float32) for _ in range(num_slots)]
        self.answered = [0] * num_slots
        self.answer_rows = [0] * num_slots
        #: Per slot: the FFN rank's error text when the answer to ``answered[slot]`` is an
        #: ERROR frame, else None.
        self.failed: list[str | None] = [None] * num_slots
        #: Per slot: the tag (step, layer, microbatch) of the last answer.
        self.answer_tags: list[tuple[int, int, int]] = [(0, 0, 0)] * num_slots
        self.seq = 0
        self.error: str | None = None
        self._text = bytearray()
        self._max_tokens = rows
        self._hidden, self._dtype = hidden, spec.dtype

    def staging(self, slot: int) -> _Buffers:
        """Gather buffer for the rows of a split batch (allocated on first use)."""
        buffers = self._x[slot]
        if buffers is None:
            buffers = self._x[slot] = _Buffers(self._max_tokens, self._hidden, self._dtype)
        return buffers

    def _targets(self, header: _Header) -> list[memoryview]:
        _, kind, slot, _, n, _, _, _ = header
        if kind in (_REJECT, _ERROR) and 0 <= n <= MAX_TEXT_BYTES and slot < len(self.out):
            self._text = bytearray(n)
            return [memoryview(self._text)]
        if kind != _RESPONSE or slot >= len(self.out) or not 0 <= n <= self._max_tokens:
            raise ConnectionError(f"protocol error: unexpected frame {header}")
        return [self.out[slot].wire(n)]

    def _on_frame(self, header: _Header) -> None:
        _, kind, slot, layer, n, seq, step, microbatch = header
        if kind == _REJECT:
            reason = self._text.decode(errors="replace")
            raise ConnectionError(f"rejected this attention rank: {reason}")
        if kind == _ERROR:
            self.failed[slot] = self._text.decode(errors="replace")
            n = 0
        else:
            self.failed[slot] = None
        self.answer_tags[slot] = (step, layer, microbatch)
        self.answered[slot], self.answer_rows[slot] = seq, n

    def read(self) -> None:
        """Absorb every response that arrived; raise ``FFNRankLost`` if the link is gone."""
        if self.error:
            raise FFNRankLost(self.ffn_rank, self.error)
        try:
            self.reader.read()
        except OSError as exc:  # ConnectionError is an OSError
            self.error = f"FFN rank {self.ffn_rank}: connection lost ({exc})"
            raise FFNRankLost(self.ffn_rank, self.error) from None


class TcpAttentionTransport(AttentionEndpoint):
    """Attention endpoint: one TCP connection per FFN rank (``spec.addresses``)."""

    backend_name = "tcp"

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank, wait)
        self._secret = _secret()
        self._selector = selectors.DefaultSelector()
        self._schedule_words = schedule_words(spec.moe_layers)
        self._peers: list[_FFNPeer] = []
        for f, address in enumerate(self.addresses):
            self._peers.append(self._connect(f, address))

    def reconnect(self, ffn_rank: int, address: str) -> None:
        """Close the lost connection and connect to the replacement at ``address``."""
        old = self._peers[ffn_rank]
        if old.sock.fileno() >= 0:  # not closed by an earlier, failed reconnect
            self._selector.unregister(old.sock)
            old.sock.close()
        try:
            self._peers[ffn_rank] = self._connect(ffn_rank, address)
        except TransportError as exc:  # the replacement is gone too: wait for the next one
            raise FFNRankLost(ffn_rank, str(exc)) from None

    def _connect(self, ffn_rank: int, address: str) -> _FFNPeer:
        """Connect and authenticate (blocking, at most ``_CONNECT_TIMEOUT_S`` per step)."""
        try:
            sock = socket.create_connection(parse_address(address), timeout=_CONNECT_TIMEOUT_S)
        except OSError as exc:
            msg = f"FFN rank {ffn_rank}: cannot connect to {address}: {exc}"
            raise TransportError(msg) from None
        try:
            self._handshake(sock, ffn_rank, address)
        except BaseException:
            sock.close()
            raise
        peer = _FFNPeer(self.spec, ffn_rank, _open_socket(sock))
        self._selector.register(sock, selectors.EVENT_READ, peer)
        return peer

    def _handshake(self, sock: socket.socket, ffn_rank: int, address: str) -> None:
        """CHALLENGE -> HELLO -> WELCOME (see the module docstring); ``TransportError`` if the
        FFN rank refuses this attention rank or cannot prove it holds the secret."""
        where = f"FFN rank {ffn_rank} at {address}"
        fields = _HELLO.pack(*_hello_fields(self.spec, self.rank))
        nonce = auth.new_nonce()
        try:
            _, ffn_nonce = _recv_frame(sock, {_CHALLENGE: (auth.NONCE_BYTES, auth.NONCE_BYTES)})
            mac = auth.hello_mac(self._secret, ffn_nonce, fields, nonce)
            body = fields + nonce + mac
            sock.sendall(bytes(_header(_HELLO_KIND, 0, 0, len(body), 0)) + body)
            kind, answer = _recv_frame(
                sock, {_WELCOME: (auth.MAC_BYTES, auth.MAC_BYTES), _REJECT: (0, MAX_TEXT_BYTES)}
            )
        except OSError as exc:  # timeouts, resets, protocol errors
            raise TransportError(f"{where}: handshake failed ({exc})") from None
        if kind == _REJECT:
            reason = answer.decode(errors="replace")
            raise TransportError(f"{where} rejected this attention rank: {reason}")
        if not auth.verify(auth.welcome_mac(self._secret, ffn_nonce, fields, nonce), answer):
            raise TransportError(
                f"{where} failed authentication: it does not hold this deployment's shared "
                "secret (VLLM_AFD_AUTH_FILE); is another process listening there?"
            )

    def _announce_to(self, ffn_rank: int, schedule: StepSchedule) -> None:
        """A SCHEDULE frame, ahead of the step's requests on the same connection."""
        body = struct.pack(f"<{self._schedule_words}q", *schedule.words(self._schedule_words))
        header = _header(_SCHEDULE, 0, 0, len(body), 0, schedule.step)
        deadline = time.perf_counter() + self.spec.timeout_s
        self._send_frame(self._peers[ffn_rank], [header, memoryview(body)], deadline)

    def _send(
        self,
        ffn_rank: int,
        slot: int,
        tag: Tag,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        rows: torch.Tensor,
        deadline: float,
    ) -> int:
        """Send one REQUEST frame; return its seq once the kernel holds every byte."""
        peer = self._peers[ffn_rank]
        parts = self._payload(peer, slot, x, topk_ids, topk_weights, rows)
        peer.seq += 1
        n = rows.shape[0]
        header = _header(_REQUEST, slot, tag.layer, n, peer.seq, tag.step, tag.microbatch)
        self._send_frame(peer, [header, *parts], deadline)
        return peer.seq

    def _payload(
        self,
        peer: _FFNPeer,
        slot: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        rows: torch.Tensor,
    ) -> list[memoryview]:
        """Byte views of the request body; zero-copy for ``x`` when it goes out whole."""
        n = rows.shape[0]
        ids, weights = peer.ids[slot], peer.weights[slot]
        if n == x.shape[0]:
            xb = _byte_view(x) if x.is_contiguous() else _byte_view(x.contiguous())
            ids.rows[n].copy_(topk_ids)
            weights.rows[n].copy_(topk_weights)
        else:
            staging = peer.staging(slot)
            torch.index_select(x, 0, rows, out=staging.rows[n])
            xb = staging.wire(n)
            ids.rows[n].copy_(topk_ids.index_select(0, rows))
            weights.rows[n].copy_(topk_weights.index_select(0, rows))
        return [xb, ids.wire(n), weights.wire(n)]

    def _send_frame(self, peer: _FFNPeer, views: list[memoryview], deadline: float) -> None:
        """Hand ``views`` to the kernel, reading responses from every FFN rank meanwhile."""
        try:
            views = _send_some(peer.sock, views)
        except OSError as exc:
            msg = f"FFN rank {peer.ffn_rank}: connection lost ({exc})"
            raise FFNRankLost(peer.ffn_rank, msg) from None
        if not views:
            return
        self._selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)
        try:
            while views:
                self._wait_events(deadline, peer)
                try:
                    views = _send_some(peer.sock, views)
                except OSError as exc:
                    msg = f"FFN rank {peer.ffn_rank}: connection lost ({exc})"
                    raise FFNRankLost(peer.ffn_rank, msg) from None
        finally:
            self._selector.modify(peer.sock, selectors.EVENT_READ, peer)

    def _wait_events(self, deadline: float, waiting_for: _FFNPeer) -> None:
        """Block until some socket is ready (reading whatever arrived) or raise on timeout;
        every ``DIRECTORY_CHECK_S`` without one, ask the FFN directory whether the supervisor
        declared the rank waited for lost (``_check_superseded``: a dead node sends no FIN)."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise FFNTimeout(
                f"FFN rank {waiting_for.ffn_rank} did not answer within "
                f"timeout_s={self.spec.timeout_s}"
            )
        ready = self._selector.select(min(remaining, DIRECTORY_CHECK_S))
        if not ready:
            self._check_superseded(waiting_for.ffn_rank)
        for key, events in ready:
            if events & selectors.EVENT_READ:
                key.data.read()

    def _wait(
        self,
        ffn_rank: int,
        slot: int,
        seq: int,
        tag: Tag,
        deadline: float,
        awaited: Collection[int],
    ) -> torch.Tensor:
        """Wait for the RESPONSE to ``seq`` in ``slot``, reading every FFN rank's responses
        meanwhile; return ``[N, H]`` (a view of the slot's response buffer). A lost
        connection raises at once, so ``awaited`` needs no liveness check here."""
        peer = self._peers[ffn_rank]
        self._spin(peer, slot, seq)
        while peer.answered[slot] != seq:
            self._wait_events(deadline, peer)
        error = peer.failed[slot]
        if error is not None:
            raise FFNServeError(f"FFN rank {ffn_rank}: {error}")
        if peer.answer_tags[slot] != tag:
            raise ProtocolError(answer_mismatch(ffn_rank, tag, Tag(*peer.answer_tags[slot])))
        return peer.out[slot].rows[peer.answer_rows[slot]]

    def _spin(self, peer: _FFNPeer, slot: int, seq: int) -> None:
        """Poll ``peer`` without blocking through the spin and yield stages (an epoll wake-up
        costs far more than a poll; measured numbers: docs/benchmarks.md)."""
        backoff = Backoff(self.wait)
        peer.read()
        while peer.answered[slot] != seq and backoff.poll_pause():
            peer.read()

    def close(self) -> None:
        """Close the connections (FFN ranks drop this attention rank)."""
        if not self._peers:
            return
        for peer in self._peers:
            if peer.sock.fileno() >= 0:
                self._selector.unregister(peer.sock)
                peer.sock.close()
        self._peers = []
        self._selector.close()


class _AttentionPeer:
    """FFN side: one attention rank's connection, its request buffers and reply queue."""

    def __init__(
        self, sock: socket.socket, spec: TransportSpec, on_hello: Callable[[_AttentionPeer], None]
    ) -> None:
        self.sock = sock
        self.spec = spec
        #: The attention rank, once its HELLO authenticated (None before).
        self.rank: int | None = None
        self.on_hello = on_hello
        self.requests: list[FFNRequest] = []
        self.reader = _FrameReader(sock, self._targets, self._on_frame)
        self.hello = bytearray(_HELLO_BODY)
        #: The CHALLENGE nonce of this connection, and when it was accepted.
        self.nonce = auth.new_nonce()
        self.accepted_at = time.monotonic()
        self.outbox: list[memoryview] = []
        self.watching_write = False
        self.closed = False
        self.x: list[_Buffers] = []
        self.ids: list[_Buffers] = []
        self.weights: list[_Buffers] = []
        #: The step schedule this attention rank announced last (None: never).
        self.schedule: StepSchedule | None = None
        self._schedule_words = schedule_words(spec.moe_layers)
        self._schedule_body = bytearray(8 * self._schedule_words)

    def allocate(self) -> None:
        rows, hidden, top_k = self.spec.max_tokens, self.spec.hidden_size, self.spec.top_k
        slots = range(self.spec.num_slots)
        self.x = [_Buffers(rows, hidden, self.spec.dtype) for _ in slots]
        self.ids = [_Buffers(rows, top_k, torch.int32) for _ in slots]
        self.weights = [_Buffers(rows, top_k, torch.float32) for _ in slots]

    def _targets(self, header: _Header) -> list[memoryview]:
        _, kind, slot, _, n, _, _, _ = header
        if self.rank is None:  # before authentication: one HELLO of the exact size, nothing else
            if kind == _HELLO_KIND and n == _HELLO_BODY:
                return [memoryview(self.hello)]
            raise ConnectionError(f"protocol error: frame {header} before authentication")
        if kind == _SCHEDULE and self.rank is not None and n == len(self._schedule_body):
            return [memoryview(self._schedule_body)]
        if kind != _REQUEST or self.rank is None or slot >= len(self.x):
            raise ConnectionError(f"protocol error: unexpected frame {header}")
        if not 0 <= n <= self.spec.max_tokens:
            raise ConnectionError(f"protocol error: {n} tokens > max_tokens")
        return [self.x[slot].wire(n), self.ids[slot].wire(n), self.weights[slot].wire(n)]

    def _on_frame(self, header: _Header) -> None:
        _, kind, slot, layer, n, seq, step, microbatch = header
        if kind == _HELLO_KIND:
            self.on_hello(self)
            return
        if kind == _SCHEDULE:
            words = struct.unpack(f"<{self._schedule_words}q", self._schedule_body)
            try:
                self.schedule = StepSchedule.from_words(words)
            except ValueError as exc:
                raise ConnectionError(f"protocol error: bad schedule ({exc})") from None
            return
        assert self.rank is not None  # requests come after the HELLO (_payload checks it)
        self.requests.append(
            FFNRequest(
                self.rank,
                layer,
                self.x[slot].rows[n],
                self.ids[slot].rows[n],
                self.weights[slot].rows[n],
                reply_key=(self, slot, seq),
                step=step,
                microbatch=microbatch,
                schedule=self.schedule,
            )
        )


def _reply_key(request: FFNRequest) -> tuple[_AttentionPeer, int, int]:
    """tcp's ``reply_key``: (the attention rank's connection, slot, sequence number)."""
    return cast("tuple[_AttentionPeer, int, int]", request.reply_key)


class TcpFFNTransport(ServesRequests):
    """FFN endpoint: listens, accepts one connection per attention rank, serves them all.

    Requests returned by ``recv`` are views of per-(attention rank, slot) buffers: valid until
    ``reply``. ``reply`` keeps a reference to ``out`` until it is sent: do not modify it.
    """

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        super().__init__(spec, rank)
        self.wait = wait or WaitPolicy()
        self._secret = _secret()
        self._max_outbox = max_outbox_bytes(spec)
        #: Connections not authenticated yet, oldest first.
        self._pending: dict[_AttentionPeer, None] = {}
        requested = spec.addresses[rank] if rank < len(spec.addresses) else ""
        host, port = parse_address(requested) if requested else (DEFAULT_HOST, 0)
        backlog = 2 * spec.num_attention_ranks + MAX_UNAUTHENTICATED
        self._listener = socket.create_server((host, port), backlog=backlog)
        self._listener.setblocking(False)
        bound = self._listener.getsockname()[1]
        shown = socket.gethostname() if host in ("", "0.0.0.0") else host
        self._address = f"{shown}:{bound}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[int, _AttentionPeer] = {}

    @property
    def address(self) -> str:
        return self._address

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """See ``ServesRequests.recv``; also accepts connections and flushes queued replies."""
        requests: list[FFNRequest] = []
        backoff = Backoff(self.wait)
        deadline = backoff.start + timeout_s
        wait = 0.0
        if self._pending:
            self._expire_pending()
        while True:
            ready = self._selector.select(wait)
            for key, events in ready:
                self._on_event(key, events, requests)
            if requests:
                if not ready:
                    return requests  # drained: nothing else is pending
                wait = 0.0
                continue
            now = time.perf_counter()
            if now >= deadline or (wait > 0 and not ready):
                return requests  # timed out
            wait = 0.0 if backoff.poll_pause() else deadline - now

    def _on_event(
        self, key: selectors.SelectorKey, events: int, requests: list[FFNRequest]
    ) -> None:
        peer: _AttentionPeer | None = key.data
        if peer is None:
            self._accept()
            return
        if peer.closed:
            return
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(peer)
            if events & selectors.EVENT_READ:
                peer.reader.read()
        except OSError:
            self._drop(peer)
        if peer.requests:
            requests += peer.requests
            peer.requests = []

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            while len(self._pending) >= MAX_UNAUTHENTICATED:
                self._drop(next(iter(self._pending)))  # the oldest unauthenticated one
            peer = _AttentionPeer(_open_socket(sock), self.spec, self._on_hello)
            self._selector.register(sock, selectors.EVENT_READ, peer)
            self._pending[peer] = None
            challenge = [_header(_CHALLENGE, 0, 0, len(peer.nonce), 0), memoryview(peer.nonce)]
            self._queue(peer, challenge)

    def _expire_pending(self) -> None:
        """Close connections that did not authenticate within ``HANDSHAKE_TIMEOUT_S``."""
        too_old = time.monotonic() - HANDSHAKE_TIMEOUT_S
        for peer in [p for p in self._pending if p.accepted_at < too_old]:
            self._drop(peer)

    def _on_hello(self, peer: _AttentionPeer) -> None:
        body = memoryview(peer.hello)
        raw_fields = bytes(body[: _HELLO.size])
        nonce = bytes(body[_HELLO.size : _HELLO.size + auth.NONCE_BYTES])
        mac = bytes(body[_HELLO.size + auth.NONCE_BYTES :])
        if not auth.verify(auth.hello_mac(self._secret, peer.nonce, raw_fields, nonce), mac):
            self._reject(
                peer,
                "authentication failed: the HELLO does not carry this deployment's HMAC "
                "(another VLLM_AFD_AUTH_FILE, or a forged or replayed HELLO)",
            )
            return
        fields = _HELLO.unpack(raw_fields)
        rank = fields[1]
        expected = _hello_fields(self.spec, rank)
        if fields != expected or not 0 <= rank < self.spec.num_attention_ranks:
            self._reject(peer, f"spec mismatch: attention sent {fields}, FFN expects {expected}")
            return
        old = self._peers.get(rank)
        if old is not None:
            self._drop(old)  # a restarted attention rank replaces its old connection
        self._pending.pop(peer, None)
        peer.rank = rank
        peer.allocate()
        self._peers[rank] = peer
        welcome = auth.welcome_mac(self._secret, peer.nonce, raw_fields, nonce)
        self._queue(peer, [_header(_WELCOME, 0, 0, len(welcome), 0), memoryview(welcome)])

    def _reject(self, peer: _AttentionPeer, reason: str) -> None:
        """Send a REJECT if the socket takes it now (never blocks: the serve loop must not
        wait for a peer that does not read), then close."""
        body = reason.encode()[:MAX_TEXT_BYTES]
        frame = bytes(_header(_REJECT, 0, 0, len(body), 0)) + body
        try:
            peer.sock.send(frame)
        except OSError:
            pass
        self._drop(peer)

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """See ``ServesRequests.reply``; ``out``: ``[N, H]``, converted to ``spec.dtype``."""
        peer, slot, seq = _reply_key(request)
        n = request.x.shape[0]
        if out.shape != (n, self.spec.hidden_size):
            raise ValueError(f"reply must be [{n}, {self.spec.hidden_size}], got {out.shape}")
        if peer.closed:
            return  # that attention rank is gone; nobody waits for this answer
        if out.dtype != self.spec.dtype:
            out = out.to(self.spec.dtype)
        header = _header(_RESPONSE, slot, request.layer, n, seq, request.step, request.microbatch)
        self._queue(peer, [header, _byte_view(out.contiguous())])

    def reply_error(self, request: FFNRequest, message: str) -> None:
        """See ``ServesRequests.reply_error``: an ERROR frame with the text (truncated to
        ``MAX_TEXT_BYTES``)."""
        peer, slot, seq = _reply_key(request)
        if peer.closed:
            return
        body = message.encode()[:MAX_TEXT_BYTES]
        header = _header(
            _ERROR, slot, request.layer, len(body), seq, request.step, request.microbatch
        )
        self._queue(peer, [header, memoryview(body)])

    def _queue(self, peer: _AttentionPeer, frame: list[memoryview]) -> None:
        """Send ``frame`` after what is queued for ``peer``, as far as the socket takes it. A
        peer whose queue grows past ``max_outbox_bytes`` (it does not read) is dropped."""
        queued = bool(peer.outbox)
        peer.outbox += frame
        if not queued:
            try:
                self._flush(peer)
            except OSError:
                self._drop(peer)
        elif sum(len(view) for view in peer.outbox) > self._max_outbox:
            self._drop(peer)

    def _flush(self, peer: _AttentionPeer) -> None:
        """Send queued replies without blocking; watch for writability while some remain."""
        peer.outbox = _send_some(peer.sock, peer.outbox)
        pending = bool(peer.outbox)
        if pending != peer.watching_write:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
            self._selector.modify(peer.sock, events, peer)
            peer.watching_write = pending

    def _drop(self, peer: _AttentionPeer) -> None:
        """Forget a dead or rejected attention rank's connection; keep serving the others."""
        if peer.closed:
            return
        peer.closed = True
        peer.outbox = []
        self._pending.pop(peer, None)
        self._selector.unregister(peer.sock)
        peer.sock.close()
        if peer.rank is not None and self._peers.get(peer.rank) is peer:
            del self._peers[peer.rank]

    def close(self) -> None:
        if self._listener.fileno() < 0:
            return
        for peer in list(self._peers.values()):
            self._drop(peer)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._drop(key.data)
        self._selector.close()
        self._listener.close()


class TcpBackend(Backend):
    """Across hosts: the FFN ranks listen on ``--afd-ffn-host`` (any free port), peers
    authenticate with the deployment's secret (HMAC), hidden states travel unencrypted."""

    name = "tcp"
    attention = TcpAttentionTransport
    ffn = TcpFFNTransport
    needs_secret = True
    plaintext_on_ffn_host = True

    @classmethod
    def requested_addresses(cls, ffn_host: str, num_ffn_ranks: int) -> tuple[str, ...]:
        return (f"{ffn_host}:0",) * num_ffn_ranks

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        """Hidden states travel through host memory: CPU attention ranks only (their FFN ranks
        may compute on a GPU)."""
        if attention_device == "cpu":
            return None
        return (
            f"{cls.name}: hidden states travel through host memory, which cannot serve a "
            f"{attention_device.upper()} model; use --afd-transport slots on GPUs"
        )
