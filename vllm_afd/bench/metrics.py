"""A/B rows in the paper's terms (pure functions over the children's results).

Per configuration: devices (attention + FFN ranks), per-rank batch b (requests per attention
rank; a TP group of A ranks decoding A*b requests counts as b per rank), the step period T over
the steady window, and tokens/s per device counting every device (X_all) and attention devices
only (X_att). Against the best colocated configuration (highest X_all, per device b_V / T_V):

    S_all = X_all / X_V = (b_A / b_V) (T_V / T_A) r / (r + 1)          (FastAFD Eq. 2)
    S_att = X_att / X_V = S_all (r + 1) / r

with r = A / F, split into batch gain b_A / b_V, overlap gain T_V / T_A and disaggregation cost
r / (r + 1) by the planner's own ``decompose`` so the harness and the planner agree by
construction. On the CPU there is no HBM limit at these sizes, so b_A = b_V unless
``--afd-batch`` differs from ``--batch``: the batch gain is 1 by design, not measured.

With speculative decoding a step emits tau tokens per request (1 <= tau <= 1 + d: the accepted
draft tokens plus the bonus token, measured over the window), so tokens/s counts tau b / T and
Eq. 2 gains a fourth factor, the token gain tau_A / tau_V (``token_gain``; 1 when both sides
accept alike, as greedy decoding of the same tokens does). ``spec_summary`` turns vLLM's
counters into the acceptance rate (accepted / draft tokens) and the mean acceptance length
(1 + accepted / drafts, vLLM's definition: tokens per verify step of a request that drafted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_afd.planner.analytical import decompose


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the A/B run."""

    name: str
    kind: str
    """'colocated' (one rank), 'wide-ep' (DP x EP, colocated) or 'afd'."""
    attention_ranks: int
    ffn_ranks: int = 0
    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False
    per_rank_batch: int = 16
    microbatches: int = 1
    ratio: str | None = None

    @property
    def devices(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    @property
    def engine_batch(self) -> int:
        """Requests one engine decodes together (a TP group shares one batch)."""
        return self.per_rank_batch * self.tensor_parallel

    @property
    def r(self) -> float | None:
        """Attention ranks per FFN rank (None for colocated configurations)."""
        return self.attention_ranks / self.ffn_ranks if self.ffn_ranks else None

    def layout(self) -> str:
        attn = f"TP{self.tensor_parallel}" if self.data_parallel == 1 else f"DP{self.data_parallel}"
        if self.expert_parallel:
            attn += f" EP{self.data_parallel * self.tensor_parallel}"
        return attn + (f" + {self.ffn_ranks} FFN" if self.ffn_ranks else "")


@dataclass
class Measurement:
    """What one configuration's run gave (period in seconds)."""

    config: BenchConfig
    status: str = "ok"
    period: dict[str, float] = field(default_factory=dict)
    """median_ms, p90_ms, mean_ms, intervals (``window.PeriodStats.to_dict``)."""
    identical: bool | None = None
    compared_requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.period)

    @property
    def step_s(self) -> float:
        return self.period["median_ms"] / 1e3

    @property
    def tokens_per_step(self) -> float:
        """Tokens per request and step over the window (tau; 1 without speculation)."""
        return self.extra.get("tokens_per_step", 1.0)


def throughput(
    config: BenchConfig, step_s: float, tokens_per_step: float = 1.0
) -> dict[str, float]:
    """Tokens/s in total, per device (all devices) and per attention device, with
    ``tokens_per_step`` tokens per request and step (tau)."""
    total = config.per_rank_batch * config.attention_ranks * tokens_per_step / step_s
    return {
        "tok_s": total,
        "tok_s_per_device": total / config.devices,
        "tok_s_per_attention_device": total / config.attention_ranks,
    }


def best_colocated(measurements: list[Measurement]) -> Measurement | None:
    """The colocated measurement with the highest tokens/s per device (the baseline)."""
    candidates = [m for m in measurements if m.ok and m.config.kind != "afd"]
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda m: throughput(m.config, m.step_s, m.tokens_per_step)["tok_s_per_device"],
    )


def speedups(m: Measurement, base: Measurement) -> dict[str, float | None]:
    """S_all, S_att and Eq. 2's three factors of ``m`` against ``base`` (four with
    speculation: the token gain tau_A / tau_V)."""
    x = throughput(m.config, m.step_s, m.tokens_per_step)
    x_v = throughput(base.config, base.step_s, base.tokens_per_step)["tok_s_per_device"]
    token_gain = m.tokens_per_step / base.tokens_per_step
    out: dict[str, float | None] = {
        "s_all": x["tok_s_per_device"] / x_v,
        "s_att": x["tok_s_per_attention_device"] / x_v,
        "batch_gain": m.config.per_rank_batch / base.config.per_rank_batch,
        "overlap_gain": base.step_s / m.step_s,
        "disaggregation_cost": None,
    }
    if "tokens_per_step" in m.extra or "tokens_per_step" in base.extra:
        out["token_gain"] = token_gain
    r = m.config.r
    if r is not None:
        d = decompose(m.config.per_rank_batch, m.step_s, base.config.per_rank_batch, base.step_s, r)
        out |= {
            "batch_gain": d.batch_gain,
            "overlap_gain": d.overlap_gain,
            "disaggregation_cost": d.disaggregation_cost,
            "eq2_s_all": d.s_all * token_gain,
        }
    return out


def build_rows(measurements: list[Measurement]) -> list[dict[str, Any]]:
    """One JSON-ready row per configuration, with speedups against the best colocated one."""
    base = best_colocated(measurements)
    rows = []
    for m in measurements:
        c = m.config
        row: dict[str, Any] = {
            "name": c.name,
            "kind": c.kind,
            "layout": c.layout(),
            "status": m.status,
            "attention_ranks": c.attention_ranks,
            "ffn_ranks": c.ffn_ranks,
            "devices": c.devices,
            "per_rank_batch": c.per_rank_batch,
            "engine_batch": c.engine_batch,
            "microbatches": c.microbatches,
            "ratio": c.ratio,
            "identical": m.identical,
            "compared_requests": m.compared_requests,
            "baseline": base is not None and m is base,
            **m.extra,
        }
        if m.ok:
            row |= {
                "step_ms": m.period["median_ms"],
                "step_p90_ms": m.period["p90_ms"],
                "step_mean_ms": m.period["mean_ms"],
                "intervals": m.period["intervals"],
            }
            row |= throughput(c, m.step_s, m.tokens_per_step)
            if base is not None:
                row |= speedups(m, base)
        rows.append(row)
    return rows


def spec_summary(counts: dict[str, float]) -> dict[str, float | None]:
    """Acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted /
    drafts) from vLLM's counters; None where nothing was drafted."""
    drafts, draft_tokens = counts.get("drafts", 0), counts.get("draft_tokens", 0)
    accepted = counts.get("accepted_tokens", 0)
    return {
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def prediction_error(predicted_ms: float, measured_ms: float) -> float:
    """Signed error in percent, e = 100 (T_predicted / T_measured - 1) (the paper's App. B)."""
    return 100.0 * (predicted_ms / measured_ms - 1.0)
