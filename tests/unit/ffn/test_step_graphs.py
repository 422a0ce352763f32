"""``StepGraphs`` (``ffn/step_graphs.py``): when an FFN step is captured, replayed or run
eagerly, and that every graph allocates from one pool. PyTorch's CUDA-graph calls are stood in
for on CPU (the device check captures and replays for real on a GPU)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from vllm_afd.ffn.step_graphs import StepGraphs


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def captures(monkeypatch):
    """Every capture as ``(graph, pool)``; a capture runs the step once (recording it)."""
    made: list[tuple[_Graph, object]] = []
    pools = itertools.count()

    @contextlib.contextmanager
    def graph(g, pool=None):
        made.append((g, pool))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: f"pool {next(pools)}")
    return made


def test_a_shape_captured_ahead_replays_from_its_first_step(captures):
    calls = []
    graphs = StepGraphs(limit=1)
    graphs.capture("decode 8", lambda: calls.append("recorded"))
    assert calls == ["recorded"] and len(graphs) == 1
    for _ in range(3):
        graphs.run("decode 8", lambda: calls.append("eager"))
    assert calls == ["recorded"] and captures[0][0].replays == 3
    graphs.capture("decode 8", lambda: calls.append("again"))  # captured once
    assert len(captures) == 1


def test_other_shapes_run_eagerly_then_are_captured_on_the_token_path_up_to_the_limit(captures):
    calls = []
    graphs = StepGraphs(limit=1)
    graphs.capture("decode 8", lambda: None)
    graphs.run("prefill 5", lambda: calls.append("first"))  # first sight: eagerly
    graphs.run("prefill 5", lambda: calls.append("captured"))  # second: captured, replayed
    graphs.run("prefill 5", lambda: calls.append("never"))
    assert calls == ["first", "captured"] and captures[1][0].replays == 2
    graphs.run("prefill 6", lambda: calls.append("a"))
    graphs.run("prefill 6", lambda: calls.append("b"))  # the limit: eagerly from now on
    assert calls[2:] == ["a", "b"] and len(captures) == 2
    graphs.capture("decode 16", lambda: None)  # captures ahead are not limited
    assert len(graphs) == 3
    assert {pool for _, pool in captures} == {"pool 0"}  # one pool for every graph
