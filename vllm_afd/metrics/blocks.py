"""Stats blocks: their format, names, writers and reader.

Why shared-memory blocks, how they are named, their lifetime and the liveness check: see the
package docstring. A writer updates its words with plain ``memoryview`` item adds (no lock, no
syscall); a reader copies the whole block with one ``read``.

Block layout (words; ``int64`` header, ``float64`` data)::

    header  [16]   magic, version, role, rank, writer pid, writer start time (clock ticks since
                   boot), pid-namespace inode, state (open/closed), layer capacity L, peers P,
                   buckets B, reserved
    bounds  [B]    histogram upper bounds (seconds)
    scalars [16]   role-specific totals (``_F_*`` / ``_A_*``)
    peers   [P]    attention: tokens dispatched to each FFN rank
    hist    [B+1]  per-bucket counts (not cumulative), last = above every bound (+Inf)
    layer   [4L]   calls, seconds, tokens, known flag per layer index (model layer number)

The header words and scalar indices are this package's block format: ``collector.py`` reads
the scalars through them.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import mmap
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm_afd.host import (
    SHM_DIR,
    UnsafeFileError,
    create_segment,
    open_owned_segment,
    pid_namespace,
    process_start_time,
    read_segment_header,
    reap_segments,
    unlink_segment,
)

PREFIX = "vllm_afd_metrics_"

#: Histogram upper bounds (seconds) for FFN service time and exposed FFN time per round trip.
# fmt: off
BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0, 2.5,
)
# fmt: on
#: Layer indices an attention block has room for (the model's layer numbers; larger ones are
#: counted in the totals only).
ATTENTION_LAYER_CAPACITY = 1024
ERROR_KINDS = ("timeout", "ffn_dead", "ffn_error", "other")
#: Largest layer count / peer count a reader accepts in a block header (a corrupted or forged
#: header cannot make a scrape allocate more).
MAX_LAYERS = 1 << 16
MAX_PEERS = 1 << 16

_MAGIC = 0x3130_5354_4D44_4641  # b"AFDMST01" little-endian
_VERSION = 1
ROLE_ATTENTION, ROLE_FFN = 1, 2
_STATE_OPEN, _STATE_CLOSED = 1, 2

# Header words.
(
    _H_MAGIC,
    _H_VERSION,
    _H_ROLE,
    _H_RANK,
    _H_PID,
    _H_START,
    _H_PIDNS,
    _H_STATE,
    _H_LAYERS,
    _H_PEERS,
    _H_BUCKETS,
) = range(11)
_HEADER_WORDS = 16
_SCALAR_WORDS = 16
# FFN scalars. The last three are the rank's health (``FFNStatsBlock.beat`` and friends):
# ``time.monotonic()`` of the heartbeat thread's last beat, of the start of the layer batch
# being served (0 while idle), and the count of requests that failed on this rank.
_F_REQUESTS, _F_TOKENS, _F_BYTES_IN, _F_BYTES_OUT, _F_SECONDS = range(5)
F_HEARTBEAT, F_BUSY_SINCE, F_FAILURES = 5, 6, 7
# Attention scalars.
_A_ROUND_TRIPS, _A_TOKENS, _A_BYTES_SENT, _A_BYTES_RECEIVED, _A_SECONDS = range(5)
_A_ERRORS = 5  # one word per ERROR_KINDS entry
_A_REDISPATCHED = _A_ERRORS + len(ERROR_KINDS)  # requests sent again to a replaced FFN rank
# Decode steps (``AttentionStatsBlock.record_step``): their count, forward seconds, requests
# and context tokens (summed over the steps): what the planner in the loop reads.
A_STEPS = _A_REDISPATCHED + 1
A_STEP_SECONDS, A_STEP_REQUESTS, A_STEP_CONTEXT = A_STEPS + 1, A_STEPS + 2, A_STEPS + 3


# --------------------------------------------------------------------------------------------
# Names, processes
# --------------------------------------------------------------------------------------------


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def deployment_id(addresses: Sequence[str]) -> str:
    """Short id of a running FFN group, from its transport addresses."""
    return _digest("\n".join(addresses))


def ffn_block_name(address: str, rank: int) -> str:
    """Stats block of the FFN rank whose transport address is ``address``."""
    return f"{PREFIX}{_digest(address)}_f{rank}"


def attention_block_name(addresses: Sequence[str], rank: int) -> str:
    """Stats block of attention rank ``rank`` of the deployment with these FFN addresses."""
    return f"{PREFIX}{deployment_id(addresses)}_a{rank}"


def _writer_alive(pid: int, start_time: int) -> bool:
    """Process ``pid`` runs and is the one that recorded ``start_time`` (0: not recorded)."""
    now = process_start_time(pid)
    return now is not None and (start_time == 0 or now == start_time)


# --------------------------------------------------------------------------------------------
# Blocks: layout, writers, reader
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    layers: int
    peers: int
    buckets: int

    @property
    def bounds(self) -> int:
        return _HEADER_WORDS

    @property
    def scalars(self) -> int:
        return _HEADER_WORDS + self.buckets

    @property
    def peer(self) -> int:
        return self.scalars + _SCALAR_WORDS

    @property
    def hist(self) -> int:
        return self.peer + self.peers

    @property
    def calls(self) -> int:
        return self.hist + self.buckets + 1

    @property
    def seconds(self) -> int:
        return self.calls + self.layers

    @property
    def tokens(self) -> int:
        return self.seconds + self.layers

    @property
    def known(self) -> int:
        return self.tokens + self.layers

    @property
    def words(self) -> int:
        return self.known + self.layers


class _Writer:
    """A block this process created and owns (lifetime: see the package docstring)."""

    role: int

    def __init__(self, name: str, rank: int, layers: int, peers: int) -> None:
        reap_stale_blocks()
        self.name = name
        self.rank = rank
        self.layout = layout = _Layout(max(1, layers), max(0, peers), len(BUCKETS))
        size = 8 * layout.words
        fd = _create_block(name, size)
        try:
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        os.close(fd)
        self._finalizer = weakref.finalize(self, unlink_segment, name)
        self._q = memoryview(self._mm).cast("q")
        #: float64 words, the hot-path view.
        self.d = memoryview(self._mm).cast("d")
        q, d = self._q, self.d
        for i, bound in enumerate(BUCKETS):
            d[layout.bounds + i] = bound
        q[_H_VERSION], q[_H_ROLE], q[_H_RANK] = _VERSION, self.role, rank
        q[_H_PID] = pid = os.getpid()
        q[_H_START] = process_start_time(pid) or 0
        q[_H_PIDNS] = pid_namespace()
        q[_H_LAYERS], q[_H_PEERS], q[_H_BUCKETS] = layout.layers, layout.peers, layout.buckets
        q[_H_STATE] = _STATE_OPEN
        q[_H_MAGIC] = _MAGIC  # publish last
        self._bounds = BUCKETS
        self._o_scalars, self._o_peer, self._o_hist = layout.scalars, layout.peer, layout.hist
        self._o_calls, self._o_seconds = layout.calls, layout.seconds
        self._o_tokens, self._o_known = layout.tokens, layout.known
        self._layers, self._peers = layout.layers, layout.peers

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Mark closed and unlink (idempotent). The mapping stays until this object is
        collected, so a late ``record_*`` from another thread writes into memory that no one
        reads, instead of failing."""
        if not self._finalizer.alive:
            return
        self._q[_H_STATE] = _STATE_CLOSED
        self._finalizer()

    def _observe(self, layer: int, tokens: int, seconds: float, calls: int = 1) -> None:
        """``calls`` calls of ``layer`` alike, ``tokens`` and ``seconds`` in all."""
        d = self.d
        d[self._o_hist + bisect.bisect_left(self._bounds, seconds / calls)] += calls
        if 0 <= layer < self._layers:
            d[self._o_calls + layer] += calls
            d[self._o_seconds + layer] += seconds
            d[self._o_tokens + layer] += tokens


def _create_block(name: str, size: int) -> int:
    """Create block ``name`` (``host.create_segment``). A taken name is reaped if it is a stale
    block of ours (``reap_stale_blocks`` already ran, so only a race leaves one) and refused
    otherwise: a live writer's block is not stolen, another user's file is not touched."""
    try:
        return create_segment(name, size)
    except FileExistsError:
        pass
    path = os.path.join(SHM_DIR, name)
    header = read_segment_header(name, _HEADER_WORDS)
    if header is None:
        raise UnsafeFileError(
            f"AFD metrics block {path} exists and is not this user's (planted by another "
            "user?); metrics of this rank are off"
        )
    if header[_H_MAGIC] == _MAGIC and not _writer_alive(header[_H_PID], header[_H_START]):
        unlink_segment(name)
        return create_segment(name, size)
    raise RuntimeError(f"AFD metrics block {name!r} exists and its writer is alive")


class FFNStatsBlock(_Writer):
    """The FFN rank's block: one ``record_layer`` per served layer batch."""

    role = ROLE_FFN

    def __init__(self, address: str, rank: int, layers: Iterable[int]) -> None:
        layers = sorted(set(layers))
        super().__init__(ffn_block_name(address, rank), rank, (layers[-1] + 1) if layers else 1, 0)
        for layer in layers:
            self.d[self._o_known + layer] = 1.0

    def record_layer(
        self,
        layer: int,
        requests: int,
        tokens: int,
        bytes_in: int,
        bytes_out: int,
        seconds: float,
        calls: int = 1,
    ) -> None:
        """``calls`` batched expert calls of ``layer`` alike (a step served whole, taken
        ``calls`` times at once) served ``requests`` requests in ``seconds``, in all."""
        d, s = self.d, self._o_scalars
        d[s + _F_REQUESTS] += requests
        d[s + _F_TOKENS] += tokens
        d[s + _F_BYTES_IN] += bytes_in
        d[s + _F_BYTES_OUT] += bytes_out
        d[s + _F_SECONDS] += seconds
        self._observe(layer, tokens, seconds, calls)

    def beat(self) -> None:
        """The heartbeat: this process runs (a stopped or dead rank stops beating)."""
        self.d[self._o_scalars + F_HEARTBEAT] = time.monotonic()

    def set_busy(self, since: float) -> None:
        """The serve loop started a layer batch at ``since`` (``time.monotonic()``; 0: idle)."""
        self.d[self._o_scalars + F_BUSY_SINCE] = since

    def record_failure(self, requests: int) -> None:
        """``requests`` requests failed on this rank (it is unhealthy from now on)."""
        self.d[self._o_scalars + F_FAILURES] += requests


class AttentionStatsBlock(_Writer):
    """An attention rank's block: one ``record_round_trip`` per dispatch/combine."""

    role = ROLE_ATTENTION

    def __init__(
        self, addresses: Sequence[str], rank: int, layers: int = ATTENTION_LAYER_CAPACITY
    ) -> None:
        super().__init__(attention_block_name(addresses, rank), rank, layers, len(addresses))
        #: (sent, received) wire bytes per token row; the recorder sets it from the spec.
        self.bytes_per_token = (0, 0)

    def record_combine(self, handle, exposed_wait_s: float) -> None:
        """``record_round_trip`` for a combined ``DispatchHandle``: tokens per FFN rank from
        ``handle.token_index``, bytes from ``bytes_per_token``. An empty batch is no round trip.
        """
        if not handle.token_index:
            return
        tokens = {f: rows.numel() for f, rows in handle.token_index.items()}
        n = sum(tokens.values())
        sent, received = self.bytes_per_token
        self.record_round_trip(handle.layer, tokens, n * sent, n * received, exposed_wait_s)

    def record_round_trip(
        self,
        layer: int,
        tokens_per_ffn_rank: Mapping[int, int] | Sequence[int],
        bytes_sent: int,
        bytes_received: int,
        exposed_wait_s: float,
    ) -> None:
        d, s, peer, peers = self.d, self._o_scalars, self._o_peer, self._peers
        items = (
            tokens_per_ffn_rank.items()
            if isinstance(tokens_per_ffn_rank, dict)
            else enumerate(tokens_per_ffn_rank)
        )
        total = 0
        for ffn_rank, n in items:
            if 0 <= ffn_rank < peers:
                d[peer + ffn_rank] += n
            total += n
        d[s + _A_ROUND_TRIPS] += 1.0
        d[s + _A_TOKENS] += total
        d[s + _A_BYTES_SENT] += bytes_sent
        d[s + _A_BYTES_RECEIVED] += bytes_received
        d[s + _A_SECONDS] += exposed_wait_s
        d[self._o_hist + bisect.bisect_left(self._bounds, exposed_wait_s)] += 1.0
        if 0 <= layer < self._layers:
            d[self._o_calls + layer] += 1.0
            d[self._o_seconds + layer] += exposed_wait_s
            d[self._o_tokens + layer] += total

    def record_error(self, kind: str) -> None:
        index = ERROR_KINDS.index(kind) if kind in ERROR_KINDS else len(ERROR_KINDS) - 1
        self.d[self._o_scalars + _A_ERRORS + index] += 1.0

    def set_redispatched(self, total: int) -> None:
        """The requests this rank sent again to replaced FFN ranks so far (failover)."""
        self.d[self._o_scalars + _A_REDISPATCHED] = total

    def record_step(self, seconds: float, requests: int, context_tokens: int) -> None:
        """One decode step's forward took ``seconds`` for ``requests`` requests holding
        ``context_tokens`` tokens of context in all."""
        d, s = self.d, self._o_scalars
        d[s + A_STEPS] += 1.0
        d[s + A_STEP_SECONDS] += seconds
        d[s + A_STEP_REQUESTS] += requests
        d[s + A_STEP_CONTEXT] += context_tokens


@dataclass
class BlockSnapshot:
    """A copy of one block, as a reader sees it."""

    name: str
    role: int
    rank: int
    pid: int
    start_time: int
    pid_namespace: int
    closed: bool
    bounds: list[float]
    scalars: list[float]
    peers: list[float]
    hist: list[float]
    #: layer -> (calls, seconds, tokens) for layers known to the writer or already seen.
    layers: dict[int, tuple[float, float, float]]

    def alive(self) -> bool:
        """Writer process still running (and block open); see the package docstring."""
        if self.closed:
            return False
        if self.pid_namespace != pid_namespace():
            return True  # not checkable from here
        return _writer_alive(self.pid, self.start_time)


def read_block(name: str) -> BlockSnapshot | None:
    """Copy block ``name``; ``None`` if it does not exist, is not (yet) a valid block, or is
    not this user's own file (``host.open_owned_segment``: regular, ours, mode 0600, opened
    without following links). Only the header's layout worth of bytes is read, and only when
    the file has exactly that size."""
    try:
        fd = open_owned_segment(name)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8 * _HEADER_WORDS, 0)
        if len(head) < 8 * _HEADER_WORDS:
            return None
        q = memoryview(head).cast("q")
        if q[_H_MAGIC] != _MAGIC or q[_H_VERSION] != _VERSION:
            return None
        layers, peers, buckets = q[_H_LAYERS], q[_H_PEERS], q[_H_BUCKETS]
        if not (0 < layers <= MAX_LAYERS and 0 <= peers <= MAX_PEERS and buckets == len(BUCKETS)):
            return None
        layout = _Layout(layers, peers, buckets)
        if size != 8 * layout.words:
            return None
        raw = os.pread(fd, size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != size:
        return None
    q = memoryview(raw).cast("q")
    d = memoryview(raw).cast("d")
    calls = d[layout.calls : layout.seconds]
    seconds = d[layout.seconds : layout.tokens]
    tokens = d[layout.tokens : layout.known]
    known = d[layout.known : layout.words]
    return BlockSnapshot(
        name=name,
        role=q[_H_ROLE],
        rank=q[_H_RANK],
        pid=q[_H_PID],
        start_time=q[_H_START],
        pid_namespace=q[_H_PIDNS],
        closed=q[_H_STATE] == _STATE_CLOSED,
        bounds=list(d[layout.bounds : layout.scalars]),
        scalars=list(d[layout.scalars : layout.peer]),
        peers=list(d[layout.peer : layout.hist]),
        hist=list(d[layout.hist : layout.calls]),
        layers={
            layer: (calls[layer], seconds[layer], tokens[layer])
            for layer in range(layout.layers)
            if known[layer] or calls[layer]
        },
    )


def reap_stale_blocks() -> list[str]:
    """Unlink stats blocks whose writer (in this pid namespace) is gone; returns their names."""
    own_ns = pid_namespace()

    def is_stale(name: str, q) -> bool:
        if q[_H_MAGIC] != _MAGIC or q[_H_PIDNS] != own_ns:
            return False
        return not _writer_alive(q[_H_PID], q[_H_START])

    return reap_segments(PREFIX, _HEADER_WORDS, is_stale)


def unlink_deployment_blocks(spec) -> list[str]:
    """Unlink every stats block of the deployment ``spec`` (a ``TransportSpec``, or its JSON
    dict). For the front-end when it stops the FFN group; returns the names unlinked."""
    addresses, num_attention, _ = spec_fields(spec)
    names = [ffn_block_name(a, f) for f, a in enumerate(addresses)]
    names += [attention_block_name(addresses, a) for a in range(num_attention)]
    return [name for name in names if unlink_segment(name)]


def spec_fields(spec) -> tuple[tuple[str, ...], int, int]:
    """(addresses, attention ranks, FFN ranks) of a TransportSpec, its dict or its JSON."""
    spec = _as_mapping(spec)
    return (
        tuple(spec.get("addresses") or ()),
        int(spec["num_attention_ranks"]),
        int(spec["num_ffn_ranks"]),
    )


def spec_directory(spec) -> str:
    """The FFN directory of a TransportSpec, its dict or its JSON ("" if none)."""
    return str(_as_mapping(spec).get("directory") or "")


def _as_mapping(spec) -> Mapping:
    if isinstance(spec, str):
        return json.loads(spec)
    return spec if isinstance(spec, Mapping) else dataclasses.asdict(spec)
