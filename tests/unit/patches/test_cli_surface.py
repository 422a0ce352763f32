"""The AFD flags on vLLM's own `serve` parser (what `vllm serve` builds): exactly these added,
every stock flag kept."""

import pytest

#: The whole CLI surface the plugin adds (a new flag must be added here on purpose).
EXPECTED = {
    "--afd-ratio",
    "--afd-transport",
    "--afd-transport-config",
    "--afd-ffn-device",
    "--afd-timeout",
    "--afd-failover-timeout",
    "--afd-ray-address",
    "--afd-microbatches",
    "--afd-join",
    "--afd-autoscale",
    "--afd-autoscale-interval",
    "--afd-autoscale-margin",
}


def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def _flags(parser) -> set[str]:
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings}


@pytest.fixture(scope="module")
def serve_parser():
    import vllm_afd

    vllm_afd.register()
    return _serve_parser()


@pytest.fixture(scope="module")
def stock_flags(serve_parser) -> set[str]:
    """The flags of vLLM's serve parser built with P1's original ``add_cli_args``."""
    from vllm.engine.arg_utils import EngineArgs

    wrapped = EngineArgs.__dict__["add_cli_args"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineArgs, "add_cli_args", staticmethod(wrapped.__func__.__wrapped__))
        return _flags(_serve_parser())


def test_the_plugin_adds_exactly_the_afd_flags_and_keeps_every_stock_one(serve_parser, stock_flags):
    flags = _flags(serve_parser)
    assert flags - stock_flags == EXPECTED
    assert stock_flags <= flags
    assert len(stock_flags) > 100 and "--data-parallel-size" in stock_flags  # vLLM's own


def test_flags_fold_into_additional_config(serve_parser, tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    def engine_args(*argv: str) -> AsyncEngineArgs:
        # the model, an existing directory: vLLM resolves no hub id (under HF_HUB_OFFLINE it
        # would look one up in the local cache); positional, as ServeSubcommand.cmd takes it
        args = serve_parser.parse_args(["serve", str(tmp_path), *argv])
        args.model = args.model_tag
        return AsyncEngineArgs.from_cli_args(args)

    afd = engine_args("--afd-ratio", "7:1", "--afd-timeout", "5", "--afd-join", "g.json")
    assert afd.additional_config["afd"] == {
        "ratio": "7:1",
        "timeout": 5.0,
        "join": "g.json",
    }
    assert "afd" not in (engine_args().additional_config or {})


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    import vllm_afd

    vllm_afd.register()
    first = EngineArgs.create_engine_config
    vllm_afd._REGISTERED = False  # as if a second process-level load happened
    vllm_afd.register()
    assert EngineArgs.create_engine_config is first


def test_help_shows_each_afd_default_once(serve_parser):
    serve = serve_parser._subparsers._group_actions[0].choices["serve"]
    (group,) = (g for g in serve._action_groups if g.title == "AFD")
    formatter = serve._get_formatter()
    formatter.start_section(group.title)
    formatter.add_arguments(group._group_actions)
    formatter.end_section()
    text = " ".join(formatter.format_help().split())
    assert "(default: None)" not in text  # argparse's own, next to every flag
    assert text.count("(default 60.0)") == 1 and text.count("(default 30.0)") == 1
