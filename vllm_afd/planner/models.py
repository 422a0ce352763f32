"""MoE model descriptions: the paper's three presets and a reader for HF config.json.

Only a few architectural numbers enter the FastAFD model: layers L, routed experts E, top-K,
hidden size H and expert intermediate size I (only H*I matters), and the KV layout of the
attention layers (KV heads, head dim; MLA latent size). Hybrid models split L into full-attention
and linear-attention (gated-delta) layers, because Eq. 3 takes the max per layer type. The memory
model also needs the attention-side weights (embeddings, projections, router, shared experts) and
the per-request linear-attention state.

Conventions that come from the spec, not from configs: attention blocks read `c + offset` tokens
(offset 256; 261 for Qwen3.5, both unexplained by the paper), and Qwen3.5's gated-delta layers cost
1.3677 us per request. A model read from config.json gets offset 256 and a gated-delta time
derived from its recurrent-state size (see `analytical.linear_attention_time`).

Bytes per parameter are the checkpoint's (`checkpoint_bytes_per_param`): FP8 1 byte plus its
block scales, 16-bit 2, 4-bit formats half a byte plus their scales. The paper's three presets
keep the spec's convention, FP8 at exactly 1 byte with no scale bytes (0.02% of the expert
bytes, and the spec's check values need it); the other presets carry their checkpoint's real
format, and a hub id of a checkpoint in another format than its preset's gets that format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_afd.config import EXPERT_KEYS, moe_layer_indices


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one MoE model, as far as the planner needs it."""

    name: str
    num_layers: int
    num_experts: int
    """E: routed experts per MoE layer (shared experts excluded)."""
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    num_linear_layers: int = 0
    """Linear-attention (gated-delta) layers; the rest are full attention."""
    num_dense_layers: int = 0
    """Layers with a dense MLP instead of routed experts (e.g. DeepSeek's first 3); taken to be
    full-attention layers."""
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    kv_lora_rank: int = 0
    """MLA latent width; > 0 switches the KV layout to one latent head per request."""
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_offset_tokens: int = 256
    """Tokens added to the context in each attention block (spec: 256; Qwen3.5: 261)."""
    linear_request_time: float | None = None
    """Seconds per request per linear-attention layer; None derives it from the state size."""
    expert_bytes_per_param: float = 1.0
    """Routed-expert weight bytes per parameter, scales included (FP8: 1; default the paper's)."""
    dense_bytes_per_param: float = 1.0
    """Bytes per parameter of the other linear layers (projections, router, shared experts)."""
    embedding_bytes_per_param: float = 2.0
    kv_bytes_per_elem: int = 2
    ssm_state_bytes_per_elem: int = 4
    conv_state_bytes_per_elem: int = 2

    def __post_init__(self) -> None:
        positive = ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size")
        for field in positive + ("num_attention_heads", "num_kv_heads", "head_dim"):
            _require(getattr(self, field) >= 1, self, field, "must be >= 1")
        _require(self.top_k <= self.num_experts, self, "top_k", "must be <= num_experts")
        _require(self.num_linear_layers >= 0, self, "num_linear_layers", "must be >= 0")
        _require(self.num_dense_layers >= 0, self, "num_dense_layers", "must be >= 0")
        _require(self.num_moe_layers >= 1, self, "num_dense_layers", "leaves no MoE layer")
        _require(
            self.num_dense_layers <= self.num_full_layers,
            self,
            "num_dense_layers",
            "must not exceed the full-attention layers",
        )
        _require(self.attn_offset_tokens >= 0, self, "attn_offset_tokens", "must be >= 0")
        for field in ("expert_bytes_per_param", "dense_bytes_per_param", "kv_bytes_per_elem"):
            _require(getattr(self, field) > 0, self, field, "must be > 0")
        if self.num_linear_layers and self.linear_request_time is None:
            _require(self.linear_state_elems > 0, self, "linear_num_value_heads", "needed (> 0)")

    # -- layer structure -------------------------------------------------------------------
    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_linear_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def gqa_group(self) -> int:
        """Query heads per KV block (MLA: all heads share the latent)."""
        if self.is_mla:
            return self.num_attention_heads
        return max(1, self.num_attention_heads // self.num_kv_heads)

    # -- attention KV layout ---------------------------------------------------------------
    @property
    def kv_blocks_per_request(self) -> int:
        """Attention blocks per request in a full-attention layer (A1's N = n * this)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def kv_block_bytes_per_token(self) -> float:
        """Bytes one block reads per context token (spec: 4 * d_h for BF16 K and V)."""
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes_per_elem
        return 2 * self.head_dim * self.kv_bytes_per_elem

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token over all full-attention layers."""
        per_layer = self.kv_blocks_per_request * self.kv_block_bytes_per_token
        return per_layer * self.num_full_layers

    @property
    def linear_state_elems(self) -> int:
        """Recurrent-state elements per request per linear-attention layer."""
        return self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim

    @property
    def linear_conv_elems(self) -> int:
        channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        channels += self.linear_num_value_heads * self.linear_value_head_dim
        return max(0, self.linear_conv_kernel - 1) * channels

    @property
    def linear_state_bytes_per_layer(self) -> float:
        ssm = self.linear_state_elems * self.ssm_state_bytes_per_elem
        return ssm + self.linear_conv_elems * self.conv_state_bytes_per_elem

    @property
    def linear_state_bytes_per_request(self) -> float:
        return self.linear_state_bytes_per_layer * self.num_linear_layers

    # -- weights ---------------------------------------------------------------------------
    @property
    def expert_params_per_layer(self) -> int:
        """Routed-expert parameters of one MoE layer: E experts of gate, up and down (3*H*I)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes_per_layer(self) -> float:
        return self.expert_params_per_layer * self.expert_bytes_per_param

    @property
    def routed_expert_bytes(self) -> float:
        return self.expert_bytes_per_layer * self.num_moe_layers

    @property
    def attention_side_bytes(self) -> float:
        """Weights an attention GPU holds: everything except the routed experts."""
        dense = self._attention_params() + self._linear_attention_params() + self._mlp_params()
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return dense * self.dense_bytes_per_param + embed * self.embedding_bytes_per_param

    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            q_in = self.q_lora_rank or h
            q_dim = heads * (self.head_dim + self.qk_rope_head_dim)
            q = (h * self.q_lora_rank if self.q_lora_rank else 0) + q_in * q_dim
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv += self.kv_lora_rank * heads * 2 * self.head_dim
            per_layer = q + kv + heads * self.head_dim * h
        else:
            per_layer = h * self.head_dim * (2 * heads + 2 * self.num_kv_heads)
        return per_layer * self.num_full_layers

    def _linear_attention_params(self) -> int:
        h = self.hidden_size
        key = self.linear_num_key_heads * self.linear_key_head_dim
        value = self.linear_num_value_heads * self.linear_value_head_dim
        per_layer = h * (2 * key + 2 * value + 2 * self.linear_num_value_heads) + value * h
        return per_layer * self.num_linear_layers

    def _mlp_params(self) -> int:
        h = self.hidden_size
        router = h * self.num_experts * self.num_moe_layers
        shared = 3 * h * self.shared_expert_intermediate_size * self.num_moe_layers
        dense = 3 * h * self.dense_intermediate_size * self.num_dense_layers
        return router + shared + dense


def _require(ok: bool, spec: ModelSpec, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"ModelSpec({spec.name!r}).{field} {message}")


MINIMAX_M25 = ModelSpec(
    name="minimax-m2.5",
    num_layers=62,
    num_experts=256,
    top_k=8,
    hidden_size=3072,
    moe_intermediate_size=1536,
    num_attention_heads=48,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=200064,
)

QWEN3_235B = ModelSpec(
    name="qwen3-235b-a22b",
    num_layers=94,
    num_experts=128,
    top_k=8,
    hidden_size=4096,
    moe_intermediate_size=1536,
    num_attention_heads=64,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
)

QWEN35_397B = ModelSpec(
    name="qwen3.5-397b-a17b",
    num_layers=60,
    num_experts=512,
    top_k=10,
    hidden_size=4096,
    moe_intermediate_size=1024,
    num_attention_heads=32,
    num_kv_heads=2,
    head_dim=256,
    vocab_size=248320,
    num_linear_layers=45,
    shared_expert_intermediate_size=1024,
    linear_num_key_heads=16,
    linear_num_value_heads=64,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel=4,
    attn_offset_tokens=261,
    linear_request_time=1.3677e-6,
)

#: Block FP8 (DeepSeek-V3's format, also Qwen's -FP8 releases): one float8 byte per weight
#: and one float32 scale per 128 x 128 block.
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)

DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3",
    num_layers=61,
    num_experts=256,
    top_k=8,
    hidden_size=7168,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_kv_heads=128,
    head_dim=128,
    vocab_size=129280,
    num_dense_layers=3,
    shared_expert_intermediate_size=2048,
    dense_intermediate_size=18432,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    q_lora_rank=1536,
    expert_bytes_per_param=FP8_BLOCK_BYTES,
    dense_bytes_per_param=FP8_BLOCK_BYTES,
)

QWEN3_30B = ModelSpec(
    name="qwen3-30b-a3b",
    num_layers=48,
    num_experts=128,
    top_k=8,
    hidden_size=2048,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
    expert_bytes_per_param=2.0,  # the hub checkpoint is bfloat16
    dense_bytes_per_param=2.0,
)

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m for m in (MINIMAX_M25, QWEN3_235B, QWEN35_397B, DEEPSEEK_V3, QWEN3_30B)
}

# Names under which the presets appear in the paper, its CSV and on the Hugging Face hub.
_ALIASES = {
    "minimax-m2.5": "minimax-m2.5",
    "minimaxai/minimax-m2.5": "minimax-m2.5",
    "qwen3": "qwen3-235b-a22b",
    "qwen3-235b": "qwen3-235b-a22b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "qwen3.5": "qwen3.5-397b-a17b",
    "qwen3.5-397b": "qwen3.5-397b-a17b",
    "qwen3.5-397b-a17b": "qwen3.5-397b-a17b",
    "qwen/qwen3.5-397b-a17b": "qwen3.5-397b-a17b",
    "deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-v3-0324": "deepseek-v3",
    "deepseek-ai/deepseek-r1": "deepseek-v3",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
}

#: Hub checkpoints stored in another format than their preset's: bytes per parameter of their
#: experts and linear layers. The paper's presets are the FP8 releases; these are the bfloat16
#: originals, and Qwen3-30B-A3B's FP8 release (block FP8, scales included).
_HUB_BYTES_PER_PARAM = {
    "qwen/qwen3-235b-a22b": 2.0,
    "qwen/qwen3-235b-a22b-instruct-2507": 2.0,
    "qwen/qwen3.5-397b-a17b": 2.0,
    "qwen/qwen3-30b-a3b-fp8": FP8_BLOCK_BYTES,
    "qwen/qwen3-30b-a3b-instruct-2507-fp8": FP8_BLOCK_BYTES,
}


def canonical_model_name(name: str) -> str | None:
    """The preset name for a paper/hub/preset spelling (`Qwen3`, `Qwen/Qwen3-235B-A22B-FP8`)."""
    key = name.strip().lower()
    for suffix in ("-fp8", "-instruct-2507"):
        key = key.removesuffix(suffix)
    return _ALIASES.get(key)


def get_model(name_or_path: str) -> ModelSpec:
    """A preset (any alias) or a local config.json / model directory.

    A hub id whose checkpoint is stored in another format than its preset's (the bfloat16
    originals of the paper's FP8 models) gets the preset's architecture at that checkpoint's
    bytes per parameter, under the hub id as its name.
    """
    preset = canonical_model_name(name_or_path)
    if preset is not None:
        bytes_per_param = _HUB_BYTES_PER_PARAM.get(name_or_path.strip().lower())
        if bytes_per_param is None:
            return MODEL_PRESETS[preset]
        return replace(
            MODEL_PRESETS[preset],
            name=name_or_path.strip(),
            expert_bytes_per_param=bytes_per_param,
            dense_bytes_per_param=bytes_per_param,
        )
    path = Path(name_or_path)
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".json"):
        return load_hf_config(path)
    raise ValueError(
        f"unknown model {name_or_path!r}; allowed: {', '.join(MODEL_PRESETS)} "
        "or a path to a Hugging Face config.json / model directory"
    )


# -- Hugging Face config.json -------------------------------------------------------------------


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a HF config.json (or a directory holding one) into a `ModelSpec`.

    Raises ValueError naming the file when the model has no routed experts or misses a key.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file}: no such config file")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    cfg = {**raw, **(raw.get("text_config") or {})}
    return _spec_from_config(cfg, file)


def _spec_from_config(cfg: dict[str, Any], file: Path) -> ModelSpec:
    experts = next((int(cfg[k]) for k in EXPERT_KEYS if cfg.get(k)), 0)
    if experts <= 0:
        raise ValueError(
            f"{file}: model has no routed experts (none of {', '.join(EXPERT_KEYS)} is set); "
            "AFD needs a mixture-of-experts model"
        )
    layers = _get_int(cfg, file, "num_hidden_layers")
    hidden = _get_int(cfg, file, "hidden_size")
    heads = _get_int(cfg, file, "num_attention_heads")
    moe_inter = cfg.get("moe_intermediate_size") or _get_int(cfg, file, "intermediate_size")
    expert_bytes, dense_bytes = checkpoint_bytes_per_param(cfg, file)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or file.parent.name or file.stem),
        num_layers=layers,
        num_experts=experts,
        top_k=_get_int(cfg, file, "num_experts_per_tok"),
        hidden_size=hidden,
        moe_intermediate_size=int(moe_inter),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=_head_dim(cfg, hidden, heads),
        vocab_size=int(cfg.get("vocab_size") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_linear_layers=_count_linear_layers(cfg, layers),
        num_dense_layers=_count_dense_layers(cfg, layers),
        shared_expert_intermediate_size=_shared_size(cfg),
        dense_intermediate_size=_dense_size(cfg),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads") or 0),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads") or 0),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim") or 0),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim") or 0),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 0),
        expert_bytes_per_param=expert_bytes,
        dense_bytes_per_param=dense_bytes,
    )


def _get_int(cfg: dict[str, Any], file: Path, key: str) -> int:
    if not cfg.get(key):
        raise ValueError(f"{file}: missing required key {key!r}")
    return int(cfg[key])


def _head_dim(cfg: dict[str, Any], hidden: int, heads: int) -> int:
    if cfg.get("kv_lora_rank"):  # MLA: the value head dim sizes the output projection
        return int(cfg.get("v_head_dim") or cfg.get("qk_nope_head_dim") or hidden // heads)
    return int(cfg.get("head_dim") or hidden // heads)


def _count_linear_layers(cfg: dict[str, Any], layers: int) -> int:
    types = cfg.get("layer_types")
    if types:
        return sum(1 for t in types if "linear" in str(t))
    interval = int(cfg.get("full_attention_interval") or 0)
    if interval > 1:
        return sum(1 for i in range(layers) if (i + 1) % interval != 0)
    return 0


def _count_dense_layers(cfg: dict[str, Any], layers: int) -> int:
    return layers - len(moe_layer_indices(cfg.get, layers))


def _dense_size(cfg: dict[str, Any]) -> int:
    """`intermediate_size` is the dense MLP's only when experts have their own size key."""
    if not cfg.get("moe_intermediate_size"):
        return 0
    return int(cfg.get("intermediate_size") or 0)


def _shared_size(cfg: dict[str, Any]) -> int:
    if cfg.get("shared_expert_intermediate_size"):
        return int(cfg["shared_expert_intermediate_size"])
    shared = int(cfg.get("n_shared_experts") or 0)
    return shared * int(cfg.get("moe_intermediate_size") or 0)


#: Bytes per element of the dtype names configs use (``torch_dtype`` / ``dtype``).
_DTYPE_BYTES = {
    "float64": 8.0,
    "float32": 4.0,
    "float": 4.0,
    "float16": 2.0,
    "half": 2.0,
    "bfloat16": 2.0,
    "float8_e4m3fn": 1.0,
    "float8_e5m2": 1.0,
}
#: Keys under which quantization configs list the layers they leave unquantized.
_IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert", "ignore", "exclude_modules")


def dtype_bytes(cfg: dict[str, Any], file: Path | str = "config.json") -> float:
    """Bytes per element of the checkpoint's ``torch_dtype`` (``dtype``); bfloat16 if unset."""
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"{file}: unknown torch_dtype {name!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _group_bytes(bits: float, group_size: int, scale_bytes: float, zero: bool = False) -> float:
    """Bytes per weight of ``bits``-bit weights with one scale (and zero point) per group."""
    per_group = scale_bytes + (bits / 8 if zero else 0)
    return bits / 8 + (per_group / group_size if group_size > 0 else 0)


def quantized_bytes_per_param(qcfg: dict[str, Any], file: Path | str = "config.json") -> float:
    """Bytes per quantized weight, scales included, of a ``quantization_config``.

    FP8 (``fp8``, ``fbgemm_fp8``, ModelOpt FP8): 1 byte, plus a float32 scale per block when it
    has ``weight_block_size`` (per-tensor and per-channel scales are negligible). MXFP4: 4 bits
    and one byte of scale per 32; NVFP4: 4 bits and one FP8 scale per 16. GPTQ / AWQ /
    AutoRound: ``bits`` plus an fp16 scale and a zero point per ``group_size`` (128 unless
    given). compressed-tensors: its first group's ``num_bits`` with group or block scales.
    ValueError for a method it does not know, rather than a guess.
    """
    method = str(qcfg.get("quant_method", "")).lower()
    algo = str(qcfg.get("quant_algo", "")).lower()
    if method in ("fp8", "fbgemm_fp8") or (method == "modelopt" and algo == "fp8"):
        block = qcfg.get("weight_block_size")
        return 1.0 + (4 / (int(block[0]) * int(block[1])) if block else 0.0)
    if method == "mxfp4":
        return _group_bytes(4, 32, 1)
    if method in ("nvfp4", "modelopt_fp4") or (method == "modelopt" and "fp4" in algo):
        return _group_bytes(4, int(qcfg.get("group_size") or 16), 1)
    if method in ("gptq", "awq", "auto-round", "gptq_marlin", "awq_marlin"):
        bits = int(qcfg.get("bits") or qcfg.get("w_bit") or 4)
        group = int(qcfg.get("group_size") or qcfg.get("q_group_size") or 128)
        return _group_bytes(bits, group, 2, zero=True)
    if method == "compressed-tensors":
        groups = list((qcfg.get("config_groups") or {}).values())
        weights = (groups[0] if groups else {}).get("weights") or {}
        if weights.get("num_bits"):
            bits = int(weights["num_bits"])
            block = weights.get("block_structure")
            if block:
                return _group_bytes(bits, int(block[0]) * int(block[1]), 4)
            group = int(weights.get("group_size") or 0)
            return _group_bytes(bits, group, 1 if bits == 4 and group == 16 else 2)
    raise ValueError(
        f"{file}: cannot price quantization_config {qcfg.get('quant_method')!r}"
        f"{f' ({algo})' if algo else ''}: known are fp8, fbgemm_fp8, modelopt (FP8, NVFP4), "
        "mxfp4, nvfp4, gptq, awq, auto-round and compressed-tensors"
    )


def checkpoint_bytes_per_param(
    cfg: dict[str, Any], file: Path | str = "config.json"
) -> tuple[float, float]:
    """``(expert, dense)`` bytes per parameter of the checkpoint a HF config describes.

    No ``quantization_config``: the ``torch_dtype``'s size for both. Quantized: the format's
    bytes (``quantized_bytes_per_param``) for the experts, and for the other linear layers too
    unless the config leaves attention unquantized (gpt-oss' MXFP4, FP8-experts checkpoints),
    in which case they take the ``torch_dtype``'s size.
    """
    qcfg = cfg.get("quantization_config") or {}
    if not qcfg:
        size = dtype_bytes(cfg, file)
        return size, size
    experts = quantized_bytes_per_param(qcfg, file)
    ignored = [str(n) for key in _IGNORE_KEYS for n in qcfg.get(key) or ()]
    dense = dtype_bytes(cfg, file) if any("attn" in n for n in ignored) else experts
    return experts, dense
