"""Worker, S1-S2: CPU communicator shims that let colocated data parallelism and wide EP run
on vLLM's CPU build, the baseline the A/B harness compares AFD against (ledger in ``__init__``).

S1 ``all_gatherv`` packs a list of tensors row-wise into one byte tensor (one collective
instead of one per tensor), pads every rank's rows to the largest size, runs the
communicator's own equal-size ``all_gather`` (gloo for the DP/EP groups) and slices the padding
back out. ``reduce_scatterv`` sums the whole tensor with the communicator's ``all_reduce`` and
keeps this rank's slice. Both are exact (float32 outputs are token-identical to a single rank)
and cost a copy or two, which is nothing at CPU test sizes; the collectives themselves (gloo
over loopback) are what costs. Nothing is patched once vLLM implements them on
``CpuCommunicator`` itself.

S2 (expert-parallel layers only: their experts get their own ``apply``; the stock path is left
alone) maps global routing ids to local ones through ``expert_map`` and zeroes the weights of
experts held elsewhere (pointing them at local expert 0, which then adds exactly 0), then calls
the CPU kernel without the map. The cross-rank sum (reduce-scatter or all-reduce) completes the
output, exactly for top-2 routing (a + 0 = a and a + b = b + a).

``apply()`` is idempotent and cheap; it must run in every vLLM process that
executes the model (workers, engine cores), which ``vllm_afd.patches.apply`` does: vLLM loads
general plugins in each of its processes. A no-op without vLLM's CPU modules (a CUDA install).
"""

from __future__ import annotations

import types

import torch

from vllm_afd.patches.base import _SENTINEL, check_unwrapped, check_vllm_version, wrap


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ``[n, ...]`` zero-padded along dim 0 to ``[rows, ...]`` (same dtype/device)."""
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def unpad_gathered(gathered: torch.Tensor, sizes: list[int], padded: int) -> torch.Tensor:
    """Drop the padding of an equal-size gather: ``[W * padded, ...]`` -> ``[sum(sizes), ...]``."""
    parts = [gathered[r * padded : r * padded + n] for r, n in enumerate(sizes)]
    return torch.cat(parts)


def slice_for_rank(x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """Rows ``[sum(sizes[:rank]), + sizes[rank])`` of ``x`` along dim 0."""
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]].contiguous()


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """``all_gatherv`` over dim 0 for a tensor or a list of tensors (vLLM's contract)."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, (list, tuple)):
        packed = pack_rows(list(input_))
        return unpack_rows(_gather_one(self, packed, sizes), list(input_))
    return _gather_one(self, input_, sizes)


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors with the same row count ``n`` as one ``[n, total_row_bytes]`` uint8 tensor.

    One collective instead of one per tensor (hidden states, weights and ids travel together):
    on two shared cores every collective costs a round of scheduling both ranks.
    """
    n = tensors[0].shape[0]
    return torch.cat([t.contiguous().view(n, -1).view(torch.uint8) for t in tensors], dim=1)


def unpack_rows(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of ``pack_rows`` for ``packed.shape[0]`` rows shaped and typed like ``like``."""
    out, offset, n = [], 0, packed.shape[0]
    for t in like:
        width = t[:1].numel() * t.element_size()
        part = packed[:, offset : offset + width].contiguous().view(t.dtype)
        out.append(part.view(n, *t.shape[1:]))
        offset += width
    return out


def _gather_one(self, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    if sizes is None or all(s == sizes[0] for s in sizes):
        return self.all_gather(x.contiguous(), dim=0)
    assert len(sizes) == self.world_size and x.shape[0] == sizes[self.rank_in_group]
    padded = max(sizes)
    gathered = self.all_gather(pad_rows(x, padded), dim=0)
    return unpad_gathered(gathered, sizes, padded)


def _reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
    """Sum over ranks, then keep this rank's rows (``sizes`` rows each, or equal shares)."""
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(dim, 0).contiguous().clone()  # all_reduce works in place
    if sizes is None:
        assert x.shape[0] % self.world_size == 0
        sizes = [x.shape[0] // self.world_size] * self.world_size
    assert len(sizes) == self.world_size and x.shape[0] == sum(sizes)
    total = self.all_reduce(x)
    return slice_for_rank(total, sizes, self.rank_in_group).movedim(0, dim).contiguous()


def localize_expert_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global -> local ids through ``expert_map`` (-1: not local); foreign weights set to 0.

    Returns ``(ids, weights)`` in ``topk_ids``' and ``topk_weights``' dtypes; a foreign expert
    becomes local id 0 with weight 0, so it adds exactly nothing.
    """
    local = expert_map[topk_ids.long()]
    foreign = local < 0
    weights = topk_weights.masked_fill(foreign, 0)
    return local.masked_fill(foreign, 0).to(topk_ids.dtype), weights


def _apply_with_expert_map(original):
    """A CPU experts class's ``apply`` that translates the ids through ``expert_map`` first."""

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        *args,
        **kwargs,
    ):
        if expert_map is not None:
            topk_ids, topk_weights = localize_expert_ids(topk_ids, topk_weights, expert_map)
        return original(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            None,
            *args,
            **kwargs,
        )

    return apply


def _wrap_cpu_experts_init(original):
    # One wrapper for each CPU experts class of S2 (``patches/base.py``, ``_S2_EXPERTS``).
    """S2: an expert-parallel layer's experts get ``_apply_with_expert_map`` as their ``apply``;
    every other layer keeps vLLM's method untouched (no extra call on the stock path)."""

    def __init__(self, moe_config, *args, **kwargs):
        original(self, moe_config, *args, **kwargs)
        if moe_config.moe_parallel_config.use_ep:
            self.apply = types.MethodType(_apply_with_expert_map(type(self).apply), self)

    return __init__


def _install_expert_map() -> bool:
    """S2: make expert-parallel CPU experts (unquantized, FP8) honour ``expert_map``."""
    check_unwrapped("S2")
    wrap("S2", _wrap_cpu_experts_init)
    return True


def _needs_shim(cls: type) -> bool:
    """True while ``cls`` still inherits the raising base implementations."""
    return "all_gatherv" not in cls.__dict__ and "reduce_scatterv" not in cls.__dict__


def _install_gatherv() -> bool:
    """S1: give ``CpuCommunicator`` variable-size all-gather and reduce-scatter."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(CpuCommunicator, _SENTINEL, False):
        return True
    if not _needs_shim(CpuCommunicator):
        return False
    check_unwrapped("S1")  # the base methods whose calls the shims must accept
    CpuCommunicator.all_gatherv = _all_gatherv
    CpuCommunicator.reduce_scatterv = _reduce_scatterv
    setattr(CpuCommunicator, _SENTINEL, True)
    return True


def apply() -> bool:
    """Install S1 and S2; returns True when both are in place (idempotent).

    False without vLLM's CPU modules (a CUDA install), or when vLLM implements
    ``all_gatherv``/``reduce_scatterv`` on CPU itself. On an unchecked vLLM version it warns
    once and still applies (the package's version policy); a changed target is an ImportError.
    """
    try:
        import vllm.distributed.device_communicators.cpu_communicator  # noqa: F401
        import vllm.model_executor.layers.fused_moe.experts.cpu_moe  # noqa: F401
    except ImportError:
        return False
    check_vllm_version()
    return _install_gatherv() & _install_expert_map()
