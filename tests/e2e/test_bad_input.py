"""Bad input to `vllm-afd serve`: one clear error naming the flag, exit 2, before any worker.

The core cases (``make test``) each run the console script in a fresh process; the rest run
its ``main`` in children forked from one process that imported vLLM once (``serve_cases.py``).
"Before any worker" is checked by the absence of any engine or FFN start in the output and by
the time each case took.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_afd.bench.offline_run import child_env

pytestmark = pytest.mark.slow

STARTED_MARKERS = ("EngineCore", "FFN rank 0 up", "Started a local Ray instance")


def _argv(model: str, *flags: str) -> list[str]:
    """``vllm-afd serve`` arguments (after ``serve``)."""
    return [model, "--host", "127.0.0.1", "--port", "1", "--dtype", "float32", *flags]


def _serve(model: str, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    argv = [str(Path(sys.executable).with_name("vllm-afd")), "serve", *_argv(model, *flags)]
    start = time.monotonic()
    proc = subprocess.run(
        argv,
        env=child_env(extra=env),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def dense_model(tiny_qwen3, tmp_path_factory) -> str:
    """A tiny dense Llama (no routed experts) sharing the tiny tokenizer."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("dense")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_qwen3) / name, out / name)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1024,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


#: (name, serve arguments, expected message, extra environment)
Case = tuple[str, tuple[str, ...], str, dict | None]


def _cases(qwen3: str, dense: str) -> list[Case]:
    """The cases, in order."""
    flag_cases = [
        ("zero side", (qwen3, "--afd-ratio", "0:1"), "--afd-ratio"),
        ("not a ratio", (qwen3, "--afd-ratio", "a:b"), "--afd-ratio"),
        (
            "ratio does not divide ranks",
            (qwen3, "--afd-ratio", "3:1", "--data-parallel-size", "2"),
            "does not divide the 2",
        ),
        (
            "data parallel size 1 given against the ratio",
            (qwen3, "--afd-ratio", "2:1", "--data-parallel-size", "1"),
            "2:1 does not divide the 1 attention rank",
        ),
        ("more FFN ranks than experts", (qwen3, "--afd-ratio", "1:16"), "only 8 routed experts"),
        ("experts not divisible", (qwen3, "--afd-ratio", "1:3"), "cannot be split evenly"),
        ("no routed experts", (dense, "--afd-ratio", "1:1"), "has no routed experts"),
        (
            "unknown transport",
            (qwen3, "--afd-ratio", "1:1", "--afd-transport", "pigeon"),
            "--afd-transport",
        ),
        (
            "unreachable Ray",
            (qwen3, "--afd-ratio", "1:1", "--afd-ray-address", "127.0.0.1:9"),
            "cannot reach Ray at 127.0.0.1:9",
        ),
        (
            "option without ratio",
            (qwen3, "--afd-transport", "nixl"),
            "--afd-ratio (or --afd-join) is required",
        ),
        (
            "timeout shorter than the poll window",
            (qwen3, "--afd-ratio", "1:1", "--afd-timeout", "0.01"),
            "--afd-timeout 0.01: shorter than the poll window",
        ),
        (
            "expert load balancer",
            (qwen3, "--afd-ratio", "1:1", "--enable-eplb"),
            "--enable-eplb: not with --afd-ratio",
        ),
        (
            "infinite timeout",
            (qwen3, "--afd-ratio", "1:1", "--afd-timeout", "inf"),
            "--afd-timeout (additional_config.afd.timeout): must be a finite number",
        ),
        (
            "empty afd section",
            (qwen3, "--additional-config", '{"afd": {}}'),
            "additional_config.afd is empty: --afd-ratio (additional_config.afd.ratio) is required",
        ),
        (
            "retired transport",
            (qwen3, "--afd-ratio", "1:1", "--afd-transport", "tcp"),
            "'tcp' is retired; across hosts use nixl",
        ),
    ]
    bad_cpus = {"VLLM_AFD_FFN_CPUS": "0|1"}  # two CPU lists for one FFN rank
    bad_poll = {"VLLM_AFD_POLL_MS": "-1"}
    absent_cpu = str(max(os.sched_getaffinity(0)) + 1)
    return [(*case, None) for case in flag_cases] + [
        ("FFN CPU lists", (qwen3, "--afd-ratio", "1:1"), "VLLM_AFD_FFN_CPUS", bad_cpus),
        ("poll window", (qwen3, "--afd-ratio", "1:1"), "VLLM_AFD_POLL_MS='-1'", bad_poll),
        (
            "poll window longer than the timeout",
            (qwen3, "--afd-ratio", "1:1", "--afd-timeout", "1"),
            "VLLM_AFD_POLL_MS='5000': the poll window may not be longer than --afd-timeout",
            {"VLLM_AFD_POLL_MS": "5000"},
        ),
        (
            "absent FFN CPU",
            (qwen3, "--afd-ratio", "1:1"),
            f"VLLM_AFD_FFN_CPUS='{absent_cpu}': CPU(s) [{absent_cpu}] are not available",
            {"VLLM_AFD_FFN_CPUS": absent_cpu},
        ),
        (
            "FFN threads",
            (qwen3, "--afd-ratio", "1:1"),
            "VLLM_AFD_FFN_THREADS='99999999999999999999'",
            {"VLLM_AFD_FFN_THREADS": "99999999999999999999"},
        ),
        (
            "admin token file",
            (qwen3, "--afd-ratio", "1:1"),
            "VLLM_AFD_ADMIN_TOKEN_FILE='/nonexistent/admin_token': [Errno 2]",
            {"VLLM_AFD_ADMIN_TOKEN_FILE": "/nonexistent/admin_token"},
        ),
    ]


#: The cases ``make test`` runs (the rest: ``make test-all``).
CORE = ("not a ratio", "more FFN ranks than experts", "unknown transport", "FFN CPU lists")


def _in_fresh_processes(cases: list[Case]) -> list[tuple[int, str, float]]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda case: _serve(*case[1], env=case[3]), cases))


def _forked(cases: list[Case], tmp_path: Path) -> list[tuple[int, str, float]]:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([{"argv": _argv(*c[1]), "env": c[3]} for c in cases]))
    runner = Path(__file__).with_name("serve_cases.py")
    proc = subprocess.run(
        [sys.executable, str(runner), str(spec)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def _check(cases: list[Case], results: list[tuple[int, str, float]]) -> None:
    for (name, _, expected, _env), (code, output, elapsed) in zip(cases, results, strict=True):
        assert code == 2, f"{name}: exit {code}\n{output[-2000:]}"
        assert expected in output, f"{name}: {expected!r} not in\n{output[-2000:]}"
        assert "Traceback" not in output, f"{name}: a traceback instead of a message"
        assert not any(m in output for m in STARTED_MARKERS), f"{name}: something started"
        assert elapsed < 120, f"{name}: took {elapsed:.0f}s"


def test_bad_inputs_fail_fast_with_the_flag_named(tiny_qwen3):
    cases = [c for c in _cases(tiny_qwen3, dense="") if c[0] in CORE]
    assert len(cases) == len(CORE)
    _check(cases, _in_fresh_processes(cases))


@pytest.mark.full
def test_more_bad_inputs_fail_fast_with_the_flag_named(tiny_qwen3, dense_model, tmp_path):
    cases = [c for c in _cases(tiny_qwen3, dense_model) if c[0] not in CORE]
    _check(cases, _forked(cases, tmp_path))
