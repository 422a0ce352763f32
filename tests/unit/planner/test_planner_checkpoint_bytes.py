"""Experts priced at the checkpoint's real bytes per parameter, not FP8 for every model:
presets, hub ids, and HF configs with and without a quantization_config."""

from __future__ import annotations

import json

import pytest

from vllm_afd.planner import get_hardware, get_model, load_hf_config
from vllm_afd.planner.analytical import expert_flops_rate
from vllm_afd.planner.cli import main
from vllm_afd.planner.memory import ffn_bytes_per_gpu, ffn_pool_candidates
from vllm_afd.planner.models import (
    FP8_BLOCK_BYTES,
    checkpoint_bytes_per_param,
    quantized_bytes_per_param,
)
from vllm_afd.planner.profile_io import bundled_profile

#: DeepSeek-V3's config.json as published (the keys the planner reads).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
#: Qwen3-30B-A3B's config.json (bfloat16, no quantization_config).
QWEN3_30B = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "torch_dtype": "bfloat16",
}
ARCH = (
    "num_layers",
    "num_experts",
    "top_k",
    "hidden_size",
    "moe_intermediate_size",
    "num_kv_heads",
    "head_dim",
    "num_dense_layers",
    "shared_expert_intermediate_size",
    "kv_lora_rank",
)


def write_config(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen3-235b-a22b", 1.0),  # the paper's FP8 presets: the spec's 1 byte, no scales
        ("minimax-m2.5", 1.0),
        ("qwen3.5-397b-a17b", 1.0),
        ("deepseek-v3", FP8_BLOCK_BYTES),  # block FP8 with its float32 scales
        ("deepseek-ai/DeepSeek-V3", FP8_BLOCK_BYTES),
        ("qwen3-30b-a3b", 2.0),  # bfloat16
        ("Qwen/Qwen3-30B-A3B", 2.0),
        ("Qwen/Qwen3-30B-A3B-FP8", FP8_BLOCK_BYTES),
        ("Qwen/Qwen3-235B-A22B", 2.0),  # the bfloat16 original of the paper's FP8 model
        ("Qwen/Qwen3-235B-A22B-FP8", 1.0),
        ("Qwen/Qwen3.5-397B-A17B", 2.0),
    ],
)
def test_presets_and_hub_ids_carry_their_checkpoint_format(name, expected):
    spec = get_model(name)
    assert spec.expert_bytes_per_param == pytest.approx(expected)
    assert spec.dense_bytes_per_param == pytest.approx(expected)


def test_a_hub_id_in_another_format_keeps_the_preset_architecture():
    bf16, fp8 = get_model("Qwen/Qwen3-235B-A22B"), get_model("qwen3-235b-a22b")
    assert bf16.name == "Qwen/Qwen3-235B-A22B"
    assert all(getattr(bf16, f) == getattr(fp8, f) for f in ARCH)
    assert bf16.routed_expert_bytes == pytest.approx(2 * fp8.routed_expert_bytes)
    assert bundled_profile(bf16.name) is not None  # D_V: the paper's profile of that model


@pytest.mark.parametrize(
    ("cfg", "preset"), [(DEEPSEEK_V3, "deepseek-v3"), (QWEN3_30B, "qwen3-30b-a3b")]
)
def test_published_configs_read_as_their_presets(tmp_path, cfg, preset):
    spec, want = load_hf_config(write_config(tmp_path, cfg)), get_model(preset)
    for field in (*ARCH, "expert_bytes_per_param", "dense_bytes_per_param", "q_lora_rank"):
        assert getattr(spec, field) == pytest.approx(getattr(want, field)), field
    assert spec.routed_expert_bytes == pytest.approx(want.routed_expert_bytes)


def test_expert_bytes_of_the_presets():
    # Qwen3-30B-A3B in bfloat16: 58 GB of routed experts (recipes/qwen3_30b_a3b_h200_7to1).
    assert ffn_bytes_per_gpu(get_model("qwen3-30b-a3b"), 1) == pytest.approx(57.98e9, rel=1e-3)
    # DeepSeek-V3: 58 MoE layers x 256 experts x 3 x 7168 x 2048 FP8 weights + block scales.
    params = 58 * 256 * 3 * 7168 * 2048
    assert get_model("deepseek-v3").routed_expert_bytes == pytest.approx(params * (1 + 2**-12))


@pytest.mark.parametrize(
    ("dtype_key", "dtype", "expected"),
    [
        ("torch_dtype", "bfloat16", 2.0),
        ("torch_dtype", "float16", 2.0),
        ("torch_dtype", "float32", 4.0),
        ("dtype", "float32", 4.0),  # transformers 5 writes "dtype"
        (None, None, 2.0),  # unset: bfloat16
    ],
)
def test_unquantized_config_takes_its_dtype_size(dtype_key, dtype, expected):
    cfg = {dtype_key: dtype} if dtype_key else {}
    assert checkpoint_bytes_per_param(cfg) == (expected, expected)


def test_unknown_dtype_and_method_are_refused():
    with pytest.raises(ValueError, match="torch_dtype 'int3'"):
        checkpoint_bytes_per_param({"torch_dtype": "int3"})
    with pytest.raises(ValueError, match="cannot price quantization_config 'hqq'"):
        checkpoint_bytes_per_param({"quantization_config": {"quant_method": "hqq"}})


@pytest.mark.parametrize(
    ("qcfg", "expected"),
    [
        ({"quant_method": "fp8"}, 1.0),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 1 + 4 / 16384),
        ({"quant_method": "mxfp4"}, 0.5 + 1 / 32),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, 0.5 + 1 / 16),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, 1.0),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 0.5 + 2.5 / 128),
        ({"quant_method": "awq", "bits": 4, "group_size": 64}, 0.5 + 2.5 / 64),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1}, 1.0),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 8, "type": "float", "block_structure": [128, 128]}
                    }
                },
            },
            1 + 4 / 16384,
        ),
    ],
)
def test_quantized_formats_with_their_scales(qcfg, expected):
    assert quantized_bytes_per_param(qcfg) == pytest.approx(expected)


def test_layers_a_config_leaves_unquantized_take_the_dtype():
    # FP8 experts only (the project's tiny FP8 checkpoints, vllm_afd.bench.tiny_models).
    fp8_experts = {
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "ignored_layers": ["model.layers.0.self_attn.q_proj", "lm_head"],
        },
    }
    assert checkpoint_bytes_per_param(fp8_experts) == (pytest.approx(1 + 4 / 16384), 2.0)
    # gpt-oss: MXFP4 experts, bfloat16 attention.
    gpt_oss = {
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens"],
        },
    }
    assert checkpoint_bytes_per_param(gpt_oss) == (0.5 + 1 / 32, 2.0)


def test_block_fp8_experts_run_at_the_fp8_rate():
    h200 = get_hardware("h200")
    assert expert_flops_rate(get_model("deepseek-v3"), h200) == h200.fp8_flops
    assert expert_flops_rate(get_model("qwen3-30b-a3b"), h200) == h200.bf16_flops
    assert expert_flops_rate(get_model("Qwen/Qwen3-235B-A22B"), h200) == h200.bf16_flops


def test_bf16_checkpoint_needs_twice_the_ffn_memory():
    h200 = get_hardware("h200")
    fp8 = ffn_pool_candidates(get_model("Qwen/Qwen3-235B-A22B-FP8"), h200)
    bf16 = ffn_pool_candidates(get_model("Qwen/Qwen3-235B-A22B"), h200)
    assert min(fp8) == 2 and min(bf16) == 4  # 227 GB vs 454 GB of experts on 141 GB GPUs


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-30b-a3b"])
def test_plan_runs_for_presets_without_a_bundled_profile(capsys, model):
    assert bundled_profile(model) is None
    assert main(["plan", "--model", model, "--hardware", "gb200", "--context", "8K"]) == 0
    assert "recommended:" in capsys.readouterr().out


def test_a_given_ffn_pool_that_cannot_hold_the_experts_is_refused(capsys):
    """Qwen3-235B-A22B's routed experts (FP8: about 227 GB) do not fit one H200; the planner
    says so and how many FFN GPUs do, instead of predicting a deployment that cannot load."""
    from vllm_afd.planner.memory import check_ffn_fits

    model, hw = get_model("qwen3-235b-a22b"), get_hardware("h200")
    with pytest.raises(ValueError, match=r"do not fit 1 FFN GPU\(s\) of h200.*at least 2 FFN GPUs"):
        check_ffn_fits(model, hw, 1)
    check_ffn_fits(model, hw, 2)
    with pytest.raises(SystemExit):
        main(
            [
                "--model",
                "qwen3-235b-a22b",
                "--hardware",
                "h200",
                "--ffn-gpus",
                "1",
                "--context",
                "8K",
            ]
        )
    assert "do not fit 1 FFN GPU(s) of h200" in capsys.readouterr().err
