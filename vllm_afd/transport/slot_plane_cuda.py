"""The slot plane's device layer (``slot_plane.py``): buffers in device memory shared by CUDA
IPC, and a publish/wait pair of one-thread Triton kernels. Everything else is the shared
protocol. PyTorch and Triton only (the GPU machine this project is lent has no vLLM or DeepEP).

Why these primitives. ``signal`` is an ``atomic_xchg`` with release semantics at system scope:
the payload copies queued before it on the stream have finished (stream order) and their
stores are visible to any peer that acquires the flag. ``wait`` spins on an acquire load
(``atomic_add(flag, 0)``) at system scope until the flag equals the expected count, which it
reads from the waiter's own device counter, so a captured graph waits for the right use on
every replay without Python. A kernel cannot raise: after ``max_spins`` polls it records the
failure in a device word and returns; ``check()`` reads that word on the host. CUDA IPC, not
PyTorch symmetric memory: it needs no process-group rendezvous (NCCL refuses two ranks on one
GPU) and works for two processes sharing a device (``torch.multiprocessing.reductions``; the
producer keeps the buffer alive). Across nodes the same protocol would sit on NVSHMEM (docs/
architecture.md). NOT YET RUN ON A GPU unless the closing note of issue 19 says otherwise.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

#: Polls a device wait makes before it gives up (about 1 us each at system scope on an H200,
#: more when two processes time-slice one GPU): a bound, not a deadline.
DEFAULT_MAX_SPINS = 1 << 26


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def signal_kernel(flag_ptr, value_ptr):
        value = tl.load(value_ptr)
        tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")

    @triton.jit
    def wait_kernel(flag_ptr, value_ptr, error_ptr, max_spins):
        want = tl.load(value_ptr)
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins = 0
        while (seen != want) & (spins < max_spins):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            spins += 1
        if seen != want:
            tl.atomic_add(error_ptr, 1)

    return signal_kernel, wait_kernel


class CudaPlaneMemory:
    """Device memory of ``device`` for the slot plane (``slot_plane.PlaneMemory``)."""

    def __init__(self, device: torch.device | int = 0, max_spins: int = DEFAULT_MAX_SPINS):
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.max_spins = max_spins
        #: Waits that gave up, counted on the device (``check``).
        self.errors = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._keep: list[torch.Tensor] = []

    def create(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._keep.append(buffer)  # peers map it: it must outlive them
        return buffer, reduce_tensor(buffer)

    def attach(self, handle: Any, nbytes: int) -> torch.Tensor:
        rebuild, args = handle
        buffer = rebuild(*args)
        if buffer.numel() != nbytes or buffer.device != self.device:
            raise ValueError(
                f"plane buffer of {buffer.numel()} bytes on {buffer.device}, the layout needs "
                f"{nbytes} on {self.device}"
            )
        return buffer

    def signal(self, flag: torch.Tensor, value: torch.Tensor) -> None:
        _kernels()[0][(1,)](flag, value, num_warps=1)

    def wait(self, flag: torch.Tensor, value: torch.Tensor, what: str) -> None:
        _kernels()[1][(1,)](flag, value, self.errors, self.max_spins, num_warps=1)

    def check(self) -> None:
        failed = int(self.errors)
        if failed:
            raise TimeoutError(
                f"slot plane: {failed} device wait(s) gave up after {self.max_spins} polls"
            )
