"""One token's path through the package, measured: the files a routed token's code runs in.

A profiler hook (``sys.setprofile``, on this thread and the FFN executors' threads) records the
``vllm_afd`` files that run during one decode step (``remote_experts_impl`` for every MoE layer,
under one forward) of a real slot-plane deployment in this process (tiny Qwen3-MoE, 1 attention
rank, 2 FFN ranks as executor threads), after ``open_session()`` (done when a worker loads the
model, patch W4), in both of the plane's serving modes: ``shm`` (host memory, requests served as
they come) and ``slots`` with the device's waits (whole announced steps, what every GPU runs).
docs/architecture.md lists these files, checked here; a change that sends a token through
another module must update both.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import vllm_afd

PACKAGE = Path(vllm_afd.__file__).parent
#: The files of step 2-8 of docs/architecture.md section 1, with 2 FFN ranks.
PATH = {
    "attention/layer.py",  # the routing boundary
    "attention/session.py",  # the worker's session: the step begun before the first dispatch
    "attention/steps.py",  # ... and announced
    "attention/exchange.py",  # the round trip
    "microbatch.py",
    "transport/endpoint.py",  # the attention endpoint, every backend's
    "transport/slots.py",  # the wire on the slot plane; its FFN side serving requests
    "transport/slot_plane.py",  # the protocol: sends, waits, answers
    "transport/slot_plane_host.py",  # the host's wait for a flag
    "transport/control_block.py",  # the step's schedule, written and read once per step
    "transport/wait.py",  # a wait's stages
    "transport/base.py",  # begin_step: the step's schedule, announced once per step
    "transport/control.py",  # ... and checked by the FFN rank
    "ffn/executor.py",
    "patches/cpu_comm.py",  # S2: vLLM's CPU kernel honours the expert map (F > 1 only)
    "metrics/blocks.py",
}
#: With the device's waits (whole steps) only: their failures, read once per step.
DEVICE_WAITS = {"transport/slot_plane_failures.py"}
#: Runs only when a wait outlasts the liveness interval (a busy machine).
SLOW_WAIT = {"host.py"}


class _OneRank:
    world_size, rank_in_group = 1, 0


class _Forward:
    """Stands for a forward's ``ForwardContext`` (identity only)."""


def _documented() -> set[str]:
    """The files docs/architecture.md's "What a token crosses" paragraph names."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    start = doc.index("**What a token crosses.**")
    paragraph = doc[start : doc.index("\n\n", start)]
    return set(re.findall(r"`([a-z_/]+\.py)`", paragraph)) - {"tests/unit/test_token_path.py"}


def test_the_documented_files_are_the_measured_ones():
    assert _documented() == PATH | DEVICE_WAITS


@pytest.mark.parametrize(
    ("backend", "config"),
    [("shm", {}), ("slots", {"waits": "device"})],
    ids=["slot plane, requests as they come", "slot plane, whole steps (the GPU's mode)"],
)
def test_a_token_crosses_the_documented_files(tiny_qwen3, monkeypatch, backend, config):
    from transformers import AutoConfig
    from vllm import forward_context
    from vllm.distributed import parallel_state

    from vllm_afd import envs
    from vllm_afd.attention import session as sessions
    from vllm_afd.attention.layer import remote_experts_impl
    from vllm_afd.config import moe_model_info
    from vllm_afd.ffn.executor import FFNExecutor
    from vllm_afd.transport import TransportSpec

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    spec = TransportSpec(
        backend=backend,
        config=config,
        num_attention_ranks=1,
        num_ffn_ranks=2,
        num_experts=info.num_experts,
        hidden_size=info.hidden_size,
        top_k=info.top_k,
        max_tokens=16,
        moe_layers=info.moe_layers,
    )
    seen: set[str] = set()
    recording = threading.Event()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if recording.is_set() and path.startswith(str(PACKAGE)):
            seen.add(Path(path).relative_to(PACKAGE).as_posix())

    executors = [FFNExecutor(spec, rank, tiny_qwen3, "cpu") for rank in range(2)]
    threading.setprofile(profile)  # the serve threads started now inherit the hook
    try:
        for executor in executors:
            executor.start()
        threading.setprofile(None)
        addresses = tuple(e.info()["address"] for e in executors)
        runtime = dataclasses.replace(spec, addresses=addresses)
        monkeypatch.setenv(envs.RUNTIME, runtime.to_json())
        monkeypatch.setattr(parallel_state, "get_tp_group", _OneRank)
        monkeypatch.setattr(parallel_state, "get_dp_group", _OneRank)
        monkeypatch.setattr(sessions, "_SESSION", None)
        sessions.open_session()
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, spec.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(spec.num_experts, generator=gen)[:2] for _ in range(4)])
        weights = torch.softmax(torch.randn(4, 2, generator=gen), dim=-1)
        monkeypatch.setattr(forward_context, "is_forward_context_available", lambda: True)
        for _ in range(3):  # the first steps warm caches; the last one is measured
            seen.clear()
            step = _Forward()  # a forward: one step through every MoE layer
            monkeypatch.setattr(forward_context, "get_forward_context", lambda s=step: s)
            time.sleep(0.05)  # the FFN threads are polling, between two layers
            sys.setprofile(profile)
            recording.set()
            for layer in info.moe_layers:
                out = remote_experts_impl(x, weights, ids.to(torch.int32), layer)
            time.sleep(0.05)  # the FFN threads finish the loop iteration that served it
            recording.clear()
            sys.setprofile(None)
        assert out.shape == x.shape and out.abs().sum() > 0
        path = PATH | (DEVICE_WAITS if config else set())
        assert path <= seen <= path | SLOW_WAIT, sorted(seen)
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        sessions.close_session()
        for executor in executors:
            executor.stop()
