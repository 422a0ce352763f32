"""The device check's toy model (``testing/slot_plane_check.py``): per layer a router
(``x @ R``, top-k, softmax) on the attention side, dense masked SiLU-gated experts on the FFN
side (capturable: no data-dependent shapes), a residual ``x = x + moe(x)``, so every layer's
input depends on the previous layer's answer; and vLLM's DBO call order its steps follow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 4, 8, 2, 256, 128, 16


class ToyMoE:
    """The toy model's per-layer router and experts, the same in every process (fixed seed)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, layers: int = LAYERS) -> None:
        g = torch.Generator().manual_seed(19)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype).to(device)

        self.router = rand(layers, HIDDEN, EXPERTS)
        self.w13 = rand(layers, EXPERTS, 2 * INTER, HIDDEN)
        self.w2 = rand(layers, EXPERTS, HIDDEN, INTER)

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (x @ self.router[layer]).float()
        weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
        return ids.to(torch.int32), weights

    def experts(self, layer: int) -> Callable:
        def forward(x, ids, weights, out):
            acc = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
            for e in range(EXPERTS):
                w = (weights * (ids == e)).sum(-1, keepdim=True)
                gate, up = (x @ self.w13[layer, e].t()).chunk(2, -1)
                acc += w * ((F.silu(gate) * up) @ self.w2[layer, e].t()).float()
            return out.copy_(acc)

        return forward

    def reference(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """The step in one process, as the plane computes it: ``x = x + moe_l(x)`` for every
        layer, each attention rank's rows (``xs[a]``, one use) routed on their own and the
        experts run once over all of them in rank order (the FFN rank's gather), so that
        every matrix product has the FFN's shape: on a GPU a row's product may change with
        the number of rows (cuBLAS's kernel choice), and one bf16 step anywhere flips a
        later layer's top-k, which no bf16 tolerance absorbs."""
        rows = [x.shape[0] for x in xs]
        for layer in range(self.router.shape[0]):
            routed = [self.route(layer, x) for x in xs]
            x = torch.cat(xs)
            ids, weights = (torch.cat(parts) for parts in zip(*routed, strict=True))
            out = self.experts(layer)(x, ids, weights, torch.empty_like(x))
            xs = tuple(x + o for x, o in zip(xs, out.split(rows), strict=True))
        return list(xs)


def dbo_order(layers: int, microbatches: int = 2) -> list[tuple[str, int, int]]:
    """vLLM's DBO call order for two microbatches whose threads alternate at one yield per
    MoE layer: D0, D1, then per layer C0, D0', C1, D1', ... (("D" | "C", microbatch, layer)).
    tests/unit/transport/test_slot_plane.py checks it against vLLM's own ubatch threads."""
    if microbatches == 1:
        return [(op, 0, layer) for layer in range(layers) for op in "DC"]
    order = [("D", 0, 0), ("D", 1, 0)]
    for layer in range(layers):
        for mb in (0, 1):
            order.append(("C", mb, layer))
            if layer + 1 < layers:
                order.append(("D", mb, layer + 1))
    return order


__all__ = ["EXPERTS", "HIDDEN", "INTER", "LAYERS", "TOKENS", "TOP_K", "ToyMoE", "dbo_order"]
