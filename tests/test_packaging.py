"""The wheel installs into a clean virtual environment and works there.

``backends/``, ``formats/`` and ``architectures/`` are mapped into the
``infer`` package with setuptools' ``package-dir``; this checks that the
mapping survives a real wheel build, that the entry points register the
first-party plugins, and that the console script runs. The editable install
is what every other test runs against.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, ROOT)
    (path,) = out.glob("infer_engine-*.whl")
    return path


def test_wheel_contains_mapped_packages(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("infer/ops.py", "infer/backends/numpy.py", "infer/backends/reference.py", "infer/backends/cpu/kernels.py",
                   "infer/backends/cpu/backend.py", "infer/formats/huggingface.py",
                   "infer/architectures/llama.py", "infer/distributed/worker.py",
                   "infer/py.typed"):  # py.typed: type checkers read the hints
        assert module in names, f"{module} missing from {wheel.name}"
    if sys.platform.startswith("linux") and platform.machine() == "x86_64":  # the C kernels, one module of many files
        assert any(re.fullmatch(r"infer/backends/cpu/_kernels\..*\.so", n) for n in names), sorted(names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[infer]" in text and "numpy = infer.backends.numpy" in text
    assert "reference = infer.backends.reference" in text
    assert "infer = infer.tools.cli:main" in text


def test_wheel_works_in_clean_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    run(bindir / "python", "-m", "pip", "install", "--quiet", wheel)
    probe = (
        "import infer, infer.backends.numpy as nb, pathlib;"
        "assert 'site-packages' in nb.__file__, nb.__file__;"
        "assert [b.key for b in infer.list_backends() if b.available] == ['numpy/cpu', 'reference/cpu'];"
        "assert 'llama' in [a.name for a in infer.list_architectures()];"
        "assert 'huggingface' in [f.name for f in infer.list_formats()];"
        "print('ok')"
    )
    # Run outside the source tree so the checkout cannot shadow the wheel.
    assert run(bindir / "python", "-c", probe, cwd=tmp_path).stdout.strip() == "ok"
    listing = run(bindir / "infer", "backends", cwd=tmp_path).stdout
    assert "numpy/cpu" in listing and "yes" in listing


def test_wheel_offers_the_conformance_extra(wheel: Path) -> None:
    # Without hypothesis the conformance kit tells its user to install this extra.
    from infer.testing import INSTALL

    assert "pip install 'infer-engine[conformance]'" in INSTALL
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Provides-Extra: conformance" in metadata.splitlines()
    needs = {re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)", line)[1] for line in metadata.splitlines()
             if line.startswith("Requires-Dist:") and 'extra == "conformance"' in line}
    assert needs == {"pytest", "hypothesis"}
