"""vLLM's own DBO machinery on CPU, for tests: two ubatch threads that alternate at every
``dbo_yield``, started as ``UBatchWrapper._run_ubatches`` starts them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch


class ForwardContext(SimpleNamespace):
    """A stand-in forward context (weak-referenceable, no DP metadata)."""


def run_ubatch_threads(
    monkeypatch, inputs: Sequence[torch.Tensor], body: Callable[[int, torch.Tensor], torch.Tensor]
) -> dict[int, torch.Tensor]:
    """``body(ubatch, x) -> x`` for each input on its own ubatch thread (inside vLLM's
    ``UBatchContext``, so ``dbo_yield`` and the receive hooks work as on GPUs); the results by
    ubatch id."""
    from vllm.forward_context import override_forward_context
    from vllm.v1.worker import ubatching

    stream = object()  # CPU: one stand-in stream, so no thread switches CUDA streams
    monkeypatch.setattr(ubatching, "current_stream", lambda: stream)
    results: dict[int, torch.Tensor] = {}

    def run(ctx, x) -> None:
        with ctx:
            results[ctx.id] = body(ctx.id, x)

    barrier = threading.Barrier(len(inputs) + 1)
    with override_forward_context(None):
        forward_contexts = [ForwardContext(dp_metadata=None) for _ in inputs]
        contexts = ubatching.make_ubatch_contexts(
            len(inputs), stream, stream, forward_contexts, barrier
        )
        threads = [
            threading.Thread(target=run, args=(c, x)) for c, x in zip(contexts, inputs, strict=True)
        ]
        for t in threads:
            t.start()
        barrier.wait()
        contexts[0].cpu_wait_event.set()
        for t in threads:
            t.join(20)
    return results
