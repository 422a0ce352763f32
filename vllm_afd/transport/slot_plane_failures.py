"""How the slot plane's device waits fail (``RecordedWaits``): a wait cannot raise (a kernel),
so one that ends without its answer records its use's value in a word of host memory, and the
host raises it where it looks anyway, without a device sync: where a step's sampled tokens are
ready (``check_through``, W1) and at the next announcement (``check``). Shared by
``CudaPlaneMemory`` and the CPU stand-in (``HostPlaneMemory`` with ``device_waits``); the
protocol itself is ``slot_plane.py``.
"""

from __future__ import annotations

import threading

import torch

from vllm_afd.errors import FFNTimeout, StepsFailed, TransportError
from vllm_afd.transport.slot_plane import ABORT_ALL, POSITION_BITS, _words, value_use


class RecordedWaits:
    """The device's way to fail a wait, shared by ``CudaPlaneMemory`` and ``HostPlaneMemory``
    with ``device_waits``: a wait cannot raise (a kernel), so one that ends without its
    answer (gave up, an error answer, a peer that moved on, ``abort``) records its use's value
    in ``errors`` (the largest so far), and ``check()`` reads it at the next step boundary and
    raises. ``errors`` lies in host memory (pinned on GPUs, written by the device through the
    same address), so that read is no device sync: the host may be a step ahead of the device
    (vLLM's async scheduling), and a failure is raised at the first check after its wait
    ended, once per failure (a check covers every step announced before it).

    A dead peer must not cost every remaining wait of a step its whole bound: a host watchdog
    that sees it die calls ``abort``, which ends every wait polling ``aborted`` (host memory,
    every wait polls it) at once; the next ``check(step)`` raises why (``StepsFailed``) and
    leaves the waits of earlier steps aborted, since the device may still be running them, and
    those of ``step`` and later ones waiting.

    The attention side learns a failure sooner where the host knows a step's device work is
    done: vLLM synchronizes on each step's sampled tokens before they leave the worker, and
    there ``check_through(step)`` raises for the failed waits of that step and earlier ones,
    so that their requests fail before a token of theirs reaches a client. That read may run
    on another thread than the announcements (vLLM's async output thread): the raise-once
    bookkeeping is under a lock."""

    #: Its waits record where they fail (``check`` raises) instead of raising.
    records_waits = True
    #: The largest use's value of a wait that ended without its answer (host memory, int64
    #: [1]; 0: none).
    errors: torch.Tensor
    #: A wait whose use's value is at most this ends at once, failed (host memory, int64 [1]).
    aborted: torch.Tensor
    #: What a wait gives up after, for the message (``"30 s"``, ``"67108864 polls"``).
    bound: str
    _reason: TransportError | None = None
    #: The largest use's value a raise covered.
    _raised = 0
    #: Steps the host may run ahead of the device: a failed wait of step S - 1 - ``lag``
    #: may be seen only at step S's check.
    lag = 0
    #: Held by ``abort``, ``check`` and ``check_through`` (the watchdog's thread, the
    #: announcing one, vLLM's output thread).
    _lock: threading.Lock
    _failed_word: memoryview

    def _record_failures(self, errors: torch.Tensor, aborted: torch.Tensor, bound: str) -> None:
        """Set up the failed waits' word ``errors``, the abort word ``aborted`` (both host
        memory, int64 [1], zeroed) and the bound text."""
        self.errors, self.aborted, self.bound = errors, aborted, bound
        self._failed_word = _words(errors)  # read at each check: a fraction of ``int(errors[0])``
        self._lock = threading.Lock()

    def abort(self, reason: TransportError) -> None:
        """End every wait now and until the next ``check``, which raises ``reason``."""
        with self._lock:
            self._reason = reason
            self.aborted.fill_(ABORT_ALL)  # host memory: a plain store, read by the waits

    def check_through(self, step: int) -> None:
        """``step``'s device work is done (vLLM synchronized on its sampled tokens): raise
        ``StepsFailed`` naming the steps up to ``step`` whose outputs a failure may have
        spoiled (at most ``lag`` + 1 back, since the last raise) if a wait of one of them
        ended without its answer, or the watchdog aborted, since the last raise; the raise
        covers every use of those steps. A watchdog's reason stays for the next ``check``,
        the announcement, which replaces a lost FFN rank before it raises (for the steps
        after ``step`` only)."""
        with self._lock:
            failed = self._failed_word[0]  # host memory: no device sync
            last = ((step + 1) << POSITION_BITS) - 1  # the last use of ``step``
            first = (self._raised + 1) >> POSITION_BITS  # the first step no raise covered
            if first > step:
                return
            reason = self._reason
            if reason is None and not self._raised < failed <= last:
                return
            self._raised = last
        raise StepsFailed(
            reason or self._failed_wait(failed), range(max(first, step - self.lag, 1), step + 1)
        )

    def check(self, step: int | None = None) -> None:
        """Raise what ended a wait since the last raise: the watchdog's reason, or a wait
        that ended without its answer. ``step``: the step about to be announced (the
        attention side's check): it raises ``StepsFailed`` naming the steps the failure may
        have spoiled (those since the last raise, at most ``lag`` + 1 back), and a raise
        covers every use before ``step``, whose waits stay aborted. Without one (the FFN side,
        aborted only by its ``interrupt`` as it stops) it raises the cause, covers what it
        read, and ``abort`` ends."""
        with self._lock:
            failed = self._failed_word[0]  # host memory: no device sync
            reason, self._reason = self._reason, None
            if reason is None and failed <= self._raised:
                return
            first = (self._raised + 1) >> POSITION_BITS  # the first step no raise covered
            self._raised = max(failed, self._raised)
            cause = reason or self._failed_wait(failed)
            if step is None:
                if reason is not None:
                    self.aborted.fill_(0)
                raise cause
            self._raised = max(self._raised, (step << POSITION_BITS) - 1)
            if reason is not None:
                self.aborted.fill_((step << POSITION_BITS) - 1)
        raise StepsFailed(cause, range(max(first, step - 1 - self.lag, 1), step))

    def _failed_wait(self, failed: int) -> FFNTimeout:
        """The error of the failed use ``failed`` (its value)."""
        failed_step, position = value_use(failed)
        return FFNTimeout(
            f"slot plane: a wait of step {failed_step} (layer position {position}) ended "
            f"without its answer (given up after {self.bound}, an error answer, or a peer "
            "that moved on)"
        )


__all__ = ["RecordedWaits"]
