"""``vllm-afd demo``: the README's main job on an embedded default.

Serves a trained model (SmolLM2-135M-Instruct upcycled to an 8-expert MoE, built offline from
its PyPI wheel: ``bench/real_model.py``) colocated (stock vLLM) and in AFD mode at 1:1, 1:2 (two
FFN ranks) and 2:1 (two tensor-parallel attention ranks, one FFN rank; skipped for a model whose
attention heads do not split in two, as SmolLM2's 9), each in a fresh process,
sends the same prompts, prints the completions side by side with whether every token equals
colocated's, a short A/B table (parameter bytes per attention rank and per FFN rank, decode
throughput) and what the planner says about a real deployment. Without the model's wheel it
falls back to the tiny random-weight Qwen3-MoE (noise for text, same checks).
Exit status 1 if any AFD output differs from colocated.
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Attention and feed-forward layers can be disaggregated because",
]

CONFIGS = [
    ("colocated", None, 1),
    ("afd 1:1", {"ratio": "1:1"}, 1),
    ("afd 1:2", {"ratio": "1:2"}, 1),
    ("afd 2:1 (TP2)", {"ratio": "2:1"}, 2),
]
#: The planner on a real deployment (the model and hardware of the FastAFD paper).
PLAN_ARGV = ["--model", "qwen3-235b-a22b", "--hardware", "gb200", "--context", "8K"]


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


def _heads(model: str) -> int:
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("num_attention_heads", 1))


def _print_completions(names: list[str], results: list[dict]) -> None:
    reference = results[0]
    for i, prompt in enumerate(PROMPTS):
        same = [r["token_ids"][i] == reference["token_ids"][i] for r in results[1:]]
        print(f"{prompt!r} -> {reference['texts'][i]!r}")
        marks = ", ".join(f"{n} {s}" for n, s in zip(names[1:], same, strict=True))
        print(f"    identical tokens: {marks}")


def _default_model() -> str:
    from vllm_afd.bench.real_model import RealModelUnavailable, default_real_model
    from vllm_afd.bench.tiny_models import default_tiny_model

    try:
        return str(default_real_model())
    except RealModelUnavailable as exc:
        print(f"[vllm-afd demo] {exc}; using the tiny random model (its text is noise)")
        return str(default_tiny_model())


def _print_plan_excerpt() -> None:
    import contextlib
    import io

    from vllm_afd.planner.cli import main as plan_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(PLAN_ARGV)
    lines = out.getvalue().splitlines()
    keep = [lines[0]] + [line for line in lines if line.startswith(("recommended", "coverage"))]
    print(f"\nWhat AFD is for (`vllm-afd plan {' '.join(PLAN_ARGV)}`):")
    print("\n".join("    " + line for line in keep))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-afd demo", description=__doc__)
    parser.add_argument("--model", default=None, help="MoE model dir (default: SmolLM2 MoE)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--skip-tp2", action="store_true", help="skip the 2:1 (TP2) config")
    args = parser.parse_args(argv)

    from vllm_afd.bench.offline_run import run_generation

    model = args.model or _default_model()
    print(f"[vllm-afd demo] model: {model}", flush=True)
    rows, names, results, reference = [], [], [], None
    for name, afd, tp in CONFIGS:
        if tp > 1 and args.skip_tp2:
            continue
        if _heads(model) % tp:
            print(f"[vllm-afd demo] skipping {name}: {_heads(model)} attention heads do not split")
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
        names.append(name)
        results.append(result)
        reference = reference or result
        if afd is not None:
            for i, (a, b) in enumerate(zip(result["texts"], reference["texts"], strict=True)):
                if a != b:
                    print(f"  prompt {i} differs:\n    colocated: {b!r}\n    {name}: {a!r}")
    print("\nGreedy completions (colocated), and whether each layout gave the same tokens:\n")
    _print_completions(names, results)
    print()
    _print_table(rows)
    print(
        "\n(tok/s: one short run on a possibly shared machine; `vllm-afd bench` follows the "
        "paper's A/B protocol)"
    )
    _print_plan_excerpt()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    sys.exit(0 if all(r["identical"] for r in rows) else 1)


if __name__ == "__main__":
    main()
