"""Whole FFN steps as CUDA graphs (``StepGraphs``), for an FFN endpoint that serves announced
steps in stream order (``transport.base.ServesSteps``): the step's plane operations and expert
kernels are captured once per step shape and replayed with no Python on the token path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_afd.transport.control import StepShape


class StepGraphs:
    """Whole FFN steps as CUDA graphs, one per step shape (``control.Step.shape``: the answer
    buffers mapped and each attention rank's schedule but its step number, which fix the
    step's uses, rows and layer positions). A shape seen once runs eagerly
    (it warms the kernels up); seen again, it is captured (a capture runs nothing), then
    replayed, and replayed from then on. The step number is a device word the graph reads, set
    before each replay (``FFNPlane.begin``), so a replay serves the step announced, with no
    Python on the token path. At most ``limit`` graphs (each holds its own memory pool); shapes
    past it run eagerly. NOT YET RUN ON A GPU (the device check captures and replays the same
    stream of plane operations, and this class around the slots endpoints, with a PyTorch
    reference MoE: ``testing/slot_plane_check.py``)."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._graphs: dict[StepShape, torch.cuda.CUDAGraph] = {}
        self._seen: set[StepShape] = set()

    def run(self, shape: StepShape, step: Callable[[], None]) -> None:
        graph = self._graphs.get(shape)
        if graph is None:
            if shape not in self._seen or len(self._graphs) >= self.limit:
                self._seen.add(shape)
                step()
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self._graphs[shape] = graph
        graph.replay()
