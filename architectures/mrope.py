"""Multimodal rotary positions (M-RoPE; Qwen2-VL report, section 2.1), as Qwen3-VL and Qwen3.5 interleave them.

A token has three positions, time, height and width. Text tokens have the
same number on all three, so on text M-RoPE is plain rope. An image of
``grid_thw = (t, h, w)`` patches, merged ``m x m`` into
``t * (h/m) * (w/m)`` tokens, gives its token at frame ``i``, row ``r``,
column ``c`` the positions ``(s + i, s + r, s + c)``, ``s`` the position the
image starts at; the text after it continues at ``s + max(h, w) / m`` (its
largest position + 1), not at ``s`` + its token count. Every token after the
prompt sits at its index + ``delta``, ``delta`` = (largest prompt position
+ 1) - prompt length. :func:`mrope_positions` is transformers'
``get_rope_index`` for a prompt whose images are given by their first token
and grid.

The rotary table: the ``rot / 2`` frequencies of the head (``rot`` =
``head_dim * partial_rotary_factor``) are dealt round-robin to the streams,
frequency ``i`` rotating by the height position when ``i % 3 == 1`` and
``i < 3 * mrope_section[1]``, by the width position when ``i % 3 == 2`` and
``i < 3 * mrope_section[2]``, and by the time position otherwise
(``mrope_interleaved``, transformers' ``Qwen3_5TextRotaryEmbedding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infer.architecture import host_array
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend

from .rope import RotaryEmbedding

Grid = tuple[int, int, int]


def mrope_positions(length: int, images: Sequence[tuple[int, Grid]], merge: int) -> tuple[list[list[int]], int]:
    """The three position streams of a prompt of ``length`` tokens whose
    images are ``(first token, grid_thw)`` (in prompt order, each taking
    ``t * h * w / merge**2`` tokens), and the ``delta`` of the tokens after it."""
    streams: list[list[int]] = [[], [], []]
    current, index = 0, 0

    def text(n: int) -> None:
        nonlocal current
        for s in streams:
            s.extend(range(current, current + n))
        current += n

    for start, (t, h, w) in sorted(images):
        if start < index:
            raise ConfigError(f"image tokens overlap at prompt position {start}")
        text(start - index)
        gh, gw = h // merge, w // merge
        for i in range(t):
            for r in range(gh):
                streams[0].extend([current + i] * gw)
                streams[1].extend([current + r] * gw)
                streams[2].extend(range(current, current + gw))
        current += max(h, w) // merge
        index = start + t * gh * gw
    if index > length:
        raise ConfigError(f"the prompt's images take positions up to {index}, past its {length} tokens")
    text(length - index)
    largest = max((max(s) for s in streams if s), default=-1)
    return streams, largest + 1 - length


class MRotaryEmbedding(RotaryEmbedding):
    """cos/sin tables from a forward's three position streams (module docstring)."""

    def __init__(self, ops: Backend, dim: int, params: dict[str, Any], max_position_embeddings: int) -> None:
        super().__init__(ops, dim, params, max_position_embeddings)
        if self.rope_type != "default":
            raise ConfigError(f"config.json: multimodal rope with rope type {self.rope_type!r} is not supported")
        section = params.get("mrope_section") or [11, 11, 10]
        if len(section) != 3:
            raise ConfigError(f"config.json: mrope_section must name three streams, found {section}")
        half = self.dim // 2
        stream = [0] * half
        for i in range(half):
            if i % 3 == 1 and i < 3 * section[1]:
                stream[i] = 1
            elif i % 3 == 2 and i < 3 * section[2]:
                stream[i] = 2
        #: Column ``i`` of the three streams' angles side by side that frequency ``i`` takes.
        self._pick = ops.from_numpy(host_array([s * half + i for i, s in enumerate(stream)], "int32"))

    def __call__(self, ctx: AttentionContext) -> tuple[Array, Array]:
        """cos, sin ``[tokens, dim/2]``; plain rope where the forward has one stream."""
        ops = self.ops
        streams = getattr(ctx, "position_ids", None)  # int32 [3, tokens] when a sequence has images
        if streams is None:
            return super().__call__(ctx)
        angles = [ops.mul(ops.reshape(ops.astype(ops.slice(streams, 0, s, s + 1), "float32"), (-1, 1)),
                          self._inv_freq) for s in range(3)]
        freqs = ops.take(ops.concat(angles, axis=1), self._pick, axis=1)  # [tokens, dim/2]
        cos, sin = ops.cos(freqs), ops.sin(freqs)
        dtype = ops.compute_dtype
        if dtype != "float32":
            cos, sin = ops.astype(cos, dtype), ops.astype(sin, dtype)
        return cos, sin
