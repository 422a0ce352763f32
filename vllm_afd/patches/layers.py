"""Worker, P5, P7 and P8: AFD's ``RoutedExperts`` replaces vLLM's (ledger in ``__init__``).

P5 is vLLM's supported out-of-tree layer registration. P7 is the private method that
``AFDRoutedExperts`` (vllm_afd/remote_experts.py) overrides, and P8 the module global it reads
to keep a speculative draft's experts local; nothing is patched for them here, but ``apply``
checks that vLLM still has them as the override expects: a renamed method would otherwise
leave AFD silently off, a renamed global would send a draft's tokens to the target's experts.
"""

from __future__ import annotations

from vllm_afd.patches.base import check_unwrapped


def apply() -> None:
    """P5: register ``AFDRoutedExperts`` (idempotent); check P5's, P7's and P8's targets."""
    check_unwrapped("P5")
    check_unwrapped("P7")
    check_unwrapped("P8")
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_afd.remote_experts import AFDRoutedExperts

    if "RoutedExperts" not in op_registry_oot:
        RoutedExperts.register_oot(AFDRoutedExperts)
