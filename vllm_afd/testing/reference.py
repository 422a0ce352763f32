"""Pure-PyTorch reference semantics of dispatch/combine (the math only, no transport).

What every transport must compute, without any transport: for each token ``t``

    out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])

``reference_moe_combine`` evaluates it densely in one process. It sums in the order a transport
does (per FFN rank, the rank's local experts in ascending id; then the ranks in ascending order,
starting from zero), so a transport whose FFN side runs ``local_moe_forward`` must match it
*exactly* for experts that act row by row (``ScaleExperts``), and to rounding for experts whose
matmuls depend on the batch shape (``SiluMulExperts``).

``LocalMoE`` is what an FFN rank computes (its local experts, non-local ids masked), in the
``FFNForward`` form the reference FFN loop of ``vllm_afd.testing`` serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_afd.transport.base import TransportSpec, expert_range

#: ``expert_fn(expert_id, x) -> y``: ``x`` ``[n, H]`` -> ``y`` ``[n, H]``, same dtype.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


class FFNForward(Protocol):
    """What an FFN rank runs on one request: ``[N, H]``, ``[N, K]`` int32, ``[N, K]`` float32
    -> ``[N, H]`` (the request's dtype), already weighted and summed over local experts.
    Given ``out`` (``[N, H]``, the request's dtype), the answer is written there and returned."""

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class SiluMulExperts:
    """vLLM-style gated MLP experts: ``y = (silu(x @ w1.T) * (x @ w3.T)) @ w2.T``.

    Attributes:
        w13: ``[E, 2I, H]``; rows ``[:I]`` are the gate projection, ``[I:]`` the up projection.
        w2: ``[E, H, I]`` down projection.
    """

    w13: torch.Tensor
    w2: torch.Tensor

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w13[expert].t()
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w2[expert].t()

    def local(self, first: int, count: int) -> SiluMulExperts:
        """The experts ``[first, first + count)`` renumbered from 0 (an FFN rank's share)."""
        return SiluMulExperts(
            self.w13[first : first + count].clone(), self.w2[first : first + count].clone()
        )


@dataclass
class ScaleExperts:
    """Row-wise experts ``y = x * scales[e]`` (exact under any batching). ``scales``: ``[E]``."""

    scales: torch.Tensor

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return x * self.scales[expert].to(x.dtype)

    def local(self, first: int, count: int) -> ScaleExperts:
        return ScaleExperts(self.scales[first : first + count].clone())


def weighted_expert_sum(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_fn: ExpertFn,
    experts: range,
    id_offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_{e in experts} w_e * expert_fn(e - id_offset, x)`` over the tokens routed to ``e``.

    Args:
        x: ``[N, H]`` hidden states.
        topk_ids: ``[N, K]`` integer global expert ids; ids outside ``experts`` are masked.
        topk_weights: ``[N, K]`` float32 routing weights.
        expert_fn: called with the expert id minus ``id_offset`` (local ids on an FFN rank).
        experts: global ids to evaluate, summed in ascending order starting from zero.
        out: optional ``[N, H]`` ``x.dtype`` tensor to sum into (overwritten) and return.
    Returns:
        ``[N, H]`` in ``x.dtype``; zero for tokens routed to none of ``experts``.
    """
    out = torch.zeros_like(x) if out is None else out.zero_()
    for expert in experts:
        mask = topk_ids == expert
        rows = mask.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        weight = (topk_weights * mask).sum(dim=1)[rows]
        y = expert_fn(expert - id_offset, x[rows])
        out.index_add_(0, rows, (y * weight[:, None]).to(x.dtype))
    return out


def reference_moe_combine(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_fn: ExpertFn,
    num_experts: int,
    num_ffn_ranks: int = 1,
) -> torch.Tensor:
    """Dense single-process dispatch + expert compute + combine.

    Args:
        x: ``[T, H]`` hidden states.
        topk_ids: ``[T, K]`` integer global expert ids.
        topk_weights: ``[T, K]`` float32 routing weights.
        expert_fn: ``expert_fn(global_id, [n, H]) -> [n, H]``.
        num_experts: ``E``; ``num_ffn_ranks`` ``F`` only sets the summation grouping.
    Returns:
        ``[T, H]`` in ``x.dtype``: ``0 + sum_f (0 + sum_{e on f} w_e * expert_e(x))``.
    """
    out = torch.zeros_like(x)
    for rank in range(num_ffn_ranks):
        experts = expert_range(num_experts, num_ffn_ranks, rank)
        out += weighted_expert_sum(x, topk_ids, topk_weights, expert_fn, experts)
    return out


@dataclass
class LocalMoE:
    """FFN-rank forward: its local experts, non-local ids masked.

    Attributes:
        experts: local expert function (ids ``0..num_local-1``), e.g. ``SiluMulExperts.local``.
        first_expert: global id of local expert 0.
        num_local: number of local experts.
    """

    experts: ExpertFn
    first_expert: int
    num_local: int

    @classmethod
    def for_rank(
        cls, experts: SiluMulExperts | ScaleExperts, spec: TransportSpec, rank: int
    ) -> LocalMoE:
        """FFN rank ``rank``'s share of ``experts`` (``spec.expert_range(rank)``)."""
        share = spec.expert_range(rank)
        return cls(experts.local(share.start, len(share)), share.start, len(share))

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        experts = range(self.first_expert, self.first_expert + self.num_local)
        return weighted_expert_sum(
            x, topk_ids, topk_weights, self.experts, experts, self.first_expert, out
        )
