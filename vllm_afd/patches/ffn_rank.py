"""FFN rank, F1-F4: build an FFN rank's MoE layers as one rank of an expert-parallel group of
the F FFN ranks, without that group existing (ledger in ``__init__``).

vLLM decides an MoE layer's expert placement while it builds the layer, from the process's
parallel state: ``make_parallel_config`` reads the TP/DP/EP groups, ``ExpertMapManager`` turns
the result into an ``expert_map`` (global -> local expert id, -1 elsewhere), and some models'
loaders ask the EP group directly which experts are theirs. An FFN rank runs in a world of one
process (its peers are the other FFN ranks, which never talk to each other: the attention side
sums their partial answers), so ``expert_parallel_placement`` makes the layers built inside it
see EP rank ``rank`` of ``size`` instead:

F1 ``make_parallel_config`` returns the stock config with ``tp = 1`` and ``ep = (rank, size)``.
F2 ``ExpertMapManager.__init__`` runs under the rank's real device: the model is built on the
   ``meta`` device so that nothing but the routed experts is ever allocated, but the expert map
   is data (its constructor calls ``nonzero()``), which ``meta`` cannot hold.
F3 ``parallel_state._EP`` is a stand-in with the EP group's rank and size (never used for
   communication), and the engine config says expert parallelism is on, for the models whose
   loaders read them (gpt-oss, Llama-4).

Everything is restored on exit, so the process's vLLM state is stock outside the block. With
``size == 1`` nothing is swapped: the layers are exactly those of a colocated single rank.
F4 lists the vLLM functions an FFN rank uses as they are (``vllm_afd/ffn/weights.py``), so that
a vLLM upgrade that reshapes them fails the compatibility test, not a deployment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

from vllm_afd.patches.base import check, targets


@contextlib.contextmanager
def _swapped(patch: str, make: Any) -> Iterator[None]:
    """Replace the one row of ``patch`` with ``make(original)`` for the block, then restore."""
    (target,) = targets(patch)
    owner, original = target.resolve()
    check(target)
    setattr(owner, target.name, make(original))
    try:
        yield
    finally:
        setattr(owner, target.name, original)


def _parallel_config(rank: int, size: int):
    def make(original):
        def make_parallel_config(*args, **kwargs):
            base = original(*args, **kwargs)
            return dataclasses.replace(
                base, tp_size=1, tp_rank=0, ep_size=size, ep_rank=rank, use_ep=True
            )

        return make_parallel_config

    return make


def _map_on(device: str):
    def make(original):
        def __init__(self, *args, **kwargs):
            import torch

            with torch.device(device):
                original(self, *args, **kwargs)

        return __init__

    return make


def _ep_group(rank: int, size: int):
    """A stand-in for the EP ``GroupCoordinator``: rank and size only, no communication."""
    device_group = types.SimpleNamespace(size=lambda: size, rank=lambda: rank)
    group = types.SimpleNamespace(
        world_size=size,
        rank_in_group=rank,
        rank=rank,
        ranks=list(range(size)),
        local_rank=0,
        device_group=device_group,
        cpu_group=device_group,
        unique_name="afd_ffn_ep",
    )
    return lambda original: group


@contextlib.contextmanager
def expert_parallel_placement(vllm_config, rank: int, size: int, device: str) -> Iterator[None]:
    """MoE layers built (and loaded) inside hold EP rank ``rank`` of ``size``'s experts.

    ``vllm_config`` is the FFN rank's own engine config: its ``enable_expert_parallel`` is set
    for the block (F3). Not thread-safe (it swaps module globals): build one rank at a time.
    """
    if size == 1:
        yield
        return
    parallel = vllm_config.parallel_config
    saved = parallel.enable_expert_parallel
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped("F1", _parallel_config(rank, size)))
        stack.enter_context(_swapped("F2", _map_on(device)))
        stack.enter_context(_swapped("F3", _ep_group(rank, size)))
        parallel.enable_expert_parallel = True
        stack.callback(setattr, parallel, "enable_expert_parallel", saved)
        yield
