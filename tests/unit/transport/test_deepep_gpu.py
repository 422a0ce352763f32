"""The deepep transport on a GPU with DeepEP (marker ``gpu``; skipped where there is none).

NOT YET RUN: no GPU has been lent to the sessions that wrote it. It runs the same round trip
as ``scripts/gpu-smoke.sh`` (one attention and one FFN process; steps of one and two
microbatches, then CUDA-graph capture and replays) against the dense reference at bfloat16
tolerance. On CPU machines the same steps run against the contract model
(test_deepep_contract.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vllm_afd.testing import deepep_round_trip as rt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("deep_ep") is None,
        reason="needs an NVIDIA GPU with DeepEP",
    ),
]


def test_deepep_round_trip_and_graph_replays_match_the_reference(capsys):
    assert rt.main([]) == 0, capsys.readouterr().out
