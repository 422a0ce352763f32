"""Worker, P5, P7, P8 and W4: AFD's ``RoutedExperts`` replaces vLLM's, and the worker opens
its attention session (ledger in ``__init__``).

P5 is vLLM's supported out-of-tree layer registration. P7 is the private method that
``AFDRoutedExperts`` (vllm_afd/attention/layer.py) overrides, and P8 the module global it reads
to keep a speculative draft's experts local; nothing is patched for them here, but ``apply``
checks that vLLM still has them as the override expects: a renamed method would otherwise
leave AFD silently off, a renamed global would send a draft's tokens to the target's experts.
W4 opens the worker's ``AttentionSession`` (attention/session.py) when vLLM's worker loads the
model, before any layer is built or run.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_afd.patches.base import check_unwrapped, wrap


def _opens_session(load_model: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        from vllm_afd.config import AFDConfig

        if AFDConfig.of(self.vllm_config) is not None:
            from vllm_afd.attention.session import open_session

            open_session()  # the front-end started the FFN group before any worker
        return load_model(self, *args, **kwargs)

    return wrapper


def apply() -> None:
    """P5: register ``AFDRoutedExperts``; W4 (idempotent); check P5's, P7's and P8's
    targets."""
    check_unwrapped("P5")
    check_unwrapped("P7")
    check_unwrapped("P8")
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_afd.attention.layer import AFDRoutedExperts

    if "RoutedExperts" not in op_registry_oot:
        RoutedExperts.register_oot(AFDRoutedExperts)
    wrap("W4", _opens_session)
