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
  square (NaViT-style buckets for smaller tiles, which the processor never
  makes: a tile is always the full square, so patch ``i`` takes vector ``i``).
* **Encoder**: SigLIP's pre-norm blocks (LayerNorm ``layer_norm_eps``;
  ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` with biases, bidirectional
  over one tile's patches; LayerNorm, ``fc1``, ``hidden_act``, ``fc2``), then
  ``post_layernorm``.
* **Connector**: pixel shuffle by ``scale_factor`` (each ``s x s`` block of
  patches side by side into one vector of ``s**2 * hidden``, Shi et al. 2016's
  space-to-depth), then ``modality_projection.proj`` (no bias) to the text
  width: ``(image_size / patch_size / s)**2`` image tokens per tile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infer.architecture import CausalLM, VisionSpec, WeightLoader
from infer.config import from_dict
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, LayerState
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from . import llama
from .decoder import activation
from .gemma3_vl import LanguageModelWeights
from .qwen3_5_vision import bidirectional_batch


@dataclass
class Idefics3VisionConfig:
    """``vision_config`` fields read (transformers names and defaults)."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def validate(self) -> None:
        """Positive sizes, heads dividing the width, patches tiling the image."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                     "image_size", "patch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: vision_config.{name} must be positive, found {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config.json: vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.image_size % self.patch_size:
            raise ConfigError(f"config.json: vision_config.image_size ({self.image_size}) must be a multiple of "
                              f"patch_size ({self.patch_size})")
        activation("vision_config.hidden_act", self.hidden_act)

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size


class Idefics3VisionModel:
    """SigLIP-style tile encoder and the pixel-shuffle connector (module docstring)."""

    def __init__(self, config: Idefics3VisionConfig, scale_factor: int, text_hidden: int, weights: WeightLoader,
                 ops: Backend, *, prefix: str = "model.") -> None:
        if scale_factor <= 0 or config.side % scale_factor:
            raise ConfigError(f"config.json: scale_factor ({scale_factor}) must divide the {config.side} patches "
                              "along a tile's side")
        self.config, self.ops, self.scale = config, ops, scale_factor
        cfg, w, d = config, weights, config.hidden_size
        self.act = activation("vision_config.hidden_act", cfg.hidden_act)
        v = prefix + "vision_model."

        def linear(name: str, rows: int, cols: int) -> tuple[Array, Array]:
            return w.get(name + ".weight", (rows, cols)), w.get(name + ".bias", (rows,))

        def norm(name: str) -> tuple[Array, Array]:
            return w.get(name + ".weight", (d,)), w.get(name + ".bias", (d,))

        p = cfg.patch_size
        self.patch_embedding = (
            w.get(v + "embeddings.patch_embedding.weight", (d, cfg.num_channels, p, p),
                  transform=lambda a: a.reshape(d, -1)),
            w.get(v + "embeddings.patch_embedding.bias", (d,)))
        self.position_embedding = w.get(v + "embeddings.position_embedding.weight", (cfg.side ** 2, d))
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            b = f"{v}encoder.layers.{i}."
            self.layers.append({"norm1": norm(b + "layer_norm1"), "norm2": norm(b + "layer_norm2"),
                                **{name: linear(b + "self_attn." + name, d, d)
                                   for name in ("q_proj", "k_proj", "v_proj", "out_proj")},
                                "fc1": linear(b + "mlp.fc1", cfg.intermediate_size, d),
                                "fc2": linear(b + "mlp.fc2", d, cfg.intermediate_size)})
        self.post_layernorm = norm(v + "post_layernorm")
        self.projection = w.get(prefix + "connector.modality_projection.proj.weight",
                                (text_hidden, d * scale_factor ** 2))

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens one tile gives (transformers' ``image_seq_len``)."""
        return (self.config.side // self.scale) ** 2

    def sequence_lengths(self, tiles: int) -> list[int]:
        """Patches per attention sequence: one tile each."""
        return [self.config.side ** 2] * tiles

    def __call__(self, pixel_values: Array) -> Array:
        """Image embeddings ``[tiles * tokens_per_tile, text hidden]`` of tiles
        ``[tiles, channels, image_size, image_size]``, tile after tile (each
        attending within itself)."""
        ops, cfg = self.ops, self.config
        tiles, c = ops.shape(pixel_values)[:2]
        batch = bidirectional_batch(ops, self.sequence_lengths(tiles))
        n, p, d, s = cfg.side, cfg.patch_size, cfg.hidden_size, self.scale
        heads = cfg.num_attention_heads
        hd = d // heads
        patches = ops.transpose(ops.reshape(pixel_values, (tiles, c, n, p, n, p)), (0, 2, 4, 1, 3, 5))
        x = ops.linear(ops.reshape(patches, (tiles * n * n, c * p * p)), *self.patch_embedding)
        x = ops.add(ops.reshape(x, (tiles, n * n, d)), self.position_embedding)
        x = ops.reshape(x, (tiles * n * n, d))
        rows = tiles * n * n
        for layer in self.layers:
            y = ops.layer_norm(x, *layer["norm1"], cfg.layer_norm_eps)
            q, k, v = (ops.reshape(ops.linear(y, *layer[name]), (rows, heads, hd))
                       for name in ("q_proj", "k_proj", "v_proj"))
            o = ops.attention(q, k, v, batch, scale=hd ** -0.5, causal=False)  # [patches, heads, head_dim]
            x = ops.add(x, ops.linear(ops.reshape(o, (rows, d)), *layer["out_proj"]))
            y = ops.layer_norm(x, *layer["norm2"], cfg.layer_norm_eps)
            x = ops.add(x, ops.linear(getattr(ops, self.act)(ops.linear(y, *layer["fc1"])), *layer["fc2"]))
        x = ops.layer_norm(x, *self.post_layernorm, cfg.layer_norm_eps)
        # Pixel shuffle as transformers writes it: columns in groups of s, then rows in groups of s.
        x = ops.transpose(ops.reshape(x, (tiles, n, n // s, d * s)), (0, 2, 1, 3))
        x = ops.transpose(ops.reshape(x, (tiles, n // s, n // s, d * s * s)), (0, 2, 1, 3))
        return ops.linear(ops.reshape(x, (tiles * (n // s) ** 2, d * s * s)), self.projection)


def vision_config(config: dict[str, Any]) -> Idefics3VisionConfig:
    """The tile encoder's settings from an ``idefics3`` / ``smolvlm`` config.json dict."""
    nested = config.get("vision_config")
    if not isinstance(nested, dict):
        raise ConfigError("config.json: an idefics3 / smolvlm model needs a vision_config")
    return from_dict(Idefics3VisionConfig, nested)


class Idefics3ForConditionalGeneration(CausalLM):
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
        text = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}
        #: The language model, built by its own architecture.
        self.language_model: CausalLM = llama.build(text, LanguageModelWeights(weights, "model.text_model.",
                                                                             "lm_head.weight"), ops)  # type: ignore[arg-type]
        self.visual = Idefics3VisionModel(vision_config(config), int(config.get("scale_factor", 2)),
                                          int(text["hidden_size"]), weights, ops)
        lm = self.language_model
        self.num_layers, self.max_context, self.vocab_size = lm.num_layers, lm.max_context, lm.vocab_size
        self.lm_head = lm.lm_head
        self.vision = VisionSpec("idefics3", int(config.get("image_token_id", 128257)), config=config)

    def layer_states(self) -> list[LayerState]:
        return self.language_model.layer_states()

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        return self.language_model.forward(input_ids, ctx)

    def compute_logits(self, hidden: Array) -> Array:
        return self.language_model.compute_logits(hidden)

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
