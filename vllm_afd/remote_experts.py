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

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.utils import set_weight_attrs

from vllm_afd import envs
from vllm_afd.config import AFDConfig
from vllm_afd.errors import FFNServeError
from vllm_afd.metrics import recorder
from vllm_afd.metrics.blocks import AttentionStatsBlock
from vllm_afd.microbatch import current_microbatch, overlap_point, vllm_dbo
from vllm_afd.transport import (
    AttentionTransport,
    DispatchHandle,
    Feature,
    TransportSpec,
    backend,
    create_attention_transport,
    directory,
)
from vllm_afd.transport.control import Mode, StepSchedule

logger = logging.getLogger("vllm.afd")


class AFDRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose experts run on the FFN group when AFD is configured.

    A speculative-decoding draft's MoE layers (an MTP layer, an MoE EAGLE head, an MoE draft
    model) keep their experts here, on the attention ranks, by choice: the FFN ranks hold the
    target model's experts, keyed by the target's layer numbers, which a draft's own numbering
    may repeat. A draft is built under a vLLM model tag of its own (``_building_draft``).
    """

    def _get_quant_method(self, prefix, quant_config, moe_config) -> FusedMoEMethodBase:
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

    return backends.model_tag != "backbone"


def _discard_expert_weight(param, loaded_weight, *args, return_success=False, **kwargs):
    """Weight loader of the placeholders: expert tensors belong to the FFN ranks."""
    return True if return_success else None


class _ScratchExperts(torch.nn.Module):
    """Receives what a quant method's ``create_weights`` registers; every other attribute read
    falls through to the real layer (its ``moe_config``, sizes, ...)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_afd_layer", layer)  # not a submodule

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_afd_layer"), name)


def _stock_expert_parameters(layer, **create_kwargs) -> dict[str, torch.nn.Parameter]:
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

    def __init__(self, moe, layer_name: str) -> None:
        super().__init__(moe)
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_index = extract_layer_index(layer_name)
        connect()  # layers are built in the worker, after the front-end started the FFN group

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        **extra_weight_attrs,
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
            return remote_experts(x, topk_weights, topk_ids, self.layer_index)
        return remote_experts_impl(x, topk_weights, topk_ids, self.layer_index)


# --------------------------------------------------------------------------------------------
# The per-process connection to the FFN group and the custom op.
# --------------------------------------------------------------------------------------------

_LOCK = threading.Lock()


class _Steps:
    """This attention rank's side of the control plane (``transport/control.py``): one
    ``StepSchedule`` announced per forward step, before its first dispatch.

    A step is one vLLM forward: every forward runs under a ``ForwardContext`` of its own, so
    the first MoE layer that runs under a context not of the current step begins a new step of
    one microbatch (its tokens: that layer's). A microbatched step is announced by the runner
    patch that splits it (M4, ``announce_microbatched_step``) with each microbatch's tokens and
    context. Outside any forward context (a test calling the op) every call is a step.
    """

    def __init__(self, endpoint: AttentionTransport, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.endpoint = endpoint
        #: The model's MoE layers; an empty list (a spec made by hand) announces nothing.
        self.layers = endpoint.spec.moe_layers
        #: Under tensor parallelism this rank sends rows ``tp_rank::tp_size`` of every batch
        #: (``remote_experts_impl``): its schedules announce that share.
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._contexts: tuple[weakref.ref, ...] = ()
        #: Runs before each step is announced, at the step boundary (the session's switch to
        #: a new FFN pool: ``_Session.switch_pending``).
        self.at_boundary: Callable[[], None] | None = None

    def begin(self, microbatch_tokens: Sequence[int], contexts: Sequence[object]) -> None:
        """Announce the next step: its microbatches' tokens, run under ``contexts``."""
        if self.at_boundary is not None:
            self.at_boundary()
        self._contexts = tuple(weakref.ref(c) for c in contexts)
        self.announce(microbatch_tokens, self.layers)

    def announce(self, microbatch_tokens: Sequence[int], layers: Sequence[int]) -> None:
        """One more step of the current forward, through ``layers`` (``_isolate`` splits a
        failed forward into such steps)."""
        if not self.layers:
            return
        endpoint, rank, size = self.endpoint, self.tp_rank, self.tp_size
        tokens = tuple(len(range(rank, n, size)) for n in microbatch_tokens)
        schedule = StepSchedule(endpoint.step + 1, tokens, tuple(layers), _mode())
        endpoint.begin_step(schedule)

    def current(self, num_tokens: int) -> None:
        """Before a dispatch: begin a step unless this forward's step is announced."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        context = get_forward_context() if is_forward_context_available() else None
        if context is None or not any(ref() is context for ref in self._contexts):
            ubatches = _dbo_ubatches(self.endpoint.spec.max_tokens)
            if ubatches is not None and any(c is context for c in ubatches[1]):
                self.begin(*ubatches)  # the first MoE layer of vLLM's first ubatch (GPUs)
            else:
                self.begin((num_tokens,), () if context is None else (context,))


def _dbo_ubatches(max_tokens: int) -> tuple[tuple[int, ...], tuple] | None:
    """Under vLLM's DBO (GPUs): each ubatch's tokens and forward context, else ``None``. The
    tokens are the ubatch's padded count across DP ranks where its DP metadata has it, else
    ``max_tokens`` (an upper bound: the FFN side checks requests against it)."""
    ubatching = vllm_dbo()
    if ubatching is None:
        return None
    live = [c for c in ubatching._CURRENT_CONTEXTS[: ubatching._NUM_UBATCHES] if c is not None]
    contexts = tuple(c.forward_context for c in live)
    tokens = []
    for context in contexts:
        dp = getattr(context, "dp_metadata", None)
        tokens.append(int(dp.num_tokens_across_dp_cpu.max()) if dp is not None else max_tokens)
    return tuple(tokens), contexts


def _mode() -> Mode:
    """``Mode.CAPTURE`` while a CUDA graph is being captured, else ``Mode.RUN``."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return Mode.CAPTURE if capturing else Mode.RUN


def announce_replay(num_tokens: int, num_ubatches: int) -> None:
    """Runner hook (G1): a FULL CUDA graph of ``num_tokens`` (padded) tokens is about to be
    replayed; its AFD kernels run without the op's Python, so the step is announced here, its
    microbatches' tokens as vLLM splits them (``replay_ubatch_tokens``). No-op in a process
    without an FFN group."""
    session = _SESSION
    if session is not None:
        session.steps.begin(replay_ubatch_tokens(num_tokens, num_ubatches), ())


def replay_ubatch_tokens(num_tokens: int, num_ubatches: int) -> tuple[int, ...]:
    """Each microbatch's tokens in a replay of ``num_tokens`` padded tokens, from vLLM's own
    split (``ubatch_utils.maybe_create_ubatch_slices``, as the V2 runner's
    ``create_ubatch_slices`` calls it): the FFN computes each microbatch's rows, not the whole
    step's once per microbatch."""
    if num_ubatches <= 1:
        return (num_tokens,)
    import numpy as np
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    _, padded = maybe_create_ubatch_slices(
        True, np.array([num_tokens]), num_tokens, 1, num_ubatches
    )
    assert padded is not None
    return tuple(s.num_tokens for s in padded)


def announce_microbatched_step(microbatch_tokens: Sequence[int], contexts: Sequence) -> None:
    """Runner hook (M4): the step about to run is split into these microbatches, each under
    its own ``ForwardContext``. No-op in a process without an FFN group."""
    session = _SESSION
    if session is not None:
        session.steps.begin(microbatch_tokens, contexts)


#: Held by the model runner for a whole step (patches W1, W3): a live scale switches an idle
#: attention rank to the new FFN pool between steps only (``_PoolWatcher``). Reentrant: a
#: step's dummy run may run inside another runner call.
STEP_LOCK = threading.RLock()
#: How often an attention rank looks for a new FFN pool (``pool.json``; a ``stat`` call).
POOL_POLL_S = 0.05


@dataclass
class _Session:
    """This worker's connection to the running FFN group, with its place among the ranks.

    A live scale (``placement/scaling.py``) publishes a new pool of FFN ranks (the next
    epoch, ``directory.Pool``); the session switches its endpoint to it at a step boundary
    (``switch_pending``): before the next step of a busy rank, at once for an idle one.
    """

    key: str  # the runtime spec it was made from
    endpoint: AttentionTransport
    tp_rank: int
    tp_size: int
    #: This rank's /metrics block (None if it could not be created: metrics never break serving).
    stats: AttentionStatsBlock | None
    steps: _Steps
    #: The FFN pool it serves on (1: the one the front-end started).
    epoch: int = 1
    #: A newer pool to switch to at the next step boundary (set by ``_PoolWatcher``).
    pending: directory.Pool | None = None
    watcher: _PoolWatcher | None = None
    _switching: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def at_step_boundary(self) -> None:
        if self.pending is not None:
            self.switch_pending()

    def switch_pending(self) -> None:
        """At a step boundary (no dispatch outstanding): serve on the pending pool from now on,
        and say so (``directory.publish_switch``). A pool whose ranks cannot be reached is
        logged and not retried: this rank stays on its pool, and the scale that published it
        times out naming this rank."""
        with self._switching:
            pool, self.pending = self.pending, None
            if pool is None or pool.epoch <= self.epoch:
                return
            start = time.perf_counter()
            old = self.endpoint
            spec = dataclasses.replace(
                TransportSpec.from_json(pool.spec),
                attention_rank_offset=old.spec.attention_rank_offset,
            )
            try:
                endpoint = create_attention_transport(spec, old.rank)
            except Exception:  # noqa: BLE001 - serving goes on on the old pool
                logger.exception(
                    "AFD: attention rank %d cannot switch to FFN pool %d", old.rank, pool.epoch
                )
                if self.watcher is not None:
                    self.watcher.given_up = pool.epoch
                return
            endpoint.step = old.step  # step numbers keep increasing across pools
            if self.stats is not None:
                self.stats.close()
            self.stats = recorder.endpoint_block(endpoint)
            self.endpoint = self.steps.endpoint = endpoint
            self.epoch = pool.epoch
            old.close()
            stall = time.perf_counter() - start
            directory.publish_switch(spec.directory, directory.Switch(old.rank, pool.epoch, stall))
            logger.info(
                "AFD: attention rank %d serves on FFN pool %d (%d FFN rank(s)) after a %.1f ms "
                "switch",
                old.rank,
                pool.epoch,
                spec.num_ffn_ranks,
                stall * 1e3,
            )

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.endpoint.close()


class _PoolWatcher:
    """A thread of the attention worker that looks for a new FFN pool every ``POOL_POLL_S``
    (a ``stat`` of ``pool.json``), hands it to the session for its next step boundary, and
    switches an idle rank itself (one not inside a step: ``STEP_LOCK`` is free), so that a
    scale completes on a server with no traffic too."""

    def __init__(self, session: _Session) -> None:
        self.session = session
        self.path = directory.pool_path(session.endpoint.spec.directory)
        #: An epoch this rank could not switch to (not tried again).
        self.given_up = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-pool-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        session, seen = self.session, None
        while not self._stop.wait(POOL_POLL_S):
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except OSError:
                continue
            if mtime == seen:
                continue
            pool = directory.read_pool(session.endpoint.spec.directory)
            if pool is None or pool.epoch <= max(session.epoch, self.given_up):
                seen = mtime
                continue
            session.pending = pool
            if STEP_LOCK.acquire(timeout=POOL_POLL_S):  # idle: no step runs
                try:
                    session.switch_pending()
                finally:
                    STEP_LOCK.release()
            if session.pending is None:
                seen = mtime


_SESSION: _Session | None = None


def connect() -> _Session:
    """Connect this process to the deployment's running FFN group (``VLLM_AFD_RUNTIME``).

    Called while the model is built, so a token never pays for it: once per process, and
    again only when the running group changed (another deployment built in the same process).
    """
    global _SESSION
    key = envs.runtime_json()
    from vllm.distributed.parallel_state import get_dp_group, get_tp_group

    with _LOCK:
        if _SESSION is not None and _SESSION.key == key:
            return _SESSION
        if _SESSION is not None:
            _SESSION.close()
        tp = get_tp_group()
        spec = TransportSpec.from_json(key)
        local = get_dp_group().rank_in_group * tp.world_size + tp.rank_in_group
        endpoint = create_attention_transport(spec, spec.attention_rank_offset + local)
        stats = recorder.endpoint_block(endpoint)
        steps = _Steps(endpoint, tp.rank_in_group, tp.world_size)
        session = _Session(key, endpoint, tp.rank_in_group, tp.world_size, stats, steps)
        if spec.directory and Feature.LIVE_SCALING in backend(spec.backend).features(spec.config):
            session.epoch = directory.epoch_of(spec.directory)
            steps.at_boundary = session.at_step_boundary
            session.watcher = _PoolWatcher(session)
        _SESSION = session
        return session


def remote_experts_impl(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Routed-expert output for ``x`` ``[T, H]`` computed by the FFN group.

    Under tensor parallelism every TP rank holds the same tokens; each sends only its share
    of rows and leaves the others zero, and the runner's TP all-reduce completes the sum.
    """
    session = _SESSION
    if session is None:
        raise RuntimeError("AFD: no FFN group connected in this process (connect() not called)")
    session.steps.current(x.shape[0])
    if session.tp_size == 1:
        if _FAILED is not None and _FAILED.now():
            return _healthy_round_trip(session, layer, x, topk_ids, topk_weights, _FAILED)
        try:
            return _round_trip(session, layer, x, topk_ids, topk_weights)
        except FFNServeError as error:
            return _isolate(session, layer, x, topk_ids, topk_weights, error, None)
    rows = torch.arange(session.tp_rank, x.shape[0], session.tp_size, device=x.device)
    out = torch.zeros_like(x)
    out[rows] = _round_trip(
        session, layer, x[rows].contiguous(), topk_ids[rows], topk_weights[rows]
    )
    return out


def _round_trip(
    session: _Session,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """dispatch -> (other microbatches run) -> combine, counted for /metrics: the wait in
    combine is the FFN time the overlap did not hide."""
    endpoint = session.endpoint
    ubatching = vllm_dbo()
    try:
        if ubatching is not None:
            handle, receive = _dbo_exchange(ubatching, endpoint, layer, x, topk_ids, topk_weights)
            start = time.perf_counter()
            out = receive()
        else:
            handle = endpoint.dispatch(layer, x, topk_ids, topk_weights, current_microbatch() or 0)
            overlap_point()  # ping-pong microbatches: the next one runs while the FFN works
            start = time.perf_counter()
            out = endpoint.combine(handle)
    except Exception as exc:
        recorder.record_error(recorder.error_kind(exc), rank=endpoint.rank)
        raise
    if session.stats is not None:
        session.stats.record_combine(handle, time.perf_counter() - start)
        session.stats.set_redispatched(endpoint.redispatched)
    return out


def _dbo_exchange(
    ubatching,
    endpoint: AttentionTransport,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> tuple[DispatchHandle, Callable[[], torch.Tensor]]:
    """Dispatch and combine under vLLM's DBO (GPUs), with the two yields and the receive hook
    vLLM's own MoE kernels use (``FusedMoEModularKernel`` with DeepEP low-latency's
    prepare/finalize): run the pending receive hook before the send, yield after it, register
    this combine's wait for the other ubatch to run before its next send, yield again. The
    caller then receives (``endpoint.combine_hook``): the wait ran, in stream order, while the
    other ubatch's attention was queued."""
    ubatching.dbo_maybe_run_recv_hook()
    microbatch = ubatching.dbo_current_ubatch_id()
    handle = endpoint.dispatch(layer, x, topk_ids, topk_weights, microbatch)
    ubatching.dbo_yield()
    ubatching.dbo_maybe_run_recv_hook()
    hook, receive = endpoint.combine_hook(handle)
    ubatching.dbo_register_recv_hook(hook)
    ubatching.dbo_yield()
    return handle, receive


# --------------------------------------------------------------------------------------------
# A request an FFN error follows fails alone (the rest of its batch is served).
# --------------------------------------------------------------------------------------------

#: This process's model runner, set before each step (patch W1): where a failed batch's
#: requests and their rows are read (``_requests_of``).
_RUNNER: object | None = None


@dataclass(frozen=True)
class _Failed:
    """Requests of one forward that an FFN error followed (``_isolate``): for the rest of
    that forward their rows go to no FFN rank and get no routed-expert output."""

    context: weakref.ref  # the forward's ForwardContext
    requests: frozenset[str]
    healthy: torch.Tensor  # the rows still sent, ascending (int64)

    def now(self) -> bool:
        return self.context() is _forward_context()


_FAILED: _Failed | None = None
#: request id -> the FFN's error text, for requests failed since the runner took them (W1).
_FAILED_REQUESTS: dict[str, str] = {}


def take_failed_requests() -> dict[str, str]:
    """Runner hook (W1): the requests failed since the last call, with the FFN's error."""
    global _FAILED
    failed = dict(_FAILED_REQUESTS)
    _FAILED_REQUESTS.clear()
    _FAILED = None
    return failed


def _forward_context() -> object | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def _requests_of(num_rows: int) -> list[tuple[str, slice]] | None:
    """This forward's requests and their rows of a layer's ``num_rows`` (rows past the last
    request are padding), or ``None`` where a failed batch cannot be split by request: no
    runner or forward context, a microbatch of a step, or rows that are not the batch's."""
    runner = _RUNNER
    if runner is None or _forward_context() is None or current_microbatch() is not None:
        return None
    num_reqs = runner.input_batch.num_reqs
    starts = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
    if not num_reqs or starts[-1] > num_rows:
        return None
    ids = runner.input_batch.req_ids[:num_reqs]
    return [(r, slice(a, b)) for r, a, b in zip(ids, starts[:-1], starts[1:], strict=True) if b > a]


def _isolate(
    session: _Session,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    error: FFNServeError,
    failed: _Failed | None,
) -> torch.Tensor:
    """An FFN rank failed this layer's batch (``error``, after its failover retry if any): send each
    request's rows again alone, in a step of this layer only, without retries. Requests that
    fail alone fail (the runner reports them: vLLM finishes them with an error, W2); the rest
    get their outputs, and the forward goes on with their rows only (``_healthy_round_trip``,
    the remaining layers announced as one more step). Re-raises ``error`` where the batch
    cannot be split (``_requests_of``) or on a collective backend."""
    global _FAILED
    endpoint = session.endpoint
    requests = _requests_of(x.shape[0])
    spec = endpoint.spec
    if requests is None or Feature.ISOLATION not in backend(spec.backend).features(spec.config):
        raise error
    before = failed.requests if failed is not None else frozenset()
    out = torch.zeros_like(x)
    errors: dict[str, str] = {}
    endpoint.retry_serve_errors = False
    try:
        for request, rows in requests:
            if request in before:
                continue
            session.steps.announce((rows.stop - rows.start,), (layer,))
            try:
                part = _round_trip(session, layer, x[rows], topk_ids[rows], topk_weights[rows])
            except FFNServeError as exc:
                errors[request] = str(exc)
            else:
                out[rows] = part
    finally:
        endpoint.retry_serve_errors = True
    if not errors:
        return out  # each request passed alone: the error followed none of them
    gone = before | errors.keys()
    healthy = [torch.arange(r.start, r.stop) for request, r in requests if request not in gone]
    rows = torch.cat(healthy) if healthy else torch.empty(0, dtype=torch.long)
    _FAILED = _Failed(weakref.ref(_forward_context()), gone, rows.to(x.device))
    _FAILED_REQUESTS.update(errors)  # logged by the scheduler as it fails them (W2)
    later = tuple(n for n in session.steps.layers if n > layer)
    if later:
        session.steps.announce((rows.numel(),), later)
    return out


def _healthy_round_trip(
    session: _Session,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    failed: _Failed,
) -> torch.Tensor:
    """The round trip of the rows of requests not failed in this forward (zeros elsewhere);
    one more failure isolates again among them."""
    out = torch.zeros_like(x)
    rows = failed.healthy
    if not rows.numel():
        return out
    try:
        out[rows] = _round_trip(session, layer, x[rows], topk_ids[rows], topk_weights[rows])
    except FFNServeError as error:
        return _isolate(session, layer, x, topk_ids, topk_weights, error, failed)
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
