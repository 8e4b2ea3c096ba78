"""The GGUF container (llama.cpp's single-file format): header, metadata, tensor infos.

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

This module knows the container only; what its names mean in Hugging Face
terms is :mod:`infer.formats.gguf_arch`'s, and the format plugin that opens a
model from it is :mod:`infer.formats.gguf`.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import FormatError, ModelNotFoundError

from .gguf_quants import GGML_TYPES, GGMLType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 2
#: The longest metadata string (a key, a tensor name, a chat template) read
#: into a Python ``str``. The longest in published files are chat templates of
#: tens of KB; a length field beyond this is corruption, refused before a byte
#: is copied (a Python str of the file's size would cost several times it).
MAX_STRING_BYTES = 16 << 20

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

try:
    import infer.formats._gguf_strings as _gguf_strings
except ImportError:  # the extension did not compile: the walk is Python's
    _gguf_strings = None


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
        #: Bytes that must remain after the value being read: the smallest
        #: size of the entries still to come, so no string can span them.
        self.reserve = 0

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
        if n > MAX_STRING_BYTES:
            raise self.fail(f"{what} claims {n} bytes; the limit for a metadata string is {MAX_STRING_BYTES}")
        self.need(n + self.reserve, f"{what} ({n} bytes) and the {self.reserve} bytes the entries after it "
                                    f"take at least")
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
        """``count`` strings (the fast path for vocabularies of 10^5 tokens).

        The loop only walks the length prefixes (each string's place depends on
        the one before); the bytes are then gathered in one numpy step, so no
        string is decoded or sliced here."""
        buf, size, start = self.buf, self.size, self.pos
        if _gguf_strings is not None:  # the same walk in C, 50 ms less for Gemma 3's 262k tokens
            walked = _gguf_strings.walk(memoryview(buf)[:size], start, count)
            if walked is None:
                self._fail_strings(count, start, what)
            data, ends, self.pos = walked
            return StringArray(data, np.frombuffer(ends, np.int64))
        found: list[int] = []
        unpack, append, pos = _U64.unpack_from, found.append, start
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8 + n
                append(n)
        except (struct.error, OverflowError):  # a length prefix cut off by the end of the file, or an
            pos = size + 1                      # absurd length that carried the walk past any offset
        if pos > size:  # checked once: a length past the end only makes the walk overshoot
            self._fail_strings(count, start, what)
        lengths = np.array(found, np.int64)
        ends = np.cumsum(lengths)
        total = pos - start
        raw = np.frombuffer(buf, np.uint8, total, start)
        # Drop the 8-byte prefix in front of each string: prefix i starts at 8 * i + ends[i - 1].
        prefixes = (8 * np.arange(count) + ends - lengths)[:, None] + np.arange(8)
        keep = np.ones(total, bool)
        keep[prefixes.reshape(-1)] = False
        self.pos = pos
        return StringArray(raw[keep].tobytes(), ends)

    def _fail_strings(self, count: int, start: int, what: str) -> None:
        """Fail naming the first string of an array that runs past the end of the file."""
        pos = start
        for i in range(count):
            if pos + 8 > self.size:
                self.pos = pos
                raise self.fail(f"length of {what}[{i}] needs 8 bytes but only {self.size - pos} remain")
            (n,) = _U64.unpack_from(self.buf, pos)
            pos += 8
            if n > self.size - pos:
                self.pos = pos
                raise self.fail(f"{what}[{i}] ({n} bytes) needs {n} bytes but only {self.size - pos} remain")
            pos += n
        raise AssertionError("unreachable: the walk found the array past the end of the file")


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

    def stored(self) -> tuple[bytes, np.ndarray]:
        """The strings as stored: their bytes one after another, and where each ends."""
        return self._data, self._ends

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
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        """Every string, decoded. Valid UTF-8 whose strings each start on a
        character (every vocabulary seen) is decoded in one call and cut at
        character offsets; anything else string by string, invalid bytes replaced."""
        data, ends = self._data, self._ends.astype(np.int64)
        if not len(ends):
            return []
        raw = np.frombuffer(data, np.uint8)
        continuation = (raw & 0xC0) == 0x80
        starts = np.concatenate(([0], ends[:-1]))
        inside = starts[starts < len(raw)]
        try:
            text = data.decode("utf-8") if not continuation[inside].any() else None
        except UnicodeDecodeError:
            text = None
        if text is None:
            out, start = [], 0
            for end in ends.tolist():
                out.append(data[start:end].decode("utf-8", errors="replace"))
                start = end
            return out
        # Characters before each byte offset: the bytes that are not continuation bytes.
        chars = np.concatenate(([0], np.cumsum(~continuation)))
        char_ends = chars[ends].tolist()
        return [text[a:b] for a, b in zip([0] + char_ends[:-1], char_ends)]

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
            c.reserve = (n_kv - 1 - i) * 13 + n_tensors * 24
            key = c.string(f"key of metadata entry {i}")
            if key in self.metadata:
                raise c.fail(f"metadata key {key!r} appears twice", at)
            vtype = c.u32(f"value type of {key!r}")
            self.metadata[key] = c.value(vtype, f"metadata {key!r}")
            self.value_types[key] = vtype
        c.reserve = 0
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

    def view(self, begin: int, end: int) -> np.ndarray:
        """Bytes ``[begin, end)`` of the file, a read-only uint8 view of the map."""
        return np.frombuffer(self._map, np.uint8, end - begin, begin)

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
