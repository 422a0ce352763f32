"""Helpers for tests that start servers: a free loopback port, a session's live processes, and
``Server``, one `vllm-afd serve` process on loopback."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from vllm_afd.bench.offline_run import child_env
from vllm_afd.host import free_port

__all__ = ["Server", "Streamed", "free_port", "http_request", "session_processes"]


@dataclass
class Streamed:
    """A streamed completion: HTTP status, text and token ids, and when each chunk arrived
    (``time.monotonic()``)."""

    status: int
    text: str
    token_ids: list[int]
    times: list[float]


def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid``: a server started with ``start_new_session`` and all
    it started (Ray's daemons and workers, engine cores and FFN ranks stay in its session)."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def http_request(
    url: str, body: dict | None = None, timeout: float = 60.0
) -> tuple[int, dict | str]:
    """GET (``body`` None) or POST JSON; ``(status, JSON object or text)``, errors included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.startswith("{") else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    def __init__(
        self,
        model: str,
        log: Path,
        extra: tuple[str, ...] = ("--afd-ratio", "2:1"),
        dtype: str = "float32",
        env: dict[str, str] | None = None,
        max_num_batched_tokens: int = 64,
    ):
        self.model, self.log, self.port = model, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(Path(sys.executable).with_name("vllm-afd")),
            "serve",
            model,
            *extra,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            str(max_num_batched_tokens),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--seed",
            "0",
        ]
        self.proc = subprocess.Popen(
            argv,
            env={**child_env(), **(env or {})},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log.read_text()[-3000:]}"
            try:
                if http_request(self.url + "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def ffn_pid(self, rank: int = 0) -> int:
        """The pid of FFN rank ``rank``'s latest process (a replacement's after a failover)."""
        found = re.findall(rf"AFD: FFN rank {rank} up: pid (\d+)", self.log.read_text())
        assert found, "the server did not log its FFN rank's pid"
        return int(found[-1])

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120.0):
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return http_request(self.url + "/v1/completions", body, timeout=timeout)

    def stream(self, prompt: str, max_tokens: int, timeout: float = 300.0) -> Streamed:
        """A streamed greedy completion, read chunk by chunk as a client would."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        out = Streamed(0, "", [], [])
        try:
            headers = {"Content-Type": "application/json"}
            connection.request("POST", "/v1/completions", json.dumps(body), headers)
            response = connection.getresponse()
            out.status = response.status
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "choices" not in chunk:  # an error object
                    out.status = 500
                    out.text += json.dumps(chunk)
                    continue
                choice = chunk["choices"][0]
                out.text += choice.get("text") or ""
                out.token_ids += choice.get("token_ids") or []
                out.times.append(time.monotonic())
        finally:
            connection.close()
        return out

    def terminate(self) -> None:
        """Stop the server as an operator would (SIGTERM) and wait for it to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=90)

    def kill_leftovers(self) -> None:
        """Test hygiene only: kill whatever of the session is still alive."""
        if self.proc.poll() is None:
            self.proc.kill()
        for proc in session_processes(self.proc.pid):
            proc.kill()
