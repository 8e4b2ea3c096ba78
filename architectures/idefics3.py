"""Idefics3 and SmolVLM's vision side: a SigLIP encoder per tile, pixel shuffle and one projection.

``vision_config`` and ``scale_factor`` of an ``idefics3`` or ``smolvlm``
checkpoint (``Idefics3ForConditionalGeneration`` /
``SmolVLMForConditionalGeneration``; weights under ``model.vision_model.``
and ``model.connector.``), as transformers' ``Idefics3VisionTransformer`` and
``Idefics3Connector`` compute them. Its input is what
:mod:`infer.image_processors.idefics3` makes of an image: square tiles
``[tiles, 3, image_size, image_size]``, each encoded alone.

* **Patch embedding**: a ``Conv2d`` whose kernel equals its stride, on
  patches cut out row by row: ``patches @ patch_embedding.weight.reshape(hidden, -1).T + b``.
* **Positions**: a learned vector per patch of the ``image_size / patch_size``
  square. transformers buckets the positions of tiles smaller than the square
  (NaViT-style); the processor never makes one (a tile is always the encoder's
  ``image_size``, checked when the processor is built), so patch ``i`` takes
  vector ``i`` and the encoder is SigLIP's (:class:`.vision.VisionTower`:
  pre-norm blocks bidirectional over one tile's patches, ``post_layernorm``).
  (transformers computes those buckets in float32 even for a whole tile:
  they are the indices for the released sides, 26, 27 and 32 patches, and
  for the tests' 4; for some sides, e.g. 19 or 25, a patch lands in the
  neighbouring bucket, which this does not copy.)
* **Connector**: pixel shuffle by ``scale_factor`` (each ``s x s`` block of
  patches side by side into one vector of ``s**2 * hidden``, Shi et al. 2016's
  space-to-depth), then ``modality_projection.proj`` (no bias) to the text
  width: ``(image_size / patch_size / s)**2`` image tokens per tile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infer.architecture import CausalLM, VisionSpec, WeightLoader
from infer.config import from_dict
from infer.errors import ConfigError
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from . import llama
from .gemma3_vl import LanguageModelWeights
from .vision import VisionConfig, VisionTower, WrappedLanguageModel


class Idefics3VisionModel:
    """The SigLIP tile encoder (:class:`.vision.VisionTower`) and the pixel-shuffle connector (module docstring)."""

    def __init__(self, config: VisionConfig, scale_factor: int, text_hidden: int, weights: WeightLoader,
                 ops: Backend, *, prefix: str = "model.") -> None:
        if scale_factor <= 0 or config.patches_per_side % scale_factor:
            raise ConfigError(f"config.json: scale_factor ({scale_factor}) must divide the {config.patches_per_side} "
                              "patches along a tile's side")
        self.config, self.ops, self.scale = config, ops, scale_factor
        self.tower = VisionTower(config, weights, ops, prefix + "vision_model.")
        self.projection = weights.get(prefix + "connector.modality_projection.proj.weight",
                                      (text_hidden, config.hidden_size * scale_factor ** 2))

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens one tile gives (transformers' ``image_seq_len``)."""
        return (self.config.patches_per_side // self.scale) ** 2

    def __call__(self, pixel_values: Array) -> Array:
        """Image embeddings ``[tiles * tokens_per_tile, text hidden]`` of tiles
        ``[tiles, channels, image_size, image_size]``, tile after tile (each
        encoded alone)."""
        ops, cfg = self.ops, self.config
        tiles, c, size = ops.shape(pixel_values)[0], cfg.num_channels, cfg.image_size
        n, d, s = cfg.patches_per_side, cfg.hidden_size, self.scale
        x = ops.concat([self.tower.last_hidden_state(ops.reshape(ops.slice(pixel_values, 0, i, i + 1), (c, size, size)))
                        for i in range(tiles)], 0)  # [tiles * n * n, d], each tile's patches row by row
        # Pixel shuffle as transformers writes it: columns in groups of s, then rows in groups of s.
        x = ops.transpose(ops.reshape(x, (tiles, n, n // s, d * s)), (0, 2, 1, 3))
        x = ops.transpose(ops.reshape(x, (tiles, n // s, n // s, d * s * s)), (0, 2, 1, 3))
        return ops.linear(ops.reshape(x, (tiles * (n // s) ** 2, d * s * s)), self.projection)


def tile_encoder_config(config: dict[str, Any]) -> VisionConfig:
    """The tile encoder's settings from an ``idefics3`` / ``smolvlm`` config.json
    dict: SigLIP's (its ``model_type`` is the family's own)."""
    nested = config.get("vision_config")
    if not isinstance(nested, dict):
        raise ConfigError("config.json: an idefics3 / smolvlm model needs a vision_config")
    return from_dict(VisionConfig, {**nested, "model_type": "siglip_vision_model"})


class Idefics3ForConditionalGeneration(WrappedLanguageModel):
    """A Llama-family language model (``text_config``, weights under
    ``model.text_model.``) reading images through the tile encoder and
    connector above: each ``<image>`` token (``image_token_id``) takes one
    connector row, tile after tile; attention stays causal (transformers'
    ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``)."""

    def __init__(self, config: dict[str, Any], weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: an idefics3 / smolvlm config needs a text_config object")
        kind = text.get("model_type", "llama")
        if kind not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"config.json: text_config.model_type {kind!r} is not a language model Idefics3 "
                              "runs here; supported: llama, mistral, qwen2")
        # transformers ties the head by the top-level flag; text_config's own is not read.
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        text = {**text, "tie_word_embeddings": tied}
        #: The language model, built by its own architecture.
        lm_weights = LanguageModelWeights(weights, "model.text_model.", "lm_head.weight")
        self.language_model: CausalLM = llama.build(text, lm_weights, ops)  # type: ignore[arg-type]
        self.visual = Idefics3VisionModel(tile_encoder_config(config), int(config.get("scale_factor", 2)),
                                          int(text["hidden_size"]), weights, ops)
        lm = self.language_model
        self.num_layers, self.max_context, self.vocab_size = lm.num_layers, lm.max_context, lm.vocab_size
        self.lm_head = lm.lm_head
        self.vision = VisionSpec("idefics3", int(config.get("image_token_id", 128257)), config=config)

    def image_activation_bytes(self, shape: Sequence[int], meta: Mapping[str, Any]) -> int:
        """The most memory :meth:`embed_image` holds at once for ``shape[0]`` tiles: one
        tile's tower layer (tiles go through one at a time) beside every tile's output,
        kept and concatenated."""
        return self.visual.tower.activation_bytes(kept=2 * int(shape[0]))

    def embed_image(self, pixel_values: Array, meta: Mapping[str, Any]) -> Array:
        """One image's rows ``[tiles * tokens_per_tile, text hidden]`` from its tiles ``[tiles, 3, size, size]``."""
        return self.visual(pixel_values)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Idefics3ForConditionalGeneration:
    """Build Idefics3 / SmolVLM from an ``idefics3`` or ``smolvlm`` config.json dict."""
    return Idefics3ForConditionalGeneration(config, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Idefics3 and SmolVLM."""
    register(ArchitectureSpec(
        name="idefics3", model_types=("idefics3", "smolvlm"), build=build,
        description="Idefics3 / SmolVLM: image tiles through a SigLIP-style encoder, pixel shuffle and a projection, "
                    "into a Llama-family language model"))
