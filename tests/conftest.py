"""Shared fixtures: the tiny models are built once per session; engines run in child processes."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="session", autouse=True)
def tcp_secret(tmp_path_factory):
    """A shared secret for the tcp transport endpoints tests create directly (a deployment's
    front-end makes its own); child processes inherit the variable. Servers started by tests
    with ``VLLM_AFD_AUTH_FILE`` removed from their environment create their own."""
    from vllm_afd import envs
    from vllm_afd.host import write_private_file
    from vllm_afd.transport.auth import new_secret

    if envs.AUTH_FILE in os.environ:
        yield os.environ[envs.AUTH_FILE]
        return
    path = write_private_file(str(tmp_path_factory.mktemp("auth") / "tcp_secret"), new_secret())
    os.environ[envs.AUTH_FILE] = path
    yield path
    os.environ.pop(envs.AUTH_FILE, None)


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
