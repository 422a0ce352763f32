"""vllm-afd: Attention-FFN Disaggregation as a one-flag deployment mode of vLLM.

Start-up, in the front-end: ``config`` (``AFDConfig``: the flags, declared once;
``check_supported``) and ``envs`` (every ``VLLM_AFD_*`` variable) -> ``deployment`` (validate,
then start the FFN group before vLLM's engines) -> ``placement`` (the FFN ranks as Ray actors).

One token, on the data path: ``attention/`` (the worker's session, the step announced, the
hook at the routing boundary, the round trip) -> ``microbatch`` (ping-pong overlap point) ->
``transport/`` (the ``endpoint``'s dispatch and combine over the slot plane, ``slots``/
``slot_plane``, on shared memory, NIXL or device memory) -> ``ffn/`` (``executor`` serve loop
and ``ExpertKernel``; ``weights`` at start-up) -> back through ``transport/`` into the model.
``metrics/`` is the sink both sides record into.

Around it: ``patches/`` (every touch of a vLLM internal, by process, with its ledger),
``planner/`` (the A:F model; ``calibrate`` and ``auto_ratio`` connect it to running vLLM),
``bench/`` (demo, offline runs, A/B harness, tiny models), ``cli`` (``vllm-afd``), ``host``
(processes, CPUs and ``/dev/shm`` segments of this host), ``testing/`` (reference FFN ranks,
the slot plane's device check).

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
