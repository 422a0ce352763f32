"""The GPU path's start-up refusals (``deployment.check_devices``) and the FFN ranks' GPUs
(``placement.ffn_gpu``), checked on CPU with the devices given as arguments."""

from __future__ import annotations

import pytest
import torch

from vllm_afd import placement
from vllm_afd.config import AFDConfig, MoEModelInfo
from vllm_afd.deployment import check_devices
from vllm_afd.errors import AFDConfigError
from vllm_afd.transport import TransportSpec

# Qwen3-30B-A3B's shape: hidden 2048, 128 experts, top 8.
QWEN3_30B = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))


def _afd(**kw) -> AFDConfig:
    return AFDConfig.from_dict({"ratio": "7:1", "ffn_device": "cuda", **kw})


def _check(afd, ranks=7, gpus=8):
    check_devices(afd, ranks, "cuda", gpus_on_node=gpus)


@pytest.mark.parametrize(
    ("transport", "why"), [("shm", "host memory"), ("nixl", "GPU memory through NIXL")]
)
def test_host_memory_transports_are_refused_for_a_cuda_model(transport, why):
    with pytest.raises(AFDConfigError, match=rf"--afd-transport .*{transport}: .*{why}"):
        _check(_afd(transport=transport))
    check_devices(_afd(transport=transport, ffn_device="cpu"), 7, "cpu")


def test_attention_and_ffn_ranks_must_fit_the_node_side_by_side():
    _check(_afd(transport="slots"), gpus=8)  # 7 + 1
    with pytest.raises(AFDConfigError, match=r"7 attention rank\(s\) and 1 FFN rank\(s\) need 8"):
        _check(_afd(transport="slots"), gpus=7)
    # FFN ranks on a given cluster may be on other nodes: not a node-level check
    _check(_afd(transport="slots", ray_address="10.0.0.1:6379"), gpus=7)


def test_local_ffn_ranks_get_the_gpus_after_the_attention_ranks():
    spec = TransportSpec("slots", 7, 2, 128, 2048, 8, 256, torch.bfloat16)
    assert [placement.ffn_gpu(spec, r) for r in range(2)] == [7, 8]
    env = placement.cluster.gpu_env(spec, 1, "cuda", local=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "8", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert placement.cluster.ffn_bundle("cuda", local=True) == {"CPU": 1}
    assert placement.cluster.ffn_bundle("cuda", local=False) == {"CPU": 1, "GPU": 1}
    assert placement.cluster.gpu_env(spec, 0, "cuda", local=False) == {}
    assert placement.cluster.gpu_env(spec, 0, "cpu", local=True) == {}


def test_the_slot_plane_is_refused_across_two_kinds_of_memory():
    with pytest.raises(
        AFDConfigError, match="slots: .*attention ranks on cuda and FFN ranks on cpu"
    ):
        _check(_afd(transport="slots", ffn_device="cpu"))
    check_devices(_afd(transport="slots", ffn_device="auto"), 7, "cpu")


def test_auto_transport_picks_by_device_and_host(monkeypatch):
    """``--afd-transport auto`` (the default): shm on an x86-64 CPU host, nixl on other CPUs,
    the slot plane on GPUs; the front-end writes the choice back for every process."""
    from vllm_afd import deployment
    from vllm_afd.config import AFDConfig
    from vllm_afd.transport import auto_backend
    from vllm_afd.transport.slots import ShmBackend

    assert AFDConfig(ratio=(1, 1)).transport == "auto"
    assert auto_backend("cuda", "cuda") == "slots"
    monkeypatch.setattr(deployment, "_attention_device", lambda: "cuda")
    assert deployment._resolve_transport(AFDConfig(ratio=(1, 1))).transport == "slots"
    monkeypatch.setattr(ShmBackend, "host_problem", classmethod(lambda cls: "shm: not x86-64"))
    assert auto_backend("cpu", "cpu") == "nixl"
    with pytest.raises(ValueError, match=r"no transport backend connects cuda .* to cpu FFN"):
        auto_backend("cuda", "cpu")


def test_auto_transport_takes_nixl_where_ffn_ranks_may_be_on_other_hosts(monkeypatch):
    """With a given Ray cluster (``--afd-ray-address``) CPU ranks get the slot plane over
    NIXL (installed by ``make venv``), and without NIXL a start is refused with the reason
    (host memory ends at the host); GPUs keep the slot plane."""
    from vllm_afd import deployment
    from vllm_afd.config import AFDConfig
    from vllm_afd.transport import auto_backend
    from vllm_afd.transport.nixl import NixlBackend

    cluster = AFDConfig(ratio=(1, 1), ray_address="10.0.0.1:6379")
    assert deployment._resolve_transport(cluster).transport == "nixl"
    assert deployment._resolve_transport(AFDConfig(ratio=(1, 1))).transport == "shm"
    assert auto_backend("cuda", "cuda", across_hosts=True) == "slots"
    monkeypatch.setattr(NixlBackend, "host_problem", classmethod(lambda cls: "nixl: missing"))
    with pytest.raises(ValueError, match=r"connects cpu attention .*: nixl: missing$"):
        auto_backend("cpu", "cpu", across_hosts=True)
    assert auto_backend("cpu", "cpu") == "shm"


def test_auto_transport_takes_no_backend_settings():
    from vllm_afd.config import AFDConfig
    from vllm_afd.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="--afd-transport-config.*need a named backend"):
        AFDConfig(ratio=(1, 1), transport_config={"waits": "device"})


def test_engine_args_get_the_resolved_transport(monkeypatch):
    """Before vLLM builds its config (patch P3): auto resolved and written back."""
    from types import SimpleNamespace

    from vllm.usage.usage_lib import UsageContext

    from vllm_afd import deployment

    cpu = SimpleNamespace(
        additional_config={"afd": {"ratio": "1:1"}}, data_parallel_size=1, tensor_parallel_size=1
    )
    deployment.prepare_engine_args(cpu, UsageContext.LLM_CLASS)
    assert cpu.additional_config["afd"]["transport"] == "shm"


def test_the_slot_plane_needs_peer_access_between_attention_and_ffn_gpus():
    """Each side maps the other's device memory: an attention GPU without peer access to an
    FFN GPU is refused before anything starts, naming both; host-memory transports and FFN
    ranks on a given cluster (other nodes) are not asked."""
    asked = []

    def no_p2p_between_2_and_7(a: int, b: int) -> bool:
        asked.append((a, b))
        return (a, b) != (2, 7)

    def check(afd):
        check_devices(afd, 7, "cuda", gpus_on_node=8, peer_access=no_p2p_between_2_and_7)

    with pytest.raises(AFDConfigError, match="attention GPU 2 has no peer access to FFN GPU 7"):
        check(_afd(transport="slots"))
    assert asked == [(0, 7), (1, 7), (2, 7)]
    check_devices(_afd(transport="slots"), 7, "cuda", gpus_on_node=8, peer_access=lambda a, b: True)
    asked.clear()
    check(_afd(transport="slots", ray_address="10.0.0.1:6379"))
    assert asked == []
