"""The AFD flags exist on vLLM's own `serve` parser (what `vllm serve` builds), unchanged."""

import pytest

EXPECTED = {
    "--afd-ratio",
    "--afd-transport",
    "--afd-ffn-device",
    "--afd-timeout",
    "--afd-ray-address",
    "--afd-microbatches",
    "--afd-ffn-host",
}


@pytest.fixture(scope="module")
def serve_parser():
    import vllm_afd

    vllm_afd.register()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def test_afd_flags_are_on_vllm_serve(serve_parser):
    serve = serve_parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    assert EXPECTED <= flags
    assert "--data-parallel-size" in flags  # the stock flags are all still there


def test_flags_fold_into_additional_config(serve_parser):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = serve_parser.parse_args(["serve", "m", "--afd-ratio", "7:1", "--afd-timeout", "5"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config["afd"] == {"ratio": "7:1", "timeout_s": 5.0}
    stock = AsyncEngineArgs.from_cli_args(serve_parser.parse_args(["serve", "m"]))
    assert "afd" not in (stock.additional_config or {})


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    import vllm_afd

    vllm_afd.register()
    first = EngineArgs.create_engine_config
    vllm_afd._REGISTERED = False  # as if a second process-level load happened
    vllm_afd.register()
    assert EngineArgs.create_engine_config is first
