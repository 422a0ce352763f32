"""Recipe: the tiny random Qwen3-MoE on the 2-core CPU development machine, AFD 2:1.

Two attention ranks (tensor parallel, one core each) share one FFN rank (a Ray actor), float32 so
that greedy outputs are comparable across layouts. ``serve_args()`` is the deployment,
``bench_config()`` the A/B run against colocated vLLM (one rank, and DP2 x EP2) on the same
workload:

    vllm-afd tiny-model /tmp/tiny-qwen3            # or let the bench build it
    vllm-afd serve $(python recipes/tiny_qwen3_cpu_2to1.py serve)
    vllm-afd bench --recipe recipes/tiny_qwen3_cpu_2to1.py [--profile cpu_profile.json]
"""

from __future__ import annotations

import sys

#: Arguments of ``vllm_afd.bench.tiny_models.default_tiny_model`` (the default tiny Qwen3-MoE).
TINY_MODEL = {"arch": "qwen3_moe"}


def model_dir() -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(**TINY_MODEL))


def serve_args(model: str | None = None) -> list[str]:
    """``vllm-afd serve`` arguments: 2 TP attention ranks : 1 FFN rank, loopback only."""
    return [
        model or model_dir(),
        "--afd-ratio",
        "2:1",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "32",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
    ]


def bench_config() -> dict:
    """A complete ``vllm-afd bench`` configuration (every key of ``bench.ab.DEFAULTS``)."""
    return {
        "tiny_model": TINY_MODEL,
        "ratios": ["1:1", "2:1"],
        "microbatches": [1],
        "ep_sizes": [2],
        "batch": 16,
        "afd_batch": None,
        "prompt_len": 128,
        "output_len": 64,
        "rounds": 5,
        "skip": 2,
        "threads": 1,
        "dtype": "float32",
    }


if __name__ == "__main__":
    print(" ".join(serve_args()) if sys.argv[1:] == ["serve"] else bench_config())
