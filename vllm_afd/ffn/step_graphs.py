"""Whole FFN steps as CUDA graphs (``StepGraphs``), for an FFN endpoint that serves announced
steps in stream order (``transport.base.ServesSteps``): the step's plane operations and expert
kernels are captured once per step shape and replayed with no Python on the token path.

When the captures happen. vLLM captures its decode graphs at start, each size after one eager
warm-up forward of that size (``CudaGraphManager.capture``); the attention ranks announce the
capture as a step of ``Mode.CAPTURE`` (nothing sent), which the FFN endpoint hands out as the
step the graph's replays will announce (``control.Step.capture``). The FFN rank captures that
step then (``capture``): at start, after the eager warm-up step it just served with the same
shape (so every Triton kernel is compiled before the capture), and the first replay finds its
graph. A shape no capture announced (an FFN rank that replaced a lost one, a step vLLM runs
eagerly) runs eagerly, and from its second sight is captured on the token path (``run``), at
most ``limit`` of them. Every graph allocates from one memory pool (as vLLM's graphs share
one): an FFN step's intermediates are dead once its answers are published into the attention
ranks' buffers, and steps replay one at a time on one stream, so the pool holds about one
step's memory however many shapes are captured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_afd.transport.control import StepShape


class StepGraphs:
    """Whole FFN steps as CUDA graphs, one per step shape (``control.Step.shape``: the answer
    buffers mapped and each attention rank's schedule but its step number, which fix the
    step's uses, rows and layer positions), captured ahead (``capture``) or from a shape's
    second sight (``run``, at most ``limit`` such). The step number is a device word the graph
    reads, set before each replay (``FFNPlane.begin``), so a replay serves the step announced,
    with no Python on the token path. NOT YET RUN ON A GPU (the device check captures and
    replays the same stream of plane operations, and this class around the slots endpoints,
    with a PyTorch reference MoE: ``testing/slot_plane_check.py``)."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._graphs: dict[StepShape, torch.cuda.CUDAGraph] = {}
        self._seen: set[StepShape] = set()
        self._on_token_path = 0  # graphs captured by ``run``
        self._pool: Any = None  # one memory pool for every graph (module docstring)

    def capture(self, shape: StepShape, step: Callable[[], None]) -> None:
        """Capture ``shape`` now, ahead of its first step (the attention ranks capture theirs):
        its steps replay from the first."""
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(step)

    def run(self, shape: StepShape, step: Callable[[], None]) -> None:
        """One step of ``shape``: replayed where captured, else run eagerly, or captured and
        replayed where seen before (``limit``)."""
        graph = self._graphs.get(shape)
        if graph is None:
            if shape not in self._seen or self._on_token_path >= self.limit:
                self._seen.add(shape)
                step()
                return
            graph = self._graphs[shape] = self._capture(step)
            self._on_token_path += 1
        graph.replay()

    def _capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):  # synchronises first
            step()
        return graph

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, shape: StepShape) -> bool:
        """Whether a step of ``shape`` replays (its graph is captured)."""
        return shape in self._graphs
