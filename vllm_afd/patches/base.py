"""The one patch mechanism: the touch-point table, ``_wrap``, its sentinel and the version
policy (the ledger and ``apply`` are in ``vllm_afd/patches/__init__.py``).

A leaf module, so that the patch groups can use it without importing the package that
applies them (no import circle).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.afd")
SUPPORTED_VLLM = ("0.32.", "0.33.")
_SENTINEL = "__vllm_afd_patched__"
#: ``Target.kind`` values that ``_wrap`` installs; the others are only checked.
WRAPPED = ("function", "static", "class")


@dataclass(frozen=True)
class Target:
    """One touch point of a ledger entry, with the shape its patch relies on."""

    patch: str  #: ledger id
    module: str
    owner: str  #: class in ``module``; "" for a module global
    name: str
    #: parameters the patch passes or binds by name (leading and in this order if ``ordered``)
    params: tuple[str, ...] = ()
    #: function / static / class: wrapped by ``_wrap``; override: a subclass method vLLM
    #: calls; added: set on the class; register: a supported registration API; global: a
    #: module global written; swapped: replaced for the duration of a block, then restored
    #: (``patches/ffn_rank.py``); property: a property whose getter is wrapped once
    #: (``swap_property``); used: read or called as is.
    kind: str = "function"
    ordered: bool = False

    @property
    def where(self) -> str:
        return f"{self.patch} {self.owner or self.module}.{self.name}"

    def resolve(self) -> tuple[Any, Any]:
        """``(owner, attribute)``; ImportError naming the patch if either is missing."""
        module = importlib.import_module(self.module)
        owner = getattr(module, self.owner, None) if self.owner else module
        if owner is None or not hasattr(owner, self.name):
            raise ImportError(f"vllm_afd patch {self.where}: target not found")
        return owner, getattr(owner, self.name)


_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"
_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
#: vLLM's V2 model runner, the default on CUDA (W1, W3 wrap it as they wrap V1's).
_GPU_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_KV_MANAGER = "vllm.v1.core.kv_cache_manager"
_W2_UPDATE = ("scheduler_output", "model_runner_output")
_ROUTED = "vllm.model_executor.layers.fused_moe.routed_experts"
_UBATCH = "vllm.v1.worker.ubatch_utils"
_CONTEXT = "vllm.forward_context"
_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator"
_PROMETHEUS = "prometheus_client.multiprocess"
_MOE = "vllm.model_executor.layers.fused_moe"
_EP_FILTER = "vllm.model_executor.model_loader.ep_weight_filter"
_PARALLEL_STATE = "vllm.distributed.parallel_state"
_SHARED = "vllm.model_executor.layers.fused_moe.runner.shared_experts"
#: Positional parameters of ``_model_forward`` that M4 slices per microbatch.
MODEL_INPUTS = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")

_GPU_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"
_UBATCHING = "vllm.v1.worker.ubatching"
#: What the AFD op reads of vLLM's DBO (``microbatch.py``, ``attention.steps.dbo_ubatches``).
_G2_NAMES = (
    "dbo_enabled",
    "dbo_current_ubatch_id",
    "dbo_yield",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "_CURRENT_CONTEXTS",
    "_NUM_UBATCHES",
)
#: Every touch point, one row each: the patches wrap from it, test_compat checks it.
_CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
#: The CPU experts classes S2 teaches ``expert_map`` (unquantized, FP8 on AMX CPUs).
_S2_EXPERTS = ("CPUUnquantizedExperts", "CPUExpertsFp8")
_S2_APPLY = (
    "output",
    "hidden_states",
    "w1",
    "w2",
    "topk_weights",
    "topk_ids",
    "activation",
    "global_num_experts",
    "expert_map",
)

TARGETS = (
    Target("P1", "vllm.engine.arg_utils", "EngineArgs", "add_cli_args", ("parser",), "static"),
    Target("P2", "vllm.engine.arg_utils", "EngineArgs", "from_cli_args", ("args",), "class"),
    Target("P3", "vllm.engine.arg_utils", "EngineArgs", "create_engine_config", ("usage_context",)),
    Target("P4", "vllm.v1.engine.async_llm", "AsyncLLM", "check_health"),
    Target("P6", _PROMETHEUS, "MultiProcessCollector", "__init__", ("registry",)),
    Target("P5", _ROUTED, "RoutedExperts", "register_oot", kind="register"),
    Target("P5", "vllm.model_executor.custom_op", "", "op_registry_oot", kind="used"),
    Target(
        "P7",
        _ROUTED,
        "RoutedExperts",
        "_get_quant_method",
        ("prefix", "quant_config", "moe_config"),
        "override",
    ),
    Target("M1", _CPU_RUNNER, "CPUModelRunner", "__init__"),
    Target("M1", _UBATCH, "", "maybe_create_ubatch_slices", kind="used"),
    Target("M1", _UBATCH, "", "split_attn_metadata", kind="used"),
    Target(
        "M2",
        _CPU_RUNNER,
        "CPUModelRunner",
        "_determine_batch_execution_and_padding",
        (
            "num_tokens",
            "num_reqs",
            "max_num_scheduled_tokens",
            "allow_microbatching",
            "force_uniform_decode",
        ),
    ),
    Target(
        "M2",
        _UBATCH,
        "",
        "check_ubatch_thresholds",
        ("config", "num_tokens", "uniform_decode"),
        "used",
        ordered=True,
    ),
    Target(
        "M2",
        _CPU_RUNNER,
        "CPUModelRunner",
        "_is_uniform_decode",
        (
            "max_num_scheduled_tokens",
            "uniform_decode_query_len",
            "num_tokens",
            "num_reqs",
            "force_uniform_decode",
        ),
        "used",
    ),
    Target("M3", _CPU_RUNNER, "CPUModelRunner", "_dummy_run", ("allow_microbatching",)),
    Target("M4", _CPU_RUNNER, "CPUModelRunner", "_model_forward", MODEL_INPUTS),
    Target(
        "M4",
        _CONTEXT,
        "",
        "create_forward_context",
        (
            "attn_metadata",
            "vllm_config",
            "dp_metadata",
            "cudagraph_runtime_mode",
            "batch_descriptor",
            "slot_mapping",
            "additional_kwargs",
            "skip_compiled",
            "is_padding",
        ),
        "used",
    ),
    Target("M4", _CONTEXT, "", "override_forward_context", ("forward_context",), "used"),
    Target(
        "M4",
        _CONTEXT,
        "DPMetadata",
        "make",
        ("parallel_config", "num_tokens", "num_tokens_across_dp_cpu"),
        "used",
        ordered=True,
    ),
    Target("M5", _CONTEXT, "", "_forward_context", kind="global"),
    Target("P8", "vllm.compilation.backends", "", "model_tag", kind="global"),
    Target("M6", "vllm.config.vllm", "VllmConfig", "__post_init__"),
    Target("M7", _SHARED, "SharedExperts", "__init__", ("layer", "moe_config", "enable_dbo")),
    Target("M7", _SHARED, "SharedExperts", "_output_idx", kind="property"),
    Target("S1", _CPU_COMM, "CpuCommunicator", "all_gatherv", ("input_", "dim", "sizes"), "added"),
    Target(
        "S1", _CPU_COMM, "CpuCommunicator", "reduce_scatterv", ("input_", "dim", "sizes"), "added"
    ),
    *(
        row
        for experts in _S2_EXPERTS
        for row in (
            Target("S2", _CPU_MOE, experts, "__init__", ("moe_config",), ordered=True),
            Target("S2", _CPU_MOE, experts, "apply", _S2_APPLY, "used", ordered=True),
        )
    ),
    Target("G1", _GPU_GRAPHS, "ModelCudaGraphManager", "run_fullgraph", ("desc",)),
    Target("G1", _GPU_GRAPHS, "BatchExecutionDescriptor", "num_ubatches", kind="used"),
    *(Target("G2", _UBATCHING, "", name, kind="used") for name in _G2_NAMES),
    Target("S3", "torch.cpu", "", "_is_amx_tile_supported", kind="used"),
    Target("S3", "torch._C", "_cpu", "_init_amx", kind="used"),
    Target(
        "F1",
        f"{_MOE}.layer",
        "",
        "make_parallel_config",
        ("tp_size", "dp_size", "pcp_size", "is_sequence_parallel", "parallel_config"),
        "swapped",
    ),
    Target(
        "F2",
        f"{_MOE}.expert_map_manager",
        "ExpertMapManager",
        "__init__",
        ("global_num_experts", "moe_parallel_config", "placement_strategy"),
        "swapped",
    ),
    Target("F3", _PARALLEL_STATE, "", "_EP", kind="swapped"),
    Target(
        "F4",
        "vllm.model_executor.model_loader.utils",
        "",
        "initialize_model",
        ("vllm_config",),
        "used",
    ),
    Target(
        "F4",
        _EP_FILTER,
        "",
        "should_skip_weight",
        ("weight_name", "local_expert_ids"),
        "used",
        ordered=True,
    ),
    Target(
        "F4", "vllm.model_executor.models.utils", "", "extract_layer_index", ("layer_name",), "used"
    ),
    Target(
        "F4",
        f"{_MOE}.expert_map_manager",
        "ExpertMapManager",
        "get_local_expert_ids",
        kind="used",
    ),
    Target("S4", _PARALLEL_STATE, "", "create_tcp_store", ("host", "port", "listen_socket")),
    Target("W1", _GPU_RUNNER, "GPUModelRunner", "execute_model", ("scheduler_output",)),
    Target("W1", _GPU_RUNNER, "GPUModelRunner", "sample_tokens", ("grammar_output",)),
    Target("W2", _SCHEDULER, "Scheduler", "update_from_output", _W2_UPDATE, ordered=True),
    Target("W2", _KV_MANAGER, "KVCacheManager", "get_block_ids", ("request_id",), "used"),
    Target("W2", _KV_MANAGER, "KVCacheManager", "evict_blocks", ("block_ids",), "used"),
    Target("W3", _GPU_RUNNER, "GPUModelRunner", "_dummy_run", ("num_tokens",)),
    Target(
        "W1", _GPU_RUNNER_V2, "GPUModelRunner", "execute_model", ("scheduler_output", "dummy_run")
    ),
    Target("W1", _GPU_RUNNER_V2, "GPUModelRunner", "sample_tokens", ("grammar_output",)),
    Target("W3", _GPU_RUNNER_V2, "GPUModelRunner", "_dummy_run", ("num_tokens",)),
    Target("W4", "vllm.v1.worker.gpu_worker", "Worker", "load_model", ("load_dummy_weights",)),
    Target("E1", "vllm.envs", "", "environment_variables", kind="global"),
    Target("R1", "ray._private.worker", "", "print_to_stdstream", ("data", "ignore_prefix")),
    Target(
        "F4",
        f"{_MOE}.fused_moe_method_base",
        "FusedMoEMethodBase",
        "apply",
        ("layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input"),
        "used",
        ordered=True,
    ),
    Target(
        "F4",
        f"{_MOE}.fused_moe_method_base",
        "FusedMoEMethodBase",
        "process_weights_after_loading",
        ("layer",),
        "used",
    ),
    Target(
        "F4",
        _PARALLEL_STATE,
        "",
        "init_distributed_environment",
        ("world_size", "rank", "distributed_init_method", "local_rank", "backend"),
        "used",
    ),
    Target(
        "F4",
        _PARALLEL_STATE,
        "",
        "initialize_model_parallel",
        ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
        "used",
        ordered=True,
    ),
)


def targets(patch: str) -> tuple[Target, ...]:
    """The rows of ledger entry ``patch``."""
    return tuple(t for t in TARGETS if t.patch == patch)


@functools.cache
def check_vllm_version() -> str:
    """The installed vLLM version; warns (once per process) when it is not a checked one."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning(
            "vllm_afd was checked against vLLM %s; found %s: applying its patches anyway, "
            "each checks its target first",
            SUPPORTED_VLLM,
            version,
        )
    return version


def _check_params(where: str, fn: Callable, params: tuple[str, ...], ordered: bool) -> None:
    names = [n for n in inspect.signature(fn).parameters if n not in ("self", "cls")]
    if ordered:
        if tuple(names[: len(params)]) != params:
            raise ImportError(f"vllm_afd patch {where}: expected leading {params}, has {names}")
        return
    missing = [p for p in params if p not in names]
    if missing:
        raise ImportError(f"vllm_afd patch {where} lacks {missing}")


def check(target: Target) -> Any:
    """Check one row against the installed vLLM; returns the attribute (ImportError if not)."""
    _, attribute = target.resolve()
    if target.params:
        _check_params(target.where, attribute, target.params, target.ordered)
    return attribute


def _where(owner: type, name: str) -> str:
    for t in TARGETS:
        if t.owner == owner.__name__ and t.name == name:
            return t.where
    return f"{owner.__name__}.{name}"


def raw_attribute(owner: type | types.ModuleType, name: str) -> Any:
    """``owner.name`` as stored: a class's own or inherited (static/class method objects kept),
    or a module's global; ``None`` if absent."""
    scopes = owner.__mro__ if isinstance(owner, type) else (owner,)
    return next((k.__dict__[name] for k in scopes if name in k.__dict__), None)


def _wrap(
    owner: type | types.ModuleType,
    name: str,
    make_wrapper: Callable[[Callable], Callable],
    kind: str = "function",
    params: tuple[str, ...] = (),
    ordered: bool = False,
) -> None:
    """Set ``owner.name`` (a class attribute or a module global) to ``make_wrapper(original)``
    once (sentinel-guarded).

    ``original`` is the function found along the MRO (own or inherited), unwrapped from its
    static/class method; ``kind`` (function / static / class) must match it. A missing target,
    a changed kind or a missing parameter is an ImportError naming the patch.
    """
    where = _where(owner, name)
    raw = raw_attribute(owner, name)
    if raw is None:
        raise ImportError(f"vllm_afd patch {where}: target not found")
    original = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(original, _SENTINEL, False):
        return
    found = {staticmethod: "static", classmethod: "class"}.get(type(raw), "function")
    if found != kind:
        raise ImportError(f"vllm_afd patch {where}: expected a {kind} method, found {found}")
    _check_params(where, original, params, ordered)
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _SENTINEL, True)
    if kind == "static":
        wrapper = staticmethod(wrapper)
    elif kind == "class":
        wrapper = classmethod(wrapper)
    setattr(owner, name, wrapper)


def wrap(patch: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """``_wrap`` every wrapped row of ledger entry ``patch`` (usually one), shaped as
    ``TARGETS`` says."""
    for target in targets(patch):
        if target.kind in WRAPPED:
            owner, _ = target.resolve()
            _wrap(owner, target.name, make_wrapper, target.kind, target.params, target.ordered)


def check_unwrapped(patch: str) -> None:
    """``check`` every row of ``patch`` that ``wrap`` does not install (used, global, ...)."""
    for target in targets(patch):
        if target.kind not in WRAPPED:
            check(target)


def swap_property(patch: str, make_getter: Callable[[Callable], Callable]) -> None:
    """Replace the property of ``patch``'s ``property`` row by one whose getter is
    ``make_getter(original getter)``, once (sentinel-guarded)."""
    (target,) = (t for t in targets(patch) if t.kind == "property")
    owner, prop = target.resolve()
    if not isinstance(prop, property):
        raise ImportError(f"vllm_afd patch {target.where}: expected a property")
    if getattr(prop.fget, _SENTINEL, False):
        return
    getter = functools.wraps(prop.fget)(make_getter(prop.fget))
    setattr(getter, _SENTINEL, True)
    setattr(owner, target.name, property(getter))
