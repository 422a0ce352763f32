"""One feasibility rule (``config.ffn_ranks_problem``): nothing the planner recommends is
refused by serve's checks."""

from __future__ import annotations

import pytest

from vllm_afd.config import AFDConfig, MoEModelInfo, ffn_ranks_problem
from vllm_afd.deployment import check_settings
from vllm_afd.planner import PlanRequest, get_hardware, get_model, plan
from vllm_afd.planner.hardware import HARDWARE_PRESETS
from vllm_afd.planner.models import MODEL_PRESETS


def _info(model) -> MoEModelInfo:
    return MoEModelInfo(
        "Preset", model.num_layers, model.num_experts, model.top_k, model.hidden_size, 128
    )


def _plans():
    """Every preset model and hardware the planner plans for at 8K context."""
    for model in MODEL_PRESETS:
        for hardware in HARDWARE_PRESETS:
            try:
                yield (
                    model,
                    hardware,
                    plan(
                        PlanRequest(
                            model=get_model(model), hardware=get_hardware(hardware), context=8192
                        )
                    ),
                )
            except ValueError:  # the experts fit no pool there: nothing recommended
                continue


def test_what_the_planner_recommends_passes_serve_s_checks():
    planned = list(_plans())
    assert len(planned) >= 10
    for model, hardware, result in planned:
        rec = result.recommended
        spec = get_model(model)
        afd = AFDConfig(ratio=(rec.attn_gpus, rec.ffn_gpus))
        assert afd.num_ffn_ranks(rec.attn_gpus) == rec.ffn_gpus
        assert ffn_ranks_problem(spec.num_experts, rec.ffn_gpus) is None, (model, hardware)
        _info(spec).check_ffn_ranks(rec.ffn_gpus)  # serve's and POST /afd/scale's check
        for row in result.rows:  # every candidate, not only the recommended one
            assert ffn_ranks_problem(spec.num_experts, row.ffn_gpus) is None, (model, row)


def test_check_settings_and_plan_refuse_the_same_ffn_rank_count():
    model = get_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="--ffn-gpus: 128 routed experts cannot be split"):
        plan(PlanRequest(model=model, hardware=get_hardware("h200"), context=8192, ffn_gpus=3))
    with pytest.raises(Exception, match="128 routed experts cannot be split evenly over 3"):
        check_settings(AFDConfig(ratio=(1, 3)), _info(model), 1)
