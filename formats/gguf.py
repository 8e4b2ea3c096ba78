"""GGUF files (llama.cpp's single-file format): header, metadata, tensors.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), all
little-endian: ``b"GGUF"``, u32 version (2 or 3), u64 tensor count, u64
metadata count; the metadata as (string key, u32 value type, value); the
tensor infos as (string name, u32 n_dims, n_dims x u64 dims, u32 GGML type,
u64 offset); padding to ``general.alignment`` (default 32); the tensor data,
each tensor at its offset from the start of the data section. A string is a
u64 byte length and UTF-8 bytes; an array a u32 element type, a u64 count and
the elements. Dims are stored fastest axis first (``ne[0]`` is the row
length), so the Hugging Face shape is the reversed dims.

The file is parsed here, over a read-only memory map, rather than with the
``gguf`` package's ``GGUFReader``: that reader trusts every count and length
it reads, so a corrupt file makes it raise arbitrary exceptions or allocate
arrays far larger than the file. Here every count, length, dim and offset is
checked against the bytes actually left before anything is allocated, so a
bad file raises :class:`~infer.errors.FormatError` with the file name and the
byte offset, and no allocation exceeds the file's size.

The normalization for each supported architecture (a row of
:data:`ARCHITECTURES`): metadata keys to ``config.json`` names, GGUF tensor
names to Hugging Face names, and the two layout fixes llama.cpp's converter
made: for ``llama`` it permuted the rows of the Q and K projections (for its
rope kernel), which is undone here on the raw rows, so quantized tensors stay
quantized; for ``gemma3`` it stored every RMSNorm weight as ``w + 1``, from
which 1 is subtracted (in float32, as transformers does) to give back the
checkpoint's ``w`` (Gemma's norm computes ``1 + w``).
"""

from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np

from infer.errors import FormatError, ModelNotFoundError, UnsupportedDtypeError
from infer.hookspecs import hookimpl
from infer.ops import QuantizedTensor
from infer.package import GenerationDefaults, ModelPackage, TensorSource
from infer.registry import FormatSpec

from . import gguf_quants
from .gguf_arch import build_config, canonical_name
from .gguf_quants import GGML_TYPES, GGMLType

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 2

# Metadata value types: id -> (name, struct format or None, size in bytes (minimum for variable ones)).
VALUE_TYPES: dict[int, tuple[str, str | None, int]] = {
    0: ("UINT8", "<B", 1), 1: ("INT8", "<b", 1), 2: ("UINT16", "<H", 2), 3: ("INT16", "<h", 2),
    4: ("UINT32", "<I", 4), 5: ("INT32", "<i", 4), 6: ("FLOAT32", "<f", 4), 7: ("BOOL", "<?", 1),
    8: ("STRING", None, 8), 9: ("ARRAY", None, 12), 10: ("UINT64", "<Q", 8), 11: ("INT64", "<q", 8),
    12: ("FLOAT64", "<d", 8),
}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}
TYPE_STRING = 8
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file describes it (validated)."""

    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the fastest axis
    type: GGMLType
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy, Hugging Face) shape: the dims reversed."""
        return self.dims[::-1]


class _Cursor:
    """Reads little-endian values from a buffer, checking every read against its end."""

    def __init__(self, buf: Any, size: int, path: Path, pos: int = 0) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, pos

    def fail(self, what: str, at: int | None = None, hint: str = "; the file is truncated or corrupt") -> FormatError:
        return FormatError(f"{self.path}: {what} (at byte {self.pos if at is None else at}){hint}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str, strict: bool = True) -> str:
        at = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if strict:
                raise self.fail(f"{what} is not valid UTF-8", at + 8 + exc.start) from None
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """A metadata value of type ``vtype``: a Python scalar or str, a
        :class:`StringArray` for an array of strings, a list for an array of
        arrays, or a numpy array (a copy) for arrays of numbers."""
        if vtype not in VALUE_TYPES:
            raise self.fail(f"{what} has unknown value type {vtype} (known: 0..12)", self.pos - 4)
        name, fmt, size = VALUE_TYPES[vtype]
        if fmt is not None:
            return self.unpack(fmt, size, what)
        if vtype == TYPE_STRING:
            return self.string(what, strict=False)
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_NESTING} deep")
        etype = self.u32(f"element type of {what}")
        count = self.u64(f"length of {what}")
        if etype not in VALUE_TYPES:
            raise self.fail(f"{what} has unknown element type {etype} (known: 0..12)", self.pos - 12)
        # Check the count against the bytes left before allocating anything for it.
        self.need(count * VALUE_TYPES[etype][2], f"{what} ({count} elements of {VALUE_TYPES[etype][0]})")
        if etype in _NUMPY:
            out = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos).copy()
            self.pos += count * VALUE_TYPES[etype][2]
            return out
        if etype == TYPE_STRING:
            return self.strings(count, what)
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]

    def strings(self, count: int, what: str) -> StringArray:
        """``count`` strings (the fast path for vocabularies of 10^5 tokens)."""
        buf, size, pos, pieces = self.buf, self.size, self.pos, []
        ends = np.empty(count, np.int64)
        unpack, append, total = _U64.unpack_from, pieces.append, 0
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"length of {what}[{i}] needs 8 bytes but only {size - pos} remain")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.fail(f"{what}[{i}] ({n} bytes) needs {n} bytes but only {size - pos} remain")
            append(buf[pos:pos + n])
            pos += n
            total += n
            ends[i] = total
        self.pos = pos
        return StringArray(b"".join(pieces), ends)


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded (UTF-8, invalid bytes replaced) when
    an item is read. A vocabulary of 49k tokens and as many merges held as
    Python strings takes about 8 MiB that a loaded model never reads again
    (its tokenizer keeps its own copy); held as the strings' bytes and their
    end offsets, about 1 MiB. It compares equal to any sequence of the same
    strings; ``list(array)`` gives a plain list."""

    __slots__ = ("_data", "_ends")

    def __init__(self, data: bytes, ends: np.ndarray) -> None:
        self._data = data
        self._ends = ends.astype(np.uint32) if len(data) < 2**32 else ends

    def __len__(self) -> int:
        return len(self._ends)

    def _item(self, i: int) -> str:
        start = int(self._ends[i - 1]) if i else 0
        return self._data[start:int(self._ends[i])].decode("utf-8", errors="replace")

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} strings")
        return self._item(i)

    def __iter__(self) -> Any:
        data, start = self._data, 0
        for end in self._ends.tolist():
            yield data[start:end].decode("utf-8", errors="replace")
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._data == other._data and np.array_equal(self._ends, other._ends)
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


class GGUFFile:
    """A GGUF file, memory-mapped read-only, with its header, metadata and tensor
    infos validated. ``metadata`` maps keys to values (see :meth:`_Cursor.value`),
    ``value_types`` keys to their GGUF value type ids, ``tensors`` names to
    :class:`TensorInfo` in file order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFoundError(f"{self.path} does not exist")
        try:
            with open(self.path, "rb") as f:
                self.size = f.seek(0, 2)
                if self.size < 24:
                    raise FormatError(f"{self.path}: {self.size} bytes is too short for a GGUF file "
                                      f"(the header alone is 24 bytes)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise FormatError(f"{self.path}: cannot read: {exc}") from exc
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        c = _Cursor(self._map, self.size, self.path)
        if self._map[:4] != MAGIC:
            raise c.fail(f"not a GGUF file: expected magic {MAGIC!r}, found {bytes(self._map[:4])!r}", 0, "")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = (" (a big-endian file; infer reads little-endian GGUF only)" if swapped in (2, 3) else
                    " (version 1 files are from before August 2023: convert the model again)"
                    if self.version == 1 else "")
            raise c.fail(f"unsupported GGUF version {self.version}: expected 2 or 3{hint}", 4, "")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Every entry takes a minimum number of bytes: absurd counts fail before any allocation.
        if n_kv * 13 > self.size - c.pos:
            raise c.fail(f"metadata count {n_kv} cannot fit in a file of {self.size} bytes", 16)
        if n_tensors * 24 > self.size - c.pos:
            raise c.fail(f"tensor count {n_tensors} cannot fit in a file of {self.size} bytes", 8)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, int] = {}
        for i in range(n_kv):
            at = c.pos
            key = c.string(f"key of metadata entry {i}")
            if key in self.metadata:
                raise c.fail(f"metadata key {key!r} appears twice", at)
            vtype = c.u32(f"value type of {key!r}")
            self.metadata[key] = c.value(vtype, f"metadata {key!r}")
            self.value_types[key] = vtype
        self.alignment = self._alignment()
        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        self.data_start = -(-c.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, gtype, offset, at in infos:
            if name in self.tensors:
                raise c.fail(f"tensor {name!r} appears twice", at)
            nbytes = math.prod(dims) // gtype.block_size * gtype.type_size
            begin = self.data_start + offset
            if offset % self.alignment:
                raise c.fail(f"tensor {name!r}: data offset {offset} is not a multiple of the "
                             f"alignment {self.alignment}", at)
            if begin + nbytes > self.size:
                raise c.fail(f"tensor {name!r}: {gtype.name} {list(dims)} needs bytes {begin}..{begin + nbytes}, "
                             f"past the end of the file ({self.size} bytes)", at)
            self.tensors[name] = TensorInfo(name, dims, gtype, begin, begin + nbytes)
        spans = sorted((t.begin, t.end, t.name) for t in self.tensors.values() if t.end > t.begin)
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise FormatError(f"{self.path}: the data of tensors {a!r} and {b!r} overlap "
                                  f"(at byte {begin}); the file is corrupt")

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata["general.alignment"], self.value_types["general.alignment"]
        if vtype != 4 or value == 0 or value & (value - 1):
            raise FormatError(f"{self.path}: general.alignment must be a UINT32 power of two, found "
                              f"{value!r} of type {VALUE_TYPES[vtype][0]}")
        return value

    def _tensor_info(self, c: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int, int]:
        at = c.pos
        name = c.string(f"name of tensor {i}")
        n_dims = c.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions: expected 1 to {MAX_DIMS}", c.pos - 4)
        dims = tuple(c.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        if not all(0 < d < 2**63 for d in dims):
            raise c.fail(f"tensor {name!r} has dims {list(dims)}: each must be 1 to 2^63 - 1", c.pos - 8 * n_dims)
        type_id = c.u32(f"type of tensor {name!r}")
        gtype = GGML_TYPES.get(type_id)
        if gtype is None:
            raise c.fail(f"tensor {name!r} has unknown GGML type id {type_id}", c.pos - 4)
        if dims[0] % gtype.block_size:
            raise c.fail(f"tensor {name!r}: row length {dims[0]} is not a multiple of the {gtype.name} "
                         f"block size {gtype.block_size}", at)
        if math.prod(dims) // gtype.block_size * gtype.type_size > self.size:
            raise c.fail(f"tensor {name!r}: {gtype.name} dims {list(dims)} need more bytes than the "
                         f"file's {self.size}", at)
        offset = c.u64(f"data offset of tensor {name!r}")
        return name, dims, gtype, offset, at

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes, a read-only uint8 view [rows, bytes per row]."""
        row = info.type.row_bytes(info.dims[0])
        rows = math.prod(info.dims[1:])
        if info.end == info.begin:
            return np.zeros((rows, row), np.uint8)
        return np.frombuffer(self._map, np.uint8, info.end - info.begin, info.begin).reshape(rows, row)

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's whole pages from this process's resident set
        (``MADV_DONTNEED`` on the read-only map: the page cache keeps them, and
        any view still using them faults them back in from the file)."""
        self.release_bytes(info.begin, info.end)

    def release_bytes(self, begin: int, end: int) -> None:
        """:meth:`release` for the whole pages inside bytes ``[begin, end)`` of the file."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or end <= begin:
            return
        page = mmap.PAGESIZE
        start, stop = -(-begin // page) * page, end // page * page
        if stop > start:
            try:
                self._map.madvise(advice, start, stop - start)
            except (ValueError, OSError):  # closed map, or an OS that refuses: only a hint
                pass

    def close(self) -> None:
        """Unmap the file (arrays handed out keep the map alive until they are freed)."""
        try:
            self._map.close()
        except (BufferError, AttributeError):
            pass


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file's header, metadata and tensor infos."""
    return GGUFFile(Path(path))


class GGUFQuantizedTensor(QuantizedTensor):
    """A GGUF tensor still in its quantized blocks.

    ``raw`` is uint8 ``[rows, bytes_per_row]`` (a zero-copy, read-only view of the
    file where no rows were reordered), ``shape`` the canonical (Hugging Face)
    shape, whose last axis is the quantized row.
    """

    def __init__(self, qtype: str, shape: tuple[int, ...], raw: np.ndarray, name: str = "a tensor",
                 file: GGUFFile | None = None, begin: int = 0) -> None:
        self.qtype, self.shape, self.raw, self.name = qtype, tuple(shape), raw, name
        t = gguf_quants.TYPES_BY_NAME[qtype]
        self.block_size, self.type_size = t.block_size, t.type_size
        # Where ``raw`` is the file's own bytes (rows in file order): its map and offset.
        self._file, self._begin = file, begin

    def release_rows(self, start: int, stop: int) -> None:
        """Drop the file pages of rows ``[start, stop)`` from the resident set
        (see :meth:`GGUFFile.release`); nothing when the rows are a copy."""
        if self._file is not None:
            row = self.raw.nbytes // self.shape[0]
            self._file.release_bytes(self._begin + start * row, self._begin + stop * row)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored blocks."""
        return int(self.raw.nbytes)

    def affine_layout(self) -> tuple[int, int] | None:
        """``(bits, group)`` of the types with an exact affine form (see
        :func:`~infer.formats.gguf_quants.affine_groups`), None for the others."""
        bits = gguf_quants.AFFINE_BITS.get(self.qtype)
        return None if bits is None else (bits, gguf_quants.AFFINE_GROUP[self.qtype])

    def affine_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Codes, scales and biases of rows ``[start, stop)``, unpacked from their blocks."""
        raw = self.raw.reshape(self.shape[0], -1)[start:stop]
        return gguf_quants.affine_groups(raw, self.qtype, self.shape[-1])

    def dequantize(self) -> np.ndarray:
        """The float32 values, shaped :attr:`shape` (bit-exact with ggml's dequantization)."""
        return gguf_quants.dequantize(self.raw, self.qtype, self.name).reshape(self.shape)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """Only the rows ``rows`` (e.g. the tokens of an embedding lookup), float32."""
        picked = self.raw.reshape(self.shape[0], -1)[np.asarray(rows)]
        return gguf_quants.dequantize(picked, self.qtype, self.name).reshape((len(picked),) + self.shape[1:])

    def stacked(self, parts: Sequence[QuantizedTensor]) -> GGUFQuantizedTensor | None:
        """The parts' rows one after another (each row is whole blocks), when
        all are 2-D GGUF tensors of this type and width."""
        if not all(isinstance(p, GGUFQuantizedTensor) and p.qtype == self.qtype and len(p.shape) == 2
                   and p.shape[1:] == self.shape[1:] for p in parts):
            return None
        raw = np.concatenate([p.raw.reshape(p.shape[0], -1) for p in parts], axis=0)
        names = "+".join(p.name for p in parts)  # type: ignore[attr-defined]
        return GGUFQuantizedTensor(self.qtype, (raw.shape[0], *self.shape[1:]), raw, names)

    def __repr__(self) -> str:
        return f"GGUFQuantizedTensor({self.name!r}, {self.qtype}, shape={self.shape})"


_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class _Entry:
    info: TensorInfo
    shape: tuple[int, ...]
    permute_heads: int | None  # undo llama.cpp's Q/K row permutation for this many heads
    norm_offset: float  # subtracted after reading (gemma3 norms)


class GGUFTensorSource(TensorSource):
    """The tensors of a GGUF file under their Hugging Face names and layouts.

    ``get`` returns float32 tensors as read-only views of the file, float16 as
    float16 views, bfloat16 widened to float32, and quantized types as
    :class:`GGUFQuantizedTensor`. Rows permuted back (llama Q/K) are copies;
    norm weights with an offset (gemma3) come back as new float32 arrays.
    """

    def __init__(self, file: GGUFFile, entries: dict[str, _Entry]) -> None:
        self.file, self._entries = file, entries

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise self._missing(name) from None

    def names(self) -> list[str]:
        """Canonical names, in the order of the file's tensor infos."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """Canonical (Hugging Face) shape: the GGUF dims reversed."""
        return self._entry(name).shape

    def storage_dtype(self, name: str) -> str:
        """``"float32"``, ``"float16"``, ``"bfloat16"``, or the GGML type name (``"Q4_K"``...)."""
        t = self._entry(name).info.type.name
        return _FLOAT_NAMES.get(t, t)

    def gguf_name(self, name: str) -> str:
        """The tensor's name in the file (``blk.0.attn_q.weight``...)."""
        return self._entry(name).info.name

    def location(self, name: str) -> str:
        """The file name, and the GGUF tensor name for a known tensor."""
        entry = self._entries.get(name)
        return f"{self.file.path.name} ({entry.info.name})" if entry else str(self.file.path)

    def get(self, name: str) -> np.ndarray | GGUFQuantizedTensor:
        """The tensor in canonical layout (see the class docstring)."""
        e = self._entry(name)
        t = e.info.type
        try:
            raw = self.file.raw(e.info)
        except ValueError as exc:  # the map was closed
            raise FormatError(f"{self.file.path}: cannot read tensor {e.info.name!r}: {exc}") from exc
        mapped = not e.permute_heads and e.info.end > e.info.begin
        if e.permute_heads:  # rows of a matrix; elements of a bias (always a plain type)
            rows = raw.reshape(e.shape[0], -1)
            raw = rows[_unpermute_rows(e.shape[0], e.permute_heads)].reshape(raw.shape)
        if t.quantized:
            q = GGUFQuantizedTensor(t.name, e.shape, raw, e.info.name, file=self.file if mapped else None,
                                    begin=e.info.begin)
            return q.dequantize() - np.float32(e.norm_offset) if e.norm_offset else q
        data = gguf_quants.dequantize(raw, t.name, e.info.name) if t.name == "BF16" else raw.view(
            "<f4" if t.name == "F32" else "<f2")
        data = data.reshape(e.shape)
        if not data.dtype.isnative:  # big-endian host
            data = data.astype(data.dtype.newbyteorder("="))
        if e.norm_offset:
            with np.errstate(all="ignore"):
                data = data.astype(np.float32) - np.float32(e.norm_offset)
        return data

    def release(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is not None:
            self.file.release(entry.info)

    def close(self) -> None:
        """Unmap the file."""
        self.file.close()


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's ``permute``: within each head, the converter moved
    rows (0, 1), (2, 3)... of the rope pairs to rows (i, i + head_dim/2); this gathers them back."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _entries(file: GGUFFile, arch: Any, config: dict[str, Any]) -> dict[str, _Entry]:
    """Canonical name -> entry for every tensor of the file; unknown names are an error."""
    entries: dict[str, _Entry] = {}
    unknown = []
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    for info in file.tensors.values():
        if info.name in arch.ignored_tensors:
            continue
        hf = canonical_name(arch, info.name, layers)
        if hf is None:
            unknown.append(info.name)
            continue
        if info.type.name not in gguf_quants.SUPPORTED:
            raise UnsupportedDtypeError(
                f"{file.path}: tensor {info.name!r} is stored as {info.type.name}, which infer cannot "
                f"dequantize; supported: {', '.join(gguf_quants.SUPPORTED)}")
        heads = None
        if arch.permute_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", info.name):
            heads = config["num_attention_heads" if ".attn_q." in info.name else "num_key_value_heads"]
            if len(info.dims) == 1 and info.type.quantized:
                raise FormatError(f"{file.path}: tensor {info.name!r} is a quantized vector: its Q/K "
                                  f"permutation cannot be undone block-wise")
            if info.shape[0] % (2 * heads):
                raise FormatError(f"{file.path}: tensor {info.name!r} has {info.shape[0]} rows, not a multiple "
                                  f"of 2 x {heads} heads: cannot undo the Q/K permutation")
        offset = arch.norm_offset if re.search(r"norm\.weight$", info.name) else 0.0
        entries[hf] = _Entry(info, info.shape, heads, offset)
    if unknown:
        raise FormatError(f"{file.path}: tensors unknown for architecture {arch.gguf_name!r}: "
                          f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    return entries


def _token_id(metadata: dict[str, Any], key: str, vocab: int, path: Path) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise FormatError(f"{path}: {key} must be a token id below the vocabulary size {vocab}, found {value!r}")
    return value


def generation_defaults(file: GGUFFile, vocab_size: int) -> GenerationDefaults:
    """BOS and end tokens (eos, plus end-of-turn and end-of-message where given)."""
    md, path = file.metadata, file.path
    ends = [_token_id(md, f"tokenizer.ggml.{k}_token_id", vocab_size, path) for k in ("eos", "eot", "eom")]
    return GenerationDefaults(eos_token_ids=tuple(dict.fromkeys(i for i in ends if i is not None)),
                              bos_token_id=_token_id(md, "tokenizer.ggml.bos_token_id", vocab_size, path))


def detect(path: Path) -> bool:
    """True for a file starting with ``b"GGUF"``; never raises."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except (OSError, ValueError, TypeError):
        return False


def open_gguf(path: str | Path, *, tokenizer: bool = True) -> ModelPackage:
    """Open a GGUF file as a :class:`ModelPackage` (tensors stay memory-mapped).

    Raises :class:`~infer.errors.FormatError` for a malformed file,
    :class:`~infer.errors.UnsupportedArchitectureError` for an architecture
    without a mapping, :class:`~infer.errors.UnsupportedDtypeError` for a
    tensor type infer cannot read. ``tokenizer=False`` skips building the
    tokenizer (slow for large vocabularies) when only the weights are wanted.
    """
    file = read_gguf(path)
    try:
        arch, config = build_config(file)
        tensors = GGUFTensorSource(file, _entries(file, arch, config))
        generation = generation_defaults(file, config["vocab_size"])
        tok = None
        if tokenizer and "tokenizer.ggml.model" in file.metadata:
            from infer.formats.gguf_tokenizer import tokenizer_from_gguf  # lazily: building it is slow

            tok = tokenizer_from_gguf(file.metadata, source=str(file.path))
        elif tokenizer:
            log.warning("%s has no tokenizer metadata: text generation will need token ids", file.path)
    except BaseException:
        file.close()
        raise
    return ModelPackage(model_type=arch.model_type, config=config, tensors=tensors, tokenizer=tok,
                        generation=generation, path=Path(path), format="gguf")


@hookimpl
def infer_register_formats(register: Any) -> None:
    """Register the GGUF format."""
    register(FormatSpec(name="gguf", detect=detect, open=open_gguf,
                        description="GGUF file (llama.cpp): metadata + tensors, quantized or not"))
