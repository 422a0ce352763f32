"""More MoE families end to end: AFD 1:1 offline against colocated vLLM, float32, greedy ids
identical and sampled-token logprobs within 1e-4, the FFN rank serving exactly the model's MoE
layers under their own numbers.

The checkpoints are tiny random models that transformers writes offline (2 layers, 8 experts,
hidden size 128, head size 32; this project's tokenizer). Each family brings a code path the
tiny_models families do not: Llama-4 top-1 routing that weights the expert input, and GLM-4.5
sigmoid routing with a score correction bias that vLLM's router hands the MoE layer (the FFN
loader must leave that router state alone), a shared expert and a dense first layer.

Other families that passed the same check when this was written (olmoe, granitemoe,
granitemoeshared, ernie4_5_moe, exaone_moe) are left out to keep the suite short; add one to
FAMILIES to run it. The test also asserts that the experts really left the attention rank:
gpt_oss and dbrx (vLLM subclasses ``RoutedExperts``) and the families vLLM serves through its
Transformers backend (hunyuan_v1_moe, flex_olmo, dots1) give colocated tokens under AFD only
because their experts never leave the attention rank (the FFN rank serves no token).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from matrixlib import assert_matches, job

pytestmark = [pytest.mark.slow, pytest.mark.full]

COMMON = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
#: model_type -> config fields besides COMMON.
FAMILIES = {
    "llama4_text": {
        "interleave_moe_layer_step": 1,
        "intermediate_size_mlp": 128,
        "no_rope_layers": [1, 1],
        "num_experts_per_tok": 1,
    },
    "glm4_moe": {
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "partial_rotary_factor": 0.5,
    },
}


def build_family_model(model_type: str, out: Path) -> Path:
    """A tiny random checkpoint of ``model_type`` written by transformers, with a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_afd.bench.tiny_models import EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = AutoConfig.for_model(
        model_type,
        **{**COMMON, **FAMILIES[model_type]},
        vocab_size=len(tokenizer),
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as tiny_models: matrices N(0, 0.2), norms 1, biases 0
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_afd_1_1_matches_colocated(model_type, tmp_path, run_pair):
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    model = str(build_family_model(model_type, tmp_path / model_type))
    colocated, result = run_pair(job(model), job(model, {"ratio": "1:1"}))
    assert_matches(result["token_ids"], result["logprobs"], colocated)
    (ffn,) = result["ffn"]
    # the experts really moved: the attention rank holds fewer bytes, the FFN rank served
    assert result["attention_param_bytes"] < colocated["attention_param_bytes"]
    assert ffn["tokens"] > 0
    moe_layers = moe_model_info(AutoConfig.from_pretrained(model)).moe_layers
    assert ffn["layers"] == list(moe_layers)
    assert set(ffn["per_layer_calls"]) == {str(i) for i in moe_layers}
