"""`vllm-afd bench` end to end: a small bench (colocated, DP2 x EP2, AFD 1:1) and the JSON it
writes; a decode pool on vLLM's DecodeBenchConnector with n-gram speculative decoding in every
configuration (one bench for both: a decode pool that speculates, as production ones do).

The two benches run as `vllm-afd bench` processes side by side (a module fixture): each runs
its configurations one after another, as a benchmark must, and the checks here read tokens and
counters, never timings, so two benches side by side cost them nothing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

#: Outside the full tier's budget since 2026-12-07 (the tier reached 29 min 32 s on a slow
#: hour of the development VM): ``make test-optional`` runs it, ``make demo`` runs an A/B bench
#: of real engines.
pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.optional]


def _small(model: str) -> list[str]:
    argv = ["--model", model, "--ratios", "1:1", "--microbatches", "1", "--ep-sizes", "2"]
    return [*argv, "--batch", "4", "--prompt-len", "32", "--output-len", "16", "--rounds", "2"]


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SPEC["prompt_lookup_max"] = 3
KV = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}


def _decode_pool(model: str) -> list[str]:
    """Each prompt's KV filled by the connector, n-gram drafts verified in every step."""
    argv = ["--model", model, "--ratios", "1:1", "--microbatches", "2", "--ep-sizes", "none"]
    argv += ["--batch", "4", "--prompt-len", "256", "--output-len", "16", "--rounds", "1"]
    argv += ["--speculative-config", json.dumps(SPEC)]
    return [*argv, "--kv-transfer-config", json.dumps(KV)]


@pytest.fixture(scope="module")
def benches(tiny_qwen3, tmp_path_factory) -> dict[str, tuple[int, dict, str]]:
    """name -> (exit code, the JSON written, the output's tail) of each bench (run in this
    process's environment, as ``ab.main`` here would)."""
    argvs = {"small": _small, "decode_pool": _decode_pool}
    script = str(Path(sys.executable).with_name("vllm-afd"))

    def run(name: str) -> tuple[int, dict, str]:
        tmp = tmp_path_factory.mktemp(name)
        argv = [*argvs[name](tiny_qwen3), "--json", str(tmp / "out.json")]
        argv += ["--log-dir", str(tmp / "logs")]
        proc = subprocess.run(
            [script, "bench", *argv],
            capture_output=True,
            text=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
        out = tmp / "out.json"
        data = json.loads(out.read_text()) if out.exists() else {}
        return proc.returncode, data, (proc.stdout + proc.stderr)[-3000:]

    with ThreadPoolExecutor(len(argvs)) as pool:
        return dict(zip(argvs, pool.map(run, argvs), strict=True))


def _rows(bench: tuple[int, dict, str]) -> tuple[dict, dict]:
    code, data, tail = bench
    rows = {r["name"]: r for r in data.get("rows", [])}
    assert code == 0 and rows, f"exit {code}: {rows}\n{tail}"
    return data, rows


def test_bench_end_to_end_small(benches):
    _, rows = _rows(benches["small"])
    assert set(rows) == {"colocated", "wide EP2", "afd 1:1 k1"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["step_ms"] > 0 and row["step_p90_ms"] >= row["step_ms"]
        assert row["intervals"] >= 2 * (16 - 4) and math.isfinite(row["s_all"])
    afd = rows["afd 1:1 k1"]
    assert afd["devices"] == 2 and afd["disaggregation_cost"] == pytest.approx(0.5)
    assert afd["microbatches_effective"] == pytest.approx(1.0)
    assert afd["ffn_layer_service_ms"] > 0 and rows["wide EP2"]["compared_requests"] == 4


def test_bench_applies_speculation_to_every_configuration(benches):
    """n-gram d = 3 colocated and at AFD 1:1 with the default two microbatches: the same
    greedy tokens, vLLM's acceptance counters per configuration. The random model's text
    seldom repeats, so drafts are few (prompt_lookup_min 1 finds some) and none is accepted."""
    data, rows = _rows(benches["decode_pool"])
    assert data["settings"]["speculative_config"] == SPEC
    assert set(rows) == {"colocated", "afd 1:1 k2"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["spec_decode"]["drafts"] > 0, row  # the counters are read: drafts were made
        assert row["spec_decode"]["draft_tokens"] >= row["spec_decode"]["drafts"]
        assert 1.0 <= row["tokens_per_step"] <= 4.0 and math.isfinite(row["s_all"])
        assert row["acceptance_rate"] is not None and "token_gain" in row
    colocated, afd = rows["colocated"], rows["afd 1:1 k2"]
    assert afd["spec_decode"] == colocated["spec_decode"]  # same tokens, same drafts
    assert afd["microbatches_effective"] == pytest.approx(2.0)  # verify steps are split


def test_bench_runs_a_decode_pool_with_decode_bench_connector(benches):
    """vLLM's DecodeBenchConnector colocated and at AFD 1:1 with the default two microbatches:
    each prompt's KV is filled, not computed (one prompt token per request), in one step, and
    every layout decodes the same tokens from the same constants."""
    data, rows = _rows(benches["decode_pool"])
    assert data["settings"]["kv_transfer_config"] == KV
    assert set(rows) == {"colocated", "afd 1:1 k2"}
    for row in rows.values():
        assert row["status"] == "ok" and row["identical"] is True, row
        assert row["kv_connector"] == "DecodeBenchConnector", row
        assert row["prompt_tokens"] == 256 and row["prompt_tokens_computed"] == 1, row
        assert row["prefill_steps"] == 1 and row["intervals"] >= 16 - 4, row
    assert rows["afd 1:1 k2"]["microbatches_effective"] == pytest.approx(2.0)
