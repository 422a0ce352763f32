"""The expert kernel of an FFN rank: each MoE layer's own quant method, given the routing.

An FFN rank computes ``sum_k w_k * expert_k(x)`` over the experts it holds, for routing the
attention side already chose (``topk_ids`` global expert ids, ``topk_weights``). It calls the
layer's quant method the way vLLM's ``MoERunner`` does after ``select_experts``
(``quant_method.apply(layer, x, topk_weights, topk_ids, ...)``), so the FFN runs whatever
kernel stock vLLM picks for that layer on that platform and quantization (the CPU grouped GEMM,
a CUDA modular kernel), on the weights that kernel's own ``process_weights_after_loading``
prepared: AFD's outputs match colocated serving because the code is the same.

Ids stay global: with expert parallelism vLLM's kernels translate them through the layer's
``expert_map`` (global -> local id, ``-1`` elsewhere; on the CPU build through patch S2). The
weights of experts held by other FFN ranks are zeroed first, which every kernel honours, also
those that apply the routing weight to the input (Llama-4), so each rank's answer is exactly
its share and the attention side's sum is the whole.

``localize_routing`` is the id translation itself (global -> local ids, foreign weights zeroed),
kept here as the one implementation that patch S2 applies inside vLLM's CPU kernel.
"""

from __future__ import annotations

import torch


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


def foreign_experts(layer: torch.nn.Module) -> torch.Tensor | None:
    """``[E]`` bool: True for the global experts ``layer`` does not hold; None if it holds all."""
    local = layer.expert_map_manager.get_local_expert_ids()
    if len(local) == layer.global_num_experts:
        return None
    foreign = torch.ones(layer.global_num_experts, dtype=torch.bool)
    foreign[local] = False
    return foreign


class ExpertKernel:
    """``kernel(layer, x, topk_ids, topk_weights)`` -> ``[N, H]``: the MoE layer numbered
    ``layer`` (the model's layer number) over this rank's experts, in ``x.dtype``.

    Inputs may live on the host (the transports' buffers); they cross to the layers' device and
    the answer comes back, when the two differ.
    """

    def __init__(self, layers: dict[int, torch.nn.Module], device: str = "cpu") -> None:
        self.layers = layers
        self.device = torch.device(device)
        self.foreign = {}
        for number, layer in layers.items():
            foreign = foreign_experts(layer)
            self.foreign[number] = None if foreign is None else foreign.to(self.device)

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if x.device != self.device:
            y = self(
                layer,
                x.to(self.device),
                topk_ids.to(self.device),
                topk_weights.to(self.device),
            )
            return y.to(x.device)
        module = self.layers[layer]
        foreign = self.foreign[layer]
        if foreign is not None:
            topk_weights = topk_weights.masked_fill(foreign[topk_ids.long()], 0.0)
        return module.quant_method.apply(module, x, topk_weights, topk_ids, None, None)
