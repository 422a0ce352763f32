"""The attention side's recorder: one stats block per attention process, behind functions.

An attention rank (a vLLM worker process) records each MoE round trip from the hook at the
routing boundary (``attention/exchange.py``): the hook takes its block once (``endpoint_block``)
and records each combine straight into it, and its session times decode steps into it
(``attention.session.StepPeriods``); ``record_error`` with ``error_kind`` counts a failure. The
module owns the process's block, created for the deployment in ``VLLM_AFD_RUNTIME`` (or the
endpoint's spec) and replaced when the FFN group restarts; a block that cannot be created
disables the metrics of this process (logged), never serving.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence

from vllm_afd import envs
from vllm_afd.metrics.blocks import AttentionStatsBlock, spec_fields

logger = logging.getLogger("vllm.afd")


#: The current attention block of this process: (FFN addresses, rank, block or None when it
#: could not be created). One at a time: a new deployment or rank closes the previous one.
_ATTENTION: tuple[tuple[str, ...], int, AttentionStatsBlock | None] | None = None
#: (VLLM_AFD_RUNTIME text, its addresses) last parsed by ``attention_block``.
_RUNTIME: tuple[str, tuple[str, ...]] | None = None


def attention_block_for(addresses: Sequence[str], rank: int) -> AttentionStatsBlock | None:
    """This process's block as attention rank ``rank`` of the deployment whose FFN ranks have
    these ``addresses``: created on first use; ``None`` if it cannot be (logged, metrics never
    break serving)."""
    global _ATTENTION
    addresses = tuple(addresses)
    current = _ATTENTION
    if current is not None and current[1] == rank and current[0] == addresses:
        return current[2]
    if current is not None and current[2] is not None:
        current[2].close()
    block = None
    try:
        block = AttentionStatsBlock(addresses, rank)
    except Exception as exc:  # noqa: BLE001
        logger.warning("AFD metrics disabled for attention rank %d: %s", rank, exc)
    _ATTENTION = (addresses, rank, block)
    return block


def attention_block(rank: int) -> AttentionStatsBlock | None:
    """``attention_block_for`` the deployment in ``VLLM_AFD_RUNTIME`` (``None`` while unset)."""
    global _RUNTIME
    key = envs.VLLM_AFD_RUNTIME
    if key is None:
        return None
    runtime = _RUNTIME
    if runtime is None or runtime[0] != key:
        try:
            runtime = _RUNTIME = (key, spec_fields(key)[0])
        except (ValueError, KeyError, TypeError):
            return None
    current = _ATTENTION
    if current is not None and current[0] == runtime[1] and rank == current[1]:
        return current[2]
    return attention_block_for(runtime[1], rank)


def endpoint_block(endpoint) -> AttentionStatsBlock | None:
    """This process's block for ``endpoint`` (an ``AttentionTransport``), with the wire bytes
    per token of its spec: the session takes it when it connects (and again after a switch to
    a new FFN pool) and records each combine straight into it. A new endpoint (the FFN group
    restarted) gets the new deployment's block."""
    from vllm_afd.transport import backend

    spec = endpoint.spec
    block = attention_block_for(spec.addresses, endpoint.rank)
    if block is not None:
        block.bytes_per_token = backend(spec.backend).round_trip_bytes(spec, 1)
    return block


def record_error(kind: str, rank: int) -> None:
    """Count a transport failure on attention rank ``rank``: ``timeout``, ``ffn_dead``,
    ``ffn_error`` (the FFN rank failed serving the request) or
    ``other`` (unknown kinds count as ``other``)."""
    block = attention_block(rank)
    if block is not None:
        block.record_error(kind)


def error_kind(exc: BaseException) -> str:
    """Classify a transport exception for ``record_error`` by its type."""
    from vllm_afd.errors import FFNServeError, FFNTimeout, TransportError

    if isinstance(exc, FFNServeError):
        return "ffn_error"
    if isinstance(exc, FFNTimeout):
        return "timeout"
    return "ffn_dead" if isinstance(exc, TransportError) else "other"


def close_attention_block() -> None:
    """Close (and unlink) this process's attention block, if any."""
    global _ATTENTION
    current, _ATTENTION = _ATTENTION, None
    if current is not None and current[2] is not None:
        current[2].close()


atexit.register(close_attention_block)
