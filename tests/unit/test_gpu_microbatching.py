"""On GPUs, ``--afd-microbatches 2`` is vLLM's dual-batch overlap: checked on CPU with a
stand-in for ``vllm.v1.worker.ubatching`` and a platform that says it is not the CPU."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform

from tests.unit.ubatchlib import run_ubatch_threads
from vllm_afd.attention import session as sessions
from vllm_afd.attention.layer import remote_experts_impl
from vllm_afd.attention.steps import Steps
from vllm_afd.config import check_supported
from vllm_afd.errors import AFDConfigError
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


def _engine_args(microbatches: int, eager: bool = False, graphs=None):
    from vllm.config import CompilationConfig

    return SimpleNamespace(
        additional_config={"afd": {"ratio": "1:1", "microbatches": microbatches}},
        enable_dbo=False,
        enforce_eager=eager,
        compilation_config=CompilationConfig(cudagraph_mode=graphs),
        data_parallel_size=1,
        tensor_parallel_size=1,
    )


def test_on_gpus_afd_sets_dbo_graphs_and_the_v2_runner_before_vllm_validates(monkeypatch):
    """``deployment.prepare_engine_args`` (patch P3, before vLLM builds its config): DBO for two
    microbatches, FULL graphs without piecewise ones, and the V2 model runner, explicitly."""
    from vllm.usage.usage_lib import UsageContext

    from vllm_afd import deployment

    monkeypatch.setattr(deployment, "_attention_device", lambda: "cuda")
    monkeypatch.setenv(deployment.V2_RUNNER_ENV, "")  # so that teardown restores it
    monkeypatch.delenv(deployment.V2_RUNNER_ENV)
    two = _engine_args(2)
    deployment.prepare_engine_args(two, UsageContext.LLM_CLASS)
    assert two.enable_dbo is True and two.additional_config["afd"]["transport"] == "slots"
    assert two.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert os.environ[deployment.V2_RUNNER_ENV] == "1"  # engine cores inherit it
    given = _engine_args(1, graphs=CUDAGraphMode.FULL_AND_PIECEWISE)
    deployment.prepare_engine_args(given, UsageContext.LLM_CLASS)
    assert given.enable_dbo is False
    assert given.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    monkeypatch.setenv(deployment.V2_RUNNER_ENV, "0")  # the user's choice stays
    eager = _engine_args(2, eager=True)
    deployment.prepare_engine_args(eager, UsageContext.LLM_CLASS)
    assert eager.enable_dbo and eager.compilation_config.cudagraph_mode is None
    assert os.environ[deployment.V2_RUNNER_ENV] == "0"
    with pytest.raises(AFDConfigError, match="--afd-microbatches .* 3: on GPUs .* use 2 or 1"):
        deployment.prepare_engine_args(_engine_args(3), UsageContext.LLM_CLASS)


def test_on_gpus_the_config_vllm_validated_is_checked_not_changed(monkeypatch):
    """What vLLM decided itself: FULL graphs on the V1 runner (whose replays G1 does not see)
    are refused naming what to change; piecewise graphs too."""
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    check_supported(_vllm_config(2, v2=True, graphs=CUDAGraphMode.FULL_DECODE_ONLY))
    with pytest.raises(AFDConfigError, match=r"FULL CUDA graphs \(FULL_DECODE_ONLY\) .* V1"):
        check_supported(_vllm_config(2, v2=False, graphs=CUDAGraphMode.FULL_DECODE_ONLY))
    with pytest.raises(AFDConfigError, match="cudagraph_mode PIECEWISE: piecewise CUDA graphs"):
        check_supported(_vllm_config(1, v2=True, graphs=CUDAGraphMode.PIECEWISE))
    check_supported(_vllm_config(1, v2=False, graphs=CUDAGraphMode.NONE))
    with pytest.raises(AFDConfigError, match="--afd-microbatches .* 3: on GPUs .* use 2 or 1"):
        check_supported(_vllm_config(3, graphs=CUDAGraphMode.NONE))


def test_an_engine_cores_revalidation_passes_for_a_config_in_which_afd_microbatches(tiny_qwen3):
    """A real ``VllmConfig`` of an AFD server, re-validated as every engine core does after its
    handshake (``VllmConfig.__post_init__()`` again) once microbatching is on (M1 in the CPU
    worker; on GPUs DBO, on from the start): vLLM's all-to-all assertion would kill it, M6 lets
    it pass and leaves the user's all-to-all backend as it was."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    import vllm_afd

    vllm_afd.register()
    create = EngineArgs.create_engine_config
    create = getattr(create, "__wrapped__", create)  # vLLM's own: no FFN group starts here
    args = EngineArgs(
        model=tiny_qwen3, additional_config={"afd": {"ratio": "1:1"}}, max_model_len=256
    )
    config = create(args)
    chosen = config.parallel_config.all2all_backend
    config.parallel_config.ubatch_size = 2
    config.__post_init__()
    assert config.parallel_config.use_ubatching
    assert config.parallel_config.all2all_backend == chosen
    with pytest.raises(AssertionError, match="Microbatching currently only supports"):
        VllmConfig.__post_init__.__wrapped__(config)


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


def _session(endpoint) -> sessions.AttentionSession:
    return sessions.AttentionSession("test", endpoint, 0, 1, None, Steps(endpoint))


def test_under_dbo_one_step_of_two_microbatches_is_announced_for_both_ubatches(monkeypatch):
    import vllm.forward_context as fc

    contexts = [_context(6), _context(None)]
    fake = FakeUbatching(contexts)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.ubatching", fake)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    session = _session(_Endpoint())
    steps = session.steps
    for ubatch in (0, 1, 0, 1):  # two MoE layers, each ubatch in turn
        monkeypatch.setattr(fc, "get_forward_context", lambda u=ubatch: contexts[u])
        session.before_dispatch(5)
    [schedule] = steps.endpoint.schedules
    # ubatch 0: its padded count across DP; ubatch 1 (no DP metadata): the spec's bound
    assert schedule.microbatch_tokens == (6, 64) and schedule.layers == (1, 3)


def test_a_replayed_full_cuda_graph_announces_its_step_first(monkeypatch):
    """G1: the replay's kernels run without the op's Python, so the runner announces, each
    ubatch with its own rows as vLLM splits the padded batch (N/2 each for two ubatches, not N:
    the FFN would compute every row twice)."""
    from vllm_afd.patches.gpu_runner import _replay_announces

    session = _session(_Endpoint())
    steps = session.steps
    monkeypatch.setattr(sessions, "_SESSION", session)
    order = []

    def run_fullgraph(self, desc):
        order.append(("replay", len(steps.endpoint.schedules)))

    for tokens, ubatches in ((16, 2), (7, 2), (24, 1)):
        desc = SimpleNamespace(num_tokens=tokens, num_ubatches=ubatches)
        _replay_announces(run_fullgraph)(None, desc)
    assert order == [("replay", 1), ("replay", 2), ("replay", 3)]
    assert [s.microbatch_tokens for s in steps.endpoint.schedules] == [(8, 8), (3, 4), (24,)]
    assert [s.step for s in steps.endpoint.schedules] == [1, 2, 3]


def test_vllms_ubatch_threads_drive_the_afd_op_with_two_yields_and_receive_hooks(monkeypatch):
    """vLLM's own DBO machinery (``make_ubatch_contexts`` threads that alternate at every
    ``dbo_yield``) runs three MoE layers of two ubatches through the product's op
    (``remote_experts_impl``) over the slots transport, an FFN thread serving: the op places its
    two yields and its receive hook as vLLM's MoE kernels do, so each combine's wait runs in the
    other ubatch's thread before its owner receives, and every answer is the reference's."""
    import threading

    from vllm_afd.testing.ffn import serve_ffn
    from vllm_afd.testing.reference import LocalMoE, ScaleExperts, reference_moe_combine
    from vllm_afd.transport import create_attention_transport, create_ffn_transport

    experts = ScaleExperts(torch.arange(1.0, 9.0) / 4)
    layers, rows = (0, 1, 2), 4
    spec = TransportSpec("slots", 1, 1, 8, 32, 2, 8, moe_layers=layers, timeout_s=20.0)
    ffn = create_ffn_transport(spec, 0)
    spec = TransportSpec(**{**spec.__dict__, "addresses": (ffn.address,)})
    endpoint = create_attention_transport(spec, 0)
    calls = []
    dispatch, combine_hook = endpoint.dispatch, endpoint.combine_hook

    def recording_dispatch(layer, x, ids, weights, microbatch=0):
        calls.append(f"D{microbatch}{layer}")
        return dispatch(layer, x, ids, weights, microbatch)

    def recording_combine_hook(handle):
        hook, receive = combine_hook(handle)
        tag = f"{handle.microbatch}{handle.layer}"

        def wait():
            calls.append("W" + tag)
            hook()

        def received():
            calls.append("C" + tag)
            return receive()

        return wait, received

    monkeypatch.setattr(endpoint, "dispatch", recording_dispatch)
    monkeypatch.setattr(endpoint, "combine_hook", recording_combine_hook)
    monkeypatch.setattr(sessions, "_SESSION", _session(endpoint))

    def route(x):
        weights, ids = torch.softmax(x[:, :8], -1).topk(2, dim=-1)
        return weights, ids

    stop = threading.Event()
    server = threading.Thread(
        target=serve_ffn, args=(ffn, LocalMoE.for_rank(experts, spec, 0), stop.is_set)
    )
    server.start()
    inputs = [torch.randn(rows, 32) for _ in range(2)]

    def body(ubatch, x):
        for layer in layers:
            weights, ids = route(x)
            x = x + remote_experts_impl(x, weights, ids, layer)
        return x

    try:
        results = run_ubatch_threads(monkeypatch, inputs, body)
    finally:
        stop.set()
        server.join(20)
        endpoint.close()
        ffn.close()
    order = "D00 D10 W00 C00 W10 D01 C10 D11 W01 C01 W11 D02 C11 D12 W02 C02 W12 C12"
    assert calls == order.split()
    for x0, got in zip(inputs, (results[0], results[1]), strict=True):
        x = x0
        for _ in layers:
            weights, ids = route(x)
            x = x + reference_moe_combine(x, ids, weights, experts, 8, 1)
        assert torch.equal(got, x)
