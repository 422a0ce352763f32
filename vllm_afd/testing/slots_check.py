"""The device check's steps on the serving backend itself (``transport/slots.py``), as
``testing/slot_plane_check.py`` lists them (``host-slots``/``cuda-slots``, the peer's death,
the stalled peer): two attention ranks' endpoints in this process, an FFN process serving
whole steps (``SteppedPlaneFFN``) as the FFN executor does, around the check's toy model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import time

import torch

from vllm_afd.testing.toy_model import (
    EXPERTS,
    HIDDEN,
    LAYERS,
    TOKENS,
    TOP_K,
    ToyMoE,
    dbo_order,
)


def _slots_spec(
    dtype: torch.dtype, waits: str, addresses: tuple[str, ...] = (), timeout_s: float = 30.0
):
    from vllm_afd.transport import TransportSpec

    return TransportSpec(
        "slots",
        2,
        1,
        EXPERTS,
        HIDDEN,
        TOP_K,
        TOKENS,
        dtype,
        timeout_s=timeout_s,
        moe_layers=tuple(range(LAYERS)),
        addresses=addresses,
        config={"waits": waits},
    )


def _slots_ffn_main(
    kind: str, dtype: torch.dtype, steps: int, to_attention, done, timeout_s: float = 30.0
) -> None:
    """The FFN process of ``run_slots_pair``: the slots FFN endpoint serving whole steps, as
    ``FFNExecutor._serve_step`` does, around the toy model's experts: ``steps`` steps, and the
    attention ranks' capture announced among them captured ahead (``_capture_ahead``)."""
    from vllm_afd.ffn.step_graphs import StepGraphs
    from vllm_afd.transport import create_ffn_transport

    if kind == "cuda":
        torch.cuda.set_device(0)
    transport = create_ffn_transport(_slots_spec(dtype, "device", timeout_s=timeout_s), 0)
    device = transport.memory.device
    model = ToyMoE(dtype, device)
    forwards = [model.experts(layer) for layer in range(LAYERS)]
    graphs = StepGraphs() if kind == "cuda" else None
    to_attention.put(transport.address)
    served = eager = 0
    while served < steps:
        step = transport.next_step(60.0)
        if step is None:
            raise TimeoutError("no step announced within 60 s")

        def run(step=step) -> None:
            for layer, slot, parts in step.uses:
                transport.serve_use(slot, parts, forwards[layer])

        if step.capture:
            if graphs is not None:
                graphs.capture(step.shape, run)
        elif graphs is None:
            run()
            eager, served = eager + 1, served + 1
        else:
            eager += step.shape not in graphs
            graphs.run(step.shape, run)
            served += 1
        transport.end_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    to_attention.put((0 if graphs is None else len(graphs), eager))
    done.get(timeout=60)  # the attention ranks are done with the buffer
    transport.close()


def _start_slots_child(kind: str, dtype: torch.dtype, steps: int, timeout_s: float = 30.0):
    """The FFN process of the slots steps (``_slots_ffn_main``) and its two queues."""
    if kind == "cuda":
        torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    to_attention, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_slots_ffn_main,
        args=(kind, dtype, steps, to_attention, done, timeout_s),
        daemon=True,
    )
    child.start()
    return child, to_attention, done


@contextlib.contextmanager
def _slots_pair(kind: str, dtype: torch.dtype, steps: int, timeout_s: float = 30.0):
    """The FFN child of the slots steps and two attention endpoints linked to it; yields
    (spec, endpoints, the toy model, child, its queue to here, its done queue). Closes the
    endpoints and ends the child (killed if it has not exited) on the way out."""
    from vllm_afd.transport import create_attention_transport

    child, to_attention, done = _start_slots_child(kind, dtype, steps, timeout_s)
    endpoints = []
    try:
        spec = _slots_spec(dtype, "device", (to_attention.get(timeout=60),), timeout_s)
        endpoints = [create_attention_transport(spec, a) for a in range(2)]
        model = ToyMoE(dtype, endpoints[0].memory.device)
        yield spec, endpoints, model, child, to_attention, done
    finally:
        for endpoint in endpoints:
            endpoint.close()
        if child.is_alive():
            child.kill()
        child.join(5)


def _dbo_step(endpoints: list, model: ToyMoE, xs: list[list[torch.Tensor]]) -> None:
    """Every layer of the announced step for each attention endpoint, its two microbatches in
    vLLM's DBO call order: ``xs[a][mb] += answer`` (the toy model's residual)."""
    handles = {}
    for op, mb, layer in dbo_order(LAYERS):
        for a, endpoint in enumerate(endpoints):
            x = xs[a][mb]
            if op == "D":
                handles[a, mb] = endpoint.dispatch(layer, x, *model.route(layer, x), mb)
            else:
                x += endpoint.combine(handles.pop((a, mb)))


def run_slots_pair(kind: str, dtype: torch.dtype, steps: int = 4) -> dict:
    """``steps`` steps of two attention ranks (this process) served by an FFN child through
    the slots backend, as vLLM captures a graph at start: the first step an eager warm-up, a
    capture announced (``Mode.CAPTURE``, nothing sent), then the steps its replays announce;
    the largest deviation from the reference, the FFN's graphs and its steps run eagerly."""
    from vllm_afd.transport.control import Mode, StepSchedule

    with _slots_pair(kind, dtype, steps) as (spec, endpoints, model, child, to_attention, done):
        device = endpoints[0].memory.device
        g = torch.Generator().manual_seed(5)
        worst = 0.0
        for number in range(1, steps + 2):
            schedule = StepSchedule(number, (TOKENS, TOKENS), spec.moe_layers)
            if number == 2:  # the capture: the FFN rank captures its graph of the step now
                for endpoint in endpoints:
                    endpoint.begin_step(dataclasses.replace(schedule, mode=Mode.CAPTURE))
                continue
            inputs = [
                [torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).to(device) for _ in "mb"]
                for _ in endpoints
            ]
            xs = [[x.clone() for x in rank] for rank in inputs]
            for endpoint in endpoints:
                endpoint.begin_step(schedule)
            _dbo_step(endpoints, model, xs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            for mb in range(2):  # a use: every attention rank's microbatch mb
                wants = model.reference(*(rank[mb] for rank in inputs))
                for rank, want in zip(xs, wants, strict=True):
                    worst = max(worst, (rank[mb].float() - want.float()).abs().max().item())
        for endpoint in endpoints:  # the last step's device waits
            endpoint.memory.check()
        graphs, eager = to_attention.get(timeout=60)
        done.put("done")
        child.join(60)
        if child.exitcode != 0:
            raise RuntimeError(f"FFN process exited with {child.exitcode}")
        return {
            "max_abs_error": worst,
            "steps_checked": steps,
            "ffn_graphs": graphs,
            "ffn_eager_steps": eager,
        }


#: How soon after an FFN process's death a step's device waits must all have ended.
PEER_DEATH_BOUND_S = 5.0


def run_peer_death(kind: str, dtype: torch.dtype) -> dict:
    """One step served, then the FFN child killed 0.5 s into the next (it serves one step
    only): seconds from the kill to the end of that step's waits, and what the next
    announcement raised."""
    from vllm_afd.errors import FFNRankLost
    from vllm_afd.transport.control import StepSchedule

    with _slots_pair(kind, dtype, 1) as (spec, endpoints, model, child, to_attention, _):
        device = endpoints[0].memory.device
        killed = 0.0
        for number in (1, 2):
            for endpoint in endpoints:
                endpoint.begin_step(StepSchedule(number, (TOKENS, TOKENS), spec.moe_layers))
            if number == 2:
                to_attention.get(timeout=60)  # the child served step 1: kill it in step 2
                time.sleep(0.5)
                child.kill()
                killed = time.perf_counter()
            xs = [[torch.zeros(TOKENS, HIDDEN, dtype=dtype, device=device) for _ in "mb"]] * 2
            _dbo_step(endpoints, model, xs)
            if device.type == "cuda":
                torch.cuda.synchronize()
        ended = time.perf_counter() - killed
        raised = ""
        try:
            endpoints[0].begin_step(StepSchedule(3, (TOKENS, TOKENS), spec.moe_layers))
        except FFNRankLost as exc:
            raised = str(exc)
        if ended > PEER_DEATH_BOUND_S or "died" not in raised:
            raise AssertionError(
                f"after the FFN process's death the step's waits took {ended:.1f} s (bound "
                f"{PEER_DEATH_BOUND_S} s); the next announcement raised {raised!r}"
            )
        return {"waits_ended_s": round(ended, 3), "raised": raised}


#: The wait bound of ``run_stalled_peer``, which stalls its attention ranks past it.
STALL_BOUND_S = 2.0


def run_stalled_peer(kind: str, dtype: torch.dtype) -> dict:
    """Two steps of the slots pair, waits bounded by ``STALL_BOUND_S``: the first served
    whole; in the second both attention ranks stall 1.5 bounds before layer 1, so the FFN
    process gives up on that layer's requests (on the host it waits for them in turn: rank 1's
    may come within its own bound). Per rank and step, what its read of the step's waits
    (``check_sampled``, as W1 calls it) raised, and the largest deviation from the reference
    of the steps that raised nothing: an FFN wait that gave up must answer with an error,
    never with the answer of the slot's stale rows."""
    from vllm_afd.errors import StepsFailed
    from vllm_afd.transport.control import StepSchedule

    pair = _slots_pair(kind, dtype, 2, STALL_BOUND_S)
    with pair as (spec, endpoints, model, child, _, done):
        device = endpoints[0].memory.device
        g = torch.Generator().manual_seed(7)
        raised: dict[str, str] = {}
        worst = 0.0
        for number in (1, 2):
            for endpoint in endpoints:
                endpoint.begin_step(StepSchedule(number, (TOKENS,), spec.moe_layers))
            inputs = [torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).to(device) for _ in "ab"]
            xs = [x.clone() for x in inputs]
            for layer in range(LAYERS):
                if number == 2 and layer == 1:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    time.sleep(1.5 * STALL_BOUND_S)  # past the FFN's waits for layer 1
                handles = [
                    e.dispatch(layer, x, *model.route(layer, x))
                    for e, x in zip(endpoints, xs, strict=True)
                ]
                for x, e, h in zip(xs, endpoints, handles, strict=True):
                    x += e.combine(h)
            if device.type == "cuda":
                torch.cuda.synchronize()  # as vLLM's wait for the sampled tokens
            for a, endpoint in enumerate(endpoints):
                try:
                    endpoint.check_sampled(number)
                except StepsFailed as failed:
                    raised[f"rank {a} step {number}"] = str(failed)
                    continue
                want = model.reference(*inputs)[a]  # the FFN gathered both ranks' rows
                worst = max(worst, (xs[a].float() - want.float()).abs().max().item())
        if not raised or any(not key.endswith("step 2") for key in raised):
            raise AssertionError(
                "an FFN wait that gave up must answer with an error, failing the stalled step "
                f"(and only it); raised: {raised}"
            )
        done.put("done")
        child.join(10)
        return {"raised": raised, "max_abs_error": worst}
