"""Every recipe in recipes/ is a complete bench configuration and a valid `vllm serve` line."""

from pathlib import Path

import pytest

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.py"))


def _module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_recipes():
    assert len(RECIPES) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_bench_config_is_complete_and_valid(path):
    from vllm_afd.bench.ab import DEFAULTS, build_configs, load_recipe
    from vllm_afd.bench.tiny_models import TinyModelSpec

    config = load_recipe(str(path))
    assert set(DEFAULTS) <= set(config), set(DEFAULTS) - set(config)
    TinyModelSpec(**config["tiny_model"])  # raises on an invalid model
    settings = {**config, "afd_batch": config["afd_batch"] or config["batch"]}
    names = [c.name for c in build_configs(settings)]
    assert names[0] == "colocated"
    assert any(name.startswith("afd ") for name in names)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_serve_args_fold_into_the_afd_config(path):
    import vllm_afd

    vllm_afd.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_afd.config import AFDConfig

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *_module(path).serve_args(model="m")])
    assert args.host == "127.0.0.1"
    afd = AsyncEngineArgs.from_cli_args(args).additional_config["afd"]
    AFDConfig.from_dict(afd)  # raises on an invalid AFD section
