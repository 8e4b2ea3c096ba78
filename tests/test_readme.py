"""README's two commands are what a newcomer runs; CI must run the same test command,
or a green CI hides what a fresh clone would hit (issue 30: CI upgraded pip and
installed two example packages that README's command left out)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fenced_after(heading: str) -> list[str]:
    """The lines of the first ```bash block under README's ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"README's section {heading!r} has no bash block"
    return [line for line in block[1].splitlines() if line.strip()]


def test_ci_runs_readmes_test_command_verbatim() -> None:
    (command,) = _fenced_after("Run the tests")
    script = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    # Beside README's command, .ci/run only sets the shell up.
    assert [line for line in script if line not in ("#!/usr/bin/env bash", "set -euo pipefail",
                                                   'cd "$(dirname "$0")/.."')] == [command]


def test_readmes_test_command_installs_every_package_the_suite_tests() -> None:
    """The example packages' tests are part of the suite: README installs them, so a
    newcomer runs the tests CI runs instead of skipping them."""
    (command,) = _fenced_after("Run the tests")
    for example in sorted((ROOT / "examples").iterdir()):
        if (example / "pyproject.toml").is_file():
            assert f"-e examples/{example.name}" in command, example.name
    assert "pip install --upgrade pip" not in command and "-U pip" not in command


def test_python_dash_m_infer_is_the_infer_command() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "infer", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: infer")
