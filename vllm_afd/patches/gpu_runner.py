"""Worker, GPUs only, G1 and G2 (ledger in ``__init__``): a replayed FULL CUDA graph announces
its step; vLLM's DBO globals the AFD op reads are checked. NOT YET RUN ON A GPU."""

from __future__ import annotations

from collections.abc import Callable

from vllm_afd.patches.base import check_unwrapped, wrap


def _replay_announces(run_fullgraph: Callable) -> Callable:
    def run(self, desc, *args, **kwargs):
        from vllm_afd.attention.session import current
        from vllm_afd.attention.steps import replay_ubatch_tokens

        session = current()
        if session is not None:  # its AFD kernels run without the op's Python: announce here
            session.begin_step(replay_ubatch_tokens(desc.num_tokens, desc.num_ubatches), ())
        return run_fullgraph(self, desc, *args, **kwargs)

    return run


def apply() -> None:
    """G1 and G2 on a GPU platform (idempotent); nothing on the CPU build."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    check_unwrapped("G1")
    check_unwrapped("G2")
    wrap("G1", _replay_announces)
