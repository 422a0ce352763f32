"""Serve recipes (recipes/*.yaml, .env) through vLLM's own parser; bench recipes by name.

Every YAML is loaded the way ``vllm serve --config`` / ``vllm-afd serve --config`` loads it
(vLLM's serve parser with the plugin registered) and must land in ``additional_config["afd"]``
as EXPECTED says; every bench recipe must be complete, and agree with the serve recipe it names.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
YAMLS = sorted((ROOT / "recipes").glob("*.yaml"))
ENVS = sorted((ROOT / "recipes").glob("*.env"))

#: Per serve recipe: additional_config["afd"], attention ranks (DP x TP), host, dtype.
EXPECTED = {
    "tiny_qwen3_cpu_2to1": (
        {"ratio": "2:1", "microbatches": 1},
        {"data_parallel_size": 1, "tensor_parallel_size": 2},
        {"host": "127.0.0.1", "dtype": "float32"},
    ),
    "tiny_qwen3_ffn_heavy_cpu_1to1": (
        {"ratio": "1:1", "microbatches": 2},
        {"data_parallel_size": 1, "tensor_parallel_size": 1},
        {"host": "127.0.0.1", "dtype": "float32"},
    ),
    "qwen3_30b_a3b_h200_7to1": (
        {
            "ratio": "7:1",
            "transport": "slots",
            "ffn_device": "cuda",
            "microbatches": 2,
        },
        {"data_parallel_size": 7, "tensor_parallel_size": 1},
        {"host": "127.0.0.1", "dtype": "bfloat16"},
    ),
}


def _serve(parser, *argv: str):
    """Parsed args and engine args of ``vllm serve ARGV`` (positional model wins, as in
    ``ServeSubcommand.cmd``). ``args.model`` is the recipe's (or the positional) model; the
    engine args are built for an empty local directory instead, so that vLLM resolves no
    model (under ``HF_HUB_OFFLINE`` it looks a hub id up in the local cache)."""
    import tempfile

    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["serve", *argv])
    if args.model_tag is not None:
        args.model = args.model_tag
    with tempfile.TemporaryDirectory() as local:
        engine_args = AsyncEngineArgs.from_cli_args(
            argparse.Namespace(**{**vars(args), "model": local})
        )
    return args, engine_args


def _tiny_model_command(path: Path) -> list[str] | None:
    """The ``vllm-afd tiny-model`` arguments in a recipe's header comment, if any."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and line.lstrip("# ").startswith("vllm-afd tiny-model "):
            return shlex.split(line.lstrip("# "))[2:]
    return None


def _exported(script: str) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", f"{script}env -0"],
        env={},
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def _sourced(path: Path) -> dict[str, str]:
    """The variables ``set -a; . FILE; set +a`` exports (beyond a clean shell's own)."""
    clean = _exported("")
    return {
        k: v
        for k, v in _exported(f'set -a; . "{path}"; set +a; ').items()
        if clean.get(k) != v and k != "_"
    }


def test_every_serve_recipe_has_an_expectation():
    assert len(YAMLS) >= 3
    assert {p.stem for p in YAMLS} == set(EXPECTED)
    for env in ENVS:
        assert env.with_suffix(".yaml").exists(), f"{env.name} has no serve recipe"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_serve_recipe_folds_into_the_afd_config(serve_parser, path):
    from vllm_afd.config import AFDConfig

    afd, layout, plain = EXPECTED[path.stem]
    args, engine_args = _serve(serve_parser, "--config", str(path))
    assert engine_args.additional_config["afd"] == afd
    config = AFDConfig.from_dict(engine_args.additional_config["afd"])  # raises if invalid
    for key, value in {**layout, **plain}.items():
        assert getattr(args, key) == value, key
    assert config.num_ffn_ranks(layout["data_parallel_size"] * layout["tensor_parallel_size"])
    assert args.model  # the model is in the file


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_command_line_overrides_the_serve_recipe(serve_parser, path):
    args, engine_args = _serve(serve_parser, "m", "--config", str(path), "--afd-timeout", "5")
    assert args.model == "m"
    assert engine_args.additional_config["afd"] == {**EXPECTED[path.stem][0], "timeout": 5.0}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_tiny_serve_recipes_say_how_to_build_their_model(serve_parser, path):
    from vllm_afd.bench.tiny_models import TinyModelSpec, _parse_args, builder_kwargs

    command = _tiny_model_command(path)
    if not path.stem.startswith("tiny_"):
        assert command is None
        return
    args, _ = _serve(serve_parser, "--config", str(path))
    parsed = _parse_args(command)
    assert parsed.out_dir == args.model  # the comment builds what `model:` names
    TinyModelSpec(**builder_kwargs(parsed))  # raises on an invalid model


@pytest.mark.parametrize("path", ENVS, ids=lambda p: p.stem)
def test_env_files_source_and_pass_the_checks(serve_parser, path, monkeypatch):
    from vllm_afd import envs
    from vllm_afd.config import AFDConfig

    env = _sourced(path)
    assert env, f"{path.name} sets nothing"
    args, engine_args = _serve(serve_parser, "--config", str(path.with_suffix(".yaml")))
    ranks = args.data_parallel_size * args.tensor_parallel_size
    num_ffn = AFDConfig.from_dict(engine_args.additional_config["afd"]).num_ffn_ranks(ranks)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # every VLLM_AFD_* value parses, one CPU list per FFN rank (not checked against this
    # machine's CPUs: a recipe is for the machine it names)
    envs.check_all(num_ffn, local=False)
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind is not None:
        assert len(bind.split("|")) == args.tensor_parallel_size  # one list per TP rank
    gpus = env.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        # the attention ranks' GPUs and, after them, the FFN ranks' (``placement.ffn_gpu``)
        assert len(gpus.split(",")) == ranks + num_ffn


# -- bench recipes ---------------------------------------------------------------------------------


def _names() -> list[str]:
    from vllm_afd.bench.recipes import recipe_names

    return recipe_names()


def test_there_are_bench_recipes_and_the_variant_derives_from_its_base():
    from vllm_afd.bench.recipes import get_recipe

    assert {"tiny_qwen3", "tiny_qwen3_ffn_heavy"} <= set(_names())
    base, heavy = get_recipe("tiny_qwen3"), get_recipe("tiny_qwen3_ffn_heavy")
    changed = {"serve_recipe", "tiny_model", "ratios", "microbatches", "batch"}
    for field in dataclasses.fields(base):
        same = getattr(heavy, field.name) == getattr(base, field.name)
        assert same != (field.name in changed), field.name
    assert heavy.tiny_model.arch == base.tiny_model.arch == "qwen3_moe"


@pytest.mark.parametrize("name", _names())
def test_bench_recipe_is_complete_and_valid(name):
    from vllm_afd.bench.ab import DEFAULTS, build_configs
    from vllm_afd.bench.recipes import get_recipe

    config = get_recipe(name).settings()
    assert set(DEFAULTS) <= set(config), set(DEFAULTS) - set(config)
    settings = {**config, "afd_batch": config["afd_batch"] or config["batch"]}
    names = [c.name for c in build_configs(settings)]
    assert names[0] == "colocated"
    assert any(name.startswith("afd ") for name in names)


@pytest.mark.parametrize("name", _names())
def test_bench_recipe_agrees_with_its_serve_recipe(serve_parser, name):
    from vllm_afd.bench.recipes import get_recipe
    from vllm_afd.bench.tiny_models import TinyModelSpec, _parse_args, builder_kwargs
    from vllm_afd.config import AFDConfig, parse_ratio

    recipe = get_recipe(name)
    path = ROOT / recipe.serve_recipe
    assert path.is_file(), recipe.serve_recipe
    args, engine_args = _serve(serve_parser, "--config", str(path))
    afd = AFDConfig.from_dict(engine_args.additional_config["afd"])
    assert parse_ratio(engine_args.additional_config["afd"]["ratio"]) in recipe.ratios
    assert afd.microbatches in recipe.microbatches
    assert args.dtype == recipe.dtype
    assert args.max_num_seqs == recipe.batch * args.tensor_parallel_size  # requests per rank
    built = builder_kwargs(_parse_args(_tiny_model_command(path)))  # the same tiny model
    assert TinyModelSpec(**built) == recipe.tiny_model


def test_bench_recipe_by_name_and_flags_override(capsys):
    from vllm_afd.bench import ab

    args = ab.build_parser().parse_args(["--recipe", "tiny_qwen3_ffn_heavy", "--batch", "8"])
    settings = ab.settings_from_args(args)
    assert settings["ratios"] == [(1, 1)] and settings["microbatches"] == [1, 2]
    assert settings["batch"] == 8 and settings["afd_batch"] == 8
    assert settings["tiny_model"]["hidden_size"] == 256 and settings["model"] is None


@pytest.mark.parametrize("bad", ["nope", "recipes/tiny_qwen3_cpu_2to1.py"])
def test_unknown_bench_recipe_is_refused_listing_the_known_ones(capsys, bad):
    from vllm_afd.bench import ab

    with pytest.raises(SystemExit) as exc:
        ab.build_parser().parse_args(["--recipe", bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--recipe" in err and bad in err
    assert "tiny_qwen3, tiny_qwen3_ffn_heavy" in err


def test_registering_a_name_twice_is_an_error():
    from vllm_afd.bench.recipes import register, tiny_qwen3

    with pytest.raises(ValueError, match="already registered"):
        register(tiny_qwen3)


def test_the_gpu_recipe_passes_the_gpu_start_up_checks(serve_parser):
    """The H200 recipe, parsed by vLLM's parser, passes ``deployment.check_devices`` on the
    node it is written for (8 GPUs): the transport connects GPUs, and attention and FFN ranks
    get disjoint GPUs of the node."""
    from vllm_afd.config import AFDConfig
    from vllm_afd.deployment import check_devices

    path = ROOT / "recipes" / "qwen3_30b_a3b_h200_7to1.yaml"
    _, engine_args = _serve(serve_parser, "--config", str(path))
    afd = AFDConfig.from_dict(engine_args.additional_config["afd"])
    ranks = engine_args.data_parallel_size * engine_args.tensor_parallel_size
    check_devices(afd, ranks, "cuda", gpus_on_node=8)
    assert ranks + afd.num_ffn_ranks(ranks) == 8
