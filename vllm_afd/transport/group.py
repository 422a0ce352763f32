"""The ``deepep`` backend's group: rendezvous and control messages of ``A + F`` ranks.

DeepEP needs two things besides its kernels that nothing in a vLLM deployment provides across
the attention ranks (vLLM's workers) and the FFN ranks (Ray actors): a communicator for
``deep_ep.Buffer(comm=...)``, whose constructor gathers device ids, IPC handles and the NVSHMEM
unique id from every rank (an object with ``Get_rank``, ``Get_size`` and ``allgather``, the
``mpi4py`` shape DeepEP accepts since 2025-08); and the control plane's channel, on which every
attention rank announces each step's schedule to every FFN rank (``control.py``), so that an FFN
rank posts a DeepEP call only for a step that will send it tokens.

``Hub`` is both, run by the front-end: a ``multiprocessing.connection.Listener`` (the standard
library's authenticated connection: an HMAC challenge with the deployment's secret,
``auth.load_secret``, before any byte is read) on the FFN host's interface (loopback unless
told otherwise); every rank keeps one connection to it (``Member``). A gather is answered once
all ``A + F`` ranks sent their part; a control message is relayed to its destination (kept
until that rank connects). Messages are JSON (bytes as base64): nothing received is unpickled.

Why not a library's: ``torch.distributed.TCPStore`` (vLLM's ``StatelessProcessGroup``) listens
on every interface without authentication and its object helpers unpickle what they read; a
torch.distributed group cannot be formed across vLLM's workers (their WORLD holds the attention
ranks only) without private c10d calls (the peer plugin registers one by hand).
"""

from __future__ import annotations

import base64
import collections
import json
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait

from vllm_afd.host import parse_address
from vllm_afd.transport.base import TransportError

#: How long a gather waits for the last rank (all ranks build their DeepEP buffer together).
GATHER_TIMEOUT_S = 300.0


def _encode(obj: object) -> object:
    """JSON-able form of what DeepEP gathers (ints, ``None``, bytes, str, lists of them)."""
    if isinstance(obj, bytes | bytearray):
        return {"b64": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, list | tuple):
        return [_encode(o) for o in obj]
    if obj is None or isinstance(obj, int | str | float):
        return obj
    raise TypeError(f"cannot send {type(obj).__name__} through the DeepEP group's hub")


def _decode(obj: object) -> object:
    """Inverse of ``_encode``; bytes come back as ``bytearray`` (DeepEP's runtime takes the
    IPC handles and the NVSHMEM unique id as ``pybind11::bytearray``, which ``bytes`` is not)."""
    if isinstance(obj, dict):
        return bytearray(base64.b64decode(obj["b64"]))
    if isinstance(obj, list):
        return [_decode(o) for o in obj]
    return obj


def _send(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes(1 << 24))


class Hub:
    """The front-end's rendezvous of one ``A + F`` rank group (see module docstring).

    Args:
        host: interface to listen on (the FFN host; 127.0.0.1 on one node).
        num_ranks: ``A + F``.
        secret: the deployment's shared secret (``auth.load_secret``).
    """

    def __init__(self, host: str, num_ranks: int, secret: bytes) -> None:
        self.num_ranks = num_ranks
        self._listener = Listener((host, 0), authkey=secret)
        self._lock = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._queued: dict[int, list[dict]] = collections.defaultdict(list)
        self._gathers: dict[int, dict[int, object]] = collections.defaultdict(dict)
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept_forever, name="afd-hub-accept", daemon=True),
            threading.Thread(target=self._serve_forever, name="afd-hub", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.address
        return f"{host}:{port}"

    def _accept_forever(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()  # authenticates (HMAC challenge) first
                rank = int(_recv(conn)["hello"])
            except Exception:  # a refused or broken client; a closed listener ends the loop
                continue
            with self._lock:
                self._conns[rank] = conn
                for message in self._queued.pop(rank, []):
                    _send(conn, message)

    def _serve_forever(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                conns = dict(self._conns)
            if not conns:
                time.sleep(0.01)
                continue
            for conn in wait(list(conns.values()), timeout=0.05):
                rank = next(r for r, c in conns.items() if c is conn)
                try:
                    self._handle(rank, _recv(conn))
                except (EOFError, OSError):
                    with self._lock:
                        self._conns.pop(rank, None)

    def _handle(self, src: int, message: dict) -> None:
        with self._lock:
            if "post" in message:
                self._deliver(int(message["post"]), {"src": src, "words": message["words"]})
                return
            round_ = int(message["gather"])
            parts = self._gathers[round_]
            parts[src] = message["obj"]
            if len(parts) == self.num_ranks:
                del self._gathers[round_]
                answer = {"gathered": round_, "objs": [parts[r] for r in range(self.num_ranks)]}
                for rank in range(self.num_ranks):
                    self._deliver(rank, answer)

    def _deliver(self, rank: int, message: dict) -> None:
        conn = self._conns.get(rank)
        if conn is None:
            self._queued[rank].append(message)
        else:
            _send(conn, message)

    def close(self) -> None:
        self._closed.set()
        try:  # wake the accept thread (closing the listener does not); it fails the challenge
            socket.create_connection(self._listener.address, timeout=1).close()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
        for thread in self._threads:
            thread.join(timeout=5)


class Member:
    """One rank's connection to the ``Hub``: DeepEP's ``comm`` and the control channel.

    Args:
        address: the hub's ``host:port``.
        rank: this rank in the group (attention ranks ``0..A-1``, FFN rank ``f`` is ``A + f``).
        num_ranks: ``A + F``.
        secret: the deployment's shared secret.

    Raises:
        TransportError: if the hub cannot be reached or refuses the secret.
    """

    def __init__(self, address: str, rank: int, num_ranks: int, secret: bytes) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        try:
            self._conn = Client(parse_address(address), authkey=secret)
            _send(self._conn, {"hello": rank})
        except Exception as exc:
            raise TransportError(
                f"deepep transport: rank {rank} cannot join the group's hub at {address}: {exc}"
            ) from None
        self._posts: collections.deque[tuple[int, list[int]]] = collections.deque()
        self._round = 0

    # DeepEP's ``comm`` protocol (mpi4py's names)
    def Get_rank(self) -> int:  # noqa: N802 - the name DeepEP calls
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.num_ranks

    def allgather(self, obj: object) -> list:
        """Every rank's ``obj``, in rank order (collective: waits for all ranks)."""
        self._round += 1
        _send(self._conn, {"gather": self._round, "obj": _encode(obj)})
        deadline = time.monotonic() + GATHER_TIMEOUT_S
        while True:
            message = self._next(deadline - time.monotonic())
            if message is None:
                raise TransportError(
                    f"deepep transport: rank {self.rank} waited {GATHER_TIMEOUT_S:.0f} s for "
                    "every rank of the group to build its DeepEP buffer"
                )
            if message.get("gathered") == self._round:
                return [_decode(o) for o in message["objs"]]

    def post(self, dst: int, words: list[int]) -> None:
        """Send a control message (a schedule's words) to group rank ``dst``."""
        _send(self._conn, {"post": dst, "words": words})

    def next_post(self, timeout_s: float) -> tuple[int, list[int]] | None:
        """The oldest control message not taken yet as ``(src, words)``, waiting up to
        ``timeout_s``; ``None`` if none came."""
        deadline = time.monotonic() + timeout_s
        while not self._posts:
            if self._next(deadline - time.monotonic()) is None:
                return None
        return self._posts.popleft()

    def _next(self, timeout_s: float) -> dict | None:
        """Read one message (control messages are queued, a gather's answer returned)."""
        try:
            if not self._conn.poll(max(timeout_s, 0.0)):
                return None
            message = _recv(self._conn)
        except (EOFError, OSError) as exc:
            why = f"deepep transport: rank {self.rank} lost the hub: {exc}"
            raise TransportError(why) from None
        if "src" in message:
            self._posts.append((int(message["src"]), [int(w) for w in message["words"]]))
        return message

    def close(self) -> None:
        self._conn.close()
