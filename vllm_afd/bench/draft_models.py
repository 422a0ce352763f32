"""Speculative-decoding drafts for the tiny models, built offline (no model hub).

Two draft kinds, each tested against the same speculative config colocated
(tests/e2e/test_spec_drafts_e2e.py):

* ``build_eagle_head``: a dense EAGLE-1 head (vLLM's ``EagleLlamaForCausalLM``: ``fc`` over
  the concatenated token embedding and target hidden state, one Llama decoder layer without
  input norm, the target's embedding and LM head shared) for any tiny target. A random head
  would never be accepted, so its weights are derived from the target: the head is a bigram
  table of the target. ``fc`` passes the embedding of the token through (the target hidden
  state is ignored), attention's output projection is zero, and the MLP is a lookup table
  with one intermediate channel per vocabulary token: channel ``j`` fires for the embedding of
  token ``j`` only and writes the LM-head row of ``next[j]``, the target's greedy next token
  after ``j`` alone. Drafts are then the target's prediction from the last token only: often
  right, often not, which is what a test of acceptance counts needs.
* ``default_mtp_model``: a tiny DeepSeek-V3 checkpoint (MLA attention, a dense first layer, an
  MoE layer with a shared expert) with one multi-token-prediction layer
  (``num_nextn_predict_layers = 1``, vLLM's ``DeepSeekMTPModel``, method ``"mtp"``): an MoE
  draft, whose layer (number ``num_hidden_layers``) has routed experts of its own.

Also ``default_eagle3_head`` (a random EAGLE-3 head) and ``default_predictable_target`` (a
tiny model whose embeddings are scaled so that a head derived from it is accepted about half
of the time; the unscaled random models depend on their context too much for any cheap draft).

All are cached like the tiny models (``tiny_models.build_cached``), keyed by a hash of the
target's files and the arguments.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_afd.bench.tiny_models import build_cached, default_cache_dir

if TYPE_CHECKING:
    import torch

#: Bumped whenever the bytes written for the same arguments change; part of the cache key.
FORMAT_VERSION = 3  # 3: EAGLE-3 aux layer ids
#: Pre-activation of the lookup channel of the input token (a sharp one-hot: the others stay
#: within a few units).
LOOKUP_GAIN = 40.0


def _target_digest(target: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(target.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def bigram_table(target: str | Path) -> torch.Tensor:
    """``next[j]``: the target's greedy next token after token ``j`` alone (transformers,
    float32), for every token of its vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.arange(vocab).unsqueeze(1)
        logits = torch.cat([model(input_ids=chunk).logits[:, -1] for chunk in ids.split(256)])
    return logits.argmax(-1)


def _eagle_config(target_config: dict[str, Any]) -> dict[str, Any]:
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target_config["vocab_size"],  # one lookup channel per token
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target_config["max_position_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "vocab_size": target_config["vocab_size"],
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "torch_dtype": target_config.get("dtype") or target_config.get("torch_dtype"),
    }


def eagle_head_weights(
    embed: torch.Tensor, lm_head: torch.Tensor, next_token: torch.Tensor, config: dict
) -> dict[str, torch.Tensor]:
    """The EAGLE-1 checkpoint tensors of the bigram head (names as vLLM's
    ``EagleLlamaForCausalLM`` loads them; no ``embed_tokens`` and no ``lm_head``, so vLLM
    shares the target's)."""
    import torch

    vocab, hidden = embed.shape
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    keys = embed / embed.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    # post_attention_layernorm makes the input's RMS 1, so its norm is sqrt(hidden)
    keys = keys * (LOOKUP_GAIN / hidden**0.5)
    rows = lm_head[next_token]
    values = rows / rows.norm(dim=-1, keepdim=True).clamp(min=1e-6) ** 2
    # channel j's output is about silu(G) * G ~ G^2; scale it so the target row's logit is ~10
    values = values * (10.0 / LOOKUP_GAIN**2)
    prefix = "layers.0."
    tensors = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        prefix + "self_attn.q_proj.weight": torch.zeros(heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": torch.zeros(kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": torch.zeros(kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        prefix + "mlp.gate_proj.weight": keys.clone(),
        prefix + "mlp.up_proj.weight": keys.clone(),
        prefix + "mlp.down_proj.weight": values.t().contiguous(),
    }
    assert tensors[prefix + "mlp.down_proj.weight"].shape == (hidden, vocab)
    return {name: t.contiguous() for name, t in tensors.items()}


def _write_eagle_head(target: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    target_config = json.loads((target / "config.json").read_text())
    config = _eagle_config(target_config)
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    embed = weights["model.embed_tokens.weight"].float()
    lm_head = weights.get("lm_head.weight", embed).float()
    tensors = eagle_head_weights(embed, lm_head, bigram_table(target), config)
    dtype = getattr(torch, config["torch_dtype"] or "float32")
    save_file({n: t.to(dtype) for n, t in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)


def default_eagle_head(target: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The bigram EAGLE-1 head of ``target`` (a tiny model directory), built on first use.

    Use it as ``{"method": "eagle", "model": <this>, "num_speculative_tokens": d}``.
    """
    target = Path(target)
    key = hashlib.sha256(f"eagle-v{FORMAT_VERSION}-{_target_digest(target)}".encode())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"eagle-head-{key.hexdigest()[:16]}"
    return build_cached(final, lambda d: _write_eagle_head(target, d))


# ----------------------------------------------------------------------------- MTP


def _deepseek_v3_config(spec, vocab_size: int, eos_id: int, num_layers: int):
    """A tiny DeepSeek-V3 config: MLA (the CPU kernel's latent size), dense layer 0, MoE
    layers after it with one shared expert, sigmoid routing with the score-correction bias
    (``noaux_tc``), one MTP layer."""
    from transformers import DeepseekV3Config

    from vllm_afd.bench import tiny_models as tm

    common = tm._common_config(spec, vocab_size, eos_id)
    common.update(num_hidden_layers=num_layers, num_key_value_heads=spec.num_attention_heads)
    return DeepseekV3Config(
        **common,
        n_routed_experts=spec.num_experts,
        n_shared_experts=1,
        moe_intermediate_size=spec.moe_intermediate_size,
        intermediate_size=4 * spec.moe_intermediate_size,
        first_k_dense_replace=1,
        kv_lora_rank=tm.MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_nope_head_dim=spec.head_dim,
        qk_rope_head_dim=tm.MLA_ROPE_HEAD_DIM,
        v_head_dim=spec.head_dim,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        # read by vLLM (transformers' V3 has these fixed): V3's router
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def _write_mtp_model(spec, out: Path) -> None:
    """The target's ``num_layers`` layers plus MTP layer ``num_layers``: its decoder block
    (MLA and MoE, like every MoE layer of the target), ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head`` (norm and LM head), in DeepSeek-V3's checkpoint names."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from vllm_afd.bench import tiny_models as tm

    tokenizer = tm.build_tokenizer(spec.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(tm.EOS_TOKEN)
    vocab = len(tokenizer)
    # one more decoder layer than the target: the MTP layer's block
    config = _deepseek_v3_config(spec, vocab, eos_id, spec.num_layers + 1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tm._randomize(model, spec.seed, spec.init_std)
    tm._silence_tokens(model, tokenizer.convert_tokens_to_ids(list(tm.SPECIAL_TOKENS)))
    tensors = tm.checkpoint_state_dict(model)
    mtp = f"model.layers.{spec.num_layers}."
    generator = torch.Generator().manual_seed(spec.seed + 1)
    hidden = spec.hidden_size
    tensors[mtp + "enorm.weight"] = torch.ones(hidden)
    tensors[mtp + "hnorm.weight"] = torch.ones(hidden)
    tensors[mtp + "eh_proj.weight"] = (
        torch.randn(hidden, 2 * hidden, generator=generator) * spec.init_std
    )
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(hidden)
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    dtype = getattr(torch, spec.dtype)
    save_file(
        {n: t.to(dtype).contiguous() for n, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.num_hidden_layers = spec.num_layers
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)


def default_mtp_model(cache_dir: str | Path | None = None, **kwargs: Any) -> Path:
    """A tiny DeepSeek-V3 model with one MTP layer (bfloat16: vLLM's CPU MLA backends), built
    on first use. ``kwargs`` are ``tiny_models.TinyModelSpec`` fields (arch is deepseek_v2,
    whose sizes the CPU MLA kernel takes). Use it with
    ``{"method": "mtp", "num_speculative_tokens": 1}`` (the draft is the target's own MTP
    layer; vLLM builds it as ``DeepSeekMTPModel``)."""
    from vllm_afd.bench.tiny_models import TinyModelSpec

    spec = TinyModelSpec(arch="deepseek_v2", **{"dtype": "bfloat16", **kwargs})
    key = hashlib.sha256(f"mtp-v{FORMAT_VERSION}-{spec.cache_key()}".encode()).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_cached(
        root / f"tiny-mtp-deepseek_v3-{key[:16]}", lambda d: _write_mtp_model(spec, d)
    )


# ----------------------------------------------------------------------------- EAGLE-3 and
# a target drafts can predict


def _write_eagle3_head(target: Path, out: Path, seed: int) -> None:
    """A random EAGLE-3 head (``LlamaForCausalLMEagle3``: ``fc`` over three of the target's
    hidden states, one ``midlayer`` whose attention reads the embedding and the hidden state
    side by side, its own norm and LM head over the full vocabulary)."""
    import torch
    from safetensors.torch import save_file

    config = _eagle_config(json.loads((target / "config.json").read_text()))
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        intermediate_size=4 * config["hidden_size"],
        # vLLM's default aux layers (2, L // 2, L - 3) do not exist in a 2-layer target: the
        # embeddings, the middle layer's and the last layer's outputs instead
        eagle_aux_hidden_state_layer_ids=[0, layers // 2, layers],
    )
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "fc.weight": (hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": (q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q),
        "midlayer.mlp.gate_proj.weight": (config["intermediate_size"], hidden),
        "midlayer.mlp.up_proj.weight": (config["intermediate_size"], hidden),
        "midlayer.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
        "lm_head.weight": (vocab, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=generator) * 0.1 for n, s in shapes.items()}
    for norm in (
        "midlayer.input_layernorm",
        "midlayer.hidden_norm",
        "midlayer.post_attention_layernorm",
        "norm",
    ):
        tensors[norm + ".weight"] = torch.ones(hidden)
    dtype = getattr(torch, config["torch_dtype"] or "float32")
    save_file(
        {n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)


def default_eagle3_head(
    target: str | Path, cache_dir: str | Path | None = None, seed: int = 0
) -> Path:
    """A random EAGLE-3 head for ``target`` (which must implement vLLM's ``SupportsEagle3``,
    e.g. Qwen3-MoE), built on first use. ``{"method": "eagle3", "model": <this>, ...}``."""
    target = Path(target)
    key = hashlib.sha256(f"eagle3-v{FORMAT_VERSION}-{seed}-{_target_digest(target)}".encode())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"eagle3-head-{key.hexdigest()[:16]}"
    return build_cached(final, lambda d: _write_eagle3_head(target, d, seed))


#: Embedding scale of ``default_predictable_target``: the last token then decides the next
#: one about half of the time (greedy, the tiny Qwen3-MoE's own prompts).
PREDICTABLE_EMBED_SCALE = 100.0


def _write_scaled_embedding(source: Path, out: Path, scale: float) -> None:
    from safetensors.torch import load_file, save_file

    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
            continue
        tensors = load_file(str(path))
        name = "model.embed_tokens.weight"
        if name in tensors:
            tensors[name] = tensors[name] * scale
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    for path in out.iterdir():
        path.chmod(0o644)


def default_predictable_target(
    cache_dir: str | Path | None = None, scale: float = PREDICTABLE_EMBED_SCALE, **kwargs: Any
) -> Path:
    """A tiny random model (``tiny_models.default_tiny_model(**kwargs)``) whose token
    embeddings are scaled by ``scale``: the residual stream is dominated by the current token,
    so its next token is often, not always, the one it predicts after that token alone.
    Random models otherwise depend on their context so much that no cheap draft is ever
    accepted; a draft derived from this one (``default_eagle_head``) gets accepted about half
    of the time, and the layers (the experts too) still decide the rest."""
    from vllm_afd.bench.tiny_models import default_tiny_model

    source = default_tiny_model(cache_dir, **kwargs)
    key = hashlib.sha256(f"scaled-v{FORMAT_VERSION}-{scale}-{source.name}".encode()).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"predictable-{source.name}-{key[:12]}"
    return build_cached(final, lambda d: _write_scaled_embedding(source, d, scale))
