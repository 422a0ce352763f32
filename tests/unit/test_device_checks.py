"""The GPU path's start-up refusals (``deployment.check_devices``) and the FFN ranks' GPUs
(``placement.ffn_gpu``), checked on CPU with the devices given as arguments."""

from __future__ import annotations

import pytest
import torch

from vllm_afd import placement
from vllm_afd.config import AFDConfig, AFDConfigError, MoEModelInfo
from vllm_afd.deployment import check_devices
from vllm_afd.transport import TransportSpec
from vllm_afd.transport.deepep import limits_problem, padded_hidden_size

# Qwen3-30B-A3B's shape: hidden 2048, 128 experts, top 8.
QWEN3_30B = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))


def _afd(**kw) -> AFDConfig:
    return AFDConfig.from_dict({"ratio": "7:1", "ffn_device": "cuda", **kw})


def _check(afd, info=QWEN3_30B, ranks=7, max_tokens=256, dtype=torch.bfloat16, gpus=8, sms=132):
    check_devices(afd, info, ranks, "cuda", max_tokens, dtype, gpus_on_node=gpus, num_sms=sms)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_host_memory_transports_are_refused_for_a_cuda_model(transport):
    with pytest.raises(AFDConfigError, match=rf"--afd-transport .*{transport}: the point-to-point"):
        _check(_afd(transport=transport))
    check_devices(_afd(transport=transport, ffn_device="cpu"), QWEN3_30B, 7, "cpu", 256, None)


def test_attention_and_ffn_ranks_must_fit_the_node_side_by_side():
    _check(_afd(transport="deepep"), gpus=8)  # 7 + 1
    with pytest.raises(AFDConfigError, match=r"7 attention rank\(s\) and 1 FFN rank\(s\) need 8"):
        _check(_afd(transport="deepep"), gpus=7)
    # FFN ranks on a given cluster may be on other nodes: not a node-level check
    _check(_afd(transport="deepep", ray_address="10.0.0.1:6379"), gpus=7)


def test_deepep_limits_name_the_setting_to_change():
    ok = dict(
        dtype=torch.bfloat16,
        max_tokens=256,
        microbatches=2,
        num_attention_ranks=7,
        num_ffn_ranks=1,
        num_experts=128,
    )
    assert limits_problem(2048, **ok) is None
    assert padded_hidden_size(2880) == 3072 and limits_problem(2880, **ok) is None  # padded
    assert padded_hidden_size(1024) == 2048
    assert "at most 8192" in limits_problem(9216, **ok)
    assert "--dtype float32" in limits_problem(2048, **{**ok, "dtype": torch.float32})
    assert "--max-num-batched-tokens 8192" in limits_problem(2048, **{**ok, "max_tokens": 8192})
    assert "--afd-microbatches 3" in limits_problem(2048, **{**ok, "microbatches": 3})
    # Qwen3-Next-like: 512 experts at 7:1 gives 8 x 512 = 4096 virtual experts > 14 x 132
    problem = limits_problem(2048, **{**ok, "num_experts": 512})
    assert "4096 virtual experts" in problem and "at most 1848" in problem
    assert limits_problem(2048, **{**ok, "num_experts": 512}, num_sms=300) is None


def test_deepep_limits_are_checked_before_start():
    with pytest.raises(AFDConfigError, match="--afd-transport deepep: --max-num-batched-tokens"):
        _check(_afd(transport="deepep"), max_tokens=8192)


def test_local_ffn_ranks_get_the_gpus_after_the_attention_ranks():
    spec = TransportSpec("deepep", 7, 2, 128, 2048, 8, 256, torch.bfloat16)
    assert [placement.ffn_gpu(spec, r) for r in range(2)] == [7, 8]
    env = placement.cluster.gpu_env(spec, 1, "cuda", local=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "8", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert placement.cluster.ffn_bundle("cuda", local=True) == {"CPU": 1}
    assert placement.cluster.ffn_bundle("cuda", local=False) == {"CPU": 1, "GPU": 1}
    assert placement.cluster.gpu_env(spec, 0, "cuda", local=False) == {}
    assert placement.cluster.gpu_env(spec, 0, "cpu", local=True) == {}


def test_deepep_is_refused_unless_both_ends_are_gpus():
    with pytest.raises(AFDConfigError, match="deepep: DeepEP runs between GPUs.*FFN ranks on cpu"):
        _check(_afd(transport="deepep", ffn_device="cpu"))
    with pytest.raises(AFDConfigError, match="attention ranks on cpu and FFN ranks on cpu"):
        check_devices(_afd(transport="deepep", ffn_device="auto"), QWEN3_30B, 7, "cpu", 256, None)


def test_auto_transport_picks_by_device_and_host(monkeypatch):
    """``--afd-transport auto`` (the default): shm on an x86-64 CPU host, tcp on other CPUs,
    deepep on GPUs; the front-end writes the choice back for every process."""
    from vllm_afd import deployment
    from vllm_afd.config import AFDConfig
    from vllm_afd.transport import auto_backend
    from vllm_afd.transport.shm import ShmBackend

    assert AFDConfig(ratio=(1, 1)).transport == "auto"
    assert auto_backend("cuda", "cuda") == "deepep"
    monkeypatch.setattr(deployment, "_attention_device", lambda: "cuda")
    assert deployment._resolve_transport(AFDConfig(ratio=(1, 1))).transport == "deepep"
    monkeypatch.setattr(ShmBackend, "host_problem", classmethod(lambda cls: "shm: not x86-64"))
    assert auto_backend("cpu", "cpu") == "tcp"
    with pytest.raises(ValueError, match=r"no transport backend connects cuda .* to cpu FFN"):
        auto_backend("cuda", "cpu")


def test_auto_transport_takes_no_backend_settings():
    from vllm_afd.config import AFDConfig, AFDConfigError

    with pytest.raises(AFDConfigError, match="--afd-transport-config.*need a named backend"):
        AFDConfig(ratio=(1, 1), transport_config={"allow_mnnvl": True})


def test_engine_args_get_the_resolved_transport_and_its_token_cap(monkeypatch):
    """Before vLLM builds its config (patch P3): auto resolved and written back, and deepep's
    256 tokens per round as ``--max-num-batched-tokens`` when the user gave none."""
    from types import SimpleNamespace

    from vllm.usage.usage_lib import UsageContext

    from vllm_afd import deployment

    def args(max_tokens=None, **afd):
        return SimpleNamespace(
            additional_config={"afd": {"ratio": "1:1", **afd}},
            max_num_batched_tokens=max_tokens,
            data_parallel_size=1,
            tensor_parallel_size=1,
        )

    cpu = args()
    deployment.prepare_engine_args(cpu, UsageContext.LLM_CLASS)
    assert cpu.additional_config["afd"]["transport"] == "shm"
    assert cpu.max_num_batched_tokens is None  # vLLM's own default
    monkeypatch.setattr(deployment, "_attention_device", lambda: "cuda")
    gpu, given = args(), args(max_tokens=512)
    for engine_args in (gpu, given):
        deployment.prepare_engine_args(engine_args, UsageContext.LLM_CLASS)
        assert engine_args.additional_config["afd"]["transport"] == "deepep"
    assert gpu.max_num_batched_tokens == 256
    assert given.max_num_batched_tokens == 512  # the user's: refused by check_devices, named
