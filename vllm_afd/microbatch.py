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
float32 outputs are token-identical to colocated serving (tests/e2e/test_offline.py;
also checked by hand for k = 3 with one-token microbatches, TP = 2, and Dynamo-compiled mode):
this rests on the CPU kernels giving each row the same result whatever rows are batched with it.

Which steps are split: decode steps of at least k requests, every request decoding one token
or, with speculative decoding, verifying its draft (up to 1 + d tokens; an n-gram drafter's
requests differ in d, and a microbatch boundary may fall inside one request's verify tokens,
whose attention then runs in two parts, the first part's KV written before the second reads
it). Prefill and mixed steps, dummy and profiling runs run whole; so does the drafter's own
forward (an EAGLE head, a draft model).

This module is the mechanism only (no vLLM or package imports). Its hooks into vLLM's CPU
model runner, and their ledger entries M1-M7, are in vllm_afd/patches/ (cpu_runner.py).

On GPUs, ``--afd-microbatches 2`` turns on vLLM's own DBO instead
(``deployment._fit_gpu_engine_args``, the V2 model runner): ``current_microbatch`` is the
ubatch id, and the op yields twice per MoE layer with a receive hook, as vLLM's own MoE kernels
do (``attention.exchange.dbo_exchange``).

Limits (CPU): V1 model runner only (the V2 runner is refused); no LoRA, multimodal or M-RoPE models,
pooling models; with DP > 1 an idle rank's dummy batch vetoes microbatching for that step, and
vLLM's own cross-rank decision splits only uniform decode steps. k = 2 pays only when one
microbatch's FFN stage is at least about as long as its attention stage, since every layer's
host work runs once per microbatch (measurements: docs/benchmarks.md). Each microbatch thread
drives its own OpenMP team; with several OpenMP threads per attention rank, an idle team
spinning (KMP_BLOCKTIME, GOMP_SPINCOUNT) competes with the active one: prefer a passive wait
policy there.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_LOCAL = threading.local()
#: Seconds ``PingPong.close`` waits for each idle thread to exit.
_JOIN_TIMEOUT_S = 5.0


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


def vllm_dbo() -> types.ModuleType | None:
    """vLLM's ``ubatching`` module while its DBO runs a microbatched step (GPUs), else
    ``None`` (ledger G2)."""
    ubatching = sys.modules.get("vllm.v1.worker.ubatching")  # never imported: DBO is off
    return ubatching if ubatching is not None and ubatching.dbo_enabled() else None


def current_microbatch() -> int | None:
    """Index of the microbatch running on this thread, or None outside a microbatch (under
    vLLM's DBO on GPUs: its ubatch id)."""
    slot = getattr(_LOCAL, "slot", None)
    if slot is not None and slot[0]._step is not None:
        return slot[1]
    ubatching = vllm_dbo()
    return None if ubatching is None else ubatching.dbo_current_ubatch_id()


def overlap_point() -> None:
    """Between ``dispatch`` and ``combine``: let the other microbatches run meanwhile.

    A no-op outside a microbatched step. Under vLLM's own DBO (GPUs) it is ``dbo_yield``.
    """
    slot = getattr(_LOCAL, "slot", None)
    if slot is not None:
        if slot[0]._step is not None:
            slot[0].yield_(slot[1])
        return
    ubatching = vllm_dbo()
    if ubatching is not None:
        ubatching.dbo_yield()
