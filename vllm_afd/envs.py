"""Every ``VLLM_AFD_*`` environment variable, declared once: typed, validated, documented.

The shape of vLLM's own ``vllm/envs.py``: ``environment_variables`` maps each name to a parser,
and ``envs.VLLM_AFD_POLL_MS`` (module ``__getattr__``) reads and parses it at each access, so
tests can change the environment (``monkeypatch.setenv``) and a value set by the front-end is
seen by the processes it starts. A bad value raises one ``AFDConfigError`` naming the variable
and what is allowed; ``check_all`` runs every check in the front-end before anything starts.

Variables a user sets:

``VLLM_AFD_FFN_CPUS``
    CPU binding of the FFN ranks: one CPU list per FFN rank, ``|``-separated, in the syntax of
    vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (``"1"``, ``"2-3|4-5"``). Unset: no binding. On a CPU
    host this keeps the FFN ranks off the cores vLLM binds the attention ranks to.
    Every CPU must be one this process may run on (``os.sched_getaffinity``), checked before
    anything starts when the FFN ranks run on this host.
``VLLM_AFD_FFN_THREADS``
    PyTorch threads per FFN rank (integer 1..``MAX_FFN_THREADS``, default 1; at most the CPUs
    this process may run on when the FFN ranks run on this host).
``VLLM_AFD_POLL_MS``
    Milliseconds a waiting transport endpoint polls (spin, then yield the CPU) before it
    sleeps (number >= 0, default 20, at most ``--afd-timeout``); see ``transport/wait.py``.
``VLLM_AFD_ADMIN_TOKEN_FILE``
    Path of the deployment's admin token (``POST /afd/scale`` and the full ``/afd/status``
    take it as a bearer token, as they take ``--api-key``): this user's file, mode 0600 or
    0400, at least 16 characters. Unset: the front-end writes a fresh one into its private
    directory, logs the path and sets this variable for the processes it starts.
``VLLM_AFD_PLAN_HARDWARE`` / ``VLLM_AFD_PLAN_PROFILE``
    Planner inputs of ``--afd-ratio auto``: a hardware preset or file, and a profile file
    written by ``vllm-afd profile`` (see docs/planner.md).
``VLLM_AFD_BENCH_CPUS``
    Comma-separated CPUs a ``vllm-afd bench`` rank process binds itself to (set by the bench).
``VLLM_AFD_FAULT_FILE``
    Fault injection, for tests and drills only: while a file exists at this path, every FFN
    rank raises in its serve loop instead of serving a layer batch; a file that reads
    ``once`` is removed by the rank it hits (one failed layer batch; a batch of several
    attention ranks' requests is then served again request by request, and passes), and one
    that reads ``rows>=N`` fails only batches with a request of at least N rows. Unset: no
    fault.

Variables the product sets (the front-end's hand-off to every process it starts afterwards):

``VLLM_AFD_RUNTIME``
    The running FFN group's ``TransportSpec`` as JSON (``TransportSpec.to_json``); its
    ``directory`` says where each FFN rank is now (``transport/directory.py``).
``VLLM_AFD_FRONT_END``
    What the front-end tells its API server processes, as JSON: vLLM's labels for the AFD
    series (``metrics.collector.MetricLabels``: the served model name, and how this
    front-end's attention ranks map to vLLM's engine indexes) and the planner's
    recommendation (``/afd/status``, ``deployment.front_end_facts``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm_afd.errors import AFDConfigError

RUNTIME = "VLLM_AFD_RUNTIME"
FFN_CPUS = "VLLM_AFD_FFN_CPUS"
FFN_THREADS = "VLLM_AFD_FFN_THREADS"
POLL_MS = "VLLM_AFD_POLL_MS"
PLAN_HARDWARE = "VLLM_AFD_PLAN_HARDWARE"
PLAN_PROFILE = "VLLM_AFD_PLAN_PROFILE"
BENCH_CPUS = "VLLM_AFD_BENCH_CPUS"
FAULT_FILE = "VLLM_AFD_FAULT_FILE"
ADMIN_TOKEN_FILE = "VLLM_AFD_ADMIN_TOKEN_FILE"
FRONT_END = "VLLM_AFD_FRONT_END"
DEFAULT_POLL_MS = 20.0
MAX_FFN_THREADS = 4096


def non_negative_number(text: str) -> float | None:
    """``text`` as a finite number >= 0, or ``None`` when it is not one (callers name the
    setting in their own error)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


def _text(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _poll_ms() -> float:
    text = _text(POLL_MS)
    if text is None:
        return DEFAULT_POLL_MS
    ms = non_negative_number(text)
    if ms is None:
        raise AFDConfigError(
            f"{POLL_MS}={text!r}: expected the milliseconds a waiting AFD endpoint polls "
            f"before it sleeps, a number >= 0 (default {DEFAULT_POLL_MS:g})"
        )
    return ms


def _ffn_threads() -> int:
    text = _text(FFN_THREADS)
    if text is None:
        return 1
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_FFN_THREADS:
        raise AFDConfigError(
            f"{FFN_THREADS}={text!r}: expected the PyTorch threads of each FFN rank, "
            f"an integer in 1..{MAX_FFN_THREADS} (default 1)"
        )
    return int(text)


def _ffn_cpus() -> list[list[int]] | None:
    text = _text(FFN_CPUS)
    if text is None:
        return None
    from vllm.utils.cpu_resource_utils import parse_id_list

    try:
        lists = [parse_id_list(part.strip()) for part in text.split("|")]
    except ValueError:
        lists = []
    if not lists or not all(lists):
        raise AFDConfigError(_ffn_cpus_error(text, None))
    return lists


def _ffn_cpus_error(text: str, num_ffn_ranks: int | None) -> str:
    count = "" if num_ffn_ranks is None else f" ({num_ffn_ranks})"
    return (
        f"{FFN_CPUS}={text!r}: need one CPU list per FFN rank{count}, '|'-separated, "
        "e.g. '1' or '2-3|4-5'"
    )


def _bench_cpus() -> list[int] | None:
    text = _text(BENCH_CPUS)
    if text is None:
        return None
    if not all(c.strip().isdigit() for c in text.split(",")):
        raise AFDConfigError(f"{BENCH_CPUS}={text!r}: expected comma-separated CPU ids, e.g. '0,1'")
    return [int(c) for c in text.split(",")]


environment_variables: dict[str, Callable[[], Any]] = {
    RUNTIME: lambda: _text(RUNTIME),
    FFN_CPUS: _ffn_cpus,
    FFN_THREADS: _ffn_threads,
    POLL_MS: _poll_ms,
    PLAN_HARDWARE: lambda: _text(PLAN_HARDWARE),
    PLAN_PROFILE: lambda: _text(PLAN_PROFILE),
    BENCH_CPUS: _bench_cpus,
    FAULT_FILE: lambda: _text(FAULT_FILE),
    ADMIN_TOKEN_FILE: lambda: _text(ADMIN_TOKEN_FILE),
    FRONT_END: lambda: _text(FRONT_END),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def ffn_cpu_lists(num_ffn_ranks: int) -> list[list[int]] | None:
    """``VLLM_AFD_FFN_CPUS`` checked against the FFN rank count; ``None`` when unset."""
    lists = _ffn_cpus()
    if lists is not None and len(lists) != num_ffn_ranks:
        raise AFDConfigError(_ffn_cpus_error(os.environ[FFN_CPUS], num_ffn_ranks))
    return lists


def runtime_json() -> str:
    """``VLLM_AFD_RUNTIME``; raises a clear error in a process the front-end did not start."""
    text = _text(RUNTIME)
    if text is None:
        raise RuntimeError(
            f"AFD is configured but {RUNTIME} is unset: the FFN group was not started by "
            "this deployment's front-end (use `vllm-afd serve` or `vllm serve --afd-ratio`)"
        )
    return text


def check_all(num_ffn_ranks: int, timeout_s: float | None = None, local: bool = True) -> None:
    """Parse and check every user-set variable now (front-end, before anything starts).

    Args:
        num_ffn_ranks: the FFN rank count (``VLLM_AFD_FFN_CPUS`` needs one list per rank).
        timeout_s: ``--afd-timeout``; the poll window may not be longer.
        local: the FFN ranks run on this host (a local Ray instance): their CPU binding and
            thread count are checked against the CPUs this process may run on.
    """
    lists = ffn_cpu_lists(num_ffn_ranks)
    threads = _ffn_threads()
    poll_ms = _poll_ms()
    _bench_cpus()
    if timeout_s is not None and poll_ms > 1e3 * timeout_s:
        if os.environ.get(POLL_MS, "").strip():
            raise AFDConfigError(
                f"{POLL_MS}={os.environ[POLL_MS]!r}: the poll window may not be longer than "
                f"--afd-timeout ({timeout_s:g} s = {1e3 * timeout_s:g} ms); use a number in "
                f"0..{1e3 * timeout_s:g}"
            )
        raise AFDConfigError(
            f"--afd-timeout {timeout_s:g}: shorter than the poll window ({POLL_MS}, default "
            f"{DEFAULT_POLL_MS:g} ms); use at least {DEFAULT_POLL_MS / 1e3:g} s, or set "
            f"{POLL_MS} to a number in 0..{1e3 * timeout_s:g}"
        )
    if not local:
        return
    allowed = sorted(os.sched_getaffinity(0))
    absent = sorted({cpu for cpus in lists or () for cpu in cpus} - set(allowed))
    if absent:
        raise AFDConfigError(
            f"{FFN_CPUS}={os.environ[FFN_CPUS]!r}: CPU(s) {absent} are not available to this "
            f"process; allowed: {_cpu_ranges(allowed)}"
        )
    if threads > len(allowed):
        raise AFDConfigError(
            f"{FFN_THREADS}={os.environ[FFN_THREADS]!r}: more threads than the "
            f"{len(allowed)} CPU(s) this process may run on; use 1..{len(allowed)}"
        )


def _cpu_ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
