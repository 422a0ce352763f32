"""Helpers for transport tests: small specs, random routing, FFN ranks in child processes.

FFN ranks run ``testing.ffn.ffn_worker_main`` in processes forked from a forkserver that has
imported torch once (see conftest), so that starting one costs tens of milliseconds instead of
seconds. Every process is joined with a timeout and killed if it does not stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from vllm_afd.host import SHM_DIR
from vllm_afd.testing.ffn import StopFlag, ffn_worker_main
from vllm_afd.testing.reference import (
    FFNForward,
    LocalMoE,
    ScaleExperts,
    reference_moe_combine,
)
from vllm_afd.transport import (
    AttentionTransport,
    TransportSpec,
    create_attention_transport,
    create_ffn_transport,
)
from vllm_afd.transport.base import ServesRequests
from vllm_afd.transport.control import StepSchedule
from vllm_afd.transport.control_block import reap_stale_control_blocks

#: Segment-name prefix of this test run (the slot plane's FFN side takes it from
#: spec.addresses).
SHM_PREFIX = f"afdtest{os.getpid()}_"
JOIN_TIMEOUT_S = 5.0


def leftover_segments() -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX))


def mappings(segment: str) -> int:
    """How many times this process maps the shared-memory segment ``segment``."""
    with open("/proc/self/maps") as maps:
        return sum(line.split()[5:6] == [f"{SHM_DIR}/{segment}"] for line in maps)


#: The MoE layers of a test spec: a step announced by ``announce`` visits them all.
LAYERS = tuple(range(16))


#: The out-of-tree backend of tests/e2e/counting_backend.py (shm, counting its rounds), and where
#: it counts (removed at the session's end: conftest).
COUNTING = "tests.e2e.counting_backend:CountingShm"
COUNTS_DIR = os.path.join(tempfile.gettempdir(), f"{SHM_PREFIX}counts")


def make_spec(backend: str, num_attention: int, num_ffn: int, **overrides) -> TransportSpec:
    """A small spec; the FFN side's ``addresses`` request a test prefix.
    ``backend`` may be ``slots-device`` (slots with the device's wait semantics) or
    ``counting`` (``COUNTING``, its counts in a directory of this test run)."""
    if backend == "slots-device":
        backend, overrides = "slots", {"config": {"waits": "device"}, **overrides}
    if backend == "counting":
        os.makedirs(COUNTS_DIR, exist_ok=True)
        counts = COUNTS_DIR
        backend, overrides = COUNTING, {"config": {"counts_dir": counts}, **overrides}
    fields = dict(
        backend=backend,
        num_attention_ranks=num_attention,
        num_ffn_ranks=num_ffn,
        num_experts=8,
        hidden_size=32,
        top_k=2,
        max_tokens=64,
        timeout_s=10.0,
        addresses=(SHM_PREFIX,) * num_ffn,
        moe_layers=LAYERS,
    )
    fields.update(overrides)
    return TransportSpec(**fields)


class FFNCluster:
    """FFN ranks in child processes plus the attention endpoints the test creates."""

    def __init__(self, ctx, spec: TransportSpec, forwards: Sequence[FFNForward]) -> None:
        self.ctx = ctx
        self.requested = spec
        self.stop_event = StopFlag(ctx)  # ranks are killed here: no lock to wedge
        self.procs = []
        self.current = {}  # FFN rank -> its latest process
        addresses = [self._start(rank, forward) for rank, forward in enumerate(forwards)]
        self.spec = dataclasses.replace(spec, addresses=tuple(addresses))
        self.attention = []

    def _start(self, rank: int, forward: FFNForward) -> str:
        """Start FFN rank ``rank`` in a new process; return its address."""
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=ffn_worker_main,
            args=(self.requested, rank, forward, child, self.stop_event),
            daemon=True,
        )
        proc.start()
        child.close()
        if not parent.poll(30):
            raise TimeoutError(f"FFN rank {rank} did not report its address")
        self.procs.append(proc)
        self.current[rank] = proc
        return parent.recv()

    def replace(self, rank: int, forward: FFNForward) -> tuple[str, int]:
        """Start a replacement of FFN rank ``rank`` (what failover's supervisor does); return
        its address and pid."""
        address = self._start(rank, forward)
        return address, self.current[rank].pid

    def connect(self, rank: int, **overrides):
        """A new attention endpoint for ``rank``, its first step announced."""
        endpoint = create_attention_transport(dataclasses.replace(self.spec, **overrides), rank)
        self.attention.append(endpoint)
        announce(endpoint)
        return endpoint

    def kill(self, rank: int) -> None:
        """SIGKILL FFN rank ``rank``'s latest process."""
        self.current[rank].kill()

    def close(self) -> None:
        for endpoint in self.attention:
            endpoint.close()
        self.stop_event.set()
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        reap_stale_control_blocks(SHM_PREFIX)  # segments of killed FFN ranks


def announce(endpoint: AttentionTransport, layers: tuple[int, ...] | None = None) -> None:
    """Begin the endpoint's next step: ``layers`` (default: every MoE layer of its spec), each
    microbatch (one per slot) up to ``max_tokens`` tokens. The slot plane serves only what a
    step announced, and each layer of a microbatch once per step."""
    spec = endpoint.spec
    tokens = (spec.max_tokens,) * spec.num_slots
    endpoint.begin_step(StepSchedule(endpoint.step + 1, tokens, layers or spec.moe_layers))


def routing(
    num_tokens: int, spec: TransportSpec, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``x [T, H]`` (spec dtype), distinct ``topk_ids [T, K]`` int64, normalised
    ``topk_weights [T, K]`` float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(spec.dtype)
    scores = torch.rand(num_tokens, spec.num_experts, generator=gen)
    weights, ids = scores.topk(spec.top_k, dim=1)
    return x, ids, weights / weights.sum(dim=1, keepdim=True)


def attach_and_exit(spec: TransportSpec) -> None:
    """Child-process body: attach an attention endpoint and exit without closing it."""
    create_attention_transport(spec, 0)


#: The experts the loopback tests serve: expert e scales its input by (e + 1) / 4.
EXPERTS = ScaleExperts(torch.arange(1.0, 9.0) / 4)


T = TypeVar("T")


def while_serving(ffn: Sequence[ServesRequests], connect: Callable[[], T]) -> T:
    """``connect()`` while a thread keeps the FFN endpoints' ``recv`` going, as a serving FFN
    rank does: over NIXL the FFN side's agent makes progress (the attention rank's READ of its
    control block, the attention rank's hello) only while it is driven. No request may arrive
    meanwhile."""
    stop = threading.Event()
    stray: list = []

    def pump() -> None:
        while not stop.is_set():
            for endpoint in ffn:
                stray.extend(endpoint.recv(0.005))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        return connect()
    finally:
        stop.set()
        thread.join(5)
        assert not stray, f"requests arrived while connecting: {stray}"


class Loopback:
    """FFN endpoints created here, attention endpoints attached to them (one process)."""

    def __init__(self, spec: TransportSpec) -> None:
        self.ffn = [create_ffn_transport(spec, f) for f in range(spec.num_ffn_ranks)]
        addresses = tuple(endpoint.address for endpoint in self.ffn)
        self.spec = dataclasses.replace(spec, addresses=addresses)
        self.attention = [self.connect(a) for a in range(spec.num_attention_ranks)]

    def connect(self, rank: int, spec: TransportSpec | None = None):
        """A new attention endpoint (closed by the test) for ``rank``, of ``spec`` (default:
        the loopback's), its first step announced."""
        spec = spec or self.spec
        endpoint = while_serving(self.ffn, lambda: create_attention_transport(spec, rank))
        announce(endpoint)
        return endpoint

    def step(self) -> None:
        """Every attention endpoint begins its next step (``announce``)."""
        for endpoint in self.attention:
            announce(endpoint)

    def progress(self) -> None:
        """Let the attention endpoints' memories move what they sent (NIXL: a WRITE needs its
        sender's progress, which a waiting endpoint makes in its waits; here the FFN side is
        served by hand in between)."""
        for endpoint in self.attention:
            pump = getattr(getattr(endpoint, "memory", None), "pump", None)
            if pump is not None:
                pump()

    def serve(self, expect: int | None = None) -> list:
        """Answer what every FFN rank has pending; return the requests seen."""
        seen = []
        self.progress()
        for rank, endpoint in enumerate(self.ffn):
            forward = LocalMoE.for_rank(EXPERTS, self.spec, rank)
            requests = recv_all(endpoint, expect) if expect else endpoint.recv(0.05)
            for request in requests:
                endpoint.reply(request, forward(request.x, request.topk_ids, request.topk_weights))
            seen += requests
        return seen

    def close(self) -> None:
        for endpoint in self.attention + self.ffn:
            endpoint.close()


def recv_all(endpoint: ServesRequests, count: int, timeout_s: float = 5.0) -> list:
    """``recv`` until ``count`` requests arrived (they may come over several calls)."""
    requests = []
    while len(requests) < count:
        got = endpoint.recv(timeout_s)
        assert got, f"only {len(requests)} of {count} requests arrived"
        requests += got
    return requests


def expected(spec: TransportSpec, x, ids, weights) -> torch.Tensor:
    """What a combine of this batch must return with ``EXPERTS`` (the reference's order)."""
    return reference_moe_combine(x, ids, weights, EXPERTS, spec.num_experts, spec.num_ffn_ranks)


#: The GPU machine's Triton, which ``make venv`` installs off the venv's import path (vLLM's CPU
#: build must not see it): the plane kernels' tests run it in a child process.
TRITON = Path(sys.prefix) / "triton"


def run_with_triton(script: str, tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script`` in a child with ``TRITON`` on its path and ``env`` over this process's
    environment (a value ``""`` removes the variable); returns the JSON of its last line."""
    assert (TRITON / "triton").is_dir(), f"no Triton in {TRITON}: run `make venv`"
    path = tmp_path / "triton_child.py"
    path.write_text(script)
    child = {k: v for k, v in {**os.environ, **env}.items() if v != ""}
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRITON), child.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(path)], env=child, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
