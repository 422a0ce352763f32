"""One layer's round trip to the FFN group: dispatch, the overlap, combine, counted.

Three ways to overlap the FFN's work, one per driver of the forward:

* none: dispatch, then combine (one microbatch per step);
* the CPU runner's ping-pong microbatches (patch M4): between dispatch and combine the
  ``overlap_point`` hands the baton to the next microbatch's thread, which runs its attention
  while the FFN ranks work on this one (``microbatch.py``);
* vLLM's DBO (GPUs): the two yields and the receive hook of vLLM's own DeepEP low-latency
  prepare/finalize (``dbo_exchange``).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_afd.metrics import recorder
from vllm_afd.microbatch import current_microbatch, overlap_point, vllm_dbo
from vllm_afd.transport import AttentionTransport, DispatchHandle

if TYPE_CHECKING:
    from vllm_afd.attention.session import AttentionSession


def round_trip(
    session: AttentionSession,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """dispatch -> (other microbatches run) -> combine, counted for /metrics: the wait in
    combine is the FFN time the overlap did not hide. Shapes as ``AttentionTransport``'s
    ``dispatch``; returns ``[T, H]`` in ``x.dtype``."""
    endpoint = session.endpoint
    ubatching = vllm_dbo()
    try:
        if ubatching is not None:
            handle, receive = dbo_exchange(ubatching, endpoint, layer, x, topk_ids, topk_weights)
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


def dbo_exchange(
    ubatching: types.ModuleType,
    endpoint: AttentionTransport,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> tuple[DispatchHandle[Any], Callable[[], torch.Tensor]]:
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
