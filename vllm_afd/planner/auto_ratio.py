"""The planner for a running deployment: ``--afd-ratio auto`` and the planner in the loop.

The attention ranks are what the user launched (data parallel x tensor parallel); the planner
predicts the decode step and tokens/s per device, counting all devices, for FFN rank counts
``f`` at a given batch per attention rank, context and speculative draft length
(``--speculative-config``'s ``num_speculative_tokens``):

- ``--afd-ratio auto`` considers the counts that divide both the attention ranks (whole r:1
  ratios) and the routed experts, at the scheduler's batch cap (``--max-num-seqs``), and uses
  the best one (the prediction acted on is logged);
- the planner in the loop (``placement.autoscale``) considers every count the experts allow
  (``config.ffn_ranks_problem``), more FFN ranks than attention ranks included (a pool scaled
  to 4 for 1 attention rank is predicted too), at the batch and context it measured.

Each platform is predicted by the model fitted for it (``planner_inputs``):

- the CPU build, given a profile ``vllm-afd profile`` wrote (``VLLM_AFD_PLAN_PROFILE`` with its
  ``"cpu"`` section): the CPU step model (``planner.cpu``: fitted attention, auxiliary and FFN
  service terms; one rank of the profile's threads is a device);
- otherwise (GPUs; or the CPU build modelling a device, as the autoscale e2e does): FastAFD's
  analytical model (``planning.predict_ratio``, Eq. 3) on ``VLLM_AFD_PLAN_HARDWARE`` (a preset
  such as ``h200`` or a hardware file; on GPUs it defaults to ``h200``), calibrated by the
  profile if one is given.

A count that cannot be predicted (its experts do not fit, it leaves the NVLink domain, the
context is outside the profile) is left out with the reason (``Predictions.unpredicted``).

In the loop, A2's intercept tau (the fixed cost of one FFN round trip) is refitted from the
round trips the deployment served (``ServedRoundTrip``): the profile measures tau between two
processes on an otherwise idle machine, serving pays it next to the front-end, the engine core
and Ray (on two CPU cores: 1.6-2.0 ms per round trip against the profile's 1.07-1.18). The
measured round trip less the model's weight and token terms is the tau served; every FFN rank
count is then predicted with it, the profile's u and u_c unchanged. The CPU step model's
attention side (A and D_V) is rescaled the same way (``ServedAttention``): the profile times
the colocated engine alone, serving runs it next to the API server and the load (on two cores
47-60 ms a step against the profile's 37, docs/benchmarks.md), so A and D_V are multiplied by
the median of the attention side as served over the model's at each window's batch and
context. This is Dynamo's planner's correction factor (observed over expected ITL), put on
each side of the step separately, so that the FFN rank counts are still told apart by the
model's shape; the advice says both factors. Only where the platform measured is the one
modelled (not the CPU build modelling a device); the analytical model (GPUs) refits tau only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_afd import envs
from vllm_afd.config import MoEModelInfo, ffn_ranks_problem
from vllm_afd.errors import AFDConfigError

if TYPE_CHECKING:
    from vllm_afd.planner.cpu import CpuFit
    from vllm_afd.planner.hardware import Hardware
    from vllm_afd.planner.models import ModelSpec
    from vllm_afd.planner.profile_io import ColocatedProfile


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner predicts a deployment from: the CPU step model (``cpu`` set) or the
    analytical model on ``hardware`` (with the optional ``profile``)."""

    cpu: CpuFit | None = None
    hardware: Hardware | None = None
    profile: ColocatedProfile | None = None
    profile_path: str = ""

    @property
    def model(self) -> str:
        """Which model predicts, in words (the advice and the logs say it)."""
        if self.cpu is not None:
            return f"CPU step model ({self.profile_path}, {self.cpu.hardware.name})"
        assert self.hardware is not None
        return f"analytical model on {self.hardware.name}"

    def ffn_hardware(self) -> Hardware:
        """The hardware A2 (``analytical.ffn_service``) predicts the FFN service on."""
        if self.cpu is not None:
            return self.cpu.hardware
        from vllm_afd.planner.planning import apply_calibration

        assert self.hardware is not None
        return apply_calibration(self.hardware, self.profile)

    def with_intercept(self, tau_s: float) -> PlannerInputs:
        """These inputs with A2's intercept tau replaced by ``tau_s``."""
        hw = dataclasses.replace(self.ffn_hardware(), dispatch_intercept=tau_s)
        if self.cpu is not None:
            return dataclasses.replace(self, cpu=dataclasses.replace(self.cpu, hardware=hw))
        profile = self.profile
        if profile is not None and profile.dispatch_intercept_us is not None:
            profile = dataclasses.replace(profile, dispatch_intercept_us=tau_s * 1e6)
        return dataclasses.replace(self, hardware=hw, profile=profile)


@dataclass(frozen=True)
class ServedRoundTrip:
    """FFN round trips as the deployment served them (what the planner in the loop measured
    over one window): ``seconds`` each, ``tokens`` routed tokens to each of ``ffn_ranks``."""

    ffn_ranks: int
    tokens: float
    seconds: float


@dataclass(frozen=True)
class ServedAttention:
    """The attention side of a step as the deployment served it over one window: ``seconds``
    per step (attention and the auxiliary time: the step less its exposed FFN waits) at
    ``batch`` requests per attention rank and ``context`` tokens of context."""

    batch: float
    context: float
    seconds: float


def served_attention_scale(
    fit: CpuFit,
    model: ModelSpec,
    served: Sequence[ServedAttention],
    microbatches: int,
    draft_length: int,
) -> float:
    """The attention side as served over the CPU step model's: the median over ``served`` of
    the measured seconds per step over the model's A and D_V at that batch and context."""
    from vllm_afd.planner.cpu import modelled_microbatches, predict_afd

    k = modelled_microbatches(microbatches)
    ratios = []
    for window in served:
        p = predict_afd(fit, model, window.batch, 1.0, 1, window.context, k, draft_length)
        ratios.append(window.seconds / (p.attention_s + p.aux_s))
    return statistics.median(ratios)


def served_intercept(
    inputs: PlannerInputs, model: ModelSpec, served: Sequence[ServedRoundTrip]
) -> float:
    """A2's tau as served (seconds, >= 0): the median over ``served`` of the round trip less
    the model's weight and token terms (``analytical.ffn_service`` without its tau)."""
    from vllm_afd.planner.analytical import ffn_service

    hw = inputs.ffn_hardware()
    fixed = hw.dispatch_intercept
    taus = [rt.seconds - ffn_service(model, hw, rt.tokens, rt.ffn_ranks) + fixed for rt in served]
    return max(0.0, statistics.median(taus))


def planner_inputs(platform_is_cpu: bool, what: str = "--afd-ratio auto") -> PlannerInputs:
    """The ``PlannerInputs`` from ``VLLM_AFD_PLAN_PROFILE`` and ``VLLM_AFD_PLAN_HARDWARE``.

    ``AFDConfigError`` naming ``what`` (the flag that needs the planner) on the CPU build with
    neither a CPU profile nor planner hardware; ``ValueError`` naming the file that does not
    load."""
    from vllm_afd.planner import get_hardware, load_profile
    from vllm_afd.planner.cpu import cpu_fit_from_dict
    from vllm_afd.planner.hardware import load_hardware

    profile_path = envs.VLLM_AFD_PLAN_PROFILE or ""
    # the paper's CSV profiles have no CPU section
    is_json = bool(profile_path) and not profile_path.lower().endswith(".csv")
    data = _read_json(profile_path) if is_json else {}
    if platform_is_cpu and "cpu" in data:
        return PlannerInputs(cpu=cpu_fit_from_dict(data["cpu"]), profile_path=profile_path)
    name = envs.VLLM_AFD_PLAN_HARDWARE or (None if platform_is_cpu else "h200")
    if name is None:
        raise AFDConfigError(
            f"{what} on the CPU build needs the planner's inputs: set {envs.PLAN_PROFILE} to "
            f"a profile written by `vllm-afd profile` (or {envs.PLAN_HARDWARE} to a device's "
            "hardware file or preset to model that device)"
            + (", or give the ratio, e.g. --afd-ratio 1:1" if what == "--afd-ratio auto" else "")
        )
    hardware = load_hardware(name) if os.path.exists(name) else get_hardware(name)
    profile = load_profile(profile_path) if profile_path else None
    return PlannerInputs(hardware=hardware, profile=profile, profile_path=profile_path)


def _read_json(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{envs.PLAN_PROFILE}={path}: not a readable JSON profile ({exc})"
        ) from None
    return data if isinstance(data, dict) else {}


def candidate_ffn_ranks(
    info: MoEModelInfo, attention_ranks: int, whole_ratios: bool = True
) -> list[int]:
    """FFN rank counts the experts allow: those dividing ``attention_ranks`` too
    (``whole_ratios``), or every one."""
    top = attention_ranks if whole_ratios else info.num_experts
    return [
        f
        for f in range(1, top + 1)
        if (not whole_ratios or attention_ranks % f == 0)
        and ffn_ranks_problem(info.num_experts, f) is None
    ]


@dataclass(frozen=True)
class Candidate:
    """The planner's prediction for one FFN rank count of a deployment."""

    num_ffn_ranks: int
    ratio: str
    batch: float
    step_ms: float
    tokens_per_device: float
    """X_all: tokens/s per device, attention and FFN devices counted."""
    covered: bool
    """The FFN stage hides behind attention in every layer."""


@dataclass(frozen=True)
class Predictions:
    """``predict_ffn_counts``' answer: the model that predicted, a ``Candidate`` per FFN rank
    count it predicted, and why it did not predict the others."""

    model: str
    candidates: tuple[Candidate, ...]
    unpredicted: dict[int, str]

    def best(self) -> Candidate | None:
        return max(self.candidates, key=lambda c: c.tokens_per_device, default=None)

    def why_none(self) -> str:
        """Why there is no prediction for any count (for a message)."""
        if not self.unpredicted:
            return "no FFN rank count was asked for"
        return "; ".join(f"{f} FFN rank(s): {why}" for f, why in self.unpredicted.items())


def predict_ffn_counts(
    info: MoEModelInfo,
    attention_ranks: int,
    model_dir: str,
    context: float,
    batch: float,
    platform_is_cpu: bool,
    draft_length: int = 0,
    what: str = "--afd-ratio auto",
    counts: Iterable[int] | None = None,
    microbatches: int = 2,
    served: Sequence[ServedRoundTrip] = (),
    attention_served: Sequence[ServedAttention] = (),
) -> Predictions:
    """``Predictions`` for ``attention_ranks`` at ``batch`` requests per attention rank and
    ``context`` tokens of context, for each FFN rank count in ``counts`` (default: the whole
    ratios of ``candidate_ffn_ranks``).

    ``draft_length``: tokens a speculative draft proposes per step (``num_speculative_tokens``),
    0 without speculation: each request then sends ``1 + d`` tokens per step through the FFN.
    ``microbatches``: the engine's (1 or 2; the CPU step model tells them apart, the analytical
    model is Eq. 3's two). ``what`` plans (named in the error without planner inputs).
    ``served``: round trips the deployment measured, to refit tau from, and
    ``attention_served``: its attention side, to rescale the CPU step model's (the module
    docstring); both ignored where the CPU build models a device.
    """
    from vllm_afd.planner import load_hf_config

    inputs = planner_inputs(platform_is_cpu, what)
    model = load_hf_config(model_dir)
    said = inputs.model
    if served and (inputs.cpu is not None or not platform_is_cpu):
        profiled = inputs.ffn_hardware().dispatch_intercept
        tau = served_intercept(inputs, model, served)
        inputs = inputs.with_intercept(tau)
        said += (
            f", tau {tau * 1e6:.0f} us as served over {len(served)} window(s) "
            f"(profiled {profiled * 1e6:.0f} us)"
        )
    if attention_served and inputs.cpu is not None:
        scale = served_attention_scale(
            inputs.cpu, model, attention_served, microbatches, draft_length
        )
        inputs = dataclasses.replace(inputs, cpu=inputs.cpu.with_attention_scale(scale))
        said += f", attention x{scale:.2f} as served over {len(attention_served)} window(s)"
    out, unpredicted = [], {}
    for ffn in candidate_ffn_ranks(info, attention_ranks) if counts is None else counts:
        problem = ffn_ranks_problem(info.num_experts, ffn)
        if problem is not None:
            unpredicted[ffn] = problem
            continue
        try:
            if inputs.cpu is not None:
                step_s, covered = _cpu_step(
                    inputs.cpu,
                    model,
                    attention_ranks,
                    ffn,
                    batch,
                    context,
                    draft_length,
                    microbatches,
                )
            else:
                step_s, covered = _analytical_step(
                    inputs, model, attention_ranks, ffn, batch, context, draft_length
                )
        except ValueError as exc:
            unpredicted[ffn] = str(exc)
            continue
        out.append(_candidate(attention_ranks, ffn, batch, step_s, covered))
    return Predictions(said, tuple(out), unpredicted)


def _candidate(attention: int, ffn: int, batch: float, step_s: float, covered: bool) -> Candidate:
    from vllm_afd.planner.analytical import afd_tokens_per_gpu

    common = math.gcd(attention, ffn)
    return Candidate(
        ffn,
        f"{attention // common}:{ffn // common}",
        batch,
        step_s * 1e3,
        afd_tokens_per_gpu(batch, step_s, attention / ffn),
        covered,
    )


def _cpu_step(
    fit: CpuFit,
    model: ModelSpec,
    attention: int,
    ffn: int,
    batch: float,
    context: float,
    draft_length: int,
    microbatches: int,
) -> tuple[float, bool]:
    """The CPU step model's ``(step seconds, FFN hidden)``: in series with one microbatch,
    Eq. 3 with two (then hidden when the FFN time is at most the attention side's)."""
    from vllm_afd.planner.cpu import modelled_microbatches, predict_afd

    k = modelled_microbatches(microbatches)
    p = predict_afd(fit, model, batch, attention / ffn, ffn, context, k, draft_length)
    return p.step_s, k == 2 and p.ffn_s <= p.attention_s + p.aux_s


def _analytical_step(
    inputs: PlannerInputs,
    model: ModelSpec,
    attention: int,
    ffn: int,
    batch: float,
    context: float,
    draft_length: int,
) -> tuple[float, bool]:
    """The analytical model's ``(step seconds, FFN hidden)`` with ``plan``'s checks: the
    experts fit the FFN devices, attention and FFN devices share one NVLink domain, the
    profile covers the context. ValueError says which fails."""
    from vllm_afd.planner.memory import check_ffn_fits
    from vllm_afd.planner.planning import predict_ratio, resolve_point

    hw = inputs.ffn_hardware()
    if attention + ffn > hw.nvlink_domain:
        raise ValueError(
            f"{attention} attention + {ffn} FFN GPUs exceed the {hw.name} NVLink domain of "
            f"{hw.nvlink_domain} GPUs"
        )
    check_ffn_fits(model, hw, ffn)
    point, _ = resolve_point(model, hw, max(1, round(context)), draft_length, inputs.profile)
    row = predict_ratio(model, hw, point, attention, ffn, max(2, round(batch)))
    return row.step_ms / 1e3, row.covered


def recommend_for_deployment(
    info: MoEModelInfo,
    attention_ranks: int,
    model_dir: str,
    context: int,
    max_batch: int,
    platform_is_cpu: bool,
    draft_length: int = 0,
    microbatches: int = 2,
    what: str = "--afd-ratio auto",
) -> tuple[int, int, str]:
    """Return ``(A, F, one-line prediction)`` for the best FFN rank count
    (``predict_ffn_counts`` at the batch cap ``max_batch``)."""
    predictions = predict_ffn_counts(
        info,
        attention_ranks,
        model_dir,
        context,
        max_batch,
        platform_is_cpu,
        draft_length,
        what,
        microbatches=microbatches,
    )
    best = predictions.best()
    if best is None:
        raise AFDConfigError(
            f"{what}: the planner ({predictions.model}) found no feasible split of "
            f"{attention_ranks} attention rank(s) ({predictions.why_none()}); give the ratio "
            "explicitly"
        )
    line = (
        f"planner: {predictions.model}: batch {best.batch:g}, d={draft_length}, "
        f"step {best.step_ms:.2f} ms, "
        f"{best.tokens_per_device:.0f} tok/s per device, FFN hidden: {best.covered}"
    )
    return attention_ranks, best.num_ffn_ranks, line
