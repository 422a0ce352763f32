"""What happens when an FFN rank fails a layer's tokens: the whole story, told once.

An FFN rank's expert computation raises (a kernel error, an input it refuses, an injected
fault), or the rank dies, stops or wedges. From the FFN rank outwards:

1. **The FFN rank** (``ffn/executor.py``, ``_serve_layer``): when a layer's batch raises, each
   request not answered yet is served again alone, so that the error answer reaches only the
   attention ranks whose requests raise by themselves; the rank keeps serving.
2. **The attention endpoint** (``transport/endpoint.py``), on a backend that fails over
   (``Feature.FAILOVER``, ``--afd-failover-timeout`` > 0): a lost rank (``FFNRankLost``) is
   waited for until its replacement is up and every request it had not answered is sent again
   (no token changes); an error answer (``FFNServeError``) counts once as the rank's loss
   (the supervisor replaces a rank that failed a request), so the request goes once more, to
   the replacement. A timeout (``FFNTimeout``) is not retried.
3. **Here** (``isolate``), on a backend that isolates requests (``Feature.ISOLATION``): an error
   answer that survived step 2 sends each vLLM request's rows of the layer again alone, in a
   step of that layer only, with step 2's retry off. The requests that fail alone are failed;
   the rest of the forward runs without their rows (``healthy_round_trip``), the remaining
   layers announced as one more step.
4. **The scheduler** (patches W1 and W2): the step's output carries the failed requests; vLLM
   finishes them with ``FINISHED_ERROR`` and evicts their blocks from the prefix cache.

What the user sees: a request an FFN rank fails even alone gets vLLM's error answer, and every
other request of its batch completes with the tokens it would have had. A lost rank is healed
by failover without any request failing; when failover gives up (``failed``) or is off, the
waiting requests fail with the reason. Where a batch cannot be split by request (a microbatched
step, attention TP > 1, no V1 runner) or the backend does not isolate, the error reaches vLLM:
the engine core dies, vLLM fails its in-flight requests and ``/health`` answers 503.

With the device's waits (every GPU; ``slots`` with ``waits: device`` on a CPU) nothing of the
above happens within a forward: a kernel cannot raise, so an error answer, a timeout or a lost
rank is recorded in the step (``transport/slot_plane.py``, ``RecordedWaits``) and seen once the
step's sampled tokens are ready (W1 calls ``AttentionSession.sampled`` after vLLM's sync on
them), which raises ``StepsFailed`` naming the steps it may have spoiled: the session fails
their requests, as W1 gave them from each step's scheduler output, on that step's own output,
so they get vLLM's error answer (step 4) and none of their spoiled tokens leaves. A lost rank
is replaced (failover) at the next announcement, which raises the loss again
(``AttentionSession.begin_step``; it also fails the requests of the steps a forward no W1 step
wraps spoiled) and announces its step again: the engine serves on. Finer than a step it cannot
be: the step's uses ran (on a GPU, one graph replay) before anyone knew.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_afd.attention.exchange import round_trip
from vllm_afd.attention.steps import forward_context
from vllm_afd.errors import FFNServeError
from vllm_afd.microbatch import current_microbatch
from vllm_afd.transport import Feature, backend

if TYPE_CHECKING:
    from vllm_afd.attention.session import AttentionSession


@dataclass(frozen=True)
class Failed:
    """Requests of one forward that an FFN error followed (``isolate``): for the rest of that
    forward their rows go to no FFN rank and get no routed-expert output."""

    context: weakref.ref[object]  # the forward's ForwardContext
    requests: frozenset[str]
    healthy: torch.Tensor  # the rows still sent, ascending (int64)

    def now(self) -> bool:
        return self.context() is forward_context()


@dataclass
class Failures:
    """The session's failed requests: those of the forward running, and every one failed
    since the runner last took them (W1). The runner's thread's only."""

    #: The forward running, where it failed requests.
    forward: Failed | None = None
    #: request id -> the FFN's error text.
    requests: dict[str, str] = field(default_factory=dict)

    def take(self) -> dict[str, str]:
        """The requests failed since the last call (the step is over: the forward too)."""
        taken, self.requests, self.forward = self.requests, {}, None
        return taken


def requests_of(runner: object | None, num_rows: int) -> list[tuple[str, slice]] | None:
    """The forward's requests and their rows of a layer's ``num_rows`` (rows past the last
    request are padding), or ``None`` where a failed batch cannot be split by request: no
    runner with V1's batch layout (V2's runner has none) or forward context, a microbatch of
    a step, or rows that are not the batch's."""
    if not hasattr(runner, "input_batch"):
        return None
    if forward_context() is None or current_microbatch() is not None:
        return None
    num_reqs: int = runner.input_batch.num_reqs
    starts: list[int] = runner.query_start_loc.cpu[: num_reqs + 1].tolist()  # type: ignore[attr-defined]
    if not num_reqs or starts[-1] > num_rows:
        return None
    ids: list[str] = runner.input_batch.req_ids[:num_reqs]
    return [(r, slice(a, b)) for r, a, b in zip(ids, starts[:-1], starts[1:], strict=True) if b > a]


def isolate(
    session: AttentionSession,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    error: FFNServeError,
    failed: Failed | None,
) -> torch.Tensor:
    """Step 3 of the module docstring: an FFN rank failed this layer's batch (``error``, after
    its failover retry if any); each request's rows go again alone. Returns the layer's output
    (zeros for failed requests' rows); re-raises ``error`` where the batch cannot be split
    (``requests_of``) or the backend does not isolate."""
    endpoint = session.endpoint
    requests = requests_of(session.runner, x.shape[0])
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
                part = round_trip(session, layer, x[rows], topk_ids[rows], topk_weights[rows])
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
    kept = torch.cat(healthy) if healthy else torch.empty(0, dtype=torch.long)
    failures = session.failures
    failures.forward = Failed(weakref.ref(forward_context()), gone, kept.to(x.device))
    failures.requests.update(errors)  # logged by the scheduler as it fails them (W2)
    later = tuple(n for n in session.steps.layers if n > layer)
    if later:
        session.steps.announce((kept.numel(),), later)
    return out


def healthy_round_trip(
    session: AttentionSession,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    failed: Failed,
) -> torch.Tensor:
    """The round trip of the rows of requests not failed in this forward (zeros elsewhere);
    one more failure isolates again among them."""
    out = torch.zeros_like(x)
    rows = failed.healthy
    if not rows.numel():
        return out
    try:
        out[rows] = round_trip(session, layer, x[rows], topk_ids[rows], topk_weights[rows])
    except FFNServeError as error:
        return isolate(session, layer, x, topk_ids, topk_weights, error, failed)
    return out
