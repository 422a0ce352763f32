"""Helpers for tests that start servers: a free loopback port, a session's live processes."""

from __future__ import annotations

import os

import psutil

from vllm_afd.bench.launch import free_port

__all__ = ["free_port", "session_processes"]


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
