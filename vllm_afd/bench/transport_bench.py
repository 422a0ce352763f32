"""Transport micro-benchmark: per-layer dispatch + combine round trip beside its floors.

    python -m vllm_afd.bench.transport_bench [--json out.json] [--tokens 1 8 64] [--hidden 4096]

Setup. One attention rank (this process) and one FFN rank (a child process running the reference
FFN loop with ``EchoForward``: ``out = x * 2``, written straight into the reply buffer where the
backend offers one, no expert compute), ``F = 1`` so every token travels, ``top_k`` routing ids
and weights riding along. Each process uses one PyTorch thread and, by default, its own CPU
(``--no-pin`` leaves placement to the scheduler: on two cores it then often puts both on one CPU
and every round trip pays for a context switch). A third process, ``FFNCpuPeer``, lives on the
FFN rank's CPU and blocks on a pipe except while it runs one of the measurements below.

Measured, per message size ``[T, H]``, in ``_ROUNDS`` rounds that each take every measurement in
turn (the VM's CPUs change speed over time, by up to 2x, and the cost of a cross-core transfer
by more: all numbers of a row then see the same mix of conditions):

* ``rt``: wall time of ``combine(dispatch(layer, x, topk_ids, topk_weights))`` (median, p90
  after a warm-up), and ``dispatch`` alone.
* ``echo``: the FFN's own compute, ``EchoForward`` into a preallocated tensor with hot caches,
  timed by ``FFNCpuPeer`` on the FFN rank's CPU. No transport can avoid it, so the ratios
  subtract it: ``transport`` = ``rt - echo`` is what the transport costs (if anything too
  high: in the round trip the FFN rank's compute reads x from, and writes its answer to, lines
  the other CPU touched last, which is slower than with hot caches).
* Two memory-copy floors. Both move exactly the round trip's bytes with ``Tensor.copy_``
  between preallocated uint8 buffers, four copies, and nothing else: no headers, sequence
  numbers, liveness checks, routing or compute::

      1. request in    x | topk_ids | topk_weights  -> request buffer   T * (H * itemsize + 8 K) B
      2. request out   request buffer -> FFN-side tensor                 same
      3. answer in     FFN answer -> response buffer                     T * H * itemsize B
      4. answer out    response buffer -> result                          same

  ``floor_hot`` (``hot_copy_floor``): all four copies in this one process. Every line stays in
  this core's caches, so it holds per-call overhead and bandwidth only: no two-process
  transport can come near it for large messages.
  ``floor_xcore`` (``FFNCpuPeer.cross_core_floor``): the same copies split over the two CPUs,
  through a shared file in /dev/shm: this process does 1 and 4, ``FFNCpuPeer`` does 2 and 3,
  and the hand-over is one flag word both sides spin on. It adds what every two-process
  transport on these CPUs pays and nothing else: the flag's hand-over and the cross-core
  cache-line transfers (lines written on one core and read on the other, or written after the
  other read them). Measured floors: docs/benchmarks.md.

  ``floor_nixl`` (``FFNCpuPeer.nixl_floor``; ``nixl`` rows only): NIXL's own round trip of
  the same bytes between the same two CPUs, the engine the ``nixl`` backend runs on and
  nothing of ours: a notification of the request's bytes, echoed by the peer with one of the
  answer's (agents made as the backend makes them, ``nixl.make_agent``). What the plane adds
  over NIXL is ``ratio_nixl`` = ``(rt - echo) / floor_nixl``.

``ratio_hot`` = ``(rt - echo) / floor_hot``: the transport against raw copying, everything of
being two processes included. ``ratio_xcore`` = ``(rt - echo) / floor_xcore``: the transport
against the cheapest exchange of the same bytes between the same two CPUs (1.0: as cheap as
bare copies and a spin flag). It can drop below 1: the transport does two copies fewer (the FFN
rank reads x where it lies and computes into the reply buffer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from vllm_afd.testing.ffn import EchoForward, ffn_worker_main
from vllm_afd.transport import TransportSpec, create_attention_transport
from vllm_afd.transport import backend as transport_backend
from vllm_afd.transport.control import StepSchedule
from vllm_afd.transport.wait import WaitPolicy

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 512)
DEFAULT_HIDDEN = (128, 1024, 4096)
#: Messages up to this many tokens count as decode-sized in the summary.
DECODE_TOKENS = 64
_START_TIMEOUT_S = 60.0
#: The FFN rank's forward (what ``echo`` times).
ECHO = EchoForward(2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vllm_afd.bench.transport_bench",
        description="Round-trip latency of the CPU AFD transports against two memory-copy floors.",
    )
    p.add_argument("--backends", nargs="+", default=["shm", "nixl"], metavar="NAME")
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS), metavar="T")
    p.add_argument(
        "--hidden",
        "--sizes",
        nargs="+",
        type=int,
        default=list(DEFAULT_HIDDEN),
        metavar="H",
        help="hidden sizes (--sizes is an alias)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seconds", type=float, default=0.4, help="measuring time per point")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the attention and FFN processes to different CPUs",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(step: Callable[[], None], seconds: float, min_iters: int = 20) -> list[float]:
    """Per-call wall times (s) of ``step`` after a warm-up, for about ``seconds``."""
    for _ in range(10):
        step()
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while len(samples) < min_iters or (time.perf_counter() < end and len(samples) < 20000):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples


def _message_bytes(num_tokens: int, hidden: int, dtype: torch.dtype, top_k: int) -> tuple[int, int]:
    """(request, response) bytes of one round trip: x | ids | weights out, [T, H] back."""
    response = num_tokens * hidden * dtype.itemsize
    return response + num_tokens * 8 * top_k, response


def hot_copy_floor(request: int, response: int, seconds: float) -> list[float]:
    """Times (s) of the four copies of one round trip in this process (module docstring)."""
    src, req_buf, ffn_buf = (torch.ones(request, dtype=torch.uint8) for _ in range(3))
    answer, resp_buf, result = (torch.ones(response, dtype=torch.uint8) for _ in range(3))

    def round_trip() -> None:
        req_buf.copy_(src)
        ffn_buf.copy_(req_buf)
        resp_buf.copy_(answer)
        result.copy_(resp_buf)

    return _timed(round_trip, seconds)


#: Flag value that ends a cross-core floor session (odd values: a request is ready).
_STOP = -1
_FLOOR_PREFIX = "vllm_afd_floor_"
#: A spinning side checks that its peer still exists every this many polls (tens of ms).
_POLLS_PER_CHECK = 1 << 20


class _SharedBuffers:
    """A mapped /dev/shm file: a flag page, then the request and the response buffer."""

    def __init__(self, path: str, max_request: int, max_response: int, create: bool) -> None:
        page = mmap.PAGESIZE
        req_span = -(-max_request // page) * page
        size = page + req_span + max_response
        flags = (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("q")
        self.request = torch.frombuffer(self.mm, dtype=torch.uint8, count=max_request, offset=page)
        self.response = torch.frombuffer(
            self.mm, dtype=torch.uint8, count=max_response, offset=page + req_span
        )

    def release(self) -> None:
        del self.request, self.response
        self.words.release()
        self.mm.close()


def echo_times(
    num_tokens: int, hidden: int, dtype: torch.dtype, top_k: int, seconds: float
) -> list[float]:
    """Times (s) of the FFN rank's forward (``ECHO``) into a preallocated tensor, here."""
    x = torch.randn(num_tokens, hidden).to(dtype)
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int32)
    weights = torch.zeros(num_tokens, top_k)
    out = torch.empty_like(x)
    return _timed(lambda: ECHO(x, ids, weights, out), seconds)


def _serve_floor(shared: _SharedBuffers, request: int, response: int, conn) -> None:
    """Process B's side of one cross-core floor session: copy each request out and the answer
    in, hand over through the flag, until ``_STOP``."""
    src, dst = shared.request[:request], torch.empty(request, dtype=torch.uint8)
    ans, out = torch.ones(response, dtype=torch.uint8), shared.response[:response]
    words = shared.words
    conn.send("serving")
    polls = 0
    while (flag := words[0]) != _STOP:
        if flag & 1:
            dst.copy_(src)
            out.copy_(ans)
            words[0] = flag + 1
        else:
            polls += 1
            if not polls % _POLLS_PER_CHECK and conn.poll():
                return  # A sends nothing mid-session: its end of the pipe closed
    conn.send("idle")


#: A NIXL floor's messages: a request (then its bytes), and the end of a session.
_NIXL_REQUEST, _NIXL_STOP = b"R", b"X"


class _NixlEcho:
    """One side of the NIXL floor: this process's agent (made once), linked to its peer's."""

    def __init__(self, role: str) -> None:
        from vllm_afd.transport.nixl import make_agent

        self.agent = make_agent(f"vllm-afd-floor-{role}-{os.getpid()}-{secrets.token_hex(4)}")
        self.peer = ""

    def link(self, metadata: bytes) -> None:
        name = self.agent.add_remote_agent(metadata)
        self.peer = name.decode() if isinstance(name, bytes) else name

    def receive(self) -> list[bytes]:
        """The next notifications from the peer (spins until one comes)."""
        while not (notifs := self.agent.get_new_notifs()):
            pass
        return [m for messages in notifs.values() for m in messages]


def _serve_nixl_floor(echo: _NixlEcho, metadata: bytes, response: int, conn) -> None:
    """Process B's side of one NIXL floor session: answer each request with ``response``
    bytes, until ``_NIXL_STOP``."""
    echo.link(metadata)
    answer = b"A" * response
    conn.send(echo.agent.get_agent_metadata())
    while True:
        for message in echo.receive():
            if message == _NIXL_STOP:
                conn.send("idle")
                return
            echo.agent.send_notif(echo.peer, answer)


def _peer_main(path: str, max_request: int, max_response: int, cpu: int | None, conn) -> None:
    """``FFNCpuPeer``'s process: runs the jobs ``conn`` brings (``("floor", request bytes,
    response bytes)``, ``("nixl", agent metadata, response bytes)`` or ``("echo",
    *echo_times args)``), blocked on ``conn`` in between (no CPU use); ``None`` or a closed
    pipe ends it."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    shared = _SharedBuffers(path, max_request, max_response, create=False)
    nixl: _NixlEcho | None = None
    conn.send("ready")
    while (job := conn.recv()) is not None:
        if job[0] == "echo":
            conn.send(echo_times(*job[1:]))
        elif job[0] == "nixl":
            nixl = nixl or _NixlEcho("ffn")
            _serve_nixl_floor(nixl, *job[1:], conn)
        else:
            _serve_floor(shared, *job[1:], conn)


class FFNCpuPeer:
    """A process on the FFN rank's CPU, idle between jobs: process B of the cross-core floor
    (module docstring), and where the FFN's own compute (``echo``) is timed."""

    def __init__(self, ctx, max_request: int, max_response: int, cpu: int | None) -> None:
        path = os.path.join("/dev/shm", f"{_FLOOR_PREFIX}{os.getpid()}_{secrets.token_hex(4)}")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_peer_main, args=(path, max_request, max_response, cpu, child), daemon=True
        )
        self.shared = _SharedBuffers(path, max_request, max_response, create=True)
        self._nixl: _NixlEcho | None = None  # this process's side of the NIXL floor
        try:
            self.proc.start()
            child.close()
            self._answer()
        except BaseException:
            self.close()
            raise
        finally:
            os.unlink(path)  # both sides have it mapped now (or never will)

    def _answer(self):
        if not self.conn.poll(_START_TIMEOUT_S):
            raise RuntimeError("the FFN-CPU peer process did not answer")
        return self.conn.recv()

    def echo(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, top_k: int, seconds: float
    ) -> list[float]:
        """``echo_times`` run on the FFN rank's CPU."""
        self.conn.send(("echo", num_tokens, hidden, dtype, top_k, seconds))
        return self._answer()

    def cross_core_floor(self, request: int, response: int, seconds: float) -> list[float]:
        """Times (s) of: request in here, peer copies it out and the answer in, answer out."""
        words = self.shared.words
        words[0] = 0
        self.conn.send(("floor", request, response))
        self._answer()  # "serving"
        src = torch.ones(request, dtype=torch.uint8)
        result = torch.empty(response, dtype=torch.uint8)
        req, resp = self.shared.request[:request], self.shared.response[:response]
        flag = 0

        def round_trip() -> None:
            nonlocal flag
            req.copy_(src)
            words[0] = flag + 1
            flag += 2
            polls = 0
            while words[0] != flag:
                polls += 1
                if not polls % _POLLS_PER_CHECK and not self.proc.is_alive():
                    raise RuntimeError("the FFN-CPU peer process died")
            result.copy_(resp)

        try:
            return _timed(round_trip, seconds)
        finally:
            words[0] = _STOP
            self._answer()  # "idle"

    def nixl_floor(self, request: int, response: int, seconds: float) -> list[float]:
        """Times (s) of: a NIXL notification of ``request`` bytes to the peer, its answer of
        ``response`` bytes back (module docstring)."""
        if self._nixl is None:
            self._nixl = _NixlEcho("attention")
        echo = self._nixl
        self.conn.send(("nixl", echo.agent.get_agent_metadata(), response))
        echo.link(self._answer())
        message = _NIXL_REQUEST + b"R" * max(0, request - 1)

        def round_trip() -> None:
            echo.agent.send_notif(echo.peer, message)
            echo.receive()

        try:
            return _timed(round_trip, seconds)
        finally:
            echo.agent.send_notif(echo.peer, _NIXL_STOP)
            self._answer()  # "idle"

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self.shared.release()


def _ffn_main(spec: TransportSpec, cpu: int | None, conn, stop_event) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ffn_worker_main(spec, 0, ECHO, conn, stop_event, num_threads=1)


class EchoFFN:
    """The FFN rank in a child process; ``spec`` carries its address once started."""

    def __init__(self, ctx, spec: TransportSpec, cpu: int | None) -> None:
        self.stop_event = ctx.Event()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_ffn_main, args=(spec, cpu, child, self.stop_event), daemon=True
        )
        self.proc.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"{spec.backend} FFN rank did not start")
        self.spec = dataclasses.replace(spec, addresses=(parent.recv(),))

    def close(self) -> None:
        self.stop_event.set()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


#: Rounds per point, each measuring ``rt``, ``floor_xcore``, ``floor_hot`` and ``echo`` in turn
#: (module docstring).
_ROUNDS = 4


#: Layers of a step the benchmark announces, for a backend that needs steps: a round trip is
#: one layer of it, so the announcement's cost is spread as over a deep model's layers.
STEP_LAYERS = tuple(range(128))


def step_layers(
    att, spec: TransportSpec, num_tokens: int, layers: tuple[int, ...] = STEP_LAYERS
) -> Callable[[], int]:
    """``next_layer()``: the layer of the next round trip of up to ``num_tokens`` tokens (the
    first of ``layers`` where the backend needs no steps; else the next of them in turn,
    announcing a step of them all whenever the last one was used), as a decode's steps visit
    the model's MoE layers."""
    if not transport_backend(spec.backend).needs_steps:
        return lambda: layers[0]
    left: Iterator[int] = iter(())

    def next_layer() -> int:
        nonlocal left
        layer = next(left, None)
        if layer is None:
            att.begin_step(StepSchedule(att.step + 1, (num_tokens,), layers))
            left = iter(layers)
            layer = next(left)
        return layer

    return next_layer


def measure_point(
    att, spec: TransportSpec, num_tokens: int, seconds: float, peer: FFNCpuPeer
) -> dict:
    """Round trip, dispatch-only, echo and both floors for one ``[T, H]`` message size."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(spec.dtype)
    ids = torch.randint(0, spec.num_experts, (num_tokens, spec.top_k), generator=gen)
    weights = torch.full((num_tokens, spec.top_k), 1.0 / spec.top_k)
    next_layer = step_layers(att, spec, num_tokens)
    out = att.combine(att.dispatch(next_layer(), x, ids, weights))
    if not torch.equal(out, x * 2):
        raise AssertionError(f"{spec.backend}: echo mismatch at T={num_tokens}")
    dispatch_times: list[float] = []

    def round_trip() -> None:
        layer = next_layer()
        start = time.perf_counter()
        handle = att.dispatch(layer, x, ids, weights)
        dispatch_times.append(time.perf_counter() - start)
        att.combine(handle)

    request, response = _message_bytes(num_tokens, spec.hidden_size, spec.dtype, spec.top_k)
    rt: list[float] = []
    xcore: list[float] = []
    hot: list[float] = []
    echo: list[float] = []
    nixl: list[float] = []
    share = seconds / _ROUNDS
    for _ in range(_ROUNDS):
        rt += _timed(round_trip, share)
        time.sleep(2 * WaitPolicy().yield_s)  # the idle FFN rank is past its yield stage now
        xcore += peer.cross_core_floor(request, response, share / 2)
        hot += hot_copy_floor(request, response, share / 2)
        echo += peer.echo(num_tokens, spec.hidden_size, spec.dtype, spec.top_k, share / 4)
        if spec.backend == "nixl":
            nixl += peer.nixl_floor(request, response, share / 2)
    us = 1e6
    row = {
        "backend": spec.backend,
        "tokens": num_tokens,
        "hidden": spec.hidden_size,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "request_bytes": request,
        "response_bytes": response,
        "iters": len(rt),
        "rt_median_us": statistics.median(rt) * us,
        "rt_p90_us": _percentile(rt, 0.9) * us,
        "dispatch_median_us": statistics.median(dispatch_times) * us,
        "echo_median_us": statistics.median(echo) * us,
        "floor_hot_median_us": statistics.median(hot) * us,
        "floor_hot_p90_us": _percentile(hot, 0.9) * us,
        "floor_xcore_median_us": statistics.median(xcore) * us,
        "floor_xcore_p90_us": _percentile(xcore, 0.9) * us,
    }
    row["transport_us"] = row["rt_median_us"] - row["echo_median_us"]
    row["ratio_hot"] = row["transport_us"] / row["floor_hot_median_us"]
    row["ratio_xcore"] = row["transport_us"] / row["floor_xcore_median_us"]
    if nixl:
        row["floor_nixl_median_us"] = statistics.median(nixl) * us
        row["ratio_nixl"] = row["transport_us"] / row["floor_nixl_median_us"]
    return row


def run_backend(
    ctx, backend: str, args: argparse.Namespace, cpus: list[int] | None, peer: FFNCpuPeer
) -> list:
    """Every (hidden, tokens) point of one backend, one FFN process per hidden size."""
    results = []
    for hidden in args.hidden:
        spec = TransportSpec(
            backend=backend,
            num_attention_ranks=1,
            num_ffn_ranks=1,
            num_experts=64,
            hidden_size=hidden,
            top_k=args.top_k,
            max_tokens=max(args.tokens),
            dtype=getattr(torch, args.dtype),
            num_slots=2,
            timeout_s=30.0,
            moe_layers=STEP_LAYERS,
        )
        ffn = EchoFFN(ctx, spec, cpus[1] if cpus else None)
        att = create_attention_transport(ffn.spec, 0)
        try:
            for num_tokens in args.tokens:
                row = measure_point(att, ffn.spec, num_tokens, args.seconds, peer)
                results.append(row)
                print(format_row(row), flush=True)
        finally:
            att.close()
            ffn.close()
    return results


_COLUMNS = (
    "backend",
    "tokens",
    "hidden",
    "KiB",
    "rt_med_us",
    "rt_p90_us",
    "dispatch_us",
    "echo_us",
    "hot_us",
    "xcore_us",
    "x_hot",
    "x_xcore",
    "nixl_us",
    "x_nixl",
)


def format_row(row: dict) -> str:
    kib = (row["request_bytes"] + row["response_bytes"]) / 1024
    cells = (
        row["backend"],
        row["tokens"],
        row["hidden"],
        f"{kib:.1f}",
        f"{row['rt_median_us']:.1f}",
        f"{row['rt_p90_us']:.1f}",
        f"{row['dispatch_median_us']:.1f}",
        f"{row['echo_median_us']:.1f}",
        f"{row['floor_hot_median_us']:.1f}",
        f"{row['floor_xcore_median_us']:.1f}",
        f"{row['ratio_hot']:.2f}",
        f"{row['ratio_xcore']:.2f}",
        f"{row['floor_nixl_median_us']:.1f}" if "ratio_nixl" in row else "-",
        f"{row['ratio_nixl']:.2f}" if "ratio_nixl" in row else "-",
    )
    return "  ".join(f"{c:>11}" for c in cells)


def summarize(results: list[dict]) -> dict:
    """Per backend: median and worst of both ratios over decode-sized messages
    (T <= DECODE_TOKENS)."""
    summary = {}
    for backend in sorted({r["backend"] for r in results}):
        rows = [r for r in results if r["backend"] == backend and r["tokens"] <= DECODE_TOKENS]
        if rows:
            keys = [k for k in ("ratio_hot", "ratio_xcore", "ratio_nixl") if k in rows[0]]
            summary[backend] = {
                f"decode_{stat.__name__}_{key}": stat([r[key] for r in rows])
                for key in keys
                for stat in (statistics.median, max)
            }
    return summary


def _machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2] if args.pin and len(allowed) >= 2 else None
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm_afd.testing.ffn"])
    print("  ".join(f"{c:>11}" for c in _COLUMNS))
    results = []
    largest = _message_bytes(
        max(args.tokens), max(args.hidden), getattr(torch, args.dtype), args.top_k
    )
    peer = FFNCpuPeer(ctx, *largest, cpus[1] if cpus else None)
    try:
        for backend in args.backends:
            results += run_backend(ctx, backend, args, cpus, peer)
    finally:
        peer.close()
        os.sched_setaffinity(0, allowed)
    summary = summarize(results)
    for backend, s in summary.items():
        print(
            f"{backend}: decode-sized (T <= {DECODE_TOKENS}) (rt - echo) / floor: "
            f"hot median {s['decode_median_ratio_hot']:.2f} worst {s['decode_max_ratio_hot']:.2f}"
            f"; cross-core median {s['decode_median_ratio_xcore']:.2f} "
            f"worst {s['decode_max_ratio_xcore']:.2f}"
            + (
                f"; NIXL's own median {s['decode_median_ratio_nixl']:.2f} "
                f"worst {s['decode_max_ratio_nixl']:.2f}"
                if "decode_median_ratio_nixl" in s
                else ""
            )
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "machine": _machine(),
                    "args": vars(args),
                    "pinned_cpus": cpus,
                    "summary": summary,
                    "results": results,
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
