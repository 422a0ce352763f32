"""When a step begins: this attention rank's side of the control plane (``transport/control.py``).

The FFN ranks serve a step whole once they know its schedule (``StepSchedule``: each
microbatch's tokens and the layers it crosses), so every step is announced before its first
dispatch, from one place (``Steps``), whichever driver runs the forward:

* a plain forward: the first MoE layer that runs under a ``ForwardContext`` not of the current
  step begins a step of one microbatch (``AttentionSession.before_dispatch``);
* the CPU runner's ping-pong microbatches (patch M4) and a replayed FULL CUDA graph (G1): the
  patch begins the step with each microbatch's tokens (``AttentionSession.begin_step``);
* vLLM's DBO (GPUs): the first ubatch's first MoE layer begins it with every ubatch's context
  (``dbo_ubatches``);
* request isolation announces a further step within the current forward
  (``Steps.announce``, ``attention/failures.py``).

Outside any forward context (a test calling the op) every call is a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from vllm_afd.microbatch import vllm_dbo
from vllm_afd.transport import AttentionTransport
from vllm_afd.transport.control import Mode, StepSchedule


class Steps:
    """Announces this rank's steps to the FFN ranks through its endpoint."""

    def __init__(self, endpoint: AttentionTransport, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.endpoint = endpoint
        #: The model's MoE layers; an empty list (a spec made by hand) announces nothing.
        self.layers: tuple[int, ...] = tuple(endpoint.spec.moe_layers)
        #: Under tensor parallelism this rank sends rows ``tp_rank::tp_size`` of every batch
        #: (``layer.remote_experts_impl``): its schedules announce that share.
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._contexts: tuple[weakref.ref[object], ...] = ()

    def begin(self, microbatch_tokens: Sequence[int], contexts: Sequence[object]) -> None:
        """A new step through every MoE layer: its microbatches' tokens, run under
        ``contexts`` (the forward contexts the step's layers will see)."""
        self._contexts = tuple(weakref.ref(c) for c in contexts)
        self.announce(microbatch_tokens, self.layers)

    def announce(self, microbatch_tokens: Sequence[int], layers: Sequence[int]) -> None:
        """One more step of the current forward, through ``layers`` only."""
        if not self.layers:
            return
        endpoint, rank, size = self.endpoint, self.tp_rank, self.tp_size
        tokens = tuple(len(range(rank, n, size)) for n in microbatch_tokens)
        schedule = StepSchedule(endpoint.step + 1, tokens, tuple(layers), _mode())
        endpoint.begin_step(schedule)

    def runs_under(self, context: object | None) -> bool:
        """Whether the current step was begun for the forward context ``context``."""
        return context is not None and any(ref() is context for ref in self._contexts)


def forward_context() -> object | None:
    """vLLM's current ``ForwardContext``, or ``None`` outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def dbo_ubatches(max_tokens: int) -> tuple[tuple[int, ...], tuple[object, ...]] | None:
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


def replay_ubatch_tokens(num_tokens: int, num_ubatches: int) -> tuple[int, ...]:
    """Each microbatch's tokens in a graph replay of ``num_tokens`` padded tokens (G1), from
    vLLM's own split (``ubatch_utils.maybe_create_ubatch_slices``, as the V2 runner's
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


def _mode() -> Mode:
    """``Mode.CAPTURE`` while a CUDA graph is being captured, else ``Mode.RUN``."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return Mode.CAPTURE if capturing else Mode.RUN
