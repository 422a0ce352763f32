"""AFD configuration: one frozen, self-validating dataclass, built at the edge.

Two spellings land here: the flags (``--afd-ratio 2:1 --afd-transport shm ...``, added to vLLM's
parser by ``patches.py``) and the long form ``--additional-config '{"afd": {...}}'``. Both end
up as the dict ``VllmConfig.additional_config["afd"]``, which every vLLM process receives, and
``AFDConfig.from_dict`` turns that dict into this dataclass wherever it is needed.

A:F semantics. A attention ranks per F FFN ranks. Attention ranks are vLLM's engine ranks
(data parallel x tensor parallel); the FFN rank count is ``attention_ranks * F / A`` and must be
a whole number. Routed experts are sharded contiguously over the FFN ranks (expert parallel
inside the FFN group), so the expert count must divide evenly.

Every error names the flag (and its ``additional_config`` key) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

#: Flag name -> additional_config key, for error messages and the CLI.
FLAG_KEYS = {
    "--afd-ratio": "ratio",
    "--afd-transport": "transport",
    "--afd-ffn-device": "ffn_device",
    "--afd-timeout": "timeout_s",
    "--afd-ray-address": "ray_address",
    "--afd-microbatches": "microbatches",
    "--afd-ffn-host": "ffn_host",
}
_KEY_FLAGS = {v: k for k, v in FLAG_KEYS.items()}
FFN_DEVICES = ("auto", "cpu", "cuda")
_RATIO_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class AFDConfigError(ValueError):
    """Invalid AFD configuration. The message names the flag and what is allowed."""


def _where(key: str) -> str:
    return f"{_KEY_FLAGS.get(key, key)} (additional_config.afd.{key})"


def afd_section(additional_config: Any) -> dict[str, Any] | None:
    """The raw ``additional_config["afd"]`` dict, or None when AFD is not configured."""
    if not isinstance(additional_config, dict):
        return None
    return additional_config.get("afd") or None


def non_negative_number(text: str) -> float | None:
    """``text`` as a finite number >= 0, or ``None`` when it is not one (callers name the
    setting in their own error)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


def parse_ratio(text: str) -> tuple[int, int] | None:
    """Parse ``"A:F"`` into ``(A, F)``; ``"auto"`` into ``None`` (the planner decides)."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return None
    match = _RATIO_RE.match(str(text))
    if match is None:
        raise AFDConfigError(
            f"{_where('ratio')}: {text!r} is not a ratio; expected A:F with positive integers "
            "A (attention ranks) and F (FFN ranks), e.g. 7:1 or 2:1, or 'auto'"
        )
    attn, ffn = int(match.group(1)), int(match.group(2))
    if attn < 1 or ffn < 1:
        raise AFDConfigError(
            f"{_where('ratio')}: {text!r} has a zero side; A and F must both be >= 1"
        )
    return attn, ffn


@dataclass(frozen=True)
class AFDConfig:
    """User-facing AFD settings (what the flags say), validated on construction."""

    #: ``(A, F)``: A attention ranks per F FFN ranks; ``None`` means "auto" (planner).
    ratio: tuple[int, int] | None
    #: Transport backend name (see ``vllm_afd.transport.available_transports()``).
    transport: str = "shm"
    #: Device of the FFN executors: ``auto`` follows the attention ranks' platform.
    ffn_device: str = "auto"
    #: Bound on one FFN round trip before requests fail, in seconds.
    timeout_s: float = 30.0
    #: Ray cluster address for the FFN group; ``None`` starts a local Ray instance.
    ray_address: str | None = None
    #: Microbatches per step on attention ranks (ping-pong overlap); 1 disables.
    microbatches: int = 2
    #: Interface the FFN ranks listen on (tcp transport). Loopback by default.
    ffn_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        from vllm_afd.transport import available_transports

        if self.transport not in available_transports():
            raise AFDConfigError(
                f"{_where('transport')}: unknown backend {self.transport!r}; allowed: "
                f"{', '.join(available_transports())}"
            )
        if self.ffn_device not in FFN_DEVICES:
            raise AFDConfigError(
                f"{_where('ffn_device')}: {self.ffn_device!r}; allowed: {', '.join(FFN_DEVICES)}"
            )
        if not self.timeout_s > 0:
            raise AFDConfigError(
                f"{_where('timeout_s')}: must be > 0 seconds, got {self.timeout_s}"
            )
        if not 1 <= self.microbatches <= 8:
            raise AFDConfigError(
                f"{_where('microbatches')}: must be an integer in 1..8, got {self.microbatches}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AFDConfig:
        """Build from ``additional_config["afd"]`` (all values may be strings)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise AFDConfigError(
                f"additional_config.afd: unknown key(s) {unknown}; allowed: {sorted(known)}"
            )
        if "ratio" not in raw:
            raise AFDConfigError(f"{_where('ratio')}: required when AFD is configured")
        kwargs: dict[str, Any] = dict(raw)
        kwargs["ratio"] = parse_ratio(raw["ratio"])
        for key, typ in (("timeout_s", float), ("microbatches", int)):
            if key in kwargs:
                kwargs[key] = _coerce(key, kwargs[key], typ)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Inverse of ``from_dict`` (JSON-serialisable)."""
        out = dataclasses.asdict(self)
        out["ratio"] = "auto" if self.ratio is None else f"{self.ratio[0]}:{self.ratio[1]}"
        return out

    def num_ffn_ranks(self, attention_ranks: int) -> int:
        """FFN ranks for ``attention_ranks`` engine ranks; raises if not a whole number."""
        if self.ratio is None:
            raise AFDConfigError(f"{_where('ratio')}: 'auto' must be resolved before placement")
        attn, ffn = self.ratio
        if (attention_ranks * ffn) % attn != 0:
            raise AFDConfigError(
                f"{_where('ratio')}: {attn}:{ffn} does not divide the {attention_ranks} attention "
                f"rank(s) (data parallel x tensor parallel); the attention rank count must be a "
                f"multiple of {attn // math.gcd(attn, ffn)}, e.g. --data-parallel-size {attn}"
            )
        return attention_ranks * ffn // attn


@dataclass(frozen=True)
class MoEModelInfo:
    """What the AFD split needs to know about a model, read from its HF config."""

    architecture: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    #: Indices of the layers that have routed experts.
    moe_layers: tuple[int, ...] = field(default_factory=tuple)

    def check_ffn_ranks(self, num_ffn_ranks: int) -> None:
        if num_ffn_ranks > self.num_experts:
            raise AFDConfigError(
                f"{_where('ratio')}: {num_ffn_ranks} FFN ranks but the model has only "
                f"{self.num_experts} routed experts; use at most {self.num_experts} FFN ranks"
            )
        if self.num_experts % num_ffn_ranks != 0:
            raise AFDConfigError(
                f"{_where('ratio')}: {self.num_experts} routed experts cannot be split evenly "
                f"over {num_ffn_ranks} FFN ranks; the FFN rank count must divide "
                f"{self.num_experts}"
            )


def _coerce(key: str, value: Any, typ: type) -> Any:
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise AFDConfigError(f"{_where(key)}: {value!r} is not a {typ.__name__}") from None


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")


def moe_model_info(hf_config: Any) -> MoEModelInfo:
    """Extract routed-expert geometry from a transformers config; raise if there is none."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    get = lambda k: getattr(text_config, k, None)  # noqa: E731
    num_experts = next((get(k) for k in _EXPERT_KEYS if get(k)), None)
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if not num_experts:
        raise AFDConfigError(
            f"{_where('ratio')}: model {arch} has no routed experts (none of "
            f"{', '.join(_EXPERT_KEYS)} is set in its config.json); AFD splits MoE layers only"
        )
    num_layers = int(get("num_hidden_layers"))
    return MoEModelInfo(
        architecture=arch,
        num_layers=num_layers,
        num_experts=int(num_experts),
        top_k=int(get("num_experts_per_tok") or get("moe_topk") or 1),
        hidden_size=int(get("hidden_size")),
        moe_intermediate_size=int(next(get(k) for k in _INTERMEDIATE_KEYS if get(k))),
        moe_layers=tuple(i for i in range(num_layers) if _is_moe_layer(text_config, i)),
    )


def _is_moe_layer(cfg: Any, i: int) -> bool:
    """Layer ``i`` has routed experts (handles the common sparse-step conventions)."""
    if i in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    first_dense = getattr(cfg, "first_k_dense_replace", None)
    if first_dense is not None and i < first_dense:
        return False
    step = getattr(cfg, "decoder_sparse_step", None) or getattr(cfg, "moe_layer_freq", None) or 1
    return isinstance(step, int) and (i + 1) % step == 0
