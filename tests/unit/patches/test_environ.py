"""E1: vLLM's environment check knows every ``VLLM_AFD_*`` variable (and only those)."""

from __future__ import annotations

import pytest


def test_vllm_knows_every_afd_variable_and_reads_it_raw(monkeypatch):
    import vllm.envs
    from vllm.platforms import current_platform

    from vllm_afd import envs, register

    register()
    assert set(envs.environment_variables) <= set(vllm.envs.environment_variables)
    # A bad value passes vLLM's check and cache untouched: ours names it (envs.check_all).
    monkeypatch.setenv(envs.FFN_THREADS, "many")
    current_platform.validate_environ(hard_fail=True)  # --fail-on-environ-validation
    assert vllm.envs.VLLM_AFD_FFN_THREADS == "many"
    monkeypatch.setenv("VLLM_AFD_NO_SUCH_VARIABLE", "1")
    with pytest.raises(ValueError, match="Unknown vLLM environment variable.*VLLM_AFD_NO_SUCH"):
        current_platform.validate_environ(hard_fail=True)
