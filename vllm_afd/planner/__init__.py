"""The AFD planner: predict AFD throughput before deploying it, and pick the attention:FFN ratio.

Pure Python (no vLLM, no torch). It implements the FastAFD analytical model (arXiv 2611.07149,
Section 4 and Appendix C) with the conventions of planner-spec.md, sizes per-GPU batches from
HBM capacity, models the wide-EP baseline, and adds near-free-parallelism budgets (arXiv
2605.30851). Modules, in the order a prediction flows through them:

    hardware.py    Hardware presets (gb200 calibrated; b200, h200, h100 from datasheets) / files
    models.py      ModelSpec presets and the HF config.json reader
    profile_io.py  colocated profiles (D_V, kappa, b_p, draft times, fits): load/save, paper CSV
    memory.py      b_A and b_V from HBM capacity; FFN pool sizes that hold the experts
    analytical.py  A1 wave model, A2 FFN service, Eq. 3 step, X_all, S_all decomposition, coverage
    nfp.py         near-free parallelism of the attention and FFN stages; draft-length advice
    planning.py    plan() over candidate ratios; recommend_ratio() for `--afd-ratio auto`
    cli.py         `vllm-afd plan` and `vllm-afd plan predict`

API for the serving side (`--afd-ratio auto`)::

    recommend_ratio(
        model: ModelSpec | str,          # preset name, alias, or path to config.json / model dir
        hardware: Hardware | str,        # preset name or hardware YAML/JSON path
        context: int | str,              # prompt tokens, e.g. 8192 or "8K"
        total_ranks: int,                # devices to split into attention + FFN ranks
        *,
        output_len: int = 1024,
        draft_length: int = 0,
        profile: ColocatedProfile | None = None,   # else the bundled paper profile, else a bound
        dv_ms: float | None = None,                # D_V override, ms
        batch: int | None = None,                  # b_A override; None sizes it from HBM
        acceptance: float = 1.0,
        memory: MemoryAssumptions = DEFAULT_MEMORY,
    ) -> tuple[int, int, RatioPrediction]          # (attention ranks, FFN ranks, prediction)

It tries every FFN pool size that divides the routed experts and holds them in HBM, and returns
the split with the highest tokens/s per GPU counting all ranks; ValueError when none is feasible.

For profile writers (`vllm-afd profile`): build a `ColocatedProfile` of `ProfilePoint`s and call
`save_profile(profile, path)`; `load_profile(path)` reads it back (format in docs/planner.md).
"""

from vllm_afd.planner.analytical import (
    Decomposition,
    StepPrediction,
    afd_step,
    afd_tokens_per_gpu,
    colocated_step,
    coverage_boundary,
    decompose,
    ffn_service,
    wave_time,
)
from vllm_afd.planner.hardware import HARDWARE_PRESETS, Hardware, get_hardware, load_hardware
from vllm_afd.planner.memory import (
    DEFAULT_MEMORY,
    MemoryAssumptions,
    attention_batch,
    colocated_batch,
)
from vllm_afd.planner.models import MODEL_PRESETS, ModelSpec, get_model, load_hf_config
from vllm_afd.planner.nfp import NearFreeBudget, attention_nfp, ffn_nfp, recommend_draft_length
from vllm_afd.planner.planning import (
    Baseline,
    PlanRequest,
    PlanResult,
    RatioPrediction,
    plan,
    recommend_ratio,
)
from vllm_afd.planner.profile_io import (
    ColocatedProfile,
    ProfilePoint,
    bundled_profile,
    load_profile,
    parse_context,
    save_profile,
)

__all__ = [
    "DEFAULT_MEMORY",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "Baseline",
    "ColocatedProfile",
    "Decomposition",
    "Hardware",
    "MemoryAssumptions",
    "ModelSpec",
    "NearFreeBudget",
    "PlanRequest",
    "PlanResult",
    "ProfilePoint",
    "RatioPrediction",
    "StepPrediction",
    "afd_step",
    "afd_tokens_per_gpu",
    "attention_batch",
    "attention_nfp",
    "bundled_profile",
    "colocated_batch",
    "colocated_step",
    "coverage_boundary",
    "decompose",
    "ffn_nfp",
    "ffn_service",
    "get_hardware",
    "get_model",
    "load_hardware",
    "load_hf_config",
    "load_profile",
    "parse_context",
    "plan",
    "recommend_draft_length",
    "recommend_ratio",
    "save_profile",
    "wave_time",
]
