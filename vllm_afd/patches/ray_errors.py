"""Front-end, R1 (ledger in ``__init__``): Ray's report of the death of an FFN rank that a
failover supervisor watches stays out of the server's log; the plugin's own lines say what
happened (``AFD: FFN rank R (pid P) died; replacing it``, ``... replaced in X s``)."""

from __future__ import annotations

import re
from collections.abc import Callable

from vllm_afd.patches.base import wrap

#: How the raylet names the worker in its report of one that died.
_WORKER_PID = re.compile(r"Worker PID: (\d+)")


def reports_a_supervised_death(data: dict, is_supervised: Callable[[int], bool]) -> bool:
    """``data`` (what Ray's driver prints for the raylet) reports the death of a worker whose
    pid ``is_supervised``."""
    if data.get("pid") != "raylet":
        return False
    for line in data.get("lines", ()):
        found = _WORKER_PID.search(str(line))
        if found is not None and is_supervised(int(found.group(1))):
            return True
    return False


def apply(is_supervised: Callable[[int], bool]) -> None:
    """R1, once per process (the first ``is_supervised`` stays)."""

    def make(original: Callable) -> Callable:
        def print_to_stdstream(data, ignore_prefix, *args, **kwargs):
            if reports_a_supervised_death(data, is_supervised):
                return None
            return original(data, ignore_prefix, *args, **kwargs)

        return print_to_stdstream

    wrap("R1", make)
