"""What an architecture implements, and how it receives its weights.

An architecture module defines a config dataclass (``config.json`` names),
a :class:`CausalLM` subclass that takes its weights from a
:class:`WeightLoader` in its constructor, and registers an
:class:`~infer.plugins.registry.ArchitectureSpec` through the
``infer_register_architectures`` hook.
"""

from __future__ import annotations

import abc
import logging
import types
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.errors import MissingTensorError, ShapeMismatchError, UnsupportedOpError
from infer.kv.attention import AttentionContext, FullAttention, LayerState
from infer.ops import Array, Backend, PackedWeight, QuantizedTensor
from infer.package import TensorSource

log = logging.getLogger(__name__)


def host_array(values: list[float] | list[int], dtype: str = "float32") -> np.ndarray:
    """A host (numpy) array for :meth:`~infer.ops.Backend.from_numpy`.

    Architecture files may not import numpy (a test enforces it); this is how
    they turn small host-computed tables (e.g. rope frequencies) into arrays.
    """
    return np.asarray(values, dtype=np.dtype(dtype))


class WeightLoader:
    """Hands tensors to an architecture, checked and on the backend.

    Each :meth:`get` checks that the tensor exists and has the shape the
    config implies, optionally transforms the host array (e.g. Gemma's
    ``1 + w`` norm weights), and converts it once with the backend's
    :meth:`~infer.ops.Backend.prepare_weight`.
    """

    def __init__(
        self,
        tensors: TensorSource,
        backend: Backend,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.backend = backend
        self._names = set(tensors.names())
        self._used: set[str] = set()
        self._progress = progress
        #: Where each tensor went: its name -> (the prepared weight holding it,
        #: its first row there), a stacked weight holding several (q, k and v
        #: at their row offsets). What adapters attach by (:mod:`infer.adapters`).
        self.sources: dict[str, tuple[Any, int]] = {}
        #: How many tensors went from which stored type to which backend form,
        #: e.g. ``("Q4_1", "int4pack g32 f32")`` or ``("Q6_K", "float32")``.
        self.placements: Counter[tuple[str, str]] = Counter()

    def has(self, name: str) -> bool:
        """True if the package holds ``name``."""
        return name in self._names

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        *,
        transform: Callable[[np.ndarray], np.ndarray] | None = None,
        fallback: str | None = None,
    ) -> Array:
        """The tensor ``name`` with the expected ``shape``, on the backend.

        ``fallback`` names a tensor to use when ``name`` is absent (e.g. tied
        output embeddings read the input embedding).
        """
        name = self._check(name, shape, fallback)
        tensor = self.tensors.get(name)
        if transform is not None:
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            tensor = transform(np.asarray(tensor, dtype=np.float32))
        return self._prepare(tensor, name, [name])

    def get_stacked(self, name: str, parts: Sequence[tuple[str, tuple[int, ...]]]) -> Array | None:
        """Matrices with the same columns stacked by rows into one weight,
        prepared under ``name`` (e.g. the q, k and v projections as
        ``...self_attn.qkv_proj.weight``): one product per token in place of
        several, and the outputs are slices of its result.

        Returns None, and reads nothing, when the parts are stored differently
        (a GGUF file may keep v in Q6_K and q, k in Q4_K), so they cannot form
        one weight; the caller then gets them one by one. Shapes are checked as
        :meth:`get` checks them.
        """
        names = [self._check(part, shape, None) for part, shape in parts]
        stored = {self.tensors.storage_dtype(n) for n in names}
        cols = {shape[1:] for _, shape in parts}
        if len(stored) != 1 or len(cols) != 1 or any(len(shape) != 2 for _, shape in parts):
            return None
        tensors = [self.tensors.get(n) for n in names]
        if all(isinstance(t, QuantizedTensor) for t in tensors):
            stacked = tensors[0].stacked(tensors)
            if stacked is None:
                return None
        elif any(isinstance(t, QuantizedTensor) for t in tensors):
            return None
        else:
            stacked = np.concatenate([np.asarray(t) for t in tensors], axis=0)
        del tensors
        return self._prepare(stacked, name, names)

    def get_unstacked(self, name: str, shape: tuple[int, ...]) -> list[Array]:
        """The slices along the first axis of ``name`` (``shape`` ``[n, ...]``),
        each prepared as a weight of its own: experts stored as one tensor
        (Gemma 4's and gpt-oss's ``experts.gate_up_proj``) read as one weight
        per expert, as :func:`~infer.architectures.moe.mix_experts` runs them."""
        name = self._check(name, shape, None)
        tensor = self.tensors.get(name)
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        host = np.array(tensor)  # a copy: the file's pages are released after the first slice
        del tensor
        return [self._prepare(np.ascontiguousarray(host[i]), name, [name]) for i in range(shape[0])]

    def _check(self, name: str, shape: tuple[int, ...], fallback: str | None) -> str:
        if name not in self._names:
            if fallback is not None and fallback in self._names:
                log.debug("%s absent; using %s", name, fallback)
                return self._check(fallback, shape, None)
            raise MissingTensorError(
                f"tensor {name!r} is missing from {self.tensors.location(name)}"
                + (f" (nor is {fallback!r} there)" if fallback else "")
            )
        found = tuple(self.tensors.shape(name))
        if found != tuple(shape):
            raise ShapeMismatchError(
                f"tensor {name!r} in {self.tensors.location(name)} has shape {list(found)}; "
                f"the config implies {list(shape)}"
            )
        return name

    def _prepare(self, tensor: Any, name: str, sources: list[str]) -> Array:
        prepared = self.backend.prepare_weight(tensor, name=name)
        self.placements[(_stored_type(tensor), self._form(prepared))] += len(sources)
        del tensor
        first = 0
        for source in sources:
            self.sources[source] = (prepared, first)
            if len(sources) > 1:  # stacked by rows (get_stacked): the next part starts after this one
                first += int(self.tensors.shape(source)[0])
            self.tensors.release(source)  # the file's pages need not stay resident beside the backend's copy
            if source not in self._used:
                self._used.add(source)
                if self._progress is not None:
                    self._progress(1)
        return prepared

    def _form(self, prepared: Any) -> str:
        if isinstance(prepared, PackedWeight):
            return prepared.scheme
        try:
            return self.backend.dtype(prepared)
        except Exception:  # a third-party weight object: name its type
            return type(prepared).__name__

    def summary(self) -> str:
        """One line: stored type -> backend form, with counts, e.g.
        ``Q4_1 x210 -> int4pack g32 f32; F32 x61 -> float32``."""
        return "; ".join(f"{src} x{n} -> {dst}" for (src, dst), n in sorted(self.placements.items()))

    def unused(self, ignore: Iterable[str] = ()) -> list[str]:
        """Names in the package that no :meth:`get` asked for."""
        skip = set(ignore)
        return sorted(n for n in self._names - self._used if n not in skip)


class RenamedWeights:
    """A :class:`WeightLoader` seen through a renaming: every name that
    starts with ``old`` is read as ``new`` + the rest (a vision-language
    checkpoint keeps its language model's ``model.layers.0...`` under
    ``model.language_model.layers.0...``), so a text architecture loads
    unchanged from inside it."""

    def __init__(self, weights: WeightLoader, old: str, new: str) -> None:
        self.weights, self.old, self.new = weights, old, new
        self.backend = weights.backend

    def _name(self, name: str) -> str:
        return self.new + name[len(self.old):] if name.startswith(self.old) else name

    def has(self, name: str) -> bool:
        return self.weights.has(self._name(name))

    def get(self, name: str, shape: tuple[int, ...], *, transform: Callable[[np.ndarray], np.ndarray] | None = None,
            fallback: str | None = None) -> Array:
        return self.weights.get(self._name(name), shape, transform=transform,
                                fallback=None if fallback is None else self._name(fallback))

    def get_stacked(self, name: str, parts: Sequence[tuple[str, tuple[int, ...]]]) -> Array | None:
        return self.weights.get_stacked(self._name(name), [(self._name(n), s) for n, s in parts])

    def get_unstacked(self, name: str, shape: tuple[int, ...]) -> list[Array]:
        return self.weights.get_unstacked(self._name(name), shape)


def _stored_type(tensor: Any) -> str:
    if isinstance(tensor, QuantizedTensor):
        return tensor.qtype
    return str(getattr(tensor, "dtype", type(tensor).__name__)).upper().replace("FLOAT", "F")


@dataclass(frozen=True)
class VisionSpec:
    """What the prompt builder and the engine need of a vision-language
    network (:attr:`CausalLM.vision`; docs/vision.md, "A family's hooks")."""

    #: The image processor's name in :data:`infer.image_processing.PROCESSORS`
    #: (preprocessing and the placeholder's expansion).
    processor: str
    #: The token whose embedding rows an image's embeddings replace.
    image_token_id: int
    #: True: each run of image tokens attends to itself both ways inside the
    #: causal sequence (Gemma 3); the engine then keeps such a run in one
    #: prompt chunk and gives the attention op its span.
    bidirectional: bool = False
    #: The model's whole ``config.json`` (what the processor reads: sizes, token ids).
    config: Mapping[str, Any] | None = None


class CausalLM(abc.ABC):
    """A decoder-only language model bound to a backend.

    Subclasses read every weight in ``__init__`` (through the loader) and
    implement :meth:`forward`. They compute only through ``ops`` and
    ``ctx.attention``.

    The network and its output head are two calls (as vLLM's ``forward`` and
    ``compute_logits``): :meth:`forward` returns the final hidden states of
    every new token, and the engine picks the rows whose logits it wants
    (a prefill needs only the last) before :meth:`compute_logits` projects
    them onto the vocabulary. So which rows to keep, and keeping the hidden
    states for multi-token prediction, are the engine's business.

    **Multi-token prediction (MTP).** Some checkpoints ship MTP modules
    (DeepSeek-V3 section 2.2; see ``docs/mtp.md``): module ``d`` predicts the
    token after the next one from the hidden state at position ``p`` and the
    embedding of the token at ``p + 1``. The engine drives them (speculative
    decoding); a model exposes them through four members, whose defaults here
    describe a model without MTP:

    * :attr:`num_mtp_modules` — modules the checkpoint ships (0: none);
    * :attr:`num_cache_layers` — KV cache layers the engine allocates:
      ``num_layers + num_mtp_modules``; MTP module ``d`` attends in cache
      layer ``num_layers + d``;
    * :meth:`mtp_forward` runs one module, :meth:`mtp_compute_logits`
      applies its head.

    The hidden states :meth:`forward` returns are exactly what MTP module 0
    consumes.
    """

    #: The config dataclass instance.
    config: Any
    #: Number of transformer layers of the main model (its KV cache layers
    #: are ``0 .. num_layers - 1``).
    num_layers: int
    #: MTP modules the checkpoint ships (0 = none).
    num_mtp_modules: int = 0
    #: Longest sequence the model supports (positions).
    max_context: int
    #: Vocabulary size (logit width).
    vocab_size: int
    #: The output head ``[vocab, hidden]`` that the default
    #: :meth:`compute_logits` applies (the input embedding when tied).
    lm_head: Array

    def __init__(self, config: Any, weights: WeightLoader, ops: Backend) -> None:
        self.config = config
        self.ops = ops

    @property
    def num_cache_layers(self) -> int:
        """KV cache layers the engine allocates: ``num_layers + num_mtp_modules``
        (MTP module ``d`` uses cache layer ``num_layers + d``)."""
        return self.num_layers + self.num_mtp_modules

    def layer_states(self) -> list[LayerState]:
        """What each cache layer keeps per sequence, one entry per cache
        layer (docs/architectures.md, "Layer states"): full-attention keys
        and values (:class:`~infer.kv.attention.FullAttention`, the default
        for every layer), a sliding window's
        (:class:`~infer.kv.attention.SlidingWindow`), another layer's
        (:class:`~infer.kv.attention.SharedKV`) or fixed-size recurrent
        arrays (:class:`~infer.kv.attention.Recurrent`). The engine
        allocates each kind; the architecture only declares."""
        return [FullAttention() for _ in range(self.num_cache_layers)]

    @abc.abstractmethod
    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        """The hidden states ``[tokens, hidden_size]`` of the new tokens
        ``input_ids`` (``[tokens]`` int32), after the final norm: what the
        output head reads, and what MTP module 0 consumes (docs/mtp.md says
        why that one)."""

    def compute_logits(self, hidden: Array) -> Array:
        """Logits ``[rows, vocab]`` for hidden states ``[rows, hidden_size]``
        taken from :meth:`forward`'s output. Default: the output head
        :attr:`lm_head` (``ops.linear`` takes a quantized head as it is)."""
        return self.ops.linear(hidden, self.lm_head)

    def mtp_forward(self, depth: int, hidden: Array, input_ids: Array, ctx: AttentionContext) -> Array:
        """Run MTP module ``depth`` (0-based).

        ``hidden``: ``[tokens, hidden_size]`` at positions ``p`` — for depth 0
        rows of the main model's :meth:`forward` output, for depth ``d > 0``
        what this method returned at depth ``d - 1`` (or the same module's,
        when the engine reuses one module for several steps). ``input_ids``:
        ``[tokens]`` the tokens at positions ``p + 1``. ``ctx`` places these
        rows at positions ``p``; attention in the module reads and writes
        cache layer ``num_layers + depth``.

        Returns the module's output hidden ``[tokens, hidden_size]``, before
        its own head norm (what the next depth chains on);
        :meth:`mtp_compute_logits` turns rows of it into logits predicting
        the tokens at ``p + 2``. Default: the model has no MTP modules.
        """
        raise UnsupportedOpError(
            f"{type(self).__name__} has no multi-token prediction modules (num_mtp_modules is 0); "
            "use another draft source"
        )

    def mtp_compute_logits(self, depth: int, hidden: Array) -> Array:
        """Logits ``[rows, vocab]`` of MTP module ``depth`` for rows of its
        :meth:`mtp_forward` output: the module's head norm, then its head."""
        raise UnsupportedOpError(f"{type(self).__name__} has no multi-token prediction modules")

    #: The network's image side (None: it reads text only).
    vision: VisionSpec | None = None

    def embed_image(self, pixel_values: Array, meta: Mapping[str, Any]) -> Array:
        """One preprocessed image's embeddings ``[tokens, hidden_size]``, the
        rows that replace its image tokens' embeddings: the vision tower and
        projector. ``pixel_values`` is what the family's image processor
        made (:class:`~infer.image_processing.ProcessedImage`), on the
        backend; ``meta`` the processor's other facts about it (a patch grid).
        Default: the network reads no images."""
        raise UnsupportedOpError(f"{type(self).__name__} reads text only; it has no vision tower")

    def image_activation_bytes(self, shape: Sequence[int], meta: Mapping[str, Any]) -> int:
        """The most memory :meth:`embed_image` holds at once for an image of
        ``pixel_values`` ``shape`` and ``meta`` (an upper estimate from the
        tower's shapes), which the batch engine reserves while the image is
        encoded (docs/vision.md, "Memory"). Default 0: a family that does not
        say is admitted on its embeddings' bytes alone."""
        return 0

    def prompt_positions(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[np.ndarray, int] | None:
        """Rope positions of a prompt holding images, where they are not the
        token indices: ``([streams, len(token_ids)] int32, delta)``, ``delta``
        added to the index of every later token (Qwen's M-RoPE: three streams,
        and text after an image continues at its largest position + 1).
        ``images`` are the prompt's :class:`~infer.multimodal.ImageSpan` s.
        Default None: positions are token indices."""
        return None

    def close(self) -> None:
        """Release what the network holds beyond its arrays (a
        tensor-parallel network's worker ranks). Default: nothing."""

    #: Tensors the model package may hold that the architecture never reads
    #: (e.g. precomputed rotary tables); not reported as unused.
    ignored_tensors: tuple[str, ...] = ()
