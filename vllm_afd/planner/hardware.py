"""Hardware descriptions for the AFD planner.

The FastAFD model (planner-spec.md) needs few hardware numbers: HBM bandwidth and its achieved
fraction u, the per-SM bandwidth floor and SM count of the attention wave model (A1), the FP8 rate
P with the fitted GEMM efficiency u_c and the fitted dispatch intercept tau of the FFN service
model (A2). The planner adds HBM capacity (for the batch), BF16 rate and kernel tile sizes (for
near-free parallelism) and the NVLink domain size (for the candidate ratios).

`gb200` carries the paper's constants exactly and is the only preset marked `calibrated=True`.
`b200`, `h200` and `h100` come from public datasheets; their u, u_c and tau are the GB200 fits
copied over, and their per-SM bandwidth is scaled from GB200's. They stay `calibrated=False`
until a colocated profile refits tau and u_c (see `profile_io.ColocatedProfile`).

All quantities are SI: bytes, bytes/s, operations/s, seconds. HBM capacity is the total memory
nvidia-smi reports (the datasheet's "GB" are GiB on these parts).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 2**20


@dataclass(frozen=True)
class Hardware:
    """One GPU type and the NVLink domain it sits in."""

    name: str
    hbm_bandwidth: float
    """BW: HBM bandwidth, bytes/s."""
    hbm_capacity: float
    """Total HBM per GPU, bytes."""
    num_sms: int
    """S_SM: streaming multiprocessors per GPU."""
    sm_bandwidth: float
    """BW_SM: bandwidth one SM pulls from HBM, bytes/s (the partial-wave floor of A1)."""
    fp8_flops: float
    """P: dense FP8 tensor rate, ops/s."""
    bf16_flops: float
    """Dense BF16 tensor rate, ops/s (attention MMAs in the near-free-parallelism model)."""
    bandwidth_efficiency: float = 0.89
    """u: achieved fraction of BW for streaming reads."""
    gemm_efficiency: float = 0.3347407189
    """u_c: achieved fraction of P in the expert grouped GEMM (a fit, not a maximum)."""
    dispatch_intercept: float = 42.834448717e-6
    """tau: fixed per-layer FFN service term (dispatch + combine intercept), seconds."""
    gpus_per_node: int = 4
    nvlink_domain: int = 72
    """GPUs reachable over NVLink: bounds the AFD deployment and the wide-EP width."""
    ffn_pool_gpus: int | None = None
    """FFN pool size the planner uses by default (GB200: one 4-GPU node, as in the paper);
    None lets it search every pool size that holds the routed experts."""
    gemm_tile_m: int = 64
    """Rows per grouped-GEMM tile (near-free parallelism granularity)."""
    gemm_tile_n: int = 128
    """Columns per grouped-GEMM tile."""
    attn_tile_m: int = 64
    """Query rows (draft positions x GQA group) per decode-attention tile."""
    calibrated: bool = False
    """True when u, u_c and tau were fitted on this hardware."""
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("hbm_bandwidth", "hbm_capacity", "sm_bandwidth", "fp8_flops", "bf16_flops"):
            _require(getattr(self, field) > 0, field, "must be > 0")
        for field in ("bandwidth_efficiency", "gemm_efficiency"):
            _require(0 < getattr(self, field) <= 1, field, "must be in (0, 1]")
        _require(self.dispatch_intercept >= 0, "dispatch_intercept", "must be >= 0 seconds")
        for field in ("num_sms", "gpus_per_node"):
            _require(getattr(self, field) >= 1, field, "must be >= 1")
        pool = self.ffn_pool_gpus
        _require(
            pool is None or 1 <= pool < self.nvlink_domain,
            "ffn_pool_gpus",
            "must be in [1, nvlink_domain) or None",
        )
        for field in ("gemm_tile_m", "gemm_tile_n", "attn_tile_m"):
            _require(getattr(self, field) >= 1, field, "must be >= 1")
        _require(self.nvlink_domain >= 2, "nvlink_domain", "must be >= 2 GPUs")
        _require(bool(self.name), "name", "must not be empty")

    @property
    def effective_bandwidth(self) -> float:
        """u * BW, bytes/s."""
        return self.bandwidth_efficiency * self.hbm_bandwidth


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"Hardware.{field} {message}")


def _scaled_sm_bandwidth(hbm_bandwidth: float, num_sms: int) -> float:
    """Per-SM bandwidth keeping GB200's ratio S_SM * BW_SM / BW (an estimate)."""
    return 107e9 * (hbm_bandwidth / 7.93e12) * (152 / num_sms)


GB200 = Hardware(
    name="gb200",
    hbm_bandwidth=7.93e12,
    hbm_capacity=189471 * MIB,
    num_sms=152,
    sm_bandwidth=107e9,
    fp8_flops=5e15,
    bf16_flops=2.5e15,
    gpus_per_node=4,
    nvlink_domain=72,
    ffn_pool_gpus=4,
    calibrated=True,
    source="FastAFD (arXiv 2611.07149) Appendix C constants; capacity from nvidia-smi",
)

_DATASHEET = "public datasheet; u, u_c, tau copied from GB200; BW_SM scaled from GB200"

B200 = Hardware(
    name="b200",
    hbm_bandwidth=8.0e12,
    hbm_capacity=183359 * MIB,
    num_sms=148,
    sm_bandwidth=_scaled_sm_bandwidth(8.0e12, 148),
    fp8_flops=4.5e15,
    bf16_flops=2.25e15,
    gpus_per_node=8,
    nvlink_domain=8,
    source=_DATASHEET,
)

H200 = Hardware(
    name="h200",
    hbm_bandwidth=4.8e12,
    hbm_capacity=143771 * MIB,
    num_sms=132,
    sm_bandwidth=_scaled_sm_bandwidth(4.8e12, 132),
    fp8_flops=1.979e15,
    bf16_flops=0.989e15,
    gpus_per_node=8,
    nvlink_domain=8,
    source=_DATASHEET,
)

H100 = Hardware(
    name="h100",
    hbm_bandwidth=3.35e12,
    hbm_capacity=81559 * MIB,
    num_sms=132,
    sm_bandwidth=_scaled_sm_bandwidth(3.35e12, 132),
    fp8_flops=1.979e15,
    bf16_flops=0.989e15,
    gpus_per_node=8,
    nvlink_domain=8,
    source=_DATASHEET,
)

HARDWARE_PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (GB200, B200, H200, H100)}


def get_hardware(name_or_path: str) -> Hardware:
    """A preset by name (case-insensitive) or a YAML/JSON file with `Hardware` fields."""
    preset = HARDWARE_PRESETS.get(name_or_path.lower())
    if preset is not None:
        return preset
    path = Path(name_or_path)
    if path.suffix.lower() in (".yaml", ".yml", ".json") and path.is_file():
        return load_hardware(path)
    raise ValueError(
        f"unknown hardware {name_or_path!r}; allowed: {', '.join(HARDWARE_PRESETS)} "
        "or a .yaml/.json file with Hardware fields"
    )


def load_hardware(path: str | Path) -> Hardware:
    """Read a hardware file. An optional `base: <preset>` key inherits every unset field."""
    path = Path(path)
    data = _read_mapping(path)
    base_name = data.pop("base", None)
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown hardware field(s) {unknown}; allowed: {sorted(known)}")
    if base_name is not None:
        if str(base_name).lower() not in HARDWARE_PRESETS:
            raise ValueError(f"{path}: base {base_name!r} is not one of {list(HARDWARE_PRESETS)}")
        data.setdefault("calibrated", False)
        return dataclasses.replace(HARDWARE_PRESETS[str(base_name).lower()], **data)
    try:
        return Hardware(**data)
    except TypeError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_mapping(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of Hardware fields")
    return dict(data)
