"""Worker, M1-M5 and M7: ping-pong microbatching on vLLM's CPU model runner (ledger in
``__init__``).

vLLM cuts a decode step into k microbatches with its own machinery once ``ubatch_size`` is set (M1)
and ``should_ubatch`` is decided (M2): ``maybe_create_ubatch_slices`` and, through
``split_attn_metadata``, one attention metadata and slot mapping per microbatch. M4 then runs the
stock ``_model_forward`` once per token slice, each on a ``vllm_afd.microbatch.PingPong`` thread
with its own ``ForwardContext`` (written into vLLM's global at every hand-off, M5), and
concatenates the outputs; first it announces the step's microbatches to the FFN ranks
(``AttentionSession.begin_step``, the control plane). M3 keeps dummy runs whole. M7
gives each microbatch its own shared-expert output slot; a server's engine core re-validates the
config M1 changed, which M6 (``engine_args.py``, every platform) lets pass. The scheme itself, and
which steps are split, is described in vllm_afd/microbatch.py.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from vllm_afd.config import MAX_MICROBATCHES
from vllm_afd.microbatch import PingPong, current_microbatch
from vllm_afd.patches.base import MODEL_INPUTS, check_unwrapped, swap_property, wrap

logger = logging.getLogger("vllm.afd")


def configure_runner(runner) -> int:
    """M1: turn vLLM's microbatching on for this worker; returns k (1: off)."""
    from vllm_afd.config import AFDConfig, check_supported

    afd = AFDConfig.of(runner.vllm_config)
    k = 1 if afd is None else afd.microbatches
    if k <= 1:
        return 1
    if runner.vllm_config.model_config.use_mla:
        logger.warning(
            "AFD: --afd-microbatches %d -> 1 for this MLA model: on vLLM's CPU build its "
            "attention gives other tokens when a decode step is split into microbatches",
            k,
        )
        return 1
    check_supported(runner.vllm_config)
    parallel = runner.parallel_config
    parallel.ubatch_size = k  # re-validated by the engine core: M6 lets it
    parallel.dbo_decode_token_threshold = k
    parallel.dbo_prefill_token_threshold = runner.scheduler_config.max_num_batched_tokens + 1
    logger.info("AFD: decode steps of >= %d tokens run as %d ping-pong microbatches", k, k)
    return k


def _microbatching(runner) -> bool:
    return runner.__dict__.get("_afd_microbatches", 1) > 1


def _should_ubatch(runner, args: dict) -> bool:
    """M2's decision for data_parallel_size 1: decode steps of at least k requests.

    A decode step is one where every request decodes: one token each, or with speculative
    decoding its verify tokens (up to 1 + the draft length, ``uniform_decode_query_len``; an
    n-gram drafter proposes a different number for each request, so such a step is rarely
    uniform). Prefill and mixed steps run whole.
    """
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds

    if not args["allow_microbatching"]:
        return False
    decode = args["max_num_scheduled_tokens"] <= runner.uniform_decode_query_len
    k = runner.parallel_config.ubatch_size
    if decode and args["num_reqs"] < k:
        return False
    return check_ubatch_thresholds(runner.parallel_config, args["num_tokens"], decode)


# --------------------------------------------------------------------------------------------
# The wrappers (M1-M4).
# --------------------------------------------------------------------------------------------


def _patch_init(original):
    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._afd_microbatches = configure_runner(self)

    return wrapper


def _patch_batch_execution(original):
    signature = inspect.signature(original)

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not _microbatching(self) or self.parallel_config.data_parallel_size > 1:
            return result
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        mode, descriptor, _, across_dp, stats = result
        return mode, descriptor, _should_ubatch(self, bound.arguments), across_dp, stats

    return wrapper


def _patch_dummy_run(original):
    signature = inspect.signature(original)

    def wrapper(self, *args, **kwargs):
        if _microbatching(self):
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["allow_microbatching"] = False
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return wrapper


def _patch_model_forward(original):
    signature = inspect.signature(original)

    def wrapper(self, *args, **kwargs):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if context.ubatch_slices is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        return _forward_microbatches(self, original, context, bound.arguments)

    return wrapper


# --------------------------------------------------------------------------------------------
# The microbatched forward (M4, M5).
# --------------------------------------------------------------------------------------------


def _forward_microbatches(runner, original, parent, arguments: dict) -> Any:
    """M4: the stock forward once per microbatch, ping-pong, outputs concatenated."""
    import torch
    from vllm.forward_context import override_forward_context

    from vllm_afd.attention.session import current

    inputs = {name: arguments.get(name) for name in MODEL_INPUTS}
    if arguments.get("model_kwargs"):
        raise RuntimeError(f"AFD microbatching: cannot split model kwargs {arguments}")
    slices = parent.ubatch_slices
    inference = torch.is_inference_mode_enabled()
    jobs = [
        functools.partial(_run_slice, runner, original, s.token_slice, inputs, inference)
        for s in slices
    ]
    contexts = [_slice_context(runner, parent, i, s) for i, s in enumerate(slices)]
    session = current()
    if session is not None:
        session.begin_step([s.num_tokens for s in slices], contexts)
    resume = [functools.partial(_set_forward_context, c) for c in contexts]
    with override_forward_context(None):
        outputs = _pingpong(runner, len(slices)).run(jobs, resume)
    return _concat_outputs(outputs)


def _concat_outputs(outputs: list) -> Any:
    """The microbatches' model outputs joined along tokens, in the structure of one: a tensor,
    or a tuple whose items are tensors or lists of tensors (EAGLE-3 targets return
    ``(hidden_states, [aux hidden states])``)."""
    import torch

    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_concat_outputs(list(parts)) for parts in zip(*outputs, strict=True))
    return torch.cat(outputs)


def _run_slice(runner, original, tokens: slice, inputs: dict, inference: bool) -> Any:
    import torch

    sliced = {name: _slice_tokens(name, value, tokens) for name, value in inputs.items()}
    with torch.inference_mode(inference):
        return original(runner, **sliced)


def _slice_tokens(name: str, value, tokens: slice):
    if value is None:
        return None
    if name == "positions" and value.ndim == 2:  # M-RoPE positions are [3, T]
        return value[:, tokens]
    return value[tokens]


def _slice_context(runner, parent, index: int, ubatch):
    """The ``ForwardContext`` of microbatch ``index``: its share of every per-step input."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import create_forward_context

    slot_mapping = parent.slot_mapping
    is_padding = parent.is_padding
    return create_forward_context(
        parent.attn_metadata[index],
        runner.vllm_config,
        dp_metadata=_slice_dp_metadata(runner, parent, ubatch.num_tokens),
        cudagraph_runtime_mode=CUDAGraphMode.NONE,
        batch_descriptor=parent.batch_descriptor,
        slot_mapping=slot_mapping[index] if isinstance(slot_mapping, list) else None,
        additional_kwargs=parent.additional_kwargs,
        skip_compiled=parent.skip_compiled,
        is_padding=None if is_padding is None else is_padding[ubatch.token_slice],
    )


def _slice_dp_metadata(runner, parent, num_tokens: int):
    """Per-microbatch DP metadata, as vLLM's UBatchWrapper builds it (equal split per rank)."""
    if parent.dp_metadata is None:
        return None
    import torch
    from vllm.forward_context import DPMetadata

    parallel = runner.parallel_config
    across_dp = torch.full((parallel.data_parallel_size,), num_tokens, dtype=torch.int32)
    return DPMetadata.make(parallel, num_tokens, across_dp)


def _set_forward_context(context) -> None:
    """M5: make ``context`` vLLM's current forward context (a private module global)."""
    from vllm import forward_context

    forward_context._forward_context = context


def _pingpong(runner, size: int) -> PingPong:
    pool = runner.__dict__.get("_afd_pingpong")
    if pool is None or pool.size < size:
        if pool is not None:
            pool.close()
        pool = runner._afd_pingpong = PingPong(size)
    return pool


def _patch_shared_experts_init(original):
    """M7: one shared-expert output slot per microbatch (vLLM keeps two, for DBO)."""

    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._output = [None] * max(len(self._output), MAX_MICROBATCHES)

    return wrapper


def _microbatch_output_idx(original):
    """M7: the slot of the microbatch running on this thread (vLLM's own choice otherwise)."""

    def _output_idx(self) -> int:
        index = current_microbatch()
        return original(self) if index is None else index

    return _output_idx


_WRAPPERS = {
    "M1": _patch_init,
    "M2": _patch_batch_execution,
    "M3": _patch_dummy_run,
    "M4": _patch_model_forward,
    "M7": _patch_shared_experts_init,
}


def apply() -> None:
    """M1-M5 and M7 on vLLM's CPU model runner (idempotent); nothing on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for patch in (*_WRAPPERS, "M5"):  # everything M1-M7 reads or writes, before any wrap
        check_unwrapped(patch)
    for patch, make_wrapper in _WRAPPERS.items():
        wrap(patch, make_wrapper)
    swap_property("M7", _microbatch_output_idx)
