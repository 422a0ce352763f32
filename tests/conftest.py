"""Shared fixtures: the tiny models are built once per session; engines run in child processes.

The suite is hermetic: every model is one it builds (or a package ships), never a hub id, and
``HF_HUB_OFFLINE`` (inherited by every child) makes a look-up of the hub fail loudly."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="mixtral"))


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="qwen2_moe"))


@pytest.fixture(scope="session")
def smollm2_moe() -> str:
    """The trained SmolLM2-135M-Instruct upcycled to an 8-expert Mixtral (bench/real_model.py)."""
    from vllm_afd.bench.real_model import default_real_model

    return str(default_real_model())


@pytest.fixture(scope="session")
def serve_parser():
    """vLLM's serve parser with the plugin registered, as ``vllm-afd serve`` builds it."""
    import vllm_afd

    vllm_afd.register()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


@pytest.fixture(scope="session")
def run_once():
    """``run_once(job)``: ``run_generation(job)`` once per session for each distinct job (the
    colocated references several tests compare with); safe to call from threads."""
    import json
    import threading

    from vllm_afd.bench.offline_run import run_generation

    runs: dict[str, dict] = {}
    locks: dict[str, threading.Lock] = {}
    guard = threading.Lock()

    def get(job: dict) -> dict:
        key = json.dumps(job, sort_keys=True)
        with guard:
            lock = locks.setdefault(key, threading.Lock())
        with lock:
            if key not in runs:
                runs[key] = run_generation(job)
            return runs[key]

    return get


@pytest.fixture(scope="session")
def run_pair(run_once):
    """``run_pair(job_a, job_b)``: both through ``run_once``, side by side (two engines at once
    about halve the wall time of two tiny-model runs on two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(job_a: dict, job_b: dict) -> tuple[dict, dict]:
        with ThreadPoolExecutor(2) as workers:
            a, b = workers.submit(run_once, job_a), workers.submit(run_once, job_b)
            return a.result(), b.result()

    return run


#: The geometry of Qwen3-30B-A3B (config.json keys the planner reads): a model the planner
#: plans for without its weights.
QWEN3_30B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def qwen3_30b_dir(tmp_path) -> str:
    """A model directory with Qwen3-30B-A3B's config.json only."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_CONFIG))
    return str(tmp_path)
