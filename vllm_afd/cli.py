"""``vllm-afd``: the product's console script.

    vllm-afd serve MODEL --afd-ratio 2:1 [any vllm serve flag]   # = vllm serve, AFD flags on
    vllm-afd ffn-server MODEL --afd-ratio 4:1 [engine flags]     # an FFN group on its own
    vllm-afd serve MODEL --afd-join GROUP_FILE [...]             # a front-end joining it
    vllm-afd scale GROUP_FILE N                                  # its FFN pool to N ranks
    vllm-afd demo                                                # the README's main job
    vllm-afd plan ...                                            # planner (vllm_afd.planner)
    vllm-afd bench ...                                           # A/B harness
    vllm-afd tiny-model OUT_DIR [--real]                         # build a tiny MoE checkpoint

``serve`` exists because the CPU build's own ``vllm`` script fails on its package metadata; it
builds vLLM's ``serve`` subcommand parser unchanged (the AFD flags are added by the plugin),
so every vLLM flag is forwarded as is.
"""

from __future__ import annotations

import sys


def serve(argv: list[str]) -> None:
    """Run ``vllm serve`` in this process with ``argv`` (plugin loaded, AFD flags known)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_afd

    vllm_afd.register()
    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm-afd")
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


def ffn_server(argv: list[str]) -> None:
    """Run an FFN group on its own until SIGTERM or SIGINT, for front-ends that join it.

    ``--afd-ratio A:F`` sizes it as a server would (F FFN ranks serving A attention ranks, here
    the attention ranks of every front-end that joins, together); the engine flags that shape
    the FFN side (``--dtype``, ``--max-num-batched-tokens``, ``--afd-*``) are vLLM's. The group
    file it prints is what ``vllm-afd serve MODEL --afd-join GROUP_FILE`` takes.
    """
    import signal
    import threading

    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_afd
    from vllm_afd import placement
    from vllm_afd.config import AFDConfig
    from vllm_afd.deployment import checkpoint_dir
    from vllm_afd.errors import AFDConfigError
    from vllm_afd.placement import scaling, shared

    vllm_afd.register()
    parser = FlexibleArgumentParser(prog="vllm-afd ffn-server")
    parser.add_argument("model_tag", help="the model (directory) the group serves")
    parser.add_argument("--group-file", help="where to write the group file (default: printed)")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    afd = AFDConfig.of(engine_args)
    if afd is None or afd.join is not None or afd.ratio is None:
        raise AFDConfigError("vllm-afd ffn-server: --afd-ratio A:F is required (not auto, no join)")
    check_shared_transport(afd)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        model_dir = checkpoint_dir(vllm_config.model_config.model)
        path = placement.write_group_file(placement.current_group(), args.group_file, model_dir)
        print(f"vllm-afd ffn-server: FFN group ready; join with --afd-join {path}", flush=True)
        while not stop.wait(scaling.REQUEST_POLL_S):
            scaling.answer_scale_requests(shared.scale_requests_dir())
    finally:
        placement.stop_ffn_group()


def check_shared_transport(afd) -> None:
    """``AFDConfigError`` unless the transport lets front-ends that join separately share the
    group (``Feature.SHARED_GROUP``), ``auto`` and its settings resolved as the front-end
    would."""
    from vllm_afd.deployment import _resolve_transport
    from vllm_afd.errors import AFDConfigError
    from vllm_afd.transport import Feature, backend

    afd = _resolve_transport(afd)
    if Feature.SHARED_GROUP not in backend(afd.transport).features(afd.transport_config):
        raise AFDConfigError(
            f"vllm-afd ffn-server: --afd-transport {afd.transport} "
            f"{afd.transport_config or ''}: its FFN ranks serve a step of every attention rank "
            "at once, and front-ends that join separately do not step together; use shm or "
            "slots with host waits (one host) or nixl (across hosts)"
        )


def scale(argv: list[str]) -> None:
    """Set the FFN rank count of a running ``vllm-afd ffn-server`` group (``POST /afd/scale``
    for a front-end's own group); exits 0 once every front-end serves on the new pool, 1 with
    the reason otherwise."""
    import argparse
    import json

    from vllm_afd.placement.scaling import SWITCH_TIMEOUT_S, ScaleError, request_scale

    parser = argparse.ArgumentParser(prog="vllm-afd scale", description=scale.__doc__)
    parser.add_argument("group_file", help="the group file `vllm-afd ffn-server` printed")
    parser.add_argument("num_ffn_ranks", type=int, help="the FFN rank count to serve on")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the answer (the new pool starts, then every front-end "
        f"switches within {SWITCH_TIMEOUT_S:g}s)",
    )
    args = parser.parse_args(argv)
    try:
        reply = request_scale(args.group_file, args.num_ffn_ranks, args.timeout)
    except ScaleError as exc:
        reply = {"status": exc.status, "error": str(exc)}
    print(json.dumps(reply), flush=True)
    if reply.get("status") != 200:
        print(f"vllm-afd scale: error: {reply.get('error')}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("--help", [])
    if command == "serve":
        return _run_user_facing(serve, rest)
    if command == "ffn-server":
        return _run_user_facing(ffn_server, rest)
    if command == "scale":
        return _run_user_facing(scale, rest)
    if command == "demo":
        from vllm_afd.bench.demo import main as demo_main

        return demo_main(rest)
    if command == "plan":
        from vllm_afd.planner.cli import main as plan_main

        return plan_main(rest)
    if command == "profile":
        from vllm_afd.bench.calibrate import main as profile_main

        return profile_main(rest)
    if command == "bench":
        from vllm_afd.bench.ab import main as bench_main

        return bench_main(rest)
    if command == "tiny-model":
        if "--real" in rest:
            from vllm_afd.bench.real_model import main as real_main

            return real_main([arg for arg in rest if arg != "--real"])
        from vllm_afd.bench.tiny_models import main as tiny_main

        return tiny_main(rest)
    print(__doc__)
    sys.exit(0 if command in ("-h", "--help", "help") else 2)


def _run_user_facing(fn, argv: list[str]) -> None:
    """Run ``fn``; an AFD configuration error exits 2 with its one-line message."""
    from vllm_afd.errors import AFDConfigError

    try:
        fn(argv)
    except AFDConfigError as exc:
        print(f"vllm-afd: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
