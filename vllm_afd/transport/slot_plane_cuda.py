"""The slot plane's device layer (``slot_plane.py``): buffers in device memory shared by CUDA
IPC, and four Triton kernels: publish, publish_all, signal and wait. Everything else is the
shared protocol.
PyTorch and Triton only (the GPU machine this project is lent has no vLLM or DeepEP).

Why these primitives. ``publish`` is a use's whole send in one kernel (issue 41: one operation
per side and direction, against a copy-engine copy per part plus a signal before): one program
copies the parts element by element into the peer's slot (the expert ids converted to the
slot's int32), a CTA barrier orders its threads' stores, then the flag is stored with release
semantics at system scope (a store, not a remote atomic read-modify-write, which PCIe peers
lack); a strided part, or a use over ``FUSED_MAX_BYTES`` (a prefill chunk), goes by the copy
engines and ``signal``. ``publish_all`` is an FFN rank's answers of one use to every attention
rank in one kernel, a program per attention rank, each publishing into its own rank's buffer
(their addresses in a small table on the device, built once per set of parts). ``signal`` is
an ``atomic_xchg`` with release semantics at system scope: the payload copies queued before
it on the stream have finished (stream order) and their stores are visible to any peer that
acquires the flag. The value either stores is
computed on the device from the sender's step word (``slot_plane``: the use's value), so a
captured graph publishes the right value on every replay without Python. ``wait`` spins on an
acquire load (``atomic_add(flag, 0)``) at system scope until ``|flag|`` reaches the awaited
value, for one flag or, in the same kernel, for each of several evenly spaced in one buffer
(``wait_all``: an FFN rank's request flags of a slot, from every attention rank, each at its
sender's step). A kernel cannot raise: a wait that gives up at its deadline (the GPU's
``%globaltimer`` against the transport's ``timeout_s``: a dead peer costs a wait seconds, not a
poll budget of minutes), or ends on another value than its own (an error answer, a peer that
moved on), or that a host watchdog aborted (a word in pinned host memory it polls), is counted
in a device word (``slot_plane.RecordedWaits``), and ``check()`` reads that word on the host at a
step boundary. Under Triton's interpreter (the suite: no device clock) a wait is bounded by a
number of polls instead.

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
from typing import Any

import torch

from vllm_afd.transport.slot_plane import RecordedWaits, publish_by_copies, publish_each

#: Polls a wait makes before it gives up where there is no device clock to bound it by (the
#: interpreter in the suite); on a GPU a wait is bounded by time (``CudaPlaneMemory``).
DEFAULT_MAX_SPINS = 1 << 26


#: A use's payload up to this size goes in one fused kernel with its flag (``publish``): one
#: program copies it word by word, then publishes (a decode use: 16 tokens x 7168 x bf16 is
#: 224 KiB). A larger one (a prefill chunk) is copied by the copy engines, then signalled.
FUSED_MAX_BYTES = 1 << 20
#: Elements each step of the fused copy moves.
_FUSED_BLOCK = 4096
#: ``publish_all`` tables kept per memory (one per set of parts: slot and attention ranks).
_MAX_TABLES = 4096


@cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    import triton
    import triton.language as tl

    # Triton kernels stay unannotated: Triton reads a kernel's parameter annotations (its
    # argument types and specialisation), so typing them for mypy would change the kernels.
    @triton.jit
    def signal_kernel(  # type: ignore[no-untyped-def]
        flag_ptr, step_ptr, offset, sign
    ):
        value = (tl.load(step_ptr) + offset) * sign
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")

    @triton.jit  # type: ignore[untyped-decorator]
    def wait_kernel(  # type: ignore[no-untyped-def]
        flag_ptr,
        flag_stride,
        count,
        step_ptr,
        offset,
        error_ptr,
        abort_ptr,
        bound,
        TIMED: tl.constexpr,
    ):
        # ``count`` flags ``flag_stride`` words apart, flag i awaited at its own step word
        # ``step_ptr[i]`` (one FFN rank's request flags of a slot, from every attention rank);
        # bound: nanoseconds of the GPU's global timer for them all (TIMED), else polls each
        # (the interpreter, which has no device clock)
        if TIMED:
            start = tl.extra.cuda.globaltimer()
        for i in range(count):
            flag = flag_ptr + i * flag_stride
            want = tl.load(step_ptr + i) + offset
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            aborted = tl.load(abort_ptr, volatile=True)
            spins = 0
            within = spins < bound
            while (seen < want) & (seen > -want) & within & (aborted == 0):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                aborted = tl.load(abort_ptr, volatile=True)
                spins += 1
                if TIMED:
                    within = tl.extra.cuda.globaltimer() - start < bound
                else:
                    within = spins < bound
            if seen != want:
                tl.atomic_add(error_ptr, 1)

    @triton.jit  # type: ignore[untyped-decorator]
    def publish_kernel(  # type: ignore[no-untyped-def]
        d0, s0, n0, d1, s1, n1, d2, s2, n2, flag_ptr, step_ptr, offset, BLOCK: tl.constexpr
    ):
        # one program: every element of up to three parts into the peer's slot, converted to
        # the destination's type (vLLM's int64 expert ids to the slot's int32), the CTA's
        # stores ordered before the flag (barrier, then a release store at system scope)
        for start in range(0, n0, BLOCK):
            at = start + tl.arange(0, BLOCK)
            part = tl.load(s0 + at, mask=at < n0).to(d0.dtype.element_ty)
            tl.store(d0 + at, part, mask=at < n0)
        for start in range(0, n1, BLOCK):
            at = start + tl.arange(0, BLOCK)
            part = tl.load(s1 + at, mask=at < n1).to(d1.dtype.element_ty)
            tl.store(d1 + at, part, mask=at < n1)
        for start in range(0, n2, BLOCK):
            at = start + tl.arange(0, BLOCK)
            part = tl.load(s2 + at, mask=at < n2).to(d2.dtype.element_ty)
            tl.store(d2 + at, part, mask=at < n2)
        tl.debug_barrier()
        value = tl.load(step_ptr) + offset
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")

    @triton.jit  # type: ignore[untyped-decorator]
    def publish_all_kernel(  # type: ignore[no-untyped-def]
        table, dst_type, src_type, BLOCK: tl.constexpr
    ):
        # program i publishes part i, its row of ``table`` (int64 words: destination, source,
        # elements, flag, step word, offset; addresses, since each destination is another
        # attention rank's buffer): the copy, the CTA's barrier, the flag's release store;
        # ``dst_type``, ``src_type``: the first part's tensors, for the element types
        row = table + tl.program_id(0) * 6
        dst = tl.load(row).to(dst_type.dtype)
        src = tl.load(row + 1).to(src_type.dtype)
        n = tl.load(row + 2)
        flag = tl.load(row + 3).to(tl.pointer_type(tl.int64))
        step = tl.load(row + 4).to(tl.pointer_type(tl.int64))
        for start in range(0, n, BLOCK):
            at = start + tl.arange(0, BLOCK)
            part = tl.load(src + at, mask=at < n).to(dst_type.dtype.element_ty)
            tl.store(dst + at, part, mask=at < n)
        tl.debug_barrier()
        value = tl.load(step) + tl.load(row + 5)
        tl.atomic_xchg(flag, value, sem="release", scope="sys")

    return signal_kernel, wait_kernel, publish_kernel, publish_all_kernel


def _fusable(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The parts as (destination, source) pairs one kernel can copy, or ``None`` (more than
    three parts, a strided tensor, too many bytes)."""
    if len(dsts) > 3 or sum(d.numel() * d.element_size() for d in dsts) > FUSED_MAX_BYTES:
        return None
    parts = list(zip(dsts, srcs, strict=True))
    for dst, src in parts:
        if dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            return None
    return parts


def _even_stride(words: Sequence[torch.Tensor]) -> int | None:
    """The distance in int64 words between consecutive ``words`` (one-word views of one
    buffer), or ``None`` where it is not one constant distance."""
    if len(words) < 2:
        return 0
    at = [w.data_ptr() for w in words]
    stride, rest = divmod(at[1] - at[0], 8)
    if rest or any(b - a != stride * 8 for a, b in zip(at, at[1:], strict=False)):
        return None
    return stride


def _hex(data: bytes | None) -> str | None:
    return None if data is None else data.hex()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else bytes.fromhex(text)


class TritonWaits(RecordedWaits):
    """``signal`` and ``wait`` as the Triton kernels above, on whatever memory holds the flags:
    device memory here (``CudaPlaneMemory``), host memory under Triton's interpreter in the
    suite (``testing.slot_plane_check.InterpretedPlaneMemory``: the same kernels, run on every
    push). ``errors`` must be on the memory's device, ``aborted`` readable by it."""

    #: A wait's bound: nanoseconds of the device's global timer (``%globaltimer``) where the
    #: device has one, else this many polls.
    deadline_ns: int | None = None
    max_spins: int = DEFAULT_MAX_SPINS
    stores_on_host = False
    push = None  # stores land in the peer's memory (CUDA IPC)
    pump = None

    def signal(
        self, flag: torch.Tensor, step: torch.Tensor, position: int, failed: bool = False
    ) -> None:
        _kernels()[0][(1,)](flag, step, position + 1, -1 if failed else 1, num_warps=1)

    def publish(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
    ) -> None:
        """One kernel for a use up to ``FUSED_MAX_BYTES`` of contiguous parts; otherwise the
        copies, then ``signal``."""
        parts = _fusable(dsts, srcs)
        if parts is None:
            publish_by_copies(self.signal, dsts, srcs, flag, step, position)
            return
        args: list[Any] = []
        for d, s in parts:
            args += [d, s, d.numel()]
        args += [flag, flag, 0] * (3 - len(parts))  # absent parts: no words to copy
        _kernels()[2][(1,)](*args, flag, step, position + 1, BLOCK=_FUSED_BLOCK, num_warps=4)

    @functools.cached_property
    def _tables(self) -> dict[tuple[tuple[int, ...], ...], torch.Tensor]:
        """``publish_all``'s tables by their rows (``_table``)."""
        return {}

    def publish_all(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
    ) -> None:
        """One kernel, a program per part, where every part is fusable and of one pair of
        types; otherwise one ``publish`` each."""
        table = self._table(dsts, srcs, flags, steps, positions)
        if table is None:
            publish_each(self.publish, dsts, srcs, flags, steps, positions)
            return
        _kernels()[3][(len(dsts),)](table, dsts[0], srcs[0], BLOCK=_FUSED_BLOCK, num_warps=4)

    def _table(
        self,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        positions: Sequence[int],
    ) -> torch.Tensor | None:
        """``publish_all``'s table on the memory's device (its rows: each part's destination,
        source, elements, flag, step word, offset), built once per set of parts (a CUDA graph
        replays the one its capture read); ``None`` where the kernel does not take the parts,
        or where a capture would have to build it (a copy to the device is no graph node: the
        step's eager run before its capture builds it)."""
        if len(dsts) < 2:
            return None
        rows = []
        for dst, src, flag, step, position in zip(dsts, srcs, flags, steps, positions, strict=True):
            if dst.dtype != dsts[0].dtype or src.dtype != srcs[0].dtype:
                return None
            if _fusable((dst,), (src,)) is None:
                return None
            rows.append(
                (
                    dst.data_ptr(),
                    src.data_ptr(),
                    dst.numel(),
                    flag.data_ptr(),
                    step.data_ptr(),
                    position + 1,
                )
            )
        key = tuple(rows)
        table = self._tables.get(key)
        if table is None:
            if flags[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            table = torch.tensor(rows, dtype=torch.int64, device=flags[0].device)
            self._tables[key] = table
        return table

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
    ) -> None:
        self._wait(flag, 0, 1, step, position)

    def wait_all(
        self,
        flags: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        position: int,
        what: Callable[[int], str],
    ) -> list[int | None]:
        """One kernel where the flags lie evenly spaced and the step words side by side;
        otherwise one wait each."""
        stride = _even_stride(flags)
        if stride is None or _even_stride(steps) != 1:
            for flag, step in zip(flags, steps, strict=True):
                self._wait(flag, 0, 1, step, position)
        else:
            self._wait(flags[0], stride, len(flags), steps[0], position)
        return [None] * len(flags)

    def _wait(
        self, flag: torch.Tensor, stride: int, count: int, step: torch.Tensor, position: int
    ) -> None:
        timed = self.deadline_ns is not None
        bound = self.deadline_ns if timed else self.max_spins
        _kernels()[1][(1,)](
            flag,
            stride,
            count,
            step,
            position + 1,
            self.errors,
            self.aborted,
            bound,
            TIMED=timed,
            num_warps=1,
        )


class CudaPlaneMemory(TritonWaits):
    """Device memory of ``device`` for the slot plane (``slot_plane.PlaneMemory``)."""

    def __init__(self, device: torch.device | int = 0, timeout_s: float = 30.0):
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.deadline_ns = int(timeout_s * 1e9)
        self.errors = torch.zeros(1, dtype=torch.int64, device=self.device)
        # pinned host memory, which the device reads through the same address (UVA), as NCCL
        # polls its abort flag: set by a host watchdog while a wait spins (``abort``)
        self.aborted = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.bound = f"{timeout_s:g} s"
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

    def close(self) -> None:
        self._keep.clear()
