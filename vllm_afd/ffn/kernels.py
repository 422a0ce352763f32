"""The expert kernels of an FFN rank, and the routing they take.

Every kernel is called as ``kernel(layer, x, local_ids, weights, out=None)`` and computes
``sum_k w_k * expert_k(x)`` over this rank's experts only. The transport hands over *global*
expert ids; ``localize_routing`` turns them into local ids through an ``expert_map`` (vLLM's
convention: global id -> local id, -1 where the expert lives elsewhere) and zeroes the weight of
the other ranks' experts, so they add exactly nothing.

The CPU kernel is vLLM's own (``cpu_fused_moe`` with the same prepacked layout), so that AFD
outputs match colocated serving bit for bit; ``TorchExperts`` is the pure-PyTorch reference the
fast kernels are tested against.
"""

from __future__ import annotations

import torch

from vllm_afd.ffn.weights import LayerExperts


def expert_map(experts: range, num_experts: int) -> torch.Tensor:
    """Global -> local expert id, int32 ``[num_experts]``: ``experts`` become ``0..len-1``,
    every other expert ``-1`` (vLLM's ``expert_map`` convention). Built once per rank."""
    out = torch.full((num_experts,), -1, dtype=torch.int32)
    out[list(experts)] = torch.arange(len(experts), dtype=torch.int32)
    return out


def localize_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global expert ids to local ids through ``expert_map``; zero foreign experts' weights.

    Args:
        topk_ids: ``[N, K]`` int32 or int64 global expert ids (each in ``[0, E)``).
        topk_weights: ``[N, K]`` routing weights.
        expert_map: ``[E]`` integer, global id -> local id, ``-1`` where not local.
    Returns:
        ``(local_ids int32 [N, K], weights float32 [N, K])``, the dtypes vLLM's CPU kernel
        takes; a foreign expert becomes local id 0 with weight 0.
    """
    local = expert_map[topk_ids]
    weights = topk_weights.to(torch.float32).masked_fill(local < 0, 0.0)
    return local.clamp_min(0).to(torch.int32), weights


class TorchExperts:
    """Pure-PyTorch reference: ``out[t] = sum_k w[t,k] * down(silu(gate x) * up x)``.

    Runs on ``device`` (weights are moved there once; inputs and the answer cross per call),
    which makes it the correct-but-slow expert kernel of a CUDA FFN rank until a grouped-GEMM
    kernel is wired in (not run on a GPU yet).
    """

    def __init__(self, layers: dict[int, LayerExperts], device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.layers = {
            layer: LayerExperts(w.w13.to(self.device), w.w2.to(self.device))
            for layer, w in layers.items()
        }

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        local_ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N, H]`` in ``x.dtype``; written into ``out`` (and returned) when given."""
        if x.device != self.device:
            y = self(layer, x.to(self.device), local_ids.to(self.device), weights.to(self.device))
            return y.to(x.device) if out is None else out.copy_(y)
        experts = self.layers[layer]
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(local_ids[weights != 0]).tolist():
            rows, slots = torch.nonzero((local_ids == e) & (weights != 0), as_tuple=True)
            h = x[rows].float() @ experts.w13[e].float().t()
            gate, up = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ experts.w2[e].float().t()
            acc.index_add_(0, rows, y * weights[rows, slots, None])
        return acc.to(x.dtype) if out is None else out.copy_(acc)


class VllmCpuExperts:
    """vLLM's CPU grouped-GEMM MoE kernel with vLLM's prepacked weight layout."""

    def __init__(self, layers: dict[int, LayerExperts], dtype: torch.dtype) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight

        self.isa = _cpu_isa(dtype)
        self.layers = {
            layer: LayerExperts(
                cpu_prepack_moe_weight(_pad_w13(w.w13), self.isa),
                cpu_prepack_moe_weight(_pad_w2(w.w2), self.isa),
            )
            for layer, w in layers.items()
        }

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        local_ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N, H]`` in ``x.dtype``; written into ``out`` (and returned) when given."""
        from vllm._custom_ops import cpu_fused_moe

        experts = self.layers[layer]
        if out is None:
            out = torch.empty_like(x)
        cpu_fused_moe(
            out, x, experts.w13, experts.w2, None, None, weights, local_ids, "silu", self.isa
        )
        return out


def _cpu_isa(dtype: torch.dtype) -> str:
    """The ISA vLLM's CPU experts pick for this dtype (see vllm experts/cpu_moe.py)."""
    import platform

    if dtype == torch.bfloat16 and platform.machine() in ("x86_64", "AMD64"):
        if torch.cpu._is_amx_tile_supported():
            return "amx"
    if dtype == torch.bfloat16 and platform.machine() in ("aarch64", "arm64"):
        return "neon"
    return "vec"


# vLLM's CPU kernel wants the intermediate size padded to its alignment: a property of the
# kernel's prepacked layout, not of the checkpoint, so the padding lives with the kernel.


def _padded(size: int, multiple: int = 32) -> int:
    return (size + multiple - 1) // multiple * multiple


def _pad_w13(w13: torch.Tensor) -> torch.Tensor:
    """Zero-pad the intermediate dim of ``[E, 2I, H]`` to vLLM's CPU alignment (gate | up)."""
    inter = w13.shape[1] // 2
    padded = _padded(inter)
    if padded == inter:
        return w13
    out = w13.new_zeros(w13.shape[0], 2 * padded, w13.shape[2])
    out[:, :inter] = w13[:, :inter]
    out[:, padded : padded + inter] = w13[:, inter:]
    return out


def _pad_w2(w2: torch.Tensor) -> torch.Tensor:
    inter = w2.shape[2]
    if _padded(inter) == inter:
        return w2
    out = w2.new_zeros(w2.shape[0], w2.shape[1], _padded(inter))
    out[:, :, :inter] = w2
    return out


def make_expert_kernel(layers: dict[int, LayerExperts], device: str, dtype: torch.dtype):
    """Pick the expert kernel for ``device``: ``cpu`` (vLLM's CPU kernel), ``cuda`` (the
    PyTorch reference on the GPU), ``torch`` (the reference on the CPU)."""
    if device == "cpu":
        return VllmCpuExperts(layers, dtype)
    if device == "cuda":
        return TorchExperts(layers, "cuda")
    if device == "torch":
        return TorchExperts(layers)
    raise ValueError(f"FFN device {device!r}; allowed: cpu, cuda, torch")
