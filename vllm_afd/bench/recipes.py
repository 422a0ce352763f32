"""Bench recipes: named, complete ``vllm-afd bench`` configurations (``--recipe NAME``).

A recipe is a function returning a ``BenchRecipe``, registered under its own name (torchtitan's
config_registry habit): a variant starts from its base and changes what differs, with
``dataclasses.replace``, instead of copying it. Flags given on the command line override the
recipe, flag by flag.

Each recipe names its serve recipe, the ``recipes/*.yaml`` file that deploys the same model at
one of the bench's ratios (``vllm-afd serve --config recipes/X.yaml``); the tests check that the
two agree on the model, the ratio, the microbatches, the dtype and the batch.

    vllm-afd bench --recipe tiny_qwen3 --json ab.json --plot ab.png
    vllm-afd bench --recipe tiny_qwen3_ffn_heavy --profile heavy_profile.json --json heavy.json
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_afd.bench.tiny_models import TinyModelSpec


@dataclass(frozen=True)
class BenchRecipe:
    """A complete ``vllm-afd bench`` configuration: every setting of ``bench.ab.DEFAULTS``."""

    serve_recipe: str
    """The serve recipe of this model and ratio, a path from the repository root."""
    tiny_model: TinyModelSpec | None
    """The tiny model the bench builds (``default_tiny_model``) when ``model`` is None."""
    ratios: tuple[tuple[int, int], ...]
    """AFD ratios (A, F) to run (``--ratios``)."""
    microbatches: tuple[int, ...]
    """Microbatch counts k to run at every ratio (``--microbatches``)."""
    ep_sizes: tuple[int, ...]
    """Colocated wide-EP widths (DP x EP) to run (``--ep-sizes``); empty: none."""
    batch: int
    """Requests per rank (``--batch``)."""
    afd_batch: int | None
    """Requests per AFD attention rank (``--afd-batch``); None: ``batch``."""
    prompt_len: int
    output_len: int
    rounds: int
    """Interleaved decodes per configuration."""
    skip: int
    """Steady steps dropped at the start of each window."""
    threads: int
    """PyTorch threads per rank (one rank = one device)."""
    dtype: Literal["float32", "bfloat16"]
    model: str | None = None
    """A model directory instead of the tiny model."""

    def __post_init__(self) -> None:
        if self.model is None and self.tiny_model is None:
            raise ValueError("a bench recipe needs a model directory or a tiny model")
        if not self.ratios or any(a < 1 or f < 1 for a, f in self.ratios):
            raise ValueError(f"ratios={self.ratios!r}: need (A, F) pairs with A, F >= 1")
        if not self.microbatches or min(self.microbatches) < 1:
            raise ValueError(f"microbatches={self.microbatches!r}: need counts >= 1")

    def settings(self) -> dict[str, Any]:
        """The bench's settings: the keys of ``bench.ab.DEFAULTS``, plus ``model``,
        ``tiny_model`` (``default_tiny_model`` keyword arguments) and ``serve_recipe``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("ratios", "microbatches", "ep_sizes"):
            out[key] = list(out[key])
        out["tiny_model"] = dataclasses.asdict(self.tiny_model) if self.tiny_model else {}
        return out


_RECIPES: dict[str, Callable[[], BenchRecipe]] = {}


def register(fn: Callable[[], BenchRecipe]) -> Callable[[], BenchRecipe]:
    """Register ``fn`` under its name; a second recipe of the same name is an error."""
    if fn.__name__ in _RECIPES:
        raise ValueError(f"bench recipe {fn.__name__!r} is already registered")
    _RECIPES[fn.__name__] = fn
    return fn


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> BenchRecipe:
    """The recipe registered as ``name``; ValueError naming the known recipes otherwise."""
    if name not in _RECIPES:
        hint = ""
        if name.endswith((".py", ".yaml", ".yml")) or "/" in name:
            hint = " (recipes/*.yaml are serve recipes: vllm-afd serve --config FILE)"
        raise ValueError(f"unknown bench recipe {name!r}; known: {', '.join(recipe_names())}{hint}")
    return _RECIPES[name]()


@register
def tiny_qwen3() -> BenchRecipe:
    """The default tiny random Qwen3-MoE (2 layers, 8 experts of 64, top-2, hidden 128) on the
    2-core CPU development machine, float32 so that greedy outputs compare across layouts.

    AFD 1:1 and 2:1 (2 tensor-parallel attention ranks + 1 FFN rank) at k = 1, against
    colocated TP1 and DP2 x EP2. k = 1: the experts of this model are cheap next to an
    attention stage's fixed host work, so a second microbatch costs more than it hides.
    """
    return BenchRecipe(
        serve_recipe="recipes/tiny_qwen3_cpu_2to1.yaml",
        tiny_model=TinyModelSpec(arch="qwen3_moe"),
        ratios=((1, 1), (2, 1)),
        microbatches=(1,),
        ep_sizes=(2,),
        batch=16,
        afd_batch=None,
        prompt_len=128,
        output_len=64,
        rounds=5,
        skip=2,
        threads=1,
        dtype="float32",
    )


@register
def tiny_qwen3_ffn_heavy() -> BenchRecipe:
    """``tiny_qwen3`` with an FFN stage that is not negligible: AFD 1:1 at k = 1 and k = 2.

    Two microbatches pay only when the FFN stage is long enough to hide the other microbatch's
    attention stage. This model makes the expert work dominate without leaving the CPU's
    caches: hidden 256, 16 experts of 128, top-8 (6 MiB of float32 experts per layer, so the
    FFN rank stays compute-bound and its service time halves with the tokens), and 64 requests
    per attention rank (docs/benchmarks.md has the measurements).
    """
    base = tiny_qwen3()
    return dataclasses.replace(
        base,
        serve_recipe="recipes/tiny_qwen3_ffn_heavy_cpu_1to1.yaml",
        tiny_model=dataclasses.replace(
            base.tiny_model, hidden_size=256, num_experts=16, top_k=8, moe_intermediate_size=128
        ),
        ratios=((1, 1),),
        microbatches=(1, 2),
        batch=64,
    )
