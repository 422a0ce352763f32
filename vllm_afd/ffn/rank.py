"""One FFN rank as a Ray actor (placement starts one per bundle): binds its CPUs, builds its
experts (``FFNExecutor``) and serves until stopped."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_afd import envs
from vllm_afd.host import bind_process
from vllm_afd.transport import TransportSpec
from vllm_afd.transport.directory import RankEntry

#: How often an FFN rank's heartbeat thread beats (``block_problem`` reads it).
HEARTBEAT_INTERVAL_S = 0.1
#: How old an FFN rank's heartbeat may be before ``block_problem`` calls the rank stopped, when
#: its process is stopped (SIGSTOP); and when it is not (frozen: a deadlock, a call that never
#: returns). The second is longer: on a loaded host a running rank's heartbeat thread can go
#: more than a second without the CPU (seen on 2 cores with three servers starting), and
#: replacing a rank that was only slow costs a failover, or a server that had not finished
#: starting.
HEARTBEAT_TIMEOUT_S = 1.0
FROZEN_TIMEOUT_S = 10.0


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

    def info(self) -> dict[str, Any]:
        """The executor's facts, and the Ray node this rank runs on."""
        import ray

        return {**self.executor.info(), "node": ray.get_runtime_context().get_node_id()}

    def problem(self, entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
        """``block_problem`` for this rank (its directory ``entry``), read here on its own
        host: the failover supervisor of a front-end on another node asks
        (``failover.RayWatch``). It answers, so its process is not stopped."""
        return block_problem(entry, timeout_s, lambda: False)

    def stats(self) -> dict[str, Any]:
        return self.executor.settled_stats()

    def stop(self) -> None:
        self.executor.stop()


def block_problem(
    entry: RankEntry, timeout_s: float, stopped: Callable[[], bool]
) -> tuple[str | None, float]:
    """Why FFN rank ``entry`` cannot serve, from its stats block alone (read on the rank's
    host; ``stopped`` says whether its process is stopped; ``placement.health.rank_problem``
    adds the pid check): no heartbeat, a layer batch running past
    ``timeout_s``; and the count of requests that failed on it."""
    from vllm_afd.metrics.blocks import (
        F_BUSY_SINCE,
        F_FAILURES,
        F_HEARTBEAT,
        ffn_block_name,
        read_block,
    )

    who = f"FFN rank {entry.rank} (pid {entry.pid})"
    block = read_block(ffn_block_name(entry.address, entry.rank))
    if block is None:
        return None, 0.0
    now = time.monotonic()
    beat, busy, failures = (block.scalars[i] for i in (F_HEARTBEAT, F_BUSY_SINCE, F_FAILURES))
    age = now - beat if beat else 0.0
    if age > FROZEN_TIMEOUT_S or (age > HEARTBEAT_TIMEOUT_S and stopped()):
        return f"{who} stopped: no heartbeat for {age:.1f}s", failures
    if busy and now - busy > timeout_s:
        return (
            f"{who} wedged: one layer batch running for {now - busy:.1f}s "
            f"(timeout_s={timeout_s:g})",
            failures,
        )
    return None, failures
