"""Quantized checkpoints under AFD: the attention side's placeholders for a block-FP8 layer (every
parameter name the model's loader maps to, no memory), the FFN side's FP8 dequantization, and
the FFN rank serving the FP8 checkpoint's experts like their dequantized twin, with vLLM's FP8
kernel where the platform has one and with the dequantizing fallback where it has none."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from vllm_afd.bench.tiny_models import (
    FP8_BLOCK,
    default_fp8_experts_model,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from vllm_afd.ffn.executor import ExpertKernel
from vllm_afd.ffn.weights import dequantize_fp8, expert_bytes, load_routed_experts

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def fp8_pair() -> tuple[str, str]:
    """Qwen2-MoE (a shared expert, listed in ``ignored_layers``): FP8 experts, and the twin."""
    fp8, twin = default_fp8_experts_model(arch="qwen2_moe")
    return str(fp8), str(twin)


@pytest.fixture
def no_fp8_expert_kernel(monkeypatch):
    """vLLM's FP8 MoE kernel oracle finds no kernel, as on a CPU without AMX."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8

    monkeypatch.setattr(fp8, "select_fp8_moe_backend", lambda **_: (Fp8MoeBackend.NONE, None))


@contextmanager
def _meta_model(model_dir: str) -> Iterator[torch.nn.Module]:
    """The model as vLLM builds it (its quant config, bfloat16), on ``meta``, in its config."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_afd.ffn.weights import _ensure_world, engine_config

    vllm_config = engine_config(model_dir, BF16)
    with set_current_vllm_config(vllm_config):
        _ensure_world()
        with set_default_torch_dtype(BF16), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
        yield model


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 128, generator=gen).to(BF16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    return x, ids.to(torch.int32), torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)


def test_the_fp8_checkpoint_is_deepseek_v3_block_fp8_of_the_experts_only(fp8_pair):
    import json

    from safetensors.torch import load_file

    fp8, twin = (Path(d) for d in fp8_pair)
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert {k: quant[k] for k in ("quant_method", "activation_scheme", "fmt")} == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
    }
    assert quant["weight_block_size"] == [128, 128]
    ignored = set(quant["ignored_layers"])
    for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.shared_expert.up_proj"):
        assert f"model.layers.1.{module}" in ignored
    assert "lm_head" in ignored and not any("experts." in n for n in ignored)
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    q, t = load_file(str(fp8 / "model.safetensors")), load_file(str(twin / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert q[name].dtype == torch.float8_e4m3fn and q[name + "_scale_inv"].shape == (1, 1)
    assert torch.equal(dequantize_block_fp8(q[name], q[name + "_scale_inv"]).to(BF16), t[name])
    shared = "model.layers.1.mlp.shared_expert.up_proj.weight"
    assert q[shared].dtype == BF16 and torch.equal(q[shared], t[shared])


def test_tiny_model_cli_builds_the_pair(tmp_path, capsys):
    from vllm_afd.cli import main

    main(["tiny-model", str(tmp_path), "--fp8-experts", "--num-layers", "1", "--num-experts", "4"])
    fp8, twin = capsys.readouterr().out.split()
    assert Path(fp8) == tmp_path / "fp8-experts" and Path(twin) == tmp_path / "dequantized-twin"
    with pytest.raises(SystemExit, match="multiple of 128"):
        main(["tiny-model", str(tmp_path / "x"), "--fp8-experts", "--moe-intermediate-size", "64"])


def test_placeholders_of_a_quantized_layer_hold_no_memory(fp8_pair):
    """Every parameter vLLM's FP8 method creates (weights and block scales) gets a zero-size
    placeholder with its dtype and loader attributes; the model's own loader finds every
    expert name of the FP8 checkpoint and the placeholders discard the tensors."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_afd.attention.layer import AFDRemoteExpertsMethod
    from vllm_afd.ffn.weights import _checkpoint

    fp8, _ = fp8_pair
    with _meta_model(fp8) as model:
        layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        assert type(layers[0].quant_method).__name__ == "Fp8MoEMethod"
        stock = {n: p for n, p in layers[0].named_parameters(recurse=False)}
        assert {"w13_weight_scale_inv", "w2_weight_scale_inv"} <= set(stock)
        for layer in layers:
            for name in list(dict(layer.named_parameters(recurse=False))):
                delattr(layer, name)
            method = AFDRemoteExpertsMethod(layer.moe_config, layer.layer_name)  # no FFN group
            method.create_weights(
                layer,
                num_experts=layer.local_num_experts,
                hidden_size=layer.hidden_size,
                intermediate_size_per_partition=layer.intermediate_size_per_partition,
                params_dtype=BF16,
                weight_loader=layer.weight_loader,
                global_num_experts=layer.global_num_experts,
            )
        placeholders = dict(layers[0].named_parameters(recurse=False))
        assert set(placeholders) == set(stock)
        for name, param in placeholders.items():
            assert param.numel() == 0 and param.device.type != "meta", name
            assert param.dtype == stock[name].dtype, name
        assert placeholders["w13_weight"].dtype == torch.float8_e4m3fn
        assert placeholders["w13_weight_scale_inv"].quant_method == "block"
        model.load_weights(_checkpoint(Path(fp8), None))
        for layer in layers:
            assert all(p.numel() == 0 for p in layer.parameters(recurse=False))


def test_dequantize_fp8_matches_the_reference():
    """Block scales (the checkpoint's 128x128, also a partial last block), per-shard and
    per-tensor scales: ``weight x scale`` of each element's block, exactly."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 256, 384, generator=gen) * 0.2
    pairs = [quantize_block_fp8(w) for w in weights]
    q = torch.stack([p[0] for p in pairs])
    scale = torch.stack([p[1] for p in pairs])
    want = torch.stack([dequantize_block_fp8(a, s) for a, s in pairs])
    assert torch.equal(dequantize_fp8(q, scale, FP8_BLOCK), want)
    assert torch.equal(dequantize_fp8(q, scale), want)  # the grid alone gives the block
    torch.testing.assert_close(want, weights, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
    partial = q[:, :200, :]  # 2 x 3 blocks, the last row of blocks 72 rows high
    assert torch.equal(dequantize_fp8(partial, scale, FP8_BLOCK), want[:, :200, :])
    per_shard = torch.tensor([[2.0, 0.5], [1.0, 4.0], [0.25, 1.0]])  # w1 | w3 halves
    expanded = per_shard.repeat_interleave(128, 1)[:, :, None]
    assert torch.equal(dequantize_fp8(q, per_shard), q.float() * expanded)
    per_tensor = torch.tensor([2.0, 0.5, 8.0])
    assert torch.equal(dequantize_fp8(q, per_tensor), q.float() * per_tensor[:, None, None])
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_fp8(q[:, :200, :], torch.ones(3, 3))


def test_the_ffn_serves_fp8_experts_like_their_twin(fp8_pair):
    """With the platform's own FP8 kernel (or the fallback where there is none): the FFN
    rank's output equals the dequantized twin's at bfloat16 precision."""
    fp8, twin = fp8_pair
    layers = load_routed_experts(fp8, 0, 1, BF16)
    want = load_routed_experts(twin, 0, 1, BF16)
    x, ids, w = _routing(9, seed=1)
    for number in want:
        got, ref = ExpertKernel(layers)(number, x, ids, w), ExpertKernel(want)(number, x, ids, w)
        scale = ref.abs().max().item()
        assert scale > 1
        # bfloat16's resolution (8 bits) at the output's magnitude: kernels round differently
        torch.testing.assert_close(got, ref, rtol=2**-6, atol=scale * 2**-6)


def test_fp8_experts_split_over_two_ffn_ranks_sum_to_one_rank(fp8_pair):
    """Expert parallel FP8 (vLLM's FP8 kernel where the platform has one, patch S2 teaching it
    the expert map on CPUs; the fallback elsewhere): two ranks' shares sum to one rank's."""
    fp8, _ = fp8_pair
    x, ids, w = _routing(9, seed=3)
    whole = ExpertKernel(load_routed_experts(fp8, 0, 1, BF16))(1, x, ids, w)
    parts = [ExpertKernel(load_routed_experts(fp8, r, 2, BF16))(1, x, ids, w) for r in range(2)]
    scale = whole.abs().max().item()
    assert scale > 1
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=2**-6, atol=scale * 2**-6)


def test_without_an_fp8_kernel_the_experts_are_dequantized_exactly(fp8_pair, no_fp8_expert_kernel):
    """No FP8 expert kernel: the layers become vLLM's unquantized ones holding the exact
    dequantization (the twin's weights, bit for bit), so the output is the twin's exactly,
    also split over two FFN ranks (expert parallel)."""
    fp8, twin = fp8_pair
    layers = load_routed_experts(fp8, 0, 1, BF16)
    want = load_routed_experts(twin, 0, 1, BF16)
    for number, layer in layers.items():
        assert type(layer.quant_method).__name__ == "UnquantizedFusedMoEMethod"
        assert set(dict(layer.named_parameters())) == {"w13_weight", "w2_weight"}
        assert torch.equal(layer.w13_weight, want[number].w13_weight)
        assert torch.equal(layer.w2_weight, want[number].w2_weight)
    assert expert_bytes(layers) == expert_bytes(want)
    x, ids, w = _routing(9, seed=2)
    whole = ExpertKernel(layers)(1, x, ids, w)
    assert torch.equal(whole, ExpertKernel(want)(1, x, ids, w))
    parts = [ExpertKernel(load_routed_experts(fp8, r, 2, BF16))(1, x, ids, w) for r in range(2)]
    scale = whole.abs().max().item()
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=2**-6, atol=scale * 2**-6)
