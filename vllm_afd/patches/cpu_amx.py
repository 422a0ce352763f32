"""All processes that run vLLM's CPU kernels, S3: ask Linux for the AMX tile state first
(ledger in ``__init__``).

Linux (5.16+) hands a process the AMX tile registers only after it asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); an AMX instruction before that is
an illegal instruction. vLLM's CPU build picks its AMX kernels from the CPU's capability alone
(``torch.cpu._is_amx_tile_supported()``: the bfloat16 attention ISA ``amx`` in
``v1/attention/backends/cpu_attn.py``, ``X86CPUUnquantizedExperts``, ``CPUExpertsFp8``, the
AMX MLA backend) and never asks; it works where something else in the process asked first
(oneDNN does, for its own AMX matmuls), and dies with SIGILL where nothing did: on the
development machine every bfloat16 model, colocated too, died in its first attention call.

``apply()`` asks once per process, through PyTorch's own request (``torch._C._cpu._init_amx``,
the ``arch_prctl`` call above), on CPUs that report AMX tiles only. Asking changes nothing
else: the kernels vLLM picks are the same, they just run.
"""

from __future__ import annotations

import logging

import torch

from vllm_afd.patches.base import check_unwrapped

logger = logging.getLogger("vllm.afd")
_DONE = False


def apply() -> None:
    """Request the AMX tile state for this process if the CPU has AMX (idempotent)."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    check_unwrapped("S3")
    if not torch.cpu._is_amx_tile_supported():
        return
    if not torch._C._cpu._init_amx():
        logger.warning(
            "AFD patch S3: the kernel refused this process the AMX tile state; vLLM's AMX "
            "kernels (bfloat16 CPU attention and MoE) will fail with an illegal instruction"
        )
