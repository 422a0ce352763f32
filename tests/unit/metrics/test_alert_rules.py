"""deploy/prometheus/vllm-afd-rules.yaml loads: each rule's PromQL parses (promql-parser, the
Rust parser Prometheus' grammar is ported to), and names only series the collector exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vllm_afd.metrics.collector import AFDCollector

RULES = Path(__file__).parents[3] / "deploy" / "prometheus" / "vllm-afd-rules.yaml"
#: The sample names a family of each type exposes.
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _exported() -> set[str]:
    names = set()
    for family in AFDCollector._families().values():
        for suffix in SUFFIXES.get(family.type, ("_sum", "_count")):
            names.add(family.name + suffix)
    return names


def _rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_rule_parses_and_names_exported_series():
    import promql_parser  # a test dependency (pyproject.toml)

    exported = _exported()
    rules = _rules()
    assert {r["alert"] for r in rules} >= {"AFDFFNRankGivenUp", "AFDTransportErrors"}
    for rule in rules:
        promql_parser.parse(rule["expr"])
        used = set(re.findall(r"\bvllm_afd_\w+", rule["expr"]))
        assert used and used <= exported, (rule["alert"], used - exported)
        assert "model_name" in rule["expr"], rule["alert"]  # vLLM's label, kept per model
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert rule["annotations"]["runbook"].startswith("docs/operations.md#")


def test_a_broken_rule_is_refused_by_the_parser():
    import promql_parser

    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        promql_parser.parse("sum by (model_name (vllm_afd_ffn_rank_alive)")
