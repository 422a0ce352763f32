"""FFN executor: its share of the experts, and its stats block for ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.unit.metrics.metrics_testlib import scrape, value
from vllm_afd.ffn.executor import FFNExecutor
from vllm_afd.metrics.blocks import ffn_block_name, read_block
from vllm_afd.transport import TransportSpec, create_attention_transport
from vllm_afd.transport.base import ServesSteps
from vllm_afd.transport.control import StepSchedule


def test_expert_range_is_contiguous():
    spec = TransportSpec(
        "shm", 1, num_ffn_ranks=4, num_experts=8, hidden_size=8, top_k=2, max_tokens=1
    )
    assert [spec.expert_range(r) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]


def test_ffn_executor_writes_its_block(tiny_qwen3):
    """A real FFN executor (tiny model, shm transport) serving one dispatch."""
    config = json.loads((Path(tiny_qwen3) / "config.json").read_text())
    spec = TransportSpec(
        backend="shm",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=config["hidden_size"],
        top_k=2,
        max_tokens=16,
        timeout_s=10.0,
        addresses=(f"afdmetricstest{os.getpid()}_",),
    )
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    name = ffn_block_name(executor.address, 0)
    endpoint = None
    try:
        assert read_block(name).layers == {0: (0, 0, 0), 1: (0, 0, 0)}
        # every expert of both layers: 8 x (gate, up, down) of 128 x 64 float32
        assert executor.info()["param_bytes"] == 2 * 8 * 3 * 128 * 64 * 4
        executor.start()
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        endpoint.begin_step(StepSchedule(1, (5,), (0, 1)))
        x = torch.randn(5, spec.hidden_size)
        ids = torch.tensor([[0, 7]] * 5, dtype=torch.int32)
        weights = torch.full((5, 2), 0.5)
        endpoint.combine(endpoint.dispatch(1, x, ids, weights))
        deadline = time.monotonic() + 5  # the rank answers first, then counts (its hot path)
        while (snapshot := read_block(name)).layers[1][0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert snapshot.layers[1][0] == 1 and snapshot.layers[1][2] == 5
        assert snapshot.scalars[:4] == [1, 5, 5 * (128 * 4 + 16), 5 * 128 * 4]
        assert executor.stats.snapshot()["tokens"] == 5  # the in-process view still works
        text = scrape(spec)
        assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()
    assert read_block(name) is None


def test_ffn_rank_refuses_a_spec_that_disagrees_with_the_model(tiny_qwen3):
    spec = TransportSpec(
        "shm",
        1,
        num_ffn_ranks=2,
        num_experts=8,
        hidden_size=128,
        top_k=2,
        max_tokens=1,
        moe_layers=(0, 1, 2),
    )
    with pytest.raises(ValueError, match=r"MoE layers are \[0, 1\].*says \[0, 1, 2\]"):
        FFNExecutor(spec, 1, tiny_qwen3, "cpu")


def test_a_failing_layer_fails_its_request_and_the_rank_serves_on(
    tiny_qwen3, monkeypatch, tmp_path
):
    """The injected fault (``VLLM_AFD_FAULT_FILE``) raises in the serve loop: the attention
    rank's combine fails at once with the FFN's text, the failure is counted in the rank's block
    (``/health`` reads it), and the serve loop is still alive for the next request."""
    from vllm_afd.errors import FFNServeError
    from vllm_afd.metrics.blocks import F_FAILURES, F_HEARTBEAT

    fault = tmp_path / "fault"
    monkeypatch.setenv("VLLM_AFD_FAULT_FILE", str(fault))
    spec = TransportSpec(
        backend="shm",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=128,
        top_k=2,
        max_tokens=4,
        timeout_s=30.0,
        addresses=(f"afdfaulttest{os.getpid()}_",),
    )
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    endpoint = None
    try:
        executor.start(heartbeat_s=0.01)
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        x = torch.randn(2, 128)
        ids = torch.tensor([[0, 7]] * 2, dtype=torch.int32)
        weights = torch.full((2, 2), 0.5)

        def round_trip(layer: int) -> torch.Tensor:  # a step of one layer each
            endpoint.begin_step(StepSchedule(endpoint.step + 1, (2,), (layer,)))
            return endpoint.combine(endpoint.dispatch(layer, x, ids, weights))

        round_trip(0)  # no fault file: served
        fault.touch()
        start = time.monotonic()
        for layer in (1, 0):  # every batch fails while the file exists, each one at once
            text = rf"FFN rank 0: layer {layer}: RuntimeError: injected fault .*"
            text += re.escape(str(fault))
            with pytest.raises(FFNServeError, match=text):
                round_trip(layer)
        assert time.monotonic() - start < 2.0
        scalars = read_block(ffn_block_name(executor.address, 0)).scalars
        assert scalars[F_FAILURES] == 2
        fault.unlink()  # the serve loop is still alive
        out = round_trip(1)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert time.monotonic() - scalars[F_HEARTBEAT] < 1.0
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()


def test_a_real_ffn_rank_serves_announced_steps_and_misuse_is_refused(tiny_qwen3):
    """The control plane with a real FFN rank (over NIXL): requests that fit the announced step
    are served; one of a microbatch the step does not have is refused before it is sent (the
    FFN side's own check of a schedule: test_control)."""
    from vllm_afd.errors import ProtocolError
    from vllm_afd.transport.control import StepSchedule

    spec = TransportSpec(
        backend="nixl",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=8,
        hidden_size=128,
        top_k=2,
        max_tokens=4,
        timeout_s=30.0,
        moe_layers=(0, 1),
    )
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    endpoint = None
    try:
        executor.start()
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        x = torch.randn(2, 128)
        ids = torch.tensor([[0, 7]] * 2, dtype=torch.int32)
        weights = torch.full((2, 2), 0.5)
        endpoint.begin_step(StepSchedule(1, (2,), (0, 1)))
        for layer in (0, 1):
            endpoint.combine(endpoint.dispatch(layer, x, ids, weights))
        endpoint.begin_step(StepSchedule(2, (2,), (0, 1)))
        text = r"dispatched 2 tokens of microbatch 1; step 2 announced \[2\]"
        with pytest.raises(ProtocolError, match=text):
            endpoint.dispatch(0, x, ids, weights, microbatch=1)
        endpoint.combine(endpoint.dispatch(0, x, ids, weights))  # the step goes on
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()


def test_a_model_whose_moe_layers_the_plugin_cannot_replace_is_refused(family_model):
    """gpt-oss builds vLLM's own RoutedExperts subclass: its attention ranks would keep every
    expert and never call the FFN rank, so the FFN rank refuses to start, naming the class."""
    from tests.unit.ffn.conftest import GPT_OSS

    spec = TransportSpec("shm", 1, 1, 8, 64, 2, 4, moe_layers=(0, 1))
    with pytest.raises(ValueError, match="GptOssRoutedExperts.*AFD cannot split this model"):
        FFNExecutor(spec, 0, family_model(GPT_OSS), "cpu")


def test_a_batch_that_fails_partway_is_served_again_request_by_request():
    """A layer batch whose reply loop raises at its second request: the first request keeps
    its answer, the others are served again one by one, so only the second gets the error
    (never an error after an answer, nor for a request that does not raise alone). The batch
    was counted before its first answer, each request once."""

    from vllm_afd.ffn.executor import FFNStats
    from vllm_afd.transport import FFNRequest

    class Transport:
        def __init__(self) -> None:
            self.answered, self.failed, self.counted = [], [], []

        def reply(self, request, out) -> None:
            self.counted.append(executor.stats.requests)  # what a reader sees by then
            if request.src_rank == 1:
                raise OSError("attention rank 1 is gone")
            self.answered.append((request.src_rank, out.clone()))

        def reply_error(self, request, message: str) -> None:
            self.failed.append((request.src_rank, message))

    executor = object.__new__(FFNExecutor)
    executor.rank, executor._fault_file, executor._routing_bytes = 0, None, 16
    executor.stats = FFNStats()
    executor.kernel = lambda layer, x, ids, weights: 2 * x
    executor.transport = transport = Transport()
    ids, weights = torch.zeros(1, 2, dtype=torch.int32), torch.full((1, 2), 0.5)
    group = [FFNRequest(src, 0, torch.full((1, 4), src + 1.0), ids, weights) for src in range(3)]
    executor._serve_layer(transport, 0, group)
    answered = [(src, out.tolist()) for src, out in transport.answered]
    assert answered == [(0, [[2.0] * 4]), (2, [[6.0] * 4])]
    assert [src for src, _ in transport.failed] == [1]
    assert "OSError: attention rank 1 is gone" in transport.failed[0][1]
    assert executor.stats.requests_by_source == {0: 1, 1: 1, 2: 1}
    assert transport.counted == [3, 3, 3, 3]  # counted before the first answer


def test_requests_are_counted_per_attention_rank():
    """``requests_by_source``: what a TP or DP test reads to see that every attention rank sent."""
    from vllm_afd.ffn.executor import FFNStats

    executor = object.__new__(FFNExecutor)
    executor.stats = FFNStats()
    executor._account(0, [(0, 0), (1, 0), (1, 1)], 3, 48, 0.01)
    snapshot = executor.stats.snapshot()
    assert snapshot["requests"] == 3 and snapshot["requests_by_source"] == {0: 1, 1: 2}
    assert snapshot["later_microbatch_requests"] == 1 and snapshot["tokens"] == 3


#: The slots transport with the device's waits: an FFN rank serving whole steps.
STEPPED = TransportSpec(
    backend="slots",
    num_attention_ranks=1,
    num_ffn_ranks=1,
    num_experts=8,
    hidden_size=128,
    top_k=2,
    max_tokens=8,
    timeout_s=5.0,
    moe_layers=(0, 1),
    config={"waits": "device"},
)


def test_with_device_waits_the_executor_serves_whole_steps_and_fails_what_it_cannot(
    tiny_qwen3, monkeypatch, tmp_path
):
    """The slots transport with the device's wait semantics (``ServesSteps``): the executor
    serves each announced step whole (per layer and microbatch, the layer's own kernel), the
    answers are exactly that kernel's, the stats count every use; a use that raises (the
    injected fault) is answered with the error together with the rest of its step, which the
    attention rank sees at its next announcement, and the next step is served."""
    from vllm_afd.errors import StepsFailed
    from vllm_afd.transport.control import StepSchedule

    fault = tmp_path / "fault"
    monkeypatch.setenv("VLLM_AFD_FAULT_FILE", str(fault))
    spec = STEPPED
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    endpoint = None
    assert isinstance(executor.transport, ServesSteps) and executor.graphs is None  # CPU: eager
    try:
        executor.start()
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        g = torch.Generator().manual_seed(0)

        def step(number: int, tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
            endpoint.begin_step(StepSchedule(number, tokens, (0, 1)))
            out = []
            for layer in (0, 1):
                sent = []
                for mb, n in enumerate(tokens):
                    x = torch.randn(n, 128, generator=g)
                    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
                    weights = torch.rand(n, 2, generator=g)
                    sent.append(
                        ((layer, x, ids, weights), endpoint.dispatch(layer, x, ids, weights, mb))
                    )
                out += [(inputs, endpoint.combine(h)) for inputs, h in sent]
            return out

        for (layer, x, ids, weights), got in step(1, (3, 2)):
            assert torch.equal(got, executor.kernel(layer, x, ids.int(), weights))
        assert executor.stats.requests == 4 and executor.stats.later_microbatch_requests == 2
        fault.write_text("once")
        step(2, (2,))  # served with errors: recorded, not raised, on the attention rank
        with pytest.raises(StepsFailed, match=r"a wait of step 2 .* ended without its answer"):
            step(3, (1,))
        assert not fault.exists()
        for (layer, x, ids, weights), got in step(4, (4,)):
            assert torch.equal(got, executor.kernel(layer, x, ids.int(), weights))
        # the stats take the steps served whole late (ACCOUNT_EVERY_S), at once when idle,
        # and a report waits for that: steps 1 and 4 (step 2 failed, step 3 was refused at
        # its announcement)
        stats = executor.settled_stats()
        assert stats["requests"] == 6 and stats["later_microbatch_requests"] == 2
        assert stats["tokens"] == 2 * (3 + 2 + 4) and stats["per_layer_calls"] == {0: 3, 1: 3}
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()


class _Graphs:
    """``StepGraphs``' part the executor calls, on CPU: a capture records the shape (or fails,
    ``fail``), a step runs eagerly (standing in for its replay) and records whether it was
    captured ahead."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.attempted: list[object] = []
        self.captured: list[object] = []
        self.runs: list[tuple[object, bool]] = []

    def capture(self, shape, step) -> None:
        self.attempted.append(shape)
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append(shape)

    def run(self, shape, step) -> None:
        self.runs.append((shape, shape in self.captured))
        step()


def test_a_rank_serving_whole_steps_stopped_mid_step_stops_at_once_and_fails_nothing(
    tiny_qwen3, monkeypatch
):
    """``stop`` while the serve loop waits inside a step (announced, nothing sent): the loop's
    device waits end at once (``interrupt``), the stopping is logged, not counted as a failed
    request (which would mark the rank unhealthy), and the transport is unmapped after the
    loop ended."""
    executor = FFNExecutor(STEPPED, 0, tiny_qwen3, "cpu")
    failures: list[int] = []
    monkeypatch.setattr(executor, "_record_failures", failures.append)
    executor.start()
    spec = TransportSpec(**{**STEPPED.__dict__, "addresses": (executor.address,)})
    endpoint = create_attention_transport(spec, 0)
    try:
        endpoint.begin_step(StepSchedule(1, (2,), (0, 1)))
        time.sleep(0.3)  # the rank took the step and waits for its first request
        start = time.perf_counter()
        executor.stop()
        assert time.perf_counter() - start < STEPPED.timeout_s / 2  # not a wait's bound
        assert not any(t.is_alive() for t in executor._threads_started)
        assert failures == []
    finally:
        endpoint.close()


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture fails"])
def test_an_attention_ranks_capture_is_captured_ahead_and_its_replays_find_it(tiny_qwen3, fail):
    """The attention rank announces a CUDA-graph capture (``Mode.CAPTURE``: nothing sent): the
    FFN rank captures its graph of the step the replays will announce then, not on the token
    path; the replay's step finds that graph and is answered exactly. A capture that fails is
    logged and its shape served eagerly."""
    from vllm_afd.transport.control import Mode, StepSchedule

    spec = STEPPED
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    executor.graphs = graphs = _Graphs(fail)
    endpoint = None
    try:
        executor.start()
        spec = TransportSpec(**{**spec.__dict__, "addresses": (executor.address,)})
        endpoint = create_attention_transport(spec, 0)
        endpoint.begin_step(StepSchedule(1, (4, 4), (0, 1), Mode.CAPTURE))
        deadline = time.monotonic() + 5
        while not graphs.attempted and time.monotonic() < deadline:
            time.sleep(0.01)
        [ahead] = graphs.attempted
        assert graphs.runs == [] and executor.stats.requests == 0  # nothing was served
        endpoint.begin_step(StepSchedule(2, (4, 4), (0, 1)))  # its replay, announced
        g = torch.Generator().manual_seed(0)
        for layer in (0, 1):
            for mb in (0, 1):
                x = torch.randn(4, 128, generator=g)
                ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4)])
                weights = torch.rand(4, 2, generator=g)
                got = endpoint.combine(endpoint.dispatch(layer, x, ids, weights, mb))
                assert torch.equal(got, executor.kernel(layer, x, ids.int(), weights))
        assert graphs.runs == [(ahead, not fail)]
    finally:
        if endpoint is not None:
            endpoint.close()
        executor.stop()


def test_a_kernel_that_fails_fails_the_start_with_its_cause(tiny_qwen3, monkeypatch):
    """The dry forward at start (``prepare_device``): a broken kernel stops the FFN rank before
    it serves, naming the layer and the error, not the attention ranks' first forward."""
    from vllm_afd.ffn import executor

    def broken(self, layer, x, topk_ids, topk_weights):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(executor.ExpertKernel, "__call__", broken)
    spec = TransportSpec("shm", 1, 1, 8, 128, 2, 4, torch.float32, moe_layers=(0, 1))
    with pytest.raises(
        RuntimeError,
        match=r"dry forward of MoE layer 0 failed at start on cpu: "
        r"RuntimeError: no kernel for this dtype",
    ):
        FFNExecutor(spec, 0, tiny_qwen3, "cpu")


def test_on_cuda_the_workspace_is_set_up_before_the_dry_forward(monkeypatch):
    """What vLLM's GPU worker sets up for its MoE kernels, the FFN rank sets up itself (faked
    CUDA device: the order of the calls, and the dry forward's routing to the rank's experts)."""
    from vllm.v1.worker import workspace

    from vllm_afd.ffn.executor import prepare_device

    calls = []
    monkeypatch.setattr(workspace, "is_workspace_manager_initialized", lambda: False)
    monkeypatch.setattr(workspace, "init_workspace_manager", lambda d: calls.append(("ws", d)))

    class Kernel:
        device = torch.device("cuda", 3)
        layers = {5: None, 9: None}

        def __call__(self, layer, x, topk_ids, topk_weights):
            calls.append(("forward", layer, x.shape, topk_ids.tolist()))

    spec = TransportSpec("slots", 1, 2, 8, 16, 2, 4, torch.bfloat16, moe_layers=(5, 9))
    prepare_device(Kernel(), spec, 1)
    assert calls == [
        ("ws", torch.device("cuda", 3)),
        ("forward", 5, (2, 16), [[4, 5], [4, 5]]),
    ]
