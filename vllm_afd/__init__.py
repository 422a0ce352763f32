"""vllm-afd: Attention-FFN Disaggregation as a one-flag deployment mode of vLLM.

Read the package in data-path order:

- ``envs``: every ``VLLM_AFD_*`` variable, typed and read lazily.
- ``config``: ``AFDConfig`` (the flags), ``AFDConfig.of(vllm_config)``, ``check_supported``.
- ``deployment``: front-end glue, validate and start the FFN group before vLLM's engines.
- ``placement``: the FFN group of Ray actors.
- ``transport/``: dispatch and combine between attention and FFN ranks (shm, tcp, deepep).
- ``ffn/``: the FFN ranks: expert weights, kernels, the serve loop.
- ``remote_experts``: the hook at the routing boundary on attention ranks.
- ``microbatch``: ping-pong microbatches overlapping attention with the FFN stage.
- ``metrics/``: per-layer stats blocks and the ``/metrics`` collector.
- ``patches/``: every touch of a vLLM internal, by process, with its ledger.
- ``planner/``: the A:F ratio model (pure; no vLLM).
- ``bench/``: A/B harness, demo and offline runs (tools).

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process,
possibly many times.
"""

from __future__ import annotations

__version__ = "0.1.0"
_REGISTERED = False


def register() -> None:
    """Apply every patch group (idempotent, lazy: nothing is imported before vLLM asks)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm_afd import patches

    patches.apply()
    _REGISTERED = True
