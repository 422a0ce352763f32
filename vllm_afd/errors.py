"""Every error the product raises on purpose, in one place: configuration errors (before
anything starts) and transport errors (a request that cannot be answered). No module needs
another stage's module for an exception type; callers classify errors by type, never by their
message text (``metrics/recorder.error_kind``).
"""

from __future__ import annotations


class AFDConfigError(ValueError):
    """Invalid AFD configuration. The message names the flag and what is allowed."""


class TransportError(RuntimeError):
    """An FFN rank did not answer: it died, or it did not answer within the timeout."""


class FFNRankLost(TransportError):
    """An FFN rank is gone: its process died or closed its endpoint, or its connection broke.

    Unlike a timeout or an error answer, this is what failover recovers from: the attention
    side waits for the rank's replacement (``transport/directory.py``) and sends it the
    requests the lost rank had not answered (``transport/endpoint.py``).
    """

    def __init__(self, ffn_rank: int, message: str, incarnation: int | None = None) -> None:
        super().__init__(message)
        self.ffn_rank = ffn_rank
        #: The incarnation of the rank that was lost, where the attention side knows it (a
        #: loss of one already replaced is not recovered from again).
        self.incarnation = incarnation


class FFNTimeout(TransportError):
    """An FFN rank, alive as far as the attention side can tell, did not answer within
    ``TransportSpec.timeout_s``."""


class FFNServeError(TransportError):
    """An FFN rank answered a request with an error: serving it raised there. The message
    names the FFN rank and carries its error text."""


class ProtocolError(TransportError):
    """A message whose tag disagrees with its sender's schedule, or an answer whose tag is not
    its request's (``transport/control.py``). The message names both sides."""


class StepsFailed(TransportError):
    """The device's waits (a kernel cannot raise) recorded a failure in steps already run:
    ``steps``, the step numbers whose outputs it may have spoiled; ``cause``, what ended the
    waits (an ``FFNRankLost`` the watchdog saw, or the failed waits' ``FFNTimeout``). Raised
    when the next step is announced; the attention session fails those steps' requests and
    announces its step again (``attention/failures.py``)."""

    def __init__(self, cause: TransportError, steps: range) -> None:
        super().__init__(f"{cause} (steps {steps.start}-{steps.stop - 1})")
        self.cause = cause
        self.steps = steps
