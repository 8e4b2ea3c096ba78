"""The ``infer`` command line: run, chat, backends, and clean errors."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from reference import tiny_model_dir

import infer
from infer.tools.cli import main

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_model_dir("smollm2_like")


def test_run_streams_the_same_text_as_the_api(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "run", str(path), PROMPT, "-n", "10", "--ignore-eos", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    want = infer.load(path, backend="numpy").generate(PROMPT, max_tokens=10, ignore_eos=True)
    assert out == want + "\n"


def test_run_passes_sampling_flags(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["-q", "run", str(path), PROMPT, "-n", "8", "-t", "0.9", "--top-k", "20", "--seed", "3", "--ignore-eos"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    want = infer.load(path).generate(PROMPT, max_tokens=8, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    assert first == want + "\n"


def test_run_passes_load_and_speculation_flags(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--quantize and --compile reach infer.load; --speculative gives the
    same greedy text (speculation is exact); bad values exit 1 with a message."""
    args = ["-q", "run", str(path), PROMPT, "-n", "10", "--ignore-eos", "--backend", "numpy"]
    assert main(args + ["--speculative", "ngram", "-k", "3"]) == 0
    want = infer.load(path, backend="numpy").generate(PROMPT, max_tokens=10, ignore_eos=True)
    assert capsys.readouterr().out == want + "\n"
    assert main(args + ["--quantize", "q8", "--compile"]) == 0
    quantized = infer.load(path, backend="numpy", quantize="q8").generate(PROMPT, max_tokens=10, ignore_eos=True)
    assert capsys.readouterr().out == quantized + "\n"
    assert main(args + ["--quantize", "q3"]) == 1
    assert "q3" in capsys.readouterr().err
    assert main(args + ["--speculative", "mtp"]) == 1
    assert "ships none" in capsys.readouterr().err


def test_chat_keeps_the_conversation(path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\nAnd then?\n"))
    assert main(["-q", "chat", str(path), "-n", "6"]) == 0
    replies = capsys.readouterr().out.splitlines()
    model = infer.load(path)
    first = model.chat([{"role": "user", "content": "Hello!"}], max_tokens=6)
    second = model.chat([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "And then?"}], max_tokens=6)
    assert "\n".join(replies) == f"{first}\n{second}"


def test_chat_without_a_template_is_a_clear_error(path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "m"
    shutil.copytree(path, folder)
    config = (folder / "tokenizer_config.json").read_text()
    import json

    data = json.loads(config)
    data.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    assert main(["-q", "chat", str(folder)]) == 1
    assert "chat template" in capsys.readouterr().err


def test_backends_lists_numpy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "numpy/cpu" in out and "yes" in out


def test_errors_exit_1_without_traceback(tmp_path: Path) -> None:
    script = shutil.which("infer", path=str(Path(sys.executable).parent))
    assert script, "the infer console script is not installed"
    done = subprocess.run([script, "run", str(tmp_path / "missing"), "hi"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("infer: error: no model at")
    assert "Traceback" not in done.stderr
    done = subprocess.run([script, "chat", str(tmp_path), "--template", str(tmp_path / "none.jinja")],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "chat template file" in done.stderr


def test_doctor_names_the_default_backend_and_its_attention_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    best = next(b for b in infer.list_backends() if b.available)
    assert f"infer.load() would run on {best.key}" in out
    assert "batched KV cache on" in out and "numpy" in out
    from infer.backends import numpy as numpy_backend

    kernels = numpy_backend._affine
    if kernels is not None:
        assert f"numpy C kernels: {kernels.simd()}" in out
    elif numpy_backend.KERNELS == "off":
        assert f"numpy C kernels: off ({numpy_backend.KERNELS_ENV}=" in out
    else:
        assert "numpy C kernels: not built" in out
