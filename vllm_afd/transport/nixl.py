"""``--afd-transport nixl``: the slot plane across hosts, over NIXL (docs/architecture.md, "The
slot plane across hosts").

Why NIXL. When the attention-FFN hop crosses the network, the engine should be the one vLLM
and Dynamo already move KV blocks with (``NixlConnector``) and vLLM's elastic expert
parallelism runs on (NIXL-EP): one-sided WRITEs into registered memory through UCX (RDMA on
GPUs, tcp or shared memory elsewhere), not a wire of our own. Nothing here re-implements the
protocol: the slot plane (``slot_plane.py``), its attention endpoint and its FFN side serving
requests as they come (``slots.py``) run unchanged; this module supplies the memory.

The memory (``NixlPlaneMemory``). Every buffer a side owns (an FFN rank's request buffer and
control block, an attention rank's answer buffers) is host memory registered with the side's
NIXL agent, and only its owner reads it (the plane's rule: the side that polls a buffer owns
it). A buffer a side writes into (its peer's) is *mirrored*: ``attach`` returns a local copy,
read once from the peer (a NIXL READ), and the plane writes the mirror exactly as it writes
shared host memory. After its stores the plane calls ``push(regions, line)``: one NIXL WRITE
carries the payload regions into the peer's buffer, and its notification carries the flag's
line (the flag, a request's row count, the writer's CPU). NIXL delivers a transfer's
notification only once the transfer is complete in the target's memory, on every UCX
transport, so the owner stores the line itself when it reads the notification (``pump``, run
between the polls of every host wait: ``wait.Backoff``), the flag last: the protocol's
payload-before-flag order holds without relying on how a transport orders the bytes of one
write. A line without a payload (a step's schedule into the FFN rank's control block) travels
in a notification alone. The owner's reads are the plane's ordinary word reads.

Peers. An FFN rank's address (``NixlAddress``, published through the deployment's
authenticated channels: the FFN directory, Ray) carries its agent's NIXL metadata, its control
block's handle and its host's identity. An attention rank adds that agent, sends its own
metadata in a first notification (``connect``) and mirrors the control block; the FFN rank
adds the attention rank's agent when that notification comes, before it maps the answer
buffer the attention rank offers next. No NIXL listener is started (``enable_listen_thread``
off): metadata never crosses an unauthenticated socket.

Liveness. On the FFN rank's host the attention rank watches its process as on shared memory
(``host.Creator``); across hosts the FFN directory's supervisor (Ray) declares a lost rank and
announces its replacement, which the endpoint's watch picks up (``_check_superseded``). A WRITE
to a dead peer ends in error; it is dropped (logged once), and the wait for its answer ends as
any wait for a lost rank does.

Not yet: device memory (VRAM registered with NIXL, GPUDirect RDMA) and the device's waits
(``slots`` ``waits: device``): this backend serves CPU attention ranks, the FFN side serving
requests as they come.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import struct
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_afd.errors import FFNRankLost, TransportError
from vllm_afd.host import Creator, pid_namespace
from vllm_afd.transport.base import Backend, TransportSpec
from vllm_afd.transport.control import schedule_words
from vllm_afd.transport.control_block import ControlBlock
from vllm_afd.transport.endpoint import AttentionEndpoint, watch_creator
from vllm_afd.transport.slot_plane import PlaneLayout, PlaneMemory
from vllm_afd.transport.slot_plane_host import HostWords
from vllm_afd.transport.slots import PlaneFFN
from vllm_afd.transport.wait import WaitPolicy

logger = logging.getLogger("vllm.afd")

#: ``nixl:`` + base64 of the address's JSON (``NixlAddress``).
ADDRESS_PREFIX = "nixl:"
#: A notification's kind: stores (``_STORES``: the line's address, its words, the regions
#: carried inline; then the regions' ``(address, bytes)``, the line's words, the regions'
#: bytes), a peer's agent metadata (``connect``), or a peer closing (``close``).
_STORES, _HELLO, _BYE = b"S", b"H", b"B"
_HEADER = struct.Struct("<qqq")
_REGION = struct.Struct("<qq")
#: ``UCX_NET_DEVICES`` where the operator set none: the loopback interface.
LOOPBACK_DEVICE = "lo"
#: Payloads up to this many bytes travel inside the notification (one message); larger ones
#: by a WRITE the notification follows (docs/benchmarks.md, nixl).
INLINE_BYTES = 64 * 1024


def nixl_problem() -> str | None:
    """Why NIXL cannot run here (``None``: it can)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return (
            f"nixl: NIXL is not installed ({exc}): pip install --no-deps nixl-cu12==1.5.1 "
            "nixl==1.5.1 (make venv does)"
        )
    return None


def make_agent(name: str) -> Any:
    """A NIXL agent named ``name``, as every one of ours is made: no progress thread (the
    waits pump), no listener (metadata never crosses an unauthenticated socket), and UCX's
    tcp transport, which listens unauthenticated on every interface it uses, on the loopback
    interface unless the operator named the fabric (``UCX_NET_DEVICES``; docs/user-guide.md,
    "Security")."""
    from nixl._api import nixl_agent, nixl_agent_config

    os.environ.setdefault("UCX_NET_DEVICES", LOOPBACK_DEVICE)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False))


def host_identity() -> int:
    """This host and pid namespace as one int64 (60 bits of the boot id, a random UUID, with
    the namespace's inode): pids compare only between processes with the same identity."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = int(f.read().strip().replace("-", "")[:15], 16)
    except (OSError, ValueError):
        return 0
    return boot ^ pid_namespace()


@dataclass(frozen=True)
class NixlAddress:
    """What an attention rank needs to reach an FFN rank: its agent's name and metadata, and
    its control block's handle and size."""

    agent: str
    metadata: bytes
    control: str
    control_bytes: int

    def __str__(self) -> str:
        fields = {
            "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode(),
            "control": self.control,
            "control_bytes": self.control_bytes,
        }
        return ADDRESS_PREFIX + base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()

    @classmethod
    def parse(cls, text: str) -> NixlAddress:
        """Raises ``TransportError`` naming what is wrong with ``text``."""
        try:
            if not text.startswith(ADDRESS_PREFIX):
                raise ValueError(f"it does not start with {ADDRESS_PREFIX!r}")
            fields = json.loads(base64.urlsafe_b64decode(text[len(ADDRESS_PREFIX) :]))
            return cls(
                str(fields["agent"]),
                base64.b64decode(fields["metadata"]),
                str(fields["control"]),
                int(fields["control_bytes"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(
                f"nixl: not an FFN rank's address ({exc}): {text[:60]!r}"
            ) from None


@dataclass(frozen=True)
class _Mirror:
    """A local copy of a peer's buffer: the peer's agent, where the copy starts (``base``)
    and how far the peer's buffer lies from it (``delta``: remote address minus local), and
    the copy's bytes (a memoryview: a slice of it costs a fraction of a tensor's)."""

    agent: str
    base: int
    delta: int
    data: memoryview


class NixlPlaneMemory(HostWords):
    """The slot plane's memory over NIXL (module docstring): buffers this process owns are
    registered host memory; a peer's buffer is a registered local mirror, its stores reach the
    peer by ``push`` and come in through ``pump``. Host waits only."""

    def __init__(
        self,
        timeout_s: float = 30.0,
        policy: WaitPolicy | None = None,
        role: str = "afd",
        reads_on_attach: bool = True,
    ) -> None:
        problem = nixl_problem()
        if problem is not None:
            raise RuntimeError(problem)
        from nixl._bindings import nixlBackendError, nixlRemoteDisconnectError

        super().__init__(timeout_s, False, policy)
        self.reads_on_attach = reads_on_attach
        self.name = f"vllm-afd-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = make_agent(self.name)
        #: What NIXL raises for a peer that went away (a send to it is dropped: ``_drop``).
        self._peer_errors = (nixlRemoteDisconnectError, nixlBackendError)
        #: Buffers this process owns: base address -> (size, bytes).
        self._owned: dict[int, tuple[int, memoryview]] = {}
        self._owner_of: dict[int, tuple[memoryview, int]] = {}  # ``_owner``'s answers
        #: Mirrors of peers' buffers: (local base, local end, mirror), and by line address.
        self._mirrors: list[tuple[int, int, _Mirror]] = []
        self._mirror_of: dict[int, _Mirror] = {}
        #: Every registered buffer by base address: the buffer (kept alive), its registration
        #: and, for a mirror, its peer's agent.
        self._registered: dict[int, tuple[torch.Tensor, Any, str | None]] = {}
        self._retired: set[str] = set()  # replaced peers whose mirrors go (``forget``)
        self._inflight: list[Any] = []  # WRITEs posted and not yet complete
        self._failed: set[str] = set()  # agents a WRITE failed to (logged once each)
        self._peers: list[str] = []  # agents connected to, or that connected to this one
        #: Agents that closed (their ``close`` said so): their buffers are gone.
        self.gone: set[str] = set()
        self.push: Callable[[Sequence[torch.Tensor], torch.Tensor], None] = self._push
        self.pump: Callable[[], None] = self._pump

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (what a peer adds to write into its buffers)."""
        metadata: bytes = self.agent.get_agent_metadata()
        return metadata

    def _register(self, nbytes: int, peer: str | None = None) -> torch.Tensor:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self._registered[buffer.data_ptr()] = (buffer, self.agent.register_memory(buffer), peer)
        return buffer

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        """A registered buffer; its handle is ``agent|address|size``. Peers already connected
        get this agent's metadata again (a peer reaches only the buffers its copy names)."""
        buffer = self._register(nbytes)
        self._owned[buffer.data_ptr()] = (nbytes, buffer.numpy().data.cast("B"))
        for agent in self._peers:
            self._notify(agent, _HELLO + self.metadata)
        return buffer, f"{self.name}|{buffer.data_ptr()}|{nbytes}"

    def _add(self, metadata: bytes) -> str:
        """Add (or update) a peer's agent; its name."""
        name: bytes | str = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def connect(self, metadata: bytes) -> str:
        """Add a peer's agent (its ``metadata``) and send it ours; returns its name."""
        agent = self._add(metadata)
        self._peers.append(agent)
        self._notify(agent, _HELLO + self.metadata)
        return agent

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        """A registered mirror of the peer's buffer ``handle`` (its agent added already:
        ``connect``, or its first notification), read from it once where
        ``reads_on_attach`` (an attention rank: the FFN rank's serving loop answers the READ);
        else zeroed (an FFN rank only writes its mirrors, and never blocks its loop on a peer).

        Raises:
            TransportError: for a handle of another size, or a READ that failed or did not
                complete within ``timeout_s``.
        """
        agent, address, size = _parse_handle(handle)
        if size != nbytes:
            raise TransportError(f"nixl: buffer {handle!r} is not of the {nbytes} bytes awaited")
        mirror = self._register(nbytes, agent)
        base = mirror.data_ptr()
        data = mirror.numpy().data.cast("B")
        self._mirrors.append((base, base + nbytes, _Mirror(agent, base, address - base, data)))
        if self.reads_on_attach:
            self._read(mirror, agent, address, handle)
        return mirror

    def _read(self, mirror: torch.Tensor, agent: str, address: int, handle: str) -> None:
        nbytes = mirror.numel()
        local = self.agent.get_xfer_descs([(mirror.data_ptr(), nbytes, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(address, nbytes, 0)], "DRAM")
        xfer = self.agent.initialize_xfer("READ", local, remote, agent)
        state = self.agent.transfer(xfer)
        deadline = time.perf_counter() + self.timeout_s
        while state == "PROC" and time.perf_counter() < deadline:
            state = self.agent.check_xfer_state(xfer)
        self.agent.release_xfer_handle(xfer)
        if state != "DONE":
            raise TransportError(
                f"nixl: reading buffer {handle!r} of agent {agent} failed ({state})"
            )

    def _mirror(self, line: torch.Tensor) -> _Mirror | None:
        """The mirror holding ``line``; ``None`` once its peer was forgotten (``forget``)."""
        at = line.data_ptr()
        found = self._mirror_of.get(at)
        if found is None:
            found = next((m for start, end, m in self._mirrors if start <= at < end), None)
            if found is not None:
                self._mirror_of[at] = found
        return found

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``HostWords.readdress``; where ``new`` mirrors another peer's buffer (a lost FFN
        rank's replacement, a restarted front-end), ``old``'s peer is forgotten (``forget``),
        also one that died without saying so."""
        super().readdress(old, new)
        gone, now = self._mirror(old), self._mirror(new)
        if gone is not None and now is not None and gone.agent != now.agent:
            self.forget(gone.agent)

    def forget(self, agent: str) -> None:
        """``agent`` was replaced or closed: its mirrors are deregistered (once no WRITE to it
        is in flight: ``_pump``) and a push into one is dropped from now on."""
        self._retired.add(agent)
        self._mirrors = [m for m in self._mirrors if m[2].agent != agent]
        self._mirror_of = {at: m for at, m in self._mirror_of.items() if m.agent != agent}
        if agent in self._peers:
            self._peers.remove(agent)

    def _push(self, regions: Sequence[torch.Tensor], line: torch.Tensor) -> None:
        """``PlaneMemory.push``: one notification carrying the line and, up to
        ``INLINE_BYTES``, the regions; larger regions go first by one WRITE, which the
        notification follows (NIXL sends it once the WRITE is complete)."""
        self._pump()  # progress what is in flight (a large WRITE needs its sender's)
        mirror = self._mirror(line)
        if mirror is None:
            return  # its peer is gone (``forget``)
        base, data = mirror.base, mirror.data
        spans = [(r.data_ptr() - base, r.numel() * r.element_size()) for r in regions]
        inline = sum(n for _, n in spans) <= INLINE_BYTES
        at, words = line.data_ptr() - base, line.numel()
        head = _HEADER.pack(at + base + mirror.delta, words, len(spans) if inline else 0)
        parts: list[bytes | memoryview] = [_STORES, head]
        if inline:
            parts += (_REGION.pack(base + mirror.delta + start, n) for start, n in spans)
        parts.append(data[at : at + 8 * words])
        if inline:
            parts += (data[start : start + n] for start, n in spans)
            self._notify(mirror.agent, b"".join(parts))
            return
        local = [(base + start, n, 0) for start, n in spans]
        remote = [(base + mirror.delta + start, n, 0) for start, n in spans]
        try:
            xfer = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs(remote, "DRAM"),
                mirror.agent,
                b"".join(parts),
            )
            state = self.agent.transfer(xfer)
        except self._peer_errors as exc:
            self._drop(mirror.agent, exc)
            return
        if state == "PROC":
            self._inflight.append((xfer, mirror.agent))
        else:
            self._done(xfer, mirror.agent, state)

    def _notify(self, agent: str, message: bytes) -> None:
        """A notification to ``agent``; dropped if it went away (``_drop``)."""
        try:
            self.agent.send_notif(agent, message)
        except self._peer_errors as exc:
            self._drop(agent, exc)

    def _done(self, xfer: Any, agent: str, state: str) -> None:
        self.agent.release_xfer_handle(xfer)
        if state == "ERR":
            self._drop(agent, "the write ended in error")

    def _drop(self, agent: str, why: object) -> None:
        """What was sent to ``agent`` is lost: logged once per agent. The wait for its answer
        ends as any wait on a lost FFN rank does (its process watched, or the FFN directory's
        verdict), and failover sends the use again to the replacement."""
        if agent not in self._failed:
            self._failed.add(agent)
            logger.warning(
                "AFD nixl: agent %s went away (%s); what was sent to it is lost", agent, why
            )

    def _pump(self) -> None:
        """Complete posted WRITEs, then store the lines peers pushed, each its flag last."""
        if self._inflight:
            still = []
            for xfer, agent in self._inflight:
                state = self.agent.check_xfer_state(xfer)
                if state == "PROC":
                    still.append((xfer, agent))
                else:
                    self._done(xfer, agent, state)
            self._inflight = still
        if self._retired:
            self._deregister_retired()
        notifs = self.agent.get_new_notifs()
        if not notifs:
            return
        for sender, messages in notifs.items():
            for message in messages:
                if message[:1] == _HELLO:  # a peer that will offer buffers to write into
                    agent = self._add(message[1:])
                    if agent not in self._peers:
                        self._peers.append(agent)
                    try:
                        self.agent.make_connection(agent)
                    except self._peer_errors as exc:
                        self._drop(agent, exc)
                elif message[:1] == _BYE:
                    closed = message[1:].decode()
                    self.gone.add(closed)
                    self.forget(closed)
                elif message[:1] == _STORES:
                    try:
                        self._store(message)
                    except (TransportError, struct.error, ValueError) as exc:
                        logger.warning(
                            "AFD nixl: dropped a malformed store from %s: %s", sender, exc
                        )

    def _store(self, message: bytes) -> None:
        """Apply a ``_STORES`` notification: the inline regions, then the line, its flag
        last. Nothing is stored unless every part lies inside a buffer of this process.

        Raises:
            TransportError, struct.error, ValueError: for a message that is not one.
        """
        view = memoryview(message)
        at, count, inline = _HEADER.unpack_from(view, 1)
        offset = 1 + _HEADER.size + inline * _REGION.size
        line, start = self._owner(at, 8 * count)
        values = view[offset : offset + 8 * count].cast("q")
        offset += 8 * count
        regions, end = [], offset
        for i in range(inline):
            address, nbytes = _REGION.unpack_from(view, 1 + _HEADER.size + i * _REGION.size)
            regions.append((self._owner(address, nbytes), nbytes))
            end += nbytes
        if count < 1 or start % 8 or end != len(view):
            raise ValueError(f"{len(view)} bytes do not hold the line and regions they name")
        for (data, begin), nbytes in regions:
            data[begin : begin + nbytes] = view[offset : offset + nbytes]
            offset += nbytes
        words, first = line.cast("q"), start // 8
        words[first + 1 : first + count] = values[1:]
        words[first] = values[0]  # the flag last

    def _deregister_retired(self) -> None:
        """Deregister the mirrors of forgotten peers with no WRITE in flight, and drop them."""
        busy = {agent for _, agent in self._inflight}
        for agent in self._retired - busy:
            self._retired.discard(agent)
            for base, (_, registered, peer) in list(self._registered.items()):
                if peer == agent:
                    self.agent.deregister_memory(registered)
                    del self._registered[base]
            try:
                self.agent.remove_remote_agent(agent)
            except Exception:  # noqa: BLE001 - never added, or gone with its connection
                pass

    def _owner(self, address: int, nbytes: int) -> tuple[memoryview, int]:
        """The owned buffer holding ``nbytes`` bytes at ``address`` (its bytes) and
        ``address``'s offset in it.

        Raises:
            TransportError: for bytes not inside one buffer of this process.
        """
        found = self._owner_of.get(address)
        if found is None:
            for base, (size, data) in self._owned.items():
                if base <= address < base + size:
                    found = self._owner_of[address] = (data, address - base)
                    break
        if found is None or not 0 <= nbytes <= len(found[0]) - found[1]:
            raise TransportError(
                f"nixl: a peer stored {nbytes} bytes at {address:#x}, outside every buffer of "
                "this process"
            )
        return found

    def close(self) -> None:
        """Tell the peers this agent closes, deregister every buffer; the agent goes with this
        object."""
        for agent in self._peers:
            try:
                self.agent.send_notif(agent, _BYE + self.name.encode())
            except self._peer_errors:
                pass  # gone already
        self._peers.clear()
        for _, registered, _ in self._registered.values():
            try:
                self.agent.deregister_memory(registered)
            except Exception:  # noqa: BLE001 - a peer's teardown may race ours
                pass
        self._registered.clear()
        self._owned.clear()
        self._words.clear()


def _parse_handle(handle: str) -> tuple[str, int, int]:
    try:
        agent, address, size = handle.rsplit("|", 2)
        return agent, int(address), int(size)
    except ValueError:
        raise TransportError(f"nixl: not a buffer handle: {handle[:80]!r}") from None


class NixlAttention(AttentionEndpoint):
    """The slot plane's attention endpoint, its FFN ranks reached through NIXL."""

    def __init__(self, spec: TransportSpec, rank: int, wait: WaitPolicy | None = None) -> None:
        self._agents: dict[int, str] = {}  # per FFN rank, its agent (``_connect``)
        super().__init__(spec, rank, wait)

    def _make_memory(self) -> PlaneMemory:
        self.nixl = NixlPlaneMemory(self.spec.timeout_s, self.wait, "attention")
        return self.nixl

    def _connect(self, ffn_rank: int, address: str) -> ControlBlock:
        """As on shared memory; an FFN rank that cannot be reached (its agent refuses the
        connection, the READ of its control block fails) is lost."""
        peer = NixlAddress.parse(address)
        try:
            self._agents[ffn_rank] = self.nixl.connect(peer.metadata)
            mirror = self.nixl.attach(peer.control, peer.control_bytes)
        except (TransportError, *self.nixl._peer_errors) as exc:
            raise FFNRankLost(ffn_rank, f"FFN rank {ffn_rank} unreachable: {exc!r}") from None
        return ControlBlock.open(address, mirror, self.layout, self.spec.moe_layers, self.nixl.push)

    def _check_alive(self, ffn_ranks: Collection[int]) -> None:
        """As on shared memory; an FFN rank that closed says so in a notification (its
        control block here is a mirror, which its closing does not reach)."""
        for f in ffn_ranks:
            if self._agents[f] in self.nixl.gone:
                raise FFNRankLost(f, f"FFN rank {f} (agent {self._agents[f]}) closed its endpoint")
        super()._check_alive(ffn_ranks)

    def _watch(self, ffn_rank: int, control: ControlBlock) -> Creator:
        """The FFN process, watched where it runs on this host and pid namespace (its
        control block records ``host_identity``); on another, its supervisor watches it."""
        if control.pid_namespace != host_identity():
            return Creator(control.pid, None)  # not checkable from here
        return watch_creator(ffn_rank, control, pid_namespace())


class NixlFFN(PlaneFFN):
    """The FFN side serving requests as they come, its buffers registered with NIXL; its
    address is a ``NixlAddress``."""

    def _make_memory(self) -> PlaneMemory:
        self.nixl = NixlPlaneMemory(self.spec.timeout_s, self._wait, "ffn", reads_on_attach=False)
        return self.nixl

    def _make_control(self) -> ControlBlock:
        layout: PlaneLayout = self.plane.layout
        size = ControlBlock.size(layout, schedule_words(self.spec.moe_layers))
        buffer, handle = self.nixl.create(size)
        address = NixlAddress(self.nixl.name, self.nixl.metadata, handle, size)
        return ControlBlock.format(
            str(address),
            buffer,
            layout,
            self.spec.moe_layers,
            self.plane.handle,
            host_identity(),
        )


class NixlBackend(Backend):
    """The slot plane over NIXL: attention and FFN ranks on any hosts Ray places them, UCX
    choosing the fabric (``UCX_TLS``; tcp on these machines, RDMA on GPU clusters)."""

    name = "nixl"
    attention = NixlAttention
    ffn = NixlFFN
    needs_steps = True
    settings: ClassVar[Mapping[str, type]] = {}

    @classmethod
    def host_problem(cls) -> str | None:
        return nixl_problem()

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        if attention_device == "cpu" and ffn_device == "cpu":
            return None
        return (
            f"{cls.name}: GPU memory through NIXL (VRAM, GPUDirect RDMA) is not built yet; "
            "this deployment has attention ranks on "
            f"{attention_device} and FFN ranks on {ffn_device} (use --afd-transport slots "
            "within one node)"
        )


__all__ = ["NixlAddress", "NixlAttention", "NixlBackend", "NixlFFN", "NixlPlaneMemory"]
