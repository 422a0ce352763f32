"""Speculative decoding under AFD at the default settings (two ping-pong microbatches).

The same speculative config colocated and under AFD must give the same greedy tokens and the
same acceptance counts, and the verify steps must really be split into microbatches (FFN
requests of microbatch 1). Two drafters: n-gram (no draft model; on the trained SmolLM2 MoE,
whose text repeats its prompt so drafts get accepted), and an MoE draft model whose layer
numbers are the target's (0, 1): its experts must stay on the attention ranks (patch P8),
never be served by the FFN ranks' target experts of the same layer number. The draft is the
target with its routed experts perturbed, so it agrees with the target often but not always:
a draft served the target's experts would agree always, and its acceptance count would differ.
``make test`` runs n-gram offline on the trained model; the rest is ``make test-all``'s. Through
the OpenAI server the verify steps run the same model runner (the server test was dropped to
keep the full tier short; `vllm-afd bench --speculative-config`, tests/e2e/test_bench_e2e.py,
runs n-gram in every configuration).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_offline import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
DEFAULT_AFD = {"ratio": "1:2"}  # microbatches: the default (2)
#: Prompts a trained model continues by copying: n-gram drafts get accepted.
COPY_PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,",
]


def _job(model: str, spec: dict, afd: dict | None, prompts: list[str]) -> dict:
    return {
        "model": model,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "afd": afd,
        "engine_args": {"speculative_config": spec},
    }


def _pair(run_pair, model: str, spec: dict, afd: dict, prompts=PROMPTS) -> tuple[dict, dict]:
    """(colocated, AFD) runs of the same speculative config, side by side."""
    return run_pair(_job(model, spec, None, prompts), _job(model, spec, afd, prompts))


def _assert_same(colocated: dict, afd: dict) -> None:
    for i, (a, c) in enumerate(zip(afd["token_ids"], colocated["token_ids"], strict=True)):
        assert a == c, f"prompt {i}: AFD {a} != colocated {c}"
    assert afd["spec_decode"] == colocated["spec_decode"]
    assert afd["spec_decode"]["drafts"] > 0
    assert sum(f["later_microbatch_requests"] for f in afd["ffn"]) > 0, "no step was split"


@pytest.fixture(scope="module")
def moe_draft(tiny_qwen3, tmp_path_factory) -> str:
    """The target with every routed expert scaled by 1.1: same layer numbers, other experts."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("moe_draft")
    for path in Path(tiny_qwen3).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
            continue
        tensors = load_file(str(path))
        perturbed = {n: t * 1.1 if ".experts." in n else t for n, t in tensors.items()}
        assert perturbed.keys() == tensors.keys() and any(".experts." in n for n in tensors)
        save_file({n: t.contiguous() for n, t in perturbed.items()}, str(out / path.name))
    return str(out)


@pytest.fixture(scope="module")
def real_ngram(smollm2_moe, run_pair) -> tuple[dict, dict]:
    return _pair(run_pair, smollm2_moe, NGRAM, DEFAULT_AFD, COPY_PROMPTS)


def test_ngram_at_default_microbatches_matches_colocated(real_ngram):
    colocated, afd = real_ngram
    _assert_same(colocated, afd)
    assert afd["spec_decode"]["accepted_tokens"] > 0


@pytest.mark.full
def test_an_moe_draft_sharing_layer_numbers_keeps_its_own_experts(tiny_qwen3, moe_draft, run_pair):
    spec = {"method": "draft_model", "model": moe_draft, "num_speculative_tokens": 2}
    colocated, afd = _pair(run_pair, tiny_qwen3, spec, DEFAULT_AFD)
    _assert_same(colocated, afd)
    counts = colocated["spec_decode"]
    assert 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts  # a real draft
