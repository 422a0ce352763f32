"""Front-end, P1-P3: the AFD flags on vLLM's parser, folded into ``additional_config``, and
the deployment hook around ``EngineArgs.create_engine_config``; front-end and engine core, M6:
vLLM's validation of a config in which AFD microbatches (ledger in ``__init__``)."""

from __future__ import annotations

from vllm_afd.patches.base import wrap


def _add_cli_args(original):
    from vllm_afd.config import add_afd_flags

    def wrapper(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        add_afd_flags(parser)
        return parser

    return wrapper


def _from_cli_args(original):
    from vllm_afd.config import merge_afd_flags

    def wrapper(cls, args):
        engine_args = original(cls, args)
        merge_afd_flags(args, engine_args)
        return engine_args

    return wrapper


def _create_engine_config(original):
    def wrapper(self, usage_context=None, *args, **kwargs):
        from vllm_afd.deployment import prepare_engine_args, setup_afd

        prepare_engine_args(self, usage_context)
        vllm_config = original(self, usage_context, *args, **kwargs)
        setup_afd(vllm_config)
        return vllm_config

    return wrapper


#: The all-to-all backend vLLM's validation is shown for an AFD config that microbatches (M6):
#: the one whose receive-hook protocol the AFD op follows under DBO.
VALIDATED_ALL2ALL = "deepep_low_latency"


def _post_init(original):
    """M6: vLLM validates (and every engine core re-validates) a config in which AFD
    microbatches as one whose MoE layers run over a DeepEP all-to-all; an AFD attention rank
    runs none (its routed experts go through the AFD transport)."""
    from vllm_afd.config import afd_section

    def wrapper(self, *args, **kwargs):
        parallel = self.parallel_config
        if not (parallel.use_ubatching and afd_section(self.additional_config) is not None):
            return original(self, *args, **kwargs)
        chosen = parallel.all2all_backend
        parallel.all2all_backend = VALIDATED_ALL2ALL
        try:
            return original(self, *args, **kwargs)
        finally:
            parallel.all2all_backend = chosen

    return wrapper


def apply() -> None:
    """P1-P3 and M6 (idempotent)."""
    wrap("P1", _add_cli_args)
    wrap("P2", _from_cli_args)
    wrap("P3", _create_engine_config)
    wrap("M6", _post_init)
