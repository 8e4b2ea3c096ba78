"""The GGUF format: a llama.cpp ``.gguf`` file opened as a model package.

The container itself (header, metadata, tensor infos, the memory map) is read
by :mod:`infer.formats.gguf_file`; this module turns it into a
:class:`~infer.package.ModelPackage`.

The normalization for each supported architecture (a row of
:data:`~infer.formats.gguf_arch.ARCHITECTURES`): metadata keys to
``config.json`` names, GGUF tensor names to Hugging Face names, and the two
layout fixes llama.cpp's converter made: for ``llama`` it permuted the rows of
the Q and K projections (for its rope kernel), which is undone here on the raw
rows, so quantized tensors stay quantized; for ``gemma3`` it stored every
RMSNorm weight as ``w + 1``, from which 1 is subtracted (in float32, as
transformers does) to give back the checkpoint's ``w`` (Gemma's norm computes
``1 + w``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import FormatError, UnsupportedDtypeError
from infer.ops import QuantizedTensor
from infer.package import GenerationDefaults, IndexedTensorSource, ModelPackage
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import FormatSpec

from . import gguf_quants
from .gguf_arch import block_kind, build_config, canonical_name
from .gguf_file import MAGIC, GGUFFile, TensorInfo, read_gguf

log = logging.getLogger(__name__)


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

    def rows(self, start: int, stop: int) -> GGUFQuantizedTensor | None:
        """Rows ``[start, stop)``: each row is whole blocks, so a view of the
        same bytes (of the memory-mapped file, read only when used)."""
        if len(self.shape) != 2 or not 0 <= start <= stop <= self.shape[0]:
            return None
        raw = self.raw.reshape(self.shape[0], -1)
        return GGUFQuantizedTensor(self.qtype, (stop - start, self.shape[1]), raw[start:stop],
                                   f"{self.name}[{start}:{stop}]", self._file, self._begin + start * raw.shape[1])

    def affine_layout(self) -> tuple[int, int] | None:
        """``(bits, group)`` of the types with an exact affine form (see
        :func:`~infer.formats.gguf_quants.affine_groups`), None for the others."""
        bits = gguf_quants.AFFINE_BITS.get(self.qtype)
        return None if bits is None else (bits, gguf_quants.AFFINE_GROUP[self.qtype])

    def ggml_blocks(self) -> tuple[str, np.ndarray] | None:
        """The type and the stored blocks ``[rows, bytes_per_row]`` of a
        matrix: the file's own bytes (a view of the map) unless rows were
        reordered, or stacked from parts not one after another in the file,
        which made a copy."""
        if len(self.shape) != 2:
            return None
        return self.qtype, self.raw.reshape(self.shape[0], -1)

    def affine_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Codes, scales and biases of rows ``[start, stop)`` from their blocks
        (the compact form: 4-bit codes packed, stored float16 scales kept)."""
        raw = self.raw.reshape(self.shape[0], -1)[start:stop]
        return gguf_quants.affine_groups(raw, self.qtype, self.shape[-1], compact=True)

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
        names = "+".join(p.name for p in parts)  # type: ignore[attr-defined]
        rows = sum(p.shape[0] for p in parts)
        file, begin = parts[0]._file, parts[0]._begin  # type: ignore[attr-defined]
        if file is not None and all(p._file is file and p._begin == q._begin + q.raw.nbytes  # type: ignore[attr-defined]
                                    for q, p in zip(parts, parts[1:])):
            # One after another in the file (llama.cpp writes ffn_gate then ffn_up): the stack
            # is a view of the map, as the parts were. Copying SmolLM2's 30 gate+up pairs was
            # about 20 ms of its load, and their pages stayed resident twice.
            end = begin + sum(p.raw.nbytes for p in parts)
            raw = file.view(begin, end).reshape(rows, -1)
            return GGUFQuantizedTensor(self.qtype, (rows, *self.shape[1:]), raw, names, file, begin)
        raw = np.concatenate([p.raw.reshape(p.shape[0], -1) for p in parts], axis=0)
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
    expert: int | None = None  # one expert's rows of a stacked [experts, rows, cols] tensor
    transpose: bool = False  # Hugging Face stores the transpose (GPT-2's Conv1D)
    value_part: TensorInfo | None = None  # DeepSeek's kv_b_proj joined from attn_k_b (info) and attn_v_b
    #: (the GGUF tensors, the function of their float32 values that gives this tensor): Mamba-2's
    #: ``A_log`` from ``ssm_a``, split projections joined (``ArchitectureMap.rebuilt``).
    rebuild: tuple[tuple[TensorInfo, ...], Callable[..., np.ndarray]] | None = None
    #: Rearranged tensors (:mod:`.gguf_delta_net`): further tensors whose rows follow ``info``'s,
    #: the order to gather those rows in, the order of the columns, and a function of the float32
    #: values (A_log from llama.cpp's A = -exp(A_log)); ``shape`` is then the Hugging Face shape.
    parts: tuple[TensorInfo, ...] = ()
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    inverse: Any = None

    @property
    def rearranged(self) -> bool:
        return bool(self.parts) or self.rows is not None or self.cols is not None or self.inverse is not None


class GGUFTensorSource(IndexedTensorSource[_Entry]):
    """The tensors of a GGUF file under their Hugging Face names and layouts.

    ``get`` returns float32 tensors as read-only views of the file, float16 as
    float16 views, bfloat16 widened to float32, and quantized types as
    :class:`GGUFQuantizedTensor`. Rows permuted back (llama Q/K) are copies;
    norm weights with an offset (gemma3) come back as new float32 arrays.
    """

    def __init__(self, file: GGUFFile, entries: dict[str, _Entry]) -> None:
        # The table is in the order of the file's tensor infos; each shape is the GGUF dims reversed.
        self.file, self._entries = file, entries

    def storage_dtype(self, name: str) -> str:
        """``"float32"``, ``"float16"``, ``"bfloat16"``, or the GGML type name (``"Q4_K"``...)."""
        e = self._entry(name)
        if (e.transpose or e.value_part is not None or e.rebuild is not None
                or (e.rearranged and not self._rows_only(e))):  # rebuilt in float32
            return "float32"
        return _FLOAT_NAMES.get(e.info.type.name, e.info.type.name)

    def stored_nbytes(self, name: str) -> int:
        """Bytes of the tensor's data in the file, from its offsets (nothing read): one
        expert's share of a stacked tensor; both halves of a joined one."""
        e = self._entry(name)
        size = e.info.end - e.info.begin
        if e.rebuild is not None:
            return sum(i.end - i.begin for i in e.rebuild[0])
        if e.expert is not None:
            return size // e.info.shape[0]
        size += sum(p.end - p.begin for p in e.parts)
        return size + (e.value_part.end - e.value_part.begin if e.value_part is not None else 0)

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
        if e.rebuild is not None:
            infos, rebuild = e.rebuild
            try:
                parts = [self._floats(i, self.file.raw(i)) for i in infos]
            except ValueError as exc:  # the map was closed
                raise FormatError(f"{self.file.path}: cannot read tensor {e.info.name!r}: {exc}") from exc
            return np.ascontiguousarray(rebuild(*parts), dtype=np.float32)
        try:
            raw = self.file.raw(e.info)
        except ValueError as exc:  # the map was closed
            raise FormatError(f"{self.file.path}: cannot read tensor {e.info.name!r}: {exc}") from exc
        if e.value_part is not None:
            return _join_kv_b(self._floats(e.info, raw), self._floats(e.value_part, self.file.raw(e.value_part)))
        if e.rearranged:
            return self._rearrange(e)
        begin = e.info.begin
        if e.expert is not None:  # the expert's rows: whole blocks, so quantized ones stay quantized
            rows = e.shape[0]
            raw = raw[e.expert * rows:(e.expert + 1) * rows]
            begin += e.expert * raw.nbytes
        mapped = not e.permute_heads and e.info.end > e.info.begin
        if e.transpose:  # a copy: dequantized, in the Hugging Face layout
            return np.ascontiguousarray(self._floats(e.info, raw).T)
        if e.permute_heads:  # rows of a matrix; elements of a bias (always a plain type)
            rows = raw.reshape(e.shape[0], -1)
            raw = rows[_unpermute_rows(e.shape[0], e.permute_heads)].reshape(raw.shape)
        if t.quantized:
            q = GGUFQuantizedTensor(t.name, e.shape, raw, e.info.name, file=self.file if mapped else None,
                                    begin=begin)
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

    @staticmethod
    def _rows_only(e: _Entry) -> bool:
        """Whether ``e`` only gathers whole rows of one quantized type (so it stays quantized)."""
        infos = (e.info, *e.parts)
        return (e.cols is None and e.inverse is None and len(e.shape) == 2 and e.info.type.quantized
                and all(i.type.name == e.info.type.name and len(i.shape) == 2 for i in infos))

    def _rearrange(self, e: _Entry) -> np.ndarray | GGUFQuantizedTensor:
        """A joined / reordered tensor: quantized rows are gathered as they are stored (whole
        blocks); anything else is rebuilt in float32."""
        infos = (e.info, *e.parts)
        if self._rows_only(e):
            raw = np.concatenate([self.file.raw(i).reshape(i.shape[0], -1) for i in infos], axis=0)
            if e.rows is not None:
                raw = raw[e.rows]
            return GGUFQuantizedTensor(e.info.type.name, e.shape, np.ascontiguousarray(raw),
                                       "+".join(i.name for i in infos))
        parts = [self._floats(i, self.file.raw(i)) for i in infos]
        data = np.concatenate([p.reshape(p.shape[0], -1) if p.ndim > 1 else p for p in parts], axis=0)
        if e.rows is not None:
            data = data[e.rows]
        if e.cols is not None:
            data = data[:, e.cols]
        if e.inverse is not None:
            with np.errstate(all="ignore"):
                data = e.inverse(data)
        return np.ascontiguousarray(data, dtype=np.float32).reshape(e.shape)

    def _floats(self, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
        """``raw`` (the stored bytes of ``info``) as float32, shaped as stored."""
        t = info.type
        if t.quantized or t.name == "BF16":
            data = gguf_quants.dequantize(raw, t.name, info.name)
        else:
            data = raw.view("<f4" if t.name == "F32" else "<f2").astype(np.float32)
        return data.reshape(info.shape)

    def release(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        if entry.value_part is not None:
            self.file.release(entry.value_part)
        for info in entry.rebuild[0] if entry.rebuild is not None else ():
            self.file.release(info)
        for part in entry.parts:
            self.file.release(part)
        if entry.expert is None:
            self.file.release(entry.info)
        else:  # only this expert's bytes: the others may not be read yet
            size = (entry.info.end - entry.info.begin) // entry.info.shape[0]
            start = entry.info.begin + entry.expert * size
            self.file.release_bytes(start, start + size)

    def close(self) -> None:
        """Unmap the file."""
        self.file.close()


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's ``permute``: within each head, the converter moved
    rows (0, 1), (2, 3)... of the rope pairs to rows (i, i + head_dim/2); this gathers them back."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` ``[heads * (nope + v), kv_lora_rank]`` from the two halves
    llama.cpp's converter splits it into for absorbed MLA: ``attn_k_b`` ``[heads,
    kv_lora_rank, nope]`` (each head's key part, transposed) and ``attn_v_b`` ``[heads, v,
    kv_lora_rank]``."""
    return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1]))


_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")


def _entries(file: GGUFFile, arch: Any, config: dict[str, Any]) -> dict[str, _Entry]:
    """Canonical name -> entry for every tensor of the file; unknown names are an error."""
    entries: dict[str, _Entry] = {}
    unknown = []
    halves: dict[str, dict[str, TensorInfo]] = {}  # layer -> {"k": attn_k_b, "v": attn_v_b}
    layers = config.get("num_hidden_layers", config.get("n_layer", 0)) + config.get("num_nextn_predict_layers", 0)
    consumed: set[str] = set()
    for hf, (shape, infos, rebuild) in (arch.rebuilt(file, config, arch) if arch.rebuilt else {}).items():
        for info in infos:
            if info.type.name not in gguf_quants.SUPPORTED:
                raise UnsupportedDtypeError(f"{file.path}: tensor {info.name!r} is stored as {info.type.name}, "
                                            f"which infer cannot dequantize")
        entries[hf] = _Entry(infos[0], tuple(shape), None, 0.0, rebuild=(tuple(infos), rebuild))
        consumed.update(info.name for info in infos)
    for info in file.tensors.values():
        if info.name in arch.ignored_tensors or info.name in consumed:
            continue
        hf = canonical_name(arch, info.name, layers)
        split = _KV_B.fullmatch(info.name) if "attn_kv_b" in arch.layer_tensors else None
        if split is not None:
            halves.setdefault(split[1], {})[split[2]] = info
            continue
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
        kind = block_kind(info.name)
        offset = arch.norm_offset if re.search(r"norm\.weight$", info.name) and kind not in arch.plain_norms else 0.0
        if "{e}" in hf:
            if len(info.shape) != 3:
                raise FormatError(f"{file.path}: expert tensor {info.name!r} has shape {list(info.shape)}; "
                                  f"expected [experts, rows, columns]")
            for e in range(info.shape[0]):
                entries[hf.format(e=e)] = _Entry(info, info.shape[1:], heads, offset, expert=e)
            continue
        transpose = kind in arch.transposed and len(info.shape) == 2
        shape = info.shape[::-1] if transpose else info.shape
        if kind in arch.unsqueezed and len(shape) == 2:  # a float reshape; quantized data keeps its rows
            shape = (shape[0], 1, shape[1])
        entries[hf] = _Entry(info, shape, heads, offset, transpose=transpose)
    for layer, pair in halves.items():
        k, v = pair.get("k"), pair.get("v")
        if k is None or v is None or len(k.shape) != 3 or len(v.shape) != 3 or k.shape[0] != v.shape[0] \
                or k.shape[1] != v.shape[2]:
            raise FormatError(f"{file.path}: block {layer} needs attn_k_b [heads, rank, nope] and attn_v_b "
                              f"[heads, v, rank] together; found {k and list(k.shape)} and {v and list(v.shape)}")
        shape = (k.shape[0] * (k.shape[2] + v.shape[1]), k.shape[1])
        entries[f"{arch.layer_prefix}.{layer}.self_attn.kv_b_proj.weight"] = _Entry(k, shape, None, 0.0, value_part=v)
    if unknown:
        raise FormatError(f"{file.path}: tensors unknown for architecture {arch.gguf_name!r}: "
                          f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    if arch.fix_entries is not None:
        arch.fix_entries(entries, file, arch, config)
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
        if file.metadata.get("general.architecture") == "clip":
            from infer.errors import MmprojError

            raise MmprojError(f"{file.path} is an mmproj file (a vision tower and projector, general.architecture "
                              "'clip'), not a model: load the text model's GGUF with mmproj= (--mmproj) naming it")
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
    return ModelPackage(model_type=config["model_type"], config=config, tensors=tensors, tokenizer=tok,
                        generation=generation, path=Path(path), format="gguf")


def random_tensor(qtype: str, shape: tuple[int, int], seed: int) -> GGUFQuantizedTensor:
    """A random but finite ``qtype`` matrix (:func:`~infer.formats.gguf_quants.random_blocks`):
    the conformance kit's quantized weights."""
    rows, cols = shape
    raw = gguf_quants.random_blocks(qtype, rows, cols, seed=seed)
    return GGUFQuantizedTensor(qtype, (rows, cols), raw, f"random {qtype}")


@hookimpl
def infer_register_formats(register: Any) -> None:
    """Register the GGUF format."""
    register(FormatSpec(name="gguf", detect=detect, open=open_gguf,
                        description="GGUF file (llama.cpp): metadata + tensors, quantized or not",
                        random_tensor=random_tensor, write=_write, write_types=WRITE_TYPES,
                        read_adapter=_read_adapter, write_adapter=_write_adapter,
                        open_pair=_open_pair, split_pair=_split_pair))


def _open_pair(model: Path, projector: Path, *, tokenizer: bool = True) -> ModelPackage:
    """The text GGUF ``model`` and llama.cpp's vision projector file ``projector`` (an
    mmproj GGUF) as one vision-language package (:mod:`.gguf_mmproj`).

    Raises:
        MmprojError: ``projector`` is not an mmproj file, or ``model`` is one.
        UnknownProjectorError: the projector type is not one infer reads.
        MmprojMismatchError: the two files are not one model's (see :func:`.gguf_mmproj.pair_package`).
    """
    from .gguf_mmproj import pair_package, read_mmproj

    vision_file = read_gguf(projector)
    text = None
    try:
        proj = read_mmproj(vision_file)
        entries = {name: _Entry(info, info.shape, None, offset) for name, (info, offset) in proj.tensors.items()}
        for name, (infos, rebuild) in proj.rebuilt.items():  # Qwen's patch kernel from its two frames
            frame = infos[0].shape
            entries[name] = _Entry(infos[0], (*frame[:2], len(infos), *frame[2:]), None, 0.0,
                                   rebuild=(infos, rebuild))
        text = open_gguf(model, tokenizer=tokenizer)
        return pair_package(proj, GGUFTensorSource(vision_file, entries), text, Path(model), Path(projector))
    except BaseException:
        vision_file.close()
        if text is not None:
            text.tensors.close()
        raise


def _split_pair(package: ModelPackage) -> Any:
    from .gguf_mmproj import split_pair, write_mmproj

    pair = split_pair(package)
    if pair is None:
        return None
    return pair[0], lambda path, *, type="f16": write_mmproj(package, Path(path), type=type)


def _read_adapter(path: Path, config: dict[str, Any] | None = None) -> Any:
    from .gguf_adapter import read_adapter

    return read_adapter(path, config)


def _write_adapter(path: Path, model_type: str, modules: Any, config: dict[str, Any], **options: Any) -> None:
    from .gguf_adapter import write_adapter

    write_adapter(path, model_type, modules, config, **options)


#: What ``infer convert --type`` may ask for, the default first: gguf_write.TYPES's keys, listed
#: here so that registering the format does not import the writer (a few milliseconds of every
#: load); tests/test_format_gguf.py checks the two agree.
WRITE_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_k_m",
               "q5_k_m")


def _write(package: ModelPackage, path: Path, **options: Any) -> None:
    from .gguf_write import write_gguf  # lazily: only `infer convert` needs the writer

    write_gguf(package, path, **options)
