"""The type checker holds the data path's contracts (``make lint``; pyproject's ``[tool.mypy]``):
the packages it lists (``attention/``, ``transport/`` and ``ffn/`` strict; the planner, the
metrics) check clean, and a call of a method the ``FFNTransport`` contract does not declare is
an error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.full]

ROOT = Path(__file__).resolve().parents[2]


def _checked_packages() -> list[str]:
    """pyproject's ``[tool.mypy]`` files (what ``make lint`` checks)."""
    import json
    import re

    text = (ROOT / "pyproject.toml").read_text()
    return json.loads(re.search(r"^\[tool\.mypy\]\nfiles = (\[.*\])$", text, re.M).group(1))


def test_mypy_is_clean_on_the_data_path_and_catches_an_undeclared_transport_call(tmp_path):
    probe = tmp_path / "undeclared_call.py"
    probe.write_text(
        "from vllm_afd.transport.base import FFNTransport\n\n\n"
        "def serve(transport: FFNTransport) -> None:\n"
        "    transport.serve_everything()\n"
    )
    assert shutil.which("mypy", path=str(Path(sys.executable).parent)), "mypy: the test extra"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", *_checked_packages(), str(probe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, done.stdout[-3000:]
    assert "undeclared_call.py:5" in errors[0]
    assert '"FFNTransport" has no attribute "serve_everything"' in errors[0]
