"""Inputs: model presets and config.json, hardware presets and files, colocated profiles."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vllm_afd.planner import (
    ColocatedProfile,
    ProfilePoint,
    afd_step,
    bundled_profile,
    get_hardware,
    get_model,
    load_hf_config,
    load_profile,
    parse_context,
    save_profile,
)
from vllm_afd.planner.models import canonical_model_name

# shared/ lies beside the checkout (development machines and CI alike).
SHARED_CSV = Path(__file__).resolve().parents[4] / "shared/papers/fastafd-profile-inputs.csv"
BUNDLED_CSV = Path(__file__).parents[3] / "vllm_afd/planner/data/fastafd_gb200_profile.csv"


def write_config(tmp_path: Path, name: str, cfg: dict) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 94,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "quantization_config": {"quant_method": "fp8"},
}


# -- models ---------------------------------------------------------------------------------------


def test_presets_carry_the_spec_dimensions():
    dims = {
        "minimax-m2.5": (62, 256, 8, 3072, 1536, 8, 128, 0),
        "qwen3-235b-a22b": (94, 128, 8, 4096, 1536, 4, 128, 0),
        "qwen3.5-397b-a17b": (60, 512, 10, 4096, 1024, 2, 256, 45),
    }
    for name, expected in dims.items():
        m = get_model(name)
        got = (m.num_layers, m.num_experts, m.top_k, m.hidden_size, m.moe_intermediate_size)
        got += (m.num_kv_heads, m.head_dim, m.num_linear_layers)
        assert got == expected, name


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("Qwen3", "qwen3-235b-a22b"),
        ("Qwen/Qwen3-235B-A22B-FP8", "qwen3-235b-a22b"),
        ("MiniMax-M2.5", "minimax-m2.5"),
        ("Qwen3.5", "qwen3.5-397b-a17b"),
        ("llama", None),
    ],
)
def test_model_aliases(alias, name):
    assert canonical_model_name(alias) == name


def test_qwen3_moe_config_matches_the_preset(tmp_path, gb200):
    spec = load_hf_config(write_config(tmp_path, "Qwen3-235B-A22B", QWEN3_MOE))
    preset = get_model("qwen3-235b-a22b")
    for field in ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size"):
        assert getattr(spec, field) == getattr(preset, field), field
    assert spec.num_kv_heads == 4 and spec.head_dim == 128 and spec.num_dense_layers == 0
    assert spec.expert_bytes_per_param == 1.0
    point = ProfilePoint(4096, 5.789)
    step = afd_step(spec, gb200, point, 198, 7, 4)
    assert step.step_s * 1e3 == pytest.approx(47.649, abs=0.01)


def test_mixtral_config_uses_local_experts_and_intermediate_size(tmp_path):
    cfg = {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    }
    spec = load_hf_config(write_config(tmp_path, "mixtral", cfg) / "config.json")
    assert (spec.num_experts, spec.top_k, spec.moe_intermediate_size) == (8, 2, 14336)
    assert spec.head_dim == 128  # hidden / heads
    assert spec.expert_bytes_per_param == 2.0  # BF16 checkpoint
    assert spec.kv_bytes_per_token == 32 * 8 * 2 * 128 * 2


def test_deepseek_v3_config_is_mla_with_dense_first_layers(tmp_path):
    cfg = {
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
        "quantization_config": {"quant_method": "fp8"},
    }
    spec = load_hf_config(write_config(tmp_path, "dsv3", cfg))
    assert (spec.num_experts, spec.num_dense_layers, spec.num_moe_layers) == (256, 3, 58)
    assert spec.is_mla and spec.kv_blocks_per_request == 1
    assert spec.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert spec.shared_expert_intermediate_size == 2048
    # Total parameters come out near DeepSeek-V3's published 671B.
    total = spec.routed_expert_bytes + spec.attention_side_bytes  # FP8: bytes ~ params
    assert 640e9 < total < 700e9


def test_hybrid_config_counts_linear_layers(tmp_path):
    text = {
        "num_hidden_layers": 60,
        "hidden_size": 4096,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    nested = {"model_type": "qwen3_5_moe", "text_config": text}
    spec = load_hf_config(write_config(tmp_path, "q35", nested))
    assert (spec.num_linear_layers, spec.num_full_layers) == (45, 15)
    listed = text | {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    listed["num_hidden_layers"] = 4
    assert load_hf_config(write_config(tmp_path, "q35b", listed)).num_linear_layers == 3
    assert spec.linear_request_time is None and spec.linear_state_bytes_per_request > 0


def test_dense_model_raises_naming_the_file(tmp_path):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    }
    directory = write_config(tmp_path, "llama", cfg)
    with pytest.raises(ValueError, match="no routed experts") as err:
        load_hf_config(directory)
    assert str(directory / "config.json") in str(err.value)


def test_missing_key_and_unknown_model_are_named(tmp_path):
    cfg = dict(QWEN3_MOE)
    del cfg["num_experts_per_tok"]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_hf_config(write_config(tmp_path, "broken", cfg))
    with pytest.raises(ValueError, match="allowed: minimax-m2.5"):
        get_model("not-a-model")


def test_model_spec_validates_fields():
    with pytest.raises(ValueError, match="top_k"):
        get_model("qwen3").__class__(
            name="x",
            num_layers=2,
            num_experts=4,
            top_k=8,
            hidden_size=8,
            moe_intermediate_size=8,
            num_attention_heads=2,
            num_kv_heads=1,
            head_dim=4,
        )


# -- hardware -------------------------------------------------------------------------------------


def test_gb200_has_the_paper_constants():
    hw = get_hardware("GB200")
    assert (hw.hbm_bandwidth, hw.bandwidth_efficiency, hw.sm_bandwidth) == (7.93e12, 0.89, 107e9)
    assert (hw.num_sms, hw.fp8_flops, hw.gemm_efficiency) == (152, 5e15, 0.3347407189)
    assert hw.dispatch_intercept == pytest.approx(42.834448717e-6)
    assert hw.calibrated and hw.ffn_pool_gpus == 4
    assert not any(get_hardware(n).calibrated for n in ("b200", "h200", "h100"))


def test_hardware_file_inherits_a_base(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: h200\nname: h200-tuned\ndispatch_intercept: 3.0e-5\n")
    hw = get_hardware(str(path))
    assert hw.name == "h200-tuned" and hw.dispatch_intercept == 3.0e-5
    assert hw.hbm_bandwidth == get_hardware("h200").hbm_bandwidth and not hw.calibrated
    full = tmp_path / "full.json"
    fields = {
        "name": "x",
        "hbm_bandwidth": 1e12,
        "hbm_capacity": 8e10,
        "num_sms": 100,
        "sm_bandwidth": 2e10,
        "fp8_flops": 1e15,
        "bf16_flops": 5e14,
    }
    full.write_text(json.dumps(fields))
    assert get_hardware(str(full)).num_sms == 100


def test_hardware_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="allowed: gb200, b200, h200, h100"):
        get_hardware("tpu")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: gb200\nhbm_speed: 1\n")
    with pytest.raises(ValueError, match="hbm_speed"):
        get_hardware(str(bad))
    negative = tmp_path / "neg.yaml"
    negative.write_text("base: gb200\nbandwidth_efficiency: 1.5\n")
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        get_hardware(str(negative))


# -- profiles -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tokens"), [("4K", 4096), ("8k", 8192), ("16384", 16384), ("1M", 1 << 20)]
)
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["4Q", "", "K", "0", "1.5"])
def test_parse_context_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="context"):
        parse_context(text)


#: sha256 of the FastAFD profile table (shared/papers/fastafd-profile-inputs.csv).
PAPER_CSV_SHA256 = "cc812a7b4e94b38a1ee9e12a3b29e7da69f1bfe08402b84babc0a3d1d1873680"


def test_bundled_csv_is_a_copy_of_the_paper_table():
    assert hashlib.sha256(BUNDLED_CSV.read_bytes()).hexdigest() == PAPER_CSV_SHA256
    if SHARED_CSV.is_file():  # next to the project's shared references (not on every machine)
        assert BUNDLED_CSV.read_text() == SHARED_CSV.read_text()


def test_bundled_profile_points():
    qwen3 = bundled_profile("Qwen3")
    assert qwen3.hardware == "gb200"
    p = qwen3.point(4096, 0)
    assert (p.dv_ms, p.kappa, p.profile_batch) == (5.789, 1.0, 125)
    spec = qwen3.point(8192, 7)
    assert (spec.dv_ms, spec.kappa, spec.profile_batch) == (9.3263, 1.0899, 76)
    assert bundled_profile("mixtral") is None


def test_profile_interpolates_between_contexts_only():
    profile = bundled_profile("minimax-m2.5")
    mid = profile.point(parse_context("6K"), 0)
    assert mid.interpolated and 3.64 < mid.dv_ms < 3.831
    with pytest.raises(ValueError, match="profiled contexts: 4K, 8K, 16K"):
        profile.point(parse_context("32K"), 0)


def test_csv_profile_needs_a_model_when_it_holds_several(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(BUNDLED_CSV.read_text())
    with pytest.raises(ValueError, match="say which one"):
        load_profile(path)
    assert load_profile(path, model="qwen3.5-397b-a17b").point(8192).dv_ms == 7.223


def test_json_profile_round_trip(tmp_path):
    profile = ColocatedProfile(
        model="qwen3-235b-a22b",
        hardware="h200",
        points=(
            ProfilePoint(
                4096, 6.1, profile_batch=80, baseline_ep=8, baseline_batch=90, baseline_step_ms=41.0
            ),
            ProfilePoint(
                4096,
                9.0,
                draft_length=3,
                kappa=1.05,
                profile_batch=70,
                t_draft_att_ms=1.2,
                t_draft_rest_ms=0.8,
            ),
        ),
        dispatch_intercept_us=38.0,
        gemm_efficiency=0.41,
    )
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded.points == profile.points
    assert (loaded.dispatch_intercept_us, loaded.gemm_efficiency) == (38.0, 0.41)
    assert json.loads(path.read_text())["format"] == "vllm-afd-colocated-profile"


def test_profile_validation_names_fields(tmp_path):
    with pytest.raises(ValueError, match="t_draft_att_ms"):
        ProfilePoint(4096, 1.0, draft_length=3, t_draft_att_ms=1.0)
    with pytest.raises(ValueError, match="baseline_ep"):
        ProfilePoint(4096, 1.0, baseline_ep=8)
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "format": "vllm-afd-colocated-profile",
                "version": 1,
                "points": [{"context": 4096, "dv_ms": 1, "dv": 2}],
            }
        )
    )
    with pytest.raises(ValueError, match=r"points\[0\] has unknown field"):
        load_profile(path)


def test_json_profile_accepts_context_strings_and_rejects_bad_values(tmp_path):
    def write(points: list[dict]) -> Path:
        path = tmp_path / "p.json"
        doc = {"format": "vllm-afd-colocated-profile", "version": 1, "points": points}
        path.write_text(json.dumps(doc))
        return path

    assert load_profile(write([{"context": "8K", "dv_ms": 2.0}])).point(8192).dv_ms == 2.0
    with pytest.raises(ValueError, match=r"points\[0\]: ProfilePoint.dv_ms"):
        load_profile(write([{"context": 4096, "dv_ms": -1}]))
    with pytest.raises(ValueError, match=r"points\[0\]: bad context"):
        load_profile(write([{"dv_ms": 1.0}]))
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("model,context,DV_ms\nQwen3,4K,5\n")
    with pytest.raises(ValueError, match="lacks column"):
        load_profile(bad_csv, model="Qwen3")


@pytest.mark.parametrize(
    "sparsity",
    [
        {"decoder_sparse_step": 2},
        {"moe_layer_freq": 2},  # DeepSeek's name for the step: the planner once ignored it
        {"first_k_dense_replace": 3},
        {"mlp_only_layers": [0, 5]},
    ],
)
def test_the_planner_counts_the_moe_layers_the_deployment_splits(tmp_path, sparsity):
    from types import SimpleNamespace

    from vllm_afd.config import moe_model_info

    cfg = {**QWEN3_MOE, "num_hidden_layers": 8, "decoder_sparse_step": None, **sparsity}
    spec = load_hf_config(write_config(tmp_path, "sparse", cfg))
    info = moe_model_info(SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], **cfg))
    assert spec.num_dense_layers == 8 - len(info.moe_layers) > 0
