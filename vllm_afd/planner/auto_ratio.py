"""``--afd-ratio auto``: the planner picks the FFN rank count for the attention ranks given.

The attention ranks are what the user launched (data parallel x tensor parallel); the planner
predicts tokens/s per device, counting all devices, for every FFN rank count ``f`` that divides
both the attention ranks (whole r:1 ratios, the planner's candidates) and the routed experts,
at the scheduler's batch cap (``--max-num-seqs``) per attention rank and the speculative draft
length (``--speculative-config``'s ``num_speculative_tokens``), and the best one is used.
Hardware and profile come from the environment, because the serving command line is vLLM's:
``VLLM_AFD_PLAN_HARDWARE`` (a preset such as ``h200`` or a hardware file; on GPUs it defaults
to ``h200``) and optionally ``VLLM_AFD_PLAN_PROFILE`` (a file written by ``vllm-afd
profile``). The prediction acted on is printed.
"""

from __future__ import annotations

import os

from vllm_afd import envs
from vllm_afd.config import AFDConfigError, MoEModelInfo


def _hardware(platform_is_cpu: bool) -> str:
    hardware = envs.VLLM_AFD_PLAN_HARDWARE or (None if platform_is_cpu else "h200")
    if hardware is None:
        raise AFDConfigError(
            f"--afd-ratio auto on the CPU build needs planner hardware: set {envs.PLAN_HARDWARE} "
            f"to a hardware file (and {envs.PLAN_PROFILE} to a profile) written by "
            "`vllm-afd profile`, or "
            "give the ratio, e.g. --afd-ratio 1:1"
        )
    return hardware


def candidate_ffn_ranks(info: MoEModelInfo, attention_ranks: int) -> list[int]:
    return [
        f
        for f in range(1, attention_ranks + 1)
        if attention_ranks % f == 0 and info.num_experts % f == 0
    ]


def recommend_for_deployment(
    info: MoEModelInfo,
    attention_ranks: int,
    model_dir: str,
    context: int,
    max_batch: int,
    platform_is_cpu: bool,
    draft_length: int = 0,
) -> tuple[int, int, str]:
    """Return ``(A, F, one-line prediction)`` for the best FFN rank count.

    ``draft_length``: tokens a speculative draft proposes per step (``num_speculative_tokens``),
    0 without speculation: each request then sends ``1 + d`` tokens per step through the FFN.
    """
    from vllm_afd.planner import PlanRequest, get_hardware, load_hf_config, load_profile, plan
    from vllm_afd.planner.hardware import load_hardware

    name = _hardware(platform_is_cpu)
    hardware = load_hardware(name) if os.path.exists(name) else get_hardware(name)
    profile_path = envs.VLLM_AFD_PLAN_PROFILE
    profile = load_profile(profile_path) if profile_path else None
    model = load_hf_config(model_dir)
    best = None
    for ffn in candidate_ffn_ranks(info, attention_ranks):
        request = PlanRequest(
            model=model,
            hardware=hardware,
            context=context,
            ratios=(attention_ranks // ffn,),
            ffn_gpus=ffn,
            batch=max(2, max_batch),
            draft_length=draft_length,
        )
        try:
            row = max(plan(request, profile).rows, key=lambda r: r.tokens_per_gpu)
        except ValueError:
            continue
        if best is None or row.tokens_per_gpu > best[2].tokens_per_gpu:
            best = (attention_ranks, ffn, row)
    if best is None:
        raise AFDConfigError(
            f"--afd-ratio auto: the planner found no feasible split of {attention_ranks} "
            f"attention rank(s) on {hardware.name}; give the ratio explicitly"
        )
    attn, ffn, row = best
    line = (
        f"planner on {hardware.name}: batch {row.batch}, d={draft_length}, "
        f"step {row.step_ms:.2f} ms, "
        f"{row.tokens_per_gpu:.0f} tok/s per device, FFN hidden: {row.covered}"
    )
    return attn, ffn, line
