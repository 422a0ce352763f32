"""Shared fixtures: the tiny models are built once per session; engines run in child processes."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="mixtral"))


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> str:
    from vllm_afd.bench.tiny_models import default_tiny_model

    return str(default_tiny_model(arch="qwen2_moe"))


@pytest.fixture(scope="session")
def smollm2_moe() -> str:
    """The trained SmolLM2-135M-Instruct upcycled to an 8-expert Mixtral (bench/real_model.py)."""
    from vllm_afd.bench.real_model import default_real_model

    return str(default_real_model())
