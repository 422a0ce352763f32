"""``vllm-afd demo``: the README's main job on an embedded default.

Builds the tiny random-weight Qwen3-MoE model, serves it colocated (stock vLLM) and in AFD mode
at 1:1 and 2:1 (two tensor-parallel attention ranks, one FFN rank), each in a fresh process,
sends the same prompts, checks that the greedy outputs are token-identical, and prints a short
A/B table (parameter bytes per attention rank and per FFN rank, decode throughput).
Exit status 1 if any AFD output differs from colocated.
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Attention and feed-forward layers can be disaggregated because",
    "1 2 3 4 5",
    "Once upon a time, in a land far away, there lived a small language model that",
    "import torch",
]

CONFIGS = [
    ("colocated", None, 1),
    ("afd 1:1", {"ratio": "1:1"}, 1),
    ("afd 2:1 (TP2)", {"ratio": "2:1"}, 2),
]


def _row(name: str, result: dict, reference: dict | None) -> dict:
    ffn = result["ffn"]
    return {
        "config": name,
        "ffn_ranks": len(ffn),
        "attn_param_MiB": result["attention_param_bytes"] / 2**20,
        "ffn_param_MiB": (ffn[0]["param_bytes"] / 2**20) if ffn else 0.0,
        "tok_per_s": result["output_tokens"] / result["generate_s"],
        "identical": reference is None or result["token_ids"] == reference["token_ids"],
    }


def _print_table(rows: list[dict]) -> None:
    header = (
        f"{'config':<16}{'FFN ranks':>10}{'attn params MiB':>17}{'FFN params MiB':>16}"
        f"{'tok/s':>9}  identical to colocated"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['config']:<16}{r['ffn_ranks']:>10}{r['attn_param_MiB']:>17.2f}"
            f"{r['ffn_param_MiB']:>16.2f}{r['tok_per_s']:>9.0f}  {r['identical']}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-afd demo", description=__doc__)
    parser.add_argument("--model", default=None, help="MoE model dir (default: tiny Qwen3-MoE)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--skip-tp2", action="store_true", help="skip the 2:1 (TP2) config")
    args = parser.parse_args(argv)

    from vllm_afd.bench.offline_run import run_generation
    from vllm_afd.bench.tiny_models import default_tiny_model

    model = args.model or str(default_tiny_model())
    print(f"[vllm-afd demo] model: {model}", flush=True)
    rows, reference = [], None
    for name, afd, tp in CONFIGS:
        if tp > 1 and args.skip_tp2:
            continue
        print(f"[vllm-afd demo] running {name} ...", flush=True)
        job = {
            "model": model,
            "prompts": PROMPTS,
            "max_tokens": args.max_tokens,
            "afd": afd,
            "tensor_parallel_size": tp,
        }
        result = run_generation(job)
        rows.append(_row(name, result, reference))
        reference = reference or result
        if afd is not None:
            for i, (a, b) in enumerate(zip(result["texts"], reference["texts"], strict=True)):
                if a != b:
                    print(f"  prompt {i} differs:\n    colocated: {b!r}\n    {name}: {a!r}")
    print(f"\nsample (colocated): {PROMPTS[0]!r} -> {reference['texts'][0]!r}\n")
    _print_table(rows)
    print(
        "\n(tok/s: one short run on a possibly shared machine; `vllm-afd bench` follows the "
        "paper's A/B protocol)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    sys.exit(0 if all(r["identical"] for r in rows) else 1)


if __name__ == "__main__":
    main()
