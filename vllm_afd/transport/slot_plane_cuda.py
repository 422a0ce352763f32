"""The slot plane's device layer (``slot_plane.py``): buffers in device memory shared by CUDA
IPC, and a publish/wait pair of one-thread Triton kernels. Everything else is the shared
protocol. PyTorch and Triton only (the GPU machine this project is lent has no vLLM or DeepEP).

Why these primitives. ``signal`` is an ``atomic_xchg`` with release semantics at system scope:
the payload copies queued before it on the stream have finished (stream order) and their
stores are visible to any peer that acquires the flag. The value it stores is computed on the
device from the sender's step word (``slot_plane``: the use's value), so a captured graph publishes
the right value on every replay without Python. ``wait`` spins on an acquire load
(``atomic_add(flag, 0)``) at system scope until ``|flag|`` reaches the awaited value. A kernel
cannot raise: a wait that gives up after ``max_spins`` polls, or ends on another value than
its own (an error answer, a peer that moved on), or that a host watchdog aborted (a word in
pinned host memory it polls), is counted in a device word (``slot_plane.RecordedWaits``), and
``check()`` reads that word on the host at a step boundary.

CUDA IPC, not PyTorch symmetric memory: it needs no process-group rendezvous (NCCL refuses two
ranks on one GPU) and works for two processes sharing a device. The handle peers attach by is
the storage's IPC handle as text (``UntypedStorage._share_cuda_``, what
``torch.multiprocessing``'s reductions send, here written into the FFN rank's control block);
the creator keeps the buffer alive until ``close``. Across nodes the same protocol would sit
on NVSHMEM (docs/architecture.md).

NOT YET RUN ON A GPU unless the closing note of issue 19 says otherwise.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import torch

from vllm_afd.transport.slot_plane import RecordedWaits, Watch

#: Polls a device wait makes before it gives up (about 1 us each at system scope on an H200,
#: more when two processes time-slice one GPU): a bound, not a deadline.
DEFAULT_MAX_SPINS = 1 << 26


@cache
def _kernels() -> tuple[Any, Any]:
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

    @triton.jit
    def wait_kernel(  # type: ignore[no-untyped-def]
        flag_ptr, step_ptr, offset, error_ptr, abort_ptr, max_spins
    ):
        want = tl.load(step_ptr) + offset
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins = 0
        aborted = tl.load(abort_ptr, volatile=True)
        while (seen < want) & (seen > -want) & (spins < max_spins) & (aborted == 0):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            aborted = tl.load(abort_ptr, volatile=True)
            spins += 1
        if seen != want:
            tl.atomic_add(error_ptr, 1)

    return signal_kernel, wait_kernel


def _hex(data: bytes | None) -> str | None:
    return None if data is None else data.hex()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else bytes.fromhex(text)


class CudaPlaneMemory(RecordedWaits):
    """Device memory of ``device`` for the slot plane (``slot_plane.PlaneMemory``)."""

    def __init__(self, device: torch.device | int = 0, max_spins: int = DEFAULT_MAX_SPINS):
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.max_spins = max_spins
        self.errors = torch.zeros(1, dtype=torch.int64, device=self.device)
        # pinned host memory, which the device reads through the same address (UVA), as NCCL
        # polls its abort flag: set by a host watchdog while a wait spins (``abort``)
        self.aborted = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.bound = f"{max_spins} polls"
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

    def signal(
        self, flag: torch.Tensor, step: torch.Tensor, position: int, failed: bool = False
    ) -> None:
        _kernels()[0][(1,)](flag, step, position + 1, -1 if failed else 1, num_warps=1)

    def wait(
        self,
        flag: torch.Tensor,
        step: torch.Tensor,
        position: int,
        what: str,
        watch: Watch | None = None,
    ) -> None:
        _kernels()[1][(1,)](
            flag, step, position + 1, self.errors, self.aborted, self.max_spins, num_warps=1
        )

    def close(self) -> None:
        self._keep.clear()
