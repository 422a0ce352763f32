"""FFN-side fixtures: tiny checkpoints of several MoE families, and their experts read back
from the checkpoint as ``reference.SiluMulExperts`` (the test's own reading, per family)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_afd.testing.reference import SiluMulExperts

#: Families ``vllm_afd.bench.tiny_models`` builds, and one whose expert tensors the old regex
#: loader did not read (Granite-MoE: fused ``input_linear`` / ``output_linear`` per layer).
TINY_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2")
FAMILIES = (*TINY_ARCHS, "granitemoe")
#: Fused expert tensors with biases and its own activation (no SiluMulExperts reference): the
#: single-rank layer is the reference. Its loader slices by the EP group's rank (patch F3).
GPT_OSS = "gpt_oss"


def build_with_transformers(arch: str, out_dir: Path) -> Path:
    """A 2-layer, 8-expert, top-2 model of ``arch`` written by transformers offline."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"layer_types": ["full_attention"] * 2, "head_dim": 32} if arch == "gpt_oss" else {}
    config = AutoConfig.for_model(
        arch,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """``family_model(arch)`` -> checkpoint directory (built once per session)."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            if arch in ("granitemoe", "gpt_oss"):
                built[arch] = str(build_with_transformers(arch, tmp_path_factory.mktemp(arch)))
            else:
                from vllm_afd.bench.tiny_models import default_tiny_model

                built[arch] = str(default_tiny_model(arch=arch))
        return built[arch]

    return get


def model_info(model_dir: str):
    """``config.moe_model_info`` of the checkpoint (experts, top-k, MoE layer numbers)."""
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    return moe_model_info(AutoConfig.from_pretrained(model_dir))


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def reference_experts(model_dir: str, arch: str, layer: int) -> SiluMulExperts:
    """All routed experts of ``layer``, read from the checkpoint by the family's names."""
    tensors = _tensors(model_dir)
    if arch == "granitemoe":
        prefix = f"model.layers.{layer}.block_sparse_moe"
        return SiluMulExperts(
            tensors[f"{prefix}.input_linear.weight"], tensors[f"{prefix}.output_linear.weight"]
        )
    from vllm_afd.bench.tiny_models import CHECKPOINT_NAMES

    names = CHECKPOINT_NAMES[arch]
    num_experts = model_info(model_dir).num_experts
    w13, w2 = [], []
    for e in range(num_experts):
        gate, up, down = (tensors[n] for n in names.routed_names(layer, e))
        w13.append(torch.cat([gate, up]))
        w2.append(down)
    return SiluMulExperts(torch.stack(w13), torch.stack(w2))
