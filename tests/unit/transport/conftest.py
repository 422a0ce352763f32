"""Fixtures for transport tests: a forkserver for FFN processes, leak checks at session end."""

from __future__ import annotations

import multiprocessing as mp
import shutil
from collections.abc import Iterator, Sequence

import pytest
from transport_testlib import COUNTS_DIR, FFNCluster, Loopback, leftover_segments

from vllm_afd.testing.reference import FFNForward
from vllm_afd.transport import TransportSpec


@pytest.fixture(scope="session")
def mp_ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm_afd.testing.ffn"])
    return ctx


@pytest.fixture
def start_ffn(mp_ctx) -> Iterator:
    """``start_ffn(spec, forwards) -> FFNCluster``; everything is stopped at teardown."""
    clusters: list[FFNCluster] = []

    def start(spec: TransportSpec, forwards: Sequence[FFNForward]) -> FFNCluster:
        cluster = FFNCluster(mp_ctx, spec, forwards)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.close()
    assert not [p for c in clusters for p in c.procs if p.is_alive()], "FFN process left running"


@pytest.fixture(scope="session", autouse=True)
def no_leaks() -> Iterator[None]:
    yield
    shutil.rmtree(COUNTS_DIR, ignore_errors=True)
    assert not mp.active_children(), f"child processes left: {mp.active_children()}"
    assert not leftover_segments(), f"shared-memory segments left: {leftover_segments()}"


@pytest.fixture
def loopback() -> Iterator:
    """``loopback(spec) -> Loopback``; every endpoint is closed at teardown."""
    made: list[Loopback] = []

    def make(spec: TransportSpec) -> Loopback:
        made.append(Loopback(spec))
        return made[-1]

    yield make
    for lb in made:
        lb.close()
