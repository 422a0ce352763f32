"""Every process, E1: vLLM knows the ``VLLM_AFD_*`` variables (ledger in ``__init__``).

vLLM checks every ``VLLM_*`` variable of the environment against ``vllm.envs``'s table when it
builds a config (``Platform.validate_environ``): an unknown one is a warning, and with
``--fail-on-environ-validation`` a refusal to start. The table is where vLLM expects its
variables to be declared, so the plugin adds its own there. vLLM reads every entry when it
caches the table (``enable_envs_cache``), so each one returns the raw text: the typed,
validated reading stays in ``vllm_afd.envs``, where a bad value is refused naming the variable
before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm_afd.patches.base import check, targets


def _raw(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


def apply() -> None:
    """E1 (idempotent: an entry already there is left as it is)."""
    from vllm_afd import envs

    (target,) = targets("E1")
    table = check(target)
    for name in envs.environment_variables:
        table.setdefault(name, _raw(name))
