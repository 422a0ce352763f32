"""Placement, credentials: what the FFN group start puts in the environment and where.

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
  looks like a credential.

- The admin routes of the API server (``POST /afd/scale``, the full ``/afd/status``:
  ``routes.py``) take a bearer token, also when the server has no ``--api-key``: the
  deployment's admin token (``prepare_admin_token``), which only the user who runs the server
  can read (a 0600 file whose path the front-end logs, or the operator's own file named by
  ``VLLM_AFD_ADMIN_TOKEN_FILE``). A client's address proves nothing: a sidecar, a proxy or a
  port-forward makes a remote caller local.

The private directory (``host.private_dir``, mode 0700) holds the Ray token and the admin
token of one deployment, its FFN directory and, for ``vllm-afd ffn-server``, the
group file and the attention-rank leases; it is removed when the FFN group stops, and the next
start removes the directories of front-ends that died without doing so
(``reap_dead_deployments``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import (
    private_dir,
    read_private_file,
    remove_private_dir,
    write_private_file,
)

logger = logging.getLogger("vllm.afd")

#: Ray's variables for token authentication (``ray/private_directory/authentication``).
RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH = (
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)
#: Ray's switch between single-machine mode (0: node address 127.0.0.1) and cluster mode.
RAY_CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: ``VLLM_AFD_*`` variables an FFN rank reads (the rest are the front-end's).
FFN_AFD_VARIABLES = (envs.FFN_CPUS, envs.FFN_THREADS, envs.POLL_MS, envs.FAULT_FILE)
#: Words that mark a variable as a credential: such a variable never reaches Ray's metadata.
SECRET_WORDS = frozenset(
    {"KEY", "KEYS", "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
)
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
      fault file);
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


def set_env(name: str, value: str | None) -> None:
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


def private_directory() -> str:
    """This deployment's private directory (created on first use)."""
    global _PRIVATE
    if _PRIVATE is None:
        _PRIVATE = private_dir()
    return _PRIVATE


#: The shortest admin token taken from a file the operator gives (``VLLM_AFD_ADMIN_TOKEN_FILE``).
MIN_ADMIN_TOKEN_CHARS = 16


def prepare_admin_token() -> str:
    """The deployment's admin token file (``VLLM_AFD_ADMIN_TOKEN_FILE``), for the admin routes
    of its API servers (``routes.py``): the operator's, checked now (``AFDConfigError`` naming
    the variable), or a fresh one in the private directory, its path exported to the processes
    started from here on. Only this user can read either."""
    given = check_admin_token_file()
    if given:
        return given
    token = os.urandom(32).hex().encode()
    path = write_private_file(os.path.join(private_directory(), "admin_token"), token)
    set_env(envs.ADMIN_TOKEN_FILE, path)
    return path


def check_admin_token_file() -> str | None:
    """The operator's ``VLLM_AFD_ADMIN_TOKEN_FILE``, checked (``AFDConfigError`` naming it), or
    ``None`` when unset: the front-end checks it before anything starts."""
    given = envs.VLLM_AFD_ADMIN_TOKEN_FILE
    if given:
        read_admin_token(given)
    return given


def read_admin_token(path: str) -> str:
    """The token in ``path``, or ``AFDConfigError`` naming ``VLLM_AFD_ADMIN_TOKEN_FILE``."""
    where = f"{envs.ADMIN_TOKEN_FILE}={path!r}"
    try:
        token = read_private_file(path).decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AFDConfigError(
            f"{where}: {exc}; give this user's own file, mode 0600 or 0400"
        ) from None
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise AFDConfigError(
            f"{where}: at least {MIN_ADMIN_TOKEN_CHARS} characters, not {len(token)}"
        )
    return token


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
    path = os.path.join(private_directory(), "ray_token")
    token = write_private_file(path, os.urandom(32).hex().encode())
    set_env(RAY_AUTH_MODE, "token")
    set_env(RAY_AUTH_TOKEN, None)  # it would win over the file
    set_env(RAY_AUTH_TOKEN_PATH, token)
    set_env(RAY_CLUSTER_MODE, "0")
    _refresh_ray_auth()


def given_cluster_credentials() -> None:
    """``--afd-ray-address``: the user's token, passed through (token mode if one is given)."""
    given = os.environ.get(RAY_AUTH_TOKEN) or os.environ.get(RAY_AUTH_TOKEN_PATH)
    if given and RAY_AUTH_MODE not in os.environ:
        set_env(RAY_AUTH_MODE, "token")
        _refresh_ray_auth()


def release_credentials() -> None:
    """Undo what the deployment set in the environment and remove its private directory."""
    global _PRIVATE
    _restore_env()
    remove_private_dir(_PRIVATE)
    _PRIVATE = None
