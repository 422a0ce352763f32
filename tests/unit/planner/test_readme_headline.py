"""README's headline command is one that runs: it passes the planner's fit check and the
product's own start-up checks of the ratio, the devices and the model's experts; and it is a
deployment the planner predicts to win, with the verdict the README prints beside it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vllm_afd.config import AFDConfig, parse_ratio
from vllm_afd.deployment import check_devices
from vllm_afd.planner import PlanRequest, plan
from vllm_afd.planner.hardware import get_hardware
from vllm_afd.planner.memory import check_ffn_fits
from vllm_afd.planner.models import get_model
from vllm_afd.transport import auto_backend

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
    # What the front-end makes of it on GPUs (deployment.prepare_engine_args): A data-parallel
    # attention ranks and the transport for CUDA at both ends.
    ratio = parse_ratio(flags["--afd-ratio"])
    afd = AFDConfig(ratio=ratio, transport=auto_backend("cuda", "cuda"), ffn_device="cuda")
    data_parallel = int(flags.get("--data-parallel-size", afd.ratio[0]))
    num_ffn = afd.num_ffn_ranks(data_parallel)
    assert data_parallel + num_ffn == 8  # "one node of 8 x H200"
    check_devices(afd, data_parallel, "cuda", gpus_on_node=8)
    check_ffn_fits(model, get_hardware("h200"), num_ffn)
    assert model.num_experts % num_ffn == 0


def test_the_old_headline_would_have_failed_the_fit_check():
    """Qwen3-235B-A22B at 7:1 on 8 GPUs: 454 GB of experts on one FFN GPU."""
    with pytest.raises(ValueError, match="do not fit 1 FFN GPU"):
        check_ffn_fits(get_model("Qwen/Qwen3-235B-A22B"), get_hardware("h200"), 1)


def test_the_readme_headline_is_a_deployment_the_planner_predicts_to_win():
    text = README.read_text()
    claim = re.search(
        r"vllm-afd plan\s+--model\s+(\S+)\s+--hardware\s+(\S+)\s+--context\s+(\d+)K`\)\s+"
        r"predicts\s+(\d+):(\d+)\s+to\s+win:\s+S_all\s+([\d.]+),",
        text,
    )
    assert claim is not None, "README.md lost its headline's planner verdict"
    model, hardware, context_k, attn, ffn, s_all = claim.groups()
    assert f"--afd-ratio {attn}:{ffn}" in text.split("## ")[0]
    result = plan(
        PlanRequest(
            model=get_model(model), hardware=get_hardware(hardware), context=int(context_k) * 1024
        )
    )
    rec = result.recommended
    assert (rec.attn_gpus, rec.ffn_gpus) == (int(attn), int(ffn))
    assert rec.s_all > 1 and f"{rec.s_all:.2f}" == s_all
