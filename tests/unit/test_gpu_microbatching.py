"""On GPUs, ``--afd-microbatches 2`` is vLLM's dual-batch overlap: checked on CPU with a
stand-in for ``vllm.v1.worker.ubatching`` and a platform that says it is not the CPU."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform

from vllm_afd import remote_experts
from vllm_afd.config import AFDConfigError, check_supported
from vllm_afd.microbatch import current_microbatch, overlap_point
from vllm_afd.transport import TransportSpec


class FakeUbatching:
    """The parts of ``vllm.v1.worker.ubatching`` the AFD op reads, two ubatches running."""

    def __init__(self, contexts) -> None:
        self._NUM_UBATCHES = len(contexts)
        self._CURRENT_CONTEXTS = [SimpleNamespace(forward_context=c) for c in contexts]
        self.current = 0
        self.yields = 0

    def dbo_enabled(self) -> bool:
        return True

    def dbo_current_ubatch_id(self) -> int:
        return self.current

    def dbo_yield(self) -> None:
        self.yields += 1


class _Context(SimpleNamespace):
    """A forward context (weak-referenceable, as vLLM's dataclass is)."""


def _context(tokens: int | None):
    dp = (
        None
        if tokens is None
        else SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([tokens, 3]))
    )
    return _Context(dp_metadata=dp)


def _vllm_config(microbatches: int, v2: bool = True, graphs=CUDAGraphMode.FULL_AND_PIECEWISE):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=graphs),
        additional_config={"afd": {"ratio": "1:1", "microbatches": microbatches}},
        use_v2_model_runner=v2,
        kv_transfer_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, enable_eplb=False, enable_dbo=False
        ),
        model_config=SimpleNamespace(quantization=None),
    )


def test_two_microbatches_on_a_gpu_turn_on_vllms_dbo_with_the_v2_runner(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    config = _vllm_config(2, v2=True)
    check_supported(config)  # the V2 runner is no blocker on GPUs
    assert config.parallel_config.enable_dbo is True
    with pytest.raises(AFDConfigError, match="--afd-microbatches .* 3: on GPUs .* use 2 or 1"):
        check_supported(_vllm_config(3))
    one = _vllm_config(1)
    check_supported(one)
    assert one.parallel_config.enable_dbo is False


def test_cuda_graphs_are_full_decode_only_and_need_the_v2_runner(monkeypatch):
    """Piecewise graphs would capture the AFD op without its announcing Python; FULL graph
    replays are announced by the V2 runner's patch (G1) only."""
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    config = _vllm_config(1, v2=True)
    check_supported(config)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(AFDConfigError, match=r"FULL CUDA graphs \(FULL_DECODE_ONLY\) .* V1"):
        check_supported(_vllm_config(1, v2=False))
    piecewise = _vllm_config(1, v2=False, graphs=CUDAGraphMode.PIECEWISE)
    check_supported(piecewise)
    assert piecewise.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    check_supported(_vllm_config(1, v2=False, graphs=CUDAGraphMode.NONE))


def test_on_the_cpu_build_the_v2_runner_still_blocks_ping_pong_microbatches():
    config = _vllm_config(2, v2=True)
    config.lora_config = None
    config.model_config = SimpleNamespace(
        supports_multimodal_inputs=False, uses_mrope=False, runner_type="generate"
    )
    with pytest.raises(AFDConfigError, match="V2 model runner"):
        check_supported(config)


def test_under_dbo_the_microbatch_is_the_ubatch_id_and_the_overlap_point_yields(monkeypatch):
    fake = FakeUbatching([_context(4), _context(4)])
    assert current_microbatch() is None
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.ubatching", fake)
    fake.current = 1
    assert current_microbatch() == 1
    overlap_point()
    assert fake.yields == 1


class _Endpoint:
    def __init__(self) -> None:
        self.spec = TransportSpec("shm", 1, 1, 8, 32, 2, 64, moe_layers=(1, 3))
        self.step = 0
        self.schedules = []

    def begin_step(self, schedule) -> None:
        self.schedules.append(schedule)
        self.step = schedule.step


def test_under_dbo_one_step_of_two_microbatches_is_announced_for_both_ubatches(monkeypatch):
    import vllm.forward_context as fc

    contexts = [_context(6), _context(None)]
    fake = FakeUbatching(contexts)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.ubatching", fake)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    steps = remote_experts._Steps(_Endpoint())
    for ubatch in (0, 1, 0, 1):  # two MoE layers, each ubatch in turn
        monkeypatch.setattr(fc, "get_forward_context", lambda u=ubatch: contexts[u])
        steps.current(5)
    [schedule] = steps.endpoint.schedules
    # ubatch 0: its padded count across DP; ubatch 1 (no DP metadata): the spec's bound
    assert schedule.microbatch_tokens == (6, 64) and schedule.layers == (1, 3)


def test_a_replayed_full_cuda_graph_announces_its_step_first(monkeypatch):
    """G1: the replay's kernels run without the op's Python, so the runner announces."""
    from vllm_afd.patches.gpu_runner import _replay_announces

    steps = remote_experts._Steps(_Endpoint())
    monkeypatch.setattr(remote_experts, "_SESSION", SimpleNamespace(steps=steps))
    order = []

    def run_fullgraph(self, desc):
        order.append(("replay", len(steps.endpoint.schedules)))

    desc = SimpleNamespace(num_tokens=16, num_ubatches=2)
    _replay_announces(run_fullgraph)(None, desc)
    _replay_announces(run_fullgraph)(None, desc)
    assert order == [("replay", 1), ("replay", 2)]
    assert [s.microbatch_tokens for s in steps.endpoint.schedules] == [(16, 16)] * 2
    assert [s.step for s in steps.endpoint.schedules] == [1, 2]
