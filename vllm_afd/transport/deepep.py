"""DeepEP backend: the GPU path, on DeepEP's low-latency dispatch/combine (NVLink / RDMA).

NOT YET RUN ON A GPU. Written against ``deep_ep.Buffer`` as of the commit vLLM pins (73b6ea4)
and tested on CPU against ``vllm_afd.testing.deep_ep_model``, a model of the low-latency
contract that keeps DeepEP's rules (collective construction, host assertions, the double
buffer and its cleaning, the receive timeout's trap).

Group. The ``A`` attention ranks and ``F`` FFN ranks form one DeepEP low-latency group of
``A + F`` ranks, attention ranks first. DeepEP requires every rank to own ``num_experts /
num_ranks`` experts, so the group has ``(A + F) * E/F`` *virtual* experts: the attention ranks
own the first ``A * E/F`` (never routed to), FFN rank ``f`` owns ``(A + f) * E/F ...``, i.e.
global expert ``e`` is virtual expert ``e + A * E/F`` (``-1``, no expert, stays ``-1``). The
ranks meet through the front-end's hub (``group.py``): DeepEP's ``Buffer(comm=...)`` gathers
through it, and it relays the control plane. Every rank builds its ``Buffer`` lazily, at the
first step (the constructor is collective: built in an FFN actor's constructor it would wait
for attention ranks that the front-end starts only after the actors are up), with
``explicitly_destroy=True`` and ``destroy()`` at ``close``.

Control plane, then data. DeepEP's kernels carry no tag and wait at most about 100 s before
they trap the GPU, so an FFN rank must know, before it posts a call, that the call will be
matched. Each attention rank announces every step (``begin_step``: its ``StepSchedule``, the
model's MoE layer numbers, one token count per microbatch, the mode) to every FFN rank. An FFN
rank waits on the hub, not in a kernel, until every attention rank announced the next step;
the schedules must agree on the microbatch count, the layers and the mode (vLLM's data-parallel
ranks run the same forwards, idle ranks a dummy batch), or it raises ``ProtocolError`` naming
both ranks. It then runs the step explicitly: for each MoE layer of the schedule, one dispatch
per microbatch, the experts, one combine per microbatch (D,D,C,C with two microbatches, the
order of every attention rank). A capture step (CUDA graphs: the kernels are recorded, not
run) posts nothing. An idle FFN rank posts nothing.

Attention side. ``dispatch`` issues the sends (``return_recv_hook=True``) and returns; the
receive hook runs before this rank's next low-latency call, whichever it is (DeepEP's rule:
a call's send phase cleans the other buffer, where the pending receive waits, as vLLM's DBO
runs the pending hook first). ``combine`` waits for the FFN ranks' answers, weighted and summed
by DeepEP. Every step makes an even number of low-latency calls (a dispatch and a combine per
layer and microbatch), so every step starts on buffer 0 on every rank, which a CUDA graph
captured at any step relies on.

Routing weights are applied on the attention side by DeepEP's combine: the FFN side answers
with unweighted expert outputs (its requests carry weight 1, one row per (token, local
expert) pair). Hidden sizes are padded up to a size DeepEP's kernels are compiled for, as
vLLM pads them (``padded_hidden_size``); the padding is zero and cut off after the combine.

Limits (refused before start: ``limits_problem``): bfloat16; hidden size up to 8192; at most
256 tokens per rank and step (``--max-num-batched-tokens``, as vLLM's own DeepEP path); at most
two microbatches (DeepEP's two buffers); at most 14 warp groups of virtual experts per SM.
Not honoured: ``timeout_s`` (DeepEP's kernels wait about 100 s and then trap), ``reply_error``
(a collective cannot fail one request: the FFN rank stops serving, the attention ranks' waits
end in DeepEP's trap), failover. The FFN side syncs the device once
per layer and microbatch to read the received counts and computes with ``ExpertKernel``;
vLLM's batched experts on DeepEP's packed layout (no sync, written into the combine buffer)
are the next step for speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_afd.transport import auth, group
from vllm_afd.transport.base import (
    AttentionTransport,
    Backend,
    DispatchHandle,
    FFNRequest,
    FFNTransport,
    ProtocolError,
    TransportError,
    TransportSpec,
)
from vllm_afd.transport.control import Mode, StepSchedule, schedule_words

#: DeepEP's low-latency limits (DeepEP @73b6ea4, the commit vLLM pins; docs/architecture.md):
#: the hidden sizes its kernels are compiled for (vLLM rounds a layer's hidden size up to the
#: next one: ``DeepEPLLPrepareAndFinalize.maybe_roundup_layer_hidden_size``), the tokens one
#: rank may dispatch per round (``NVSHMEM_QP_DEPTH >= (tokens + 1) * 2`` at the default depth of
#: 1024; vLLM uses 256), the double buffer (two dispatches in flight), and the receive kernels'
#: warp groups (``ceil(experts / SMs) < 15``).
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LL_MAX_TOKENS = 256
LL_MAX_IN_FLIGHT = 2
LL_MAX_WARP_GROUPS = 14
#: SMs of an H100/H200 (B200: 148), for the warp-group limit when no GPU can be asked.
DEFAULT_NUM_SMS = 132


def padded_hidden_size(hidden_size: int) -> int | None:
    """The hidden size DeepEP's low-latency kernels run ``hidden_size`` at (vLLM's round-up to
    the next compiled size), or ``None`` when it is larger than every compiled size."""
    return next((h for h in LL_HIDDEN_SIZES if h >= hidden_size), None)


def limits_problem(
    hidden_size: int,
    *,
    dtype: torch.dtype | None,
    max_tokens: int,
    microbatches: int,
    num_attention_ranks: int,
    num_ffn_ranks: int,
    num_experts: int,
    num_sms: int | None = None,
) -> str | None:
    """Why DeepEP's low-latency mode cannot serve this deployment (``None``: it can), naming
    the setting to change; checked before anything starts (``deployment.check_devices``, as
    ``DeepEPBackend.limits_problem``). ``num_sms``: ``None`` is ``DEFAULT_NUM_SMS``."""
    num_sms = num_sms or DEFAULT_NUM_SMS
    if padded_hidden_size(hidden_size) is None:
        return (
            f"hidden size {hidden_size}: DeepEP's low-latency kernels take at most "
            f"{LL_HIDDEN_SIZES[-1]} (compiled sizes {list(LL_HIDDEN_SIZES)}; smaller ones are "
            "padded up)"
        )
    if dtype != torch.bfloat16:
        return f"--dtype {str(dtype).removeprefix('torch.')}: DeepEP dispatches bfloat16 only"
    if max_tokens > LL_MAX_TOKENS:
        return (
            f"--max-num-batched-tokens {max_tokens}: DeepEP's low-latency mode takes at most "
            f"{LL_MAX_TOKENS} tokens per rank and round (as vLLM's own DeepEP path); use "
            f"--max-num-batched-tokens {LL_MAX_TOKENS} with chunked prefill"
        )
    if microbatches > LL_MAX_IN_FLIGHT:
        return (
            f"--afd-microbatches {microbatches}: DeepEP's low-latency buffer holds "
            f"{LL_MAX_IN_FLIGHT} dispatches in flight"
        )
    virtual = VirtualExperts(num_attention_ranks, num_ffn_ranks, num_experts // num_ffn_ranks)
    warp_groups = -(-virtual.num_experts // num_sms)
    if warp_groups > LL_MAX_WARP_GROUPS:
        return (
            f"--afd-ratio: {virtual.num_experts} virtual experts ((A + F) x E / F with "
            f"A={num_attention_ranks}, F={num_ffn_ranks}, E={num_experts}) need "
            f"{warp_groups} warp groups on {num_sms} SMs; DeepEP's receive kernels take at most "
            f"{LL_MAX_WARP_GROUPS} (at most {LL_MAX_WARP_GROUPS * num_sms} virtual experts): "
            "use fewer attention ranks per FFN rank"
        )
    return None


@dataclass
class DeepEPState:
    """``DispatchHandle.state`` of the DeepEP backend (what ``low_latency_combine`` needs).

    Attributes:
        ll_handle: DeepEP's low-latency dispatch handle.
        topk_idx: ``[T, K]`` virtual expert ids (``VirtualExperts.to_virtual``).
        topk_weights: ``[T, K]`` float32 routing weights, applied by the combine.
    """

    ll_handle: object
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def _import_deep_ep():
    """Import ``deep_ep`` or explain why this machine cannot use the backend."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the 'deepep' AFD transport needs an NVIDIA GPU with the deep_ep package (DeepEP, "
            "built with NVSHMEM); this machine has no CUDA device: use 'shm' or 'tcp'"
        )
    try:
        import deep_ep
    except (ImportError, AssertionError) as exc:  # 2.x asserts its NCCL at import
        raise RuntimeError(
            "the 'deepep' AFD transport needs the deep_ep package (DeepEP, built from source "
            f"with NVSHMEM, https://github.com/deepseek-ai/DeepEP): {exc}"
        ) from exc
    return deep_ep


def _device() -> torch.device:
    """Where the buffers live: the current GPU (on CPU: the model of ``testing``)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class VirtualExperts:
    """Expert numbering inside the ``A + F`` rank DeepEP group (see module docstring)."""

    num_attention_ranks: int
    num_ffn_ranks: int
    experts_per_rank: int

    @classmethod
    def of(cls, spec: TransportSpec) -> VirtualExperts:
        return cls(spec.num_attention_ranks, spec.num_ffn_ranks, spec.experts_per_ffn_rank)

    @property
    def num_ranks(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def num_experts(self) -> int:
        return self.num_ranks * self.experts_per_rank

    def to_virtual(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` global expert ids -> ``[T, K]`` int64 virtual ids (DeepEP's ``topk_idx``);
        ``-1`` (no expert) stays ``-1``."""
        ids = topk_ids.long()
        return torch.where(ids < 0, ids, ids + self.num_attention_ranks * self.experts_per_rank)

    def group_rank_of_ffn(self, ffn_rank: int) -> int:
        return self.num_attention_ranks + ffn_rank


class _Endpoint:
    """What both sides share: the group membership, the lazily built buffer, and the shapes."""

    def _join(self, spec: TransportSpec, group_rank: int) -> None:
        if spec.dtype != torch.bfloat16:
            raise ValueError(f"deepep transport: dtype {spec.dtype}; DeepEP dispatches bfloat16")
        if not spec.moe_layers:
            raise ValueError(
                "the deepep transport needs TransportSpec.moe_layers (the model's MoE layer "
                "numbers), which the control plane announces each step; the spec has none"
            )
        self._deep_ep = _import_deep_ep()
        self._experts = VirtualExperts.of(spec)
        self._hidden = padded_hidden_size(spec.hidden_size) or spec.hidden_size
        self._words = schedule_words(spec.moe_layers)
        hub = spec.addresses[0].partition("/")[0] if spec.addresses else ""
        if not hub:
            raise ValueError("deepep transport: the spec names no hub address (placement sets it)")
        self.hub_address = hub
        self._member = group.Member(hub, group_rank, self._experts.num_ranks, auth.load_secret())
        self._buffer = None

    def _ensure_buffer(self):
        """The DeepEP buffer, built at the first step (collective over the group)."""
        if self._buffer is None:
            spec, experts = self.spec, self._experts
            size = self._deep_ep.Buffer.get_low_latency_rdma_size_hint(
                spec.max_tokens, self._hidden, experts.num_ranks, experts.num_experts
            )
            self._buffer = self._deep_ep.Buffer(
                None,
                num_rdma_bytes=size,
                low_latency_mode=True,
                num_qps_per_rank=experts.experts_per_rank,
                explicitly_destroy=True,
                comm=self._member,
                **spec.config,  # DeepEPBackend.settings, as the user gave them
            )
        return self._buffer

    def _release(self) -> None:
        """Destroy the buffer (collective in DeepEP: an NVSHMEM barrier with every rank's
        destroy; the front-end bounds an FFN rank's stop) and leave the hub."""
        if self._buffer is not None:
            self._buffer.destroy()
            self._buffer = None
        self._member.close()


class DeepEPAttentionTransport(_Endpoint, AttentionTransport):
    """Attention endpoint: group rank ``rank``; sends tokens, owns only idle virtual experts."""

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        AttentionTransport.__init__(self, spec, rank)
        self._join(spec, rank)
        self._pending_hook = None  # the last dispatch's receive half, not run yet
        self._idle: torch.Tensor | None = None

    def _announce(self, schedule: StepSchedule) -> None:
        words = schedule.words(self._words)
        for ffn_rank in range(self.spec.num_ffn_ranks):
            self._member.post(self._experts.group_rank_of_ffn(ffn_rank), words)
        if self._buffer is None:  # the first step (eager: vLLM profiles before it captures)
            self._ensure_buffer()
            # combine input of this rank's own, never routed, experts
            rows = self.spec.max_tokens * self._experts.num_ranks
            shape = (self._experts.experts_per_rank, rows, self._hidden)
            self._idle = torch.zeros(shape, dtype=torch.bfloat16, device=_device())

    def _run_pending_hook(self) -> None:
        """Finish the pending dispatch's receive before another low-latency call (its send
        phase would clean the buffer that receive waits on)."""
        hook, self._pending_hook = self._pending_hook, None
        if hook is not None:
            hook()

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        microbatch: int = 0,
    ) -> DispatchHandle:
        """``x``: ``[T, H]`` bfloat16, ``T <= spec.max_tokens``; issues the sends and returns
        (the receive runs before this rank's next low-latency call). Needs ``begin_step``."""
        schedule = self.schedule
        if schedule is None or layer not in schedule.layers:
            raise ProtocolError(
                f"deepep transport: attention rank {self.rank} dispatched layer {layer} outside "
                f"an announced step (schedule: {schedule}); the FFN ranks run announced steps only"
            )
        self._run_pending_hook()
        buffer = self._buffer
        if x.shape[1] != self._hidden:
            x = torch.nn.functional.pad(x, (0, self._hidden - x.shape[1]))
        topk_idx = self._experts.to_virtual(topk_ids).to(self._deep_ep.topk_idx_t).contiguous()
        _, _, ll_handle, _, hook = buffer.low_latency_dispatch(
            x.contiguous(),
            topk_idx,
            self.spec.max_tokens,
            self._experts.num_experts,
            use_fp8=False,
            return_recv_hook=True,
        )
        self._pending_hook = hook
        state = DeepEPState(ll_handle, topk_idx, topk_weights.float().contiguous())
        return DispatchHandle(
            layer, x.shape[0], self.spec.hidden_size, x.dtype, {}, state, self.step, microbatch
        )

    def combine(self, handle: DispatchHandle) -> torch.Tensor:
        """``[T, H]`` bfloat16: DeepEP reduces the FFN ranks' outputs with the weights here.

        Raises:
            ValueError: if ``handle`` was already combined.
        """
        state: DeepEPState | None = handle.state
        if state is None:
            raise ValueError(f"handle of layer {handle.layer} was already combined")
        handle.state = None
        self._run_pending_hook()
        out, _, _ = self._buffer.low_latency_combine(
            self._idle, state.topk_idx, state.topk_weights, state.ll_handle
        )
        if out.shape[1] != handle.hidden_size:
            out = out[:, : handle.hidden_size].contiguous()  # the padding
        return out

    def close(self) -> None:
        self._release()


@dataclass
class _Round:
    """One microbatch of the layer the FFN side serves now: DeepEP's answer to its dispatch."""

    recv_x: torch.Tensor  # [E_local, ranks * max_tokens, H_padded], DeepEP's packed layout
    rows: torch.Tensor  # [N] int64: where each received row is in recv_x viewed as [-1, H_pad]
    ll_handle: object
    out: torch.Tensor | None = None  # the experts' answer, [N, H]


def _received_rows(
    recv_x: torch.Tensor, counts: torch.Tensor, first_expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's packed layout (expert ``e`` received ``counts[e]`` rows, at the start of
    ``recv_x[e]``) as ``(rows, ids)``: each received row's index in ``recv_x`` viewed as
    ``[-1, H]``, and its global expert id. One device sync: the total row count."""
    num_local, per_expert = recv_x.shape[0], recv_x.shape[1]
    local = torch.arange(num_local, device=recv_x.device)
    total = int(counts.sum())  # device sync
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(local, counts, output_size=total)
    within = torch.arange(total, device=recv_x.device) - starts[expert]
    return expert * per_expert + within, expert + first_expert


class DeepEPFFNTransport(_Endpoint, FFNTransport):
    """FFN endpoint: group rank ``A + rank``; runs each announced step layer by layer.

    ``recv`` returns, per MoE layer of the step, one request per microbatch (all attention
    ranks' tokens routed here, one row per (token, local expert) pair, weight 1); once every
    one is answered (``reply``), the layer's combines run and the next ``recv`` serves the
    next layer.

    Raises:
        ValueError: if the spec has no ``moe_layers`` or is not bfloat16.
    """

    def __init__(self, spec: TransportSpec, rank: int) -> None:
        FFNTransport.__init__(self, spec, rank)
        self._join(spec, VirtualExperts.of(spec).group_rank_of_ffn(rank))
        self._first = spec.expert_range(rank).start  # global id of local expert 0
        self._layers: list[int] = []  # the step's layers still to serve
        self._schedule: StepSchedule | None = None
        self._rounds: list[_Round] = []
        self._failed = ""
        # what an FFN rank dispatches and combines for its own (it routes no token)
        device, top_k = _device(), spec.top_k
        self._no_x = torch.empty(0, self._hidden, dtype=torch.bfloat16, device=device)
        self._no_idx = torch.empty(0, top_k, dtype=self._deep_ep.topk_idx_t, device=device)
        self._no_weights = torch.empty(0, top_k, dtype=torch.float32, device=device)

    @property
    def address(self) -> str:
        return f"{self.hub_address}/{self._experts.group_rank_of_ffn(self.rank)}"

    def recv(self, timeout_s: float) -> list[FFNRequest]:
        """The next layer's requests of the current step, or of the next announced step
        (waiting up to ``timeout_s`` for its first schedule, on the hub: an idle rank posts no
        DeepEP call). ``[]`` when idle, and for a capture step."""
        if self._failed:  # the group cannot go on (``reply_error``): serve nothing more
            time.sleep(timeout_s)
            return []
        if self._rounds:
            raise TransportError("deepep transport: recv before the last layer was answered")
        if not self._layers and not self._next_step(timeout_s):
            return []
        layer = self._layers[0]
        buffer = self._buffer
        requests = []
        for microbatch in range(len(self._schedule.microbatch_tokens)):
            recv_x, count, ll_handle, _, _ = buffer.low_latency_dispatch(
                self._no_x,
                self._no_idx,
                self.spec.max_tokens,
                self._experts.num_experts,
                use_fp8=False,
            )
            rows, ids = _received_rows(recv_x, count.long(), self._first)
            self._rounds.append(_Round(recv_x, rows, ll_handle))
            hidden = recv_x.shape[-1]
            x = recv_x.view(-1, hidden)[:, : self.spec.hidden_size].index_select(0, rows)
            weights = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            # step 0, no schedule: the schedules were checked here (all attention ranks agree)
            requests.append(
                FFNRequest(
                    -1,
                    layer,
                    x,
                    ids[:, None].int(),
                    weights,
                    reply_key=microbatch,
                    microbatch=microbatch,
                )
            )
        return requests

    def _next_step(self, timeout_s: float) -> bool:
        """Take every attention rank's next schedule; ``False`` if none came in ``timeout_s``
        (or the step is a capture: nothing to serve)."""
        num_attention = self.spec.num_attention_ranks
        schedules: dict[int, StepSchedule] = {}
        wait_s = timeout_s
        while len(schedules) < num_attention:
            post = self._member.next_post(wait_s)
            if post is None:
                if not schedules:
                    return False
                missing = sorted(set(range(num_attention)) - set(schedules))
                raise TransportError(
                    f"deepep transport: FFN rank {self.rank} got the next step from attention "
                    f"ranks {sorted(schedules)} but not from {missing} within {wait_s:.0f} s"
                )
            src, words = post
            if src in schedules:
                raise ProtocolError(
                    f"deepep transport: attention rank {src} announced a step before every "
                    "attention rank announced the one before it"
                )
            schedules[src] = StepSchedule.from_words(words)
            wait_s = self.spec.timeout_s
        first = schedules[0]
        for src, schedule in schedules.items():
            mine = (len(first.microbatch_tokens), first.layers, first.mode)
            theirs = (len(schedule.microbatch_tokens), schedule.layers, schedule.mode)
            if theirs != mine:
                raise ProtocolError(
                    f"deepep transport: FFN rank {self.rank}: attention rank 0 announced "
                    f"{first}, attention rank {src} announced {schedule}; DeepEP's collective "
                    "needs every attention rank to run the same microbatches and layers"
                )
        self._ensure_buffer()  # the first step: every rank builds its buffer now
        if first.mode == Mode.CAPTURE:
            return False
        self._schedule = first
        self._layers = list(first.layers)
        return True

    def reply(self, request: FFNRequest, out: torch.Tensor) -> None:
        """``out``: ``[N, H]`` unweighted expert outputs, rows in ``request`` order. The layer's
        combines run, in microbatch order, once every microbatch is answered."""
        self._rounds[request.reply_key].out = out
        if any(r.out is None for r in self._rounds):
            return
        rounds, self._rounds = self._rounds, []
        self._layers.pop(0)
        for r in rounds:
            # DeepEP's combine reads the received rows only; the padding columns are cut off
            # on the attention side: nothing else needs clearing
            packed = torch.empty_like(r.recv_x)  # [E_local, ranks * max_tokens, H_padded]
            packed.view(-1, packed.shape[-1])[r.rows, : r.out.shape[1]] = r.out
            self._buffer.low_latency_combine(packed, self._no_idx, self._no_weights, r.ll_handle)

    def reply_error(self, request: FFNRequest, message: str) -> None:
        """A collective cannot fail one request: the layer's combines never run, so the
        attention ranks' combines end in DeepEP's timeout (about 100 s, then the kernel
        traps). This rank serves nothing more and says why once."""
        if not self._failed:
            self._failed = message
            raise TransportError(
                f"deepep transport: FFN rank {self.rank} cannot answer layer {request.layer} "
                f"({message}); the DeepEP group cannot go on, this rank stops serving"
            )

    def close(self) -> None:
        self._release()


class DeepEPBackend(Backend):
    """GPUs at both ends, DeepEP's low-latency kernels; the ranks meet through the front-end's
    hub (``group.py``), authenticated with the deployment's secret. A collective: no failover
    (a DeepEP group cannot take a new member), and the combine applies the routing weights."""

    name = "deepep"
    attention = DeepEPAttentionTransport
    ffn = DeepEPFFNTransport
    needs_secret = True
    supports_failover = False
    scales_live = False
    isolates_requests = False
    weights_applied_on = "attention"
    max_tokens_per_round = LL_MAX_TOKENS
    #: DeepEP ``Buffer`` arguments a deployment may set (``--afd-transport-config``); the
    #: rest are this backend's to choose (low-latency mode, its RDMA size, one QP per local
    #: expert as the low-latency kernels require).
    settings = {"allow_nvlink_for_low_latency_mode": bool, "allow_mnnvl": bool, "use_fabric": bool}

    @classmethod
    def device_problem(cls, attention_device: str, ffn_device: str) -> str | None:
        if (attention_device, ffn_device) == ("cuda", "cuda"):
            return None
        return (
            "deepep: DeepEP runs between GPUs; this deployment has attention ranks on "
            f"{attention_device} and FFN ranks on {ffn_device} (--afd-ffn-device); use shm or "
            "tcp on CPUs"
        )

    limits_problem = staticmethod(limits_problem)

    @classmethod
    def start_rendezvous(cls, spec: TransportSpec, ffn_host: str) -> group.Hub:
        num_ranks = spec.num_attention_ranks + spec.num_ffn_ranks
        return group.Hub(ffn_host, num_ranks, auth.load_secret())

    @classmethod
    def round_trip_bytes(cls, spec: TransportSpec, tokens: int) -> tuple[int, int]:
        """One hidden-state row per (token, expert) pair each way, at most (DeepEP's
        low-latency layout: a token goes once to each FFN rank that holds one of its experts,
        one row per expert comes back); ids and weights stay on the attention side."""
        rows = tokens * spec.top_k * spec.hidden_size * spec.dtype.itemsize
        return rows, rows
