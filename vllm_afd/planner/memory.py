"""Per-GPU decode batches from HBM capacity: b_A for AFD attention GPUs, b_V for wide EP.

The paper measures b_A; the planner must predict it. Both engines of the paper reserve a fixed
amount of HBM for activations and communication buffers and give the rest to the paged KV cache,
running the largest decode batch that fits (Section 3.1, Appendix A.1). So:

    b = floor((HBM - reserved - weights per GPU) / bytes per request)
    bytes per request = KV bytes per token * (context + output length + d) + linear-attention state

Weights per GPU: an AFD attention GPU holds everything but the routed experts
(`attention_side_bytes`: embeddings and LM head in BF16, projections, router and shared experts at
the checkpoint's precision); a wide-EP GPU holds the same plus 1/EP of the routed experts; an
FFN GPU holds 1/(FFN GPUs) of the routed experts of every MoE layer. Assumptions and limits:
- KV cache BF16, no KV quantization; every request reserves its full final length (vLLM admits
  requests against the KV pool; FastAFD's measured batches sit within about 7% of this model on
  the paper's four check points, some above, some below).
- Gated-delta state is FP32 (recurrent state) and BF16 (conv state) per request and layer.
- The CUDA-graph pool, NCCL/NVSHMEM buffers and fragmentation are inside `reserved_bytes`.
- b_A does not depend on r here; the planner may step b_A down to whole attention waves when that
  raises throughput (as FastAFD does), which makes the chosen b_A(r) fall slightly with r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_afd.config import ffn_ranks_problem
from vllm_afd.planner.hardware import Hardware
from vllm_afd.planner.models import ModelSpec


@dataclass(frozen=True)
class MemoryAssumptions:
    reserved_bytes: float = 2e9
    """HBM kept back from the KV cache for activations and communication (paper: 2 GB)."""

    def __post_init__(self) -> None:
        if self.reserved_bytes < 0:
            raise ValueError("MemoryAssumptions.reserved_bytes must be >= 0")


DEFAULT_MEMORY = MemoryAssumptions()


def request_bytes(model: ModelSpec, context: int, output_len: int, draft_length: int = 0) -> float:
    """HBM one running request occupies on an attention GPU."""
    tokens = context + output_len + draft_length
    return model.kv_bytes_per_token * tokens + model.linear_state_bytes_per_request


def _batch_from_free(free_bytes: float, per_request: float) -> int:
    return max(0, int(math.floor(free_bytes / per_request)))


def attention_batch(
    model: ModelSpec,
    hw: Hardware,
    context: int,
    output_len: int,
    memory: MemoryAssumptions = DEFAULT_MEMORY,
    draft_length: int = 0,
) -> int:
    """Largest b_A that fits an AFD attention GPU (no routed experts on it)."""
    free = hw.hbm_capacity - memory.reserved_bytes - model.attention_side_bytes
    return _batch_from_free(free, request_bytes(model, context, output_len, draft_length))


def colocated_batch(
    model: ModelSpec,
    hw: Hardware,
    context: int,
    output_len: int,
    ep: int,
    memory: MemoryAssumptions = DEFAULT_MEMORY,
    draft_length: int = 0,
) -> int:
    """Largest b_V that fits a wide-EP GPU holding 1/ep of the routed experts."""
    weights = model.attention_side_bytes + model.routed_expert_bytes / ep
    free = hw.hbm_capacity - memory.reserved_bytes - weights
    return _batch_from_free(free, request_bytes(model, context, output_len, draft_length))


def ffn_bytes_per_gpu(model: ModelSpec, ffn_gpus: int) -> float:
    return model.routed_expert_bytes / ffn_gpus


def ffn_fits(
    model: ModelSpec, hw: Hardware, ffn_gpus: int, memory: MemoryAssumptions = DEFAULT_MEMORY
) -> bool:
    """True when `ffn_gpus` GPUs hold all routed experts with `reserved_bytes` left on each."""
    return ffn_bytes_per_gpu(model, ffn_gpus) + memory.reserved_bytes <= hw.hbm_capacity


def check_ffn_fits(
    model: ModelSpec, hw: Hardware, ffn_gpus: int, memory: MemoryAssumptions = DEFAULT_MEMORY
) -> None:
    """Raise ``ValueError`` saying how much is missing when `ffn_gpus` GPUs cannot hold the
    routed experts (at the checkpoint's bytes per parameter)."""
    if ffn_fits(model, hw, ffn_gpus, memory):
        return
    need = ffn_bytes_per_gpu(model, ffn_gpus) + memory.reserved_bytes
    fewest = next(
        (n for n in range(ffn_gpus, 4 * hw.nvlink_domain + 1) if ffn_fits(model, hw, n, memory)),
        None,
    )
    hint = f"at least {fewest} FFN GPUs hold them" if fewest else "no FFN pool holds them"
    raise ValueError(
        f"the routed experts of {model.name} ({model.routed_expert_bytes / 1e9:.0f} GB) do not "
        f"fit {ffn_gpus} FFN GPU(s) of {hw.name}: {need / 1e9:.0f} GB per GPU with "
        f"{memory.reserved_bytes / 1e9:.0f} GB reserved, {hw.hbm_capacity / 1e9:.0f} GB of HBM; "
        f"{hint}"
    )


def ffn_pool_candidates(
    model: ModelSpec, hw: Hardware, memory: MemoryAssumptions = DEFAULT_MEMORY
) -> tuple[int, ...]:
    """FFN pool sizes to consider. With a fixed `hw.ffn_pool_gpus` (GB200: one node), the
    smallest multiple of it that holds the experts; otherwise every size that divides E, holds
    the routed experts and leaves at least one attention GPU in the NVLink domain."""
    pool = hw.ffn_pool_gpus
    sizes = range(pool, hw.nvlink_domain, pool) if pool else range(1, hw.nvlink_domain)
    fitting = tuple(
        s
        for s in sizes
        if ffn_ranks_problem(model.num_experts, s) is None and ffn_fits(model, hw, s, memory)
    )
    if pool:
        fitting = fitting[:1]
    if not fitting:
        raise ValueError(
            f"the routed experts of {model.name} ({model.routed_expert_bytes / 1e9:.0f} GB) fit "
            f"no FFN pool within one {hw.name} NVLink domain of {hw.nvlink_domain} GPUs"
        )
    return fitting
