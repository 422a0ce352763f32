"""An FFN rank's serve loop: one FFN rank holds a contiguous slice of every MoE layer's routed
experts (``TransportSpec.expert_range``, which is vLLM's own linear expert placement) and
answers every attention rank.

At start-up ``ffn/weights.py`` builds the model's own vLLM MoE layers for this slice; the rank
checks that vLLM placed the experts where the attention side will send them and that it has a
layer for every MoE layer of the spec, so a disagreement fails the start, not a token.

A token's journey on this side: ``transport.recv`` hands over every pending request (from any
attention rank, any layer); requests of the same layer are concatenated so the experts run
once for all attention ranks' tokens (the batching AFD exists for); the request's layer number
(the model's own) picks the layer, whose quant method computes ``sum_k w_k * expert_k(x)``
over this rank's experts (``ExpertKernel``); ``transport.reply`` copies each request its rows
back (for shm, into the response area of its slot). Each layer batch is counted in
``FFNStats`` and in this rank's shared stats block, which ``/metrics`` reads
(``vllm_afd.metrics``).

The expert kernel is each MoE layer's own quant method, given the routing. ``ExpertKernel``
calls it the way vLLM's ``MoERunner`` does after ``select_experts``
(``quant_method.apply(layer, x, topk_weights, topk_ids, ...)``), so the FFN runs whatever
kernel stock vLLM picks for that layer on that platform and quantization (the CPU grouped GEMM,
a CUDA modular kernel), on the weights that kernel's own ``process_weights_after_loading``
prepared: AFD's outputs match colocated serving because the code is the same. Ids stay global:
with expert parallelism vLLM's kernels translate them through the layer's ``expert_map``
(global -> local id, ``-1`` elsewhere; on the CPU build through patch S2). The kernel sees only
this rank's share of the routing: on CPUs its own (token, expert) pairs, one row each; on CUDA
the whole routing with the weights of experts held by other FFN ranks zeroed (see
``ExpertKernel``). Either way each rank's answer is exactly its share, also for kernels that
apply the routing weight to the input (Llama-4), and the attention side's sum is the whole.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd import envs
from vllm_afd.ffn.step_graphs import StepGraphs
from vllm_afd.ffn.weights import expert_bytes, load_routed_experts
from vllm_afd.metrics.blocks import FFNStatsBlock
from vllm_afd.transport import FFNRequest, FFNTransport, TransportSpec, create_ffn_transport
from vllm_afd.transport.base import ServesRequests, ServesSteps, UseForward
from vllm_afd.transport.control import Part, ScheduleChecker, Step, Tag, Use

if TYPE_CHECKING:
    # a routed-experts layer as vLLM builds it (``ffn/weights.py``)
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts as MoELayer

logger = logging.getLogger("vllm.afd")
#: How late the stats may take the steps served whole (``FFNExecutor._account_steps``); an
#: idle serve loop takes them at once.
ACCOUNT_EVERY_S = 0.5


def foreign_experts(layer: MoELayer) -> torch.Tensor | None:
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

    On the CPU, a rank holding a slice of the experts (F > 1) runs only its own (token, expert)
    pairs: one row per pair, top-1, summed back per token. vLLM's CPU kernel has no "skip this
    expert" id, so given the whole routing it would compute every pair, the other ranks' on a
    local expert with weight 0 (patch S2): F ranks would each do the colocated layer's work
    (docs/benchmarks.md). CUDA kernels skip the ``-1`` that ``expert_map`` gives foreign
    experts, so there the routing goes in whole, foreign weights zeroed.
    """

    def __init__(self, layers: dict[int, MoELayer], device: str = "cpu") -> None:
        self.layers = layers
        self.device = torch.device(device)
        self.own_pairs_only = self.device.type == "cpu"
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
        if foreign is None:
            return _apply(module, x, topk_weights, topk_ids)
        elsewhere = foreign[topk_ids.long()]
        if not self.own_pairs_only:
            return _apply(module, x, topk_weights.masked_fill(elsewhere, 0.0), topk_ids)
        rows, cols = (~elsewhere).nonzero(as_tuple=True)  # row-major: tokens, then their k
        pair_ids = topk_ids[rows, cols].unsqueeze(1)
        pair_weights = topk_weights[rows, cols].unsqueeze(1)
        y = _apply(module, x.index_select(0, rows), pair_weights, pair_ids)
        return torch.zeros_like(x).index_add_(0, rows, y)


def _apply(
    module: MoELayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The layer's quant method on ``x`` routed as given: the finished ``[N, H]`` (no shared
    experts or tensor-parallel reduce to fuse here, so no kernel hands back an unfinished
    output)."""
    y = module.quant_method.apply(module, x, topk_weights, topk_ids, None, None)
    assert isinstance(y, torch.Tensor), type(y)
    return y


@dataclass
class FFNStats:
    """Counters the attention side and /metrics read (cumulative).

    ``shared``, when set, is this rank's stats block in shared memory
    (``vllm_afd.metrics.blocks``): ``FFNExecutor._account`` writes the same numbers there, where
    ``/metrics`` reads them.
    """

    requests: int = 0
    #: Requests of a microbatch other than the first (evidence that steps were split).
    later_microbatch_requests: int = 0
    #: Requests per attention rank (``FFNRequest.src_rank``): every rank of a step sends its own.
    requests_by_source: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    tokens: int = 0
    bytes_in: int = 0
    busy_s: float = 0.0
    per_layer_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    per_layer_calls: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    shared: FFNStatsBlock | None = field(default=None, repr=False, compare=False)

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "later_microbatch_requests": self.later_microbatch_requests,
            "requests_by_source": dict(self.requests_by_source),
            "tokens": self.tokens,
            "bytes_in": self.bytes_in,
            "busy_s": self.busy_s,
            "per_layer_s": dict(self.per_layer_s),
            "per_layer_calls": dict(self.per_layer_calls),
        }


def _open_stats_block(address: str, rank: int, layers: Iterable[int]) -> FFNStatsBlock | None:
    """This rank's shared stats block for /metrics, or None (logged) if it cannot be made:
    metrics never keep an FFN rank from serving."""
    try:
        return FFNStatsBlock(address, rank, layers)
    except Exception as exc:  # noqa: BLE001
        logger.warning("AFD metrics disabled for FFN rank %d: %s", rank, exc)
        return None


def _weights_report(layers: dict[int, MoELayer]) -> dict[str, list[str]]:
    """What the layers hold once prepared for their kernels: the dtypes of their tensors and
    their quant methods (an FP8 checkpoint served dequantized shows no float8 tensor)."""
    return {
        "weight_dtypes": sorted(
            {str(p.dtype).removeprefix("torch.") for m in layers.values() for p in m.parameters()}
        ),
        "quant_methods": sorted({type(m.quant_method).__name__ for m in layers.values()}),
    }


def _check_layers(spec: TransportSpec, rank: int, layers: dict[int, MoELayer]) -> None:
    """ValueError unless vLLM placed this rank's experts where the attention side sends them
    and there is a layer for every MoE layer of the spec."""
    want = list(spec.expert_range(rank))
    for number, layer in layers.items():
        held = layer.expert_map_manager.get_local_expert_ids()
        if held != want:
            raise ValueError(
                f"FFN rank {rank}: vLLM placed experts {held} of layer {number} here, the "
                f"transport routes experts {want[0]}-{want[-1]} to it"
            )
    if spec.moe_layers and set(spec.moe_layers) != set(layers):
        raise ValueError(
            f"FFN rank {rank}: the model's MoE layers are {sorted(layers)}, the transport "
            f"spec says {list(spec.moe_layers)}"
        )


def _check_split_on_attention_ranks(model_dir: str, layers: dict[int, MoELayer]) -> None:
    """ValueError unless the attention ranks will hand these layers to the FFN group: vLLM
    builds the plugin's out-of-tree ``RoutedExperts`` (registered in its ``op_registry_oot``
    by patch P5) only where the model builds vLLM's ``RoutedExperts`` itself; a model class
    with its own subclass of it would start, give colocated tokens and never send a token here
    (gpt-oss, dbrx). Asked of vLLM's registry, so that the FFN side imports nothing of the
    attention side."""
    from vllm.model_executor.custom_op import op_registry_oot

    swapped = op_registry_oot.get("RoutedExperts")
    kept = sorted(
        {
            type(layer).__name__
            for layer in layers.values()
            if swapped is None or not isinstance(layer, swapped)
        }
    )
    if kept:
        raise ValueError(
            f"--afd-ratio: {model_dir}: this model's MoE layers are vLLM's {', '.join(kept)} (a "
            "subclass of RoutedExperts the plugin does not replace), so its attention ranks "
            "would keep every expert: AFD cannot split this model yet"
        )


def _inject_fault(path: str, rows: list[int]) -> None:
    """Raise the injected fault of ``VLLM_AFD_FAULT_FILE`` (``path`` exists) on a batch of
    requests of ``rows`` rows each. A file that reads ``once`` is removed first: the fault hits
    one layer batch of one FFN rank. One that reads ``rows>=N`` hits only a batch with a request
    of at least ``N`` rows (a request, from one attention rank, that always fails wherever it
    goes). Any other content: every batch."""
    try:
        with open(path) as file:
            fault = file.read().strip()
        if fault == "once":
            os.unlink(path)
    except FileNotFoundError:
        return  # another rank took the one fault, or the test removed the file
    if fault.startswith("rows>="):
        least = int(fault.removeprefix("rows>="))
        if all(n < least for n in rows):
            return
    raise RuntimeError(f"injected fault ({envs.FAULT_FILE}={path} reads {fault!r})")


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The requests' rows stacked (no copy for a single request)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def prepare_device(kernel: ExpertKernel, spec: TransportSpec, rank: int) -> None:
    """What the rank's device needs before its first request, done at start so that a
    problem fails the start with its cause rather than the attention ranks' first forward (on
    a GPU their memory profiling run): on CUDA, vLLM's workspace manager, which its modular MoE
    kernels take scratch from (vLLM's GPU worker sets it up; the FFN rank has no worker); then
    one dry forward of the first layer: two tokens on the host (the kernel moves them, as it
    moves the transports' buffers), routed to this rank's first experts.

    Raises:
        RuntimeError: naming the layer and the kernel's error, when the dry forward fails.
    """
    if kernel.device.type == "cuda":
        from vllm.v1.worker import workspace

        if not workspace.is_workspace_manager_initialized():
            workspace.init_workspace_manager(kernel.device)
    layer = min(kernel.layers)
    x = torch.zeros(2, spec.hidden_size, dtype=spec.dtype)
    first = spec.expert_range(rank).start
    ids = ((first + torch.arange(spec.top_k)) % spec.num_experts).to(torch.int32).expand(2, -1)
    weights = torch.full((2, spec.top_k), 1.0 / spec.top_k, dtype=torch.float32)
    try:
        kernel(layer, x, ids.contiguous(), weights)
    except Exception as exc:
        raise RuntimeError(
            f"AFD FFN rank {rank}: a dry forward of MoE layer {layer} failed at start on "
            f"{kernel.device}: {type(exc).__name__}: {exc}"
        ) from exc


class FFNExecutor:
    """One FFN rank: its experts, its transport endpoint, and the serve loop."""

    def __init__(self, spec: TransportSpec, rank: int, model_dir: str, device: str) -> None:
        self.spec, self.rank = spec, rank
        self.experts = spec.expert_range(rank)
        self._threads = torch.get_num_threads()  # the rank's setting, before vLLM's config runs
        start = time.perf_counter()
        layers = load_routed_experts(model_dir, rank, spec.num_ffn_ranks, spec.dtype, device)
        _check_layers(spec, rank, layers)
        _check_split_on_attention_ranks(model_dir, layers)
        self.layers = sorted(layers)  # the model's own numbers of the MoE layers served here
        self.param_bytes = expert_bytes(layers)
        self.weights = _weights_report(layers)
        self.kernel = ExpertKernel(layers, device)
        prepare_device(self.kernel, spec, rank)
        self.checker = ScheduleChecker(rank, self.layers)
        self._announcing: set[int] = set()  # attention ranks seen announcing (logged once)
        logger.info(
            "AFD FFN rank %d: experts %d-%d of %d MoE layers, %.1f MiB, built in %.2f s",
            rank,
            self.experts.start,
            self.experts.stop - 1,
            len(layers),
            self.param_bytes / 2**20,
            time.perf_counter() - start,
        )
        self.transport: FFNTransport = create_ffn_transport(spec, rank)
        self.stats = FFNStats(shared=_open_stats_block(self.transport.address, rank, layers))
        # Wire bytes per token besides the hidden state: int32 expert ids + float32 weights.
        self._routing_bytes = spec.top_k * 8
        self._stop = threading.Event()
        self._threads_started: list[threading.Thread] = []
        self._fault_file = envs.VLLM_AFD_FAULT_FILE
        #: Whole steps as CUDA graphs (a transport that serves steps, on a GPU).
        on_gpu = torch.device(device).type == "cuda"
        steps = isinstance(self.transport, ServesSteps)
        self.graphs = StepGraphs() if on_gpu and steps else None
        #: Steps served whole and not yet in the stats: step -> [times, seconds].
        self._unaccounted: dict[Step, list[Any]] = {}
        self._accounted_at = -math.inf

    @property
    def address(self) -> str:
        return self.transport.address

    def serve_once(self, timeout_s: float) -> int:
        """Serve every pending request (or, for a transport that serves steps, the next whole
        step); returns how many requests were answered."""
        transport = self.transport
        if isinstance(transport, ServesSteps):
            return self._serve_step(transport, timeout_s)
        assert isinstance(transport, ServesRequests)
        requests = transport.recv(timeout_s)
        by_layer: dict[int, list[FFNRequest]] = defaultdict(list)
        for request in requests:
            if self._check(transport, request):
                by_layer[request.layer].append(request)
        for layer, group in by_layer.items():
            self._serve_layer(transport, layer, group)
        return len(requests)

    def _serve_step(self, transport: ServesSteps, timeout_s: float) -> int:
        """The next announced step, whole and in stream order (``ServesSteps``):
        per use of a slot, every attention rank's rows through the layer's MoE kernel at once.
        On a GPU the step is one CUDA graph per step shape (``StepGraphs``). If serving raises
        on the host, the uses not served are answered with the error (their attention ranks'
        waits end, recorded; with graphs every use of the step, since a capture serves none),
        and the rank serves on. The stats take the step later (``_account_steps``)."""
        step = transport.next_step(timeout_s)
        if step is None:
            if self._unaccounted:
                self._account_steps()
            return 0
        if step.capture:
            self._capture_ahead(transport, step)
            return 0
        served = [0]  # uses served, as they are
        run = functools.partial(self._run_uses, transport, step, served)
        start = time.perf_counter()
        try:
            if self.graphs is None:
                run()
            else:
                self.graphs.run(step.shape, run)
            done = len(step.uses)
        except Exception as exc:
            done = 0 if self.graphs is not None else served[0]  # a capture serves none
            rest = step.uses[done:]
            message = f"layer {rest[0][0]}: {type(exc).__name__}: {exc}"
            logger.exception("AFD FFN rank %d failed serving %s", self.rank, message)
            self._record_failures(sum(len(parts) for _, _, parts in rest))
            transport.fail_uses(rest, message)
        finally:
            transport.end_step()
        now = time.perf_counter()
        if done == len(step.uses):
            pending = self._unaccounted.setdefault(step, [0, 0.0])
            pending[0] += 1
            pending[1] += now - start
        else:  # served in part (an error): counted now
            self._account_uses(step.uses[:done], (now - start) / max(done, 1))
        if now - self._accounted_at >= ACCOUNT_EVERY_S:
            self._account_steps()
        return sum(len(parts) for _, _, parts in step.uses[:done])

    def _run_uses(
        self, transport: ServesSteps, step: Step, served: list[int] | None = None
    ) -> None:
        """Serve ``step``'s uses in order (eagerly, or recorded into a graph), counting them
        in ``served[0]``."""
        for layer, slot, parts in step.uses:
            transport.serve_use(slot, parts, self._step_forward(layer, parts))
            if served is not None:
                served[0] += 1

    def _capture_ahead(self, transport: ServesSteps, step: Step) -> None:
        """The attention ranks capture CUDA graphs of ``step`` (``Step.capture``): capture the
        FFN side's graph of it now, at start (``StepGraphs.capture``), so that its replays
        never capture on the token path. A capture that fails leaves the shape to run eagerly
        (logged); nothing is served either way."""
        try:
            if self.graphs is not None:
                self.graphs.capture(step.shape, functools.partial(self._run_uses, transport, step))
        except Exception:
            logger.exception(
                "AFD FFN rank %d: capturing the graph of a step ahead failed; steps of its "
                "shape run eagerly",
                self.rank,
            )
        finally:
            transport.end_step()

    def settled_stats(self, timeout_s: float = 1.0) -> dict[str, Any]:
        """The stats once the steps served so far are in them (the serve loop folds them when
        idle: ``_account_steps``), waiting at most ``timeout_s``; what a report after a run
        reads (``rank.FFNRank.stats``)."""
        deadline = time.monotonic() + timeout_s
        while self._unaccounted and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.stats.snapshot()

    def _account_steps(self) -> None:
        """Fold the steps served since the last call into the stats, each step's time shared
        evenly by its uses (a graph's layers are not timed one by one). Deferred to every
        ``ACCOUNT_EVERY_S`` and to an idle serve loop: per step it cost about as much as
        everything else the host does for a step (docs/benchmarks.md, "The host time per
        step")."""
        pending, self._unaccounted = self._unaccounted, {}
        self._accounted_at = time.perf_counter()
        for step, (count, seconds) in pending.items():
            if step.uses:
                self._account_uses(step.uses, seconds / (count * len(step.uses)), count)

    def _account_uses(self, uses: Sequence[Use], dt: float, times: int = 1) -> None:
        """``uses`` of a step served ``times`` alike, ``dt`` seconds each use."""
        row_bytes = self.spec.hidden_size * self.spec.dtype.itemsize
        for layer, slot, parts in uses:
            rows = sum(part.rows for part in parts)
            sources = [(part.attention_rank, slot) for part in parts]
            self._account(layer, sources, rows, rows * row_bytes, dt, times)

    def _step_forward(self, layer: int, parts: tuple[Part, ...]) -> UseForward:
        """The layer's experts as the plane's ``forward(x, ids, weights, out)``."""

        def forward(
            x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
        ) -> torch.Tensor:
            if self._fault_file is not None and os.path.exists(self._fault_file):
                _inject_fault(self._fault_file, [part.rows for part in parts])
            return out.copy_(self.kernel(layer, x, topk_ids, topk_weights))

        return forward

    def _check(self, transport: ServesRequests, request: FFNRequest) -> bool:
        """Check the request's tag against its sender's schedule (``control.py``); a request
        that disagrees is failed on its attention rank with the reason."""
        tag = Tag(request.step, request.layer, request.microbatch)
        why = self.checker.check(request.src_rank, tag, request.x.shape[0], request.schedule)
        if why is None:
            if request.schedule is not None and request.src_rank not in self._announcing:
                self._announcing.add(request.src_rank)
                logger.info(
                    "AFD FFN rank %d: attention rank %d announces its steps (first: %s)",
                    self.rank,
                    request.src_rank,
                    request.schedule,
                )
            return True
        logger.error("AFD: %s", why)
        self._record_failures(1)
        transport.reply_error(request, why)
        return False

    def _record_failures(self, count: int) -> None:
        """``count`` requests failed here: the rank is unhealthy from now on (``/health``)."""
        if self.stats.shared is not None:
            self.stats.shared.record_failure(count)

    def _serve_layer(
        self,
        transport: ServesRequests,
        layer: int,
        group: list[FFNRequest],
        counted: bool = False,
    ) -> None:
        """Serve one layer's requests together, counted in the stats before their answers are
        published (whoever holds an answer finds it counted; ``counted``: already). If that
        raises, each request not answered yet is served again alone, so that the error
        reaches only the attention ranks whose requests raise by themselves: each of those is
        failed on its attention rank with the error text (``reply_error``), and the loop goes
        on serving."""
        shared = self.stats.shared
        if shared is not None:
            shared.set_busy(time.monotonic())
        answered = 0
        try:
            start = time.perf_counter()
            x, out = self._compute_layer(layer, group)
            if not counted:
                sources = [(r.src_rank, r.microbatch) for r in group]
                self._account(layer, sources, x.shape[0], x.nbytes, time.perf_counter() - start)
                counted = True
            offset = 0
            for request in group:
                n = request.x.shape[0]
                transport.reply(request, out[offset : offset + n])
                offset += n
                answered += 1
        except Exception as exc:
            rest = group[answered:]
            if len(rest) > 1:
                for request in rest:
                    self._serve_layer(transport, layer, [request], counted)
                return
            message = f"layer {layer}: {type(exc).__name__}: {exc}"
            logger.exception("AFD FFN rank %d failed serving %s", self.rank, message)
            if rest:  # never an error after an answer
                self._record_failures(1)
                transport.reply_error(rest[0], message)
        finally:
            if shared is not None:
                shared.set_busy(0.0)

    def _compute_layer(
        self, layer: int, group: list[FFNRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's experts over every request's rows: ``(x, out)``, rows in request order."""
        if self._fault_file is not None and os.path.exists(self._fault_file):
            _inject_fault(self._fault_file, [r.x.shape[0] for r in group])
        x = _rows([r.x for r in group])
        if not x.shape[0]:
            return x, x.new_empty(x.shape)
        ids = _rows([r.topk_ids for r in group])
        w = _rows([r.topk_weights for r in group])
        return x, self.kernel(layer, x, ids, w)

    def _account(
        self,
        layer: int,
        sources: list[tuple[int, int]],
        rows: int,
        nbytes: int,
        dt: float,
        times: int = 1,
    ) -> None:
        """One layer batch served (``times`` alike): ``sources`` (attention rank, microbatch)
        of its requests, ``rows`` tokens of ``nbytes`` hidden state, in ``dt`` seconds."""
        s = self.stats
        s.requests += len(sources) * times
        s.later_microbatch_requests += sum(microbatch > 0 for _, microbatch in sources) * times
        for rank, _ in sources:
            s.requests_by_source[rank] += times
        s.tokens += rows * times
        s.bytes_in += nbytes * times
        s.busy_s += dt * times
        s.per_layer_s[layer] += dt * times
        s.per_layer_calls[layer] += times
        if s.shared is not None:
            wire = nbytes + rows * self._routing_bytes
            s.shared.record_layer(
                layer,
                len(sources) * times,
                rows * times,
                wire * times,
                nbytes * times,
                dt * times,
                calls=times,
            )

    def serve_forever(self) -> None:
        # The expert kernels open OpenMP teams of this thread's size, which a new thread takes
        # from OMP_NUM_THREADS or the CPUs it may run on, not from the creator's
        # torch.set_num_threads: a team larger than the CPUs the rank is bound to time-slices
        # one CPU and makes every expert call many times slower (numbers: docs/benchmarks.md).
        torch.set_num_threads(self._threads)
        while not self._stop.is_set():
            try:
                self.serve_once(timeout_s=0.2)
            except Exception:  # the transport itself failed: counted, logged, loop goes on
                logger.exception("AFD FFN rank %d: serve loop error", self.rank)
                self._record_failures(1)
                self._stop.wait(0.1)
        self._account_steps()

    def heartbeat_forever(self, interval_s: float) -> None:
        """Beat into the stats block every ``interval_s`` (``/health`` reads it)."""
        shared = self.stats.shared
        while shared is not None and not self._stop.wait(interval_s):
            shared.beat()

    def start(self, heartbeat_s: float = 0.1) -> None:
        """Serve on a daemon thread (the process keeps answering control calls), with a
        heartbeat thread beside it."""
        if self.stats.shared is not None:
            self.stats.shared.beat()
        self._threads_started = [
            threading.Thread(target=self.serve_forever, name="afd-ffn", daemon=True),
            threading.Thread(
                target=self.heartbeat_forever, args=(heartbeat_s,), name="afd-beat", daemon=True
            ),
        ]
        for thread in self._threads_started:
            thread.start()

    def stop(self) -> None:
        """Stop serving: end the serve loop's waits, join it, then unmap the transport (not
        while the loop may still read it: a thread still running after 5 s keeps it)."""
        self._stop.set()
        self.transport.interrupt()
        for thread in self._threads_started:
            thread.join(timeout=5)
        running = [t.name for t in self._threads_started if t.is_alive()]
        if running:
            logger.warning(
                "AFD FFN rank %d: %s still running; transport left mapped", self.rank, running
            )
        else:
            self.transport.close()
        if self.stats.shared is not None:
            self.stats.shared.close()

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "experts": [self.experts.start, self.experts.stop],
            "layers": self.layers,
            "param_bytes": self.param_bytes,
            **self.weights,
            "address": self.address,
            "cpus": sorted(os.sched_getaffinity(0)),
        }
