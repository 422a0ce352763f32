"""One ``vllm-afd serve`` process on loopback, as the benchmarks and the e2e suite start it.

``ServeProcess`` launches the server in a session of its own (``start_new_session``: Ray's
daemons and workers, the engine cores and the FFN ranks all stay in it), waits for ``/health``,
sends greedy completions (whole or streamed, chunk by chunk as a client reads them), finds the
FFN ranks' pids in the log, and stops it: SIGTERM, then SIGKILL for whatever of its session is
still alive. The flags are the suite's: float32 (greedy text comparable request by request),
eager mode, chunked prefill and prefix caching, 64 batched tokens, 512 tokens of context.

A benchmark that starts one calls ``exit_on_sigterm`` first: the server's session is its own,
so a SIGTERM to the benchmark reaches only the benchmark, which must then stop the server.
"""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_afd.host import session_pids


def exit_on_sigterm() -> None:
    """A SIGTERM to this process raises ``SystemExit`` (143) in its main thread, so that the
    ``finally`` that stops its server runs (Python's default is to die at once)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@dataclass
class Streamed:
    """A streamed completion: HTTP status, text and token ids, when each chunk arrived
    (``time.monotonic()``), and the error objects the stream carried (if any)."""

    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""


def http_request(
    url: str,
    body: dict | None = None,
    timeout: float = 60.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict | str]:
    """GET (``body`` None) or POST JSON: ``(status, JSON object or text)``, HTTP errors
    included; ``OSError`` when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.startswith("{") else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class ServeProcess:
    """``vllm-afd serve MODEL *extra`` on 127.0.0.1, its output in ``log``."""

    def __init__(
        self,
        model: str,
        log: Path,
        extra: tuple[str, ...] = ("--afd-ratio", "2:1"),
        dtype: str = "float32",
        env: dict[str, str] | None = None,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 512,
    ) -> None:
        from vllm_afd.bench.offline_run import child_env
        from vllm_afd.host import free_port

        self.model, self.log, self.port = model, Path(log), free_port()
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
            str(max_model_len),
            "--max-num-batched-tokens",
            str(max_num_batched_tokens),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--seed",
            "0",
        ]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**child_env(), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return http_request(self.url + "/health", timeout=timeout)[0] == 200
        except OSError:
            return False

    def ready(self, timeout: float = 5.0) -> bool:
        """``/afd/ready`` answers 200 (the server runs with ``VLLM_PLUGINS=afd``)."""
        try:
            return http_request(self.url + "/afd/ready", timeout=timeout)[0] == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Wait for ``/health`` to answer 200; raise if the server exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout:g}s:\n{self.tail()}")

    def ffn_pid(self, rank: int = 0) -> int | None:
        """The pid of FFN rank ``rank``'s latest process (a replacement's after a failover)."""
        found = re.findall(rf"AFD: FFN rank {rank} up: pid (\d+)", self.tail(10**9))
        return int(found[-1]) if found else None

    def admin_headers(self) -> dict[str, str]:
        """The bearer token of the server's admin routes (``POST /afd/scale``, the full
        ``/afd/status``), read from the file its log names, as an operator reads it."""
        found = re.findall(r"take the bearer token in (\S+) \(readable", self.tail(10**9))
        if not found:
            raise RuntimeError(f"the server logged no admin token file:\n{self.tail()}")
        return {"Authorization": f"Bearer {Path(found[-1]).read_text().strip()}"}

    def _body(self, prompt: str, max_tokens: int, stream: bool) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120.0):
        """A greedy completion: ``(status, response JSON or error text)``."""
        body = self._body(prompt, max_tokens, stream=False)
        return http_request(self.url + "/v1/completions", body, timeout=timeout)

    def stream(
        self,
        prompt: str,
        max_tokens: int,
        timeout: float = 300.0,
        on_chunk: Callable[[], None] | None = None,
    ) -> Streamed:
        """A streamed greedy completion, read chunk by chunk as a client would (``on_chunk``
        is called after each); ``OSError`` when the connection fails. An error object in the
        stream sets status 500."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        out = Streamed(0)
        try:
            body = json.dumps(self._body(prompt, max_tokens, stream=True))
            headers = {"Content-Type": "application/json"}
            connection.request("POST", "/v1/completions", body, headers)
            response = connection.getresponse()
            out.status = response.status
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "choices" not in chunk:
                    out.status, out.error = 500, out.error + json.dumps(chunk)[:500]
                    continue
                choice = chunk["choices"][0]
                out.text += choice.get("text") or ""
                out.token_ids += choice.get("token_ids") or []
                out.times.append(time.monotonic())
                if on_chunk is not None:
                    on_chunk()
            if response.status != 200 and not out.error:
                out.error = f"HTTP {response.status}"
        finally:
            connection.close()
        return out

    def terminate(self, timeout: float = 90.0) -> None:
        """Stop the server as an operator would (SIGTERM) and wait for it to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)

    def wait_session_empty(self, grace: float) -> list[int]:
        """Wait up to ``grace`` seconds for the server's session to empty; the pids left."""
        deadline = time.monotonic() + grace
        while (left := session_pids(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def stop(self, timeout: float = 90.0, grace: float = 20.0) -> list[int]:
        """``terminate``, give the rest of the server's session ``grace`` seconds to exit (a
        process such as multiprocessing's resource tracker ends just after the server), then
        SIGKILL what is left (the main process too if it did not exit in time). Returns the
        pids that had to be killed."""
        try:
            self.terminate(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.wait_session_empty(grace)
        killed: list[int] = []
        for _ in range(10):
            left = session_pids(self.proc.pid)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        return sorted(set(killed))
