"""Placement: the FFN executor group as Ray actors in one placement group sized by the ratio.

The front-end process (``LLM(...)`` or the API server) owns the group: it is started while
vLLM builds its engine config, before any engine or worker process exists, so that the
transport addresses can be handed to every attention rank; and it is stopped with the
front-end (``atexit``, or explicitly by ``stop_ffn_group``). Ray is started locally when no
cluster address is given, and shut down again by whoever started it.

One bundle per FFN rank, packed, so that the FFN ranks sit next to the attention ranks the way
the ratio says: ``{"CPU": 1}``; on a given Ray cluster with GPUs ``{"CPU": 1, "GPU": 1}``.
On the local node an FFN rank on a GPU gets GPU ``A + rank`` (``ffn_gpu``), after the ``A``
attention ranks' GPUs, never one of them (Ray would hand out GPU 0 onwards, which vLLM's
engines use). NOT YET RUN ON A GPU.

Security. Ray runs code for whoever can talk to it, so its token authentication stays on:

- The local Ray instance the front-end starts uses a token of its own (``RAY_AUTH_MODE=token``,
  ``RAY_AUTH_TOKEN_PATH``: 32 random bytes in a 0600 file of the deployment's private
  directory, never ``~/.ray``; a ``RAY_AUTH_MODE=disabled`` inherited from the environment is
  overridden). It also runs in Ray's single-machine mode
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), so that its node address is 127.0.0.1: with it the
  GCS, the raylet, the object manager and every worker's gRPC server listen on loopback and
  require the token (every gRPC call without it is answered UNAUTHENTICATED), the runtime-env
  agent listens on 127.0.0.1 and answers 401 without it, and the autoscaler's Prometheus
  endpoint (read-only counters, no token) listens on 127.0.0.1. No dashboard, no Ray client
  server. tests/e2e/test_listeners_e2e.py checks all of it on a running server.
- ``--afd-ray-address``: the user's own Ray credentials are passed through unchanged
  (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``; given either, ``RAY_AUTH_MODE`` defaults to
  ``token``); a cluster that refuses them is an ``AFDConfigError`` naming these variables.
- Nothing secret goes into Ray's metadata: the FFN actors' runtime environment (stored in the
  GCS) carries only the variables an FFN rank reads (``ffn_runtime_env``), never a name that
  looks like a credential, and the tcp transport's secret travels as a file path
  (``VLLM_AFD_AUTH_FILE``, ``transport/auth.py``), never as a value.

The private directory (``host.private_dir``, mode 0700) holds the Ray token and the tcp secret
of one deployment, its FFN directory and, for ``vllm-afd ffn-server``, the group file and the
attention-rank leases; it is removed when the FFN group stops, and the next start removes the
directories of front-ends that died without doing so (``reap_dead_deployments``).

Failover: ``Supervisor``, a thread of the front-end, replaces an FFN rank that died, stopped or
wedged, and publishes the replacement in the FFN directory (``transport/directory.py``), where
the attention ranks find it (``transport/p2p.py``).

One group, many front-ends: ``vllm-afd ffn-server`` runs ``start_ffn_group`` in a process of
its own and writes a group file (``write_group_file``); a front-end given ``--afd-join`` checks
it against its own configuration and takes attention ranks of the group (``join_ffn_group``).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllm_afd import envs
from vllm_afd.config import AFDConfig, AFDConfigError, MoEModelInfo
from vllm_afd.host import (
    bind_process,
    pid_alive,
    private_dir,
    process_start_time,
    reap_private_dirs,
    remove_private_dir,
    write_private_file,
)
from vllm_afd.transport import TransportSpec, backend, directory
from vllm_afd.transport.directory import RankEntry

logger = logging.getLogger("vllm.afd")
START_TIMEOUT_S = 300.0
#: How often an FFN rank's heartbeat thread beats, and how old a beat may be before
#: ``ffn_group_problems`` calls the rank stopped.
HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 1.0
#: Failover (``Supervisor``): a replacement that served this long ends a streak of failures;
#: after this many failures of one rank in a row the supervisor gives up on it; the longest
#: wait before starting a replacement.
FAILOVER_STABLE_S = 30.0
FAILOVER_MAX_STREAK = 5
FAILOVER_MAX_DELAY_S = 30.0
#: Ray's variables for token authentication (``ray/_private/authentication``).
RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH = (
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)
#: Ray's switch between single-machine mode (0: node address 127.0.0.1) and cluster mode.
RAY_CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: ``VLLM_AFD_*`` variables an FFN rank reads (the rest are the front-end's).
FFN_AFD_VARIABLES = (envs.FFN_CPUS, envs.FFN_THREADS, envs.POLL_MS, envs.FAULT_FILE, envs.AUTH_FILE)
#: Words that mark a variable as a credential: such a variable never reaches Ray's metadata.
SECRET_WORDS = frozenset(
    {"KEY", "KEYS", "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
)


class FFNRank:
    """The Ray actor: one FFN rank (wraps ``FFNExecutor``)."""

    def __init__(self, spec_json: str, rank: int, model_dir: str, device: str) -> None:
        from vllm_afd.ffn.executor import FFNExecutor

        spec = TransportSpec.from_json(spec_json)
        cpus = envs.ffn_cpu_lists(spec.num_ffn_ranks)
        if cpus is not None:
            bind_process(cpus[rank])
        torch.set_num_threads(envs.VLLM_AFD_FFN_THREADS)
        self.executor = FFNExecutor(spec, rank, model_dir, device)
        self.executor.start(HEARTBEAT_INTERVAL_S)

    def info(self) -> dict:
        return self.executor.info()

    def stats(self) -> dict:
        return self.executor.stats.snapshot()

    def stop(self) -> None:
        self.executor.stop()


@dataclass
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
    supervisor: Supervisor | None = None
    #: The transport's rendezvous (``Backend.start_rendezvous``; deepep: its hub), served here.
    hub: object = None

    def stats(self) -> list[dict]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors], timeout=10)

    def start_rank(self, rank: int) -> None:
        """Start a replacement of FFN rank ``rank`` in its bundle and wait until it serves;
        ``actors[rank]`` and ``infos[rank]`` then describe it (``_launch`` starts the first
        ones all at once)."""
        import ray

        actor = _new_actor(
            self.placement_group, rank, self.launch, self.model_dir, self.device, self.local
        )
        try:
            info = ray.get(actor.info.remote(), timeout=START_TIMEOUT_S)
        except BaseException:
            ray.kill(actor)
            raise
        self.actors[rank], self.infos[rank] = actor, info


_LOCK = threading.Lock()
_GROUP: FFNGroup | None = None
_GROUP_KEY: str | None = None
#: The running deployment's private directory, and the variables it set (name -> old value).
_PRIVATE: str | None = None
_SAVED_ENV: dict[str, str | None] = {}


def looks_secret(name: str) -> bool:
    """``name`` has a credential word (``VLLM_API_KEY``, ``HF_TOKEN``, ``S3_SECRET_...``)."""
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def ffn_runtime_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables an FFN rank gets through its Ray runtime environment.

    The runtime environment is cluster metadata (stored in the GCS, shown by Ray's state API
    and dashboard), so it carries only what an FFN rank reads, and no credential:

    - the ``VLLM_AFD_*`` variables of ``FFN_AFD_VARIABLES`` (binding, threads, poll window,
      fault file, the *path* of the tcp secret);
    - ``OMP_*`` and ``VLLM_CPU_*`` (threading and the CPU kernels' settings), and every other
      variable vLLM itself declares (``vllm.envs``: the FFN rank builds and runs the model's
      MoE layers through vLLM, whose kernel choices these settings steer; ``VLLM_HOST_IP``...);
    - never a name with a credential word (``looks_secret``: ``VLLM_API_KEY`` and any
      ``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``), whatever the
      above says.

    Not copied: front-end-only AFD variables (planner inputs, ``VLLM_AFD_RUNTIME``...) and
    undeclared ``VLLM_*`` names. With a local Ray instance the FFN ranks also inherit the
    front-end's environment the way any child process does; that is process state of this
    user, not cluster metadata.
    """
    environ = os.environ if environ is None else environ
    try:
        from vllm import envs as vllm_envs

        declared = set(vllm_envs.environment_variables)
    except ImportError:  # pragma: no cover - vLLM is a dependency
        declared = set()
    out = {}
    for name, value in environ.items():
        wanted = (
            name in FFN_AFD_VARIABLES
            or name.startswith(("OMP_", "VLLM_CPU_"))
            or (name.startswith("VLLM_") and not name.startswith("VLLM_AFD_") and name in declared)
        )
        if wanted and not looks_secret(name):
            out[name] = value
    return out


def _set_env(name: str, value: str | None) -> None:
    """Set (or, with None, unset) ``name`` for this deployment; ``_restore_env`` undoes it."""
    _SAVED_ENV.setdefault(name, os.environ.get(name))
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _restore_env() -> None:
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _SAVED_ENV.clear()


def _private() -> str:
    """This deployment's private directory (created on first use)."""
    global _PRIVATE
    if _PRIVATE is None:
        _PRIVATE = private_dir()
    return _PRIVATE


def prepare_transport_secret(afd: AFDConfig) -> None:
    """A transport that authenticates its peers (``Backend.needs_secret``: tcp; deepep's group
    hub, ``transport/group.py``): make sure the deployment has its shared secret
    (``transport/auth.py``).

    A ``VLLM_AFD_AUTH_FILE`` set by the user is used as it is (``deployment.setup_afd`` checked
    it); otherwise a fresh secret is written into the private directory and the variable set
    for every process started from here on.
    """
    if not backend(afd.transport).needs_secret or envs.VLLM_AFD_AUTH_FILE:
        return
    from vllm_afd.transport.auth import new_secret

    path = write_private_file(os.path.join(_private(), "tcp_secret"), new_secret())
    _set_env(envs.AUTH_FILE, path)


def _refresh_ray_auth() -> None:
    """Make an already imported Ray see the variables set here (it caches its config and the
    token at first use)."""
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ.get(RAY_CLUSTER_MODE) == "0":
        constants.ENABLE_RAY_CLUSTER = False
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception as exc:  # noqa: BLE001 - a Ray without these APIs reads the env at init
        logger.debug("AFD: could not refresh Ray's auth config: %s", exc)


def use_local_ray_credentials() -> None:
    """Token authentication and loopback for the local Ray instance (module docstring)."""
    if os.environ.get(RAY_AUTH_MODE, "token").lower() != "token":
        logger.warning(
            "AFD: %s=%s ignored: the local Ray instance of the FFN group always uses token "
            "authentication",
            RAY_AUTH_MODE,
            os.environ[RAY_AUTH_MODE],
        )
    token = write_private_file(os.path.join(_private(), "ray_token"), os.urandom(32).hex().encode())
    _set_env(RAY_AUTH_MODE, "token")
    _set_env(RAY_AUTH_TOKEN, None)  # it would win over the file
    _set_env(RAY_AUTH_TOKEN_PATH, token)
    _set_env(RAY_CLUSTER_MODE, "0")
    _refresh_ray_auth()


def _given_cluster_credentials() -> None:
    """``--afd-ray-address``: the user's token, passed through (token mode if one is given)."""
    given = os.environ.get(RAY_AUTH_TOKEN) or os.environ.get(RAY_AUTH_TOKEN_PATH)
    if given and RAY_AUTH_MODE not in os.environ:
        _set_env(RAY_AUTH_MODE, "token")
        _refresh_ray_auth()


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


def _ensure_ray(address: str | None, num_cpus: int) -> bool:
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
        _given_cluster_credentials()
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


def start_ffn_group(
    afd: AFDConfig,
    model: MoEModelInfo,
    model_dir: str,
    num_attention_ranks: int,
    max_tokens: int,
    dtype: torch.dtype,
    device: str,
) -> FFNGroup:
    """Start (or reuse, if identical) this process's FFN group and export its address."""
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
        timeout_s=afd.timeout_s,
        moe_layers=model.moe_layers,
        # What the FFN side is asked to listen on (tcp: interface, any free port); the
        # addresses it actually got replace these once it is up.
        addresses=backend(afd.transport).requested_addresses(afd.ffn_host, num_ffn),
        failover_s=afd.failover_s,
    )
    key = json.dumps([spec.to_json(), model_dir, device, afd.ray_address, afd.ffn_host])
    with _LOCK:
        if _GROUP is not None and key == _GROUP_KEY:
            return _GROUP
        stop_ffn_group()
        check_ray_address(afd.ray_address)
        reap_dead_deployments()
        prepare_transport_secret(afd)
        spec = dataclasses.replace(spec, directory=_ffn_directory())
        hub = backend(spec.backend).start_rendezvous(spec, afd.ffn_host)
        if hub is not None:
            spec = dataclasses.replace(spec, addresses=(hub.address,) * num_ffn)
        try:
            _GROUP = _launch(spec, afd, model_dir, device)
        except BaseException:
            if hub is not None:
                hub.close()
            release_credentials()
            raise
        _GROUP.hub = hub
        _GROUP_KEY = key
        if afd.failover_s > 0 and backend(spec.backend).supports_failover:
            _GROUP.supervisor = Supervisor(_GROUP)
        # The hand-off to every process started from here on (engine cores, workers).
        os.environ[envs.RUNTIME] = _GROUP.spec.to_json()
        return _GROUP


def _ffn_directory() -> str:
    """The deployment's FFN directory (``transport/directory.py``), in its private directory."""
    path = os.path.join(_private(), "ffn")
    os.mkdir(path, 0o700)
    return path


def restart_delay(streak: int) -> float:
    """Seconds before starting the replacement after the ``streak``-th failure of a rank in a
    row: 0 for the first, then 1, 3, 7, 15 s (at most ``FAILOVER_MAX_DELAY_S``)."""
    return min(2.0 ** (streak - 1) - 1, FAILOVER_MAX_DELAY_S)


class Supervisor:
    """Failover: a thread of the front-end that replaces FFN ranks that died, stopped or wedged.

    Every ``HEARTBEAT_INTERVAL_S`` it checks each ``up`` rank of the FFN directory as
    ``/health`` does (``_rank_problem``: pid, heartbeat, busy-since; ranks on this host), so a
    loss is seen within ``HEARTBEAT_TIMEOUT_S`` plus one interval. Then it marks the rank
    ``recovering``, kills what is left of it (a stopped or wedged process would never answer),
    removes its shared-memory segments, starts a replacement in the same placement bundle
    (``FFNGroup.start_rank``: same experts, loaded again) and publishes it ``up`` with the next
    incarnation, the failover count and the seconds from detection to serving. The attention
    ranks, which noticed the loss themselves, wait for that entry and send the replacement what
    the lost rank had not answered (``transport/p2p.py``).

    Repeated failures back off: a rank that fails again within ``FAILOVER_STABLE_S`` of its
    replacement extends its streak, and the replacement waits ``restart_delay(streak)``; after
    ``FAILOVER_MAX_STREAK`` failures in a row the rank is published ``failed`` with the reason,
    waiting requests fail at once with it, and ``/health`` says so.
    """

    def __init__(self, group: FFNGroup) -> None:
        self.group = group
        num_ffn = group.spec.num_ffn_ranks
        self._streak = [0] * num_ffn
        self._started = [time.monotonic()] * num_ffn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-ffn-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (a replacement being started is given up)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=START_TIMEOUT_S)

    def _run(self) -> None:
        spec = self.group.spec
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            for entry in directory.entries(spec.directory, spec.num_ffn_ranks):
                if entry is None or entry.state != directory.UP:
                    continue
                problem, _ = _rank_problem(entry, spec.timeout_s)
                if problem is not None and not self._stop.is_set():
                    try:
                        self._fail_over(entry, problem)
                    except Exception:  # noqa: BLE001 - the supervisor must outlive one failover
                        logger.exception("AFD: failover of FFN rank %d failed", entry.rank)

    def _publish(self, entry: RankEntry, **changes) -> RankEntry:
        entry = dataclasses.replace(entry, **changes)
        directory.publish(self.group.spec.directory, entry)
        return entry

    def _fail_over(self, entry: RankEntry, problem: str) -> None:
        rank, detected = entry.rank, time.monotonic()
        stable = detected - self._started[rank] >= FAILOVER_STABLE_S
        streak = 1 if stable else self._streak[rank] + 1
        logger.warning("AFD: %s; replacing it (failure %d in a row)", problem, streak)
        entry = self._publish(entry, state=directory.RECOVERING, reason=problem)
        self._kill(rank, entry)
        while True:
            if streak > FAILOVER_MAX_STREAK:
                reason = (
                    f"FFN rank {rank} failed {streak - 1} times in a row, each within "
                    f"{FAILOVER_STABLE_S:g}s of its start; the last: {problem}"
                )
                logger.error("AFD: %s; giving up on it: requests fail until a restart", reason)
                self._publish(entry, state=directory.FAILED, reason=reason)
                return
            if self._stop.wait(restart_delay(streak)):
                return
            try:
                self.group.start_rank(rank)
                break
            except Exception as exc:  # noqa: BLE001 - counted as the next failure
                problem = f"FFN rank {rank}: its replacement did not start ({exc})"
                logger.warning("AFD: %s", problem)
                streak += 1
        info = self.group.infos[rank]
        took = time.monotonic() - detected
        self._streak[rank], self._started[rank] = streak, time.monotonic()
        self._publish(
            entry,
            incarnation=entry.incarnation + 1,
            state=directory.UP,
            address=info["address"],
            host=info["host"],
            pid=info["pid"],
            failovers=entry.failovers + 1,
            recovery_s=entry.recovery_s + took,
        )
        _log_rank_up(info)
        logger.warning(
            "AFD: FFN rank %d replaced in %.1fs (failover %d; it had %s)",
            rank,
            took,
            entry.failovers + 1,
            problem.split(") ", 1)[-1],
        )

    def _kill(self, rank: int, entry: RankEntry) -> None:
        """Kill the lost rank's process (stopped and wedged ones too) and reap its segments."""
        import ray

        actor = self.group.actors[rank]
        if actor is not None and ray.is_initialized():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if entry.host != socket.gethostname():
            return
        if pid_alive(entry.pid):
            try:
                os.kill(entry.pid, signal.SIGKILL)  # the pid of the process this group started
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while pid_alive(entry.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        reap_dead_segments()


def _bundle(device: str, local: bool) -> dict[str, float]:
    """One FFN rank's placement bundle: a CPU, and a GPU Ray assigns when the ranks run on a
    given cluster; on the local node the FFN ranks' GPUs are chosen by rank (``ffn_gpu``)."""
    return {"CPU": 1, "GPU": 1} if device == "cuda" and not local else {"CPU": 1}


def ffn_gpu(spec: TransportSpec, rank: int) -> int:
    """The GPU of FFN rank ``rank`` on the local node: the first after the attention ranks'
    (vLLM's engines take GPUs ``0..A-1``), so that the two never share one (``A + F`` GPUs
    are checked before start: ``deployment.check_devices``)."""
    return spec.num_attention_ranks + rank


def _gpu_env(spec: TransportSpec, rank: int, device: str, local: bool) -> dict[str, str]:
    """The variables that give a local FFN rank its own GPU (Ray would otherwise hand out
    GPU 0 onwards, which vLLM's engines use, and reset ``CUDA_VISIBLE_DEVICES``)."""
    if device != "cuda" or not local:
        return {}
    return {
        "CUDA_VISIBLE_DEVICES": str(ffn_gpu(spec, rank)),
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }


def _new_actor(pg, rank: int, launch: TransportSpec, model_dir: str, device: str, local: bool):
    """An ``FFNRank`` actor for ``rank`` in bundle ``rank`` of the placement group."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = _bundle(device, local)
    env = {**ffn_runtime_env(), **_gpu_env(launch, rank, device, local)}
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


def _launch(spec: TransportSpec, afd: AFDConfig, model_dir: str, device: str) -> FFNGroup:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    owns_ray = _ensure_ray(afd.ray_address, num_cpus=max(os.cpu_count() or 1, spec.num_ffn_ranks))
    local = afd.ray_is_local
    bundle = _bundle(device, local)
    pg = placement_group([dict(bundle) for _ in range(spec.num_ffn_ranks)], strategy="PACK")
    if not _wait(pg.ready(), START_TIMEOUT_S):
        remove_placement_group(pg)
        raise RuntimeError(
            f"AFD: Ray could not place {spec.num_ffn_ranks} FFN rank(s) with {bundle} each "
            f"within {START_TIMEOUT_S:.0f}s; check the cluster's free resources"
        )
    group = FFNGroup(spec, [], [], pg, owns_ray, spec, model_dir, device, local)
    group.actors = [
        _new_actor(pg, r, spec, model_dir, device, local) for r in range(spec.num_ffn_ranks)
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
        _log_rank_up(info)
        directory.publish(
            spec.directory,
            RankEntry(info["rank"], 1, directory.UP, info["address"], info["host"], info["pid"]),
        )
    return group


def _log_rank_up(info: dict) -> None:
    logger.info(
        "AFD: FFN rank %d up: pid %d on %s, experts [%d, %d), %.2f MiB, address %s",
        info["rank"],
        info["pid"],
        info["host"],
        *info["experts"],
        info["param_bytes"] / 2**20,
        info["address"],
    )


def _wait(ref, timeout: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)


# --------------------------------------------------------------------------------------------
# One FFN group, many front-ends: ``vllm-afd ffn-server`` and ``--afd-join``.
# --------------------------------------------------------------------------------------------

#: Version of the group file's format.
GROUP_FILE_FORMAT = 1
_GROUP_FILE_MAX_BYTES = 1 << 20
#: The joined group's lease directory and the attention ranks this front-end holds there.
_LEASES: tuple[str, list[int]] | None = None


def _version() -> str:
    """This package's version (from its metadata: importing ``vllm_afd`` here would close an
    import circle)."""
    from importlib.metadata import version

    return version("vllm-afd")


def model_identity(model_dir: str) -> str:
    """What a front-end must serve to join a group: the sha256 of the checkpoint's
    ``config.json`` (architecture, sizes, experts, quantization)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def write_group_file(path: str | None, model_dir: str) -> str:
    """Describe the running FFN group for front-ends that join it (``--afd-join``).

    The file (mode 0600) holds the group's ``TransportSpec`` (addresses, FFN directory), the
    model's identity and dtype, the package version, the lease directory where joining
    front-ends take their attention ranks, and the *path* of the tcp secret: nothing secret.
    Default place: the deployment's private directory. Returns the path.
    """
    group = _GROUP
    if group is None:
        raise RuntimeError("no FFN group runs in this process")
    leases = os.path.join(_private(), "leases")
    os.makedirs(leases, mode=0o700, exist_ok=True)
    content = {
        "format": GROUP_FILE_FORMAT,
        "vllm_afd": _version(),
        "spec": json.loads(group.spec.to_json()),
        "model": model_dir,
        "model_sha256": model_identity(model_dir),
        "leases": leases,
        "auth_file": envs.VLLM_AFD_AUTH_FILE or "",
        "owner": {"host": socket.gethostname(), "pid": os.getpid()},
    }
    path = os.path.abspath(path or os.path.join(_private(), "group.json"))
    if os.path.lexists(path):
        os.unlink(path)
    return write_private_file(path, json.dumps(content, indent=1).encode())


def _read_group_file(path: str) -> dict:
    from vllm_afd.host import read_private_file

    where = f"--afd-join (additional_config.afd.join) {path!r}"
    try:
        content = json.loads(read_private_file(path, _GROUP_FILE_MAX_BYTES))
    except FileNotFoundError:
        raise AFDConfigError(
            f"{where}: no such file; give the group file `vllm-afd ffn-server` printed"
        ) from None
    except (OSError, ValueError) as exc:
        raise AFDConfigError(f"{where}: not a readable group file of this user ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != GROUP_FILE_FORMAT:
        raise AFDConfigError(f"{where}: not a group file of format {GROUP_FILE_FORMAT}")
    return content


def join_ffn_group(
    afd: AFDConfig,
    model: MoEModelInfo,
    model_dir: str,
    num_attention_ranks: int,
    max_tokens: int,
    dtype: torch.dtype,
) -> TransportSpec:
    """Join the FFN group of ``afd.join`` with this front-end's attention ranks.

    Everything that must agree is checked first, each mismatch an ``AFDConfigError`` naming
    both sides: package version, model (``model_identity``), dtype, expert layout, transport,
    batch size (``--max-num-batched-tokens`` at most the group's) and microbatches (at most
    the group's slots). Then this front-end takes ``num_attention_ranks`` consecutive attention
    ranks of the group (``_claim_ranks``), and the group's spec, with them, is handed to the
    processes vLLM starts (``VLLM_AFD_RUNTIME``). The front-end never stops the group; leaving
    gives its ranks back (``stop_ffn_group``).
    """
    global _LEASES
    content = _read_group_file(afd.join)
    where = f"--afd-join (additional_config.afd.join) {afd.join!r}"
    spec = TransportSpec.from_json(json.dumps(content["spec"]))
    mine = {
        "vllm_afd version": _version(),
        "model (sha256 of config.json)": model_identity(model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "transport (--afd-transport)": afd.transport,
        "experts, top_k, hidden size, MoE layers": (
            model.num_experts,
            model.top_k,
            model.hidden_size,
            list(model.moe_layers),
        ),
    }
    theirs = {
        "vllm_afd version": content.get("vllm_afd"),
        "model (sha256 of config.json)": content.get("model_sha256"),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "transport (--afd-transport)": spec.backend,
        "experts, top_k, hidden size, MoE layers": (
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            list(spec.moe_layers),
        ),
    }
    for field_name, value in mine.items():
        if value != theirs[field_name]:
            raise AFDConfigError(
                f"{where}: the FFN group serves {field_name} {theirs[field_name]!r}, this "
                f"front-end {value!r} (group model: {content.get('model')})"
            )
    if max_tokens > spec.max_tokens:
        raise AFDConfigError(
            f"{where}: --max-num-batched-tokens {max_tokens} is more than the FFN group takes "
            f"({spec.max_tokens}); use at most that"
        )
    if afd.microbatches > spec.num_slots:
        raise AFDConfigError(
            f"{where}: --afd-microbatches {afd.microbatches} is more than the FFN group's "
            f"{spec.num_slots} slots per attention rank"
        )
    leases = str(content["leases"])
    first = _claim_ranks(leases, num_attention_ranks, spec.num_attention_ranks, where)
    _LEASES = (leases, list(range(first, first + num_attention_ranks)))
    secret = backend(spec.backend).needs_secret
    if secret and content.get("auth_file") and not envs.VLLM_AFD_AUTH_FILE:
        _set_env(envs.AUTH_FILE, str(content["auth_file"]))
    spec = dataclasses.replace(spec, attention_rank_offset=first)
    os.environ[envs.RUNTIME] = spec.to_json()
    logger.info(
        "AFD: joined the FFN group of %s as attention ranks %d..%d of %d (%d FFN rank(s), %s)",
        afd.join,
        first,
        first + num_attention_ranks - 1,
        spec.num_attention_ranks,
        spec.num_ffn_ranks,
        spec.backend,
    )
    return spec


def _claim_ranks(leases: str, count: int, capacity: int, where: str) -> int:
    """Take ``count`` consecutive attention ranks of a group: one lease file per rank, created
    exclusively, holding this process's pid and start time. A lease whose holder is gone (same
    host) is taken over. Returns the first rank."""
    pid = os.getpid()
    me = {"host": socket.gethostname(), "pid": pid, "start": process_start_time(pid)}
    for first in range(0, capacity - count + 1):
        taken: list[int] = []
        for rank in range(first, first + count):
            if not _take_lease(leases, rank, me):
                break
            taken.append(rank)
        if len(taken) == count:
            return first
        _release_leases(leases, taken)
    raise AFDConfigError(
        f"{where}: the FFN group has no {count} free attention rank(s) in a row (it takes "
        f"{capacity}; front-ends that joined hold the others: {sorted(os.listdir(leases))}); "
        "start the ffn-server with a larger --afd-ratio A, or use fewer ranks here"
    )


def _take_lease(leases: str, rank: int, me: dict) -> bool:
    path = os.path.join(leases, f"rank{rank}")
    for _ in range(2):
        try:
            write_private_file(path, json.dumps(me).encode())
            return True
        except FileExistsError:
            try:
                with open(path) as fh:
                    holder = json.load(fh)
            except (OSError, ValueError):
                return False
            alive = holder.get("host") != me["host"] or process_start_time(
                int(holder.get("pid", 0))
            ) == holder.get("start")
            if alive:
                return False
            os.unlink(path)  # its front-end died without giving it back
    return False


def _release_leases(leases: str, ranks: list[int]) -> None:
    for rank in ranks:
        try:
            os.unlink(os.path.join(leases, f"rank{rank}"))
        except FileNotFoundError:
            pass


def current_group() -> FFNGroup | None:
    return _GROUP


def reap_dead_segments() -> list[str]:
    """Unlink this user's ``/dev/shm`` segments (transport and metrics) whose creator died
    (SIGKILLed FFN or attention ranks of earlier runs); returns their names."""
    from vllm_afd.metrics.blocks import reap_stale_blocks
    from vllm_afd.transport.shm import reap_stale_segments

    reaped = reap_stale_segments() + reap_stale_blocks()
    if reaped:
        logger.info("AFD: removed %d segment(s) of dead processes from /dev/shm", len(reaped))
    return reaped


def reap_dead_deployments() -> list[str]:
    """``reap_dead_segments``, and the private directories of front-ends that died without
    cleaning up (``host.reap_private_dirs``): run before a new FFN group starts."""
    dirs = reap_private_dirs()
    if dirs:
        logger.info("AFD: removed %d private directory(ies) of dead front-ends", len(dirs))
    return reap_dead_segments() + dirs


def release_credentials() -> None:
    """Undo what the deployment set in the environment and remove its private directory."""
    global _PRIVATE
    _restore_env()
    remove_private_dir(_PRIVATE)
    _PRIVATE = None


def stop_ffn_group() -> None:
    """Stop this process's FFN group (and the local Ray it started). Idempotent."""
    global _GROUP, _GROUP_KEY, _LEASES
    group, _GROUP, _GROUP_KEY = _GROUP, None, None
    os.environ.pop(envs.RUNTIME, None)
    if _LEASES is not None:  # a front-end that joined a group leaves it running
        _release_leases(*_LEASES)
        _LEASES = None
    if group is None:
        release_credentials()
        return
    if group.supervisor is not None:
        group.supervisor.stop()  # before the ranks: no replacement may start meanwhile
    if group.hub is not None:
        group.hub.close()
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        try:
            ray.get(actor.stop.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort: the actor may be dead already
            pass
        ray.kill(actor)
    try:
        remove_placement_group(group.placement_group)
    except Exception:  # noqa: BLE001
        pass
    from vllm_afd.metrics.blocks import unlink_deployment_blocks

    unlink_deployment_blocks(group.spec)
    if group.owns_ray:
        ray.shutdown()
    release_credentials()


def _rank_problem(entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
    """Why the process of ``entry`` (an ``up`` FFN rank) cannot serve, or ``None``; and the
    count of requests that failed on it. Only ranks on this host are checked (pid, stats
    block); others are ``(None, 0)``: their failures surface as transport errors."""
    from vllm_afd.metrics.blocks import (
        F_BUSY_SINCE,
        F_FAILURES,
        F_HEARTBEAT,
        ffn_block_name,
        read_block,
    )

    if entry.host != socket.gethostname():
        return None, 0.0
    who = f"FFN rank {entry.rank} (pid {entry.pid})"
    if not pid_alive(entry.pid):
        return f"{who} died", 0.0
    block = read_block(ffn_block_name(entry.address, entry.rank))
    if block is None:
        return None, 0.0
    now = time.monotonic()
    beat, busy, failures = (block.scalars[i] for i in (F_HEARTBEAT, F_BUSY_SINCE, F_FAILURES))
    if beat and now - beat > HEARTBEAT_TIMEOUT_S:
        return f"{who} stopped: no heartbeat for {now - beat:.1f}s", failures
    if busy and now - busy > timeout_s:
        return (
            f"{who} wedged: one layer batch running for {now - busy:.1f}s "
            f"(timeout_s={timeout_s:g})",
            failures,
        )
    return None, failures


def ffn_group_problems() -> list[str]:
    """What keeps the deployment's FFN ranks from serving, one line each (empty: healthy).

    Readable from any process of the deployment (``/health`` runs in the API server), from the
    FFN directory (``VLLM_AFD_RUNTIME``'s ``directory``). A rank is unhealthy while it is being
    replaced, once the supervisor gave up on it, and, on this host, when its process is gone,
    when its heartbeat (a thread of the rank, every ``HEARTBEAT_INTERVAL_S``) is older than
    ``HEARTBEAT_TIMEOUT_S`` (stopped, e.g. SIGSTOP, or frozen), when one layer batch has been
    running longer than the transport timeout (wedged), or once a request failed there
    (``FFNServeError``).
    """
    runtime = envs.VLLM_AFD_RUNTIME
    spec = TransportSpec.from_json(runtime) if runtime else None
    if spec is None or not spec.directory:
        return []
    problems = []
    for rank, entry in enumerate(directory.entries(spec.directory, spec.num_ffn_ranks)):
        if entry is None:
            continue
        if entry.state == directory.RECOVERING:
            problems.append(f"FFN rank {rank} is being replaced: {entry.reason}")
        elif entry.state == directory.FAILED:
            problems.append(entry.reason)
        else:
            problem, failures = _rank_problem(entry, spec.timeout_s)
            if problem:
                problems.append(problem)
            if failures:
                problems.append(
                    f"FFN rank {rank} (pid {entry.pid}) failed {failures:.0f} request(s)"
                )
    return problems


atexit.register(stop_ffn_group)
