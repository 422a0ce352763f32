"""Start benchmark children: one process per engine, or one per data-parallel rank.

Every configuration runs in its own fresh processes (vLLM keeps process-global state, and a
fresh process is what a deployment is), with ``runner.child_env``'s loopback and small-KV
settings plus one PyTorch thread per rank, so that a "device" is a core.

A data-parallel configuration is offline SPMD: one child per DP rank with
``VLLM_DP_RANK/SIZE/MASTER_*`` set, each decoding its own ``batch`` requests with vLLM's
single-process executor (so the CPU shims the child installs are in the process that runs the
model); the ranks step in lockstep through the MoE collectives.

The processes stay up for the whole benchmark (``ChildGroup``) so that the harness can
interleave the configurations decode by decode: a load spike from other users of the machine
then lands on all of them, not on whichever configuration happened to run at the time.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm_afd import envs
from vllm_afd.bench.decode import RESULT_PREFIX
from vllm_afd.bench.offline_run import child_env
from vllm_afd.host import free_port

CHILD_TIMEOUT_S = 600.0


def core_plan(
    attention_ranks: int, ffn_ranks: int, threads: int, cpus: list[int] | None = None
) -> tuple[list[list[int]], list[list[int]]] | None:
    """Disjoint CPUs for every rank of a configuration, ``threads`` each: attention ranks
    first, then FFN ranks. ``None`` when ``cpus`` (default: this process's) are too few: the
    scheduler then places the ranks.

    A rank is a device: with its own cores, an attention rank never waits for an FFN rank (or
    another attention rank) that the scheduler put on the same core, and the FFN rank's wait
    for its next request never takes cycles from attention work.
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    ranks = attention_ranks + ffn_ranks
    if ranks * threads > len(cpus):
        return None
    blocks = [cpus[i * threads : (i + 1) * threads] for i in range(ranks)]
    return blocks[:attention_ranks], blocks[attention_ranks:]


def _ids(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def job_env(job: dict[str, Any], threads: int, dp_rank: int | None = None) -> dict[str, str]:
    """Environment of one child: loopback, threads per rank, CPU binding, DP rank variables."""
    tp = job.get("tensor_parallel_size", 1)
    extra = {
        "OMP_NUM_THREADS": str(threads),
        envs.FFN_THREADS: str(threads),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp == 1 else "1",
    }
    cpus = job.get("cpus")
    if tp > 1:  # vLLM binds its TP workers itself
        cores = os.cpu_count() or 1
        binds = [_ids(c) for c in cpus] if cpus else [str(i % cores) for i in range(tp)]
        extra["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(binds)
    elif cpus:
        extra[envs.BENCH_CPUS] = _ids(cpus[dp_rank or 0])
    if job.get("ffn_cpus"):
        extra[envs.FFN_CPUS] = "|".join(_ids(c) for c in job["ffn_cpus"])
    dp = job.get("dp")
    if dp and dp_rank is not None:
        extra |= {
            "VLLM_DP_RANK": str(dp_rank),
            "VLLM_DP_RANK_LOCAL": str(dp_rank),
            "VLLM_DP_SIZE": str(dp["size"]),
            "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(dp["port"]),
        }
    env = child_env(tp, extra)
    env.update(extra)  # child_env's setdefault must not win over the per-job values
    return env


class ChildGroup:
    """The process(es) of one configuration: one engine, or one per DP rank, kept running.

    ``start`` waits for every rank's ``ready`` line; ``run`` sends one command to every rank
    (DP ranks must decode together) and returns their answers in rank order; ``close`` asks them
    to exit and kills what does not within a few seconds. Lines arrive through reader threads,
    so a hung child costs a timeout, not a hang.
    """

    def __init__(self, job: dict[str, Any], threads: int, log_dir: Path) -> None:
        self.job = dict(job)
        dp = job.get("dp")
        self.ranks = dp["size"] if dp else 1
        if dp:
            self.job["dp"] = {**dp, "port": free_port()}
        self.threads, self.log_dir = threads, log_dir
        self.procs: list[subprocess.Popen] = []
        self.queues: list[queue.Queue] = []
        self.ready: list[dict[str, Any]] = []

    def log(self, rank: int) -> Path:
        return self.log_dir / f"{_slug(self.job['name'])}.rank{rank}.log"

    def start(self, timeout_s: float = CHILD_TIMEOUT_S) -> list[dict[str, Any]]:
        dp = self.job.get("dp")
        for rank in range(self.ranks):
            rank_job = {**self.job, "first_request": rank * self.job["batch"]}
            env = job_env(self.job, self.threads, rank if dp else None)
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_afd.bench.decode", json.dumps(rank_job)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log(rank).open("w"),
                text=True,
            )
            self.procs.append(proc)
            self.queues.append(_reader(proc))
        self.ready = self._answers(timeout_s)
        return self.ready

    def run(self, command: dict[str, Any], timeout_s: float = CHILD_TIMEOUT_S) -> list[dict]:
        for proc in self.procs:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        return self._answers(timeout_s)

    def _answers(self, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        return [self._answer(rank, deadline) for rank in range(self.ranks)]

    def _answer(self, rank: int, deadline: float) -> dict[str, Any]:
        while True:
            try:
                line = self.queues[rank].get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(self._failure(rank, "timed out")) from None
            if line is None:
                raise RuntimeError(self._failure(rank, f"exited {self.procs[rank].wait()}"))
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])

    def _failure(self, rank: int, what: str) -> str:
        log = self.log(rank)
        tail = log.read_text()[-3000:] if log.exists() else ""
        return f"benchmark child {self.job['name']!r} rank {rank} {what} (log {log}):\n{tail}"

    def close(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _reader(proc: subprocess.Popen) -> queue.Queue:
    """A queue fed with ``proc``'s stdout lines, then None at end of file."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_") or "job"


class SharedRay:
    """One local Ray instance for every AFD configuration of the run (started, then shut down).

    Without it each AFD child would start its own Ray (GCS, raylet, workers): slower start-up,
    and several idle clusters' background work competing with the configuration being measured.
    Workers (the FFN ranks) run at nice 0 like every other rank of the benchmark.
    Children reach it through ``additional_config.afd.ray_address``. It is secured as the
    product's own local instance is (``placement.use_local_ray_credentials``: token
    authentication, loopback); the children inherit the token's path from this process.
    """

    def __init__(self, num_cpus: int) -> None:
        import ray

        from vllm_afd.placement import use_local_ray_credentials

        # Ray starts workers at nice 15; on a machine shared with other users that starves the
        # FFN ranks (the colocated configurations run at nice 0), so start them at nice 0.
        os.environ.setdefault("RAY_worker_niceness", "0")
        self._owns = not ray.is_initialized()
        if self._owns:
            use_local_ray_credentials()
            ray.init(
                address="local",  # never join another user's cluster (ray_current_cluster)
                num_cpus=num_cpus,
                include_dashboard=False,
                namespace="vllm_afd_bench",
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )
        self.address = ray.get_runtime_context().gcs_address

    def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()
        if self._owns:
            from vllm_afd.placement import release_credentials

            release_credentials()
