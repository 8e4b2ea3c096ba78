"""Prompts that hold images: from text and pictures to tokens, embeddings and spans.

:func:`image_prompt` takes a prompt's text (a user's, or a rendered chat
template's) and its images, and gives what the engine runs:

1. each image is read (:func:`infer.images.load_image`) and preprocessed by
   the family's :class:`~infer.image_processing.ImageProcessor`;
2. each placeholder in the text (``<start_of_image>``, ``<image>``, ...)
   becomes the family's expansion, so the image takes as many tokens as it
   has embeddings; a text with no placeholder gets one per image in front;
3. the text is tokenized, and the i-th image owns the next
   ``num_tokens`` image-token positions;
4. the network's :meth:`~infer.architecture.CausalLM.embed_image` turns each
   image into its embedding rows, once per request, when a forward first
   needs them (so the batch engine admits the request, reserving the
   tower's memory, before the tower runs, and a prompt found whole in the
   prefix cache never runs it); they live in the :class:`PromptMedia` (the
   encoder cache) until the request ends, so a preempted request recomputed
   later does not run the vision tower again.

The :class:`PromptMedia` rides on the engine's sequence
(:attr:`infer.engine.runner.SequenceState.media`); every forward asks it, per
sequence slice, for the rows to inject, the bidirectional spans and the rope
positions (:class:`infer.kv.attention.SequenceSlice`), so prompt chunks,
recomputation, rollback and prefix hits all see the same description. Its
:attr:`~PromptMedia.extra_key` keys the prefix cache by the images' content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.errors import ContextLengthError, ImageError
from infer.image_processing import ImageProcessor, ProcessedImage, image_processor, read_preprocessor_config
from infer.image_processors import idefics3, qwen2_vl  # noqa: F401  (they register their processors)
from infer.images import DEFAULT_LIMITS, ImageLimits, image_key, load_image
from infer.ops import Array, Backend


@dataclass
class ImageSpan:
    """One image of a prompt: its token positions and what made them."""

    #: First prompt position of its image tokens.
    start: int
    #: Its image tokens (= rows of its embeddings).
    length: int
    #: SHA-256 of the decoded image (:func:`infer.images.image_key`).
    key: bytes
    #: The preprocessed image.
    processed: ProcessedImage
    #: What the request called it (``images[0]``, ``messages[1].content[0]``).
    name: str = "image"
    #: The most memory the vision tower holds at once while encoding it
    #: (:meth:`~infer.architecture.CausalLM.image_activation_bytes`).
    activation_bytes: int = 0


@dataclass
class PromptMedia:
    """A prompt's images as the engine sees them (module docstring)."""

    #: The images in prompt order.
    images: list[ImageSpan]
    #: Runs the vision tower: ``[image tokens, hidden]`` on the backend, image
    #: after image (:attr:`embeddings` calls it once, when first needed).
    encode: Callable[[], Array]
    #: int64 ``[image tokens]``: the prompt position each embedding row goes to, rising.
    rows: np.ndarray
    #: ``[(lo, hi)]`` prompt position ranges that attend both ways (empty: all causal).
    spans: list[tuple[int, int]] = field(default_factory=list)
    #: int32 ``[streams, prompt tokens]`` rope positions, or None: token indices.
    positions: np.ndarray | None = None
    #: Added to the index of every token after the prompt (with :attr:`positions`).
    position_delta: int = 0
    #: Bytes the embeddings take (image tokens x hidden x the compute dtype's size).
    embedding_bytes: int = 0

    def __post_init__(self) -> None:
        self._embeddings: Array | None = None

    @property
    def embeddings(self) -> Array:
        """``[image tokens, hidden]`` on the backend: the images' embeddings,
        computed by the vision tower on first use and held until :meth:`release`."""
        if self._embeddings is None:
            self._embeddings = self.encode()
        return self._embeddings

    @property
    def encoded(self) -> bool:
        """Whether the embeddings are held (the tower has run and they were not released)."""
        return self._embeddings is not None

    def release(self) -> None:
        """Drop the embeddings (the request ended); a later use encodes again."""
        self._embeddings = None

    @property
    def activation_bytes(self) -> int:
        """The most memory the tower holds at once while encoding these images (one at a time)."""
        return max((image.activation_bytes for image in self.images), default=0)

    @property
    def extra_key(self) -> bytes:
        """The prefix-cache extra key (:func:`infer.kv.blocks.root_hash`): the images' keys in order."""
        digest = hashlib.sha256(b"images:")
        for image in self.images:
            digest.update(image.key)
        return digest.digest()

    @property
    def image_tokens(self) -> int:
        return int(self.rows.shape[0])

    def injected(self, ops: Backend, start: int, stop: int) -> tuple[np.ndarray, Array] | None:
        """The embedding rows of positions ``start..stop``: (their offsets
        from ``start``, ``[n, hidden]``), or None where no image token is there."""
        lo, hi = np.searchsorted(self.rows, [start, stop])
        if lo == hi:
            return None
        return (self.rows[lo:hi] - start).astype(np.int32), ops.slice(self.embeddings, 0, int(lo), int(hi))

    def span_rows(self, start: int, stop: int) -> np.ndarray | None:
        """int32 ``[stop - start, 2]``: per position the key range it sees both
        ways beyond the causal ones (``(0, 0)``: none), or None where none does."""
        out = None
        for lo, hi in self.spans:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                if out is None:
                    out = np.zeros((stop - start, 2), np.int32)
                out[a - start:b - start] = (lo, hi)
        return out

    def position_rows(self, start: int, stop: int) -> np.ndarray | None:
        """int32 ``[streams, stop - start]`` rope positions, or None: the token indices."""
        if self.positions is None:
            return None
        n = self.positions.shape[1]
        inside = self.positions[:, start:min(stop, n)]
        if stop <= n:
            return inside.astype(np.int32, copy=False)
        after = np.arange(max(start, n), stop, dtype=np.int64) + self.position_delta
        return np.concatenate([inside, np.broadcast_to(after, (self.positions.shape[0], after.shape[0]))],
                              axis=1).astype(np.int32)

    def rope_offset(self, start: int, stop: int) -> int | None:
        """The one number positions ``start..stop`` need beyond their token
        ids, where one number is all they need: how far their rope positions
        sit from the token indices (0 without multi-stream positions;
        :attr:`position_delta` after an M-RoPE prompt, whose three streams are
        equal there). None where they need more (image rows, a span, streams
        that differ): a captured step serves the former, the offset one of
        its inputs, and runs the latter eagerly."""
        if np.searchsorted(self.rows, start) != np.searchsorted(self.rows, stop):
            return None
        if any(max(lo, start) < min(hi, stop) for lo, hi in self.spans):
            return None
        placed = self.position_rows(start, stop)
        if placed is None or stop <= start:
            return 0
        offsets = placed - np.arange(start, stop, dtype=np.int32)
        if (offsets != offsets[0, 0]).any():
            return None
        return int(offsets[0, 0])

    def chunk_end(self, start: int, stop: int) -> int:
        """Where a prompt chunk from ``start`` that would end at ``stop`` ends
        instead, so it never splits a bidirectional span (whose first rows
        attend to its last): before the span when the chunk has other tokens
        before it, else after the span."""
        for lo, hi in self.spans:
            if lo < stop < hi:
                return lo if lo > start else hi
        return stop


class ImagePrompts:
    """A model's image side: its processor and the rules that build a
    :class:`PromptMedia` (made once per model by :func:`for_model`)."""

    def __init__(self, network: Any, ops: Backend, tokenizer: Any, processor: ImageProcessor,
                 limits: ImageLimits = DEFAULT_LIMITS, *, text_width: int = 0) -> None:
        self.network, self.ops, self.tokenizer = network, ops, tokenizer
        self.processor = processor
        self.spec = network.vision
        self.limits = limits
        #: The language model's hidden size: an embedding row's width (0: not known).
        self.text_width = text_width

    def load(self, images: Sequence[Any], names: Sequence[str] | None = None) -> list[tuple[Any, bytes]]:
        """Each image decoded (within the limits) with its content key."""
        out = []
        for i, source in enumerate(images):
            image = load_image(source, limits=self.limits, what=names[i] if names else f"images[{i}]")
            out.append((image, image_key(image)))
        return out

    def placeholders(self, text: str, count: int) -> str:
        """``text`` with exactly ``count`` placeholders: a text with none gets them in front."""
        placeholder = self.processor.placeholder
        found = text.count(placeholder)
        if found == 0 and count:
            text, found = placeholder * count + text, count
        if found != count:
            raise ImageError(f"the prompt has {found} image placeholders ({placeholder!r}) for {count} images")
        return text

    def build(self, text: str, images: Sequence[Any], *, add_special_tokens: bool = True,
              names: Sequence[str] | None = None, context: int | None = None) -> tuple[list[int], PromptMedia]:
        """The token ids of ``text`` with ``images`` and their :class:`PromptMedia`."""
        loaded = self.load(images, names)
        processed = [self.processor.preprocess(image) for image, _ in loaded]
        text = self.placeholders(text, len(processed))
        pieces = text.split(self.processor.placeholder)
        text = pieces[0] + "".join(self.processor.expand(p) + rest for p, rest in zip(processed, pieces[1:]))
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        token = self.spec.image_token_id
        where = [i for i, t in enumerate(ids) if t == token]
        need = sum(p.num_tokens for p in processed)
        if len(where) != need:
            raise ImageError(f"the prompt holds {len(where)} image tokens (id {token}) but its {len(processed)} "
                             f"images take {need}: the prompt's text must not contain the image token itself")
        if context is not None and len(ids) >= context:
            raise ContextLengthError(f"the prompt with its images is {len(ids)} tokens ({need} of them image "
                                     f"tokens) but the model's context is {context} positions")
        spans: list[ImageSpan] = []
        k = 0
        network = self.network
        for i, (p, (_, key)) in enumerate(zip(processed, loaded)):
            spans.append(ImageSpan(where[k], p.num_tokens, key, p, names[i] if names else f"images[{i}]",
                                   network.image_activation_bytes(p.pixel_values.shape, p.meta)))
            k += p.num_tokens
        rows = np.asarray(where, np.int64)
        itemsize = 4 if self.ops.compute_dtype == "float32" else 2
        media = PromptMedia(spans, lambda: self.encode(spans), rows, runs(rows) if self.spec.bidirectional else [],
                            embedding_bytes=need * self.text_width * itemsize)
        placed = self.network.prompt_positions(ids, spans)
        if placed is not None:
            media.positions, media.position_delta = np.asarray(placed[0], np.int32), int(placed[1])
        return ids, media

    def encode(self, images: Sequence[ImageSpan]) -> Array:
        """The vision tower over ``images``, one at a time: their embeddings, image after image."""
        ops, parts = self.ops, []
        for span in images:
            emb = self.network.embed_image(ops.from_numpy(span.processed.pixel_values), span.processed.meta)
            shape = ops.shape(emb)
            if tuple(shape[:1]) != (span.length,):
                raise ImageError(f"{type(self.network).__name__}.embed_image gave {list(shape)} rows for "
                                 f"{span.name} of {span.length} tokens")
            parts.append(emb)
        return parts[0] if len(parts) == 1 else ops.concat(parts, 0)


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive positions, as transformers groups a Gemma 3 image's tokens into one block."""
    out: list[tuple[int, int]] = []
    for r in rows.tolist():
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def for_model(package: Any, network: Any, ops: Backend, tokenizer: Any) -> ImagePrompts | None:
    """The image side of a loaded model, or None for a text-only network."""
    spec = getattr(network, "vision", None)
    if spec is None:
        return None
    config = dict(spec.config or package.config)
    preprocessor = getattr(package, "preprocessor", None)
    if preprocessor is None:
        preprocessor = read_preprocessor_config(package.path)
    processor = image_processor(spec.processor, config, preprocessor, tokenizer)
    text = config.get("text_config")
    width = (text if isinstance(text, dict) else config).get("hidden_size", 0)
    return ImagePrompts(network, ops, tokenizer, processor, text_width=int(width or 0))


def image_parts(messages: Sequence[Any]) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
    """Chat messages with their image content parts taken out: each becomes
    ``{"type": "image"}`` (what the chat templates of vision families render
    as their placeholder) and its source joins the list, in order, with a
    name for errors. Parts: ``{"type": "image", "image": SRC}`` (also
    ``"url"`` / ``"path"``), OpenAI's ``{"type": "image_url", "image_url":
    {"url": SRC}}`` or ``"image_url": SRC``, and Anthropic's ``{"type":
    "image", "source": {"type": "base64", "media_type", "data"}}``."""
    out, images, names = [], [], []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            source = image_source(part) if isinstance(part, dict) else None
            if source is None:
                parts.append(part)
                continue
            images.append(source)
            names.append(part.get("where") or f"messages[{m}].content[{p}]")
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images, names


def image_source(part: dict[str, Any]) -> Any:
    """The image a content part holds, or None when it is not an image part."""
    kind = part.get("type")
    if kind == "image_url" or kind == "input_image":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if kind != "image":
        return None
    source = part.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64":
            return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
        return source.get("url") or source.get("data")
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    raise ImageError("an image content part needs 'image', 'url', 'path' or 'source'")
