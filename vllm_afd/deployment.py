"""Deployment: turn a stock ``VllmConfig`` with ``additional_config["afd"]`` into an AFD one.

Runs in the front-end process, inside ``EngineArgs.create_engine_config`` (patch P3), i.e.
after vLLM has validated its own arguments and before any engine core or worker starts. Every
AFD input is validated here first (``check_settings``: the flags, the vLLM config, this host,
the variables and the Ray address), so bad input fails with one
``AFDConfigError`` naming the flag or variable and what is allowed (``vllm-afd serve`` exits 2
with it) and nothing running; then the FFN group is started and its address exported to the
attention ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_afd import envs
from vllm_afd.config import (
    AUTO_TRANSPORT,
    EPLB_REFUSED,
    AFDConfig,
    UnsetParallelSize,
    check_gpu_microbatches,
    check_supported,
    check_this_host,
    moe_model_info,
)
from vllm_afd.errors import AFDConfigError

logger = logging.getLogger("vllm.afd")


def attention_ranks(vllm_config) -> int:
    parallel = vllm_config.parallel_config
    return parallel.data_parallel_size * parallel.tensor_parallel_size


def _ffn_device(afd: AFDConfig) -> str:
    return _attention_device() if afd.ffn_device == "auto" else afd.ffn_device


def checkpoint_dir(model: str) -> str:
    """Local directory of the checkpoint (downloads the safetensors of a hub id if needed)."""
    if Path(model).is_dir():
        return str(Path(model).resolve())
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.safetensors", "*.json"])


def prepare_engine_args(engine_args, usage_context) -> None:
    """Defaults that fit AFD, set before vLLM builds its config from ``engine_args``:

    - ``--afd-transport auto`` becomes the backend for these devices (``_resolve_transport``);
    - on GPUs, what AFD needs of vLLM's config (``_fit_gpu_engine_args``), so that vLLM
      validates the config AFD runs and every engine core's re-validation passes;
    - one flag is enough: ``serve MODEL --afd-ratio 7:1`` gets 7 data-parallel attention
      ranks, when the user gave no data parallel size and tensor parallel size 1 (a
      ``--data-parallel-size 1`` given is kept, and refused by the ratio check),
      for servers only: vLLM's offline ``LLM`` class runs a single engine, where tensor
      parallelism is the way to get several attention ranks.
    """
    afd = AFDConfig.of(engine_args)
    if afd is None:
        return
    if getattr(engine_args, "enable_eplb", False):  # before vLLM's own checks of it
        raise AFDConfigError(EPLB_REFUSED)
    if afd.join is None:  # a joining one takes its group's
        afd = _resolve_transport(afd)
        engine_args.additional_config = {**engine_args.additional_config, "afd": afd.to_dict()}
    if _attention_device() == "cuda":
        _fit_gpu_engine_args(engine_args, afd)
    if engine_args.data_parallel_size != 1 or engine_args.tensor_parallel_size != 1:
        return
    if not isinstance(engine_args.data_parallel_size, UnsetParallelSize):
        return  # --data-parallel-size 1 given: checked against the ratio, not widened
    from vllm.usage.usage_lib import UsageContext

    ratio = afd.ratio
    if ratio is None or ratio[0] == 1 or usage_context == UsageContext.LLM_CLASS:
        return
    engine_args.data_parallel_size = ratio[0]
    logger.info(
        "--afd-ratio %d:%d: %d data-parallel attention ranks (set --data-parallel-size or "
        "--tensor-parallel-size to choose otherwise)",
        ratio[0],
        ratio[1],
        ratio[0],
    )


#: vLLM's switch between its model runners (``VllmConfig.use_v2_model_runner``).
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _fit_gpu_engine_args(engine_args, afd: AFDConfig) -> None:
    """On GPUs, set what AFD needs of vLLM's config before vLLM builds and validates it:

    - ``--afd-microbatches 2`` is vLLM's dual-batch overlap (``--enable-dbo``; more than two
      microbatches is refused): the op's overlap points are DBO's yields and receive hooks;
    - CUDA graphs without piecewise graphs (none given: ``FULL_DECODE_ONLY``): a piecewise
      graph would capture the AFD op inside ``vllm::moe_forward`` without the Python that
      announces each step, a FULL graph's replay is announced by patch G1;
    - the V2 model runner, explicitly (``VLLM_USE_V2_MODEL_RUNNER=1`` unless the user set
      it): with DBO on and the variable unset, vLLM picks the V1 runner silently, whose FULL
      graph replays G1 does not see (``config.check_supported`` refuses that combination).

    vLLM's own check that microbatching runs over a DeepEP/NIXL all-to-all is answered by
    patch M6, in the front-end's validation and every engine core's re-validation alike.
    """
    import os

    from vllm.config.compilation import CUDAGraphMode

    check_gpu_microbatches(afd)
    if afd.microbatches == 2:
        engine_args.enable_dbo = True
    if engine_args.enforce_eager:
        return
    # a CompilationConfig here (EngineArgs converts a dict; its validator parses a mode's name)
    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    fitted = CUDAGraphMode.FULL_DECODE_ONLY if mode is None else mode.without_piecewise()
    if fitted != mode:
        compilation.cudagraph_mode = fitted
        logger.info("AFD: CUDA graphs %s (piecewise graphs would capture the AFD op)", fitted)
    if fitted.has_full_cudagraphs() and os.environ.get(V2_RUNNER_ENV) is None:
        os.environ[V2_RUNNER_ENV] = "1"
        logger.info(
            "AFD: %s=1 (the model runner whose FULL graph replays AFD announces)", V2_RUNNER_ENV
        )


def setup_afd(vllm_config) -> None:
    """Validate AFD settings against the model and layout, then start the FFN group."""
    afd = AFDConfig.of(vllm_config)
    if afd is None:
        return
    check_supported(vllm_config)
    info = moe_model_info(vllm_config.model_config.hf_config)
    ranks = attention_ranks(vllm_config)
    model_dir = checkpoint_dir(vllm_config.model_config.model)
    if afd.join is not None:
        return _join(afd, info, ranks, model_dir, vllm_config)
    if afd.ratio is None:
        afd = _resolve_auto(afd, info, ranks, model_dir, vllm_config)
        vllm_config.additional_config["afd"] = afd.to_dict()
    check_settings(afd, info, ranks)
    if afd.autoscale:  # its planner needs inputs (the CPU build has no default)
        from vllm_afd.planner.auto_ratio import planner_inputs

        try:
            planner_inputs(_attention_device() == "cpu", "--afd-autoscale")
        except ValueError as exc:
            raise AFDConfigError(f"--afd-autoscale: {exc}") from None
    check_devices(afd, ranks, _attention_device())
    from vllm_afd.placement.credentials import check_admin_token_file

    check_admin_token_file()  # the operator's, if given: before anything starts
    log_kv_transfer_requirements(vllm_config)
    from vllm_afd.placement import start_ffn_group

    group = start_ffn_group(_group_request(afd, info, ranks, model_dir, vllm_config))
    _export_front_end(vllm_config, info, ranks, model_dir, first_attention_rank=0)
    from vllm_afd.placement.autoscale import Deployment, start_advisor

    on_cpu, draft = _attention_device() == "cpu", _draft_length(vllm_config)
    start_advisor(Deployment(info, ranks, model_dir, on_cpu, draft, afd.microbatches), afd)
    logger.info(
        "AFD on: %d attention rank(s) : %d FFN rank(s), transport %s",
        ranks,
        group.spec.num_ffn_ranks,
        group.spec.backend,
    )


def _resolve_transport(afd: AFDConfig) -> AFDConfig:
    """``--afd-transport auto``: the backend for these devices on this machine
    (``transport.auto_backend``), and the backend's settings as it runs them here
    (``Backend.resolve_settings``), written back so every process gets the same."""
    from vllm_afd.transport import auto_backend, backend

    attention, ffn = _attention_device(), _ffn_device(afd)
    name = afd.transport
    if name == AUTO_TRANSPORT:
        try:
            name = auto_backend(attention, ffn, across_hosts=not afd.ray_is_local)
        except ValueError as exc:
            raise AFDConfigError(
                f"--afd-transport (additional_config.afd.transport) auto: {exc}"
            ) from None
        logger.info(
            "AFD: --afd-transport auto -> %s (%s attention ranks, %s FFN ranks)",
            name,
            attention,
            ffn,
        )
    settings = backend(name).resolve_settings(afd.transport_config, attention)
    return dataclasses.replace(afd, transport=name, transport_config=settings)


def _join(afd: AFDConfig, info, ranks: int, model_dir: str, vllm_config) -> None:
    """``--afd-join``: this front-end's attention ranks join a running FFN group."""
    from vllm_afd.placement import join_ffn_group
    from vllm_afd.placement.credentials import check_admin_token_file

    check_this_host(afd)
    check_admin_token_file()
    log_kv_transfer_requirements(vllm_config)
    spec = join_ffn_group(_group_request(afd, info, ranks, model_dir, vllm_config))
    _export_front_end(vllm_config, info, ranks, model_dir, spec.attention_rank_offset)
    logger.info(
        "AFD on: %d attention rank(s) joined a group of %d FFN rank(s), transport %s",
        ranks,
        spec.num_ffn_ranks,
        spec.backend,
    )


def _export_front_end(
    vllm_config, info, ranks: int, model_dir: str, first_attention_rank: int
) -> None:
    """``VLLM_AFD_FRONT_END`` and the admin token (``credentials.prepare_admin_token``) for
    this front-end's API server processes (they inherit both)."""
    from vllm_afd.placement.credentials import prepare_admin_token, set_env

    logger.info(
        "AFD: admin calls (POST /afd/scale, the full /afd/status) take the bearer token in %s "
        "(readable by this user only) or the server's --api-key",
        prepare_admin_token(),
    )
    set_env(
        envs.FRONT_END,
        json.dumps(front_end_facts(vllm_config, info, ranks, model_dir, first_attention_rank)),
    )


def front_end_facts(
    vllm_config, info, ranks: int, model_dir: str, first_attention_rank: int
) -> dict[str, Any]:
    """vLLM's labels for the AFD series (``metrics.collector.metric_labels``) and the planner's
    recommendation for this deployment (``recommend``; ``{"error": ...}`` when it has none)."""
    from vllm_afd.metrics.collector import metric_labels

    try:
        attn, ffn, line = recommend(
            vllm_config, info, ranks, model_dir, "the planner's recommendation"
        )
        recommendation = {"ratio": f"{attn}:{ffn}", "prediction": line}
    except (AFDConfigError, ValueError, OSError) as exc:
        recommendation = {"error": str(exc)}
    labels = metric_labels(vllm_config, first_attention_rank, ranks)
    return {**dataclasses.asdict(labels), "recommendation": recommendation}


def _group_request(afd: AFDConfig, info, ranks: int, model_dir: str, vllm_config):
    """What this front-end brings to its FFN group (``placement.GroupRequest``)."""
    from vllm_afd.placement import GroupRequest

    return GroupRequest(
        afd,
        info,
        model_dir,
        ranks,
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        dtype=vllm_config.model_config.dtype,
        device=_ffn_device(afd),
    )


def _attention_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def check_devices(
    afd: AFDConfig,
    ranks: int,
    attention_device: str,
    gpus_on_node: int | None = None,
    peer_access: Callable[[int, int], bool] | None = None,
) -> None:
    """Refuse, before anything starts, a deployment its devices cannot run (the GPU path):

    - what the transport cannot connect (``Backend.device_problem``: shm with a CUDA model,
      whose hidden states it would move through host memory; nixl on GPUs, not built; the slot
      plane across two kinds of memory);
    - with a local Ray instance, attention ranks and FFN ranks on GPUs that do not fit the
      node's GPUs side by side (``A + F``: the FFN ranks get GPUs of their own,
      ``placement.ffn_gpu``), and for a transport that maps the peer's device memory
      (``Backend.maps_peer_gpu_memory``: the slot plane) an attention GPU without peer access
      to an FFN GPU (no NVLink or PCIe P2P between them: CUDA IPC would fail at the first
      step, or not at all and crawl through host memory).

    ``gpus_on_node`` and ``peer_access(a, b)`` default to this machine's (NVML's answer; tests
    pass them; without CUDA there is no peer access to check).
    """
    from vllm_afd.transport import backend

    transport = backend(afd.transport)
    ffn_device = _ffn_device(afd)
    num_ffn = afd.num_ffn_ranks(ranks)
    problem = transport.device_problem(attention_device, ffn_device)
    if problem is not None:
        raise AFDConfigError(f"--afd-transport (additional_config.afd.transport) {problem}")
    if ffn_device == "cuda" and afd.ray_is_local:
        if gpus_on_node is None:
            import torch

            gpus_on_node = torch.cuda.device_count()
        if ranks + num_ffn > gpus_on_node:
            raise AFDConfigError(
                f"--afd-ratio (additional_config.afd.ratio): {ranks} attention rank(s) and "
                f"{num_ffn} FFN rank(s) need {ranks + num_ffn} GPUs of their own, this node has "
                f"{gpus_on_node}; use fewer ranks, or --afd-ray-address to place the FFN ranks "
                "on other nodes"
            )
        if attention_device == "cuda" and transport.maps_peer_gpu_memory:
            _check_peer_access(afd, ranks, num_ffn, peer_access)


def _check_peer_access(
    afd: AFDConfig, ranks: int, num_ffn: int, peer_access: Callable[[int, int], bool] | None
) -> None:
    """``check_devices``: every attention GPU (``0..A-1``) reaches every FFN GPU (``A + r``)."""
    if peer_access is None:
        import torch

        if not torch.cuda.is_available():
            return
        peer_access = _nvml_peer_access
    for a in range(ranks):
        for f in range(ranks, ranks + num_ffn):
            if not peer_access(a, f):
                raise AFDConfigError(
                    f"--afd-transport (additional_config.afd.transport) {afd.transport}: "
                    f"attention GPU {a} has no peer access to FFN GPU {f} (no NVLink or PCIe "
                    "P2P between them), and the slot plane maps each side's device memory into "
                    "the other's; enable P2P (nvidia-smi topo -p2p r), or use fewer ranks"
                )


def _nvml_peer_access(a: int, b: int) -> bool:
    """Whether GPU ``a`` reads GPU ``b``'s memory directly (NVLink or PCIe P2P), asked of NVML
    as vLLM asks it for its custom all-reduce: the front-end creates no CUDA context (which
    ``torch.cuda.can_device_access_peer`` would, on both GPUs, before vLLM's engines)."""
    import pynvml
    from vllm.platforms import current_platform

    pynvml.nvmlInit()
    try:
        handles = [
            pynvml.nvmlDeviceGetHandleByIndex(current_platform.device_id_to_physical_device_id(i))
            for i in (a, b)
        ]
        status = pynvml.nvmlDeviceGetP2PStatus(*handles, pynvml.NVML_P2P_CAPS_INDEX_READ)
        return bool(status == pynvml.NVML_P2P_STATUS_OK)
    finally:
        pynvml.nvmlShutdown()


def check_settings(afd: AFDConfig, info, ranks: int) -> None:
    """Every check of a resolved configuration that needs no engine and starts nothing: the
    FFN rank count against the model, this host, the ``VLLM_AFD_*`` variables (against the
    timeout and, with a local Ray instance, this machine's CPUs) and the Ray address."""
    from vllm_afd.placement import check_ray_address

    num_ffn = afd.num_ffn_ranks(ranks)
    info.check_ffn_ranks(num_ffn)
    check_this_host(afd)
    envs.check_all(num_ffn, timeout_s=afd.timeout, local=afd.ray_is_local)
    check_ray_address(afd.ray_address)


def log_kv_transfer_requirements(vllm_config) -> None:
    """With a KV connector (disaggregated prefill/decode), warn what the other side must share.

    AFD changes nothing in the attention ranks' KV cache, so a stock vLLM prefill instance
    hands its KV to an AFD decode instance (and back) through vLLM's own connectors; but
    nothing checks, at start-up, that the two instances agree, and a mismatch shows only as
    wrong tokens or a failed load at the first transfer.
    """
    kv = getattr(vllm_config, "kv_transfer_config", None)
    connector = getattr(kv, "kv_connector", None)
    if not connector:
        return
    role = kv.kv_role or "kv_both"
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    side = "prefill" if role == "kv_producer" else "decode"
    other = "decode" if side == "prefill" else "prefill"
    must = [
        f"the model ({model.model}, same weights, revision and tokenizer)",
        f"--dtype {str(model.dtype).removeprefix('torch.')}",
        f"--kv-cache-dtype {cache.cache_dtype}",
        f"--block-size {cache.block_size}",
        "the KV layout (the same attention backend and platform, or a connector that converts)",
        f"--max-model-len >= {model.max_model_len} (the prompts this instance accepts)",
    ]
    if connector == "ExampleConnector":
        extra = kv.kv_connector_extra_config or {}
        must += [
            f"shared_storage_path {extra.get('shared_storage_path', '/tmp')}",
            f"--tensor-parallel-size {vllm_config.parallel_config.tensor_parallel_size}",
            "each prompt scheduled whole on the prefill side (--max-num-batched-tokens >= the "
            "longest prompt: ExampleConnector saves a request's first scheduled chunk only)",
        ]
    elif connector.startswith("Nixl"):
        must.append(f"kv_buffer_device {kv.kv_buffer_device} and a reachable side channel")
    logger.warning(
        "AFD: %s instance of a disaggregated deployment (%s, %s): the %s instances must share "
        "%s. vLLM checks none of this at start-up.",
        side,
        connector,
        role,
        other,
        "; ".join(must),
    )


def _resolve_auto(afd: AFDConfig, info, ranks: int, model_dir: str, vllm_config) -> AFDConfig:
    """``--afd-ratio auto``: the planner picks the FFN rank count; the prediction is logged."""
    attn, ffn, line = recommend(vllm_config, info, ranks, model_dir)
    logger.info("--afd-ratio auto -> %d:%d (%s)", attn, ffn, line)
    return dataclasses.replace(afd, ratio=(attn, ffn))


def recommend(
    vllm_config, info, ranks: int, model_dir: str, what: str = "--afd-ratio auto"
) -> tuple[int, int, str]:
    """The planner's ``(A, F, one-line prediction)`` for this deployment's attention ranks at
    its batch cap and context (``planner.auto_ratio``; ``AFDConfigError`` naming ``what``
    without planner inputs on the CPU build): what ``--afd-ratio auto`` uses and
    ``/afd/status`` shows."""
    from vllm.platforms import current_platform

    from vllm_afd.planner.auto_ratio import recommend_for_deployment

    return recommend_for_deployment(
        info,
        ranks,
        model_dir,
        context=vllm_config.model_config.max_model_len,
        max_batch=vllm_config.scheduler_config.max_num_seqs,
        platform_is_cpu=current_platform.is_cpu(),
        draft_length=_draft_length(vllm_config),
        microbatches=_microbatches(vllm_config),
        what=what,
    )


def _microbatches(vllm_config) -> int:
    """``--afd-microbatches`` of this deployment: what the advisor plans with too."""
    afd = AFDConfig.of(vllm_config)
    return afd.microbatches if afd is not None else 1


def _draft_length(vllm_config) -> int:
    """Tokens the speculative draft proposes per step (0 without speculative decoding)."""
    speculative = vllm_config.speculative_config
    return 0 if speculative is None else int(speculative.num_speculative_tokens or 0)


def raise_if_ffn_group_dead() -> None:
    """For /health (liveness): raise vLLM's EngineDeadError if an FFN rank of the deployment
    cannot serve and failover is not healing it (``placement.ffn_group_problems``)."""
    from vllm_afd.placement import ffn_group_problems

    problems = [p.text for p in ffn_group_problems() if not p.healing]
    if problems:
        from vllm.v1.engine.exceptions import EngineDeadError

        raise EngineDeadError(f"AFD: {'; '.join(problems)}; requests cannot be served")
