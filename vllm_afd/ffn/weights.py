"""An FFN rank's routed experts: the model's own vLLM MoE layers, holding this rank's experts.

Nothing here knows a model family. The rank builds the model through vLLM (its class, its
quantization config) without allocating it (the ``meta`` device), as expert-parallel rank
``rank`` of the F FFN ranks (``patches/ffn_rank.py``: vLLM's own ``expert_map`` placement,
which is ``TransportSpec.expert_range``'s contiguous one), then gives real memory to the
``RoutedExperts`` modules only and feeds the model's own ``load_weights`` the checkpoint. The
model's expert-parameter mapping routes each tensor wherever it goes (per-expert or fused
tensors, any names, scales), the layer's weight loader keeps only this rank's experts, and
vLLM's EP filter skips reading other ranks' per-expert tensors. Every other parameter stays on
``meta``, so writing to it does nothing: attention, embeddings, router and shared experts are
never held on an FFN rank. The layer's quant method then prepares the weights for its kernel
(``process_weights_after_loading``: on CPU it repacks them in place, no second copy), the
kernel ``ffn/executor.py`` calls (``ExpertKernel``).

An expert this rank should hold that the checkpoint did not fill is an error naming the layer:
the parameters start as NaN, so a missing tensor cannot pass for zeros.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm_afd.host import free_port

logger = logging.getLogger("vllm.afd")

#: Longest context the FFN rank's engine config asks for: it builds no KV cache, and a long
#: one only makes vLLM's config checks slower.
_MAX_MODEL_LEN = 256


def engine_config(model_dir: str | Path, dtype: torch.dtype):
    """The FFN rank's own vLLM config of the model: stock, no AFD (``additional_config`` has
    no ``afd``, so the plugin's ``RoutedExperts`` is vLLM's), eager."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=_MAX_MODEL_LEN,
    ).create_engine_config()


def _ensure_world() -> None:
    """A vLLM world of this one process (gloo), as a worker has, unless there is one."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    if not torch.distributed.is_initialized():
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
    parallel_state.initialize_model_parallel(1, 1)


def _materialise(layer: torch.nn.Module, device: str) -> None:
    """Real NaN-filled memory for ``layer``'s own parameters (zeros for integer ones).

    New ``Parameter`` objects carry over the old ones' attributes (``weight_loader`` and the
    other loader metadata vLLM sets), which ``Module.to_empty`` would drop.
    """
    for name, param in list(layer.named_parameters(recurse=False)):
        fill = float("nan") if param.is_floating_point() else 0
        new = torch.nn.Parameter(
            torch.full(param.shape, fill, dtype=param.dtype, device=device), requires_grad=False
        )
        new.__dict__.update(param.__dict__)
        setattr(layer, name, new)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of the checkpoint (those its index names, if it has one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = set(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / f for f in sorted(files)]
    return sorted(model_dir.glob("*.safetensors"))


def _checkpoint(model_dir: Path, local: set[int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor except other ranks' per-expert ones (vLLM's EP filter)."""
    from safetensors import safe_open
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    files = _checkpoint_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir}: no safetensors checkpoint")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if not should_skip_weight(name, local):
                    yield name, f.get_tensor(name)


def _check_loaded(name: str, layer) -> None:
    """ValueError naming the layer and experts whose parameters the checkpoint left NaN."""
    local = layer.expert_map_manager.get_local_expert_ids()
    missing: dict[str, list[int]] = {}
    for pname, param in layer.named_parameters(recurse=False):
        if not param.is_floating_point():
            continue
        nan = torch.isnan(param.detach())
        per_expert = nan.reshape(nan.shape[0], -1).any(1) if nan.dim() else nan.reshape(1)
        if per_expert.any():
            ids = per_expert.nonzero().flatten().tolist()
            missing[pname] = [local[i] for i in ids] if len(per_expert) == len(local) else ids
    if missing:
        raise ValueError(
            f"{name}: the checkpoint did not fill {missing} (parameter -> global expert ids): "
            "missing routed-expert tensors"
        )


def load_routed_experts(
    model_dir: str | Path, rank: int, num_ranks: int, dtype: torch.dtype, device: str = "cpu"
) -> dict[int, torch.nn.Module]:
    """FFN rank ``rank`` of ``num_ranks``: the model's MoE layers holding this rank's experts.

    Returns the model's layer number -> its vLLM ``RoutedExperts`` module (weights loaded and
    processed for the layer's kernel, ``expert_map`` set when ``num_ranks > 1``). Raises
    ``ValueError`` when the model has no routed experts or an expert was not in the checkpoint.
    """
    from vllm_afd.patches import cpu_comm
    from vllm_afd.patches.base import check_unwrapped
    from vllm_afd.patches.ffn_rank import expert_parallel_placement

    cpu_comm.apply()  # S2: vLLM's CPU kernel honours expert_map (the worker patch FFN ranks need)
    check_unwrapped("F4")
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.utils import extract_layer_index

    model_dir = Path(model_dir)
    vllm_config = engine_config(model_dir, dtype)
    with set_current_vllm_config(vllm_config):
        _ensure_world()
        with expert_parallel_placement(vllm_config, rank, num_ranks, device):
            with torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config)
            named = {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
            if not named:
                raise ValueError(f"{model_dir}: the model has no routed-expert layers")
            for layer in named.values():
                _materialise(layer, device)
            held = next(iter(named.values())).expert_map_manager.get_local_expert_ids()
            local = set(held) if num_ranks > 1 else None  # vLLM's own placement of this rank
            model.load_weights(_checkpoint(model_dir, local))
        layers = {}
        for name, layer in named.items():
            _check_loaded(name, layer)
            layer.quant_method.process_weights_after_loading(layer)
            layers[extract_layer_index(name)] = layer
    del model  # the meta rest of the model; the layers live on in ``layers``
    return dict(sorted(layers.items()))


def expert_bytes(layers: dict[int, torch.nn.Module]) -> int:
    """Bytes of the expert weights ``layers`` hold (what the rank's memory holds for them)."""
    return sum(
        p.nbytes for layer in layers.values() for p in layer.parameters() if p.device.type != "meta"
    )
