"""DeepEP backend: the GPU path, on DeepEP's low-latency dispatch/combine (NVLink / RDMA).

NOT YET RUN ON A GPU. Written against ``deep_ep.Buffer.low_latency_dispatch`` /
``low_latency_combine`` as documented in DeepEP's ``buffer.py``; on this project's CPU machines
only the import-time error path, the expert renumbering (``VirtualExperts``) and the
``moe_layers`` check are tested.

Group. One ``torch.distributed`` world of ``A + F`` ranks, attention ranks first
(``0..A-1``), FFN ranks after (``A..A+F-1``), is one DeepEP low-latency group. DeepEP requires
every rank to own ``num_experts / num_ranks`` experts, so the group gets ``(A + F) * E/F``
*virtual* experts: the attention ranks own the first ``A * E/F`` (never routed to), FFN rank
``f`` owns ``(A + f) * E/F ...``, i.e. global expert ``e`` is virtual expert ``e + A * E/F``.
The price is low-latency buffer space for the attention ranks' idle experts.

Lockstep. Unlike the point-to-point backends, DeepEP's kernels are collectives: for every MoE
layer every attention rank calls ``dispatch`` then ``combine`` (vLLM's data-parallel dummy
batches keep idle ranks in step, with ``T = 0``) and every FFN rank calls ``recv`` then
``reply``. ``recv`` returns exactly one request per call holding every token routed to this FFN
rank from all attention ranks, one row per (token, local expert) pair with ``topk_ids`` ``[N, 1]``
and weight 1.

Routing weights. In this backend they are applied on the attention side, by DeepEP's
low-latency combine: the FFN side answers with unweighted expert outputs (its requests carry
weight 1), and ``combine`` weights and sums them. The point-to-point backends apply them on the
FFN side instead (see ``base.py``); ``combine``'s result is the same.

Layers. The FFN side cannot read the layer from the wire: the ``i``-th ``recv`` is taken to be
MoE layer ``spec.moe_layers[i % len(spec.moe_layers)]`` (every layer is one collective, in model
order), so ``spec.moe_layers`` must be set on the FFN side.

Not honoured: ``timeout_s`` (DeepEP kernels have their own timeout, which aborts the process),
``recv``'s ``timeout_s`` (it blocks until the layer's collective), ``DispatchHandle.token_index``
(left empty: computing it would cost a device sync). At most two dispatches may be outstanding
(DeepEP's double buffer: ``num_slots <= 2``). Hidden states must be bfloat16 CUDA tensors.
``recv`` syncs the device once per layer to read the per-expert counts; a DeepGEMM masked grouped
GEMM on DeepEP's packed layout would avoid that and is future work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_afd.transport.base import (
    AttentionTransport,
    DispatchHandle,
    FFNRequest,
    FFNTransport,
    TransportSpec,
)

#: DeepEP's low-latency limits (DeepEP @73b6ea4, the commit vLLM pins; docs/architecture.md):
#: the hidden sizes its kernels are compiled for (vLLM rounds a layer's hidden size up to the
#: next one: ``DeepEPLLPrepareAndFinalize.maybe_roundup_layer_hidden_size``), the tokens one
#: rank may dispatch per round (``NVSHMEM_QP_DEPTH >= (tokens + 1) * 2`` at the default depth of
#: 1024; vLLM uses 256), the double buffer (two dispatches in flight), and the receive kernels'
#: warp groups (``ceil(experts / SMs) < 15``).
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LL_MAX_TOKENS = 256
LL_MAX_IN_FLIGHT = 2
LL_MAX_WARP_GROUPS = 14
#: SMs of an H100/H200 (B200: 148), for the warp-group limit when no GPU can be asked.
DEFAULT_NUM_SMS = 132


def padded_hidden_size(hidden_size: int) -> int | None:
    """The hidden size DeepEP's low-latency kernels run ``hidden_size`` at (vLLM's round-up to
    the next compiled size), or ``None`` when it is larger than every compiled size."""
    return next((h for h in LL_HIDDEN_SIZES if h >= hidden_size), None)


def limits_problem(
    hidden_size: int,
    dtype: torch.dtype,
    max_tokens: int,
    microbatches: int,
    num_attention_ranks: int,
    num_ffn_ranks: int,
    num_experts: int,
    num_sms: int = DEFAULT_NUM_SMS,
) -> str | None:
    """Why DeepEP's low-latency mode cannot serve this deployment (``None``: it can), naming
    the setting to change; checked before anything starts (``deployment.check_devices``)."""
    if padded_hidden_size(hidden_size) is None:
        return (
            f"hidden size {hidden_size}: DeepEP's low-latency kernels take at most "
            f"{LL_HIDDEN_SIZES[-1]} (compiled sizes {list(LL_HIDDEN_SIZES)}; smaller ones are "
            "padded up)"
        )
    if dtype != torch.bfloat16:
        return f"--dtype {str(dtype).removeprefix('torch.')}: DeepEP dispatches bfloat16 only"
    if max_tokens > LL_MAX_TOKENS:
        return (
            f"--max-num-batched-tokens {max_tokens}: DeepEP's low-latency mode takes at most "
            f"{LL_MAX_TOKENS} tokens per rank and round (as vLLM's own DeepEP path); use "
            f"--max-num-batched-tokens {LL_MAX_TOKENS} with chunked prefill"
        )
    if microbatches > LL_MAX_IN_FLIGHT:
        return (
            f"--afd-microbatches {microbatches}: DeepEP's low-latency buffer holds "
            f"{LL_MAX_IN_FLIGHT} dispatches in flight"
        )
    virtual = VirtualExperts(num_attention_ranks, num_ffn_ranks, num_experts // num_ffn_ranks)
    warp_groups = -(-virtual.num_experts // num_sms)
    if warp_groups > LL_MAX_WARP_GROUPS:
        return (
            f"--afd-ratio: {virtual.num_experts} virtual experts ((A + F) x E / F with "
            f"A={num_attention_ranks}, F={num_ffn_ranks}, E={num_experts}) need "
            f"{warp_groups} warp groups on {num_sms} SMs; DeepEP's receive kernels take at most "
            f"{LL_MAX_WARP_GROUPS} (at most {LL_MAX_WARP_GROUPS * num_sms} virtual experts): "
            "use fewer attention ranks per FFN rank"
        )
    return None


@dataclass
class DeepEPState:
    """``DispatchHandle.state`` of the DeepEP backend (what ``low_latency_combine`` needs).

    Attributes:
        ll_handle: DeepEP's low-latency dispatch handle.
        hook: finishes the dispatch's receive half (``return_recv_hook=True``).
        topk_idx: ``[T, K]`` int64 virtual expert ids (``VirtualExperts.to_virtual``).
        topk_weights: ``[T, K]`` float32 routing weights, applied by the combine.
    """

    ll_handle: object
    hook: Callable[[], None]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def _import_deep_ep():
    """Import ``deep_ep`` or explain why this machine cannot use the backend."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the 'deepep' AFD transport needs an NVIDIA GPU with the deep_ep package (DeepEP, "
            "built with NVSHMEM); this machine has no CUDA device: use 'shm' or 'tcp'"
        )
    try:
        import deep_ep
    except ImportError as exc:
        raise RuntimeError(
            "the 'deepep' AFD transport needs the deep_ep package (DeepEP, built from source "
            "with NVSHMEM): https://github.com/deepseek-ai/DeepEP"
        ) from exc
    return deep_ep


@dataclass(frozen=True)
class VirtualExperts:
    """Expert numbering inside the ``A + F`` rank DeepEP group (see module docstring)."""

    num_attention_ranks: int
    num_ffn_ranks: int
    experts_per_rank: int

    @classmethod
    def of(cls, spec: TransportSpec) -> VirtualExperts:
        return cls(spec.num_attention_ranks, spec.num_ffn_ranks, spec.experts_per_ffn_rank)

    @property
    def num_ranks(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def num_experts(self) -> int:
        return self.num_ranks * self.experts_per_rank

    def to_virtual(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` global expert ids -> ``[T, K]`` int64 virtual ids (DeepEP's ``topk_idx``)."""
        return topk_ids.long() + self.num_attention_ranks * self.experts_per_rank

    def group_rank_of_ffn(self, ffn_rank: int) -> int:
        return self.num_attention_ranks + ffn_rank


def _make_buffer(spec: TransportSpec, experts: VirtualExperts):
    """One low-latency ``deep_ep.Buffer`` over the default process group (``A + F`` ranks)."""
    deep_ep = _import_deep_ep()
    import torch.distributed as dist

    if spec.dtype != torch.bfloat16 or spec.num_slots > 2:
        raise ValueError("deepep transport needs dtype=torch.bfloat16 and num_slots <= 2")
    if not dist.is_initialized() or dist.get_world_size() != experts.num_ranks:
        raise RuntimeError(
            f"deepep transport needs torch.distributed initialised with {experts.num_ranks} "
            "ranks (attention ranks first, then FFN ranks)"
        )
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        spec.max_tokens, spec.hidden_size, experts.num_ranks, experts.num_experts
    )
    return deep_ep.Buffer(
        dist.group.WORLD,
        num_rdma_bytes=rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=experts.experts_per_rank,
    )


class DeepEPAttentionTransport(AttentionTransport):
    """Attention endpoint: group rank ``rank``; sends tokens, owns only idle virtual experts."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        super().__init__(spec, rank)
        self._experts = VirtualExperts.of(spec)
        self._buffer = _make_buffer(spec, self._experts)
        rows = spec.max_tokens * self._experts.num_ranks
        # combine input for this rank's own (never selected) experts: nothing to send back
        self._idle = torch.zeros(
            self._experts.experts_per_rank, rows, spec.hidden_size, dtype=spec.dtype, device="cuda"
        )

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle:
        """``x``: ``[T, H]`` bfloat16 CUDA; issues the sends and returns (receive on combine).
        The tag does not travel: DeepEP's low-latency kernels carry no metadata (the GPU
        issue redesigns this backend around the control plane)."""
        topk_idx = self._experts.to_virtual(topk_ids)
        _, _, ll_handle, _, hook = self._buffer.low_latency_dispatch(
            x,
            topk_idx,
            self.spec.max_tokens,
            self._experts.num_experts,
            use_fp8=False,
            return_recv_hook=True,
        )
        state = DeepEPState(ll_handle, hook, topk_idx, topk_weights.float())
        return DispatchHandle(
            layer, x.shape[0], x.shape[1], x.dtype, {}, state, self.step, microbatch
        )

    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """``[T, H]`` bfloat16: DeepEP reduces the FFN ranks' outputs with the weights here.

        Raises:
            ValueError: if ``handle`` was already combined.
        """
        state: DeepEPState | None = handle.state
        if state is None:
            raise ValueError(f"handle of layer {handle.layer} was already combined")
        handle.state = None
        state.hook()  # finish the dispatch's receive half (nothing is routed to this rank)
        out, _, _ = self._buffer.low_latency_combine(
            self._idle, state.topk_idx, state.topk_weights, state.ll_handle
        )
        return out


class DeepEPFFNTransport(FFNTransport):
    """FFN endpoint: group rank ``A + rank``; one request per ``recv`` = one layer.

    Raises:
        ValueError: if ``spec.moe_layers`` is empty (see "Layers" in the module docstring).
    """

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        super().__init__(spec, rank)
        if not spec.moe_layers:
            raise ValueError(
                "the deepep transport's FFN side needs TransportSpec.moe_layers (the model's "
                "MoE layer indices) to number the layers it serves; the spec has none"
            )
        self._experts = VirtualExperts.of(spec)
        self._buffer = _make_buffer(spec, self._experts)
        self._layers = spec.moe_layers
        self._calls = 0
        self._first = spec.expert_range(rank).start  # global id of local expert 0
        hidden, top_k = spec.hidden_size, spec.top_k
        self._no_x = torch.empty(0, hidden, dtype=spec.dtype, device="cuda")
        self._no_idx = torch.empty(0, top_k, dtype=torch.int64, device="cuda")
        self._no_weights = torch.empty(0, top_k, dtype=torch.float32, device="cuda")

    @property
    def address(self) -> str:
        return f"deepep:group_rank={self._experts.group_rank_of_ffn(self.rank)}"

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """Join this layer's dispatch; return its tokens as one request (see module doc)."""
        recv_x, recv_count, ll_handle, _, _ = self._buffer.low_latency_dispatch(
            self._no_x,
            self._no_idx,
            self.spec.max_tokens,
            self._experts.num_experts,
            use_fp8=False,
        )
        counts = recv_count.tolist()  # device sync: per-expert token counts
        x = torch.cat([recv_x[e, :n] for e, n in enumerate(counts)])
        local = torch.arange(len(counts), device=x.device) + self._first
        ids = torch.repeat_interleave(local, torch.tensor(counts, device=x.device))
        layer = self._layers[self._calls % len(self._layers)]
        self._calls += 1
        weights = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        tag = (ll_handle, recv_x, counts)
        return [FFNRequest(-1, layer, x, ids[:, None].int(), weights, tag=tag)]

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """``out``: ``[N, H]`` unweighted expert outputs, rows in ``request`` order."""
        ll_handle, recv_x, counts = request.tag
        packed = torch.zeros_like(recv_x)  # [E_local, max_tokens * num_ranks, H]
        for e, rows in enumerate(out.split(counts)):
            packed[e, : rows.shape[0]] = rows
        self._buffer.low_latency_combine(packed, self._no_idx, self._no_weights, ll_handle)
