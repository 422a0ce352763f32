"""The slot plane's device layer (``slot_plane.py``): buffers in device memory shared by CUDA
IPC, and Triton kernels, one per protocol operation: signal, wait, publish (or copy_parts then
release, for a large use), publish_all, wait_gather, wait_sum. Everything else is the shared
protocol.
PyTorch and Triton only (the GPU machine this project is lent has no vLLM or DeepEP).

Why these primitives: a use is one kernel per side and direction around the MoE kernel (issue
41, against a copy-engine copy per part, a signal, a wait and a ``cat`` or an add per rank).

* ``publish`` (an attention rank's send): one program copies the parts element by element into
  the peer's slot (the expert ids converted to the slot's int32), a CTA barrier orders its
  threads' stores, then the flag is stored with release semantics at system scope (a store,
  not a remote atomic read-modify-write, which PCIe peers lack); a use over
  ``FUSED_MAX_BYTES`` (a prefill chunk, a large decode batch) is copied by ``copy_parts``'
  programs, then ``release`` stores the flag (stream order). Their destinations and flag are
  read from a table row, which ``readdress`` rewrites when a lost FFN rank's replacement takes
  its place, so that the sends a CUDA graph captured reach the new buffer. A strided part goes
  by the copy engines and ``signal`` (an ``atomic_xchg`` with release semantics at system
  scope, after the copies in stream order).
* ``wait_gather`` (an FFN rank's take of one use from every attention rank): a program per
  attention rank waits for its request, then copies its rows next to the others' for the one
  forward (the slots lie a slot apart); ``wait`` (one flag: an FFN rank with one attention
  rank, whose experts read the slot in place).
* ``publish_all`` (the FFN rank's answers): a program per attention rank publishes its share
  of the forward's output into that rank's own buffer.
* ``wait_sum`` (an attention rank's combine): each program waits for every FFN rank's answer,
  then sums its blocks of them, in FFN rank order and in float32, into the combine's output.

The fused kernels read their parts' addresses from a small table on the device, built once per
set of parts (a CUDA graph replays the table its capture read). The value a flag carries is
computed on the device from the sender's step word (``slot_plane``: the use's value), so a
captured graph publishes and awaits the right value on every replay without Python. A wait
spins on an acquire load (``atomic_add(flag, 0)``) at system scope until ``|flag|`` reaches the
awaited value. A kernel cannot raise: a wait that gives up at its deadline (the GPU's
``%globaltimer`` against the transport's ``timeout_s``: a dead peer costs a wait seconds, not a
poll budget of minutes), or ends on another value than its own (an error answer, a peer that
moved on), or that a host watchdog aborted (a word in pinned host memory it polls), records its
use's value in a word of pinned host memory (``slot_plane_failures.RecordedWaits``), and ``check()``
reads that word at the next step boundary without a device sync. Under Triton's interpreter
(the suite: no device clock) a wait is bounded by a number of polls instead.

CUDA IPC, not PyTorch symmetric memory: it needs no process-group rendezvous (NCCL refuses two
ranks on one GPU) and works for two processes sharing a device. The handle peers attach by is
the storage's IPC handle as text (``UntypedStorage._share_cuda_``, what
``torch.multiprocessing``'s reductions send, here written into the FFN rank's control block);
the creator keeps the buffer alive until ``close``. Across nodes the same protocol would sit
on NVSHMEM (docs/architecture.md).

NOT YET RUN ON A GPU unless the closing note of issue 19 says otherwise.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from functools import cache
from types import ModuleType
from typing import Any

import torch

from vllm_afd.transport.slot_plane import (
    publish_by_copies,
    publish_each,
    wait_then_gather,
    wait_then_sum,
)
from vllm_afd.transport.slot_plane_failures import RecordedWaits

#: Polls a wait makes before it gives up where there is no device clock to bound it by (the
#: interpreter in the suite); on a GPU a wait is bounded by time (``CudaPlaneMemory``).
DEFAULT_MAX_SPINS = 1 << 26


#: A use's payload up to this size goes in one fused kernel with its flag (``publish``): one
#: program copies it word by word, then publishes (a decode use: 16 tokens x 7168 x bf16 is
#: 224 KiB). A larger one (a prefill chunk) is copied by the copy engines, then signalled.
FUSED_MAX_BYTES = 1 << 20
#: Elements each step of the fused copy moves.
_FUSED_BLOCK = 4096
#: The fused kernels' tables kept per memory (one per set of parts: slot and ranks), besides
#: those a CUDA graph captured, which are kept for good (``_table``).
_MAX_TABLES = 4096
#: Programs of ``copy_parts`` at most (a use over ``FUSED_MAX_BYTES``).
_COPY_PROGRAMS = 32
#: Programs of ``wait_sum`` at most: each spins on the answers' flags before its blocks, on an
#: SM the other microbatch's attention could use (DBO), so few; a decode use's 16 x 7168
#: elements are 28 blocks, 3-4 per program.
_SUM_PROGRAMS = 8


@cache
def _kernels() -> ModuleType:
    """The kernels' module (``slot_plane_kernels``), imported on first use: it needs Triton."""
    from vllm_afd.transport import slot_plane_kernels

    return slot_plane_kernels


def _fusable(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The parts as (destination, source) pairs a kernel can copy, or ``None`` (more than
    three parts, a strided tensor); how many bytes one program takes is the caller's
    (``_nbytes``)."""
    if len(dsts) > 3:
        return None
    parts = list(zip(dsts, srcs, strict=True))
    for dst, src in parts:
        if dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            return None
    return parts


def _nbytes(dsts: Sequence[torch.Tensor]) -> int:
    return sum(d.numel() * d.element_size() for d in dsts)


def _row(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], flag: torch.Tensor) -> tuple[int, ...]:
    """``publish``'s table row: its destinations' addresses (the flag's for an absent part),
    then the flag's."""
    dsts = [d.data_ptr() for d, _ in parts] + [flag.data_ptr()] * (3 - len(parts))
    return (*dsts, flag.data_ptr())


def _hex(data: bytes | None) -> str | None:
    return None if data is None else data.hex()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else bytes.fromhex(text)


class TritonWaits(RecordedWaits):
    """The plane's operations as the Triton kernels above, on whatever memory holds the flags:
    device memory here (``CudaPlaneMemory``), host memory under Triton's interpreter in the
    suite (``testing.slot_plane_check.InterpretedPlaneMemory``: the same kernels, run on every
    push). ``errors`` and ``aborted`` lie in host memory the device reads and writes (pinned, on
    GPUs)."""

    #: A wait's bound: nanoseconds of the device's global timer (``%globaltimer``) where the
    #: device has one, else this many polls.
    deadline_ns: int | None = None
    max_spins: int = DEFAULT_MAX_SPINS
    device: torch.device
    stores_on_host = False
    push = None  # stores land in the peer's memory (CUDA IPC)
    pump = None

    @property
    def _bound(self) -> dict[str, Any]:
        """A wait kernel's bound and its kind (``TIMED``)."""
        timed = self.deadline_ns is not None
        return {"bound": self.deadline_ns if timed else self.max_spins, "TIMED": timed}

    def signal(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        failed: bool = False,
        missed: torch.Tensor | None = None,
    ) -> None:
        _kernels().signal[(1,)](
            flag,
            step,
            position + 1,
            -1 if failed else 1,
            flag if missed is None else missed,
            MISSED=missed is not None,
            num_warps=1,
        )

    def publish(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
    ) -> None:
        """Up to three contiguous parts: one kernel for a use up to ``FUSED_MAX_BYTES``, else
        ``copy_parts`` over several programs, then ``release``; the destinations and the flag
        (the peer's buffer) read from a table ``readdress`` rewrites when a replacement's
        buffer takes the place of this one (a CUDA graph replays the table). Otherwise (a
        strided part) the copies, then ``signal``."""
        parts = _fusable(dsts, srcs)
        row = None if parts is None else self._table([_row(parts, flag)])
        if parts is None or row is None:
            publish_by_copies(self.signal, dsts, srcs, flag, step, position)
            return
        args: list[Any] = [row]
        for d, s in parts:
            args += [d, s, d.numel()]
        args += [flag, flag, 0] * (3 - len(parts))  # absent parts: no words to copy
        kernels = _kernels()
        if _nbytes(dsts) <= FUSED_MAX_BYTES:
            kernels.publish[(1,)](*args, step, position + 1, BLOCK=_FUSED_BLOCK, num_warps=4)
            return
        programs = min(-(-max(d.numel() for d, _ in parts) // _FUSED_BLOCK), _COPY_PROGRAMS)
        kernels.copy_parts[(programs,)](*args, BLOCK=_FUSED_BLOCK, num_warps=4)
        kernels.release[(1,)](row, step, position + 1, num_warps=1)

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` takes the place of ``old`` (a lost FFN rank's request buffer, in this
        process): the tables whose words address ``old`` (``publish``'s destinations and
        flag) now address the same bytes of ``new``, rewritten in place, since a CUDA graph
        replays the tables its capture read (vLLM does not capture its graphs again)."""
        start, nbytes = old.data_ptr(), old.numel() * old.element_size()
        shift = new.data_ptr() - start
        if new.numel() * new.element_size() != nbytes:
            raise ValueError(f"a buffer of other size than {nbytes} bytes cannot replace it")

        def moved(key: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
            end = start + nbytes
            return tuple(tuple(w + shift if start <= w < end else w for w in row) for row in key)

        tables = {}
        for key, table in self._tables.items():
            to = moved(key)
            if to != key:
                table.copy_(torch.tensor(to, dtype=torch.int64))
                if key in self._captured:
                    self._captured.discard(key)
                    self._captured.add(to)
            tables[to] = table
        self._tables = tables

    def publish_all(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
        missed: torch.Tensor | None = None,
    ) -> None:
        """One kernel, a program per part, where every part is fusable and of one pair of
        types; otherwise a copy and a ``signal`` each."""
        table = None
        if len(dsts) > 1 and all(
            d.dtype == dsts[0].dtype
            and s.dtype == srcs[0].dtype
            and _fusable((d,), (s,))
            and _nbytes((d,)) <= FUSED_MAX_BYTES
            for d, s in zip(dsts, srcs, strict=True)
        ):
            rows = zip(dsts, srcs, flags, steps, positions, strict=True)
            table = self._table(
                [
                    (d.data_ptr(), s.data_ptr(), d.numel(), f.data_ptr(), t.data_ptr(), p + 1)
                    for d, s, f, t, p in rows
                ]
            )
        if table is None:
            publish_each(self.signal, dsts, srcs, flags, steps, positions, missed)
            return
        _kernels().publish_all[(len(dsts),)](
            table,
            dsts[0],
            srcs[0],
            table if missed is None else missed,
            MISSED=missed is not None,
            BLOCK=_FUSED_BLOCK,
            num_warps=4,
        )

    @functools.cached_property
    def _tables(self) -> dict[tuple[tuple[int, ...], ...], torch.Tensor]:
        """The fused kernels' tables by their rows (``_table``)."""
        return {}

    @functools.cached_property
    def _captured(self) -> set[tuple[tuple[int, ...], ...]]:
        """The rows of the tables a CUDA graph captured: a graph keeps only their address,
        so they live as long as this memory."""
        return set()

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _table(self, rows: Sequence[tuple[int, ...]]) -> torch.Tensor | None:
        """A fused kernel's table of int64 ``rows`` (addresses, counts) on the memory's
        device, built once per set of rows (a CUDA graph replays the one its capture read);
        ``None`` where a capture would have to build it (a copy to the device is no graph
        node: the step's eager run before its capture builds it). Past ``_MAX_TABLES`` tables
        no graph captured, those are dropped (prefill chunks of every size are rows too)."""
        key = tuple(rows)
        table = self._tables.get(key)
        capturing = self._capturing()
        if table is None:
            if capturing:
                return None
            if len(self._tables) - len(self._captured) >= _MAX_TABLES:
                self._tables = {k: t for k, t in self._tables.items() if k in self._captured}
            table = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self._tables[key] = table
        if capturing:
            self._captured.add(key)
        return table

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        missed: torch.Tensor | None = None,
    ) -> None:
        _kernels().wait[(1,)](
            flag,
            step,
            position + 1,
            self.errors,
            self.aborted,
            **self._bound,
            missed_ptr=flag if missed is None else missed,
            MISSED=missed is not None,
            num_warps=1,
        )

    def wait_gather(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
        srcs: Sequence[Sequence[torch.Tensor]],
        dsts: Sequence[torch.Tensor],
        what: Callable[[int], str],
        missed: torch.Tensor | None = None,
    ) -> list[int | None]:
        """One kernel, a program per sender (its wait, then its rows' copy), where every part
        is contiguous; otherwise ``wait_then_gather``."""
        x, ids, weights = dsts
        table = None
        if all(t.is_contiguous() for parts in srcs for t in parts) and all(
            t.is_contiguous() for t in dsts
        ):
            first, rows = 0, []
            for flag, step, position, (sx, sids, sweights) in zip(
                flags, steps, positions, srcs, strict=True
            ):
                rows.append(
                    (
                        flag.data_ptr(),
                        step.data_ptr(),
                        position + 1,
                        sx.data_ptr(),
                        sids.data_ptr(),
                        sweights.data_ptr(),
                        first,
                        sx.shape[0],
                    )
                )
                first += sx.shape[0]
            table = self._table(rows)
        if table is None:
            return wait_then_gather(self.wait, flags, steps, positions, srcs, dsts, what, missed)
        _kernels().wait_gather[(len(flags),)](
            table,
            x,
            ids,
            weights,
            x.shape[1],
            ids.shape[1],
            self.errors,
            self.aborted,
            **self._bound,
            missed=table if missed is None else missed,
            MISSED=missed is not None,
            BLOCK=_FUSED_BLOCK,
            num_warps=4,
        )
        return [None] * len(flags)

    def wait_sum(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        position: int,
        srcs: Sequence[torch.Tensor],
        out: torch.Tensor,
        what: Callable[[int], str],
    ) -> list[int | None]:
        """One kernel (its programs each wait for every answer, then sum their blocks) where
        the answers are contiguous and of ``out``'s type; otherwise ``wait_then_sum``."""
        table = None
        if out.is_contiguous() and all(s.is_contiguous() and s.dtype == out.dtype for s in srcs):
            rows = zip(flags, steps, srcs, strict=True)
            table = self._table(
                [(f.data_ptr(), t.data_ptr(), position + 1, s.data_ptr()) for f, t, s in rows]
            )
        if table is None:
            return wait_then_sum(self.wait, flags, steps, position, srcs, out, what)
        n = out.numel()
        programs = max(1, min(-(-n // _FUSED_BLOCK), _SUM_PROGRAMS))
        _kernels().wait_sum[(programs,)](
            table,
            len(flags),
            out,
            n,
            self.errors,
            self.aborted,
            **self._bound,
            BLOCK=_FUSED_BLOCK,
            num_warps=4,
        )
        return [None] * len(flags)


class CudaPlaneMemory(TritonWaits):
    """Device memory of ``device`` for the slot plane (``slot_plane.PlaneMemory``)."""

    #: vLLM's async scheduling prepares and launches a step while the device runs the last.
    lag = 1

    def __init__(self, device: torch.device | int = 0, timeout_s: float = 30.0):
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.deadline_ns = int(timeout_s * 1e9)
        # pinned host memory, which the device reads and writes through the same address
        # (UVA), as NCCL polls its abort flag: the failed waits' word, read by ``check`` with
        # no device sync, and the abort word, set by a host watchdog while a wait spins
        self._record_failures(
            torch.zeros(1, dtype=torch.int64).pin_memory(),
            torch.zeros(1, dtype=torch.int64).pin_memory(),
            f"{timeout_s:g} s",
        )
        self._keep: list[torch.Tensor] = []  # created buffers: peers map them

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._keep.append(buffer)
        # torch's ``_share_cuda_`` (its C binding) has no annotations
        device, handle, size, offset, ref_handle, ref_offset, event, sync = (
            buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        )
        fields = [device, _hex(handle), size, offset, _hex(ref_handle), ref_offset, _hex(event)]
        return buffer, json.dumps([*fields, bool(sync), nbytes])

    def attach(self, handle: str, nbytes: int) -> torch.Tensor:
        """Opened in this process's context on ``self.device`` (the producer's device index is
        its own numbering): a peer GPU's buffer is reached over NVLink (peer access)."""
        _, ipc, size, offset, ref_handle, ref_offset, event, sync, length = json.loads(handle)
        if length != nbytes:
            raise ValueError(f"plane buffer of {length} bytes, the layout needs {nbytes}")
        torch.cuda._lazy_init()  # type: ignore[no-untyped-call]  # torch internal, unannotated
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device.index,
            _bytes(ipc),
            size,
            offset,
            _bytes(ref_handle),
            ref_offset,
            _bytes(event),
            sync,
        )
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            storage, 0, (nbytes,), (1,)
        )

    def readdress(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``TritonWaits.readdress``, then a device sync: the caller drops ``old``, which
        closes its CUDA IPC mapping, and kernels launched before may still address it (the
        spoiled steps' sends; their waits were aborted with the loss, so they end at once).
        At a failover only, off the token path."""
        super().readdress(old, new)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._keep.clear()
