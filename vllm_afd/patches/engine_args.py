"""Front-end, P1-P3: the AFD flags on vLLM's parser, folded into ``additional_config``, and
the deployment hook around ``EngineArgs.create_engine_config`` (ledger in ``__init__``)."""

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


def apply() -> None:
    """P1-P3 (idempotent)."""
    wrap("P1", _add_cli_args)
    wrap("P2", _from_cli_args)
    wrap("P3", _create_engine_config)
