"""Placement, the Ray side: the cluster (a local instance or a given one), the placement group
sized by the ratio, and one ``FFNRank`` actor (``ffn/rank.py``) per bundle.

One bundle per FFN rank, packed, so that the FFN ranks sit next to the attention ranks the way
the ratio says: ``{"CPU": 1}``; on a given Ray cluster with GPUs ``{"CPU": 1, "GPU": 1}``.
On the local node an FFN rank on a GPU gets GPU ``A + rank`` (``ffn_gpu``), after the ``A``
attention ranks' GPUs, never one of them (Ray would hand out GPU 0 onwards, which vLLM's
engines use). NOT YET RUN ON A GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass

import torch

from vllm_afd.config import AFDConfig, MoEModelInfo
from vllm_afd.errors import AFDConfigError
from vllm_afd.ffn.rank import FFNRank
from vllm_afd.placement.credentials import (
    RAY_AUTH_MODE,
    RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH,
    ffn_runtime_env,
    given_cluster_credentials,
    use_local_ray_credentials,
)
from vllm_afd.transport import TransportSpec

logger = logging.getLogger("vllm.afd")
#: How long an FFN rank (or the placement group) may take to start.
START_TIMEOUT_S = 300.0


@dataclass(eq=False)  # a running group is itself, not its fields (``lifecycle.DRAINING``)
class FFNGroup:
    """A running FFN executor group.

    ``spec`` is the running group's (addresses of the first incarnations; the FFN directory,
    ``spec.directory``, has the current ones); ``launch`` is what each FFN rank is started with
    (requested addresses), kept to start replacements.
    """

    spec: TransportSpec
    actors: list
    infos: list[dict]
    placement_group: object
    owns_ray: bool
    launch: TransportSpec
    model_dir: str
    device: str
    local: bool = True
    #: Failover's ``failover.Supervisor`` of this group, if failover is on.
    supervisor: object = None
    #: What the front-end asked for (a live scale starts the next pool from it).
    request: GroupRequest | None = None

    def stats(self) -> list[dict]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors], timeout=10)

    def start_rank(self, rank: int) -> None:
        """Start a replacement of FFN rank ``rank`` in its bundle and wait until it serves;
        ``actors[rank]`` and ``infos[rank]`` then describe it (``_launch`` starts the first
        ones all at once)."""
        import ray

        actor = new_actor(
            self.placement_group, rank, self.launch, self.model_dir, self.device, self.local
        )
        try:
            info = ray.get(actor.info.remote(), timeout=START_TIMEOUT_S)
        except BaseException:
            ray.kill(actor)
            raise
        self.actors[rank], self.infos[rank] = actor, info


@dataclass(frozen=True)
class GroupRequest:
    """What a front-end brings to an FFN group, to start one (``lifecycle.start_ffn_group``) or
    to join a running one (``shared.join_ffn_group``)."""

    afd: AFDConfig
    model: MoEModelInfo
    #: The checkpoint's local directory (FFN ranks load their experts from it).
    model_dir: str
    #: This front-end's attention ranks (data parallel x tensor parallel).
    num_attention_ranks: int
    #: Most tokens one attention rank sends in one dispatch (``--max-num-batched-tokens``).
    max_tokens: int
    dtype: torch.dtype
    #: The FFN ranks' device (a group that is joined keeps its own).
    device: str = "cpu"


def check_ray_address(address: str | None) -> None:
    """Fail fast, before anything starts, if a given Ray cluster cannot be reached."""
    if address in (None, "", "local", "auto"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise AFDConfigError(
            f"--afd-ray-address (additional_config.afd.ray_address): {address!r} is not "
            "HOST:PORT (or ray://HOST:PORT); omit it to start Ray locally"
        )
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise AFDConfigError(
            f"--afd-ray-address (additional_config.afd.ray_address): cannot reach Ray at "
            f"{address} ({exc}); check the address or omit the flag to start Ray locally"
        ) from None


def ensure_ray(address: str | None, num_cpus: int) -> bool:
    """Connect to (or start) Ray; returns True if this process started it.

    ``ray.init`` installs its own SIGTERM handler, which would take shutdown away from vLLM's
    (a server's launcher then dies without running its clean-up). The previous handler is put
    back: vLLM shuts down on SIGTERM as usual, and our ``atexit`` stops the FFN group and Ray.
    """
    import ray

    if ray.is_initialized():
        return False
    if address in (None, "", "local"):
        use_local_ray_credentials()
    else:
        given_cluster_credentials()
    # Ray starts workers at nice 15: an FFN rank would starve behind the attention ranks.
    os.environ.setdefault("RAY_worker_niceness", "0")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        if address in (None, "", "local"):
            ray.init(  # "local": always a new instance, never a cluster found on the machine
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                namespace="vllm_afd",
                _node_ip_address="127.0.0.1",
                # no idle worker per logical CPU (``lifecycle._launch`` says why they are many)
                _system_config={"prestart_worker_first_driver": False},
            )
        else:
            ray.init(address=address, namespace="vllm_afd")
    except ray.exceptions.AuthenticationError as exc:
        raise AFDConfigError(
            f"--afd-ray-address (additional_config.afd.ray_address): the Ray cluster at "
            f"{address} refused this client ({exc}); give its token with "
            f"{RAY_AUTH_TOKEN_PATH} (a file) or {RAY_AUTH_TOKEN}, and {RAY_AUTH_MODE}=token"
        ) from None
    finally:
        if in_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return True


def ffn_bundle(device: str, local: bool) -> dict[str, float]:
    """One FFN rank's placement bundle: a CPU, and a GPU Ray assigns when the ranks run on a
    given cluster; on the local node the FFN ranks' GPUs are chosen by rank (``ffn_gpu``)."""
    return {"CPU": 1, "GPU": 1} if device == "cuda" and not local else {"CPU": 1}


def ffn_gpu(spec: TransportSpec, rank: int) -> int:
    """The GPU of FFN rank ``rank`` on the local node: the first after the attention ranks'
    (vLLM's engines take GPUs ``0..A-1``), so that the two never share one (``A + F`` GPUs
    are checked before start: ``deployment.check_devices``)."""
    return spec.num_attention_ranks + rank


def gpu_env(spec: TransportSpec, rank: int, device: str, local: bool) -> dict[str, str]:
    """The variables that give a local FFN rank its own GPU (Ray would otherwise hand out
    GPU 0 onwards, which vLLM's engines use, and reset ``CUDA_VISIBLE_DEVICES``)."""
    if device != "cuda" or not local:
        return {}
    return {
        "CUDA_VISIBLE_DEVICES": str(ffn_gpu(spec, rank)),
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }


def new_actor(pg, rank: int, launch: TransportSpec, model_dir: str, device: str, local: bool):
    """An ``FFNRank`` actor for ``rank`` in bundle ``rank`` of the placement group."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = ffn_bundle(device, local)
    env = {**ffn_runtime_env(), **gpu_env(launch, rank, device, local)}
    return (
        ray.remote(FFNRank)
        .options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank
            ),
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            runtime_env={"env_vars": env},
            name=None,
            max_restarts=0,  # replacements are the supervisor's (``Supervisor``)
        )
        .remote(launch.to_json(), rank, model_dir, device)
    )


def log_rank_up(info: dict) -> None:
    logger.info(
        "AFD: FFN rank %d up: pid %d on %s, experts [%d, %d), %.2f MiB, address %s",
        info["rank"],
        info["pid"],
        info["host"],
        *info["experts"],
        info["param_bytes"] / 2**20,
        _short(info["address"]),
    )


def _short(address: str, keep: int = 72) -> str:
    """``address`` for a log line: a long one (nixl's carries its agent's metadata) cut."""
    return address if len(address) <= keep else f"{address[:keep]}... ({len(address)} chars)"


def wait_ready(ref, timeout: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)
