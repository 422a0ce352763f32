"""Every VLLM_AFD_* variable is declared once in vllm_afd.envs, typed, and a bad value names it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import bind_process

PACKAGE = Path(envs.__file__).parent


def test_defaults(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    assert envs.VLLM_AFD_POLL_MS == envs.DEFAULT_POLL_MS
    assert envs.VLLM_AFD_FFN_THREADS == 1
    assert envs.VLLM_AFD_FFN_CPUS is None and envs.ffn_cpu_lists(3) is None
    assert envs.VLLM_AFD_RUNTIME is None
    assert envs.VLLM_AFD_BENCH_CPUS is None
    with pytest.raises(RuntimeError, match="VLLM_AFD_RUNTIME is unset"):
        envs.runtime_json()
    with pytest.raises(AttributeError):
        envs.VLLM_AFD_NO_SUCH_THING  # noqa: B018


def test_values_are_parsed_at_each_access(monkeypatch):
    monkeypatch.setenv(envs.POLL_MS, "7.5")
    assert envs.VLLM_AFD_POLL_MS == 7.5
    monkeypatch.setenv(envs.POLL_MS, "0")
    assert envs.VLLM_AFD_POLL_MS == 0.0
    monkeypatch.setenv(envs.FFN_THREADS, "4")
    assert envs.VLLM_AFD_FFN_THREADS == 4
    monkeypatch.setenv(envs.BENCH_CPUS, "0,3")
    assert envs.VLLM_AFD_BENCH_CPUS == [0, 3]


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        (envs.POLL_MS, "-1"),
        (envs.POLL_MS, "inf"),
        (envs.POLL_MS, "soon"),
        (envs.FFN_THREADS, "0"),
        (envs.FFN_THREADS, "two"),
        (envs.FFN_CPUS, "a"),
        (envs.FFN_CPUS, "1|"),
        (envs.FFN_CPUS, "3-"),
        (envs.BENCH_CPUS, "0,x"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(AFDConfigError, match=re.escape(f"{name}={bad!r}")):
        envs.check_all(num_ffn_ranks=1)


def test_ffn_cpus_need_one_list_per_ffn_rank(monkeypatch):
    monkeypatch.setenv(envs.FFN_CPUS, "1")
    assert envs.ffn_cpu_lists(1) == [[1]]
    monkeypatch.setenv(envs.FFN_CPUS, "0-2|4,6")
    assert envs.ffn_cpu_lists(2) == [[0, 1, 2], [4, 6]]
    monkeypatch.setenv(envs.FFN_CPUS, "1|2")
    with pytest.raises(AFDConfigError, match=r"VLLM_AFD_FFN_CPUS='1\|2'.*\(1\)"):
        envs.ffn_cpu_lists(1)


def test_bind_process():
    allowed = os.sched_getaffinity(0)
    try:
        bind_process([min(allowed)])
        assert os.sched_getaffinity(0) == {min(allowed)}
    finally:
        bind_process(allowed)
    assert os.sched_getaffinity(0) == allowed


def test_no_module_but_envs_reads_a_vllm_afd_variable():
    """Every VLLM_AFD_* name in the package's code is spelled in envs.py alone."""
    pattern = re.compile(r"[\"']VLLM_AFD_[A-Z_]+[\"']")
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "envs.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_user_guide_documents_every_variable():
    guide = (PACKAGE.parent / "docs" / "user-guide.md").read_text()
    assert [n for n in envs.environment_variables if f"`{n}`" not in guide] == []


def test_poll_window_may_not_exceed_the_timeout(monkeypatch):
    monkeypatch.setenv(envs.POLL_MS, "5000")
    envs.check_all(num_ffn_ranks=1, timeout_s=5.0)
    with pytest.raises(AFDConfigError, match=r"VLLM_AFD_POLL_MS='5000'.*--afd-timeout \(2 s"):
        envs.check_all(num_ffn_ranks=1, timeout_s=2.0)
    monkeypatch.delenv(envs.POLL_MS)  # the default window: the timeout is what to change
    with pytest.raises(AFDConfigError, match=r"^--afd-timeout 0.01: shorter than the poll window"):
        envs.check_all(num_ffn_ranks=1, timeout_s=0.01)


def test_ffn_cpus_must_be_available_here(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    absent = max(allowed) + 1
    monkeypatch.setenv(envs.FFN_CPUS, str(absent))
    with pytest.raises(
        AFDConfigError, match=rf"VLLM_AFD_FFN_CPUS='{absent}'.*\[{absent}\].*allowed"
    ):
        envs.check_all(num_ffn_ranks=1)
    envs.check_all(num_ffn_ranks=1, local=False)  # FFN ranks elsewhere: not checkable here
    monkeypatch.setenv(envs.FFN_CPUS, str(allowed[0]))
    envs.check_all(num_ffn_ranks=1)


@pytest.mark.parametrize("bad", ["99999999999999999999", "²", "1.5", "-2"])
def test_ffn_threads_are_bounded(monkeypatch, bad):
    monkeypatch.setenv(envs.FFN_THREADS, bad)
    with pytest.raises(AFDConfigError, match=re.escape(f"{envs.FFN_THREADS}={bad!r}")):
        envs.check_all(num_ffn_ranks=1, local=False)


def test_ffn_threads_at_most_the_cpus_here(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv(envs.FFN_THREADS, str(cpus + 1))
    with pytest.raises(AFDConfigError, match=rf"more threads than the {cpus} CPU"):
        envs.check_all(num_ffn_ranks=1)
    envs.check_all(num_ffn_ranks=1, local=False)
