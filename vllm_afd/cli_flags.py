"""The AFD flags of ``vllm serve`` (and ``vllm-afd serve``): definition and merge.

Parsing happens only here, at the edge; the result is the plain dict
``additional_config["afd"]`` that ``AFDConfig.from_dict`` validates in every process.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_afd.config import FFN_DEVICES, FLAG_KEYS, AFDConfigError, parse_ratio


def _ratio_arg(text: str) -> str:
    try:
        parse_ratio(text)
    except AFDConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def add_afd_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "AFD" argument group to a vLLM engine-args parser (idempotent)."""
    if any(getattr(a, "dest", None) == "afd_ratio" for a in parser._actions):
        return
    from vllm_afd.transport import available_transports

    group = parser.add_argument_group(
        "AFD", "Attention-FFN Disaggregation (vllm-afd). Off unless --afd-ratio is given."
    )
    group.add_argument(
        "--afd-ratio",
        type=_ratio_arg,
        default=None,
        metavar="A:F",
        help="Turn AFD on: A attention ranks (data parallel x tensor parallel engine ranks) per "
        "F FFN ranks, e.g. 7:1. The FFN rank count is attention_ranks*F/A and must be whole. "
        "'auto' lets the planner pick the ratio.",
    )
    group.add_argument(
        "--afd-transport",
        choices=available_transports(),
        default=None,
        help="Dispatch/combine backend between attention and FFN ranks: shm (one host, "
        "shared memory; default), tcp (across hosts), deepep (GPUs, NVLink/RDMA).",
    )
    group.add_argument(
        "--afd-ffn-device",
        choices=FFN_DEVICES,
        default=None,
        help="Device of the FFN executors (default auto: the attention ranks' platform).",
    )
    group.add_argument(
        "--afd-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Bound on one FFN round trip; past it, in-flight requests fail (default 30).",
    )
    group.add_argument(
        "--afd-ray-address",
        default=None,
        metavar="HOST:PORT",
        help="Ray cluster for the FFN group (default: start Ray locally).",
    )
    group.add_argument(
        "--afd-microbatches",
        type=int,
        default=None,
        metavar="K",
        help="Microbatches per decode step for ping-pong overlap of attention and FFN "
        "(default 2; 1 disables).",
    )
    group.add_argument(
        "--afd-ffn-host",
        default=None,
        metavar="IP",
        help="Interface the FFN ranks listen on with the tcp transport (default 127.0.0.1).",
    )


def afd_flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The AFD flags that were given, as additional_config keys."""
    out = {}
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None:
            out[key] = value
    return out


def _given_flags(flags: dict[str, Any]) -> list[str]:
    return [flag for flag, key in FLAG_KEYS.items() if key in flags]


def merge_afd_flags(args: argparse.Namespace, engine_args: Any) -> None:
    """Fold the AFD flags into ``engine_args.additional_config["afd"]``."""
    flags = afd_flags_from_args(args)
    if not flags:
        return
    if "ratio" not in flags:
        raise AFDConfigError(
            f"--afd-ratio is required with {', '.join(_given_flags(flags))}; AFD is off without it"
        )
    extra = dict(engine_args.additional_config or {})
    long_form = dict(extra.get("afd") or {})
    clash = sorted(set(long_form) & set(flags))
    if clash:
        raise AFDConfigError(
            f"AFD setting(s) {clash} given both as flags and in --additional-config; give each once"
        )
    extra["afd"] = {**long_form, **flags}
    engine_args.additional_config = extra
