"""CPU step-period prediction from a `vllm-afd profile` file (the A/B harness's comparison).

The CPU build has no CUDA graphs, no NVLink and no wave-quantised attention kernel, so the A1 wave
model does not apply; the profile instead carries fitted CPU terms (its ``"cpu"`` section, read
by ``load_cpu_fit``), all per engine step in seconds, for one rank of ``threads`` cores:

    A(n, c)  = a0 + a1 n + a2 n c        core attention of one layer, n requests, c context
    D_V(n)   = d0 + d1 n                 auxiliary time of one pass over the layers (projections,
                                          norms, router, sampling, scheduler and host work)
    K(m)     = k0 + m k1                 local expert kernel of one layer (colocated MoE)
    F(m)     = tau + W / (u BW) + m 6 H I K / (u_c P)   remote FFN service of one layer (A2),
                                          dispatch + FFN-side work + combine, W = expert bytes of
                                          the layer / F, with tau, u, u_c fitted by the profiler

Predicted step periods (b requests per attention rank, r = A / F, m = r n routed tokens):

    colocated   T_V = D_V(b) + sum_l A(b, c) + sum_moe K(b)
    AFD, k = 1  T_A = D_V(b) + sum_l A(b, c) + sum_moe F(r b)          (no overlap: in series)
    AFD, k = 2  T_A = 2 sum_l max(S, F(r n)) + min(S, F(r n)),  S = A(n, c) + D_V(n) / L,
                n = b / 2                                      (Eq. 3 + the pipeline's fill/drain)

With speculative decoding (draft length d) a verify step carries ``q = 1 + d`` positions per
request through every term, so each formula is evaluated at ``q b`` positions in place of ``b``
requests (attention at ``q`` queries per request over the same context); the draft's own time
T_draft is not modelled (n-gram drafting is host work; a draft model would add its own step).

``k = 2`` is the paper's two-microbatch form with D_V spread over the layers; on the CPU it
charges the host part of D_V twice, which only a microbatched engine would actually pay. The
``min`` term is the two-stage pipeline's fill or drain: when attention is the bottleneck, the
last microbatch's last FFN call comes after all attention work; when the FFN is, the first
attention stage comes before all FFN work. Eq. 3 leaves it out because on the paper's 60-94
layers it is about 1% of the step; on the 2-layer tiny models it is a quarter of a layer pair
(measured: the FFN-heavy recipe's k = 2 step was 6-20% above Eq. 3 alone, 1 ms of it this term).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_afd.planner.analytical import LayerGroup, StageTimes, StepPrediction, ffn_service
from vllm_afd.planner.hardware import Hardware
from vllm_afd.planner.models import ModelSpec


@dataclass(frozen=True)
class CpuFit:
    """The fitted CPU terms of one model (seconds; see the module docstring)."""

    attention: tuple[float, float, float]
    """(a0, a1, a2) of A(n, c) = a0 + a1 n + a2 n c, per layer."""
    aux: tuple[float, float]
    """(d0, d1) of D_V(n) = d0 + d1 n, per pass."""
    kernel: tuple[float, float]
    """(k0, k1) of the local expert kernel K(m) = k0 + k1 m, per layer (all experts local)."""
    hardware: Hardware
    """One CPU rank with tau, u and u_c fitted (A2's constants)."""
    threads: int = 1

    def attention_s(self, n: float, context: float) -> float:
        a0, a1, a2 = self.attention
        return a0 + a1 * n + a2 * n * context

    def aux_s(self, n: float) -> float:
        return self.aux[0] + self.aux[1] * n

    def kernel_s(self, m: float) -> float:
        return self.kernel[0] + self.kernel[1] * m

    def with_attention_scale(self, factor: float) -> CpuFit:
        """This fit with A and D_V (the attention side) ``factor`` times the profile's."""
        return dataclasses.replace(
            self,
            attention=(
                factor * self.attention[0],
                factor * self.attention[1],
                factor * self.attention[2],
            ),
            aux=(factor * self.aux[0], factor * self.aux[1]),
        )


def cpu_fit_from_dict(data: dict[str, Any]) -> CpuFit:
    """Build from a profile file's ``"cpu"`` section; ValueError names a missing key."""
    try:
        hw = Hardware(**data["hardware"])
        a0, a1, a2 = (float(v) for v in data["attention"])
        d0, d1 = (float(v) for v in data["aux"])
        k0, k1 = (float(v) for v in data["kernel"])
        return CpuFit(
            attention=(a0, a1, a2),
            aux=(d0, d1),
            kernel=(k0, k1),
            hardware=hw,
            threads=int(data.get("threads", 1)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile 'cpu' section is incomplete or malformed ({exc})") from None


def cpu_fit_to_dict(fit: CpuFit) -> dict[str, Any]:
    return {
        "attention": list(fit.attention),
        "aux": list(fit.aux),
        "kernel": list(fit.kernel),
        "hardware": dataclasses.asdict(fit.hardware),
        "threads": fit.threads,
    }


def load_cpu_fit(path: str | Path) -> CpuFit:
    """The ``"cpu"`` section of a profile JSON written by `vllm-afd profile`."""
    data = json.loads(Path(path).read_text())
    if "cpu" not in data:
        raise ValueError(f"{path}: no 'cpu' section (not written by `vllm-afd profile` on CPU)")
    return cpu_fit_from_dict(data["cpu"])


@dataclass(frozen=True)
class CpuPrediction:
    """A predicted step period and its parts (seconds per step)."""

    step_s: float
    attention_s: float
    aux_s: float
    ffn_s: float
    """Routed experts: local kernel (colocated) or remote service incl. transport (AFD)."""
    microbatches: int = 1

    def to_dict(self) -> dict[str, float]:
        return {
            "predicted_ms": self.step_s * 1e3,
            "pred_attention_ms": self.attention_s * 1e3,
            "pred_aux_ms": self.aux_s * 1e3,
            "pred_ffn_ms": self.ffn_s * 1e3,
        }


def predict_colocated(
    fit: CpuFit, model: ModelSpec, batch: float, context: float, draft_length: int = 0
) -> CpuPrediction:
    """T_V for ``batch`` requests on one colocated rank, ``1 + draft_length`` positions each."""
    batch = batch * (1 + draft_length)
    attention = model.num_layers * fit.attention_s(batch, context)
    moe = model.num_moe_layers * fit.kernel_s(batch)
    aux = fit.aux_s(batch)
    return CpuPrediction(aux + attention + moe, attention, aux, moe)


def modelled_microbatches(microbatches: int) -> int:
    """The k the step model takes for an engine's ``microbatches``: 1 or 2 (Eq. 3's)."""
    return min(max(1, microbatches), 2)


def predict_afd(
    fit: CpuFit,
    model: ModelSpec,
    batch: float,
    ratio: float,
    ffn_ranks: int,
    context: float,
    microbatches: int = 1,
    draft_length: int = 0,
) -> CpuPrediction:
    """T_A for ``batch`` requests per attention rank at ``ratio`` = A / F and k microbatches,
    ``1 + draft_length`` positions per request.

    ``k = 1`` sums attention, auxiliary and remote FFN service in series; ``k = 2`` is Eq. 3.
    Raises ValueError for other k or non-positive inputs.
    """
    if not (batch > 0 and ratio > 0 and ffn_ranks >= 1 and draft_length >= 0):
        raise ValueError(
            f"need batch, ratio > 0, ffn_ranks >= 1 and draft_length >= 0: "
            f"{batch}, {ratio}, {ffn_ranks}, {draft_length}"
        )
    batch = batch * (1 + draft_length)
    if microbatches == 1:
        attention = model.num_layers * fit.attention_s(batch, context)
        ffn = model.num_moe_layers * ffn_service(model, fit.hardware, ratio * batch, ffn_ranks)
        aux = fit.aux_s(batch)
        return CpuPrediction(aux + attention + ffn, attention, aux, ffn, 1)
    if microbatches == 2:
        return _two_microbatches(fit, model, batch, ratio, ffn_ranks, context)
    raise ValueError(f"microbatches must be 1 or 2, got {microbatches}")


def _two_microbatches(
    fit: CpuFit, model: ModelSpec, batch: float, ratio: float, ffn_ranks: int, context: float
) -> CpuPrediction:
    n = batch / 2
    per_layer_aux = fit.aux_s(n) / model.num_layers
    attention = fit.attention_s(n, context)
    ffn = ffn_service(model, fit.hardware, ratio * n, ffn_ranks)
    groups = [LayerGroup("full", model.num_moe_layers, moe=True)]
    if model.num_dense_layers:
        groups.append(LayerGroup("full", model.num_dense_layers, moe=False))
    stage = attention + per_layer_aux
    stages = tuple(StageTimes(g, stage, ffn if g.moe else 0.0) for g in groups)
    step = StepPrediction(stages=stages)
    return CpuPrediction(
        step.step_s + min(stage, ffn),
        2 * model.num_layers * attention,
        2 * fit.aux_s(n),
        2 * model.num_moe_layers * ffn,
        2,
    )
