"""AFD metrics on vLLM's ``/metrics``: shared-memory counters + a Prometheus collector.

The numbers are produced in processes that do not serve ``/metrics``: FFN ranks (Ray actors)
and attention ranks (vLLM worker processes); ``/metrics`` is served by the front-end or, with
several API servers, by each API-server process. So every producer owns one small *stats
block*, a file in ``/dev/shm`` of 8-byte words, and ``AFDCollector`` reads all blocks of the
running deployment at scrape time. Nothing is sent anywhere and nothing is locked: a writer
updates its own words with plain stores (a ``memoryview`` item add, about 0.1 us, no syscall);
a reader copies the whole block with one ``read``. A scrape may see a histogram bucket
incremented before its sum (words are written one after another), never a torn word.

Finding the blocks. Every process of a deployment inherits ``VLLM_AFD_RUNTIME`` (the running
FFN group's ``TransportSpec`` as JSON, see ``placement.py``), whose ``addresses`` name the FFN
ranks' transport endpoints. Names are derived from it::

    FFN rank f:        vllm_afd_metrics_<sha1(addresses[f])[:16]>_f<f>
    attention rank a:  vllm_afd_metrics_<sha1("\\n".join(addresses))[:16]>_a<a>

The FFN rank names its block after its own transport address (it cannot know the others' when
it starts); the deployment id of the attention blocks covers all of them.

Block layout (words; ``int64`` header, ``float64`` data)::

    header  [16]   magic, version, role, rank, writer pid, writer start time (clock ticks since
                   boot), pid-namespace inode, state (open/closed), layer capacity L, peers P,
                   buckets B, reserved
    bounds  [B]    histogram upper bounds (seconds)
    scalars [16]   role-specific totals (``_F_*`` / ``_A_*``)
    peers   [P]    attention: tokens dispatched to each FFN rank
    hist    [B+1]  per-bucket counts (not cumulative), last = above every bound (+Inf)
    layer   [4L]   calls, seconds, tokens, known flag per layer index (model layer number)

Lifetime. The writer creates its block (``O_EXCL``), writes the header, magic last, and unlinks
it on ``close()``, at interpreter exit and when collected. A writer killed by a signal leaks its
block until someone unlinks it: the front-end (``unlink_deployment_blocks`` when the FFN group
stops) or any new writer (``reap_stale_blocks``: blocks whose writer, in this pid namespace, is
gone). A dead FFN rank's block is kept until then, so ``vllm_afd_ffn_rank_alive`` reads 0 and its
last counters stay visible.

Liveness (``vllm_afd_ffn_rank_alive``): 1 when the FFN rank's block exists, is open and its writer
process exists with the start time it recorded (no pid reuse); 0 otherwise. Blocks of another
pid namespace are trusted on their state word alone. Blocks live in this host's ``/dev/shm``:
FFN ranks on another host are reported as not alive (see docs/metrics.md).

The attention side records through module functions (``record_combine``, or
``record_round_trip``, and ``record_error``; one block per process, created on first use), the
FFN side through ``FFNStatsBlock`` (owned by ``ffn_executor.FFNStats``). The collector goes into
vLLM's ``/metrics`` registries through ``patch_metrics_registries`` (patch P6).
"""

from __future__ import annotations

import atexit
import bisect
import hashlib
import json
import logging
import mmap
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm_afd.host import (
    SHM_DIR,
    pid_namespace,
    process_start_time,
    reap_segments,
    unlink_segment,
)

logger = logging.getLogger("vllm.afd")

#: Same name as ``placement.RUNTIME_ENV`` (not imported: this module must stay light, it is
#: imported by every vLLM process through the plugin).
RUNTIME_ENV = "VLLM_AFD_RUNTIME"
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
ERROR_KINDS = ("timeout", "ffn_dead", "other")

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
# FFN scalars.
_F_REQUESTS, _F_TOKENS, _F_BYTES_IN, _F_BYTES_OUT, _F_SECONDS = range(5)
# Attention scalars.
_A_ROUND_TRIPS, _A_TOKENS, _A_BYTES_SENT, _A_BYTES_RECEIVED, _A_SECONDS = range(5)
_A_ERRORS = 5  # one word per ERROR_KINDS entry


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
    """A block this process created and owns (see module docstring)."""

    role: int

    def __init__(self, name: str, rank: int, layers: int, peers: int) -> None:
        reap_stale_blocks()
        self.name = name
        self.rank = rank
        self.layout = layout = _Layout(max(1, layers), max(0, peers), len(BUCKETS))
        size = 8 * layout.words
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            # Same address as a deployment whose writer is still alive: do not steal it.
            raise RuntimeError(
                f"AFD metrics block {name!r} exists and its writer is alive"
            ) from None
        try:
            os.ftruncate(fd, size)
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

    def _observe(self, layer: int, tokens: int, seconds: float) -> None:
        d = self.d
        d[self._o_hist + bisect.bisect_left(self._bounds, seconds)] += 1.0
        if 0 <= layer < self._layers:
            d[self._o_calls + layer] += 1.0
            d[self._o_seconds + layer] += seconds
            d[self._o_tokens + layer] += tokens


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
    ) -> None:
        """One batched expert call of ``layer`` served ``requests`` requests in ``seconds``."""
        d, s = self.d, self._o_scalars
        d[s + _F_REQUESTS] += requests
        d[s + _F_TOKENS] += tokens
        d[s + _F_BYTES_IN] += bytes_in
        d[s + _F_BYTES_OUT] += bytes_out
        d[s + _F_SECONDS] += seconds
        self._observe(layer, tokens, seconds)


class AttentionStatsBlock(_Writer):
    """An attention rank's block: one ``record_round_trip`` per dispatch/combine."""

    role = ROLE_ATTENTION

    def __init__(
        self, addresses: Sequence[str], rank: int, layers: int = ATTENTION_LAYER_CAPACITY
    ) -> None:
        super().__init__(attention_block_name(addresses, rank), rank, layers, len(addresses))

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
        """Writer process still running (and block open); see module docstring."""
        if self.closed:
            return False
        if self.pid_namespace != pid_namespace():
            return True  # not checkable from here
        return _writer_alive(self.pid, self.start_time)


def read_block(name: str) -> BlockSnapshot | None:
    """Copy block ``name``; ``None`` if it does not exist or is not (yet) a valid block."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    if len(raw) < 8 * _HEADER_WORDS:
        return None
    q = memoryview(raw).cast("q")
    if q[_H_MAGIC] != _MAGIC or q[_H_VERSION] != _VERSION:
        return None
    layout = _Layout(q[_H_LAYERS], q[_H_PEERS], q[_H_BUCKETS])
    if len(raw) < 8 * layout.words:
        return None
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
    addresses, num_attention, _ = _spec_fields(spec)
    names = [ffn_block_name(a, f) for f, a in enumerate(addresses)]
    names += [attention_block_name(addresses, a) for a in range(num_attention)]
    return [name for name in names if unlink_segment(name)]


def _spec_fields(spec) -> tuple[tuple[str, ...], int, int]:
    """(addresses, attention ranks, FFN ranks) of a TransportSpec, its dict or its JSON."""
    if isinstance(spec, str):
        spec = json.loads(spec)
    if isinstance(spec, Mapping):
        return (
            tuple(spec.get("addresses") or ()),
            int(spec["num_attention_ranks"]),
            int(spec["num_ffn_ranks"]),
        )
    return tuple(spec.addresses), spec.num_attention_ranks, spec.num_ffn_ranks


# --------------------------------------------------------------------------------------------
# Attention side: per-process recorder (called from attention.remote_experts_impl)
# --------------------------------------------------------------------------------------------

#: The current attention block of this process: (FFN addresses, rank, block or None when it
#: could not be created). One at a time: a new deployment or rank closes the previous one.
_ATTENTION: tuple[tuple[str, ...], int, AttentionStatsBlock | None] | None = None
#: (VLLM_AFD_RUNTIME text, its addresses) last parsed by ``attention_block``.
_RUNTIME: tuple[str, tuple[str, ...]] | None = None
#: (endpoint, block, bytes sent and received per token) last used by ``record_combine``.
_LAST_ENDPOINT: tuple[object, AttentionStatsBlock | None, int, int] | None = None


def attention_block_for(addresses: Sequence[str], rank: int) -> AttentionStatsBlock | None:
    """This process's block as attention rank ``rank`` of the deployment whose FFN ranks have
    these ``addresses``: created on first use; ``None`` if it cannot be (logged, metrics never
    break serving)."""
    global _ATTENTION
    addresses = tuple(addresses)
    current = _ATTENTION
    if current is not None and current[1] == rank and current[0] == addresses:
        return current[2]
    if current is not None and current[2] is not None:
        current[2].close()
    block = None
    try:
        block = AttentionStatsBlock(addresses, rank)
    except Exception as exc:  # noqa: BLE001
        logger.warning("AFD metrics disabled for attention rank %d: %s", rank, exc)
    _ATTENTION = (addresses, rank, block)
    return block


def attention_block(rank: int) -> AttentionStatsBlock | None:
    """``attention_block_for`` the deployment in ``VLLM_AFD_RUNTIME`` (``None`` while unset)."""
    global _RUNTIME
    key = os.environ.get(RUNTIME_ENV)
    if not key:
        return None
    runtime = _RUNTIME
    if runtime is None or runtime[0] != key:
        try:
            runtime = _RUNTIME = (key, _spec_fields(key)[0])
        except (ValueError, KeyError, TypeError):
            return None
    current = _ATTENTION
    if current is not None and current[0] == runtime[1] and rank == current[1]:
        return current[2]
    return attention_block_for(runtime[1], rank)


def record_round_trip(
    layer: int,
    tokens_per_ffn_rank: Mapping[int, int] | Sequence[int],
    bytes_sent: int,
    bytes_received: int,
    exposed_wait_s: float,
    rank: int,
) -> None:
    """Account one dispatch/combine of ``layer`` on attention rank ``rank``.

    Args:
        layer: MoE layer index (``handle.layer``).
        tokens_per_ffn_rank: token rows sent to each FFN rank (``{f: rows.numel()}`` of
            ``handle.token_index``, or a list indexed by FFN rank).
        bytes_sent / bytes_received: payload bytes on the wire (``round_trip_bytes``).
        exposed_wait_s: seconds spent in ``combine`` (FFN time not hidden by overlap).
        rank: global attention rank (``endpoint.rank``).
    """
    block = attention_block(rank)
    if block is not None:
        block.record_round_trip(
            layer, tokens_per_ffn_rank, bytes_sent, bytes_received, exposed_wait_s
        )


def record_combine(endpoint, handle, exposed_wait_s: float) -> None:
    """``record_round_trip`` for ``handle`` (a ``DispatchHandle``) combined by ``endpoint``
    (an ``AttentionTransport``): tokens from ``handle.token_index``, bytes from the endpoint's
    spec (``round_trip_bytes``). The block is bound to the endpoint (a new endpoint, e.g.
    after the FFN group restarted, gets the new deployment's block), so the common case costs
    one identity check."""
    global _LAST_ENDPOINT
    last = _LAST_ENDPOINT
    if last is None or last[0] is not endpoint:
        spec = endpoint.spec
        last = _LAST_ENDPOINT = (
            endpoint,
            attention_block_for(spec.addresses, endpoint.rank),
            *round_trip_bytes(1, spec.hidden_size, spec.dtype.itemsize, spec.top_k),
        )
    _, block, sent_per_token, received_per_token = last
    if block is None or not handle.token_index:
        return  # nothing was sent (an empty batch): not a round trip
    tokens = {f: rows.numel() for f, rows in handle.token_index.items()}
    n = sum(tokens.values())
    block.record_round_trip(
        handle.layer, tokens, n * sent_per_token, n * received_per_token, exposed_wait_s
    )


def record_error(kind: str, rank: int) -> None:
    """Count a transport failure on attention rank ``rank``: ``timeout``, ``ffn_dead`` or
    ``other`` (unknown kinds count as ``other``)."""
    block = attention_block(rank)
    if block is not None:
        block.record_error(kind)


def error_kind(exc: BaseException) -> str:
    """Classify a transport exception for ``record_error`` (by the transports' messages)."""
    from vllm_afd.transport.base import TransportError

    if not isinstance(exc, TransportError):
        return "other"
    text = str(exc)
    if "did not answer within" in text or "timeout" in text.lower():
        return "timeout"
    return "ffn_dead"


def round_trip_bytes(tokens: int, hidden_size: int, itemsize: int, top_k: int) -> tuple[int, int]:
    """(sent, received) payload bytes for ``tokens`` token rows: hidden states plus int32 ids
    and float32 weights out, hidden states back."""
    hidden = tokens * hidden_size * itemsize
    return hidden + tokens * top_k * 8, hidden


def close_attention_block() -> None:
    """Close (and unlink) this process's attention block, if any."""
    global _ATTENTION, _LAST_ENDPOINT
    current, _ATTENTION, _LAST_ENDPOINT = _ATTENTION, None, None
    if current is not None and current[2] is not None:
        current[2].close()


atexit.register(close_attention_block)


# --------------------------------------------------------------------------------------------
# Reader: the Prometheus collector
# --------------------------------------------------------------------------------------------


def _histogram_buckets(snapshot: BlockSnapshot | None) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs, as prometheus_client's own histograms label them."""
    from prometheus_client.utils import floatToGoString

    bounds = snapshot.bounds if snapshot else list(BUCKETS)
    counts = snapshot.hist if snapshot else [0.0] * (len(bounds) + 1)
    out, total = [], 0.0
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        total += count
        out.append((floatToGoString(bound), total))
    return out


class AFDCollector:
    """Prometheus collector of the running deployment's stats blocks (read at scrape time).

    Args:
        runtime: the deployment's TransportSpec (object, dict or JSON); default: read
            ``VLLM_AFD_RUNTIME`` at each scrape (nothing is reported while it is unset).
    """

    def __init__(self, runtime=None) -> None:
        self._runtime = runtime

    def describe(self):
        return list(self._families().values())

    def collect(self):
        runtime = self._runtime if self._runtime is not None else os.environ.get(RUNTIME_ENV)
        if not runtime:
            return []
        try:
            addresses, num_attention, num_ffn = _spec_fields(runtime)
        except (ValueError, KeyError, TypeError):
            return []
        families = f = self._families()
        ffn_blocks = [
            read_block(ffn_block_name(addresses[r], r)) if r < len(addresses) else None
            for r in range(num_ffn)
        ]
        for r, block in enumerate(ffn_blocks):
            rank = str(r)
            f["alive"].add_metric([rank], 1.0 if block is not None and block.alive() else 0.0)
            scalars = block.scalars if block else [0.0] * _SCALAR_WORDS
            f["ffn_requests"].add_metric([rank], scalars[_F_REQUESTS])
            f["ffn_bytes"].add_metric([rank, "in"], scalars[_F_BYTES_IN])
            f["ffn_bytes"].add_metric([rank, "out"], scalars[_F_BYTES_OUT])
            f["ffn_service"].add_metric([rank], _histogram_buckets(block), scalars[_F_SECONDS])
            for layer, (calls, seconds, tokens) in sorted((block.layers if block else {}).items()):
                f["ffn_layer_service"].add_metric([rank, str(layer)], calls, seconds)
                f["ffn_tokens"].add_metric([rank, str(layer)], tokens)
        for a in range(num_attention):
            block = read_block(attention_block_name(addresses, a))
            rank = str(a)
            scalars = block.scalars if block else [0.0] * _SCALAR_WORDS
            peers = block.peers if block else []
            for r in range(num_ffn):
                f["dispatched"].add_metric([rank, str(r)], peers[r] if r < len(peers) else 0.0)
            f["bytes"].add_metric([rank, "sent"], scalars[_A_BYTES_SENT])
            f["bytes"].add_metric([rank, "received"], scalars[_A_BYTES_RECEIVED])
            for i, kind in enumerate(ERROR_KINDS):
                f["errors"].add_metric([rank, kind], scalars[_A_ERRORS + i])
            f["exposed"].add_metric([rank], _histogram_buckets(block), scalars[_A_SECONDS])
            for layer, (calls, seconds, _) in sorted((block.layers if block else {}).items()):
                f["layer_exposed"].add_metric([rank, str(layer)], calls, seconds)
        return list(families.values())

    @staticmethod
    def _families() -> dict:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            SummaryMetricFamily,
        )

        return {
            "alive": GaugeMetricFamily(
                "vllm_afd_ffn_rank_alive",
                "1 if the FFN rank's process is running, else 0 (same-host check).",
                labels=["ffn_rank"],
            ),
            "ffn_service": HistogramMetricFamily(
                "vllm_afd_ffn_service_seconds",
                "FFN service time of one layer batch (experts of all attention ranks' "
                "requests for that layer, replies included).",
                labels=["ffn_rank"],
            ),
            "ffn_layer_service": SummaryMetricFamily(
                "vllm_afd_ffn_layer_service_seconds",
                "FFN service time per MoE layer (count = layer batches served).",
                labels=["ffn_rank", "layer"],
            ),
            "ffn_tokens": CounterMetricFamily(
                "vllm_afd_ffn_tokens",
                "Token rows the FFN rank computed, per MoE layer.",
                labels=["ffn_rank", "layer"],
            ),
            "ffn_requests": CounterMetricFamily(
                "vllm_afd_ffn_requests",
                "Requests (one per attention rank, layer and dispatch) the FFN rank answered.",
                labels=["ffn_rank"],
            ),
            "ffn_bytes": CounterMetricFamily(
                "vllm_afd_ffn_bytes",
                "Payload bytes the FFN rank received (hidden states, expert ids and weights) "
                "and sent back (outputs).",
                labels=["ffn_rank", "direction"],
            ),
            "dispatched": CounterMetricFamily(
                "vllm_afd_dispatched_tokens",
                "Token rows the attention rank dispatched to each FFN rank.",
                labels=["attention_rank", "ffn_rank"],
            ),
            "bytes": CounterMetricFamily(
                "vllm_afd_transport_bytes",
                "Payload bytes the attention rank sent to and received from the FFN ranks.",
                labels=["attention_rank", "direction"],
            ),
            "errors": CounterMetricFamily(
                "vllm_afd_transport_errors",
                "Failed combines on the attention rank, by kind (timeout, ffn_dead, other).",
                labels=["attention_rank", "kind"],
            ),
            "exposed": HistogramMetricFamily(
                "vllm_afd_exposed_ffn_seconds",
                "Time the attention rank waited in combine per round trip (FFN time not "
                "hidden by overlap).",
                labels=["attention_rank"],
            ),
            "layer_exposed": SummaryMetricFamily(
                "vllm_afd_layer_exposed_ffn_seconds",
                "Exposed FFN time per MoE layer (count = round trips).",
                labels=["attention_rank", "layer"],
            ),
        }


# Registries that already have a collector (a registry's collect would report it twice).
_REGISTERED: weakref.WeakSet = weakref.WeakSet()


def register_collector(registry=None) -> AFDCollector | None:
    """Add an ``AFDCollector`` to ``registry`` (default: prometheus_client's global REGISTRY),
    once per registry. Returns it, or ``None`` if the registry already has one."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    if registry in _REGISTERED:
        return None
    collector = AFDCollector()
    registry.register(collector)
    _REGISTERED.add(registry)
    return collector


_PATCHED = "__vllm_afd_metrics_patched__"


def patch_metrics_registries() -> None:
    """P6 ``prometheus_client.multiprocess.MultiProcessCollector.__init__``, wrapped; plus an
    ``AFDCollector`` in prometheus_client's global ``REGISTRY`` (public API, not a patch).

    Why: the AFD metrics are read from shared memory at scrape time by a custom collector,
    which must be in the registry that answers ``/metrics``. With one API server that is the
    global ``REGISTRY`` (vLLM's ``get_prometheus_registry`` returns it). With several
    (``PROMETHEUS_MULTIPROC_DIR`` set) there is no long-lived registry to add to: vLLM's
    ``get_prometheus_registry`` builds a fresh ``CollectorRegistry`` + ``MultiProcessCollector``
    per API server, and prometheus-fastapi-instrumentator's ``/metrics`` handler (the route
    that answers, installed by vLLM's ``instrumentator.metrics.attach_router``) builds another
    one on every scrape. Both are built with ``MultiProcessCollector(registry)``, the one hook
    they share.
    How: register the collector in ``REGISTRY`` once, and wrap ``MultiProcessCollector.__init__``
    so that every registry it joins gets an ``AFDCollector`` too (once per registry). The
    collector reports nothing while ``VLLM_AFD_RUNTIME`` is unset, so non-AFD servers and
    processes that never serve ``/metrics`` are unaffected. Idempotent.
    Remove when: vLLM lets plugins contribute collectors to the registry ``/metrics`` serves.
    """
    from prometheus_client import multiprocess

    register_collector()
    cls = multiprocess.MultiProcessCollector
    original = cls.__init__
    if getattr(original, _PATCHED, False):
        return

    def __init__(self, registry, *args, **kwargs):
        original(self, registry, *args, **kwargs)
        if registry is not None:
            try:
                register_collector(registry)
            except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
                logger.warning("AFD metrics collector not registered: %s", exc)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    setattr(__init__, _PATCHED, True)
    cls.__init__ = __init__
