"""The state file: a sequence's keys, values and recurrent state on disk.

A state file is a `safetensors <https://huggingface.co/docs/safetensors>`_
file (any safetensors reader opens it): an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then
the tensors' bytes. infer's own description rides in the header's
``__metadata__`` (string values only, as safetensors requires):

* ``infer.state`` — a JSON object: ``format`` (``"infer-state"``),
  ``version`` (:data:`STATE_VERSION`), the :class:`~infer.kv.fingerprint.Fingerprint`
  of the model that computed the state, and the layout of the tensors (what
  :mod:`infer.kv.snapshot` writes: token count, state groups, checkpoints);
* ``infer.checksum`` — SHA-256 of the header without this entry, followed
  by every data byte.

The header is written canonically (no whitespace, padding spaces to a
multiple of 8 bytes), and a reader accepts only the canonical bytes, so no
byte of a file can change without the checksum or the header check seeing
it. Writes are atomic: a temporary file in the same folder, flushed and
renamed over the target, so a reader never sees half a file and a crash
leaves the old one.

This module is the container only; what the tensors mean is
:mod:`infer.kv.snapshot`'s business.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import StateFileError

#: The ``format`` field of every state file.
STATE_FORMAT = "infer-state"
#: The layout version this code writes and reads.
STATE_VERSION = 1
#: A header larger than this is refused before it is read (a corrupt length field).
MAX_HEADER_BYTES = 64 * 2**20

#: safetensors dtype names -> the numpy dtype their bytes are read as. bfloat16
#: has no numpy dtype: its bytes travel as uint16 (the top half of a float32).
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
}


@dataclass(frozen=True)
class Tensor:
    """One tensor of a state file: its safetensors ``dtype`` and its data
    (for ``"BF16"``, a uint16 array of the bfloat16 bits)."""

    dtype: str
    data: np.ndarray


def _canonical(header: Mapping[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header with spaces


def write_state_file(path: str | os.PathLike[str], info: Mapping[str, Any], tensors: Mapping[str, Tensor], *,
                     durable: bool = True) -> int:
    """Write ``tensors`` and the description ``info`` (JSON-serializable; the
    ``format`` and ``version`` fields are added) to ``path`` atomically.
    ``durable`` flushes the file to the disk before the rename (a saved
    state); a cache entry skips it, since a file a power cut leaves
    incomplete fails its checksum and is a miss. Returns the bytes written."""
    path = Path(path)
    entries: dict[str, Any] = {}
    offset = 0
    arrays = []
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise StateFileError(f"{path}: tensor {name!r} has dtype {t.dtype!r}; a state file holds {sorted(DTYPES)}")
        data = np.ascontiguousarray(t.data, dtype=DTYPES[t.dtype])
        entries[name] = {"dtype": t.dtype, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        arrays.append(data)
    described = {"format": STATE_FORMAT, "version": STATE_VERSION, **info}
    meta = {"infer.state": json.dumps(described, separators=(",", ":"), sort_keys=True)}
    digest = hashlib.sha256(_canonical({"__metadata__": meta, **entries}))
    for data in arrays:
        digest.update(memoryview(data).cast("B"))
    header = _canonical({"__metadata__": {**meta, "infer.checksum": digest.hexdigest()}, **entries})
    path.parent.mkdir(parents=True, exist_ok=True)
    import tempfile  # here, not at the top: every load imports this module, few save state

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for data in arrays:
                f.write(memoryview(data).cast("B"))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return 8 + len(header) + offset


@dataclass
class StateFile:
    """A state file read and checked: its description and its tensors."""

    path: Path
    #: The ``infer.state`` description (with ``format`` and ``version``).
    info: dict[str, Any]
    tensors: dict[str, Tensor]


def read_state_file(path: str | os.PathLike[str]) -> StateFile:
    """Read and check the state file at ``path``. Raises
    :class:`~infer.errors.StateFileError` naming the byte offset or field at
    fault for a file that is truncated, altered (its checksum does not
    match), not a state file, or of another version; never anything else
    for bad bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such state file") from None
    except OSError as exc:
        raise StateFileError(f"{path}: cannot read the state file: {exc}") from None
    return parse_state_file(raw, path)


def parse_state_file(raw: bytes, path: Path | str = "<bytes>") -> StateFile:
    """:func:`read_state_file` of bytes already in memory."""
    path = Path(path)
    if len(raw) < 8:
        raise StateFileError(f"{path}: {len(raw)} bytes, too short for a state file (truncated?)")
    (n,) = struct.unpack_from("<Q", raw, 0)
    if n > MAX_HEADER_BYTES or 8 + n > len(raw):
        raise StateFileError(f"{path}: the header length at byte 0 says {n:,} bytes, but the file has "
                             f"{len(raw) - 8:,} after it (truncated or not a state file)")
    header_bytes = raw[8:8 + n]
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateFileError(f"{path}: the header (bytes 8..{8 + n}) is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise StateFileError(f"{path}: the header has no __metadata__ object: not an infer state file")
    if _canonical(header) != header_bytes:
        raise StateFileError(f"{path}: the header (bytes 8..{8 + n}) is not as infer writes it: the file was altered")
    meta = dict(header["__metadata__"])
    checksum = meta.pop("infer.checksum", None)
    described = meta.get("infer.state")
    if not isinstance(described, str) or not isinstance(checksum, str):
        raise StateFileError(f"{path}: no infer.state / infer.checksum metadata: not an infer state file")
    try:
        info = json.loads(described)
    except ValueError as exc:
        raise StateFileError(f"{path}: the infer.state metadata is not JSON: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != STATE_FORMAT:
        raise StateFileError(f"{path}: format {info.get('format') if isinstance(info, dict) else info!r}, "
                             f"expected {STATE_FORMAT!r}")
    if info.get("version") != STATE_VERSION:
        raise StateFileError(f"{path}: state file version {info.get('version')!r}; this infer reads version "
                             f"{STATE_VERSION} (save the state again with this version)")
    data = memoryview(raw)[8 + n:]
    digest = hashlib.sha256(_canonical({"__metadata__": meta, **{k: v for k, v in header.items()
                                                                  if k != "__metadata__"}}))
    digest.update(data)
    if digest.hexdigest() != checksum:
        raise StateFileError(f"{path}: checksum mismatch: the file's bytes were altered or cut "
                             f"(expected sha256 {checksum[:16]}…, found {digest.hexdigest()[:16]}…)")
    tensors: dict[str, Tensor] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(path, name, entry, data, 8 + n)
        end = max(end, entry["data_offsets"][1])
    if end != len(data):
        raise StateFileError(f"{path}: the tensors end at byte {8 + n + end:,} but the file has {len(raw):,}")
    return StateFile(path, info, tensors)


def _tensor(path: Path, name: str, entry: Any, data: memoryview, base: int) -> Tensor:
    """One header entry's tensor, checked (its bytes are the checksum's already)."""
    ok = (isinstance(entry, dict) and entry.get("dtype") in DTYPES and isinstance(entry.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"]))
    if not ok:
        raise StateFileError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}")
    dtype = DTYPES[entry["dtype"]]
    start, stop = entry["data_offsets"]
    count = int(np.prod(entry["shape"], dtype=np.int64))
    if not 0 <= start <= stop <= len(data) or stop - start != count * dtype.itemsize:
        raise StateFileError(f"{path}: tensor {name!r} ({entry['dtype']} {entry['shape']}) claims bytes "
                             f"{base + start:,}..{base + stop:,} of a file of {base + len(data):,}")
    array = np.frombuffer(data[start:stop], dtype=dtype).reshape(entry["shape"])
    return Tensor(entry["dtype"], array)
