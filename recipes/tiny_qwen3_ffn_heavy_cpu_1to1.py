"""Recipe: a tiny Qwen3-MoE whose FFN stage is not negligible, AFD 1:1 with k = 1 and k = 2.

Two microbatches only pay when the FFN stage is long enough to hide the attention stage of the
other microbatch behind. On the default tiny model (hidden 128, 8 experts of 64, top-2) one
layer's routed experts take about 0.1 ms for 16 requests, while the attention stage of a layer
costs about 0.5 ms of vLLM's eager host work whatever the batch (docs/benchmarks.md): k = 2 then
adds a second pass of that fixed cost and hides almost nothing.

This model makes the expert work dominate without leaving the CPU's caches: hidden 256,
16 experts of 128, top-8 (6 MiB of float32 experts per layer, 2 layers, so the FFN rank stays
compute-bound and its service time halves with the tokens), and 64 requests per attention rank.
Measured here, one FFN request takes about 1.6 ms for 64 tokens and 0.9 ms for 32.

    vllm-afd bench --recipe recipes/tiny_qwen3_ffn_heavy_cpu_1to1.py --json heavy.json
    vllm-afd serve $(python recipes/tiny_qwen3_ffn_heavy_cpu_1to1.py serve)
"""

from __future__ import annotations

import sys

#: Arguments of ``vllm_afd.bench.tiny_models.default_tiny_model``.
TINY_MODEL = {
    "arch": "qwen3_moe",
    "hidden_size": 256,
    "num_experts": 16,
    "top_k": 8,
    "moe_intermediate_size": 128,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
#: Requests per attention rank: enough tokens per microbatch for the experts to stay busy.
BATCH = 64


def model_dir() -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(**TINY_MODEL))


def serve_args(model: str | None = None) -> list[str]:
    """``vllm-afd serve`` arguments: 1 attention rank : 1 FFN rank, two microbatches."""
    return [
        model or model_dir(),
        "--afd-ratio",
        "1:1",
        "--afd-microbatches",
        "2",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        str(BATCH),
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
        "ratios": ["1:1"],
        "microbatches": [1, 2],
        "ep_sizes": [2],
        "batch": BATCH,
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
