"""Ping-pong microbatching on attention ranks: the FFN group serves microbatch i while this
attention rank runs the attention stage of microbatch i + 1.

Scheme (vLLM's dual-batch overlap, without CUDA streams). A decode step of T tokens is cut
into k microbatches by vLLM's own machinery (``maybe_create_ubatch_slices``; attention
metadata, slot mapping and per-microbatch metadata builders through ``split_attn_metadata``).
Each microbatch runs the unchanged model forward on its own thread of a ``PingPong`` pool,
with its own ``ForwardContext``. Exactly one thread runs at a time: a thread hands the baton
on only at an ``overlap_point()``, which the AFD MoE op calls between ``dispatch`` (returns
at once) and ``combine`` (waits)::

    mb0: attn L0 | dispatch L0 -> yield                     combine L0 | attn L1 | dispatch ...
    mb1:                        attn L0 | dispatch L0 -> yield                    combine L0 ...
    FFN:                        experts mb0 L0 |  experts mb1 L0         | experts mb0 L1 ...

Every microbatch has at most one request outstanding, so an attention rank never has more than
k (<= ``TransportSpec.num_slots`` = max(2, k)) requests in flight, and the combines come back
in dispatch order. The hand-off order is a pure function of k and the layer count, so tensor-
parallel ranks issue their collectives in the same order. Every token goes through the same
kernels as with k = 1; only the rows it shares a GEMM (and an FFN request) with change. Greedy
float32 outputs are token-identical to colocated serving (tests/test_microbatch.py; also
checked by hand for k = 3 with one-token microbatches, TP = 2, and Dynamo-compiled mode): this
rests on the CPU kernels giving each row the same result whatever rows are batched with it.

Which steps are split: uniform decode steps with at least k tokens (each microbatch gets one
or more whole requests). Prefill and mixed steps, dummy and profiling runs run whole.

Where it hooks into vLLM (CPU build, V1 model runner; each patch checked by ``install``)
------------------------------------------------------------------------------------------
M1 ``CPUModelRunner.__init__``, wrapped.
   Why: vLLM builds per-microbatch attention metadata (one metadata builder per microbatch)
   only when ``ParallelConfig.use_ubatching``; but the CPU platform turns ``--enable-dbo`` off
   and ``VllmConfig`` rejects ``--ubatch-size`` without a DeepEP/NIXL all2all backend, so
   neither can be asked for on the command line.
   How: on an AFD attention rank with ``microbatches = k > 1``, after the stock init (and
   before the KV cache and its metadata builders exist) set this process's
   ``parallel_config.ubatch_size = k``, ``dbo_decode_token_threshold = k`` and
   ``dbo_prefill_token_threshold`` above ``max_num_batched_tokens`` (decode steps only).
   Unsupported combinations are refused (``check_supported``). The platform check in
   platforms/cpu.py is left alone: it only touches ``enable_dbo``.
   Remove when: vLLM supports microbatching on CPU and lets an out-of-tree MoE kernel opt in.
M2 ``_determine_batch_execution_and_padding``, overridden on ``CPUModelRunner``.
   Why: stock vLLM sets ``should_ubatch`` only in its data-parallel branch
   (``coordinate_batch_across_dp``); one attention rank never microbatches.
   How: with data_parallel_size 1, ``should_ubatch`` = ``allow_microbatching`` (vLLM's
   prefix-cache veto) and ``check_ubatch_thresholds``. With DP > 1 the stock decision stands.
   Remove when: vLLM microbatches without data parallelism.
M3 ``_dummy_run``, overridden on ``CPUModelRunner``.
   Why: dummy runs call ``self.model`` directly; on CPU it is not wrapped (no
   ``UBatchWrapper``), so a microbatched dummy run would hand per-microbatch lists to layers.
   How: ``allow_microbatching=False`` (with DP > 1 this vetoes the step on every rank).
   Remove when: M4 is upstream.
M4 ``_model_forward``, overridden on ``CPUModelRunner`` (vLLM documents it as the method to
   override for model execution).
   Why: the GPU runner wraps the model in ``UBatchWrapper`` (CUDA streams and events); the
   CPU runner runs microbatched steps nowhere.
   How: when the forward context carries ``ubatch_slices``, run the stock ``_model_forward``
   on each token slice on a ``PingPong`` thread with its own ``ForwardContext``, concatenate.
   Remove when: vLLM ships a CPU ubatch wrapper.

On GPUs (design; not exercised here). vLLM's DBO is the same scheme with CUDA streams:
``UBatchWrapper`` runs the microbatch threads, ``dbo_yield`` hands over, and with
``cudagraph_mode=FULL`` the whole k-microbatch step is captured once (the threads hand over
during capture; the graph records the interleaving on the compute and comm streams).
``overlap_point`` therefore delegates to ``dbo_yield`` when vLLM's DBO is active. The GPU path
needs M1 (post-validation ``ubatch_size``) and M2 (DP = 1) for ``GPUModelRunner``, and with
DP = 1 also ``UBatchWrapper.__call__``, which asserts DP metadata; not M3/M4. To be
capturable the transport must be DeepEP-like: dispatch and combine are kernels on the comm
stream over buffers sized for ``max_tokens`` per microbatch, the receive side a hook run after
the yield, and no host synchronisation (the CPU transports' ``split_by_ffn_rank`` reads the
routing on the host and is not capturable). Microbatch token counts are static per captured
size (vLLM pads the last microbatch).

Limits: V1 model runner only (the V2 runner is refused); no speculative decoding, LoRA,
multimodal or M-RoPE models, pooling models; with DP > 1 an idle rank's dummy batch vetoes
microbatching for that step. Costs on CPU: one thread hand-off per MoE layer and microbatch
(about 13 us), smaller GEMMs on the attention side, k requests per layer instead of one on the
FFN side (its per-request cost does not shrink with the tokens when the experts are memory-
bound), and, dominating on small models, a second pass of each layer's host work (vLLM's eager
decoder layer costs about 0.4-0.5 ms of Python and op dispatch on the development machine, whatever
the batch) plus per-microbatch attention metadata (about 0.4 ms per step). k = 2 therefore pays
only when one microbatch's FFN stage is at least about as long as that attention stage
(recipes/tiny_qwen3_ffn_heavy_cpu_1to1.py; numbers in docs/benchmarks.md). Each microbatch
thread drives its own OpenMP team; with several OpenMP threads per attention rank, an idle team
spinning (KMP_BLOCKTIME, GOMP_SPINCOUNT) competes with the active one: prefer a passive wait
policy there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm_afd")
_LOCAL = threading.local()
_SENTINEL = "__vllm_afd_microbatch__"
#: Seconds ``PingPong.close`` waits for each idle thread to exit.
_JOIN_TIMEOUT_S = 5.0


# --------------------------------------------------------------------------------------------
# The hand-off scheduler (no vLLM imports: unit-testable on its own).
# --------------------------------------------------------------------------------------------


class MicrobatchAborted(RuntimeError):
    """Raised at the overlap point of a suspended microbatch when another one failed."""


@dataclass
class _Step:
    """One ``PingPong.run``: its jobs, their results and who has finished."""

    jobs: Sequence[Callable[[], Any]]
    resume: Sequence[Callable[[], None]] | None
    results: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    error: BaseException | None = None

    def next_after(self, index: int) -> int | None:
        """The next unfinished microbatch after ``index`` in round-robin order, if any."""
        count = len(self.jobs)
        for offset in range(1, count):
            other = (index + offset) % count
            if not self.finished[other]:
                return other
        return None

    def enter(self, index: int) -> None:
        if self.resume is not None:
            self.resume[index]()


class PingPong:
    """Runs up to ``size`` jobs per step on persistent threads, strictly one at a time.

    Job i starts when job i - 1 first yields (``overlap_point``) or finishes; a yielding job
    resumes when every other unfinished job has yielded or finished once (round robin). A
    job that raises aborts the others at their next overlap point (``MicrobatchAborted``)
    and ``run`` re-raises the first error; the pool stays usable.
    """

    def __init__(self, size: int, name: str = "afd-microbatch") -> None:
        if size < 1:
            raise ValueError(f"PingPong needs at least one thread, got {size}")
        self.size = size
        self._wake = [threading.Event() for _ in range(size)]
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._step: _Step | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def run(
        self,
        jobs: Sequence[Callable[[], Any]],
        resume: Sequence[Callable[[], None]] | None = None,
    ) -> list:
        """Run ``jobs`` ping-pong; return their results in order.

        ``resume[i]``, if given, runs on job i's thread each time it gets the baton (before
        it starts and after each overlap point): the place to restore per-microbatch globals.
        """
        if getattr(_LOCAL, "slot", None) is not None:
            raise RuntimeError("PingPong.run called from inside a microbatch")
        if len(jobs) > self.size or (resume is not None and len(resume) != len(jobs)):
            raise ValueError(f"{len(jobs)} jobs for a PingPong of {self.size} threads")
        if not jobs:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("PingPong is closed")
            step = _Step(jobs, resume, [None] * len(jobs), [False] * len(jobs))
            self._step = step
            self._done.clear()
            self._wake[0].set()
            self._done.wait()
            self._step = None
        if step.error is not None:
            raise step.error
        return step.results

    def yield_(self, index: int) -> None:
        """Called on job ``index``'s thread: run the other microbatches, then continue."""
        step = self._step
        other = step.next_after(index)
        if other is not None:
            self._wake[other].set()
            self._sleep(index)
        if step.error is not None:
            raise MicrobatchAborted(f"microbatch {index} aborted: another one failed")
        if other is not None:
            step.enter(index)

    def close(self) -> None:
        """Stop the threads (idempotent). Call only between steps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for event in self._wake:
                event.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)

    def _sleep(self, index: int) -> None:
        self._wake[index].wait()
        self._wake[index].clear()

    def _serve(self, index: int) -> None:
        _LOCAL.slot = (self, index)
        while True:
            self._sleep(index)
            if self._closed:
                return
            step = self._step
            self._run_job(step, index)
            other = step.next_after(index)
            (self._wake[other] if other is not None else self._done).set()

    @staticmethod
    def _run_job(step: _Step, index: int) -> None:
        try:
            if step.error is None:
                step.enter(index)
                step.results[index] = step.jobs[index]()
        except MicrobatchAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to run() and re-raised there
            if step.error is None:
                step.error = exc
        finally:
            step.finished[index] = True


def current_microbatch() -> int | None:
    """Index of the microbatch running on this thread, or None outside a microbatch."""
    slot = getattr(_LOCAL, "slot", None)
    return slot[1] if slot is not None and slot[0]._step is not None else None


def overlap_point() -> None:
    """Between ``dispatch`` and ``combine``: let the other microbatches run meanwhile.

    A no-op outside a microbatched step. Under vLLM's own DBO (GPUs) it is ``dbo_yield``.
    """
    slot = getattr(_LOCAL, "slot", None)
    if slot is not None:
        if slot[0]._step is not None:
            slot[0].yield_(slot[1])
        return
    ubatching = sys.modules.get("vllm.v1.worker.ubatching")  # never imported: DBO is off
    if ubatching is not None and ubatching.dbo_enabled():
        ubatching.dbo_yield()


# --------------------------------------------------------------------------------------------
# Configuration: when a worker microbatches.
# --------------------------------------------------------------------------------------------


def afd_microbatches(vllm_config) -> int:
    """``microbatches`` of this deployment's AFD settings; 1 without AFD."""
    from vllm_afd.deployment import afd_config_of

    afd = afd_config_of(vllm_config)
    return 1 if afd is None else afd.microbatches


def check_supported(vllm_config) -> None:
    """Raise ``AFDConfigError`` if ``--afd-microbatches > 1`` cannot run with this config."""
    from vllm_afd.config import AFDConfigError

    model = vllm_config.model_config
    blockers = {
        "the V2 model runner (VLLM_USE_V2_MODEL_RUNNER)": vllm_config.use_v2_model_runner,
        "speculative decoding": vllm_config.speculative_config is not None,
        "LoRA": vllm_config.lora_config is not None,
        "multimodal models": model.supports_multimodal_inputs,
        "M-RoPE models": model.uses_mrope,
        "pooling models": model.runner_type == "pooling",
        "pipeline parallelism": vllm_config.parallel_config.pipeline_parallel_size > 1,
    }
    found = [name for name, blocked in blockers.items() if blocked]
    if found:
        raise AFDConfigError(
            f"--afd-microbatches (additional_config.afd.microbatches): microbatching is not "
            f"supported with {', '.join(found)}; use --afd-microbatches 1"
        )


def configure_runner(runner) -> int:
    """M1: turn vLLM's microbatching on for this worker; returns k (1: off)."""
    k = afd_microbatches(runner.vllm_config)
    if k <= 1:
        return 1
    check_supported(runner.vllm_config)
    parallel = runner.parallel_config
    parallel.ubatch_size = k
    parallel.dbo_decode_token_threshold = k
    parallel.dbo_prefill_token_threshold = runner.scheduler_config.max_num_batched_tokens + 1
    logger.info("AFD: decode steps of >= %d tokens run as %d ping-pong microbatches", k, k)
    return k


def _microbatching(runner) -> bool:
    return runner.__dict__.get("_afd_microbatches", 1) > 1


# --------------------------------------------------------------------------------------------
# The patches (M1-M4) and the microbatched forward.
# --------------------------------------------------------------------------------------------


def _should_ubatch(runner, args: dict) -> bool:
    """M2's decision for data_parallel_size 1."""
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds

    if not args["allow_microbatching"]:
        return False
    uniform = runner._is_uniform_decode(
        max_num_scheduled_tokens=args["max_num_scheduled_tokens"],
        uniform_decode_query_len=runner.uniform_decode_query_len,
        num_tokens=args["num_tokens"],
        num_reqs=args["num_reqs"],
        force_uniform_decode=args["force_uniform_decode"],
    )
    return check_ubatch_thresholds(runner.parallel_config, args["num_tokens"], uniform)


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


_MODEL_INPUTS = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")


def _forward_microbatches(runner, original, parent, arguments: dict) -> Any:
    """M4: the stock forward once per microbatch, ping-pong, outputs concatenated."""
    import torch
    from vllm.forward_context import override_forward_context

    inputs = {name: arguments.get(name) for name in _MODEL_INPUTS}
    if arguments.get("model_kwargs"):
        raise RuntimeError(f"AFD microbatching: cannot split model kwargs {arguments}")
    slices = parent.ubatch_slices
    inference = torch.is_inference_mode_enabled()
    jobs = [
        functools.partial(_run_slice, runner, original, s.token_slice, inputs, inference)
        for s in slices
    ]
    contexts = [_slice_context(runner, parent, i, s) for i, s in enumerate(slices)]
    resume = [functools.partial(_set_forward_context, c) for c in contexts]
    with override_forward_context(None):
        outputs = _pingpong(runner, len(slices)).run(jobs, resume)
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))
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
    from vllm import forward_context

    forward_context._forward_context = context


def _pingpong(runner, size: int) -> PingPong:
    pool = runner.__dict__.get("_afd_pingpong")
    if pool is None or pool.size < size:
        if pool is not None:
            pool.close()
        pool = runner._afd_pingpong = PingPong(size)
    return pool


# --------------------------------------------------------------------------------------------
# install(): called from patches.apply_all in every process.
# --------------------------------------------------------------------------------------------

_PATCHES = {
    "__init__": (_patch_init, ()),
    "_determine_batch_execution_and_padding": (
        _patch_batch_execution,
        (
            "num_tokens",
            "num_reqs",
            "max_num_scheduled_tokens",
            "allow_microbatching",
            "force_uniform_decode",
        ),
    ),
    "_dummy_run": (_patch_dummy_run, ("allow_microbatching",)),
    "_model_forward": (_patch_model_forward, _MODEL_INPUTS),
}


def _override(cls: type, name: str, make_wrapper, params: tuple[str, ...]) -> None:
    """Set ``cls.name`` to ``make_wrapper(inherited or own cls.name)`` once."""
    original = getattr(cls, name, None)
    if original is None:
        raise ImportError(f"vllm_afd patch target {cls.__name__}.{name} not found")
    if getattr(original, _SENTINEL, False):
        return
    missing = [p for p in params if p not in inspect.signature(original).parameters]
    if missing:
        raise ImportError(f"vllm_afd patch target {cls.__name__}.{name} lacks {missing}")
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _SENTINEL, True)
    setattr(cls, name, wrapper)


def install() -> None:
    """Apply M1-M4 to vLLM's CPU model runner (idempotent); nothing on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker import ubatch_utils
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for helper in ("maybe_create_ubatch_slices", "split_attn_metadata", "check_ubatch_thresholds"):
        if not hasattr(ubatch_utils, helper):
            raise ImportError(f"vllm_afd microbatching needs vllm ubatch_utils.{helper}")
    for name, (make_wrapper, params) in _PATCHES.items():
        _override(CPUModelRunner, name, make_wrapper, params)
