"""Run one offline vLLM generation in a fresh process and report what happened.

Every configuration (colocated, AFD at a ratio, tensor parallel, ...) runs in its own Python
process: vLLM keeps process-global state (distributed groups, compiled graphs), and a fresh
process is also what a user's deployment is. The child prints one JSON line with the greedy
token ids, timings, and the parameter bytes held by attention rank 0 and by each FFN rank, so
that the demo, the A/B harness and the tests all compare like with like.

    python -m vllm_afd.bench.offline_run \\
        '{"model": "...", "prompts": [...], "afd": {"ratio": "1:1"}}'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

RESULT_PREFIX = "VLLM_AFD_RESULT "
DEFAULT_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # lets collective_rpc ship the small parameter-counting function to MP workers
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def child_env(tensor_parallel: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM child on this machine (loopback, small KV cache, core binding)."""
    env = {**os.environ, **DEFAULT_ENV, **(extra or {})}
    if tensor_parallel > 1:
        env.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(i % (os.cpu_count() or 1)) for i in range(tensor_parallel)),
        )
    else:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def run_generation(job: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``job`` (see ``_generate``) in a child process; return its JSON result.

    Raises RuntimeError with the child's output tail if it fails or prints no result.
    """
    env = child_env(job.get("tensor_parallel_size", 1), job.get("env"))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_afd.bench.offline_run", json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stdout + proc.stderr)[-4000:]
    raise RuntimeError(f"vLLM child exited {proc.returncode} without a result:\n{tail}")


def param_bytes(worker) -> int:
    """Bytes of the model parameters a worker holds (for `collective_rpc`)."""
    model = worker.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _generate(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        seed=0,
        max_model_len=job.get("max_model_len", 512),
        max_num_seqs=job.get("max_num_seqs", 16),
        enforce_eager=job.get("enforce_eager", True),
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        enable_prefix_caching=job.get("enable_prefix_caching", True),
        enable_chunked_prefill=job.get("enable_chunked_prefill", True),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 256),
    )
    kwargs.update(job.get("engine_args") or {})  # any other LLM argument, e.g. attention_backend
    if "speculative_config" in kwargs:
        kwargs["disable_log_stats"] = False  # the acceptance counters
    if job.get("afd"):
        kwargs["additional_config"] = {"afd": job["afd"]}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job.get("max_tokens", 32),
        ignore_eos=True,
        logprobs=0 if job.get("logprobs") else None,  # 0: the sampled token's only
    )
    prompts = job["prompts"]
    if job.get("warmup", True):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))
    t1 = time.perf_counter()
    if job.get("one_at_a_time"):  # each prompt alone: the batches a server sees, one request
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if job.get("logprobs"):
        logprobs = [
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids, strict=True)]
            for o, ids in zip(outputs, tokens, strict=True)
        ]
    result = {
        "token_ids": tokens,
        "texts": [o.outputs[0].text for o in outputs],
        "startup_s": startup_s,
        "generate_s": gen_s,
        "output_tokens": sum(len(t) for t in tokens),
        "prompt_lens": [len(o.prompt_token_ids or ()) for o in outputs],
        # prompt tokens not computed here: local prefix cache hits plus KV loaded through a
        # KV connector (a disaggregated decode instance's prefill)
        "num_cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
        "attention_param_bytes": llm.collective_rpc(param_bytes)[0],
        "ffn": _ffn_report(),
    }
    if job.get("logprobs"):
        result["logprobs"] = logprobs  # per prompt, the sampled tokens' logprobs
    if "speculative_config" in kwargs:
        result["spec_decode"] = spec_decode_counts(llm)
    return result


def spec_decode_counts(llm) -> dict[str, float]:
    """Speculative decoding so far: drafts, draft tokens and accepted tokens (vLLM's counters)."""
    wanted = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    counts = dict.fromkeys(wanted.values(), 0.0)
    for metric in llm.get_metrics():
        key = wanted.get(metric.name)
        if key is not None:
            counts[key] += metric.value
    return counts


def _ffn_report() -> list[dict]:
    from vllm_afd.placement import current_group

    group = current_group()
    if group is None:
        return []
    stats = group.stats()
    return [{**info, **stat} for info, stat in zip(group.infos, stats, strict=True)]


def main() -> None:
    """The child's entry; run by hand, it takes ``DEFAULT_ENV`` for what the caller left unset
    (without ``VLLM_CPU_KVCACHE_SPACE`` vLLM's CPU build sizes the KV cache from the host's
    memory: tens of GiB next to the FFN ranks)."""
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    result = _generate(json.loads(sys.argv[1]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
