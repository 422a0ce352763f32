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

import math
import os
from dataclasses import dataclass

from vllm_afd import envs
from vllm_afd.config import AFDConfigError, MoEModelInfo, ffn_ranks_problem


def plan_hardware(platform_is_cpu: bool, what: str = "--afd-ratio auto") -> str:
    """The planner hardware (preset or file) ``what`` plans on; ``AFDConfigError`` on the CPU
    build without ``VLLM_AFD_PLAN_HARDWARE``."""
    hardware = envs.VLLM_AFD_PLAN_HARDWARE or (None if platform_is_cpu else "h200")
    if hardware is None:
        raise AFDConfigError(
            f"{what} on the CPU build needs planner hardware: set {envs.PLAN_HARDWARE} "
            f"to a hardware file (and {envs.PLAN_PROFILE} to a profile) written by "
            "`vllm-afd profile`"
            + (", or give the ratio, e.g. --afd-ratio 1:1" if what == "--afd-ratio auto" else "")
        )
    return hardware


def candidate_ffn_ranks(info: MoEModelInfo, attention_ranks: int) -> list[int]:
    return [
        f
        for f in range(1, attention_ranks + 1)
        if attention_ranks % f == 0 and ffn_ranks_problem(info.num_experts, f) is None
    ]


@dataclass(frozen=True)
class Candidate:
    """The planner's prediction for one FFN rank count of a deployment."""

    num_ffn_ranks: int
    ratio: str
    batch: int
    step_ms: float
    tokens_per_device: float
    """X_all: tokens/s per device, attention and FFN devices counted."""
    covered: bool
    """The FFN stage hides behind attention in every layer."""


def predict_ffn_counts(
    info: MoEModelInfo,
    attention_ranks: int,
    model_dir: str,
    context: int,
    batch: int,
    platform_is_cpu: bool,
    draft_length: int = 0,
    what: str = "--afd-ratio auto",
) -> tuple[str, list[Candidate]]:
    """``(hardware name, one Candidate per feasible FFN rank count)`` for ``attention_ranks``
    at ``batch`` requests per attention rank and ``context`` tokens of context.

    ``draft_length``: tokens a speculative draft proposes per step (``num_speculative_tokens``),
    0 without speculation: each request then sends ``1 + d`` tokens per step through the FFN.
    ``what`` plans (named in the error without planner hardware).
    """
    from vllm_afd.planner import PlanRequest, get_hardware, load_hf_config, load_profile, plan
    from vllm_afd.planner.hardware import load_hardware

    name = plan_hardware(platform_is_cpu, what)
    hardware = load_hardware(name) if os.path.exists(name) else get_hardware(name)
    profile_path = envs.VLLM_AFD_PLAN_PROFILE
    profile = load_profile(profile_path) if profile_path else None
    model = load_hf_config(model_dir)
    out = []
    for ffn in candidate_ffn_ranks(info, attention_ranks):
        request = PlanRequest(
            model=model,
            hardware=hardware,
            context=max(1, context),
            ratios=(attention_ranks // ffn,),
            ffn_gpus=ffn,
            batch=max(2, batch),
            draft_length=draft_length,
        )
        try:
            row = max(plan(request, profile).rows, key=lambda r: r.tokens_per_gpu)
        except ValueError:
            continue
        common = math.gcd(attention_ranks, ffn)
        out.append(
            Candidate(
                ffn,
                f"{attention_ranks // common}:{ffn // common}",
                row.batch,
                row.step_ms,
                row.tokens_per_gpu,
                row.covered,
            )
        )
    return hardware.name, out


def recommend_for_deployment(
    info: MoEModelInfo,
    attention_ranks: int,
    model_dir: str,
    context: int,
    max_batch: int,
    platform_is_cpu: bool,
    draft_length: int = 0,
) -> tuple[int, int, str]:
    """Return ``(A, F, one-line prediction)`` for the best FFN rank count
    (``predict_ffn_counts`` at the batch cap ``max_batch``)."""
    hardware, candidates = predict_ffn_counts(
        info, attention_ranks, model_dir, context, max_batch, platform_is_cpu, draft_length
    )
    if not candidates:
        raise AFDConfigError(
            f"--afd-ratio auto: the planner found no feasible split of {attention_ranks} "
            f"attention rank(s) on {hardware}; give the ratio explicitly"
        )
    best = max(candidates, key=lambda c: c.tokens_per_device)
    line = (
        f"planner on {hardware}: batch {best.batch}, d={draft_length}, "
        f"step {best.step_ms:.2f} ms, "
        f"{best.tokens_per_device:.0f} tok/s per device, FFN hidden: {best.covered}"
    )
    return attention_ranks, best.num_ffn_ranks, line
