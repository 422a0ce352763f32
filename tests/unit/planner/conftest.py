"""Shared fixtures of the planner tests: the paper's GB200 hardware and the three models."""

from __future__ import annotations

import pytest

from vllm_afd.planner import HARDWARE_PRESETS, MODEL_PRESETS


@pytest.fixture
def gb200():
    return HARDWARE_PRESETS["gb200"]


@pytest.fixture
def qwen3():
    return MODEL_PRESETS["qwen3-235b-a22b"]


@pytest.fixture
def minimax():
    return MODEL_PRESETS["minimax-m2.5"]


@pytest.fixture
def qwen35():
    return MODEL_PRESETS["qwen3.5-397b-a17b"]
