"""README's headline command is one that runs: it passes the planner's fit check and the
product's own start-up checks of the ratio, the transport's limits and the model's experts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from vllm_afd.config import AFDConfig, parse_ratio
from vllm_afd.planner.hardware import get_hardware
from vllm_afd.planner.memory import check_ffn_fits
from vllm_afd.planner.models import get_model
from vllm_afd.transport import auto_backend, backend

README = Path(__file__).parents[3] / "README.md"


def _headline() -> list[str]:
    """The first command of README.md (an indented ``vllm serve`` block)."""
    match = re.search(r"\n    (vllm serve .*?)\n\n", README.read_text(), re.S)
    assert match, "README has no indented `vllm serve` command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_the_headline_fits_its_node_and_passes_the_start_up_checks():
    argv = _headline()
    model = get_model(argv[2])
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    afd = AFDConfig(ratio=parse_ratio(flags["--afd-ratio"]))
    # What the front-end makes of it on GPUs (deployment.prepare_engine_args): A data-parallel
    # attention ranks, the transport for CUDA at both ends and its token cap.
    data_parallel = int(flags.get("--data-parallel-size", afd.ratio[0]))
    transport = backend(auto_backend("cuda", "cuda"))
    max_tokens = int(flags.get("--max-num-batched-tokens", transport.max_tokens_per_round))
    num_ffn = afd.num_ffn_ranks(data_parallel)
    assert data_parallel + num_ffn == 8  # "one node of 8 x H200"
    check_ffn_fits(model, get_hardware("h200"), num_ffn)
    assert model.num_experts % num_ffn == 0
    problem = transport.limits_problem(
        hidden_size=model.hidden_size,
        dtype=torch.bfloat16,
        max_tokens=max_tokens,
        microbatches=afd.microbatches,
        num_attention_ranks=data_parallel,
        num_ffn_ranks=num_ffn,
        num_experts=model.num_experts,
    )
    assert problem is None, problem


def test_the_old_headline_would_have_failed_the_fit_check():
    """Qwen3-235B-A22B at 7:1 on 8 GPUs: 454 GB of experts on one FFN GPU."""
    with pytest.raises(ValueError, match="do not fit 1 FFN GPU"):
        check_ffn_fits(get_model("Qwen/Qwen3-235B-A22B"), get_hardware("h200"), 1)
