"""The deepep transport against a CPU model of DeepEP's low-latency contract.

``vllm_afd.testing.deep_ep_model`` keeps DeepEP's rules (collective construction, host
assertions, two buffers cleaned by the next call's send phase, a receive that traps after its
timeout, results that reuse the buffers). Ranks are threads; the group meets through a real
hub (``transport/group.py``) with a real secret. What must hold: the control plane's schedule
(D,D,C,C with two microbatches, layers from the model's MoE layer list, an idle FFN rank posts
nothing, a capture step posts nothing), results equal to the dense reference at bf16
tolerance, schedules that disagree refused, buffers destroyed explicitly.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client

import pytest
import torch

from vllm_afd import envs
from vllm_afd.testing import deep_ep_model
from vllm_afd.testing import deepep_round_trip as rt
from vllm_afd.transport import ProtocolError, TransportSpec, auth, deepep, group, tcp
from vllm_afd.transport.control import Mode, StepSchedule

LAYERS = rt.LAYERS  # MoE layers that are not 0..L-1 (a dense first layer, interleaved)
MAX_TOKENS = 8


@pytest.fixture
def secret(tmp_path, monkeypatch) -> bytes:
    path = tmp_path / "secret"
    path.write_bytes(auth.new_secret())
    path.chmod(0o600)
    monkeypatch.setenv(envs.AUTH_FILE, str(path))
    return auth.load_secret(str(path))


@pytest.fixture
def model(monkeypatch):
    """The CPU model stands in for ``deep_ep``; its receive traps after 3 s, not 100 s."""
    monkeypatch.setattr(deepep, "_import_deep_ep", lambda: deep_ep_model)
    monkeypatch.setattr(deep_ep_model, "RECV_TIMEOUT_S", 3.0)
    return deep_ep_model


@pytest.fixture
def hub(secret) -> Iterator[Callable[[int], group.Hub]]:
    hubs: list[group.Hub] = []

    def start(num_ranks: int) -> group.Hub:
        hubs.append(group.Hub("127.0.0.1", num_ranks, secret))
        return hubs[-1]

    yield start
    for h in hubs:
        h.close()


def _parallel(*fns: Callable[[], object]) -> list[object]:
    """Run each function on its own thread (a rank each); re-raise the first error."""
    results: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


class Group:
    """A attention endpoints on the test's threads, F FFN ranks serving on threads of their own."""

    def __init__(self, hub, num_attention: int, num_ffn: int, config: dict | None = None) -> None:
        h = hub(num_attention + num_ffn)
        self.spec = dataclasses.replace(
            rt.spec(num_attention, num_ffn, h.address), config=config or {}
        )
        self.ffn = [deepep.DeepEPFFNTransport(self.spec, f) for f in range(num_ffn)]
        self.attention = [
            deepep.DeepEPAttentionTransport(self.spec, a) for a in range(num_attention)
        ]
        self.seen: list[list[tuple[int, int, int]]] = [[] for _ in self.ffn]  # (layer, mb, rows)
        self.stop = threading.Event()
        self.servers = [
            threading.Thread(target=self._serve, args=(f,), daemon=True) for f in range(num_ffn)
        ]
        for t in self.servers:
            t.start()

    def _serve(self, f: int) -> None:
        transport = self.ffn[f]
        original = transport.recv

        def recv(timeout_s):
            requests = original(timeout_s)
            self.seen[f] += [(r.layer, r.microbatch, r.x.shape[0]) for r in requests]
            return requests

        transport.recv = recv
        rt.serve(transport, f, self.stop)

    def step(self, rank: int, step: int, tokens: tuple[int, ...], seed: int) -> list[tuple]:
        """One step of attention rank ``rank`` in vLLM's DBO order: per layer D0, D1, C0, C1."""
        return rt.run_step(self.attention[rank], step, tokens, seed)

    def world(self):
        return deep_ep_model.world_of(self.ffn[0]._buffer)

    def close(self) -> None:
        self.stop.set()
        for t in self.servers:
            t.join(10)
        for endpoint in self.attention + self.ffn:
            endpoint.close()


@pytest.fixture
def make_group(model, hub) -> Iterator[Callable[[int, int], Group]]:
    groups: list[Group] = []

    def make(num_attention: int, num_ffn: int, config: dict | None = None) -> Group:
        groups.append(Group(hub, num_attention, num_ffn, config))
        return groups[-1]

    yield make
    for g in groups:
        g.close()


def _check(results: list[tuple]) -> None:
    assert rt.max_error(results) < 2e-2


def test_steps_of_one_and_two_microbatches_run_d_d_c_c_with_the_models_layers(make_group):
    g = make_group(2, 2)
    steps = [(1, ((5, 3), (2, 4))), (2, ((4,), (6,))), (3, ((2, 2), (0, 3)))]
    for step, tokens in steps:
        results = _parallel(
            *(lambda a=a, s=step, t=tokens: g.step(a, s, t[a], 10 * s + a) for a in (0, 1))
        )
        for r in results:
            _check(r)
    # every rank made the same low-latency calls, per layer: D per microbatch, then C per one
    per_step = [["dispatch"] * k + ["combine"] * k for k in (2, 1, 2) for _ in LAYERS]
    want = [kind for layer in per_step for kind in layer]
    world = g.world()
    for rank in range(4):
        calls = [(kind, b) for r, kind, b in world.calls if r == rank]
        assert [kind for kind, _ in calls] == want
        assert [b for _, b in calls] == [i % 2 for i in range(len(want))]  # even per step
    # the FFN ranks served the schedule's layers (the model's numbers), microbatches in order
    for seen in g.seen:
        layers_mbs = [(layer, mb) for layer, mb, _ in seen]
        two = [(1, 0), (1, 1), (3, 0), (3, 1)]
        assert layers_mbs == two + [(1, 0), (3, 0)] + two


def test_an_idle_ffn_rank_posts_no_deepep_call(make_group):
    g = make_group(1, 1)
    _check(g.step(0, 1, (3,), 1))
    calls = len(g.world().calls)
    assert g.ffn[0]._buffer is not None
    threading.Event().wait(1.0)  # the FFN rank polls the hub meanwhile (50 ms at a time)
    assert len(g.world().calls) == calls
    _check(g.step(0, 2, (2,), 2))  # and serves the next step


def test_before_the_first_step_no_rank_builds_a_buffer(model, hub):
    h = hub(2)
    spec = rt.spec(1, 1, h.address)
    ffn = deepep.DeepEPFFNTransport(spec, 0)
    try:
        assert ffn.recv(0.2) == [] and ffn._buffer is None
    finally:
        ffn.close()


def test_a_capture_step_posts_nothing_and_the_next_step_runs(make_group):
    g = make_group(1, 1)
    _check(g.step(0, 1, (2,), 1))
    calls = len(g.world().calls)
    g.attention[0].begin_step(StepSchedule(2, (4,), LAYERS, Mode.CAPTURE))
    threading.Event().wait(0.5)
    assert len(g.world().calls) == calls  # the FFN rank took the schedule and posted nothing
    _check(g.step(0, 3, (4,), 3))


def test_schedules_that_disagree_are_refused_naming_both_ranks(model, hub):
    h = hub(3)
    spec = rt.spec(2, 1, h.address)
    ffn = deepep.DeepEPFFNTransport(spec, 0)
    attention = [deepep.DeepEPAttentionTransport(spec, a) for a in range(2)]
    try:
        for a, tokens in enumerate([(2, 2), (4,)]):
            attention[a]._member.post(2, StepSchedule(1, tokens, LAYERS).words(ffn._words))
        with pytest.raises(ProtocolError, match="attention rank 1 announced .*same microbatches"):
            ffn.recv(5.0)
    finally:
        for endpoint in [ffn, *attention]:
            endpoint._member.close()


def test_dispatch_outside_an_announced_step_is_refused(model, hub):
    h = hub(2)
    spec = rt.spec(1, 1, h.address)
    attention = deepep.DeepEPAttentionTransport(spec, 0)
    try:
        x = torch.zeros(1, 128, dtype=torch.bfloat16)
        with pytest.raises(ProtocolError, match="outside an announced step"):
            attention.dispatch(1, x, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    finally:
        attention._member.close()


def test_the_deployments_buffer_settings_reach_every_buffer(make_group):
    """``--afd-transport-config`` (``spec.config``) arrives in every rank's ``Buffer``."""
    g = make_group(1, 1, {"allow_mnnvl": True, "allow_nvlink_for_low_latency_mode": False})
    g.step(0, 1, (1,), 1)
    for buffer in (g.attention[0]._buffer, g.ffn[0]._buffer):
        assert buffer.links == {
            "allow_nvlink_for_low_latency_mode": False,
            "allow_mnnvl": True,
            "use_fabric": False,
        }


def test_close_destroys_every_buffer_explicitly(make_group):
    g = make_group(1, 1)
    g.step(0, 1, (1,), 1)
    buffers = [g.attention[0]._buffer, g.ffn[0]._buffer]
    assert all(b.explicitly_destroy for b in buffers)
    g.close()
    assert all(b.destroyed for b in buffers)


# --- the model keeps DeepEP's hazards: what the transport avoids would fail ----------------


def _model_pair(hub, secret) -> list:
    """Two model ranks (one expert each... 2 experts in all) on a hub."""
    h = hub(2)
    members = [group.Member(h.address, r, 2, secret) for r in range(2)]
    make = [
        lambda m=m: deep_ep_model.Buffer(
            None, num_rdma_bytes=1 << 30, low_latency_mode=True, explicitly_destroy=True, comm=m
        )
        for m in members
    ]
    return _parallel(*make)


def _dispatch(buffer, n: int, hook: bool):
    x = torch.ones(n, 2048, dtype=torch.bfloat16)
    idx = torch.zeros(n, 1, dtype=torch.int64)
    return buffer.low_latency_dispatch(x, idx, 4, 2, use_fp8=False, return_recv_hook=hook)


def test_model_a_second_call_before_the_first_hook_traps(model, hub, secret, monkeypatch):
    monkeypatch.setattr(deep_ep_model, "RECV_TIMEOUT_S", 0.5)
    b0, b1 = _model_pair(hub, secret)
    first = _dispatch(b0, 2, hook=True)
    _parallel(lambda: _dispatch(b1, 1, hook=False), lambda: _dispatch(b0, 1, hook=True))
    # b0's second send phase cleaned the buffer the first receive waits on
    with pytest.raises(deep_ep_model.DeepEPTrap, match="timeout for dispatch receive"):
        first[4]()
    with pytest.raises(RuntimeError, match="trapped"):  # the group is dead from then on
        _dispatch(b1, 1, hook=False)


def test_model_a_dispatch_no_peer_sends_traps(model, hub, secret, monkeypatch):
    monkeypatch.setattr(deep_ep_model, "RECV_TIMEOUT_S", 0.5)
    b0, _ = _model_pair(hub, secret)
    with pytest.raises(deep_ep_model.DeepEPTrap):
        _dispatch(b0, 0, hook=False)  # an FFN rank pre-posting while the attention side idles


def test_model_refuses_what_deepep_refuses(model, hub, secret):
    b0, _ = _model_pair(hub, secret)
    x = torch.ones(1, 128, dtype=torch.bfloat16)  # not a compiled hidden size
    with pytest.raises(AssertionError, match="Unsupported hidden"):
        b0.low_latency_dispatch(x, torch.zeros(1, 1, dtype=torch.int64), 4, 2, use_fp8=False)
    # 600 tokens: NVSHMEM_QP_DEPTH 1024 < (600 + 1) * 2
    with pytest.raises(AssertionError, match="NVSHMEM_QP_DEPTH too small"):
        _dispatch_tokens = torch.ones(1, 2048, dtype=torch.bfloat16)
        b0.low_latency_dispatch(
            _dispatch_tokens, torch.zeros(1, 1, dtype=torch.int64), 600, 2, use_fp8=False
        )
    b = deep_ep_model.Buffer.__new__(deep_ep_model.Buffer)
    b.explicitly_destroy = False
    with pytest.raises(AssertionError, match="explicitly_destroy"):
        b.destroy()


# --- the hub -------------------------------------------------------------------------------


def test_hub_refuses_a_client_without_the_secret(hub, secret):
    h = hub(2)
    host, port = tcp.parse_address(h.address)
    assert host == "127.0.0.1"
    with pytest.raises(Exception, match="digest|authentication|refused"):
        Client((host, port), authkey=b"not the deployment's secret, at all")


def test_hub_gathers_in_rank_order_and_relays_posts_to_late_ranks(hub, secret):
    h = hub(3)
    m0 = group.Member(h.address, 0, 3, secret)
    m0.post(2, [7, 8, 9])  # rank 2 has not connected yet: kept for it
    m1 = group.Member(h.address, 1, 3, secret)
    m2 = group.Member(h.address, 2, 3, secret)
    gathered = _parallel(
        lambda: m0.allgather(b"\x00zero"), lambda: m1.allgather(1), lambda: m2.allgather(None)
    )
    assert gathered == [[b"\x00zero", 1, None]] * 3
    assert m2.next_post(5.0) == (0, [7, 8, 9])
    assert m2.next_post(0.1) is None
    for m in (m0, m1, m2):
        m.close()


def test_the_ffn_executor_serves_a_models_experts_over_deepep(tiny_qwen3, model, hub):
    """The product's FFN rank (the model's own MoE layers) behind the deepep transport: the
    answer is the layer's routed-expert output at bf16 tolerance, for every MoE layer."""
    from vllm_afd.ffn.executor import FFNExecutor

    h = hub(2)
    spec = TransportSpec(
        "deepep", 1, 1, 8, 128, 2, MAX_TOKENS, torch.bfloat16, addresses=(h.address,)
    )
    spec = TransportSpec(**{**spec.__dict__, "moe_layers": (0, 1), "timeout_s": 10.0})
    executor = FFNExecutor(spec, 0, tiny_qwen3, "cpu")
    attention = None
    try:
        executor.start()
        attention = deepep.DeepEPAttentionTransport(spec, 0)
        gen = torch.Generator().manual_seed(0)
        for step in (1, 2):
            attention.begin_step(StepSchedule(step, (5,), (0, 1)))
            for layer in (0, 1):
                x = (torch.randn(5, 128, generator=gen) / 4).to(torch.bfloat16)
                ids = torch.tensor([[0, 7], [3, 4], [1, 2], [6, 5], [7, 0]], dtype=torch.int32)
                w = torch.full((5, 2), 0.5)
                out = attention.combine(attention.dispatch(layer, x, ids, w))
                want = executor.kernel(layer, x, ids, w)
                torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)
                assert out.abs().sum() > 0
        deadline = time.monotonic() + 10  # the rank counts a layer after its answer went out
        while executor.stats.requests < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.stats.requests == 4 and executor.stats.tokens == 4 * 10  # (token, k)
    finally:
        if attention is not None:
            attention.close()
        executor.stop()


def test_the_gpu_smoke_round_trip_passes_on_the_cpu_model(secret, capsys):
    """The data-path step of scripts/gpu-smoke.sh, run here against the contract model."""
    assert rt.main(["--cpu-model"]) == 0
    assert "4 steps" in capsys.readouterr().out


def test_a_failed_layer_stops_the_ffn_rank_once_and_it_serves_nothing_more(model, hub):
    """A collective cannot fail one request: the rank says why once, then posts nothing (the
    attention ranks' waits end in DeepEP's timeout)."""
    from vllm_afd.transport import FFNRequest, TransportError

    h = hub(2)
    ffn = deepep.DeepEPFFNTransport(rt.spec(1, 1, h.address), 0)
    try:
        request = FFNRequest(-1, 3, torch.zeros(0, 128), torch.zeros(0, 1), torch.zeros(0, 1))
        with pytest.raises(TransportError, match="cannot answer layer 3 .*boom.* stops serving"):
            ffn.reply_error(request, "boom")
        ffn.reply_error(request, "again")  # said once
        assert ffn.recv(0.05) == [] and ffn._buffer is None
    finally:
        ffn.close()
