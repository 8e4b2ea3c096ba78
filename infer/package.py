"""The normalized form every format turns a model into.

A format (Hugging Face folder, GGUF file, ...) knows file layouts, not model
math. It produces a :class:`ModelPackage`: the Hugging Face ``model_type`` and
``config.json``-style hyperparameters, a lazy :class:`TensorSource` in
canonical Hugging Face names and layouts, the tokenizer (with its chat
template) and the generation defaults. Architectures consume only this.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from infer.errors import MissingTensorError
from infer.ops import QuantizedTensor

if TYPE_CHECKING:
    from infer.tokenizer import Tokenizer


class TensorSource(abc.ABC):
    """Lazy access to a model's tensors by canonical (Hugging Face) name.

    Nothing is read until :meth:`get`; implementations memory-map their files
    where they can.
    """

    @abc.abstractmethod
    def names(self) -> list[str]:
        """All tensor names, in storage order."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape in canonical layout, without reading the data."""

    @abc.abstractmethod
    def storage_dtype(self, name: str) -> str:
        """How the tensor is stored: ``"float32"``, ``"bfloat16"``, ``"Q4_K"``..."""

    @abc.abstractmethod
    def get(self, name: str) -> np.ndarray | QuantizedTensor:
        """The tensor in canonical layout: a float32/float16 numpy array
        (bfloat16 is widened to float32, which is exact) or a
        :class:`~infer.ops.QuantizedTensor`."""

    def stored_nbytes(self, name: str) -> int:
        """Bytes the tensor occupies in its file (quantized blocks as stored).
        Default: the bytes of what :meth:`get` returns; sources that know
        their offsets answer without reading the tensor."""
        return int(self.get(name).nbytes)

    def location(self, name: str) -> str:
        """Where the tensor lives, for error messages (e.g. a file name)."""
        return "the model package"

    def release(self, name: str) -> None:
        """A hint that the backend has prepared its own copy of ``name``: a
        memory-mapped source may drop the tensor's pages from the process's
        resident set (they are read again from the file if ever needed).
        Default: nothing."""

    def __contains__(self, name: object) -> bool:
        return name in set(self.names())

    def _missing(self, name: str) -> MissingTensorError:
        return MissingTensorError(f"tensor {name!r} is not in {self.location(name)}")

    def close(self) -> None:
        """Release open files and memory maps."""



class _Shaped(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...


EntryT = TypeVar("EntryT", bound=_Shaped)


class IndexedTensorSource(TensorSource, Generic[EntryT]):
    """A source that reads its files' headers once, at open, into a table:
    one entry per canonical name, in storage order, holding the tensor's
    canonical ``shape`` and whatever the format needs to read it.

    Names, membership and shapes are answered from that table without
    reading any data; a name it lacks is a
    :class:`~infer.errors.MissingTensorError` naming :meth:`location`.
    Subclasses fill ``_entries`` and read tensors through :meth:`_entry`.
    """

    _entries: dict[str, EntryT]

    def _entry(self, name: str) -> EntryT:
        try:
            return self._entries[name]
        except KeyError:
            raise self._missing(name) from None

    def names(self) -> list[str]:
        """Canonical names, in the order of the table (the files' order)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The canonical (Hugging Face) shape, from the table (nothing read)."""
        return self._entry(name).shape


@dataclass
class GenerationDefaults:
    """Defaults from ``generation_config.json`` (or a format's equivalent)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields the model package sets, by parameter name."""
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class ModelPackage:
    """A model, normalized: what to compute, independent of file format."""

    #: Hugging Face ``model_type`` (``"llama"``, ``"qwen2"``, ``"gemma3_text"``...).
    model_type: str
    #: Hyperparameters under their ``config.json`` names.
    config: dict[str, Any]
    #: Weights in canonical names and layouts.
    tensors: TensorSource
    #: The tokenizer, with special tokens and chat template; None if absent.
    tokenizer: Tokenizer | None
    #: Defaults for generation.
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    #: Where the model came from.
    path: Path | None = None
    #: Name of the format that produced this package.
    format: str = ""
    #: Weights of modules beside the network, by folder: a sentence-transformers
    #: folder's ``Dense`` layers (``{"2_Dense": <linear.weight, linear.bias>}``),
    #: read by :mod:`infer.embedding`.
    module_tensors: dict[str, TensorSource] = field(default_factory=dict)
    #: The architecture's reading of :attr:`config` (its ``ArchitectureSpec.read_config``),
    #: attached by :func:`infer.convert` for writers that need resolved sizes (the GGUF
    #: writer of the Mamba-2 families); None where no one attached it.
    read_config: Callable[[dict[str, Any]], Any] | None = None
    #: preprocessor_config.json's keys where the format carries them itself (an mmproj
    #: GGUF's image mean, std and sizes); None: read the folder's preprocessor_config.json.
    preprocessor: dict[str, Any] | None = None
