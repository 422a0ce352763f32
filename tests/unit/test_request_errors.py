"""A request an FFN error follows fails alone: the attention-side hook sends a failed batch's
requests again one by one (``attention/failures.py``), and the scheduler finishes the ones
that fail alone with vLLM's request error (patch W2, ``fail_requests``).

The hook runs against a real FFN rank (an executor thread on the tiny Qwen3-MoE), on every
backend that claims request isolation (the slot plane on host memory and over NIXL), whose
serve loop raises for any request of at least 5 rows (``VLLM_AFD_FAULT_FILE`` reading
``rows>=5``), with the model runner's batch layout given as vLLM's runner holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_afd import envs
from vllm_afd.attention import failures
from vllm_afd.attention import session as sessions
from vllm_afd.attention.layer import remote_experts_impl
from vllm_afd.errors import FFNServeError, StepsFailed
from vllm_afd.patches.request_errors import fail_requests

#: The batch: request id -> its rows (b's 6 rows trip the fault; a's and c's 2 do not).
BATCH = {"a": 2, "b": 6, "c": 2}


class _OneRank:
    world_size, rank_in_group = 1, 0


class _Context:
    """Stands for the forward's ``ForwardContext`` (identity only)."""


def _runner(batch: dict[str, int]) -> SimpleNamespace:
    starts = torch.tensor([0, *torch.tensor(list(batch.values())).cumsum(0).tolist()])
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(batch), req_ids=list(batch)),
        query_start_loc=SimpleNamespace(cpu=starts.to(torch.int32)),
    )


@contextlib.contextmanager
def _hooked(backend, config, tiny_qwen3, tmp_path, monkeypatch):
    """The hook connected to one FFN rank of ``backend`` with the fault armed; yields
    (session, fault file, inputs, MoE layers)."""
    from transformers import AutoConfig
    from vllm.distributed import parallel_state

    from vllm_afd.config import moe_model_info
    from vllm_afd.ffn.executor import FFNExecutor
    from vllm_afd.transport import TransportSpec

    fault = tmp_path / "fault"
    fault.write_text("rows>=5")
    monkeypatch.setenv(envs.FAULT_FILE, str(fault))
    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    spec = TransportSpec(
        backend=backend,
        num_attention_ranks=1,
        num_ffn_ranks=1,
        num_experts=info.num_experts,
        hidden_size=info.hidden_size,
        top_k=info.top_k,
        max_tokens=16,
        moe_layers=info.moe_layers,
        config=config,
    )
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    executor.start()
    runtime = dataclasses.replace(spec, addresses=(executor.info()["address"],))
    monkeypatch.setenv(envs.RUNTIME, runtime.to_json())
    for name in ("get_tp_group", "get_dp_group"):
        monkeypatch.setattr(parallel_state, name, _OneRank)
    monkeypatch.setattr(sessions, "_SESSION", None)
    context = _Context()
    monkeypatch.setattr(failures, "forward_context", lambda: context)
    session = sessions.open_session()
    session.runner = _runner(BATCH)  # as W1 sets it for each step
    gen = torch.Generator().manual_seed(0)
    n = sum(BATCH.values())
    x = torch.randn(n, spec.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=gen)[:2] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, 2, generator=gen), dim=-1)
    try:
        yield session, fault, (x, weights, ids.to(torch.int32)), info.moe_layers
    finally:
        sessions.close_session()
        executor.stop()


@pytest.fixture(params=["shm", "nixl"])
def hook(request, tiny_qwen3, tmp_path, monkeypatch):
    """The hook on a backend that isolates requests (host waits)."""
    with _hooked(request.param, {}, tiny_qwen3, tmp_path, monkeypatch) as hooked:
        yield hooked


def _reference(inputs, layer: int) -> torch.Tensor:
    """The layer's output for every row, one request at a time, with the fault disarmed."""
    x, weights, ids = inputs
    out, start = torch.zeros_like(x), 0
    for n in BATCH.values():
        rows = slice(start, start + n)
        out[rows] = remote_experts_impl(x[rows], weights[rows], ids[rows], layer)
        start += n
    return out


def test_the_request_an_error_follows_fails_alone_and_the_rest_are_served(hook):
    session, fault, inputs, layers = hook
    first, second = layers[0], layers[1]
    out_first = remote_experts_impl(*inputs, first)
    out_second = remote_experts_impl(*inputs, second)  # b's rows not sent again
    failed = session.take_failed_requests()
    assert list(failed) == ["b"], failed
    assert "injected fault" in failed["b"] and f"layer {first}" in failed["b"]
    b = slice(2, 8)
    assert not out_first[b].any() and not out_second[b].any()
    fault.unlink()
    for layer, out in ((first, out_first), (second, out_second)):
        expected = _reference(inputs, layer)
        for rows in (slice(0, 2), slice(8, 10)):
            torch.testing.assert_close(out[rows], expected[rows], rtol=1e-5, atol=1e-6)
            assert out[rows].abs().sum() > 0


def test_a_batch_whose_requests_each_pass_alone_is_served_whole(hook):
    session, fault, inputs, layers = hook
    fault.write_text("once")
    out = remote_experts_impl(*inputs, layers[0])
    assert not fault.exists(), "the fault did not fire"
    assert session.take_failed_requests() == {}
    torch.testing.assert_close(out, _reference(inputs, layers[0]), rtol=1e-5, atol=1e-6)


def test_without_the_batch_layout_the_ffn_error_fails_the_forward(hook, monkeypatch):
    session, _, inputs, layers = hook
    session.runner = None
    with pytest.raises(FFNServeError, match="injected fault"):
        remote_experts_impl(*inputs, layers[0])
    assert session.take_failed_requests() == {}


def _scheduled(requests: dict[str, int]):
    """A ``SchedulerOutput`` scheduling ``requests`` (request id -> tokens)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = dict(requests)
    output.total_num_scheduled_tokens = sum(requests.values())
    return output


def _v2_runner() -> object:
    """vLLM's V2 model runner (the default on CUDA), as W1 sees it: its class, none of V1's
    batch layout (not constructed: its steps below are the test's)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return object.__new__(GPUModelRunner)


def _sampled(runner: str, requests: list[str]):
    """What ``sample_tokens`` returns: V1 a ``ModelRunnerOutput``, V2 its ``AsyncOutput``
    (async scheduling, the default on CUDA), whose ``get_output`` gives one."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.async_utils import AsyncOutput

    output = ModelRunnerOutput(
        req_ids=requests,
        req_id_to_index={r: i for i, r in enumerate(requests)},
        sampled_token_ids=[[7] for _ in requests],
    )
    if runner == "v1":
        return output

    class Async(AsyncOutput):
        def __init__(self) -> None:  # the device copies it waits for: none here
            pass

        def get_output(self) -> ModelRunnerOutput:
            return output

    return Async()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_with_the_device_waits_a_failed_step_fails_its_requests_and_the_next_is_served(
    runner, tiny_qwen3, tmp_path, monkeypatch
):
    """With the device's waits (every GPU: a kernel cannot raise) an FFN error is recorded in
    its step and seen once the step's sampled tokens are ready (W1, ``session.sampled``):
    the session fails the requests of the step it spoiled, as W1 gave them from the
    scheduler output, with the error's text, on that step's own output, before a token of
    theirs leaves (W2 drops it); the next step is served: the engine goes on. On both of
    vLLM's runners, driven through W1 and W3 as vLLM calls them (V2: its async output, read
    after vLLM's sync; dummy runs are ``execute_model`` calls with ``dummy_run`` and
    placeholder requests, which never fail a request). A forward no W1 step wraps is failed
    at the next announcement instead (``StepsFailed``), which ends the forward: its requests
    are unknown."""
    from vllm_afd.patches.request_errors import FAILED_ATTRIBUTE, _dummy_step, _runner_step

    config = {"waits": "device"}
    with _hooked("slots", config, tiny_qwen3, tmp_path, monkeypatch) as hooked:
        session, fault, inputs, layers = hooked
        fault.unlink()
        model_runner = session.runner if runner == "v1" else _v2_runner()
        taken: dict[str, str] = {}

        def forward(_runner, _scheduled, rows: slice, **_: object) -> list[torch.Tensor]:
            context = _Context()  # one forward
            monkeypatch.setattr(sessions, "forward_context", lambda: context)
            return [remote_experts_impl(*(t[rows] for t in inputs), n) for n in layers]

        def step(requests: dict[str, int], rows: slice) -> list[torch.Tensor]:
            """One runner step of ``requests`` (execute_model, then sample_tokens), as vLLM
            calls it through W1; the failed requests its output carries go to ``taken``."""
            out = _runner_step(forward)(model_runner, _scheduled(requests), rows)
            sampled = _runner_step(lambda _r, _g: _sampled(runner, list(requests)))(
                model_runner, None
            )
            if runner == "v2":
                sampled = sampled.get_output()
            taken.update(getattr(sampled, FAILED_ATTRIBUTE, {}))
            return out

        def dummy_run() -> None:
            """A dummy run (profiling, a DP rank's idle forward) through W3 (and on V2 W1)."""
            if runner == "v1":
                _dummy_step(lambda _r, _n: forward(None, None, slice(0, 2)))(model_runner, 2)
                return
            dummy = _scheduled({"_dummy_req_0": 2})
            execute = _runner_step(forward)
            _dummy_step(lambda r, _n: execute(r, dummy, slice(0, 2), dummy_run=True))(
                model_runner, 2
            )

        expected = [_reference(inputs, layer) for layer in layers]
        for got, want in zip(step(BATCH, slice(None)), expected, strict=True):  # served
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        first = session.endpoint.step
        fault.write_text("once")
        step(BATCH, slice(None))  # the FFN rank fails this step: recorded, not raised
        assert not fault.exists(), "the fault did not fire"
        assert sorted(taken) == ["a", "b", "c"], taken  # on the failed step's own output
        assert f"a wait of step {first + 1}" in taken["a"], taken
        taken.clear()
        for got, want in zip(step({"d": 2}, slice(0, 2)), expected, strict=True):  # served
            torch.testing.assert_close(got, want[:2], rtol=1e-5, atol=1e-6)
        assert taken == {}, taken  # failed once: not again at d's announcement
        fault.write_text("once")
        dummy_run()  # a failed dummy run fails no request, placeholders neither
        assert not fault.exists(), "the fault did not fire"
        step({"d": 2}, slice(0, 2))
        assert taken == {}, taken
        # a runner W1 does not wrap gives no requests: the error reaches vLLM (the engine
        # fails them all) rather than let the spoiled step's tokens on
        session.batch = None
        fault.write_text("once")
        forward(None, None, slice(None))  # one forward, as a runner W1 does not wrap runs it
        assert not fault.exists(), "the fault did not fire"
        monkeypatch.setattr(sessions, "forward_context", _Context)  # the next forward
        with pytest.raises(StepsFailed, match=r"a wait of step \d+"):
            remote_experts_impl(*inputs, layers[0])


def test_on_the_v2_runner_a_failed_batch_is_not_split_by_request(monkeypatch):
    """``requests_of`` reads V1's batch layout; V2's runner has none, so there an error
    answer with the host's waits reaches vLLM whole (docs/operations.md) rather than a
    wrong attribute error inside a forward."""
    monkeypatch.setattr(failures, "forward_context", _Context)
    assert failures.requests_of(_runner(BATCH), 10) == [
        ("a", slice(0, 2)),
        ("b", slice(2, 8)),
        ("c", slice(8, 10)),
    ]
    assert failures.requests_of(_v2_runner(), 10) is None


class _KVCacheManager:
    def __init__(self) -> None:
        self.evicted: set[int] = set()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([1, 2], [7]) if request_id == "b" else ([3],)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= block_ids


def test_the_scheduler_finishes_a_failed_request_with_an_error_and_evicts_its_blocks():
    scheduler = SimpleNamespace(
        requests={"a": object(), "b": object()},
        kv_cache_manager=_KVCacheManager(),
        grammar_compile_error_reqs=set(),
    )
    output = SimpleNamespace(req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[11], [12]])
    fail_requests(scheduler, output, {"b": "FFN rank 0: layer 1: boom", "gone": "aborted"})
    assert scheduler.grammar_compile_error_reqs == {"b"}
    assert output.sampled_token_ids == [[11], []]
    assert scheduler.kv_cache_manager.evicted == {1, 2, 7}


def test_failed_requests_never_ride_vllms_shared_empty_output():
    """vLLM returns one ``EMPTY_MODEL_RUNNER_OUTPUT`` for every step without a forward: W1
    puts a step's failed requests on a copy of it, or every later empty step would fail
    them again."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from vllm_afd.patches.request_errors import FAILED_ATTRIBUTE, _with_failures

    failed = failures.Failures(requests={"a": "FFN rank 0: boom"})
    session = SimpleNamespace(
        endpoint=SimpleNamespace(step=3),
        take_failed_requests=failed.take,
        sampled=lambda step: {},
    )
    out = _with_failures(session, EMPTY_MODEL_RUNNER_OUTPUT)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert getattr(out, FAILED_ATTRIBUTE) == {"a": "FFN rank 0: boom"}
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, FAILED_ATTRIBUTE)
