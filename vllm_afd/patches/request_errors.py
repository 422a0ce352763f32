"""Worker W1 and engine core W2 (ledger in ``__init__``): a request an FFN error follows fails
alone, with vLLM's own request-error path.

The attention side finds, within a forward, the requests whose rows an FFN rank fails even
alone (``attention/failures.py``, where the whole story is told), serves the rest and records
those. W1 gives the worker's session the model runner (the batch's request ids and rows) and
carries the failed requests to the
scheduler on the step's ``ModelRunnerOutput`` (an attribute, which survives the pickling of a
multi-process executor). W2, in the scheduler, drops the step's token of each failed request,
evicts its blocks from the prefix cache (their KV was computed without routed experts), and
hands it to the set vLLM finishes with ``FINISHED_ERROR`` in ``update_from_output``: the
client gets vLLM's error answer, the other requests go on.

W1 and W3 wrap both of vLLM's model runners, V1's (the CPU runner inherits it) and V2's (the
default on CUDA), which call alike: the differences are V2's dummy runs, an ``execute_model``
with ``dummy_run`` and placeholder requests, and its batch layout, which ``failures.requests_of``
does not read (on V2 a failed batch is not split by request; a failed step still is).

W1 also gives the session the step's requests (its scheduler output's): where the device's
waits recorded a failure, the requests of the steps it may have spoiled fail the same way
(``AttentionSession.fail_steps``). W1 reads those waits where vLLM has synchronized on a step's
sampled tokens (the step's device work is done): the step's ``ModelRunnerOutput``, or an async
one's ``get_output`` after its own wait (``AttentionSession.sampled``), so the failed requests
ride the output whose tokens their failure spoiled.

W1 and W3 also hold the session's step lock (``AttentionSession.step``) for each
step and dummy step (a DP rank's idle forward): a live scale switches an idle attention rank
to the new FFN pool between steps only. W1 also gives the session each step's start, with its
requests and their context (``decode_step``): it times the decode steps' periods into the
rank's stats block (``attention.session.StepPeriods``), what the planner in the loop reads.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

from vllm_afd.patches.base import check_unwrapped, wrap

logger = logging.getLogger("vllm.afd")

#: The ``ModelRunnerOutput`` attribute W1 sets: request id -> the FFN's error text.
FAILED_ATTRIBUTE = "afd_failed_requests"


def _with_failures(session, output):
    """``output`` carrying the requests ``session`` failed since the last output (a step's
    output, or an async one's ``get_output``, after vLLM's sync on the sampled tokens); the
    device's waits of the step announced last are checked first (``session.sampled``), so a
    request its failure spoiled fails before its token leaves. ``None`` and intermediate
    tensors carry none yet."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    step = session.endpoint.step
    if isinstance(output, ModelRunnerOutput):
        return _carrying(output, {**session.take_failed_requests(), **session.sampled(step)})
    if isinstance(output, AsyncModelRunnerOutput):
        failed, get_output = session.take_failed_requests(), output.get_output
        # on vLLM's output thread: ``sampled`` reads the waits only, the session's failures
        # stay the runner's thread's
        output.get_output = lambda: _carrying(get_output(), {**failed, **session.sampled(step)})
    return output


def _carrying(output, failed: dict[str, str]):
    """``output`` (a ``ModelRunnerOutput``; a copy if it is vLLM's shared empty one)
    carrying ``failed``, if any."""
    if failed:
        output = copy.copy(output)  # vLLM returns one EMPTY_MODEL_RUNNER_OUTPUT for all
        setattr(output, FAILED_ATTRIBUTE, failed)
    return output


def _runner_step(original: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        from vllm_afd.attention.session import current

        session = current()
        if session is None:  # no FFN group in this process
            return original(self, *args, **kwargs)
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        requests = None
        if kwargs.get("dummy_run"):  # the V2 runner's dummy run (W3): placeholder requests
            requests = ()
        elif hasattr(scheduler_output, "total_num_scheduled_tokens"):  # not sample_tokens
            session.periods.started(time.perf_counter(), decode_step(scheduler_output))
            requests = scheduler_output.num_scheduled_tokens  # request id -> tokens
        with session.step(self, requests):
            return _with_failures(session, original(self, *args, **kwargs))

    return wrapper


def decode_step(scheduler_output) -> tuple[int, int] | None:
    """``(requests, context tokens)`` of a step that only decodes (each request one token,
    plus its draft tokens under speculative decoding); ``None`` for any other step (a
    prefill, a chunk of one, an empty step, ``sample_tokens``' argument)."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not scheduled or scheduler_output.scheduled_new_reqs:
        return None
    drafts = sum(len(t) for t in scheduler_output.scheduled_spec_decode_tokens.values())
    total = scheduler_output.total_num_scheduled_tokens
    if total != len(scheduled) + drafts:
        return None
    computed = scheduler_output.scheduled_cached_reqs.num_computed_tokens
    return len(scheduled), sum(computed) + total


def _dummy_step(original: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        from vllm_afd.attention.session import current

        session = current()
        if session is None:
            return original(self, *args, **kwargs)
        with session.step(None):
            return original(self, *args, **kwargs)

    return wrapper


def _scheduler_update(original: Callable) -> Callable:
    def wrapper(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, FAILED_ATTRIBUTE, None)
        if failed:
            fail_requests(self, model_runner_output, failed)
        return original(self, scheduler_output, model_runner_output)

    return wrapper


def fail_requests(scheduler, output, failed: dict[str, str]) -> None:
    """W2: finish the ``failed`` requests of the step ``output`` with an error (below)."""
    errors = scheduler.grammar_compile_error_reqs  # finished with FINISHED_ERROR in the update
    for request_id, text in failed.items():
        index = output.req_id_to_index.get(request_id)
        if index is not None and index < len(output.sampled_token_ids):
            output.sampled_token_ids[index] = []
        if request_id not in scheduler.requests:
            continue  # aborted meanwhile
        blocks = scheduler.kv_cache_manager.get_block_ids(request_id)
        scheduler.kv_cache_manager.evict_blocks({b for group in blocks for b in group})
        errors.add(request_id)
        logger.error("AFD: request %s failed: an FFN rank fails its tokens: %s", request_id, text)


def apply() -> None:
    """W1, W2 and W3 (idempotent)."""
    for patch in ("W1", "W2", "W3"):
        check_unwrapped(patch)
    wrap("W1", _runner_step)
    wrap("W2", _scheduler_update)
    wrap("W3", _dummy_step)
