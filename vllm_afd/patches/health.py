"""Front-end, P4: ``/health`` fails as soon as an FFN rank is lost beyond what failover heals
(ledger in ``__init__``)."""

from __future__ import annotations

from vllm_afd.patches.base import wrap


def _check_health(original):
    async def wrapper(self, *args, **kwargs):
        from vllm_afd.deployment import raise_if_ffn_group_dead

        raise_if_ffn_group_dead()
        return await original(self, *args, **kwargs)

    return wrapper


def apply() -> None:
    """P4 (idempotent)."""
    wrap("P4", _check_health)
