"""Device check of the slot plane (issue 19): one attention and one FFN process exchange the MoE
layers of a toy model through ``transport.slot_plane``, against a one-process reference.

    python -m vllm_afd.testing.slot_plane_check [--json out.json]

Steps, each in its own process group under its own timeout, one ``PASS``/``FAIL``/``SKIP`` line
each (the whole well under 5 minutes):

* ``probe``: ``nvidia-smi topo -m`` (SKIP without a GPU).
* ``host-plane``: the protocol through host memory (``HostPlaneMemory``): two attention ranks
  (in one process, taking turns) whose rows the FFN rank serves in one forward, two
  microbatches in vLLM's DBO call order (D0, D1, C0, D0', C1, ...), float32, identical to the
  reference.
* ``cuda-ipc-probe``: CUDA IPC alone, before any protocol: a child process creates a device
  buffer, fills it and hands its IPC handle over (``CudaPlaneMemory.create``); this process maps
  it (``attach``), reads the pattern, writes another the child reads back. A FAIL here says
  "CUDA IPC refused here" (a container without the IPC it needs, a driver), not a protocol bug.
* ``cuda-plane``: the same through device memory shared by CUDA IPC on GPU 0 (both processes on
  one GPU), bfloat16, at bf16 tolerance.
* ``cuda-two-gpus``: ``cuda-plane`` with the FFN process on GPU 1, its ``CUDA_VISIBLE_DEVICES``
  narrowed to that GPU as placement narrows an FFN rank's (its device is its own 0), the
  buffers reached over NVLink (SKIP with one GPU).
* ``cuda-graphs``: both sides' whole step captured as one CUDA graph each, then 3 replays with
  fresh inputs, each against the reference: each side sets its step word before a replay and
  the flag values the kernels compute from it carry the protocol, with no Python on the token
  path.
* ``host-slots`` / ``cuda-slots``: the serving backend itself (``transport/slots.py``): two
  attention ranks' ``endpoint.AttentionEndpoint`` (announced steps, DBO call order) and an FFN
  process's ``SteppedPlaneFFN`` serving whole steps as the FFN executor does, its steps as
  CUDA graphs from the second step of a shape on (``StepGraphs``; on the host eagerly, with
  the device's wait semantics), 4 steps against the reference (host: exact; CUDA: bf16).
* ``host-peer-death`` / ``cuda-peer-death``: the ``slots`` pair again; the FFN process serves one
  step and is SIGKILLed while the attention ranks wait in the next: their device waits end
  within ``PEER_DEATH_BOUND_S`` of the kill (the endpoint's watchdog sets the abort word they
  poll; on CUDA, pinned host memory the Triton wait reads) instead of each spinning to its
  bound, and the next announcement raises ``FFNRankLost``.
* ``cuda-stalled-peer``: the ``slots`` pair with a wait bound of ``STALL_BOUND_S``; in its
  second step both attention ranks stall past that bound before one layer: the FFN process's
  waits for that layer give up and run the use on the slots' stale rows, and the answers must
  be error answers (the missed word the wait writes, read by the answer's release store), so
  that the late requests' own waits record a failure, raised when the step's sampled tokens
  are read (``check_sampled``), rather than take the stale answers as their own. The same
  function runs on the host in the unit tests.
* ``cuda-round-trip``: per decode-sized batch, the round trip per MoE layer (graph replays of a
  step of ``LAYERS`` layers, the router included, FFN compute an echo) and the bytes it moves,
  against the time the GPU's own copy takes for those bytes. Two processes time-slice one GPU
  here (no MPS), so the latency is an upper bound that does not transfer to two GPUs.

The toy model: ``testing/toy_model.py``; the steps on the serving backend itself (``*-slots``,
``*-peer-death``, ``cuda-stalled-peer``): ``testing/slots_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm_afd.host import session_pids
from vllm_afd.testing.slots_check import run_peer_death, run_slots_pair, run_stalled_peer
from vllm_afd.testing.toy_model import (
    HIDDEN,
    LAYERS,
    TOKENS,
    TOP_K,
    ToyMoE,
    dbo_order,
)
from vllm_afd.transport.control import Part
from vllm_afd.transport.slot_plane import AttentionPlane, FFNPlane, PlaneLayout

SKIP = 77
#: How long a step's processes get to exit after a SIGTERM at its timeout (``stop_session``).
STOP_GRACE_S = 5.0
#: (step, timeout in seconds): 300 s in all, so the whole check fits the device budget.
STEPS = (
    ("probe", 10),
    ("host-plane", 25),
    ("host-slots", 20),
    ("cuda-ipc-probe", 20),
    ("cuda-plane", 30),
    ("cuda-two-gpus", 30),
    ("cuda-graphs", 40),
    ("cuda-slots", 30),
    ("cuda-round-trip", 30),
    ("host-peer-death", 20),
    ("cuda-peer-death", 25),
    ("cuda-stalled-peer", 20),
)


@dataclass(frozen=True)
class PlaneHandle:
    """What ``dispatch`` returns and ``combine`` consumes: the slot, the layer's position in the
    step and the rows sent."""

    slot: int
    position: int
    num_tokens: int


def dispatch(
    plane: AttentionPlane,
    slot: int,
    position: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> PlaneHandle:
    """``plane.send`` of every row to every FFN rank (fixed shapes, as on devices)."""
    n = x.shape[0]
    if not 0 <= n <= plane.layout.max_tokens:
        raise ValueError(f"send of {n} tokens: allowed 0..{plane.layout.max_tokens}")
    for f in range(len(plane.slots)):
        plane.send(f, slot, position, x, topk_ids, topk_weights)
    return PlaneHandle(slot, position, n)


def combine(plane: AttentionPlane, handle: PlaneHandle) -> torch.Tensor:
    """Await every FFN rank's answer and sum them in FFN rank order (``await_sum``: on devices
    with streams, queued): ``[N, H]``, a new tensor (the slot may be reused at once)."""
    out = torch.empty(
        handle.num_tokens, plane.layout.hidden, dtype=plane.layout.dtype, device=plane.memory.device
    )
    plane.await_sum(handle.slot, handle.position, out)
    return out


def attention_step(
    planes: list[AttentionPlane], model: ToyMoE, xs: list[list[torch.Tensor]], layers: int
) -> None:
    """One step of every attention rank (``planes[a]``, its hidden states ``xs[a]``, one per
    microbatch), in place; the ranks take turns at every call. Layer ``l`` is position ``l``
    of the step; the step itself is set before (``AttentionPlane.begin``)."""
    handles = {}
    for op, mb, layer in dbo_order(layers, len(xs[0])):
        for a, plane in enumerate(planes):
            x = xs[a][mb]
            if op == "D":
                handles[a, mb] = dispatch(plane, mb, layer, x, *model.route(layer, x))
            else:
                x += combine(plane, handles.pop((a, mb)))


def ffn_step(plane: FFNPlane, forwards: list[Callable], rows: int, microbatches: int) -> None:
    """One step on the FFN side: per layer, each microbatch's slot in turn, ``rows`` tokens
    from every attention rank (the step set before: ``FFNPlane.begin``)."""
    ranks = range(plane.layout.num_attention_ranks)
    for layer, forward in enumerate(forwards):
        parts = [Part(a, rows, layer) for a in ranks]
        for slot in range(microbatches):
            plane.serve(slot, parts, forward)


def ffn_begin(plane: FFNPlane, step: int) -> None:
    """Every attention rank is at ``step`` (both sides count steps from 1 here)."""
    for a in range(plane.layout.num_attention_ranks):
        plane.begin(a, step)


def _memory(kind: str):
    if kind == "host":
        from vllm_afd.transport.slot_plane_host import HostPlaneMemory

        return HostPlaneMemory(timeout_s=30.0)
    if kind == "interpreted":
        return interpreted_memory()
    from vllm_afd.transport.slot_plane_cuda import CudaPlaneMemory

    torch.cuda.set_device(0)
    return CudaPlaneMemory(0, timeout_s=10.0)  # a deadline well inside the step's timeout


#: Polls an interpreted wait makes before it gives up (about 0.25 ms each: Python runs the
#: kernel), a bound well above a toy step's wait.
INTERPRETED_MAX_SPINS = 40_000


def interpreted_memory():
    """Host shared memory whose flags are published and awaited by the CUDA layer's own Triton
    kernels (``slot_plane_cuda.TritonWaits``), run by Triton's interpreter
    (``TRITON_INTERPRET=1``, set before Triton is imported): the GPU path's signal and wait,
    release/acquire at system scope and the abort word, tested between two processes on a CPU.
    The attention side's sends store their flag through the host words (``AttentionPlane.send``
    on host memory); every other flag goes through the kernels."""
    from vllm_afd.transport.slot_plane_cuda import TritonWaits
    from vllm_afd.transport.slot_plane_host import HostPlaneMemory

    class InterpretedPlaneMemory(TritonWaits, HostPlaneMemory):
        def __init__(self) -> None:
            HostPlaneMemory.__init__(self, timeout_s=30.0, device_waits=True)
            self.max_spins = INTERPRETED_MAX_SPINS
            self.bound = f"{INTERPRETED_MAX_SPINS} polls"

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the interpreted plane needs TRITON_INTERPRET=1 before Triton loads")
    return InterpretedPlaneMemory()


def _ffn_main(kind, dtype, layout_args, plan, to_attention, from_attention) -> None:
    """The FFN process: create the request buffer, send its handle, map the attention ranks'
    answer buffers, serve the steps of ``plan``: (first, last, rows, graphs, echo); with
    graphs the first step eagerly (the warm-up), then a graph of it replayed."""
    memory = _memory(kind)
    layout = PlaneLayout(*layout_args)
    plane = FFNPlane(layout, memory, 0)
    first, last, rows, graphs, echo = plan
    model = ToyMoE(dtype, memory.device)
    if echo:
        forwards = [lambda x, i, w, out: out.copy_(x)] * LAYERS
    else:
        forwards = [model.experts(layer) for layer in range(LAYERS)]
    to_attention.put(plane.handle)
    for a, handle in enumerate(from_attention.get(timeout=60)):
        plane.attach_answers(a, handle)
    microbatches = layout.num_slots
    if graphs:
        ffn_begin(plane, first)
        graph = _capture(lambda: ffn_step(plane, forwards, rows, microbatches))
        for step in range(first + 1, last + 1):
            ffn_begin(plane, step)  # outside the graph: the replay reads the step word
            graph.replay()
    else:
        for step in range(first, last + 1):
            ffn_begin(plane, step)
            ffn_step(plane, forwards, rows, microbatches)
    if memory.device.type == "cuda":
        torch.cuda.synchronize()
    memory.check()
    from_attention.get(timeout=60)  # the attention side has mapped and used the buffer: done


def _capture(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm up once (eagerly, both sides in lockstep), then capture ``step``."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def run_pair(
    kind: str,
    dtype: torch.dtype,
    steps: int = 2,
    microbatches: int = 2,
    rows: int = TOKENS,
    graphs: bool = False,
    echo: bool = False,
    attention_ranks: int = 1,
    ffn_gpu: int | None = None,
    replace_at: int | None = None,
) -> dict:
    """Run ``steps`` steps between this process (``attention_ranks`` attention ranks) and an
    FFN child (``ffn_gpu``: on that GPU, which is all its ``CUDA_VISIBLE_DEVICES`` shows it);
    returns the largest deviation from the reference, and for ``echo`` the seconds per step.
    ``replace_at``: before that step the child is killed and a replacement serves the rest,
    linked as failover links one (``AttentionPlane.attach``); with graphs, the attention
    ranks' graph captured against the lost child's buffer is replayed into the new one."""
    ctx = mp.get_context("spawn")
    layout_args = (attention_ranks, microbatches, rows, HIDDEN, TOP_K, dtype)
    # with graphs both sides run one eager warm-up step (step 1), capture, then replay
    # ``steps`` steps (2 .. steps + 1)
    last = steps + 1 if graphs else steps

    def start(first: int, until: int) -> tuple[Any, Any, Any]:
        """An FFN child serving steps ``first`` to ``until``, and its two queues."""
        to_attention, from_attention = ctx.Queue(), ctx.Queue()
        plan = (first, until, rows, graphs, echo)
        child = ctx.Process(
            target=_ffn_main,
            args=(kind, dtype, layout_args, plan, to_attention, from_attention),
            daemon=True,
        )
        with _visible_devices(None if ffn_gpu is None else str(ffn_gpu)):
            child.start()  # a spawned child takes the environment as it is now
        return child, to_attention, from_attention

    child, to_attention, from_attention = start(1, last if replace_at is None else replace_at - 1)
    try:
        memory = _memory(kind)
        layout = PlaneLayout(*layout_args)
        handle = to_attention.get(timeout=60)
        planes = [AttentionPlane(layout, memory, a, [handle]) for a in range(attention_ranks)]
        from_attention.put([plane.answer_handles[0] for plane in planes])
        model = ToyMoE(dtype, memory.device)
        g = torch.Generator().manual_seed(4)
        xs = [
            [
                torch.zeros(rows, HIDDEN, dtype=dtype, device=memory.device)
                for _ in range(microbatches)
            ]
            for _ in planes
        ]
        result = {"max_abs_error": 0.0, "steps_checked": 0}

        def fresh_inputs() -> list[torch.Tensor]:
            inputs = [
                torch.randn(rows, HIDDEN, generator=g).to(dtype)
                for _ in range(len(planes) * microbatches)
            ]
            for x, new in zip((x for rank in xs for x in rank), inputs, strict=True):
                x.copy_(new)
            return inputs

        def compare(inputs: list[torch.Tensor]) -> None:
            if echo:  # timing only
                return
            for mb in range(microbatches):  # a use: every attention rank's microbatch mb
                x0s = [inputs[a * microbatches + mb].to(memory.device) for a in range(len(xs))]
                for rank, want in zip(xs, model.reference(*x0s), strict=True):
                    err = (rank[mb].float() - want.float()).abs().max().item()
                    result["max_abs_error"] = max(result["max_abs_error"], err)
            result["steps_checked"] += 1

        def step() -> None:
            attention_step(planes, model, xs, LAYERS)

        def begin(step: int) -> None:
            nonlocal child, to_attention, from_attention
            if step == replace_at:  # the FFN child lost between steps, its replacement linked
                child.kill()
                child.join(10)
                child, to_attention, from_attention = start(step, last)
                handle = to_attention.get(timeout=60)
                for plane in planes:
                    plane.attach(0, handle)
                from_attention.put([plane.answer_handles[0] for plane in planes])
                result["replaced_at"] = step
            for plane in planes:
                plane.begin(step)

        if graphs:
            fresh_inputs()
            begin(1)
            graph = _capture(step)
            started = time.perf_counter()
            for k in range(2, last + 1):
                inputs = fresh_inputs()
                begin(k)
                graph.replay()
                torch.cuda.synchronize()
                compare(inputs)
            result["seconds_per_step"] = (time.perf_counter() - started) / steps
        else:
            for k in range(1, last + 1):
                inputs = fresh_inputs()
                begin(k)
                step()
                if memory.device.type == "cuda":
                    torch.cuda.synchronize()
                compare(inputs)
        memory.check()
        from_attention.put("done")
        child.join(60)
        if child.exitcode != 0:
            raise RuntimeError(f"FFN process exited with {child.exitcode}")
        return result
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)


def _no_cuda() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def step_probe() -> dict:
    if shutil.which("nvidia-smi") is None or not torch.cuda.is_available():
        raise _Skip("no GPU (nvidia-smi not found or CUDA unavailable)")
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=15)
    print(topo.stdout)
    return {"gpus": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}


def step_cuda_stalled_peer() -> dict:
    _require_cuda()
    return _bf16_close(run_stalled_peer("cuda", torch.bfloat16))


def step_host_peer_death() -> dict:
    return run_peer_death("host", torch.float32)


def step_cuda_peer_death() -> dict:
    _require_cuda()
    return run_peer_death("cuda", torch.bfloat16)


def step_host_slots() -> dict:
    result = run_slots_pair("host", torch.float32)
    if result["max_abs_error"] != 0.0:
        raise AssertionError(f"the slots backend differs from the reference: {result}")
    return result


def step_cuda_slots() -> dict:
    _require_cuda()
    result = _bf16_close(run_slots_pair("cuda", torch.bfloat16))
    if result["ffn_graphs"] != 1 or result["ffn_eager_steps"] != 1:
        raise AssertionError(
            "the FFN steps were not one CUDA graph captured at the announced capture, every "
            f"step after the warm-up replayed: {result}"
        )
    return result


@contextlib.contextmanager
def _visible_devices(devices: str | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set to ``devices`` (unchanged for ``None``), restored after."""
    if devices is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _ipc_child(to_parent, from_parent) -> None:
    """``cuda-ipc-probe``'s child: a device buffer filled with 1..n, its handle to the parent;
    then what the parent wrote into it (its sum) back."""
    from vllm_afd.transport.slot_plane_cuda import CudaPlaneMemory

    torch.cuda.set_device(0)
    memory = CudaPlaneMemory(0)
    buffer, handle = memory.create(4096)
    buffer.view(torch.int32).copy_(torch.arange(1, 1025, dtype=torch.int32))
    torch.cuda.synchronize()
    to_parent.put(handle)
    from_parent.get(timeout=30)  # the parent wrote its pattern
    to_parent.put(int(buffer.view(torch.int32).sum()))
    memory.close()


def step_cuda_ipc_probe() -> dict:
    _require_cuda()
    from vllm_afd.transport.slot_plane_cuda import CudaPlaneMemory

    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(to_parent, from_parent), daemon=True)
    child.start()
    try:
        handle = to_parent.get(timeout=60)
        torch.cuda.set_device(0)
        try:
            mapped = CudaPlaneMemory(0).attach(handle, 4096).view(torch.int32)
            seen = int(mapped.sum())
        except RuntimeError as exc:
            raise RuntimeError(f"CUDA IPC refused here (not a protocol bug): {exc}") from exc
        if seen != 1024 * 1025 // 2:
            raise AssertionError(f"CUDA IPC mapped other bytes: sum {seen}, wrote 1..1024")
        mapped.fill_(2)
        torch.cuda.synchronize()
        from_parent.put("written")
        back = to_parent.get(timeout=30)
        if back != 2 * 1024:
            raise AssertionError(f"the creator read {back} after the peer wrote 2s (2048)")
        child.join(30)
        return {"read": seen, "written_read_back": back}
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)


def step_cuda_two_gpus() -> dict:
    _require_cuda()
    if torch.cuda.device_count() < 2:
        raise _Skip(f"one GPU here ({torch.cuda.device_count()}): no second GPU for the FFN")
    return _bf16_close(run_pair("cuda", torch.bfloat16, steps=2, attention_ranks=2, ffn_gpu=1))


def step_host_plane() -> dict:
    result = run_pair("host", torch.float32, steps=2, attention_ranks=2, replace_at=2)
    if result["max_abs_error"] != 0.0:
        raise AssertionError(f"host plane differs from the reference: {result}")
    return result


def _bf16_close(result: dict) -> dict:
    if not result["max_abs_error"] <= 5e-2:  # bf16, 4 residual layers of O(1) values
        raise AssertionError(f"differs from the reference beyond bf16 tolerance: {result}")
    return result


def step_cuda_plane() -> dict:
    _require_cuda()
    return _bf16_close(run_pair("cuda", torch.bfloat16, steps=2, attention_ranks=2))


def step_cuda_graphs() -> dict:
    _require_cuda()
    # the FFN child lost after two steps: the graph captured against its buffer replayed
    # into its replacement's (``PlaneMemory.readdress``), as failover links one
    graphs = run_pair("cuda", torch.bfloat16, steps=3, graphs=True, attention_ranks=2, replace_at=3)
    return _bf16_close(graphs)


def step_cuda_round_trip() -> dict:
    _require_cuda()
    rows_out = []
    for tokens in (1, 16, 64, 256):
        timed = run_pair(
            "cuda", torch.bfloat16, steps=20, microbatches=1, rows=tokens, graphs=True, echo=True
        )
        per_layer = timed["seconds_per_step"] / LAYERS
        moved = 2 * tokens * HIDDEN * 2 + tokens * TOP_K * 8  # x out, answer back, routing
        rows_out.append(
            {
                "tokens": tokens,
                "round_trip_us": per_layer * 1e6,
                "bytes": moved,
                "copy_us": _copy_seconds(moved) * 1e6,
            }
        )
        print(rows_out[-1])
    big = 1 << 28
    return {"rows": rows_out, "copy_gb_per_s": big / _copy_seconds(big) / 1e9}


def _copy_seconds(nbytes: int) -> float:
    """Seconds a device-to-device copy of ``nbytes`` takes on GPU 0 (median of 50)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


class _Skip(Exception):
    pass


def _require_cuda() -> None:
    problem = _no_cuda()
    if problem:
        raise _Skip(problem)


def _run_step(name: str, out: str) -> int:
    """This process runs step ``name``; exit 0 (PASS), 77 (SKIP, reason on the last line)."""
    function = globals()["step_" + name.replace("-", "_")]
    try:
        result = function()
    except _Skip as skip:
        print(skip)
        return SKIP
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every step's result here")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", help="run only these steps")
    parser.add_argument(
        "--limit-scale",
        type=float,
        default=1.0,
        help="multiply every step's timeout (the unit tests run it beside the e2e tier on two "
        "busy cores, where a host step took over 25 s)",
    )
    args = parser.parse_args(argv)
    if args.step:
        return _run_step(args.step, args.out)
    report, failed = {}, False
    for name, limit in STEPS:
        if args.only and name not in args.only:
            continue
        no_cuda = _no_cuda() if name.startswith("cuda-") else None
        if no_cuda:  # known here: no process to start
            status, detail = "SKIP", {"line": no_cuda}
        else:
            status, detail = _spawn_step(name, limit * args.limit_scale)
        report[name] = {"status": status, **detail}
        failed |= status == "FAIL"
        print(f"{status} {name}: {detail.get('line', '')}".rstrip(": "), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("SLOT PLANE CHECK:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def stop_session(sid: int, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a step's session at its timeout: SIGTERM first, which ends the step's processes
    but not multiprocessing's resource tracker (it ignores SIGTERM), so that once they are gone
    the tracker unlinks what they leaked (their queues' semaphores in ``/dev/shm``) and exits;
    SIGKILL for whatever is left after ``grace_s`` seconds. (A SIGKILL of the whole session
    killed the tracker with the step and left the semaphores behind.)"""
    os.killpg(sid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in session_pids(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _spawn_step(name: str, limit: float) -> tuple[str, dict]:
    """Run one step in a process group of its own; kill the group at ``limit``."""
    import tempfile

    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_afd.testing.slot_plane_check", "--step", name, "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stop_session(proc.pid)
        log, _ = proc.communicate()
        return "FAIL", {"line": f"timed out after {limit} s", "log": log[-4000:]}
    finally:
        took = time.perf_counter() - start
    lines = log.strip().splitlines() or [""]
    if proc.returncode == SKIP:
        return "SKIP", {"line": lines[-1]}
    if proc.returncode != 0:
        return "FAIL", {"line": f"exit {proc.returncode}: {lines[-1][:300]}", "log": log[-4000:]}
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return "PASS", {
        "line": f"{took:.1f} s {json.dumps(result)[:400]}",
        "result": result,
        "log": log[-4000:],
    }


if __name__ == "__main__":
    sys.exit(main())
