"""One FFN rank as a Ray actor (placement starts one per bundle): binds its CPUs, builds its
experts (``FFNExecutor``) and serves until stopped."""

from __future__ import annotations

import torch

from vllm_afd import envs
from vllm_afd.host import (
    bind_process,
)
from vllm_afd.transport import TransportSpec
from vllm_afd.transport.directory import RankEntry

#: How often an FFN rank's heartbeat thread beats (``placement.health`` reads it).
HEARTBEAT_INTERVAL_S = 0.1


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
        """The executor's facts, and the Ray node this rank runs on."""
        import ray

        return {**self.executor.info(), "node": ray.get_runtime_context().get_node_id()}

    def problem(self, entry: RankEntry, timeout_s: float) -> tuple[str | None, float]:
        """``health.block_problem`` for this rank (its directory ``entry``), read here on its
        own host: the failover supervisor of a front-end on another node asks
        (``failover.RayWatch``). It answers, so its process is not stopped."""
        from vllm_afd.placement.health import block_problem

        return block_problem(entry, timeout_s, lambda: False)

    def stats(self) -> dict:
        return self.executor.stats.snapshot()

    def stop(self) -> None:
        self.executor.stop()
