"""Upstream compatibility: every ledger entry's touch point still has the shape its patch
relies on, on the installed vLLM (the habit of vllm-spyre's upstream-compatibility tests).

One row of ``vllm_afd.patches.base.TARGETS`` per touch point drives both the patches and
these tests, so they cannot drift. A failure here means a vLLM upgrade moved or reshaped a
patched attribute: fix the patch and its ledger entry, or remove it if upstream now does the
job (the "still needed" tests below say when).
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import vllm_afd.patches
from vllm_afd.patches.base import TARGETS, WRAPPED, Target, raw_attribute

LEDGER_IDS = re.findall(r"^([PMSFGEWR]\d+) ", vllm_afd.patches.__doc__, re.M)


def _attribute(target: Target):
    module = pytest.importorskip(target.module)
    owner = getattr(module, target.owner) if target.owner else module
    assert hasattr(owner, target.name), f"{target.where} is gone"
    return owner, getattr(owner, target.name)


def _params(fn) -> list[str]:
    return [n for n in inspect.signature(fn).parameters if n not in ("self", "cls")]


def test_every_ledger_entry_has_a_target_and_every_target_an_entry():
    assert len(LEDGER_IDS) == len(set(LEDGER_IDS)), LEDGER_IDS
    assert set(LEDGER_IDS) == {t.patch for t in TARGETS}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.where.replace(" ", ":"))
def test_target_exists_with_the_expected_parameters(target: Target):
    _, attribute = _attribute(target)
    if not target.params:
        return
    names = _params(attribute)
    if target.ordered:
        assert tuple(names[: len(target.params)]) == target.params, names
    else:
        assert set(target.params) <= set(names), names


@pytest.mark.parametrize(
    "target", [t for t in TARGETS if t.kind in WRAPPED], ids=lambda t: t.where.replace(" ", ":")
)
def test_wrapped_target_is_still_the_same_kind_of_method(target: Target):
    owner, _ = _attribute(target)
    raw = raw_attribute(owner, target.name)
    kind = {staticmethod: "static", classmethod: "class"}.get(type(raw), "function")
    assert kind == target.kind


def test_m5_the_private_global_is_what_vllm_reads():
    """M5 writes ``_forward_context``: it must still be the global ``get_forward_context``
    returns (vLLM's own ``override_forward_context`` sets it)."""
    forward_context = importlib.import_module("vllm.forward_context")
    marker = object()
    with forward_context.override_forward_context(marker):
        assert forward_context._forward_context is marker
        assert forward_context.get_forward_context() is marker


def test_p5_routed_experts_is_still_a_pluggable_layer():
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    assert issubclass(RoutedExperts, PluggableLayer) and isinstance(op_registry_oot, dict)


def test_s1_still_needed():
    """Remove S1 when vLLM's CPU communicator implements the variable-size collectives."""
    module = pytest.importorskip("vllm.distributed.device_communicators.cpu_communicator")
    source = inspect.getsource(module)
    assert "def all_gatherv" not in source and "def reduce_scatterv" not in source


def test_m1_still_needed():
    """Remove M1-M5 when the CPU platform stops turning DBO off."""
    from vllm.platforms import cpu

    assert "enable_dbo = False" in inspect.getsource(cpu)


def test_f1_f3_place_experts_inside_the_block_and_restore_everything():
    """The FFN-rank swaps hold only inside ``expert_parallel_placement``."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.fused_moe import layer
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    from vllm_afd.patches.ffn_rank import expert_parallel_placement

    config = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=False))
    before = (layer.make_parallel_config, ExpertMapManager.__init__, parallel_state._EP)
    with expert_parallel_placement(config, 1, 4, "cpu"):
        assert parallel_state.get_ep_group().rank_in_group == 1
        assert parallel_state.get_ep_group().device_group.size() == 4
        assert config.parallel_config.enable_expert_parallel
        assert layer.make_parallel_config is not before[0]
    assert (layer.make_parallel_config, ExpertMapManager.__init__, parallel_state._EP) == before
    assert config.parallel_config.enable_expert_parallel is False
    with expert_parallel_placement(config, 0, 1, "cpu"):  # one FFN rank: nothing swapped
        assert (layer.make_parallel_config, ExpertMapManager.__init__) == before[:2]
