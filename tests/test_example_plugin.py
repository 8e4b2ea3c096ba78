"""The third-party backend in examples/infer-jax, installed as a third party would be.

CI installs it from its folder after infer (``pip install -e examples/infer-jax``);
where it is not installed these tests skip. They check what docs/design.md rule 5
promises: infer discovers the plugin through its entry point with no change
to infer, installing it changes no default, the conformance kit passes on it
with the one command a backend author runs, and a real model decodes the same
greedy tokens on it as on numpy.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

infer_jax = pytest.importorskip("infer_jax")

from reference import encode, tiny_model_dir  # noqa: E402

import infer  # noqa: E402
from infer.plugins import get_registry  # noqa: E402
from infer.plugins.selection import select_backend  # noqa: E402
from infer.testing.cases import CASES  # noqa: E402

PROMPT = "The capital of France is Paris. Once upon a time"


def test_discovered_through_its_entry_point() -> None:
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="infer") if ep.name == "jax"]
    assert ep.value == "infer_jax" and ep.dist is not None and ep.dist.name == "infer-jax"
    infos = {b.key: b for b in infer.list_backends()}
    cpu = infos["jax/cpu"]
    assert cpu.available and cpu.plugin == "jax", cpu
    assert {"swiglu", "fused_add_rms_norm", "attention"} <= set(cpu.native_ops)
    gpu = infos["jax/gpu"]
    assert gpu.available or gpu.reason  # unavailable only with a reason
    assert get_registry().backends["jax/cpu"].plugin == "jax"


def test_installing_it_changes_no_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFER_BACKEND", raising=False)
    infos = {b.key: b for b in infer.list_backends()}
    assert infos["jax/cpu"].score < infos["numpy/cpu"].score
    assert infos["jax/gpu"].score < infos["numpy/cpu"].score
    assert select_backend().name != "jax"
    assert select_backend("jax").name == "jax"  # by name it is there


def test_listing_backends_does_not_import_jax() -> None:
    code = "import sys, infer; infer.list_backends(); assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def outcome(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}


def test_the_conformance_kit_passes_with_one_command(tmp_path: Path) -> None:
    # The command from the plugin's README, run from an empty folder as in the
    # plugin's own CI: only installed packages count. tests/test_conformance.py
    # already runs the kit in-process on jax/cpu at the default 25 examples;
    # this run proves the one-command path, so few examples do (~1 min).
    proc = run_pytest(tmp_path, "--pyargs", "infer.testing", "--infer-backend", "jax:cpu", "--infer-examples", "5")
    # Every op case and both tiny models, in float32 and bfloat16: nothing skipped as unsupported
    # but the int8-activation cases and the q8_0 pools' (the plugin lists no activation_schemes, and
    # no q8_0 in its kv_dtypes) and the bidirectional spans (its native attention does not list
    # attention_spans: infer gives span batches to the default).
    q8 = sum(c.name.startswith(("quantized_linear-q8act-", "attention-spans")) or "q8_0" in c.name for c in CASES)
    assert proc.returncode == 0 and outcome(proc) == {"passed": 2 * (len(CASES) + 2 - q8), "skipped": 2 * q8}, \
        proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_plugins_own_tests_pass() -> None:
    folder = Path(__file__).resolve().parents[1] / "examples" / "infer-jax"
    proc = run_pytest(folder, "tests")
    assert proc.returncode == 0 and outcome(proc).get("failed", 0) == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_tiny_model_generates_numpy_greedy_tokens() -> None:
    path = tiny_model_dir("llama3")
    prompt = encode(path, PROMPT)
    want = list(infer.load(path, backend="numpy").generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    model = infer.load(path, backend="jax:cpu", dtype="float32")
    assert model.backend.name == "jax"
    assert list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True)) == want
