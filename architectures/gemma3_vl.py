"""Gemma 3 with images (``model_type`` ``gemma3``: ``Gemma3ForConditionalGeneration``).

The Gemma 3 report, section 2.1: a 400M SigLIP tower reads an 896 x 896
image as 64 x 64 patches of 14 pixels; the projector averages them over
4 x 4 squares into 256 "soft tokens", norms them (Gemma's RMSNorm, ``1 + w``)
and projects them into the language model's width (``mm_input_projection_weight``,
``[vision, text]``, applied as ``x @ W``). The prompt holds
``<start_of_image>``, 256 ``<image_soft_token>`` s and ``<end_of_image>``
(:func:`infer.image_processing.gemma3_processor`); the soft tokens' rows of the
scaled token embeddings are replaced by the projected image, unscaled.

Attention: the language model attends causally, except that the tokens of
one image attend to each other both ways (transformers' ``token_type_ids``
block mask, on full and sliding layers alike): :attr:`VisionSpec.bidirectional`,
which the engine turns into the attention batch's spans.

The language model is :class:`~.gemma3.Gemma3ForCausalLM` reading
``text_config`` and its weights where the checkpoint keeps them
(:func:`~.vision.checkpoint_prefixes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infer.architecture import RenamedWeights, VisionSpec, WeightLoader
from infer.config import from_dict
from infer.errors import ConfigError
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .gemma3 import Gemma3Config, Gemma3ForCausalLM, _gemma_norm, layer_rope
from .vision import VisionTower, avg_pool, checkpoint_prefixes, vision_config


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's language model with its SigLIP tower and projector."""

    def __init__(self, config: dict[str, Any], text: Gemma3Config, weights: WeightLoader, ops: Backend) -> None:
        lm, head, tower, projector = checkpoint_prefixes(weights)
        super().__init__(text, LanguageModelWeights(weights, lm, head), ops)  # type: ignore[arg-type]
        vcfg = vision_config(config)
        self.vision_tower = VisionTower(vcfg, weights, ops, tower)
        self.tokens = int(config.get("mm_tokens_per_image", 256))
        self.side = int(round(self.tokens ** 0.5))
        if self.side * self.side != self.tokens or vcfg.patches_per_side % self.side:
            raise ConfigError(f"config.json: mm_tokens_per_image ({self.tokens}) must be a square whose side divides "
                              f"the {vcfg.patches_per_side} patches per side")
        dv, dt = vcfg.hidden_size, text.hidden_size
        self.soft_norm = weights.get(projector + "mm_soft_emb_norm.weight", (dv,), transform=_gemma_norm)
        self.soft_eps = vcfg.layer_norm_eps
        self.projection = weights.get(projector + "mm_input_projection_weight", (dv, dt),
                                      transform=lambda a: a.T.copy())  # [text, vision]: a linear's layout
        image_token = config.get("image_token_index", config.get("image_token_id", 262144))
        self.vision = VisionSpec("gemma3", int(image_token), bidirectional=True, config=config)

    def image_activation_bytes(self, shape: Sequence[int], meta: Mapping[str, Any]) -> int:
        """The most memory :meth:`embed_image` holds at once for one image: the tower's (every
        image and pan-and-scan crop is one size and goes through alone; the rows they give
        are the request's embeddings, counted apart)."""
        return self.vision_tower.activation_bytes()

    def embed_image(self, pixel_values: Array, meta: Mapping[str, Any]) -> Array:
        """``[mm_tokens_per_image, text hidden]``: tower, 4 x 4 average, soft-embedding norm, projection;
        pan-and-scan's ``[1 + crops, 3, size, size]`` gives each view's rows, the whole image first."""
        ops, vcfg = self.ops, self.vision_tower.config
        shape = ops.shape(pixel_values)
        if len(shape) == 4:
            views = [self.embed_image(ops.reshape(ops.slice(pixel_values, 0, i, i + 1), tuple(shape[1:])), meta)
                     for i in range(shape[0])]
            return views[0] if len(views) == 1 else ops.concat(views, 0)
        h = self.vision_tower.last_hidden_state(pixel_values)  # [patches, vision hidden]
        pooled = avg_pool(ops, h, vcfg.patches_per_side, self.side)
        return ops.linear(ops.rms_norm(pooled, self.soft_norm, self.soft_eps), self.projection)


class LanguageModelWeights(RenamedWeights):
    """A text architecture's names (``model.*``, ``lm_head.weight``) inside a vision-language checkpoint."""

    def __init__(self, weights: WeightLoader, lm: str, head: str) -> None:
        super().__init__(weights, "model.", lm)
        self.head = head

    def _name(self, name: str) -> str:
        return self.head if name == "lm_head.weight" else super()._name(name)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Gemma3ForConditionalGeneration:
    """Build Gemma 3 with its vision tower from a ``gemma3`` ``config.json`` dict."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: a gemma3 config needs a text_config object")
    # transformers ties the head by the top-level flag (which follows text_config's when unset).
    text = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}
    cfg = from_dict(Gemma3Config, {**text, "rope": layer_rope(text)})
    return Gemma3ForConditionalGeneration(config, cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Gemma 3 with images."""
    register(ArchitectureSpec(
        name="gemma3_vl", model_types=("gemma3",), build=build,
        description="Gemma 3 4B-27B with images (SigLIP tower, 256 soft tokens per image)",
    ))
