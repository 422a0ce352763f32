"""Placement: the FFN executor group as Ray actors, placed by the ratio, and its life.

One module per job; a reader starting a deployment walks them in this order:

- ``lifecycle.py``: ``start_ffn_group`` / ``stop_ffn_group`` in the front-end (before any
  engine starts: the attention ranks are handed the group's transport spec), ``current_group``.
- ``credentials.py``: the deployment's private directory, the transport secret, Ray's token
  authentication, and what the FFN actors' runtime environment may carry (nothing secret).
- ``cluster.py``: the Ray instance (local, or ``--afd-ray-address``), the placement group
  and one ``FFNRank`` actor (``ffn/rank.py``, the FFN process's entry point) per bundle.
- ``health.py``: what keeps a rank from serving (``/health``), the clean-up of dead processes'
  segments and directories.
- ``failover.py``: the supervisor that replaces lost FFN ranks.
- ``shared.py``: one group for many front-ends (``vllm-afd ffn-server``, ``--afd-join``).

This package's names are the ones the rest of the product and the tests use.
"""

from vllm_afd.ffn.rank import FROZEN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S
from vllm_afd.placement.cluster import (
    START_TIMEOUT_S,
    FFNGroup,
    GroupRequest,
    check_ray_address,
    ffn_gpu,
)
from vllm_afd.placement.credentials import (
    RAY_AUTH_MODE,
    RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH,
    RAY_CLUSTER_MODE,
    ffn_runtime_env,
    looks_secret,
    release_credentials,
    use_local_ray_credentials,
)
from vllm_afd.placement.failover import FAILOVER_MAX_DELAY_S, Supervisor, restart_delay
from vllm_afd.placement.health import (
    Problem,
    ffn_group_problems,
    reap_dead_deployments,
    reap_dead_segments,
)
from vllm_afd.placement.lifecycle import current_group, start_ffn_group, stop_ffn_group
from vllm_afd.placement.shared import (
    GROUP_FILE_FORMAT,
    join_ffn_group,
    model_identity,
    write_group_file,
)

__all__ = [
    "FAILOVER_MAX_DELAY_S",
    "GROUP_FILE_FORMAT",
    "FROZEN_TIMEOUT_S",
    "HEARTBEAT_TIMEOUT_S",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_CLUSTER_MODE",
    "START_TIMEOUT_S",
    "FFNGroup",
    "GroupRequest",
    "Problem",
    "Supervisor",
    "check_ray_address",
    "current_group",
    "ffn_group_problems",
    "ffn_gpu",
    "ffn_runtime_env",
    "join_ffn_group",
    "looks_secret",
    "model_identity",
    "reap_dead_deployments",
    "reap_dead_segments",
    "release_credentials",
    "restart_delay",
    "start_ffn_group",
    "stop_ffn_group",
    "use_local_ray_credentials",
    "write_group_file",
]
