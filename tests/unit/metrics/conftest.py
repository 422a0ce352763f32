"""Fixtures of the metrics tests."""

from __future__ import annotations

import multiprocessing as mp

import pytest


@pytest.fixture
def ctx():
    """Writer processes start fresh (spawn): no inherited blocks or finalizers."""
    return mp.get_context("spawn")
