"""End to end: ``/metrics`` of a running ``vllm-afd serve`` carries the AFD series (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverlib import free_port, session_processes

from tests.unit.metrics.metrics_testlib import value
from vllm_afd import envs
from vllm_afd.host import SHM_DIR
from vllm_afd.metrics import blocks


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_serve_exposes_afd_metrics(tiny_qwen3, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop(envs.RUNTIME, None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    flags = "--afd-ratio 1:1 --host 127.0.0.1 --dtype float32 --max-model-len 256 --enforce-eager"
    args = ["serve", tiny_qwen3, *flags.split(), "--port", str(port)]
    cmd = [str(Path(sys.executable).with_name("vllm-afd")), *args]
    before = _stats_blocks()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300  # vLLM start-up: ~60 s idle, minutes when loaded
        while True:
            assert proc.poll() is None, _tail(tmp_path / "serve.log")
            try:
                if _get(f"{base}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, _tail(tmp_path / "serve.log")
            time.sleep(1)
        for prompt in ("hello world", "1 2 3 4", "the experts"):
            out = _post(
                f"{base}/v1/completions", {"model": tiny_qwen3, "prompt": prompt, "max_tokens": 8}
            )
            assert out["choices"][0]["text"] is not None
        status, text = _get(f"{base}/metrics")
        assert status == 200
        assert "vllm:" in text  # vLLM's own metrics are still there
        assert value(text, "vllm_afd_ffn_rank_alive", ffn_rank=0) == 1.0
        tokens = sum(
            value(text, "vllm_afd_ffn_tokens_total", ffn_rank=0, layer=layer) for layer in (0, 1)
        )
        assert tokens > 0
        assert value(text, "vllm_afd_ffn_service_seconds_count", ffn_rank=0) > 0
        assert value(text, "vllm_afd_ffn_service_seconds_sum", ffn_rank=0) > 0
        assert value(text, "vllm_afd_ffn_layer_service_seconds_sum", ffn_rank=0, layer=1) > 0
        assert value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in") > 0
        # Attention-side series exist; they count once remote_experts.py records round trips.
        sent = value(text, "vllm_afd_dispatched_tokens_total", attention_rank=0, ffn_rank=0)
        if sent:
            assert sent == tokens  # 1:1: every token row went to the only FFN rank
            assert value(text, "vllm_afd_exposed_ffn_seconds_count", attention_rank=0) > 0
            assert value(
                text, "vllm_afd_transport_bytes_total", attention_rank=0, direction="sent"
            ) == value(text, "vllm_afd_ffn_bytes_total", ffn_rank=0, direction="in")
        assert value(text, "vllm_afd_transport_errors_total", attention_rank=0, kind="timeout") == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        finally:
            for child in session_processes(proc.pid):  # never leave any behind
                child.kill()
            log.close()
    left = [n for n in _stats_blocks() - before if _dead_writer(n)]
    assert not left, f"stats blocks left behind by the server: {left}"


def _dead_writer(name: str) -> bool:
    """Still there and its writer is gone (blocks of other live servers on the host are not)."""
    snapshot = blocks.read_block(name)
    return snapshot is not None and not snapshot.alive()


def _stats_blocks() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(blocks.PREFIX)}


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
