"""One FFN group, several front-ends: `vllm-afd ffn-server` and `vllm-afd serve --afd-join`.

An FFN group of one FFN rank for two attention ranks runs on its own, over NIXL (the transport
of a group shared by front-ends on several hosts; its transport-level sharing runs over every
backend in tests/unit/transport's contract suites); two servers of one
attention rank each join it and serve concurrent requests with colocated's greedy tokens. A
front-end that disagrees with the group (dtype) is refused before it starts anything (exit 2,
the reason named; one more front-end than the group has attention ranks for is refused by the
same join check, tests/unit/test_join.py). When one
front-end leaves, the other serves on; `vllm-afd scale` takes the group to two FFN ranks while
it does (waiting for the front-end that holds a rank, not for the free one), and it serves on
the new pool with colocated's tokens; SIGTERM stops the FFN group and leaves nothing behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverlib import Server, http_request, session_processes

from vllm_afd.bench.offline_run import child_env, run_generation

pytestmark = [pytest.mark.slow, pytest.mark.full]

PROMPTS = ["hello world", "One FFN group serves every front-end that joins it"]
FFN_FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "64", "--max-model-len", "512")


def _vllm_afd(*argv: str) -> list[str]:
    return [str(Path(sys.executable).with_name("vllm-afd")), *argv]


def _refused(model: str, group_file: Path, *flags: str) -> str:
    """Run a joining front-end that must be refused; return its output."""
    argv = _vllm_afd("serve", model, "--afd-join", str(group_file), "--port", "1", *flags)
    proc = subprocess.run(
        argv, env=child_env(), capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "EngineCore" not in out, "the refused front-end started an engine"
    return out


def _scale(group_file: Path, count: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        _vllm_afd("scale", str(group_file), str(count)),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "FFN group ready" not in log.read_text():
        assert proc.poll() is None, f"ffn-server exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"ffn-server not ready:\n{log.read_text()[-3000:]}"
        time.sleep(1)


@pytest.mark.timeout(1500)
def test_two_front_ends_share_one_ffn_group(tiny_qwen3, tmp_path):
    group_file, ffn_log = tmp_path / "group.json", tmp_path / "ffn.log"
    ffn = subprocess.Popen(
        _vllm_afd(
            "ffn-server", tiny_qwen3, "--afd-ratio", "2:1", "--afd-transport", "nixl", *FFN_FLAGS
        ),
        env=child_env(),
        stdout=ffn_log.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    servers: list[Server] = []
    references = concurrent.futures.ThreadPoolExecutor(1)  # colocated while the group starts
    colocated = references.submit(
        run_generation, {"model": tiny_qwen3, "prompts": PROMPTS, "max_tokens": 24}
    )
    try:
        _wait_ready(ffn, ffn_log)
        group_file = Path(ffn_log.read_text().split("--afd-join ")[1].split()[0])
        out = _refused(tiny_qwen3, group_file, "--dtype", "bfloat16", *FFN_FLAGS[2:])
        assert "the FFN group serves dtype 'float32', this front-end 'bfloat16'" in out

        join = ("--afd-join", str(group_file))
        plugins = {"VLLM_PLUGINS": "afd"}  # vLLM's allowlist: our plugin and /afd/status
        servers += [
            Server(tiny_qwen3, tmp_path / f"front{i}.log", join, env=plugins) for i in range(2)
        ]
        for server in servers:
            server.wait_healthy()
        taken = [
            re.findall(r"as attention ranks (\d+)\.\.(\d+) of 2", s.log.read_text())
            for s in servers
        ]
        assert sorted(taken) == [[("0", "0")], [("1", "1")]], taken  # one each, in either order

        colocated = colocated.result()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = [
                pool.submit(server.complete, prompt, 24) for server in servers for prompt in PROMPTS
            ]
            replies = [r.result() for r in replies]
        for i, (status, body) in enumerate(replies):
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == colocated["token_ids"][i % 2], i

        leases = Path(json.loads(group_file.read_text())["leases"])
        assert sorted(p.name for p in leases.iterdir()) == ["rank0", "rank1"]
        servers[0].terminate()  # one front-end leaves; the group and the other serve on
        assert ffn.poll() is None
        # the leaving front-end's rank is free again, the other's still held
        assert [p.name for p in leases.iterdir()] == [f"rank{taken[1][0][0]}"]
        status, body = servers[1].complete(PROMPTS[1], 24)
        assert status == 200 and body["choices"][0]["token_ids"] == colocated["token_ids"][1]
        assert "FFN rank 0 up" not in servers[1].log.read_text()  # it never started a group

        # `vllm-afd scale`: refused for a count the experts cannot split into; to 2 FFN ranks
        # it waits for the front-end that holds a rank only, which then serves on the new pool
        refused = _scale(group_file, 3)
        assert refused.returncode == 1 and "num_ffn_ranks 3" in refused.stderr, refused
        scaled = _scale(group_file, 2)
        assert scaled.returncode == 0, (scaled.stdout, scaled.stderr, ffn_log.read_text()[-3000:])
        reply = json.loads(scaled.stdout)
        assert reply["num_ffn_ranks"] == 2 and reply["scale"]["epoch"] == 2, reply
        status, body = servers[1].complete(PROMPTS[0], 24)
        assert status == 200 and body["choices"][0]["token_ids"] == colocated["token_ids"][0]
        status, live = http_request(
            servers[1].url + "/afd/status", headers=servers[1].admin_headers()
        )
        assert (live["num_ffn_ranks"], live["pool"], live["transport"]) == (2, 2, "nixl"), live
        assert "serves on FFN pool 2 (2 FFN rank(s))" in servers[1].log.read_text()
    finally:
        references.shutdown(wait=True)
        for server in servers:
            try:
                server.terminate()
            finally:
                server.kill_leftovers()
        if ffn.poll() is None:
            ffn.send_signal(signal.SIGTERM)
        try:
            ffn.wait(timeout=90)
        finally:
            left = session_processes(ffn.pid)
            for proc in left:
                proc.kill()
    assert ffn.returncode == 0, ffn_log.read_text()[-3000:]
    assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]
