"""Helpers for tests that start servers: a free loopback port, a session's live processes, and
``Server``, one `vllm-afd serve` process on loopback."""

from __future__ import annotations

import psutil

from vllm_afd.bench.server import ServeProcess, Streamed, http_request
from vllm_afd.host import free_port, session_pids

__all__ = ["Server", "Streamed", "free_port", "http_request", "session_processes"]


def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid``: a server started with ``start_new_session`` and all
    it started (Ray's daemons and workers, engine cores and FFN ranks stay in its session)."""
    found = []
    for pid in session_pids(sid):
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


class Server(ServeProcess):
    """The product's ``ServeProcess`` (``vllm_afd.bench.server``), with the suite's asserts."""

    def ffn_pid(self, rank: int = 0) -> int:
        pid = super().ffn_pid(rank)
        assert pid is not None, f"the server did not log FFN rank {rank}'s pid"
        return pid

    def assert_nothing_left(self, grace: float) -> None:
        """The server's session is empty within ``grace`` seconds (it has exited)."""
        self.wait_session_empty(grace)
        left = session_processes(self.proc.pid)
        assert not left, [(p.pid, " ".join(p.cmdline())) for p in left]

    def kill_leftovers(self) -> None:
        """Test hygiene only: kill whatever of the session is still alive a few seconds after
        the server exited (multiprocessing's resource tracker ends just after the server,
        unlinking the semaphores its processes leaked: killed, it leaves them in /dev/shm)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait_session_empty(5.0)
        for proc in session_processes(self.proc.pid):
            proc.kill()
