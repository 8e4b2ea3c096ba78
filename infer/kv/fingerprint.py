"""What a saved sequence state was computed with, so that no other model loads it.

Keys, values and recurrent states are only meaningful to the model that
computed them, stored as that cache stores them. A :class:`Fingerprint`
names everything they depend on: the architecture, a content hash of the
weights (a re-quantized or fine-tuned file with the same config hashes
differently), the compute dtype, the dtype the keys and values are stored in
(``kv_dtype``), the block size (blocks are the prefix cache's unit), and a
hash of the tokenizer and chat template (token ids mean nothing under
another vocabulary). A mismatch is a :class:`~infer.errors.StateMismatchError`
naming the field.

Hashing the weights reads every byte of them once (about a second per GB);
:func:`weights_hash` keeps each file's digest in infer's cache folder,
keyed by the file's resolved path, size and modification time, so a model
is hashed once, not at every save or restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from infer.errors import StateFileError, StateMismatchError, StateUnsupportedError
from infer.paths import cache_dir

#: Files of a model folder whose bytes decide what it computes.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz", ".npy")
#: Small files of a folder that change the computation as much as the weights.
CONFIG_FILES = ("config.json",)
_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class Fingerprint:
    """What a state was computed with; equal fingerprints, interchangeable states."""

    #: The model package's ``model_type``.
    architecture: str
    #: SHA-256 (hex) over the weight files' contents (:func:`weights_hash`).
    weights: str
    #: The dtype the model computes in.
    dtype: str
    #: The dtype the cache stores keys and values in.
    kv_dtype: str
    #: Positions per block of the paged cache.
    block_size: int
    #: SHA-256 (hex) of the tokenizer and its chat templates (:func:`tokenizer_hash`).
    tokenizer: str
    #: What else the prefix cache's keys were salted with (adapters, images);
    #: empty where a sequence had none.
    salt: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, path: Path | str) -> Fingerprint:
        names = {f.name: f.type for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != set(names):
            raise StateFileError(f"{path}: the fingerprint {data!r} does not have the fields {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise StateFileError(f"{path}: malformed fingerprint: {exc}") from None

    def check(self, found: Fingerprint, path: Path | str) -> None:
        """Raise :class:`~infer.errors.StateMismatchError` when the state
        ``found`` in ``path`` was computed with anything else than this."""
        differ = [f.name for f in fields(self) if getattr(self, f.name) != getattr(found, f.name)]
        if not differ:
            return
        first = differ[0]
        what = "; ".join(f"{name}: the file has {getattr(found, name)!r}, this model {getattr(self, name)!r}"
                         for name in differ)
        raise StateMismatchError(
            f"{path} was saved by another model or cache setting ({what}); its keys and values would be wrong "
            "here: load it with the model and settings that saved it, or compute the prompt again",
            first, getattr(self, first), getattr(found, first))


_memo: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def _index_path() -> Path:
    return cache_dir() / "weights-hashes.json"


def file_hash(path: Path) -> str:
    """SHA-256 of one file's contents, remembered by resolved path, size and
    modification time (in this process, and in infer's cache folder)."""
    path = path.resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _memo:
            return _memo[key]
        index = _read_index()
        entry = index.get(str(path))
        if isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns] and isinstance(entry[2], str):
            _memo[key] = entry[2]
            return entry[2]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    with _lock:
        _memo[key] = value
        index = _read_index()
        index[str(path)] = [st.st_size, st.st_mtime_ns, value]
        _write_index(index)
    return value


def _read_index() -> dict[str, Any]:
    try:
        data = json.loads(_index_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_index(index: dict[str, Any]) -> None:
    # Temp file and rename: two processes writing at once leave one whole index, never a torn one.
    target = _index_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        import tempfile  # here, not at the top: a load imports this module and never calls this

        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".weights-hashes.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(index, f)
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only cache folder costs a rehash next time, nothing more


def weights_hash(path: Path | str) -> str:
    """SHA-256 (hex) over a model's weights: a file's contents, or for a
    folder the weight files (:data:`WEIGHT_SUFFIXES`) and ``config.json``
    under it, by relative path."""
    path = Path(path)
    if path.is_file():
        return file_hash(path)
    if not path.is_dir():
        raise StateUnsupportedError(f"{path}: the model's weights are not on disk, so a saved state cannot be "
                                    "tied to them")
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES) and not p.name.startswith("."))
    if not files:
        raise StateUnsupportedError(f"{path}: no weight files found to fingerprint a saved state with")
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.relative_to(path).as_posix()}\0{file_hash(p)}\0".encode())
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 (hex) of a :class:`~infer.tokenizer.Tokenizer` (its serialized
    vocabulary, merges and special tokens) and its chat templates; of
    nothing for a model without one."""
    digest = hashlib.sha256()
    if tokenizer is not None:
        digest.update(tokenizer.backend.to_str().encode())
        digest.update(json.dumps(tokenizer.chat_templates, sort_keys=True).encode())
    return digest.hexdigest()
