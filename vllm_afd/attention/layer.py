"""Attention-side hook: MoE layers whose routed experts live on the FFN group.

vLLM builds every MoE layer through its MoE factory: a ``MoERunner`` holding the router, the
shared experts and a ``RoutedExperts`` that owns the expert weights and a quant method. The
runner routes first (``router.select_experts`` -> ``topk_weights, topk_ids``) and then calls
``RoutedExperts.forward_modular`` -> ``quant_method.apply``: that call is exactly the routing
boundary. So the hook is one pluggable-layer swap (``AFDRoutedExperts``, registered out of
tree for ``RoutedExperts``) that, when AFD is configured, gives the layer a quant method
(``AFDRemoteExpertsMethod``) which

* registers zero-size placeholders instead of expert weights (the model's loader still finds
  the parameter names it expects, and the placeholders' loader discards expert tensors),
* reports an internal modular kernel, so vLLM does not all-gather tokens across DP ranks,
* in ``apply`` sends the routed tokens to the FFN group and returns their combined outputs.

Everything else (attention, norms, projections, router, shared experts, vLLM's scheduler and
KV-cache manager) runs unchanged. Without AFD configured, ``AFDRoutedExperts`` is exactly
``RoutedExperts``.

The remote call is a registered custom op (``torch.ops.vllm_afd.remote_experts``) so that
Dynamo (the CPU platform compiles the model by default) treats it as opaque.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.utils import set_weight_attrs

from vllm_afd.attention import session as sessions
from vllm_afd.attention.exchange import round_trip
from vllm_afd.attention.failures import healthy_round_trip, isolate
from vllm_afd.config import AFDConfig
from vllm_afd.errors import FFNServeError

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig


class AFDRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose experts run on the FFN group when AFD is configured.

    A speculative-decoding draft's MoE layers (an MTP layer, an MoE EAGLE head, an MoE draft
    model) keep their experts here, on the attention ranks, by choice: the FFN ranks hold the
    target model's experts, keyed by the target's layer numbers, which a draft's own numbering
    may repeat. A draft is built under a vLLM model tag of its own (``_building_draft``).
    """

    def _get_quant_method(
        self, prefix: str, quant_config: QuantizationConfig | None, moe_config: FusedMoEConfig
    ) -> FusedMoEMethodBase:
        # Overrides a private vLLM method: ledger entry P7 in vllm_afd/patches/__init__.py.
        from vllm.config import get_current_vllm_config

        if AFDConfig.of(get_current_vllm_config()) is None or _building_draft():
            return super()._get_quant_method(prefix, quant_config, moe_config)
        return AFDRemoteExpertsMethod(moe_config, layer_name=prefix)


def _building_draft() -> bool:
    """True while vLLM builds a speculative-decoding draft (P8: the model tag vLLM's proposers
    set around it, ``set_model_tag("eagle_head")`` / ``"draft_model"`` / ..., is not the
    target's ``"backbone"``)."""
    from vllm.compilation import backends

    tag: str = backends.model_tag
    return tag != "backbone"


def _discard_expert_weight(
    param: torch.nn.Parameter,
    loaded_weight: torch.Tensor,
    *args: Any,
    return_success: bool = False,
    **kwargs: Any,
) -> bool | None:
    """Weight loader of the placeholders: expert tensors belong to the FFN ranks."""
    return True if return_success else None


class _ScratchExperts(torch.nn.Module):
    """Receives what a quant method's ``create_weights`` registers; every other attribute read
    falls through to the real layer (its ``moe_config``, sizes, ...)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_afd_layer", layer)  # not a submodule

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_afd_layer"), name)


def _stock_expert_parameters(
    layer: RoutedExperts, **create_kwargs: Any
) -> dict[str, torch.nn.Parameter]:
    """The parameters the layer's own quant method (the one stock vLLM gives it: unquantized,
    FP8, INT4, ... with any scales, zero points and biases) would create, built on ``meta``
    into a scratch module: names, dtypes and loader attributes, no memory."""
    stock = RoutedExperts._get_quant_method(
        layer, layer.layer_name, layer.quant_config, layer.moe_config
    )
    scratch = _ScratchExperts(layer)
    with torch.device("meta"):
        stock.create_weights(layer=scratch, **create_kwargs)
    return dict(scratch.named_parameters(recurse=False))


def _placeholder(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A zero-size stand-in for ``param``: its dtype, rank and attributes (``quant_method``,
    ``is_transposed``, ...), with the discarding weight loader."""
    shape = (0, *param.shape[1:]) if param.dim() else (0,)
    new = torch.nn.Parameter(torch.empty(shape, dtype=param.dtype), requires_grad=False)
    attrs = {k: v for k, v in vars(param).items() if k not in ("weight_loader", "_weight_loader")}
    new.__dict__.update(attrs)
    set_weight_attrs(new, {"weight_loader": _discard_expert_weight})
    return new


class AFDRemoteExpertsMethod(FusedMoEMethodBase):
    """Quant method of an AFD layer: no local weights, experts computed remotely."""

    def __init__(self, moe: FusedMoEConfig, layer_name: str) -> None:
        super().__init__(moe)
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_index = extract_layer_index(layer_name)

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Zero-size placeholders for every parameter the layer's stock quant method would
        create, under any quantization: the model's loader finds every name it maps an expert
        tensor to (weights, scales, zero points, biases) and the tensors are discarded."""
        stock = _stock_expert_parameters(
            layer,
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            params_dtype=params_dtype,
            **extra_weight_attrs,
        )
        for name, param in stock.items():
            layer.register_parameter(name, _placeholder(param))

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig | None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    @property
    def supports_internal_mk(self) -> bool:
        # The FFN group serves every DP rank's tokens itself: no naive all-gather needed.
        return True

    @property
    def is_monolithic(self) -> bool:
        return False

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: torch.nn.Module | None,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """The routing boundary: this layer's routed-expert output, computed by the FFN group.

        Args:
            layer: the ``RoutedExperts`` module (holds only zero-size placeholders).
            x: ``[T, H]`` hidden states, the model dtype (this rank's tokens).
            topk_weights: ``[T, K]`` float32 routing weights from vLLM's router.
            topk_ids: ``[T, K]`` integer global expert ids from vLLM's router.
            shared_experts, shared_experts_input: unused here; vLLM's ``MoERunner`` runs the
                shared experts itself and adds their output.
        Returns:
            ``[T, H]`` in ``x.dtype``: ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``.
        """
        if torch.compiler.is_compiling():
            out: torch.Tensor = remote_experts(x, topk_weights, topk_ids, self.layer_index)
            return out
        return remote_experts_impl(x, topk_weights, topk_ids, self.layer_index)


def remote_experts_impl(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Routed-expert output for ``x`` ``[T, H]`` computed by the FFN group, through this
    worker's session (``attention/session.py``): the step begun if this is its first layer,
    the round trip (``attention/exchange.py``), an FFN error's isolation
    (``attention/failures.py``).

    Under tensor parallelism every TP rank holds the same tokens; each sends only its share
    of rows and leaves the others zero, and the runner's TP all-reduce completes the sum.
    """
    session = sessions.current()
    if session is None:
        raise RuntimeError(
            "AFD: no FFN group connected in this process (the attention session opens when "
            "vLLM's worker loads the model: patch W4)"
        )
    session.before_dispatch(x.shape[0])
    if session.tp_size == 1:
        failed = session.failures.forward  # requests failed earlier in this forward?
        if failed is not None and failed.now():
            return healthy_round_trip(session, layer, x, topk_ids, topk_weights, failed)
        try:
            return round_trip(session, layer, x, topk_ids, topk_weights)
        except FFNServeError as error:
            return isolate(session, layer, x, topk_ids, topk_weights, error, None)
    rows = torch.arange(session.tp_rank, x.shape[0], session.tp_size, device=x.device)
    out = torch.zeros_like(x)
    out[rows] = round_trip(session, layer, x[rows].contiguous(), topk_ids[rows], topk_weights[rows])
    return out


@torch.library.custom_op("vllm_afd::remote_experts", mutates_args=())
def remote_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Opaque-to-Dynamo wrapper of ``remote_experts_impl``."""
    return remote_experts_impl(x, topk_weights, topk_ids, layer)


@remote_experts.register_fake
def _remote_experts_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    return torch.empty_like(x)
