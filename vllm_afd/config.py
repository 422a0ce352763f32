"""AFD configuration: one frozen, self-validating dataclass, built at the edge.

Two spellings land here: the flags (``--afd-ratio 2:1 --afd-transport shm ...``, declared once
as ``AFDConfig`` field metadata and added to vLLM's parser by patch P1) and the long form
``--additional-config '{"afd": {...}}'``. Both end up as the dict
``VllmConfig.additional_config["afd"]``, which every vLLM process receives, and
``AFDConfig.of(vllm_config)`` turns it into this dataclass wherever it is needed.
``check_supported`` is the one check of a vLLM config against what AFD can run.

A:F semantics. A attention ranks per F FFN ranks. Attention ranks are vLLM's engine ranks
(data parallel x tensor parallel); the FFN rank count is ``attention_ranks * F / A`` and must be
a whole number. Routed experts are sharded contiguously over the FFN ranks (expert parallel
inside the FFN group), so the expert count must divide evenly.

Every error names the flag (and its ``additional_config`` key) and what is allowed. The checks
run in the front-end before anything starts (``deployment.setup_afd`` calls them all, in this
order): ``AFDConfig.of`` (each value on its own: ``__post_init__``), ``check_supported`` (the
rest of the vLLM config), ``check_this_host`` (what depends on this machine: the transport's
host check), then ``envs.check_all`` (the variables) and ``placement``'s Ray checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from vllm_afd.errors import AFDConfigError

FFNDevice = Literal["auto", "cpu", "cuda"]
#: Most ping-pong microbatches per step (``--afd-microbatches``).
MAX_MICROBATCHES = 8
_RATIO_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
#: ``--afd-ray-address`` values that mean a Ray instance on this machine.
LOCAL_RAY = (None, "", "local", "auto")
logger = logging.getLogger("vllm.afd")


def _flag(name: str, help: str, metavar: str | None = None, **argparse_kwargs: Any) -> dict:
    """Field metadata: the field's ``vllm serve`` flag and its help text (one source)."""
    return {"flag": name, "help": help, "metavar": metavar, **argparse_kwargs}


def afd_section(additional_config: Any) -> dict[str, Any] | None:
    """The raw ``additional_config["afd"]`` dict, or None when AFD is not configured.

    A present but empty or non-dict ``afd`` entry is an error, not "AFD off": a user who wrote
    ``{"afd": {}}`` meant to turn it on.
    """
    if not isinstance(additional_config, dict) or additional_config.get("afd") is None:
        return None
    raw = additional_config["afd"]
    if not isinstance(raw, dict):
        raise AFDConfigError(
            f"additional_config.afd: expected an object of AFD settings such as "
            f'{{"ratio": "2:1"}}, got {raw!r}'
        )
    if not raw:
        raise AFDConfigError(
            f"additional_config.afd is empty: {_where('ratio')} is required to turn AFD on "
            "(A:F with integers >= 1, e.g. 2:1, or 'auto'); remove the afd entry to run without"
        )
    return raw


def parse_ratio(text: str) -> tuple[int, int] | None:
    """Parse ``"A:F"`` into ``(A, F)``; ``"auto"`` into ``None`` (the planner decides)."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return None
    match = _RATIO_RE.match(str(text))
    if match is None:
        raise AFDConfigError(
            f"{_where('ratio')}: {text!r} is not a ratio; expected A:F with positive integers "
            "A (attention ranks) and F (FFN ranks), e.g. 7:1 or 2:1, or 'auto'"
        )
    attn, ffn = int(match.group(1)), int(match.group(2))
    if attn < 1 or ffn < 1:
        raise AFDConfigError(
            f"{_where('ratio')}: {text!r} has a zero side; A and F must both be >= 1"
        )
    return attn, ffn


#: ``--afd-transport`` that lets the front-end choose (``transport.auto_backend``).
AUTO_TRANSPORT = "auto"


def _transport_arg(text: str) -> str:
    from vllm_afd.transport import backend

    if text == AUTO_TRANSPORT:
        return text
    try:
        backend(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def json_object_arg(text: str) -> dict[str, Any]:
    """An argparse ``type``: a JSON object (``--afd-transport-config``, the bench's
    ``--speculative-config``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"waits": "device"}}\', got {text!r}'
        )
    return value


def _ratio_arg(text: str) -> str:
    try:
        parse_ratio(text)
    except AFDConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


@dataclass(frozen=True)
class AFDConfig:
    """User-facing AFD settings (what the flags say), validated on construction.

    Each field's metadata holds its ``vllm serve`` flag and help text: the argparse group
    (``add_afd_flags``), ``FLAG_KEYS`` and the README's flag table all derive from it.
    """

    #: ``(A, F)``: A attention ranks per F FFN ranks; ``None`` means "auto" (planner), or,
    #: with ``join``, the ratio of the group joined.
    ratio: tuple[int, int] | None = field(
        metadata=_flag(
            "--afd-ratio",
            "Turn AFD on: A attention ranks (data parallel x tensor parallel engine ranks) per "
            "F FFN ranks, e.g. 7:1. The FFN rank count is attention_ranks*F/A and must be "
            "whole. 'auto' lets the planner pick the ratio.",
            "A:F",
            type=_ratio_arg,
        )
    )
    #: Transport backend: ``auto`` (the front-end picks one for the devices), a registered name
    #: (``vllm_afd.transport.available_transports()``) or an out-of-tree backend's
    #: ``package.module:BackendClass``.
    transport: str = field(
        default=AUTO_TRANSPORT,
        metadata=_flag(
            "--afd-transport",
            "Dispatch/combine backend between attention and FFN ranks: auto (shm on one x86-64 "
            "CPU host, nixl on other CPUs or with --afd-ray-address, slots on GPUs), shm (one "
            "host: the slot plane on shared memory), slots (one node: the slot plane on the "
            "attention ranks' memory, device memory on GPUs, "
            "CUDA-graph safe), nixl (across hosts: the slot plane over NIXL, CPU ranks), "
            "or an out-of-tree backend as package.module:BackendClass.",
            type=_transport_arg,
        ),
    )
    #: The backend's own settings (``Backend.settings``), opaque to the rest of the product:
    #: they reach its endpoints as ``TransportSpec.config`` (as vLLM's
    #: ``kv_connector_extra_config`` reaches a KV connector).
    transport_config: dict[str, Any] = field(
        default_factory=dict,
        metadata=_flag(
            "--afd-transport-config",
            "Settings of the transport backend itself, as a JSON object, e.g. "
            '\'{"waits": "device"}\' for slots; an unknown key is refused with the '
            "backend's list.",
            "JSON",
            type=json_object_arg,
        ),
    )
    #: Device of the FFN executors: ``auto`` follows the attention ranks' platform.
    ffn_device: FFNDevice = field(
        default="auto",
        metadata=_flag(
            "--afd-ffn-device",
            "Device of the FFN executors (auto: the attention ranks' platform).",
            choices=get_args(FFNDevice),
        ),
    )
    #: Bound on one FFN round trip before requests fail, in seconds.
    timeout: float = field(
        default=30.0,
        metadata=_flag(
            "--afd-timeout",
            "Bound on one FFN round trip; past it, in-flight requests fail.",
            "SECONDS",
            type=float,
        ),
    )
    #: How long attention ranks wait for a lost FFN rank's replacement; 0 turns failover off.
    failover_timeout: float = field(
        default=60.0,
        metadata=_flag(
            "--afd-failover-timeout",
            "How long in-flight requests wait for a lost FFN rank (died, stopped or wedged) to "
            "be replaced before they fail; 0 turns failover off.",
            "SECONDS",
            type=float,
        ),
    )
    #: Ray cluster address for the FFN group; ``None`` starts a local Ray instance.
    ray_address: str | None = field(
        default=None,
        metadata=_flag(
            "--afd-ray-address",
            "Ray cluster for the FFN group (default: start Ray locally).",
            "HOST:PORT",
        ),
    )
    #: Microbatches per step on attention ranks (ping-pong overlap); 1 disables.
    microbatches: int = field(
        default=2,
        metadata=_flag(
            "--afd-microbatches",
            "Microbatches per decode step for ping-pong overlap of attention and FFN (1 disables).",
            "K",
            type=int,
        ),
    )
    #: The group file of a running ``vllm-afd ffn-server`` to join instead of starting a group.
    join: str | None = field(
        default=None,
        metadata=_flag(
            "--afd-join",
            "Turn AFD on by joining the FFN group a `vllm-afd ffn-server` runs (the group file "
            "it printed) instead of starting one; this front-end's attention ranks are its own "
            "data x tensor parallel ranks. Not with --afd-ratio.",
            "GROUP_FILE",
        ),
    )

    #: Let the planner in the loop change the FFN rank count live (``placement.autoscale``).
    autoscale: bool = field(
        default=False,
        metadata=_flag(
            "--afd-autoscale",
            "Apply the planner's recommended FFN rank count live, for the batch and context "
            "the attention ranks measure (on the CPU build it needs the planner's inputs: "
            "VLLM_AFD_PLAN_PROFILE, a profile `vllm-afd profile` wrote).",
            action="store_true",
        ),
    )
    #: Least time between two scales --afd-autoscale makes; it measures over windows of
    #: ``min(10, interval / 3)`` seconds.
    autoscale_interval: float = field(
        default=120.0,
        metadata=_flag(
            "--afd-autoscale-interval",
            "Least time between two scales --afd-autoscale makes.",
            "SECONDS",
            type=float,
        ),
    )
    #: Hysteresis of --afd-autoscale: the predicted gain a new FFN rank count must promise.
    autoscale_margin: float = field(
        default=0.1,
        metadata=_flag(
            "--afd-autoscale-margin",
            "Hysteresis of --afd-autoscale: the gain in predicted tokens/s per device (0.1 is "
            "a tenth) a new FFN rank count must promise, in two windows in a row, to be applied.",
            "FRACTION",
            type=float,
        ),
    )

    def __post_init__(self) -> None:
        try:
            _transport_arg(self.transport)
        except argparse.ArgumentTypeError as exc:
            raise AFDConfigError(f"{_where('transport')}: {exc}") from None
        from vllm_afd.transport import Feature, backend

        if not isinstance(self.transport_config, dict):
            raise AFDConfigError(
                f"{_where('transport_config')}: expected a JSON object, got "
                f"{self.transport_config!r}"
            )
        if self.transport != AUTO_TRANSPORT:
            problem = backend(self.transport).config_problem(self.transport_config)
        elif self.transport_config:
            problem = "settings need a named backend (--afd-transport), not auto"
        else:
            problem = None
        if problem:
            raise AFDConfigError(f"{_where('transport_config')}: {problem}")
        devices = get_args(FFNDevice)
        if self.ffn_device not in devices:
            raise AFDConfigError(
                f"{_where('ffn_device')}: {self.ffn_device!r}; allowed: {', '.join(devices)}"
            )
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise AFDConfigError(
                f"{_where('timeout')}: must be a finite number of seconds > 0, got {self.timeout}"
            )
        if not (self.failover_timeout >= 0 and math.isfinite(self.failover_timeout)):
            raise AFDConfigError(
                f"{_where('failover_timeout')}: must be a finite number of seconds >= 0 (0: no "
                f"failover), got {self.failover_timeout}"
            )
        if not (self.autoscale_interval > 0 and math.isfinite(self.autoscale_interval)):
            raise AFDConfigError(
                f"{_where('autoscale_interval')}: must be a finite number of seconds > 0, got "
                f"{self.autoscale_interval}"
            )
        if not (0 <= self.autoscale_margin < 10):
            raise AFDConfigError(
                f"{_where('autoscale_margin')}: must be a fraction in [0, 10), got "
                f"{self.autoscale_margin}"
            )
        if self.autoscale and self.join is not None:
            raise AFDConfigError(
                f"{_where('autoscale')}: not with {_where('join')}; the FFN group belongs to "
                "the `vllm-afd ffn-server` that runs it"
            )
        if self.autoscale and self.transport != AUTO_TRANSPORT:
            features = backend(self.transport).features(self.transport_config)
            if Feature.LIVE_SCALING not in features:
                raise AFDConfigError(
                    f"{_where('autoscale')}: the {self.transport} transport cannot change its "
                    "FFN rank count live"
                )
        if not 1 <= self.microbatches <= MAX_MICROBATCHES:
            raise AFDConfigError(
                f"{_where('microbatches')}: must be an integer in 1..{MAX_MICROBATCHES}, "
                f"got {self.microbatches}"
            )

    @classmethod
    def of(cls, vllm_config: Any) -> AFDConfig | None:
        """The AFD settings of a ``VllmConfig`` (or ``EngineArgs``); ``None`` when AFD is off.

        The one reader of ``additional_config["afd"]``: every process (front-end, engine
        cores, workers) gets its settings through here.
        """
        raw = afd_section(vllm_config.additional_config)
        return None if raw is None else cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AFDConfig:
        """Build from ``additional_config["afd"]`` (all values may be strings)."""
        raw = _renamed_keys(raw)
        retired = sorted(set(raw) & set(RETIRED_KEYS))
        if retired:
            raise AFDConfigError(f"additional_config.afd.{retired[0]}: {RETIRED_KEYS[retired[0]]}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise AFDConfigError(
                f"additional_config.afd: unknown key(s) {unknown}; allowed: {sorted(known)}"
            )
        if raw.get("join") is not None:
            if raw.get("ratio") is not None:
                raise AFDConfigError(
                    f"{_where('join')} and {_where('ratio')}: give one; a front-end that joins "
                    "an FFN group serves with that group's FFN ranks"
                )
        elif "ratio" not in raw:
            raise AFDConfigError(f"{_where('ratio')}: required when AFD is configured")
        kwargs: dict[str, Any] = dict(raw)
        kwargs["ratio"] = None if raw.get("join") is not None else parse_ratio(raw["ratio"])
        for key, typ in (
            ("timeout", float),
            ("failover_timeout", float),
            ("microbatches", int),
            ("autoscale", boolean),
            ("autoscale_interval", float),
            ("autoscale_margin", float),
        ):
            if key in kwargs:
                kwargs[key] = _coerce(key, kwargs[key], typ)
        if isinstance(kwargs.get("transport_config"), str):
            try:
                kwargs["transport_config"] = json_object_arg(kwargs["transport_config"])
            except argparse.ArgumentTypeError as exc:
                raise AFDConfigError(f"{_where('transport_config')}: {exc}") from None
        return cls(**kwargs)

    @property
    def ray_is_local(self) -> bool:
        """The FFN group runs in a Ray instance on this machine (no cluster address given)."""
        return self.ray_address in LOCAL_RAY

    def to_dict(self) -> dict[str, Any]:
        """Inverse of ``from_dict`` (JSON-serialisable)."""
        out = dataclasses.asdict(self)
        out["ratio"] = "auto" if self.ratio is None else f"{self.ratio[0]}:{self.ratio[1]}"
        if self.join is not None:
            del out["ratio"]
        return out

    def num_ffn_ranks(self, attention_ranks: int) -> int:
        """FFN ranks for ``attention_ranks`` engine ranks; raises if not a whole number."""
        if self.ratio is None:
            raise AFDConfigError(f"{_where('ratio')}: 'auto' must be resolved before placement")
        attn, ffn = self.ratio
        if (attention_ranks * ffn) % attn != 0:
            raise AFDConfigError(
                f"{_where('ratio')}: {attn}:{ffn} does not divide the {attention_ranks} attention "
                f"rank(s) (data parallel x tensor parallel); the attention rank count must be a "
                f"multiple of {attn // math.gcd(attn, ffn)}, e.g. --data-parallel-size {attn}"
            )
        return attention_ranks * ffn // attn


#: Keys renamed to their flag's name: old key -> new key (the old ones are still taken).
RENAMED_KEYS = {"timeout_s": "timeout", "failover_s": "failover_timeout"}
#: Keys of retired settings: key -> what to do instead (refused with that advice).
RETIRED_KEYS = {
    "ffn_host": "--afd-ffn-host went with the tcp transport; across hosts --afd-transport nixl "
    "takes its interface from UCX_NET_DEVICES (docs/operations.md)",
}


def _renamed_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the old keys of ``RENAMED_KEYS`` under their new names (with a warning)."""
    out = dict(raw)
    for old, new in RENAMED_KEYS.items():
        if old not in out:
            continue
        if new in out:
            raise AFDConfigError(
                f"additional_config.afd.{old} and {_where(new)}: give one ({old} is the old "
                f"name of {new})"
            )
        logger.warning(
            "additional_config.afd.%s is now %s, the name of its flag %s; the old key is "
            "still taken",
            old,
            new,
            _KEY_FLAGS[new],
        )
        out[new] = out.pop(old)
    return out


#: Flag name -> additional_config key (derived from the fields' metadata).
FLAG_KEYS: dict[str, str] = {
    f.metadata["flag"]: f.name for f in dataclasses.fields(AFDConfig) if "flag" in f.metadata
}
_KEY_FLAGS = {v: k for k, v in FLAG_KEYS.items()}


def _where(key: str) -> str:
    return f"{_KEY_FLAGS.get(key, key)} (additional_config.afd.{key})"


def flag_table() -> list[tuple[str, str, str]]:
    """``(flag and metavar, default, help)`` per AFD flag: the README table's rows."""
    rows = []
    for f in dataclasses.fields(AFDConfig):
        meta = f.metadata
        choices = _choices(f)
        value = meta["metavar"] or ("{" + ",".join(choices) + "}" if choices else "")
        default = "" if f.default is dataclasses.MISSING or f.default is None else str(f.default)
        rows.append((f"{meta['flag']} {value}".strip(), default, meta["help"]))
    return rows


def _choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The values a flag's help shows: its declared choices, the registered backends for the
    transport (an open set: a module path is also taken)."""
    if f.name == "transport":
        from vllm_afd.transport import available_transports

        return (AUTO_TRANSPORT, *available_transports())
    return f.metadata.get("choices")


class UnsetParallelSize(int):
    """``--data-parallel-size`` when the user gave none (1, as vLLM's default): ``--afd-ratio
    7:1`` alone widens it to 7 attention ranks, while a 1 the user gave (a plain ``int``: the
    flag, or a config file's key) is kept, and checked against the ratio like any other."""


def add_afd_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "AFD" argument group to a vLLM engine-args parser (idempotent).

    A flag not given sets nothing (``argparse.SUPPRESS``), so that only the flags a user gave reach
    ``additional_config["afd"]``; the defaults live in ``AFDConfig`` and are shown in the help.
    """
    if any(getattr(a, "dest", None) == "afd_ratio" for a in parser._actions):
        return
    if any(getattr(a, "dest", None) == "data_parallel_size" for a in parser._actions):
        parser.set_defaults(data_parallel_size=UnsetParallelSize(1))
    group = parser.add_argument_group(
        "AFD",
        "Attention-FFN Disaggregation (vllm-afd). Off unless --afd-ratio or --afd-join is given.",
    )
    for f in dataclasses.fields(AFDConfig):
        meta = {k: v for k, v in f.metadata.items() if v is not None}
        flag, help_text = meta.pop("flag"), meta.pop("help")
        if f.default not in (dataclasses.MISSING, None):
            help_text += f" (default {f.default})"
        # SUPPRESS: a flag not given leaves no attribute (read as "not given"), and argparse's
        # help formatter adds no "(default: None)" next to the real default above
        group.add_argument(flag, default=argparse.SUPPRESS, help=help_text, **meta)


def afd_flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The AFD flags that were given, as additional_config keys."""
    out = {}
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None:
            out[key] = value
    return out


def merge_afd_flags(args: argparse.Namespace, engine_args: Any) -> None:
    """Fold the AFD flags into ``engine_args.additional_config["afd"]``."""
    flags = afd_flags_from_args(args)
    if not flags:
        return
    if "ratio" not in flags and "join" not in flags:
        given = [flag for flag, key in FLAG_KEYS.items() if key in flags]
        raise AFDConfigError(
            f"--afd-ratio (or --afd-join) is required with {', '.join(given)}; AFD is off "
            "without it"
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


@dataclass(frozen=True)
class MoEModelInfo:
    """What the AFD split needs to know about a model, read from its HF config."""

    architecture: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    #: Indices of the layers that have routed experts.
    moe_layers: tuple[int, ...] = field(default_factory=tuple)

    def check_ffn_ranks(self, num_ffn_ranks: int) -> None:
        problem = ffn_ranks_problem(self.num_experts, num_ffn_ranks)
        if problem is not None:
            raise AFDConfigError(f"{_where('ratio')}: {problem}")


def ffn_ranks_problem(num_experts: int, num_ffn_ranks: int) -> str | None:
    """Why ``num_ffn_ranks`` FFN ranks cannot hold ``num_experts`` routed experts, or ``None``.
    The one rule of what serve, ``POST /afd/scale``, ``vllm-afd plan``, ``--afd-ratio auto``
    and the advisor consider: each FFN rank holds an equal share of the experts."""
    if num_ffn_ranks < 1:
        return f"{num_ffn_ranks} FFN ranks: at least 1"
    if num_ffn_ranks > num_experts:
        return (
            f"{num_ffn_ranks} FFN ranks but the model has only {num_experts} routed experts; "
            f"use at most {num_experts} FFN ranks"
        )
    if num_experts % num_ffn_ranks:
        allowed = [f for f in range(1, min(num_experts, 64) + 1) if num_experts % f == 0]
        return (
            f"{num_experts} routed experts cannot be split evenly over {num_ffn_ranks} FFN "
            f"ranks; the FFN rank count must divide {num_experts} ({', '.join(map(str, allowed))}"
            f"{', ...' if num_experts > 64 else ''})"
        )
    return None


def _coerce(key: str, value: Any, typ: Callable[[Any], Any]) -> Any:
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise AFDConfigError(f"{_where(key)}: {value!r} is not a {typ.__name__}") from None


def boolean(value: Any) -> bool:
    """A JSON boolean, or its text (``additional_config`` values may be strings)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(value)
    return text == "true"


#: The config.json keys that give the routed-expert count, by model family (the first set wins).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")


def moe_model_info(hf_config: Any) -> MoEModelInfo:
    """Extract routed-expert geometry from a transformers config; raise if there is none."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    get = lambda k: getattr(text_config, k, None)  # noqa: E731
    num_experts = next((get(k) for k in EXPERT_KEYS if get(k)), None)
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if not num_experts:
        raise AFDConfigError(
            f"{_where('ratio')}: model {arch} has no routed experts (none of "
            f"{', '.join(EXPERT_KEYS)} is set in its config.json); AFD splits MoE layers only"
        )
    num_layers = int(get("num_hidden_layers"))
    return MoEModelInfo(
        architecture=arch,
        num_layers=num_layers,
        num_experts=int(num_experts),
        top_k=int(get("num_experts_per_tok") or get("moe_topk") or 1),
        hidden_size=int(get("hidden_size")),
        moe_intermediate_size=int(next(get(k) for k in _INTERMEDIATE_KEYS if get(k))),
        moe_layers=moe_layer_indices(get, num_layers),
    )


def moe_layer_indices(get: Callable[[str], Any], num_layers: int) -> tuple[int, ...]:
    """The layers with routed experts, from a config's keys (``get(key)``, ``None`` when
    absent; the planner's reader of config.json uses it too): every layer but the first
    ``first_k_dense_replace``, the ``mlp_only_layers`` and, with a sparse step
    (``decoder_sparse_step`` or ``moe_layer_freq``), the layers off it."""
    dense = set(get("mlp_only_layers") or ())
    first_dense = get("first_k_dense_replace") or 0
    step = get("decoder_sparse_step") or get("moe_layer_freq") or 1
    return tuple(
        i
        for i in range(num_layers)
        if i not in dense and i >= first_dense and isinstance(step, int) and (i + 1) % step == 0
    )


EPLB_REFUSED = (
    "--enable-eplb: not with --afd-ratio: vLLM's expert load balancer moves experts between "
    "expert-parallel ranks, and AFD's FFN ranks hold fixed slices of them; drop --enable-eplb "
    "(a live POST /afd/scale changes the FFN pool instead)"
)


def check_supported(vllm_config: Any) -> None:
    """Raise ``AFDConfigError`` if AFD, as configured, cannot run with this vLLM config.

    The one check of a vLLM config against AFD (front-end, before anything starts, and again
    in each worker that microbatches). A no-op when AFD is off.

    Not refused here: the expert activation (the FFN ranks run the model's own vLLM MoE
    layers, which implement it) and quantized checkpoints. vLLM has already refused, before
    this runs, every format its platform cannot serve (``verify_quantization``, the GPU's
    capability, the dtype); the attention ranks run the non-expert layers as stock vLLM does,
    and the FFN ranks the experts with the layer's own quant method, or, for FP8 experts on a
    platform with no FP8 expert kernel, dequantized (``ffn/weights.py``). A format with no
    expert kernel on the FFN ranks' platform that is not FP8 fails there, naming the format
    and the platform, when the FFN group starts (front-end, before any engine): stock vLLM
    cannot serve it there either.
    """
    afd = AFDConfig.of(vllm_config)
    if afd is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise AFDConfigError(
            "--afd-ratio: pipeline parallelism (--pipeline-parallel-size > 1) is not supported "
            "with AFD; use data or tensor parallelism for the attention ranks"
        )
    if parallel.enable_eplb:
        raise AFDConfigError(EPLB_REFUSED)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _check_gpu_config(vllm_config, afd)
    elif afd.microbatches > 1:
        _check_microbatching(vllm_config)
    _check_kv_transfer(vllm_config, afd)


#: KV connectors whose per-layer hooks (``save_kv_layer``, ``wait_for_layer_load``) are no-ops
#: or idempotent, so that running each attention layer once per ping-pong microbatch (twice
#: per decode step at k = 2, each time with that microbatch's attention metadata) cannot
#: double-send, mis-count layers or save a microbatch's slice as the whole step's. Checked:
#: ExampleConnector (rewrites the same file; tested, tests/e2e/test_pd_e2e.py), Nixl (pulls
#: whole blocks outside the forward), the offloading connectors (save after the step),
#: DecodeBenchConnector and Mooncake (no per-layer work).
MICROBATCH_SAFE_KV_CONNECTORS = frozenset(
    {
        "ExampleConnector",
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "DecodeBenchConnector",
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
        "MooncakeConnector",
    }
)


def kv_connectors(vllm_config: Any) -> list[str]:
    """The KV connectors of a vLLM config (a MultiConnector's members), empty without one."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(kv, "kv_connector", None)
    if not name:
        return []
    if name != "MultiConnector":
        return [name]
    members = (kv.kv_connector_extra_config or {}).get("connectors", [])
    return [name] + [m.get("kv_connector", "?") for m in members]


def _check_kv_transfer(vllm_config: Any, afd: AFDConfig) -> None:
    """A KV connector (disaggregated prefill/decode, KV offloading) with AFD.

    The connector only touches the attention ranks' KV cache, which AFD leaves to stock vLLM,
    so any connector runs with ``--afd-microbatches 1``; with ping-pong microbatches only the
    connectors whose per-layer hooks tolerate one call per microbatch
    (``MICROBATCH_SAFE_KV_CONNECTORS``).
    """
    names = kv_connectors(vllm_config)
    unsafe = [n for n in names if n not in MICROBATCH_SAFE_KV_CONNECTORS | {"MultiConnector"}]
    if afd.microbatches > 1 and unsafe:
        raise AFDConfigError(
            f"--afd-microbatches (additional_config.afd.microbatches) {afd.microbatches} with "
            f"--kv-transfer-config kv_connector {', '.join(unsafe)}: with ping-pong "
            "microbatches every attention layer runs once per microbatch, and this "
            "connector's per-layer hooks (save_kv_layer, wait_for_layer_load) are not known "
            "to tolerate that; use --afd-microbatches 1 (or one of "
            f"{', '.join(sorted(MICROBATCH_SAFE_KV_CONNECTORS))})"
        )


def check_this_host(afd: AFDConfig) -> None:
    """Raise ``AFDConfigError`` if this machine cannot run ``afd``'s transport
    (``Backend.host_problem``; shm: x86-64 store ordering). Front-end only: other processes
    may run elsewhere."""
    from vllm_afd.transport import backend

    # auto here: a front-end joining a group (which checks that it runs the group's backend)
    transport = None if afd.transport == AUTO_TRANSPORT else backend(afd.transport)
    problem = transport and transport.host_problem()
    if problem:
        raise AFDConfigError(f"{_where('transport')}: {problem}")


def check_gpu_microbatches(afd: AFDConfig) -> None:
    """On GPUs microbatching is vLLM's dual-batch overlap: two microbatches or none."""
    if afd.microbatches > 2:
        raise AFDConfigError(
            f"--afd-microbatches (additional_config.afd.microbatches) {afd.microbatches}: on "
            "GPUs microbatching is vLLM's dual-batch overlap, two microbatches; use 2 or 1"
        )


def _check_gpu_config(vllm_config: Any, afd: AFDConfig) -> None:
    """On GPUs, the config vLLM validated is the one AFD runs: ``deployment.prepare_engine_args``
    set DBO, CUDA graphs without piecewise graphs and the V2 model runner before vLLM built it.
    What vLLM decided itself is checked here: with FULL CUDA graphs the model runner must be
    V2, whose replays patch G1 announces to the FFN ranks (vLLM falls back to V1 when
    ``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature V2 does not run with DBO is on: LoRA,
    speculative decoding, pipeline or context parallelism, multimodal models)."""
    check_gpu_microbatches(afd)
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None:
        return
    if mode.has_piecewise_cudagraphs():
        raise AFDConfigError(
            f"--compilation-config cudagraph_mode {mode.name}: piecewise CUDA graphs would "
            "capture the AFD op without the Python that announces each step to the FFN ranks; "
            "use FULL_DECODE_ONLY (AFD's default) or --enforce-eager"
        )
    if mode.has_full_cudagraphs() and not vllm_config.use_v2_model_runner:
        why = "microbatches" if vllm_config.parallel_config.enable_dbo else "settings"
        raise AFDConfigError(
            f"--afd-ratio: FULL CUDA graphs ({mode.name}) with vLLM's V1 model runner (chosen "
            f"for these {why}: VLLM_USE_V2_MODEL_RUNNER=0, or a feature V2 does not run with "
            "dual-batch overlap): its graph replays would not announce their steps to the FFN "
            "ranks; use --enforce-eager, --afd-microbatches 1, or drop that feature"
        )


def _check_microbatching(vllm_config: Any) -> None:
    model = vllm_config.model_config
    blockers = {
        "the V2 model runner (VLLM_USE_V2_MODEL_RUNNER)": vllm_config.use_v2_model_runner,
        "LoRA": vllm_config.lora_config is not None,
        "multimodal models": model.supports_multimodal_inputs,
        "M-RoPE models": model.uses_mrope,
        "pooling models": model.runner_type == "pooling",
        "pipeline parallelism": vllm_config.parallel_config.pipeline_parallel_size > 1,
    }
    found = [name for name, blocked in blockers.items() if blocked]
    if found:
        raise AFDConfigError(
            f"--afd-microbatches (additional_config.afd.microbatches): microbatching is not "
            f"supported with {', '.join(found)}; use --afd-microbatches 1"
        )
