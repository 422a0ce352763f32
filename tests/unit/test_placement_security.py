"""What the FFN group start puts where (``placement/credentials.py``): no credential in Ray's
metadata, the Ray token in a private file, and the environment restored at
stop."""

from __future__ import annotations

import os
import stat

import pytest

from vllm_afd import envs, placement


def test_runtime_env_carries_only_what_an_ffn_rank_reads():
    environ = {
        "VLLM_API_KEY": "sk-secret",
        "VLLM_AFD_FFN_CPUS": "1",
        "VLLM_AFD_FFN_THREADS": "2",
        "VLLM_AFD_POLL_MS": "5",
        "VLLM_AFD_FAULT_FILE": "/tmp/x/faults",
        "VLLM_AFD_PLAN_PROFILE": "/p.json",  # front-end only
        "VLLM_AFD_RUNTIME": "{}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_SOMETHING_NEW": "x",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "VLLM_NOT_DECLARED_BY_VLLM": "1",
        "VLLM_CPU_API_TOKEN": "t",  # looks like a credential: never, whatever the prefix
        "OMP_NUM_THREADS": "1",
        "HF_TOKEN": "hf_secret",
        "RAY_AUTH_TOKEN": "ray",
        "PATH": "/bin",
    }
    assert placement.ffn_runtime_env(environ) == {
        "VLLM_AFD_FFN_CPUS": "1",
        "VLLM_AFD_FFN_THREADS": "2",
        "VLLM_AFD_POLL_MS": "5",
        "VLLM_AFD_FAULT_FILE": "/tmp/x/faults",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_SOMETHING_NEW": "x",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("VLLM_API_KEY", True),
        ("S3_SECRET_ACCESS_KEY", True),
        ("DB_PASSWORD", True),
        ("HF_TOKEN", True),
        ("VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", False),
        ("VLLM_AFD_ADMIN_TOKEN_FILE", True),
        ("VLLM_KEYBOARD", False),
    ],
)
def test_looks_secret(name, secret):
    assert placement.looks_secret(name) is secret


def test_the_ray_token_is_private_and_released(monkeypatch):
    monkeypatch.setenv(placement.RAY_AUTH_MODE, "disabled")
    monkeypatch.setenv(placement.RAY_AUTH_TOKEN, "the user's token for another cluster")
    monkeypatch.setattr(placement.credentials, "_refresh_ray_auth", lambda: None)
    try:
        placement.use_local_ray_credentials()
        directory = placement.credentials._PRIVATE
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        path = os.environ[placement.RAY_AUTH_TOKEN_PATH]
        assert os.path.dirname(path) == directory
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.environ[placement.RAY_AUTH_MODE] == "token"
        assert placement.RAY_AUTH_TOKEN not in os.environ  # it would win over the file
        assert os.environ[placement.RAY_CLUSTER_MODE] == "0"
    finally:
        placement.release_credentials()
    assert not os.path.exists(directory)
    assert os.environ[placement.RAY_AUTH_MODE] == "disabled"
    assert os.environ[placement.RAY_AUTH_TOKEN] == "the user's token for another cluster"
    assert placement.RAY_CLUSTER_MODE not in os.environ


def test_given_cluster_token_is_passed_through(monkeypatch):
    monkeypatch.delenv(placement.RAY_AUTH_MODE, raising=False)
    monkeypatch.setenv(placement.RAY_AUTH_TOKEN_PATH, "/home/u/.ray/prod_token")
    monkeypatch.setattr(placement.credentials, "_refresh_ray_auth", lambda: None)
    try:
        placement.credentials.given_cluster_credentials()
        assert os.environ[placement.RAY_AUTH_MODE] == "token"
        assert os.environ[placement.RAY_AUTH_TOKEN_PATH] == "/home/u/.ray/prod_token"
    finally:
        placement.release_credentials()
    assert placement.RAY_AUTH_MODE not in os.environ


def test_private_directories_of_dead_front_ends_are_reaped(tmp_path, monkeypatch):
    """A SIGKILLed front-end leaves its private directory (Ray token, FFN directory,
    admin token); the next start removes it, and only it."""
    import subprocess
    import sys

    from vllm_afd.host import PRIVATE_PREFIX, private_dir, reap_private_dirs

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    gone = tmp_path / f"{PRIVATE_PREFIX}{dead.stdout.strip()}_abc"
    gone.mkdir(mode=0o700)
    (gone / "ray_token").write_text("x")
    mine = private_dir()
    unrelated = tmp_path / f"{PRIVATE_PREFIX}notapid"
    unrelated.mkdir()
    assert os.path.basename(mine).startswith(f"{PRIVATE_PREFIX}{os.getpid()}_")
    assert reap_private_dirs() == ([str(gone)], [])
    assert not gone.exists() and os.path.isdir(mine) and unrelated.exists()


def test_the_admin_token_is_fresh_private_and_exported_or_the_operators_checked(
    tmp_path, monkeypatch
):
    """Without ``VLLM_AFD_ADMIN_TOKEN_FILE`` the front-end writes a fresh token only this user
    can read and exports its path for its API servers (restored at stop); a file the operator
    names is checked before anything starts, the variable named."""
    from vllm_afd.errors import AFDConfigError
    from vllm_afd.placement.credentials import prepare_admin_token, read_admin_token

    monkeypatch.delenv(envs.ADMIN_TOKEN_FILE, raising=False)
    try:
        path = prepare_admin_token()
        assert os.environ[envs.ADMIN_TOKEN_FILE] == path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert len(read_admin_token(path)) == 64
    finally:
        placement.release_credentials()
    assert envs.ADMIN_TOKEN_FILE not in os.environ and not os.path.exists(path)

    given = tmp_path / "token"
    for content, mode, problem in (
        ("x" * 32, 0o644, "no group/other access"),
        ("short", 0o600, "at least 16 characters, not 5"),
    ):
        given.write_text(content)
        given.chmod(mode)
        monkeypatch.setenv(envs.ADMIN_TOKEN_FILE, str(given))
        with pytest.raises(AFDConfigError, match=envs.ADMIN_TOKEN_FILE) as refused:
            prepare_admin_token()
        assert problem in str(refused.value), refused.value
    monkeypatch.setenv(envs.ADMIN_TOKEN_FILE, str(tmp_path / "absent"))
    with pytest.raises(AFDConfigError, match="No such file"):
        prepare_admin_token()
    given.write_text("an operator's token of 32 chars!")
    given.chmod(0o400)
    monkeypatch.setenv(envs.ADMIN_TOKEN_FILE, str(given))
    assert prepare_admin_token() == str(given)
    assert read_admin_token(str(given)) == "an operator's token of 32 chars!"
