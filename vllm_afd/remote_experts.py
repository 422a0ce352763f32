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

import os
import threading
import time
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.utils import set_weight_attrs

from vllm_afd import metrics
from vllm_afd.config import afd_section
from vllm_afd.microbatch import overlap_point
from vllm_afd.transport import AttentionTransport, create_attention_transport


def afd_settings() -> dict | None:
    """``additional_config["afd"]`` of the current vLLM config, or None when AFD is off."""
    from vllm.config import get_current_vllm_config

    return afd_section(get_current_vllm_config().additional_config)


class AFDRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose experts run on the FFN group when AFD is configured."""

    def _get_quant_method(self, prefix, quant_config, moe_config) -> FusedMoEMethodBase:
        if afd_settings() is None:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        return AFDRemoteExpertsMethod(moe_config, layer_name=prefix)


def _discard_expert_weight(param, loaded_weight, *args, return_success=False, **kwargs):
    """Weight loader of the placeholders: expert tensors belong to the FFN ranks."""
    return True if return_success else None


class AFDRemoteExpertsMethod(FusedMoEMethodBase):
    """Quant method of an AFD layer: no local weights, experts computed remotely."""

    def __init__(self, moe, layer_name: str) -> None:
        super().__init__(moe)
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_index = extract_layer_index(layer_name)

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        **extra_weight_attrs,
    ) -> None:
        names = ["w13_weight", "w2_weight"]
        if self.moe.has_bias:
            names += ["w13_bias", "w2_bias"]
        for name in names:
            param = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": _discard_expert_weight})

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        return None

    @property
    def supports_internal_mk(self) -> bool:
        # The FFN group serves every DP rank's tokens itself: no naive all-gather needed.
        return True

    @property
    def is_monolithic(self) -> bool:
        return False

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if torch.compiler.is_compiling():
            return remote_experts(x, topk_weights, topk_ids, self.layer_index)
        return remote_experts_impl(x, topk_weights, topk_ids, self.layer_index)


# --------------------------------------------------------------------------------------------
# The per-process connection to the FFN group and the custom op.
# --------------------------------------------------------------------------------------------

_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Session:
    """This worker's connection to the running FFN group, with its place among the ranks."""

    key: str  # the runtime spec it was made from
    endpoint: AttentionTransport
    tp_rank: int
    tp_size: int


_SESSION: _Session | None = None


def _session() -> _Session:
    """This process's session, (re)connected when the running FFN group changes."""
    global _SESSION
    from vllm_afd.placement import RUNTIME_ENV, runtime_spec

    key = os.environ.get(RUNTIME_ENV, "")
    session = _SESSION
    if session is not None and session.key == key:
        return session
    from vllm.distributed.parallel_state import get_dp_group, get_tp_group

    with _LOCK:
        if _SESSION is not None:
            _SESSION.endpoint.close()
        tp = get_tp_group()
        rank = get_dp_group().rank_in_group * tp.world_size + tp.rank_in_group
        endpoint = create_attention_transport(runtime_spec(), rank)
        _SESSION = _Session(key, endpoint, tp.rank_in_group, tp.world_size)
        return _SESSION


def remote_experts_impl(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Routed-expert output for ``x`` ``[T, H]`` computed by the FFN group.

    Under tensor parallelism every TP rank holds the same tokens; each sends only its share
    of rows and leaves the others zero, and the runner's TP all-reduce completes the sum.
    """
    session = _session()
    if session.tp_size == 1:
        return _round_trip(session.endpoint, layer, x, topk_ids, topk_weights)
    rows = torch.arange(session.tp_rank, x.shape[0], session.tp_size)
    out = torch.zeros_like(x)
    out[rows] = _round_trip(
        session.endpoint, layer, x[rows].contiguous(), topk_ids[rows], topk_weights[rows]
    )
    return out


def _round_trip(
    endpoint: AttentionTransport,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """dispatch -> (other microbatches run) -> combine, counted for /metrics: the wait in
    combine is the FFN time the overlap did not hide."""
    try:
        handle = endpoint.dispatch(layer, x, topk_ids, topk_weights)
        overlap_point()  # ping-pong microbatches: the next one runs while the FFN group works
        start = time.perf_counter()
        out = endpoint.combine(handle)
    except Exception as exc:
        metrics.record_error(metrics.error_kind(exc), rank=endpoint.rank)
        raise
    metrics.record_combine(endpoint, handle, time.perf_counter() - start)
    return out


@torch.library.custom_op("vllm_afd::remote_experts", mutates_args=())
def remote_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Opaque-to-Dynamo wrapper of ``remote_experts_impl``."""
    return remote_experts_impl(x, topk_weights, topk_ids, layer)


@remote_experts.register_fake
def _remote_experts_fake(x, topk_weights, topk_ids, layer):
    return torch.empty_like(x)
