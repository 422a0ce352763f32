"""vllm-afd: Attention-FFN Disaggregation as a one-flag deployment mode of vLLM.

Read the data path in this order: config -> placement -> transport -> ffn_executor ->
attention (the hook at the routing boundary) -> planner. ``register`` is the
``vllm.general_plugins`` entry point: vLLM calls it in every process, possibly many times.
"""

from __future__ import annotations

__version__ = "0.1.0"
_REGISTERED = False


def register() -> None:
    """Install the AFD flags, the deployment hook and the layer swap (idempotent, lazy)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm_afd import patches

    patches.apply_all()
    _REGISTERED = True
