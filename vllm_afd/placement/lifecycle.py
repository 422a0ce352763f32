"""Placement, lifecycle: start and stop the FFN executor group, Ray actors in one placement
group sized by the ratio (``cluster.py``).

The front-end process (``LLM(...)`` or the API server) owns the group: it is started while
vLLM builds its engine config, before any engine or worker process exists, so that the
transport addresses can be handed to every attention rank; and it is stopped with the
front-end (``atexit``, or explicitly by ``stop_ffn_group``). Ray is started locally when no
cluster address is given, and shut down again by whoever started it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import threading

from vllm_afd import envs
from vllm_afd.config import AFDConfig
from vllm_afd.placement import shared
from vllm_afd.placement.cluster import (
    START_TIMEOUT_S,
    FFNGroup,
    GroupRequest,
    check_ray_address,
    ensure_ray,
    ffn_bundle,
    log_rank_up,
    new_actor,
    wait_ready,
)
from vllm_afd.placement.credentials import (
    private_directory,
    release_credentials,
)
from vllm_afd.placement.failover import Supervisor
from vllm_afd.placement.health import (
    drop_ledger,
    keep_ledger,
    reap_dead_deployments,
    reap_once_exited,
)
from vllm_afd.transport import Feature, TransportSpec, backend, directory
from vllm_afd.transport.directory import RankEntry

logger = logging.getLogger("vllm.afd")


#: Held while the process's group changes hands: a start, a live scale's adoption, a stop
#: (re-entrant: a start stops the previous group).
_LOCK = threading.RLock()
_GROUP: FFNGroup | None = None
_GROUP_KEY: str | None = None
#: Pools a live scale replaced (``scaling.py``), from their replacement's adoption until the
#: scale stops them (``stop_replaced``); a stop meanwhile stops them with the group.
DRAINING: list[FFNGroup] = []
#: How long a stop waits for the FFN ranks to stop on their own (``stop_ranks``).
STOP_WAIT_S = 5.0


def start_ffn_group(request: GroupRequest) -> FFNGroup:
    """Start (or reuse, if identical) this process's FFN group and export its address."""
    afd, model, model_dir, device = request.afd, request.model, request.model_dir, request.device
    num_attention_ranks, max_tokens = request.num_attention_ranks, request.max_tokens
    dtype = request.dtype
    global _GROUP, _GROUP_KEY
    num_ffn = afd.num_ffn_ranks(num_attention_ranks)
    model.check_ffn_ranks(num_ffn)
    spec = TransportSpec(
        backend=afd.transport,
        num_attention_ranks=num_attention_ranks,
        num_ffn_ranks=num_ffn,
        num_experts=model.num_experts,
        hidden_size=model.hidden_size,
        top_k=model.top_k,
        max_tokens=max_tokens,
        dtype=dtype,
        num_slots=max(2, afd.microbatches),
        timeout_s=afd.timeout,
        moe_layers=model.moe_layers,
        failover_s=afd.failover_timeout,
        config=afd.transport_config,
    )
    key = json.dumps([spec.to_json(), model_dir, device, afd.ray_address])
    with _LOCK:
        if _GROUP is not None and key == _GROUP_KEY:
            return _GROUP
        stop_ffn_group()
        check_ray_address(afd.ray_address)
        reap_dead_deployments()
        spec = dataclasses.replace(spec, directory=_ffn_directory())
        try:
            _GROUP = _launch(spec, afd, model_dir, device)
        except BaseException:
            release_credentials()
            raise
        _GROUP.request = request
        _GROUP_KEY = key
        supervise(_GROUP)
        keep_ledger(private_directory())
        # The hand-off to every process started from here on (engine cores, workers).
        os.environ[envs.RUNTIME] = _GROUP.spec.to_json()
        return _GROUP


def supervise(group: FFNGroup) -> None:
    """Start failover's supervisor of ``group`` when failover is on (and the backend has it)."""
    spec = group.spec
    if spec.fails_over and Feature.FAILOVER in backend(spec.backend).features(spec.config):
        group.supervisor = Supervisor(group)


def _ffn_directory(epoch: int = 1) -> str:
    """The FFN directory (``transport/directory.py``) of the deployment's ``epoch``-th pool
    (a live scale starts the next: ``scaling.py``), in its private directory."""
    path = os.path.join(private_directory(), "ffn" if epoch == 1 else f"ffn{epoch}")
    os.mkdir(path, 0o700)
    return path


def _launch(spec: TransportSpec, afd: AFDConfig, model_dir: str, device: str) -> FFNGroup:
    """Start the FFN ranks of ``spec`` in a placement group of their own and publish them in
    its FFN directory.

    A local Ray instance runs FFN ranks only. Its logical CPUs (admission, not the cores the
    ranks compute on: ``VLLM_AFD_FFN_CPUS``) admit twice the most FFN ranks the model can
    have (one per routed expert): a live scale starts the new pool next to the running one.
    Ray would start an idle worker per logical CPU for the first driver; it is told not to.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    owns_ray = ensure_ray(afd.ray_address, num_cpus=max(os.cpu_count() or 1, 2 * spec.num_experts))
    local = afd.ray_is_local
    bundle = ffn_bundle(device, local)
    pg = placement_group([dict(bundle) for _ in range(spec.num_ffn_ranks)], strategy="PACK")
    if not wait_ready(pg.ready(), START_TIMEOUT_S):
        remove_placement_group(pg)
        raise RuntimeError(
            f"AFD: Ray could not place {spec.num_ffn_ranks} FFN rank(s) with {bundle} each "
            f"within {START_TIMEOUT_S:.0f}s; check the cluster's free resources"
        )
    group = FFNGroup(spec, [], [], pg, owns_ray, spec, model_dir, device, local)
    group.actors = [
        new_actor(pg, r, spec, model_dir, device, local) for r in range(spec.num_ffn_ranks)
    ]
    try:
        group.infos = ray.get([a.info.remote() for a in group.actors], timeout=START_TIMEOUT_S)
    except Exception:
        for a in group.actors:
            ray.kill(a)
        remove_placement_group(pg)
        if owns_ray:
            ray.shutdown()
        raise
    group.spec = dataclasses.replace(spec, addresses=tuple(i["address"] for i in group.infos))
    for info in group.infos:
        log_rank_up(info)
        directory.publish(
            spec.directory,
            RankEntry(info["rank"], 1, directory.UP, info["address"], info["host"], info["pid"]),
        )
    return group


def current_group() -> FFNGroup | None:
    return _GROUP


def adopt(pool: FFNGroup, replacing: FFNGroup) -> bool:
    """A live scale's new pool (``scaling.py``) becomes this process's FFN group in place of
    ``replacing``: it takes over the Ray instance the old one owned, and the runtime spec that
    ``/afd/status``, ``/metrics`` and ``/health`` read. The old pool is the scale's to stop; an
    identical request for a group starts a new one (the running size is not the one asked for).

    False, and nothing adopted, when ``replacing`` is no longer the group: the front-end
    stopped it (``stop_ffn_group``, at shutdown) while the new pool started, and the scale
    must stop the new pool itself."""
    global _GROUP, _GROUP_KEY
    with _LOCK:
        if _GROUP is not replacing:
            return False
        _GROUP, _GROUP_KEY = pool, None
        pool.owns_ray, replacing.owns_ray = replacing.owns_ray, False
        DRAINING.append(replacing)
        os.environ[envs.RUNTIME] = pool.spec.to_json()
        return True


def stop_replaced(pool: FFNGroup) -> None:
    """Take the replaced ``pool`` off ``DRAINING`` and stop it, unless a stop of the group took
    it (and stops it) already."""
    with _LOCK:
        if pool not in DRAINING:
            return
        DRAINING.remove(pool)
    stop_pool(pool)


def stop_pool(pool: FFNGroup) -> None:
    """``stop_ranks``, then the segments of the ranks whose stop did not complete, once they
    exited (``_reap_unstopped``)."""
    _reap_unstopped(stop_ranks(pool))


def stop_ffn_group() -> None:
    """Stop this process's FFN group (and the local Ray it started). Idempotent."""
    global _GROUP, _GROUP_KEY
    with _LOCK:  # a live scale adopts its new pool before this, or not at all
        group, _GROUP, _GROUP_KEY = _GROUP, None, None
        replaced, DRAINING[:] = list(DRAINING), []
        os.environ.pop(envs.RUNTIME, None)
    drop_ledger()
    shared.leave_group()  # a front-end that joined a group leaves it running
    if group is None:
        release_credentials()
        return
    unstopped = [pid for pool in (*replaced, group) for pid in stop_ranks(pool)]
    if group.owns_ray:
        import ray

        ray.shutdown()
    _reap_unstopped(unstopped)
    release_credentials()


def _returned(ref: object) -> bool:
    """The remote call ``ref`` (done) returned, not raised (its actor died meanwhile)."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return True
    except Exception:  # noqa: BLE001 - any failure: the stop did not run through
        return False


def _reap_unstopped(pids: list[int]) -> None:
    """Unlink the segments of this host's FFN ranks ``pids`` whose stop did not complete, once
    they exited (``health.reap_once_exited``: Ray ended them, their raylet dead)."""
    if pids:
        reaped = reap_once_exited(pids, STOP_WAIT_S)
        logger.info(
            "AFD: %d FFN rank(s) ended without their stop; removed %d segment(s) of dead "
            "processes from /dev/shm",
            len(pids),
            len(reaped),
        )


def stop_ranks(group: FFNGroup) -> list[int]:
    """Stop ``group``'s supervisor, FFN ranks and placement group, and unlink its ranks' stats
    blocks (the front-end's Ray and credentials stay), within about ``STOP_WAIT_S`` plus the
    supervisor's: a stop runs at the front-end's exit, where a rank, Ray's raylet or both may
    have died already (a signal to the whole process group), and a Ray call without a bound
    would keep the front-end, and through it Ray's daemons, alive. A group that owns its Ray
    leaves its placement group to ``ray.shutdown`` (removing it waits on the raylet). With Ray
    shut down already (a stop of the group overtook a live scale) the actors and placement
    group went with it: only the blocks are left to unlink (an actor call would start a new
    Ray). Returns the pids of this host's ranks whose stop did not complete (their segments
    stay: ``_reap_unstopped``)."""
    if group.supervisor is not None:
        group.supervisor.stop()  # before the ranks: no replacement may start meanwhile
    import ray
    from ray.util.placement_group import remove_placement_group

    stopped: set[int] = set()  # ranks whose stop completed
    if ray.is_initialized():
        stops = {}
        for rank, actor in enumerate(group.actors):
            try:
                stops[actor.stop.remote()] = rank
            except Exception:  # noqa: BLE001 - best effort: the actor may be dead already
                pass
        try:
            if stops:
                done, _ = ray.wait(list(stops), num_returns=len(stops), timeout=STOP_WAIT_S)
                stopped = {stops[ref] for ref in done if _returned(ref)}
        except Exception:  # noqa: BLE001 - best effort: Ray may be shutting down
            pass
        for actor in group.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort: Ray may be shutting down
                pass
        if not group.owns_ray:
            try:
                remove_placement_group(group.placement_group)
            except Exception:  # noqa: BLE001
                pass
    from vllm_afd.metrics.blocks import unlink_deployment_blocks

    unlink_deployment_blocks(group.spec)
    host = socket.gethostname()
    return [
        info["pid"]
        for rank, info in enumerate(group.infos)
        if rank not in stopped and info["host"] == host
    ]


atexit.register(stop_ffn_group)
