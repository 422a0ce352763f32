"""What the tests and the transport micro-benchmark run on an FFN rank instead of the product's
executor: a reference serve loop (``serve_ffn``), its process entry (``ffn_worker_main``), and
forwards that compute nothing or misbehave on purpose (``EchoForward``, ``DelayedForward``,
``FailingForward``).

A forward is any picklable ``forward(x, topk_ids, topk_weights, out) -> out`` (see
``testing.reference.FFNForward``; ``LocalMoE`` is the one that computes experts). ``out`` is the
request's ``reply_buffer`` (``None`` where the backend has none): every forward here writes its
answer straight into it, which saves the shm backend its reply copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_afd.testing.reference import FFNForward
from vllm_afd.transport.base import FFNTransport, ServesRequests, ServesSteps, TransportSpec


@dataclass
class EchoForward:
    """Transport-only FFN: returns ``x * scale`` (no expert compute)."""

    scale: float = 2.0

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.mul(x, self.scale, out=out)


@dataclass
class DelayedForward:
    """Fault injection: sleeps ``delay_s`` before running ``inner`` (a slow or hung FFN rank)."""

    inner: FFNForward
    delay_s: float

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.inner(x, topk_ids, topk_weights, out)


@dataclass
class FailingForward:
    """Fault injection: every call raises (an FFN rank whose serve loop fails a request)."""

    message: str = "bad batch"

    def __call__(self, x, topk_ids, topk_weights, out=None) -> torch.Tensor:
        raise RuntimeError(self.message)


def serve_ffn(
    transport: FFNTransport,
    forward: FFNForward,
    should_stop: Callable[[], bool],
    poll_s: float = 0.05,
) -> int:
    """Reference FFN loop: answer every request until ``should_stop()`` (checked when idle);
    a request whose forward raises is failed with the error's text (``reply_error``). An
    endpoint that serves whole announced steps is served step by step, as the executor does
    (``_serve_steps``).

    Returns:
        The number of requests (or parts of uses) answered.
    """
    if isinstance(transport, ServesSteps):
        return _serve_steps(transport, forward, should_stop, poll_s)
    assert isinstance(transport, ServesRequests)
    served = 0
    while True:
        requests = transport.recv(poll_s)
        if not requests and should_stop():
            return served
        for request in requests:
            try:
                out = forward(
                    request.x, request.topk_ids, request.topk_weights, request.reply_buffer
                )
            except Exception as exc:  # as the product's executor does: fail this request
                transport.reply_error(request, f"{type(exc).__name__}: {exc}")
                continue
            transport.reply(request, out)
        served += len(requests)


def _serve_steps(
    transport: ServesSteps, forward: FFNForward, should_stop: Callable[[], bool], poll_s: float
) -> int:
    """Every announced step, use by use (``ServesSteps``), until ``should_stop()``."""
    served = 0
    while True:
        step = transport.next_step(poll_s)
        if step is None:
            if should_stop():
                return served
            continue
        for _, slot, parts in step.uses:
            transport.serve_use(slot, parts, forward)
            served += len(parts)
        transport.end_step()


class StopFlag:
    """A stop flag for reference FFN ranks that killing one cannot wedge: a
    ``multiprocessing.Event`` takes a lock in ``is_set``, so a rank SIGKILLed while it checks
    (the failover tests kill ranks) leaves ``set`` in the parent blocked for ever. One shared
    byte, no lock (``ctx``: the multiprocessing context the ranks start from)."""

    def __init__(self, ctx) -> None:
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)


def ffn_worker_main(
    spec: TransportSpec, rank: int, forward: FFNForward, conn, stop_event, num_threads: int = 1
) -> None:
    """Process entry of a reference FFN rank (tests, micro-benchmark).

    Creates the FFN endpoint, sends its ``address`` through ``conn`` (a ``multiprocessing``
    connection), serves until ``stop_event`` is set, then closes the endpoint.
    """
    torch.set_num_threads(num_threads)
    from vllm_afd.transport import create_ffn_transport

    transport = create_ffn_transport(spec, rank)
    try:
        conn.send(transport.address)
        serve_ffn(transport, forward, stop_event.is_set)
    finally:
        transport.close()
        conn.close()
