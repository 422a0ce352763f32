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

Quantized experts. The layers carry the checkpoint's own quant method (FP8, INT4, ...), which
loads the quantized weights and their scales; where the platform has a kernel for the format
(FP8 on GPUs and AMX CPUs), the FFN rank uses it unchanged, as stock vLLM would. Where it has
none, an FP8 layer falls back: its experts are dequantized at load to the serving dtype
(``weight x scale``, per tensor, channel or block, whatever the scale's shape says) and served
by vLLM's ``UnquantizedFusedMoEMethod`` (on CPU the same grouped GEMM as unquantized models),
with one log line saying so. The outputs are then those of the dequantized model: activations
are not quantized (with ``activation_scheme: dynamic`` only the activation rounding differs
from the FP8 kernel's; static input scales are not applied).

"No kernel" is vLLM's own decision, not a list here: a quant method built on vLLM's MoE kernel
oracle (``Fp8MoEMethod`` and the others that call ``select_*_moe_backend``) asks every kernel
class whether it supports this platform and configuration (``is_supported_config``: e.g.
``CPUExpertsFp8`` needs AMX tiles) and keeps ``experts_cls = None`` when none does. On CPU the
oracle returns that instead of raising (on CUDA and ROCm it raises in the constructor, so stock
vLLM and the FFN rank fail alike), and the method would fail only at
``process_weights_after_loading``. The fallback runs when the layer's expert weights are FP8 and
``experts_cls`` is None; any other format without a kernel fails in vLLM's own code, as it does
colocated.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    # a routed-experts layer as vLLM builds it
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts as MoELayer

logger = logging.getLogger("vllm.afd")

#: Longest context the FFN rank's engine config asks for: it builds no KV cache, and a long
#: one only makes vLLM's config checks slower.
_MAX_MODEL_LEN = 256
#: Bytes a rank reads from one opening of a checkpoint file before it reopens it (``_checkpoint``).
_MAPPED_BYTES = 32 << 20


def engine_config(model_dir: str | Path, dtype: torch.dtype) -> VllmConfig:
    """The FFN rank's own vLLM config of the model: stock, no AFD (``additional_config`` has
    no ``afd``, so the plugin's ``RoutedExperts`` is vLLM's), eager."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),  # torch's names
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=_MAX_MODEL_LEN,
    ).create_engine_config()


def _ensure_world() -> None:
    """A vLLM world of this one process (gloo), as a worker has, unless there is one.

    Its rendezvous is a file in a private directory, not ``tcp://``: torch's TCP store
    listens on every interface whatever host the URL names, with no authentication. The
    directory is removed as soon as the groups exist (nothing of a world of one process uses
    the store afterwards), so that a killed FFN rank (failover, ``ray.kill`` at shutdown: no
    ``atexit``) leaves nothing behind.
    """
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    private = None
    if not torch.distributed.is_initialized():
        private = tempfile.mkdtemp(prefix="vllm_afd_world_")  # mode 0700
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{os.path.join(private, 'store')}",
            local_rank=0,
            backend="gloo",
        )
    try:
        parallel_state.initialize_model_parallel(1, 1)
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _materialise(layer: MoELayer, device: str) -> None:
    """Real NaN-filled memory for ``layer``'s own parameters (zeros for integer ones).

    New ``Parameter`` objects carry over the old ones' attributes (``weight_loader`` and the
    other loader metadata vLLM sets), which ``Module.to_empty`` would drop. Parameters that
    another module holds too (marked ``_afd_elsewhere``: the router's
    ``e_score_correction_bias``, which vLLM hands the layer) stay on meta: they are routing
    state, and routing runs on the attention ranks.
    """
    for name, param in list(layer.named_parameters(recurse=False)):
        if getattr(param, "_afd_elsewhere", False):
            continue
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
    """Every checkpoint tensor except other ranks' per-expert ones (vLLM's EP filter).

    safetensors maps a file and copies each tensor out of the mapping; the pages it touched
    stay in this process's resident memory until the file is closed, which for a one-shard
    checkpoint doubled the rank's peak while loading. So a file is reopened after every
    ``_MAPPED_BYTES`` read: the rank holds at most that much of the mapping at a time.
    """
    from safetensors import safe_open
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    files = _checkpoint_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir}: no safetensors checkpoint")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names = [name for name in f.keys() if not should_skip_weight(name, local)]  # noqa: SIM118
        done = 0
        while done < len(names):
            with safe_open(str(path), framework="pt") as f:
                mapped = 0
                while done < len(names) and mapped < _MAPPED_BYTES:
                    tensor = f.get_tensor(names[done])
                    mapped += tensor.nbytes
                    yield names[done], tensor
                    done += 1


def _check_loaded(name: str, layer: MoELayer) -> None:
    """ValueError naming the layer and experts whose parameters the checkpoint left NaN."""
    local = layer.expert_map_manager.get_local_expert_ids()
    missing: dict[str, list[int]] = {}
    for pname, param in layer.named_parameters(recurse=False):
        if not param.is_floating_point() or param.is_meta:  # meta: routing state (_materialise)
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
) -> dict[int, MoELayer]:
    """FFN rank ``rank`` of ``num_ranks``: the model's MoE layers holding this rank's experts.

    Returns the model's layer number -> its vLLM ``RoutedExperts`` module (weights loaded and
    processed for the layer's kernel, ``expert_map`` set when ``num_ranks > 1``). Raises
    ``ValueError`` when the model has no routed experts or an expert was not in the checkpoint.
    """
    from vllm_afd.patches import cpu_amx, cpu_comm
    from vllm_afd.patches.base import check_unwrapped
    from vllm_afd.patches.ffn_rank import expert_parallel_placement

    cpu_comm.apply()  # S2: vLLM's CPU kernel honours expert_map (the worker patch FFN ranks need)
    cpu_amx.apply()  # S3: vLLM's AMX expert kernels may run in this process
    check_unwrapped("F4")
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_dir = Path(model_dir)
    vllm_config = engine_config(model_dir, dtype)
    with set_current_vllm_config(vllm_config):
        _ensure_world()
        with expert_parallel_placement(vllm_config, rank, num_ranks, device):
            # the serving dtype, as vLLM's own loader builds the model (else float32); vLLM
            # annotates it ``ModelDType | torch.dtype``, but ``ModelConfig`` has resolved the
            # name to a torch dtype by now
            serving_dtype = cast("torch.dtype", vllm_config.model_config.dtype)
            with set_default_torch_dtype(serving_dtype), torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config)
            named = {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
            if not named:
                raise ValueError(f"{model_dir}: the model has no routed-expert layers")
            for module in model.modules():
                if not isinstance(module, RoutedExperts):
                    for param in module.parameters(recurse=False):
                        param._afd_elsewhere = True  # not the layer's own (_materialise)
            for layer in named.values():
                _materialise(layer, device)
            held = next(iter(named.values())).expert_map_manager.get_local_expert_ids()
            local = set(held) if num_ranks > 1 else None  # vLLM's own placement of this rank
            model.load_weights(_checkpoint(model_dir, local))
        layers = {}
        for name, layer in named.items():
            _check_loaded(name, layer)
            layers[extract_layer_index(name)] = layer
        _prepare_for_kernels(layers, dtype)
    del model  # the meta rest of the model; the layers live on in ``layers``
    return dict(sorted(layers.items()))


#: Floating-point 8-bit dtypes whose experts the fallback dequantizes.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
#: The expert parameters an unquantized layer has; everything else (scales) goes at fallback.
_UNQUANTIZED_PARAMS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def has_expert_kernel(method: FusedMoEMethodBase) -> bool:
    """False when vLLM's MoE kernel oracle, run by the quant method's constructor, found no
    expert kernel class for this platform and format (``experts_cls`` left None)."""
    return getattr(method, "experts_cls", True) is not None


def needs_fp8_fallback(layer: MoELayer) -> bool:
    """The layer's experts are FP8 and this platform has no kernel for them."""
    return layer.w13_weight.dtype in FP8_DTYPES and not has_expert_kernel(layer.quant_method)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """float32 ``weight * scale`` for ``[E, N, K]`` FP8 experts.

    ``scale`` is ``[E]`` (per tensor), ``[E, S]`` (per fused shard, e.g. w1 and w3, or per
    channel) or ``[E, N / bn, K / bk]`` (per block); each entry multiplies its block of rows
    and columns. ``block`` (the checkpoint's ``weight_block_size``) gives the block when the
    last one is partial; otherwise the sizes must divide evenly.
    """
    experts, rows, cols = weight.shape
    grid = scale.reshape(experts, *scale.shape[1:], *(1,) * (3 - scale.dim()))
    sizes = []
    for size, count, hint in zip((rows, cols), grid.shape[1:], block or (None, None), strict=True):
        if hint is not None and -(-size // hint) == count:
            sizes.append(hint)
        elif size % count == 0:
            sizes.append(size // count)
        else:
            raise ValueError(
                f"FP8 scale {tuple(scale.shape)} does not tile weight {tuple(weight.shape)}"
            )
    expanded = grid.float().repeat_interleave(sizes[0], 1).repeat_interleave(sizes[1], 2)
    return weight.float() * expanded[:, :rows, :cols]


def _weight_scale(layer: MoELayer, prefix: str) -> torch.Tensor:
    """The dequantization multiplier of ``{prefix}_weight`` (vLLM's two FP8 scale names)."""
    for suffix in ("weight_scale_inv", "weight_scale"):
        scale = getattr(layer, f"{prefix}_{suffix}", None)
        if isinstance(scale, torch.Tensor):
            return scale
    raise ValueError(f"{prefix}_weight is FP8 but the layer has no weight scale")


def dequantize_fp8_experts(layer: MoELayer, dtype: torch.dtype) -> None:
    """Make an FP8 layer an unquantized one in place: its experts dequantized to ``dtype``,
    its scales dropped, vLLM's ``UnquantizedFusedMoEMethod`` as its quant method (weights not
    yet processed for its kernel)."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    block = getattr(layer, "weight_block_size", None)
    dequantized = {
        prefix: dequantize_fp8(
            getattr(layer, f"{prefix}_weight"), _weight_scale(layer, prefix), block
        ).to(dtype)
        for prefix in ("w13", "w2")
    }
    for pname, param in list(layer.named_parameters(recurse=False)):
        if pname not in _UNQUANTIZED_PARAMS:
            delattr(layer, pname)
        elif pname.endswith("_bias"):
            param.data = param.data.to(dtype)
    for prefix, weight in dequantized.items():
        getattr(layer, f"{prefix}_weight").data = weight
    for name in ("w13_input_scale", "w2_input_scale"):
        setattr(layer, name, None)
    layer._replace_quant_method(UnquantizedFusedMoEMethod(layer.moe_config))


def _prepare_for_kernels(layers: dict[int, MoELayer], dtype: torch.dtype) -> None:
    """Each layer's quant method prepares its weights for its kernel; FP8 layers without a
    kernel on this platform are dequantized first (one log line)."""
    fallback = [n for n, layer in layers.items() if needs_fp8_fallback(layer)]
    if fallback:
        method = type(layers[fallback[0]].quant_method).__name__
        logger.info(
            "AFD FFN rank: vLLM has no %s expert kernel for this platform; dequantizing the "
            "FP8 routed experts of %d layer(s) to %s at load and serving them with the "
            "unquantized kernel",
            method,
            len(fallback),
            str(dtype).removeprefix("torch."),
        )
    for number, layer in layers.items():
        if number in fallback:
            dequantize_fp8_experts(layer, dtype)
        try:
            layer.quant_method.process_weights_after_loading(layer)
        except Exception as exc:
            if has_expert_kernel(layer.quant_method):
                raise
            raise ValueError(f"MoE layer {number}: {_no_kernel(layer)}: {exc}") from exc


def _no_kernel(layer: MoELayer) -> str:
    """Why a layer without an expert kernel cannot be served, naming format and platform."""
    from vllm.platforms import current_platform

    quant = layer.quant_config.get_name() if layer.quant_config is not None else "unquantized"
    return (
        f"vLLM has no {quant} expert kernel ({type(layer.quant_method).__name__}) on "
        f"{current_platform.device_name}, so stock vLLM cannot serve this checkpoint there "
        "either, and the FFN ranks dequantize FP8 experts only"
    )


def expert_bytes(layers: dict[int, MoELayer]) -> int:
    """Bytes of the expert weights ``layers`` hold (what the rank's memory holds for them)."""
    return sum(
        p.nbytes for layer in layers.values() for p in layer.parameters() if p.device.type != "meta"
    )
