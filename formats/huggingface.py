"""Hugging Face model folders: ``config.json`` + safetensors + tokenizer.

A folder is recognised by its ``config.json``. Weights come from
``model.safetensors``, else from the shards listed in
``model.safetensors.index.json``, else from every ``*.safetensors`` file (the
order transformers uses). Tensor names are kept exactly as stored: Hugging
Face names are infer's canonical names, except MTP modules in Qwen3-Next's
naming, renamed to DeepSeek-V3's (:func:`normalize_mtp_names`).

Pickle checkpoints (``pytorch_model.bin``, ``*.pt``...) are refused, never
loaded: unpickling can execute arbitrary code.

Why safetensors is parsed here rather than with the ``safetensors`` package:
its numpy API cannot represent bfloat16 (``safe_open(framework="numpy")``
raises ``TypeError: data type 'bfloat16' not understood``), and most current
checkpoints are bfloat16. The format is small and documented
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian
u64 header length N, N bytes of UTF-8 JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
first byte after the header) plus an optional ``"__metadata__"`` object, then
the data, little-endian and row-major. Only the header is read; the file is
memory-mapped read-only, so opening a 10 GB checkpoint costs a few kilobytes
and a tensor's bytes are touched only when :meth:`SafetensorsSource.get` asks.
Every header field is validated before use, so a corrupt file raises a
:class:`~infer.errors.FormatError` naming the file and tensor, never an
exception from numpy or struct.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import (
    ConfigError,
    FormatError,
    MissingTensorError,
    ModelNotFoundError,
    UnsafeFormatError,
    UnsupportedDtypeError,
)
from infer.package import GenerationDefaults, IndexedTensorSource, ModelPackage, TensorSource
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import FormatSpec

from .mxfp4 import mxfp4_tensors

log = logging.getLogger(__name__)

#: Safetensors dtype -> (infer dtype name, little-endian numpy dtype it is read as).
#: bfloat16 is read as raw uint16 and widened in :meth:`SafetensorsSource.get`.
DTYPES: dict[str, tuple[str, str]] = {
    "F32": ("float32", "<f4"),
    "F16": ("float16", "<f2"),
    "BF16": ("bfloat16", "<u2"),
    "I64": ("int64", "<i8"),
    "I32": ("int32", "<i4"),
    "I16": ("int16", "<i2"),
    "I8": ("int8", "i1"),
    "U8": ("uint8", "u1"),
    "BOOL": ("bool", "?"),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the Rust reference implementation's limit
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


# -- safetensors ------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str  # safetensors name, a key of DTYPES
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class _SafetensorsFile:
    """One memory-mapped safetensors file with its validated header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                if size < 8:
                    raise FormatError(f"{path}: {size} bytes is too short for a safetensors file "
                                      f"(expected an 8-byte header length first)")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8 or n > MAX_HEADER_BYTES:
                    raise FormatError(f"{path}: header length {n} is impossible for a file of "
                                      f"{size} bytes (limit {MAX_HEADER_BYTES}); the file is truncated or "
                                      f"not safetensors")
                raw = f.read(n)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise FormatError(f"{path}: cannot read: {exc}") from exc
        try:
            self.entries, self.metadata = self._parse_header(raw, size - 8 - n, 8 + n)
        except BaseException:
            self.close()
            raise

    def _parse_header(self, raw: bytes, data_size: int, data_start: int) -> tuple[dict[str, _Entry], dict]:
        path = self.path
        try:
            header = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: header is not UTF-8 (byte {exc.start + 8})") from exc
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}: header is not valid JSON: {exc.msg} at byte {exc.pos + 8}") from exc
        except RecursionError as exc:
            raise FormatError(f"{path}: header JSON is nested too deeply") from exc
        except ValueError as exc:  # an integer past Python's digit limit
            raise FormatError(f"{path}: header JSON holds an unreadable value: {exc}") from exc
        if not isinstance(header, dict):
            raise FormatError(f"{path}: header must be a JSON object, found {type(header).__name__}")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict):
            raise FormatError(f"{path}: __metadata__ must be an object, found {type(metadata).__name__}")
        entries = {}
        for name, info in header.items():
            where = f"{path}: tensor {name!r}"
            if not isinstance(info, dict):
                raise FormatError(f"{where}: entry must be an object, found {type(info).__name__}")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype, str):
                raise FormatError(f"{where}: dtype must be a string, found {dtype!r}")
            if dtype not in DTYPES:
                raise UnsupportedDtypeError(f"{where}: dtype {dtype!r} is not supported; "
                                            f"supported: {', '.join(DTYPES)}")
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise FormatError(f"{where}: shape must be a list of non-negative integers, found {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
                    or not 0 <= offsets[0] <= offsets[1] <= data_size):
                raise FormatError(f"{where}: data_offsets must be [begin, end] with "
                                  f"0 <= begin <= end <= {data_size} (the data size), found {offsets!r}")
            itemsize = np.dtype(DTYPES[dtype][1]).itemsize
            expected = math.prod(shape) * itemsize
            if offsets[1] - offsets[0] != expected:
                raise FormatError(f"{where}: {dtype} shape {shape} needs {expected} bytes, "
                                  f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
            begin, end = data_start + offsets[0], data_start + offsets[1]
            entries[name] = _Entry(path, dtype, tuple(shape), begin, end)
        # As the safetensors package: tensors may not share bytes (one write
        # would change two weights, and a crafted file could alias any tensor).
        spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise FormatError(f"{path}: tensors {a!r} and {b!r} overlap (bytes {begin_b} to "
                                  f"{min(end_a, begin_b)}... are in both); each tensor needs bytes of its own")
        return entries, metadata

    def array(self, entry: _Entry) -> np.ndarray:
        """A read-only view of the tensor's stored bytes, in its storage dtype."""
        np_dtype = np.dtype(DTYPES[entry.dtype][1])
        if entry.end == entry.begin:
            return np.zeros(entry.shape, np_dtype)
        count = (entry.end - entry.begin) // np_dtype.itemsize
        return np.frombuffer(self._map, np_dtype, count, entry.begin).reshape(entry.shape)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            # Arrays returned by get() still view the map; it is unmapped when
            # the last of them is garbage-collected.
            pass
        except AttributeError:
            pass


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsSource(IndexedTensorSource[_Entry]):
    """Tensors from one or more memory-mapped safetensors files.

    ``get`` returns float32/float16 (and integer) tensors as zero-copy,
    **read-only** views of the file map; bfloat16 is widened exactly to a new
    float32 array. Copy an array before writing to it.
    """

    def __init__(self, files: list[Path], only: dict[str, str] | None = None) -> None:
        """Open ``files``; with ``only`` (a sharded index's ``weight_map``),
        expose exactly those names and check each is in the shard it names."""
        self._files: dict[Path, _SafetensorsFile] = {}
        self._entries: dict[str, _Entry] = {}  # file by file, each in the order of its data
        try:
            for path in files:
                st = _SafetensorsFile(path)
                self._files[path] = st
                for name, entry in sorted(st.entries.items(), key=lambda kv: kv[1].begin):
                    if only is not None and only.get(name) != path.name:
                        continue
                    if name in self._entries:
                        raise FormatError(f"tensor {name!r} is in both {self._entries[name].file} and {path}")
                    self._entries[name] = entry
            for name, shard in (only or {}).items():
                if name not in self._entries:
                    raise self._missing_in(name, shard)
        except BaseException:
            self.close()
            raise

    def _missing_in(self, name: str, shard: str) -> MissingTensorError:
        return MissingTensorError(f"tensor {name!r} is listed in the index under shard {shard!r}, "
                                  f"but that shard does not contain it")

    def storage_dtype(self, name: str) -> str:
        """``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int64"``..."""
        return DTYPES[self._entry(name).dtype][0]

    def stored_nbytes(self, name: str) -> int:
        """Bytes of the tensor's data in its file, from the header (nothing read)."""
        entry = self._entry(name)
        return entry.end - entry.begin

    def location(self, name: str) -> str:
        """The file holding ``name``; for an unknown name, the folder."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry.file.name
        folders = {str(p.parent) for p in self._files}
        return ", ".join(sorted(folders)) or "no safetensors file"

    def get(self, name: str) -> np.ndarray:
        """The tensor as numpy: a read-only view for stored float32/float16/
        integers, a new float32 array for bfloat16 (widening is exact)."""
        entry = self._entry(name)
        try:
            data = self._files[entry.file].array(entry)
        except ValueError as exc:  # the map was closed
            raise FormatError(f"{entry.file}: cannot read tensor {name!r}: {exc}") from exc
        if entry.dtype == "BF16":
            # bfloat16 is the top half of a float32: shift the bits into place.
            return (data.astype(np.uint32) << 16).view(np.float32)
        if not data.dtype.isnative:  # big-endian host
            return data.astype(data.dtype.newbyteorder("="))
        return data

    def metadata(self) -> dict[str, Any]:
        """The ``__metadata__`` objects of all files, merged."""
        out: dict[str, Any] = {}
        for f in self._files.values():
            out.update(f.metadata)
        return out

    def close(self) -> None:
        """Unmap every file (views handed out keep their map alive)."""
        for f in self._files.values():
            f.close()


# -- the folder ---------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: {what} is not valid JSON: {exc.msg} "
                          f"(line {exc.lineno}, column {exc.colno})") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path}: {what} is nested too deeply") from exc
    except ValueError as exc:  # an integer past Python's int digit limit (sys.set_int_max_str_digits)
        raise ConfigError(f"{path}: {what} holds an unreadable value: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object, found {type(data).__name__}")
    return data


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and, when sharded, the index's weight map."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, "the shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
            raise FormatError(f"{index_path}: 'weight_map' must map tensor names to shard file names "
                              f"in the same folder")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FormatError(f"{index_path} lists shards that are not in {folder}: {', '.join(missing)}")
        return [folder / s for s in shards], weight_map
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if files:
        return files, None
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        raise UnsafeFormatError(
            f"{folder} holds weights only as pickle ({', '.join(pickles)}); infer never loads pickle "
            f"because unpickling can execute arbitrary code. Convert the folder to safetensors once, "
            f"in an environment you trust, e.g.:\n"
            f"  python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}', safe_serialization=True)\"")
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    hint = f"; to run a GGUF file, pass its path ({folder / ggufs[0]})" if ggufs else ""
    raise FormatError(f"{folder} has a config.json but no weights: expected model.safetensors, "
                      f"model.safetensors.index.json or *.safetensors{hint}")


def _token_ids(value: Any, key: str, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: {key} must be a token id or a list of token ids, found {value!r}")
    return tuple(dict.fromkeys(ids))  # unique, in order


def _number(config: dict[str, Any], key: str, path: Path, kind: type) -> Any:
    value = config.get(key)
    if value is None:
        return None
    ok = _is_int(value) if kind is int else isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        expected = "an integer" if kind is int else "a number"
        raise ConfigError(f"{path}: {key} must be {expected}, found {value!r}")
    return kind(value)


def read_generation_defaults(folder: Path, config: dict[str, Any]) -> GenerationDefaults:
    """Generation defaults as transformers' ``generate()`` would apply them.

    ``eos_token_id``/``bos_token_id`` come from ``generation_config.json``,
    each falling back to ``config.json``. transformers applies temperature,
    top_k, top_p and min_p only when ``do_sample`` is true (otherwise it
    decodes greedily), so they are taken only then; repetition_penalty and
    max_new_tokens apply to greedy decoding too and are always taken. Unlike
    transformers, no library default (its implicit ``top_k=50``) is added.
    """
    path = folder / "generation_config.json"
    gen = _read_json(path, "the generation config") if path.is_file() else {}
    eos = _token_ids(gen.get("eos_token_id"), "eos_token_id", path)
    if not eos:
        eos = _token_ids(config.get("eos_token_id"), "eos_token_id", folder / "config.json")
    bos = _token_ids(gen.get("bos_token_id"), "bos_token_id", path)
    if not bos:
        bos = _token_ids(config.get("bos_token_id"), "bos_token_id", folder / "config.json")
    defaults = GenerationDefaults(
        eos_token_ids=eos,
        bos_token_id=bos[0] if bos else None,
        repetition_penalty=_number(gen, "repetition_penalty", path, float),
        max_new_tokens=_number(gen, "max_new_tokens", path, int),
    )
    if gen.get("do_sample") is True:
        defaults.temperature = _number(gen, "temperature", path, float)
        defaults.top_k = _number(gen, "top_k", path, int)
        defaults.top_p = _number(gen, "top_p", path, float)
        defaults.min_p = _number(gen, "min_p", path, float)
    return defaults


def detect(path: Path) -> bool:
    """True for a directory with a ``config.json``; never raises."""
    try:
        path = Path(path)
        return path.is_dir() and (path / "config.json").is_file()
    except (OSError, ValueError, TypeError):
        return False


def open_folder(path: Path) -> ModelPackage:
    """Open a Hugging Face model folder as a :class:`ModelPackage`.

    Raises :class:`~infer.errors.ConfigError` for a bad ``config.json`` or
    ``generation_config.json``, :class:`~infer.errors.UnsafeFormatError` for
    pickle-only weights, :class:`~infer.errors.FormatError` for missing or
    corrupt weights, and the tokenizer's errors for a bad ``tokenizer.json``.
    """
    folder = Path(path)
    if not folder.exists():
        raise ModelNotFoundError(f"{folder} does not exist")
    if not folder.is_dir():
        raise FormatError(f"{folder} is not a folder; a Hugging Face model is a folder with config.json")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{folder} has no config.json, so it is not a Hugging Face model folder")
    config = _read_json(config_path, "config.json")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{config_path}: 'model_type' is missing or not a string (found {model_type!r}); "
                          f"it names the architecture, e.g. \"llama\"")
    generation = read_generation_defaults(folder, config)
    files, weight_map = _weight_files(folder)
    tensors: TensorSource = SafetensorsSource(files, only=weight_map)
    try:
        config, tensors = normalize_mtp_names(config, tensors, config_path)
        tensors = mxfp4_tensors(config, tensors, config_path)
        tensors = normalize_bare_names(tensors)
        modules = sentence_transformers_modules(folder)
        tokenizer = None
        if (folder / "tokenizer.json").is_file():
            from infer.tokenizer import Tokenizer  # lazily: listing formats stays cheap

            tokenizer = Tokenizer.from_folder(folder)
        else:
            log.warning("%s has no tokenizer.json: text generation will need token ids", folder)
        if not generation.eos_token_ids and tokenizer is not None:
            generation.eos_token_ids = tuple(tokenizer.eos_token_ids)
    except BaseException:
        tensors.close()
        raise
    return ModelPackage(model_type=model_type, config=config, tensors=tensors, tokenizer=tokenizer,
                        generation=generation, path=folder, format="huggingface", module_tensors=modules)


# -- multi-token prediction modules: one canonical naming ------------------------------


class RenamedSource(TensorSource):
    """A tensor source seen under other names: ``names[canonical] = stored``.
    One stored tensor may appear under several canonical names."""

    def __init__(self, base: TensorSource, names: dict[str, str]) -> None:
        self.base, self._names = base, names

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _stored(self, name: str) -> str:
        if name not in self._names:
            raise self._missing(name)
        return self._names[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(self._stored(name))

    def storage_dtype(self, name: str) -> str:
        return self.base.storage_dtype(self._stored(name))

    def get(self, name: str) -> Any:
        return self.base.get(self._stored(name))

    def stored_nbytes(self, name: str) -> int:
        return self.base.stored_nbytes(self._stored(name))

    def location(self, name: str) -> str:
        stored = self._names.get(name, name)
        where = self.base.location(stored)
        return where if stored == name else f"{where} (stored as {stored!r})"

    def close(self) -> None:
        self.base.close()


def sentence_transformers_modules(folder: Path) -> dict[str, TensorSource]:
    """The weights of a sentence-transformers folder's ``Dense`` modules (the
    folders ``modules.json`` names with a ``Dense`` type), by folder name;
    empty without ``modules.json``. Pickle-only weights are refused, as the
    model's own."""
    listing = folder / "modules.json"
    if not listing.is_file():
        return {}
    try:
        modules = json.loads(listing.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{listing}: cannot read it as JSON: {exc}") from exc
    if not isinstance(modules, list):
        raise ConfigError(f"{listing}: must be a list of modules, found {type(modules).__name__}")
    out: dict[str, TensorSource] = {}
    for module in modules:
        if not (isinstance(module, dict) and str(module.get("type", "")).rsplit(".", 1)[-1] == "Dense"):
            continue
        name = str(module.get("path", ""))
        where = (folder / name).resolve()
        if not name or Path(name).is_absolute() or ".." in Path(name).parts or not where.is_dir():
            raise ConfigError(f"{listing}: Dense module path {name!r} is not a folder inside {folder}")
        file = where / "model.safetensors"
        if not file.is_file():
            pickles = sorted(p.name for p in where.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
            if pickles:
                raise UnsafeFormatError(
                    f"{where} holds its Dense weights only as pickle ({', '.join(pickles)}); infer never loads "
                    "pickle because unpickling can execute arbitrary code. Re-save the sentence-transformers "
                    "model (safetensors is its default) in an environment you trust")
            raise FormatError(f"{where} has no model.safetensors for its Dense module")
        out[name] = SafetensorsSource([file])
    return out


def normalize_bare_names(tensors: TensorSource) -> TensorSource:
    """A decoder saved as its bare model class (``Qwen3Model``,
    ``Gemma3TextModel``, ``LlamaModel``: an embedding model's usual form)
    in the names of its ``...ForCausalLM``: transformers saves the bare class
    without the ``model.`` prefix (``embed_tokens.weight``, ``layers.0...``)
    and without an output head. Its tensors are seen under ``model.``; the
    head reads the input embedding (what an embedding model never uses, but a
    decoder network is built with). Other folders pass unchanged."""
    names = tensors.names()
    if "embed_tokens.weight" not in names or "model.embed_tokens.weight" in names:
        return tensors
    renamed = {("" if n.startswith("model.") else "model.") + n: n for n in names}
    renamed.setdefault("lm_head.weight", "embed_tokens.weight")
    log.info("%d tensors without the model. prefix (a bare model class): read as model.*", len(names))
    return RenamedSource(tensors, renamed)


#: Qwen3-Next's MTP names (after ``mtp.``) -> the DeepSeek-V3 names of each module's layer.
QWEN3_NEXT_MTP_NAMES = {
    "fc.weight": "eh_proj.weight",
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "norm.weight": "shared_head.norm.weight",
}


def normalize_mtp_names(config: dict[str, Any], tensors: TensorSource,
                        where: Path) -> tuple[dict[str, Any], TensorSource]:
    """Multi-token prediction modules in one naming, DeepSeek-V3's (docs/mtp.md).

    DeepSeek-V3 checkpoints (``num_nextn_predict_layers``) store module ``d`` as
    the extra layer ``model.layers.{num_hidden_layers + d}``: already canonical.
    Qwen3-Next-style checkpoints (``mtp_num_hidden_layers``) store
    ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.norm`` (shared by every module) and the blocks ``mtp.layers.{d}.*``;
    they are renamed to ``model.layers.{num_hidden_layers + d}.eh_proj``,
    ``enorm``, ``hnorm``, ``shared_head.norm`` and ``.*``, and the config gains
    ``num_nextn_predict_layers``. Weights are not changed (a Qwen3-Next model's
    zero-centred norms are its architecture's business, not the naming's).
    """
    count = config.get("mtp_num_hidden_layers")
    if not count or config.get("num_nextn_predict_layers"):
        return config, tensors
    names = tensors.names()
    if not any(n.startswith("mtp.") for n in names):
        return config, tensors
    first = config.get("num_hidden_layers")
    if not _is_int(first) or not _is_int(count) or first < 0 or count < 0:
        raise ConfigError(f"{where}: num_hidden_layers ({first!r}) and mtp_num_hidden_layers ({count!r}) "
                          "must be non-negative integers")
    renamed: dict[str, str] = {}
    for name in names:
        rest = name[4:] if name.startswith("mtp.") else None
        if rest in QWEN3_NEXT_MTP_NAMES:
            for d in range(count):
                renamed[f"model.layers.{first + d}.{QWEN3_NEXT_MTP_NAMES[rest]}"] = name
        elif rest is not None and rest.startswith("layers.") and rest.split(".")[1].isdigit():
            _, d, tail = rest.split(".", 2)
            if int(d) >= count:
                raise FormatError(f"{where}: tensor {name!r} belongs to MTP layer {d}, but mtp_num_hidden_layers "
                                  f"is {count}")
            renamed[f"model.layers.{first + int(d)}.{tail}"] = name
        else:
            renamed[name] = name
    log.debug("%s: %d Qwen3-Next-style MTP layer(s) renamed to model.layers.%d..", where, count, first)
    return {**config, "num_nextn_predict_layers": count}, RenamedSource(tensors, renamed)


@hookimpl
def infer_register_formats(register: Any) -> None:
    """Register the Hugging Face folder format."""
    register(FormatSpec(
        name="huggingface", detect=detect, open=open_folder,
        description="Hugging Face folder: config.json + safetensors (+ tokenizer.json)",
        write=_write, write_types=("f32", "f16", "bf16"),
    ))


def _write(package: ModelPackage, path: Path, **options: Any) -> None:
    from .huggingface_write import write_folder  # lazily: only `infer convert` needs the writer

    write_folder(package, path, **options)
