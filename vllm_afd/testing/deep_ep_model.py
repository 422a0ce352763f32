"""A CPU model of DeepEP's low-latency contract, for testing the ``deepep`` transport without a GPU.

It stands in for the ``deep_ep`` module (``Buffer``, ``topk_idx_t``) and keeps the rules of
DeepEP's legacy low-latency mode as read from its source at the commit vLLM pins (73b6ea4:
``deep_ep/buffer.py``, ``csrc/deep_ep.cpp``, ``csrc/config.hpp``, ``csrc/kernels/internode_ll.cu``).
Ranks are threads of one process and a rank's "RDMA buffer" is process memory, but every rule
that decides whether a caller's sequence of calls works is the real one:

* ``Buffer()`` is collective: it gathers the device ids, IPC handles and the root's NVSHMEM
  unique id through ``group`` or ``comm.allgather`` (``comm=``: any object with ``Get_rank``,
  ``Get_size`` and ``allgather``), so no rank's constructor returns before every rank called it.
* The host assertions of ``low_latency_dispatch``/``low_latency_combine``: bfloat16, a hidden
  size DeepEP's kernels are compiled for (a multiple of 128 in ``LL_HIDDEN_SIZES``), at most
  ``num_max_dispatch_tokens_per_rank`` tokens, ``topk_idx`` of ``topk_idx_t``, experts divisible
  by ranks, ``NVSHMEM_QP_DEPTH >= (tokens + 1) * 2``, the layout within ``num_rdma_bytes``.
* Two buffers (odd/even). Every call uses buffer ``idx`` and flips ``idx``; its send phase first
  zeroes the *other* buffer's signalling area (dispatch counts and combine flags share it:
  ``clean_meta``), then writes data and signals into the same-index buffer of the peers.
* The receive phase (at once, or in the hook with ``return_recv_hook=True``) waits for every
  peer's signal in this rank's buffer. It waits at most ``RECV_TIMEOUT_S`` (DeepEP: about 100 s
  of GPU cycles) and then *traps*: ``DeepEPTrap``, and the whole group is dead (the CUDA
  context is gone), so every later call of any rank raises. Hence the hazards the transport
  must avoid: a rank waiting in a dispatch no peer sends (an idle FFN pre-posting one), and a
  second call before the first call's hook ran (its send phase wipes the counts the hook waits
  for).
* Results reuse the buffers: a dispatch's ``recv_x`` is a view of its buffer's receive area,
  which the dispatch and combine receive areas share (``LowLatencyLayout``): at most two
  results may be held. Received tokens are packed per local expert in no particular source
  order (the model packs sources in descending rank order and tokens in reverse, so a consumer
  relying on an order fails); ``src_info`` and ``layout_range`` say where each row came from.
* Combine weights the expert outputs by ``topk_weights`` in float32 and returns bfloat16;
  ``-1`` expert ids select nothing. ``destroy()`` needs ``explicitly_destroy=True``.

Not modelled: FP8/LogFMT casts, ``zero_copy``, shrink/masking, statistics tensors, events, and
``destroy()``'s NVSHMEM barrier (on GPUs every rank's destroy waits for the others').
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

topk_idx_t = torch.int64
#: Hidden sizes DeepEP's low-latency kernels are compiled for (``SWITCH_HIDDEN``).
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: How long a receive phase waits before it traps (DeepEP: ``NUM_TIMEOUT_CYCLES``, ~100 s).
RECV_TIMEOUT_S = 100.0


class DeepEPTrap(RuntimeError):
    """A receive phase timed out: on a GPU the kernel calls ``trap()`` and the context dies."""


def _layout_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """``LowLatencyLayout.total_bytes`` (bf16, no FP8 scales), as ``csrc/config.hpp``."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = -(-num_experts * 4 // 128) * 128
    return 2 * (send + recv + signal)


@dataclass
class _RankBuffers:
    """One rank's symmetric memory: two buffers, each a signalling area and a receive area."""

    signals: list[torch.Tensor]  # 2 x [num_experts] int32 (dispatch counts = combine flags)
    recv: list[torch.Tensor]  # 2 x [E_local, ranks * max_tokens, H] bfloat16
    src_rows: list[dict]  # 2 x {(local expert, src rank): [source token indices]}


@dataclass
class _World:
    """The group's shared state (what NVSHMEM makes visible to every rank)."""

    num_ranks: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    ranks: dict[int, _RankBuffers] = field(default_factory=dict)
    dead: str = ""
    layout: tuple[int, int, int] | None = None
    #: Every low-latency call, as (rank, "dispatch" | "combine", buffer index), in call order.
    calls: list[tuple[int, str, int]] = field(default_factory=list)


_WORLDS: dict[str, _World] = {}
_WORLDS_LOCK = threading.Lock()


def world_of(buffer: Buffer) -> _World:
    """The group a ``Buffer`` belongs to (tests read its call log)."""
    return buffer._world


class Buffer:
    """Model of ``deep_ep.Buffer`` in low-latency mode (see module docstring)."""

    def __init__(
        self,
        group=None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ) -> None:
        if group is not None:
            raise NotImplementedError("the model takes comm=, not a torch.distributed group")
        if comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        assert low_latency_mode, "the model covers the low-latency mode only"
        assert num_qps_per_rank > 0
        assert num_rdma_bytes // 16 < 2**31 - 1, "num_rdma_bytes / sizeof(int4) < INT_MAX"
        self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        self.num_rdma_bytes = num_rdma_bytes
        self.explicitly_destroy = explicitly_destroy
        #: The connectivity switches, as given (tests read them; the model ignores them).
        self.links = {
            "allow_nvlink_for_low_latency_mode": allow_nvlink_for_low_latency_mode,
            "allow_mnnvl": allow_mnnvl,
            "use_fabric": use_fabric,
        }
        self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self._idx = 0
        # The three gathers of the real constructor: device ids, IPC handles, root unique id.
        comm.allgather(self.rank)
        comm.allgather(uuid.uuid4().bytes)
        root = comm.allgather(uuid.uuid4().hex if self.rank == 0 else None)[0]
        with _WORLDS_LOCK:
            self._world = _WORLDS.setdefault(root, _World(self.group_size))
        comm.allgather(None)  # runtime.sync: every rank attached before any call
        self.destroyed = False

    # --- lifecycle ----------------------------------------------------------------------------

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.destroyed = True

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        size = _layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return -(-size // 128) * 128

    # --- the two calls ------------------------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        max_tokens = num_max_dispatch_tokens_per_rank
        assert self.nvshmem_qp_depth >= (max_tokens + 1) * 2, "NVSHMEM_QP_DEPTH too small"
        assert not use_fp8, "the model covers bf16 dispatch only"
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert x.size(1) % 128 == 0 and x.size(1) in LL_HIDDEN_SIZES, "Unsupported hidden"
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous()
        assert x.size(0) == topk_idx.size(0) and x.size(0) <= max_tokens
        assert topk_idx.dtype == topk_idx_t
        assert num_experts % self.group_size == 0
        assert (self.group_size * max_tokens) % 4 == 0, "TMA requires a multiple of 4 tokens"
        assert not (async_finish and return_recv_hook)
        mine, b = self._begin("dispatch", max_tokens, x.size(1), num_experts)
        local = num_experts // self.group_size
        with self._world.cond:
            # send phase: every global expert gets its tokens and a count, even when none
            for expert in range(num_experts):
                dst, le = divmod(expert, local)
                rows = (topk_idx == expert).any(dim=1).nonzero().squeeze(1).flip(0)
                peer = self._world.ranks[dst]
                base = self.rank * max_tokens
                peer.recv[b][le, base : base + rows.numel()] = x[rows]
                peer.src_rows[b][(le, self.rank)] = rows.tolist()
                peer.signals[b][le * self.group_size + self.rank] = -rows.numel() - 1
            self._world.cond.notify_all()
        hidden = x.size(1)
        packed_x = torch.empty(local, self.group_size * max_tokens, hidden, dtype=torch.bfloat16)
        count = torch.zeros(local, dtype=torch.int32)
        src_info = torch.zeros(local, self.group_size * max_tokens, dtype=torch.int32)
        layout_range = torch.zeros(local, self.group_size, dtype=torch.int64)

        def recv_phase() -> None:
            self._wait(
                mine.signals[b],
                range(local * self.group_size),
                "dispatch",
                lambda i: f"local expert {i // self.group_size}, src rank {i % self.group_size}",
            )
            # pack: per local expert, sources in descending rank order (DeepEP: arrival order)
            for le in range(local):
                offset = 0
                for src in reversed(range(self.group_size)):
                    rows = mine.src_rows[b][(le, src)]
                    n = len(rows)
                    base = src * max_tokens
                    packed_x[le, offset : offset + n] = mine.recv[b][le, base : base + n]
                    src_info[le, offset : offset + n] = torch.tensor(rows, dtype=torch.int32)
                    layout_range[le, src] = (offset << 32) | n
                    offset += n
                count[le] = offset
            # the result reuses the buffer's receive area (at most two results held)
            mine.recv[b].copy_(packed_x)

        hook: Callable[[], None] | None = None
        if return_recv_hook:
            hook = recv_phase
        else:
            recv_phase()
        handle = (src_info, layout_range, max_tokens, hidden, num_experts)
        return mine.recv[b], count, handle, None, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats=None,
    ):
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (max_tokens + 1) * 2, "NVSHMEM_QP_DEPTH too small"
        assert not (use_logfmt or zero_copy), "not modelled"
        local = num_experts // self.group_size
        assert x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert x.size(0) == local and x.size(1) == self.group_size * max_tokens
        assert x.size(2) % 128 == 0
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t
        assert topk_idx.shape == topk_weights.shape and topk_weights.dtype == torch.float32
        assert topk_weights.size(0) <= max_tokens
        assert src_info.dtype == torch.int32 and layout_range.shape == (local, self.group_size)
        assert not return_recv_hook, "not modelled: the transport's combine waits in the call"
        mine, b = self._begin("combine", max_tokens, x.size(2), num_experts)
        with self._world.cond:
            # send phase: each local expert's rows back to their source ranks, and a flag each
            for le in range(local):
                expert = self.rank * local + le
                for src in range(self.group_size):
                    packed = int(layout_range[le, src])
                    offset, n = packed >> 32, packed & 0xFFFFFFFF
                    peer = self._world.ranks[src]
                    rows = src_info[le, offset : offset + n].long()
                    peer.recv[b].view(num_experts, max_tokens, hidden)[expert, rows] = x[
                        le, offset : offset + n
                    ]
                    peer.signals[b][expert] = 1
            self._world.cond.notify_all()
        self._wait(mine.signals[b], range(num_experts), "combine", lambda i: f"expert {i}")
        data = mine.recv[b].view(num_experts, max_tokens, hidden).float()
        acc = torch.zeros(topk_idx.size(0), hidden)
        for t in range(topk_idx.size(0)):
            for k in range(topk_idx.size(1)):
                expert = int(topk_idx[t, k])
                if expert >= 0:
                    acc[t] += topk_weights[t, k] * data[expert, t]
        result = acc.to(torch.bfloat16)
        if out is not None:
            result = out.copy_(result)
        return result, None, None

    # --- helpers ------------------------------------------------------------------------------

    def _begin(
        self, kind: str, max_tokens: int, hidden: int, num_experts: int
    ) -> tuple[_RankBuffers, int]:
        """Checks common to both calls, the rank's buffers allocated at the first call, and the
        buffer flip with the send phase's clean of the next buffer's signalling area."""
        if self.destroyed:
            raise RuntimeError("DeepEP buffer used after destroy()")
        assert _layout_bytes(max_tokens, hidden, num_experts) <= self.num_rdma_bytes, (
            "layout.total_bytes <= num_rdma_bytes"
        )
        world = self._world
        with world.cond:
            if world.dead:
                raise RuntimeError(f"CUDA error: the DeepEP group trapped earlier ({world.dead})")
            # the symmetric memory exists from construction on; its layout comes with the calls
            layout = (max_tokens, hidden, num_experts)
            if world.layout is None:
                local, rows = num_experts // self.group_size, self.group_size * max_tokens
                for rank in range(self.group_size):
                    world.ranks[rank] = _RankBuffers(
                        [torch.zeros(num_experts, dtype=torch.int32) for _ in range(2)],
                        [torch.zeros(local, rows, hidden, dtype=torch.bfloat16) for _ in range(2)],
                        [{}, {}],
                    )
                world.layout = layout
            assert layout == world.layout, "the model keeps one layout per group"
            b = self._idx
            self._idx ^= 1
            mine = world.ranks[self.rank]
            mine.signals[self._idx].zero_()  # clean the next buffer (send phase)
            world.calls.append((self.rank, kind, b))
        return mine, b

    def _wait(
        self, signals: torch.Tensor, indices: range, kind: str, what: Callable[[int], str]
    ) -> None:
        """The receive phase's spin on the signals, with DeepEP's trap at the timeout."""
        world = self._world
        deadline = time.monotonic() + RECV_TIMEOUT_S
        with world.cond:
            while True:
                if world.dead:
                    raise RuntimeError(f"CUDA error: the DeepEP group trapped ({world.dead})")
                missing = [i for i in indices if int(signals[i]) == 0]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    where = what(missing[0])
                    world.dead = f"rank {self.rank}: DeepEP timeout for {kind} receive, {where}"
                    world.cond.notify_all()
                    raise DeepEPTrap(world.dead)
                world.cond.wait(min(left, 0.05))
