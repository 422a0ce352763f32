"""Run many `vllm-afd serve` invocations that are expected to fail, paying vLLM's import once.

``python serve_cases.py CASES.json`` reads ``[{"argv": [...], "env": {...}}, ...]``, imports
what `vllm-afd serve` imports, then forks one child per case (no thread has started yet):
the child sets the case's environment, sends its output to a file and runs the console
script's own ``vllm_afd.cli.main`` with ``serve ARGV``. It prints one JSON line,
``[[exit code, output, seconds], ...]``. A case still running after 120 s is killed (exit
-9). test_bad_input.py's core cases run the console script itself, each in a fresh process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

CASE_TIMEOUT_S = 120.0


def _preload() -> None:
    import vllm.entrypoints.cli.serve  # noqa: F401 - what serve() imports, paid once
    import vllm.entrypoints.serve.utils.api_utils  # noqa: F401
    import vllm.logger  # noqa: F401

    import vllm_afd.cli  # noqa: F401
    import vllm_afd.deployment  # noqa: F401


def _child(argv: list[str], env: dict[str, str], out_fd: int) -> None:
    os.environ.update(env)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    code = 1
    try:
        from vllm_afd.cli import main

        sys.argv = ["vllm-afd", "serve", *argv]
        main(["serve", *argv])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(case: dict) -> tuple[int, str, float]:
    with tempfile.TemporaryFile() as out:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(case["argv"], case.get("env") or {}, out.fileno())
        deadline = start + CASE_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = -signal.SIGKILL
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        out.seek(0)
        text = out.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status) if status >= 0 else status
    return code, text, elapsed


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    _preload()
    print(json.dumps([run(case) for case in cases]), flush=True)


if __name__ == "__main__":
    main()
