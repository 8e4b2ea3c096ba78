"""A LoRA adapter in one form, whatever file it came from.

Hu et al. 2021 ("LoRA: Low-Rank Adaptation of Large Language Models") adapt a
linear weight ``W [out, in]`` by a product of two thin factors: the adapted
layer computes ``x @ W.T + scale * (x @ A.T) @ B.T`` with ``A [r, in]`` and
``B [out, r]``. PEFT's ``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)``
under rsLoRA, Kalajdzievski 2023), per module where ``rank_pattern`` /
``alpha_pattern`` override them. A format reader (:mod:`.peft`, :mod:`.gguf`)
turns its file into :class:`LoraAdapter`: modules by their Hugging Face names
(``model.layers.0.self_attn.q_proj``) with each module's scale resolved, and
the whole tensors of ``modules_to_save`` (an embedding or output head) by
their Hugging Face tensor names.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoraModule:
    """One adapted linear module: ``delta(x) = scale * (x @ a.T) @ b.T``."""

    #: ``[r, in]`` float32.
    a: np.ndarray
    #: ``[out, r]`` float32.
    b: np.ndarray
    #: ``lora_alpha / r`` (or ``/ sqrt(r)`` under rsLoRA), as resolved for this module.
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> np.ndarray:
        """The dense update ``scale * b @ a`` ``[out, in]`` (what merging adds)."""
        return (np.float32(self.scale) * (self.b.astype(np.float64) @ self.a.astype(np.float64))).astype(np.float32)


@dataclass
class LoraAdapter:
    """A LoRA adapter read from a PEFT folder or a GGUF adapter file."""

    #: Where it was read from.
    path: str
    #: Adapted modules by Hugging Face module name (``model.layers.3.mlp.down_proj``).
    modules: dict[str, LoraModule]
    #: Whole tensors the adapter replaces (PEFT's ``modules_to_save``: an
    #: embedding or the output head), by Hugging Face tensor name (``lm_head.weight``).
    saved: dict[str, np.ndarray] = field(default_factory=dict)
    #: The architecture the adapter was made for, where the file says it
    #: (a GGUF adapter's ``general.architecture``); None: unknown (PEFT folders).
    architecture: str | None = None
    #: The base model the adapter was trained on, as the file names it (informational).
    base_model: str | None = None
    #: PEFT's ``lora_alpha`` (a GGUF adapter's ``adapter.lora.alpha``); the scales above are resolved already.
    alpha: float | None = None

    @property
    def rank(self) -> int:
        """The largest rank of any module (0: none)."""
        return max((m.rank for m in self.modules.values()), default=0)

    def content_hash(self) -> bytes:
        """SHA-256 of every factor, scale and saved tensor: what the prefix
        cache keys this adapter's blocks by, so an adapter reloaded under the
        same name with other weights never reuses the old one's keys and
        values (vLLM #42125)."""
        import hashlib  # here, not at the top: loading a model without adapters never calls this

        h = hashlib.sha256(b"lora:")
        for name in sorted(self.modules):
            m = self.modules[name]
            h.update(name.encode() + struct.pack("<d", m.scale))
            for t in (m.a, m.b):
                h.update(struct.pack("<2q", *t.shape) + np.ascontiguousarray(t, np.float32).tobytes())
        for name in sorted(self.saved):
            t = self.saved[name]
            h.update(b"saved:" + name.encode() + np.ascontiguousarray(t, np.float32).tobytes())
        return h.digest()
