"""Fast checks of the offline tiny MoE models: configs, checkpoint layout, tokenizer, validation.

No vLLM engine is started here; the checkpoints are inspected with transformers and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from vllm_afd.bench import tiny_models as tiny
from vllm_afd.bench.tiny_models import (
    ARCHS,
    CHECKPOINT_NAMES,
    build_tiny_model,
    build_tokenizer,
    default_tiny_model,
)

EXPECTED_MODEL_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, from one file or from every shard."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


#: MoE layers of the default 2-layer models (deepseek_v2: first_k_dense_replace=1).
MOE_LAYERS = {"deepseek_v2": (1,)}


def _expected_expert_names(arch: str, layers: tuple[int, ...], num_experts: int) -> set[str]:
    names = CHECKPOINT_NAMES[arch]
    return {
        names.routed.format(layer=layer, expert=expert, proj=proj)
        for layer in layers
        for expert in range(num_experts)
        for proj in names.projs
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One default model per architecture, built once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_fields(built: dict[str, Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(built[arch])
    assert config.model_type == arch
    assert config.architectures == [EXPECTED_MODEL_CLASS[arch]]
    assert config.hidden_size == 128
    assert config.num_hidden_layers == 2
    assert config.num_experts_per_tok == 2
    assert config.vocab_size == len(build_tokenizer()) == 1024
    assert config.eos_token_id == config.bos_token_id == 0
    assert config.tie_word_embeddings is False
    assert config.to_dict()["dtype"] == "float32"


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_router_and_shared_names(built: dict[str, Path], arch: str) -> None:
    tensors = _tensors(built[arch])
    names = CHECKPOINT_NAMES[arch]
    moe_layers = MOE_LAYERS.get(arch, (0, 1))
    expert_keys = {k for k in tensors if ".experts." in k}
    assert expert_keys == _expected_expert_names(arch, moe_layers, num_experts=8)
    gate, _, down = names.routed_names(layer=1, expert=7)
    assert tuple(tensors[gate].shape) == (64, 128)
    assert tuple(tensors[down].shape) == (128, 64)
    assert tuple(tensors[names.router.format(layer=moe_layers[0])].shape) == (8, 128)
    shared_keys = {k for k in tensors if ".shared_expert" in k}
    if names.shared is None:
        assert not shared_keys
    else:
        expected = {
            names.shared.format(layer=layer, proj=p) for layer in moe_layers for p in names.projs
        }
        if names.shared_gate:
            expected |= {names.shared_gate.format(layer=layer) for layer in moe_layers}
        assert shared_keys == expected


def test_deepseek_v2_has_mla_a_shared_expert_and_its_first_moe_layer_is_1(
    built: dict[str, Path],
) -> None:
    """The layout tests/e2e/test_deepseek_mla_e2e.py serves: MLA, a shared expert, a dense
    first layer (first_k_dense_replace=1), so the model's only MoE layer is layer 1."""
    from vllm_afd.config import moe_model_info

    config = AutoConfig.from_pretrained(built["deepseek_v2"])
    assert config.first_k_dense_replace == 1 and config.num_hidden_layers == 2
    assert config.kv_lora_rank and config.n_shared_experts == 1
    assert moe_model_info(config).moe_layers == (1,)


def test_weights_are_random_with_unit_norms(built: dict[str, Path]) -> None:
    tensors = _tensors(built["qwen3_moe"])
    expert = tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert 0.15 < float(expert.std()) < 0.25
    assert torch.equal(tensors["model.norm.weight"], torch.ones(128))
    assert not torch.equal(expert, tensors["model.layers.0.mlp.experts.1.gate_proj.weight"])


def test_special_tokens_have_zero_output_rows(built: dict[str, Path]) -> None:
    lm_head = _tensors(built["mixtral"])["lm_head.weight"]
    special = build_tokenizer().convert_tokens_to_ids(list(tiny.SPECIAL_TOKENS))
    assert not lm_head[special].any()
    assert lm_head[len(tiny.SPECIAL_TOKENS) :].abs().sum(dim=1).min() > 0


def test_same_arguments_give_identical_bytes(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", "qwen2_moe", seed=3)
    second = build_tiny_model(tmp_path / "b", "qwen2_moe", seed=3)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_other_seed_gives_other_weights(tmp_path: Path) -> None:
    seed0 = _tensors(build_tiny_model(tmp_path / "s0", seed=0))
    seed1 = _tensors(build_tiny_model(tmp_path / "s1", seed=1))
    assert seed0.keys() == seed1.keys()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(seed0[key], seed1[key])


def test_sharded_index_lists_every_expert(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "sharded", "qwen3_moe", shards=4)
    shard_files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert _expected_expert_names("qwen3_moe", (0, 1), 8) <= weight_map.keys()
    for shard in shard_files:
        with safe_open(str(model_dir / shard), framework="pt") as handle:
            assert set(handle.keys()) == {k for k, f in weight_map.items() if f == shard}
    layer0_expert_shards = {
        f for k, f in weight_map.items() if k.startswith("model.layers.0.mlp.experts.")
    }
    assert len(layer0_expert_shards) > 1, "experts of one layer should span several shards"


def test_sharded_and_single_file_hold_the_same_tensors(tmp_path: Path) -> None:
    single = _tensors(build_tiny_model(tmp_path / "one", "mixtral"))
    sharded = _tensors(build_tiny_model(tmp_path / "three", "mixtral", shards=3))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_rebuild_into_the_same_dir_drops_stale_shards(tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "m", shards=3)
    build_tiny_model(tmp_path / "m", shards=1)
    assert sorted(p.name for p in (tmp_path / "m").glob("model*")) == ["model.safetensors"]


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    tensors = _tensors(build_tiny_model(tmp_path / "bf16", "qwen3_moe", dtype="bfloat16"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(tmp_path / "bf16").to_dict()["dtype"] == "bfloat16"


def test_tokenizer_round_trips_text(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["qwen3_moe"])
    text = "Hello, world! def f(x):\n    return x ** 2  # ünïcödé 日本語 🙂"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()), "BPE merges should compress the text"
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert len(tokenizer) == 1024


def test_chat_template(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["mixtral"])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer(prompt)["input_ids"]


def test_transformers_greedy_decode_is_not_degenerate(built: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = built["qwen3_moe"]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = AutoTokenizer.from_pretrained(model_dir)("hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    assert len(out) == 24, "no special token should stop greedy decoding"
    assert len(set(out.tolist())) >= 8


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"hidden_size": 100}, "hidden_size"),
        ({"moe_intermediate_size": 48}, "moe_intermediate_size"),
        ({"arch": "llama"}, "arch"),
        ({"dtype": "int8"}, "dtype"),
        ({"top_k": 9}, "top_k"),
        ({"num_layers": 0}, "num_layers"),
        ({"shards": 0}, "shards"),
        ({"shards": 10_000}, "shards"),
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_shared_experts": 1}, "num_shared_experts"),
        ({"hidden_size": 160}, "head size"),
        ({"vocab_size": 4096}, "vocab_size"),
    ],
)
def test_invalid_arguments_name_the_argument(
    tmp_path: Path, kwargs: dict[str, object], argument: str
) -> None:
    kwargs = {"arch": "qwen3_moe", **kwargs}
    with pytest.raises(ValueError, match=argument):
        build_tiny_model(tmp_path / "bad", **kwargs)


def test_default_tiny_model_builds_once(tmp_path: Path) -> None:
    first = default_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = default_tiny_model(tmp_path)
    assert first == second
    assert first.name.startswith("tiny-qwen3_moe-")
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temporary dirs left"
    assert default_tiny_model(tmp_path, arch="mixtral") != first


def test_default_tiny_model_ignores_a_leftover_temp_dir(tmp_path: Path) -> None:
    (tmp_path / ".tiny-half-written").mkdir()
    model_dir = default_tiny_model(tmp_path, seed=5)
    assert (model_dir / "config.json").is_file()
    assert json.loads((model_dir / "tiny_model_spec.json").read_text())["seed"] == 5


def test_cli_prints_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny.main([str(tmp_path / "cli"), "--arch", "qwen2_moe", "--shards", "2"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert len(list((tmp_path / "cli").glob("model-*.safetensors"))) == 2
    with pytest.raises(SystemExit, match="hidden_size"):
        tiny.main([str(tmp_path / "bad"), "--hidden-size", "100"])
