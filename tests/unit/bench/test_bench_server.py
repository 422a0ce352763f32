"""A benchmark that starts a server stops it when it is itself stopped (``exit_on_sigterm``):
the server runs in a session of its own, where a SIGTERM to the benchmark does not reach."""

from __future__ import annotations

import signal
import subprocess
import sys

SCRIPT = """
import pathlib, sys, time
from vllm_afd.bench.server import exit_on_sigterm
exit_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    pathlib.Path(sys.argv[1]).write_text("the server is stopped here")
"""


def test_a_sigterm_runs_the_finally_that_stops_the_server(tmp_path):
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(stopped)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert stopped.read_text() == "the server is stopped here"
    finally:
        proc.kill()
