"""Colocated profiles: the measured inputs of the FastAFD model, read and written.

A profile is measured on the colocated (wide-EP) vLLM deployment of one model on one hardware
type, before any AFD run. Per context c and draft length d it holds the auxiliary attention-side
time D_V (D_V,spec for d > 0), the speculative attention factor kappa, the profiling batch b_p and
the two draft-time components; optionally the fitted hardware constants tau and u_c, and the
measured wide-EP baseline (EP width, batch b_V, step T_V) that S_all is taken against.

Two formats are read: the paper's Table A13 CSV (`model,context,d,bp,DV_ms,kappa`, several models
per file) and the JSON file that `save_profile` writes (one model, documented in docs/planner.md).
A copy of the paper's CSV ships as package data and serves as the built-in GB200 profile of the
three preset models.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_afd.planner.models import canonical_model_name

PROFILE_FORMAT = "vllm-afd-colocated-profile"
PROFILE_VERSION = 1
_BUNDLED_CSV = "fastafd_gb200_profile.csv"
#: The presets the bundled CSV profiles (the paper's three models).
_BUNDLED_MODELS = ("minimax-m2.5", "qwen3-235b-a22b", "qwen3.5-397b-a17b")

_CONTEXT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_context(text: str | int) -> int:
    """Token count from `4096`, `4K`, `8k`, `1M` (K = 1024, M = 1024**2, as in the paper)."""
    value: float
    if isinstance(text, int):
        value = text
    else:
        match = _CONTEXT_RE.match(str(text))
        if match is None:
            raise ValueError(f"bad context {text!r}: expected a token count such as 4096 or 4K")
        scale = {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
        value = float(match.group(1)) * scale
        if value != int(value):
            raise ValueError(f"bad context {text!r}: not a whole number of tokens")
    if int(value) < 1:
        raise ValueError(f"bad context {text!r}: must be >= 1 token")
    return int(value)


def format_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


@dataclass(frozen=True)
class ProfilePoint:
    """Profile inputs for one (context, draft length)."""

    context: int
    dv_ms: float
    """D_V (d = 0) or D_V,spec (d > 0): attention-side auxiliary time per microbatch pass, ms."""
    draft_length: int = 0
    kappa: float = 1.0
    """Speculative attention factor: attention time for q = d + 1 positions over 1 position."""
    profile_batch: int | None = None
    """b_p: per-GPU batch of the profiling run."""
    t_draft_att_ms: float | None = None
    """T_draft,att,V: draft attention per step at b_p, ms (scaled by b / b_p)."""
    t_draft_rest_ms: float | None = None
    """T_draft,rest,V: the rest of the draft-and-accept time per step, ms (fixed)."""
    baseline_ep: int | None = None
    baseline_batch: int | None = None
    baseline_step_ms: float | None = None
    """Measured wide-EP baseline: EP width, per-GPU batch b_V and step period T_V (ms)."""
    interpolated: bool = dataclasses.field(default=False, compare=False)

    def __post_init__(self) -> None:
        _check(self.context >= 1, "context", "must be >= 1 token")
        _check(self.dv_ms >= 0, "dv_ms", "must be >= 0")
        _check(self.draft_length >= 0, "draft_length", "must be >= 0")
        _check(self.kappa > 0, "kappa", "must be > 0")
        _check(self.profile_batch is None or self.profile_batch >= 1, "profile_batch", ">= 1")
        for field in ("t_draft_att_ms", "t_draft_rest_ms", "baseline_step_ms"):
            value = getattr(self, field)
            _check(value is None or value >= 0, field, "must be >= 0")
        _check(
            self.t_draft_att_ms is None or self.profile_batch is not None,
            "t_draft_att_ms",
            "needs profile_batch (it is scaled by b / b_p)",
        )
        baseline = (self.baseline_ep, self.baseline_batch, self.baseline_step_ms)
        _check(
            all(v is None for v in baseline) or all(v is not None for v in baseline),
            "baseline_ep",
            "baseline_ep, baseline_batch and baseline_step_ms go together",
        )

    @property
    def has_baseline(self) -> bool:
        return self.baseline_step_ms is not None

    def draft_time_s(self, batch: float) -> float:
        """T_draft = (b / b_p) T_draft,att,V + T_draft,rest,V, seconds (0 when not profiled)."""
        total = self.t_draft_rest_ms or 0.0
        if self.t_draft_att_ms is not None and self.profile_batch:
            total += batch / self.profile_batch * self.t_draft_att_ms
        return total / 1e3


@dataclass(frozen=True)
class ColocatedProfile:
    """A colocated profile of one model on one hardware type."""

    model: str
    hardware: str
    points: tuple[ProfilePoint, ...]
    dispatch_intercept_us: float | None = None
    """Fitted tau (us): intercept of dispatch + combine time against routed bytes."""
    gemm_efficiency: float | None = None
    """Fitted u_c: slope of expert GEMM time against FLOPs, as a fraction of P."""
    bandwidth_efficiency: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.points), "points", "must hold at least one point", "ColocatedProfile")
        keys = [(p.context, p.draft_length) for p in self.points]
        _check(len(keys) == len(set(keys)), "points", "repeat a (context, d)", "ColocatedProfile")
        tau = self.dispatch_intercept_us
        _check(tau is None or tau >= 0, "dispatch_intercept_us", ">= 0", "ColocatedProfile")
        for field in ("gemm_efficiency", "bandwidth_efficiency"):
            value = getattr(self, field)
            _check(value is None or 0 < value <= 1, field, "in (0, 1]", "ColocatedProfile")

    def contexts(self, draft_length: int) -> list[int]:
        return sorted(p.context for p in self.points if p.draft_length == draft_length)

    def point(self, context: int, draft_length: int = 0) -> ProfilePoint:
        """The point at (context, d); between two profiled contexts, interpolated in log2(c)."""
        rows = {p.context: p for p in self.points if p.draft_length == draft_length}
        if context in rows:
            return rows[context]
        below = [c for c in rows if c < context]
        above = [c for c in rows if c > context]
        if not below or not above:
            have = ", ".join(format_context(c) for c in sorted(rows)) or "none"
            raise ValueError(
                f"profile of {self.model} has no point for context {format_context(context)} "
                f"and draft length {draft_length} (profiled contexts: {have})"
            )
        return _interpolate(rows[max(below)], rows[min(above)], context)


def _check(ok: bool, field: str, message: str, owner: str = "ProfilePoint") -> None:
    if not ok:
        raise ValueError(f"{owner}.{field} {message}")


def _interpolate(lo: ProfilePoint, hi: ProfilePoint, context: int) -> ProfilePoint:
    w = (math.log2(context) - math.log2(lo.context)) / (
        math.log2(hi.context) - math.log2(lo.context)
    )

    def mix(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a + w * (b - a)

    def between(a: float, b: float) -> float:
        return a + w * (b - a)

    batch = mix(lo.profile_batch, hi.profile_batch)
    return ProfilePoint(
        context=context,
        dv_ms=between(lo.dv_ms, hi.dv_ms),
        draft_length=lo.draft_length,
        kappa=between(lo.kappa, hi.kappa),
        profile_batch=None if batch is None else max(1, round(batch)),
        t_draft_att_ms=mix(lo.t_draft_att_ms, hi.t_draft_att_ms) if batch is not None else None,
        t_draft_rest_ms=mix(lo.t_draft_rest_ms, hi.t_draft_rest_ms),
        interpolated=True,
    )


# -- reading and writing ------------------------------------------------------------------------


def load_profile(path: str | Path, model: str | None = None) -> ColocatedProfile:
    """Read a JSON profile, or the paper's CSV (then `model` picks the rows when it has several)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such profile file")
    if path.suffix.lower() == ".csv":
        return _profile_from_csv(path.read_text(), model, source=str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return profile_from_dict(data, source=str(path))


def save_profile(profile: ColocatedProfile, path: str | Path) -> None:
    """Write `profile` as JSON (the format `load_profile` reads back)."""
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")


def profile_to_dict(profile: ColocatedProfile) -> dict[str, Any]:
    points = []
    for p in profile.points:
        row = dataclasses.asdict(p)
        row.pop("interpolated")
        points.append(row)
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": profile.model,
        "hardware": profile.hardware,
        "fit": {
            "dispatch_intercept_us": profile.dispatch_intercept_us,
            "gemm_efficiency": profile.gemm_efficiency,
            "bandwidth_efficiency": profile.bandwidth_efficiency,
        },
        "points": points,
    }


def profile_from_dict(data: dict[str, Any], source: str = "") -> ColocatedProfile:
    where = source or "profile"
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{where}: 'format' must be {PROFILE_FORMAT!r}")
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{where}: unsupported version {data.get('version')!r}")
    allowed = {f.name for f in dataclasses.fields(ProfilePoint)} - {"interpolated"}
    points = []
    for i, row in enumerate(data.get("points") or ()):
        unknown = sorted(set(row) - allowed)
        if unknown:
            raise ValueError(f"{where}: points[{i}] has unknown field(s) {unknown}")
        try:
            points.append(ProfilePoint(**(row | {"context": parse_context(row.get("context"))})))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: points[{i}]: {exc}") from None
    fit = data.get("fit") or {}
    return ColocatedProfile(
        model=str(data.get("model", "")),
        hardware=str(data.get("hardware", "")),
        points=tuple(points),
        dispatch_intercept_us=fit.get("dispatch_intercept_us"),
        gemm_efficiency=fit.get("gemm_efficiency"),
        bandwidth_efficiency=fit.get("bandwidth_efficiency"),
        source=source,
    )


def _profile_from_csv(text: str, model: str | None, source: str) -> ColocatedProfile:
    reader = csv.DictReader(io.StringIO(text))
    missing = {"model", "context", "d", "bp", "DV_ms", "kappa"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"{source}: CSV profile lacks column(s) {sorted(missing)}")
    rows = list(reader)
    models = sorted({r["model"] for r in rows})
    if model is None and len(models) == 1:
        model = models[0]
    if model is None:
        raise ValueError(f"{source}: holds models {models}; say which one")
    wanted = canonical_model_name(model) or model
    picked = [r for r in rows if (canonical_model_name(r["model"]) or r["model"]) == wanted]
    if not picked:
        raise ValueError(f"{source}: no rows for model {model!r} (has {models})")
    points = tuple(_point_from_csv_row(r) for r in picked)
    return ColocatedProfile(model=wanted, hardware="gb200", points=points, source=source)


def _point_from_csv_row(row: dict[str, str]) -> ProfilePoint:
    return ProfilePoint(
        context=parse_context(row["context"]),
        dv_ms=float(row["DV_ms"]),
        draft_length=int(row["d"]),
        kappa=float(row["kappa"]) if row.get("kappa") else 1.0,
        profile_batch=int(row["bp"]) if row.get("bp") else None,
    )


def bundled_profile(model: str) -> ColocatedProfile | None:
    """The paper's GB200 profile (Table A13) for one of the paper's models, or None (other
    presets and models have no bundled profile)."""
    name = canonical_model_name(model)
    if name is None or name not in _BUNDLED_MODELS:
        return None
    resource = resources.files("vllm_afd.planner").joinpath("data").joinpath(_BUNDLED_CSV)
    if not resource.is_file():
        raise FileNotFoundError(
            f"package data vllm_afd/planner/data/{_BUNDLED_CSV} is missing from this install "
            "(pyproject.toml must list it under [tool.setuptools.package-data])"
        )
    text = resource.read_text()
    return _profile_from_csv(text, name, source=f"bundled {_BUNDLED_CSV} (FastAFD Table A13)")
