"""Vision transformers (ViT; Dosovitskiy et al. 2020) as vision-language models use them.

Two towers, as transformers' ``SiglipVisionModel`` and ``CLIPVisionModel``
compute them for one image ``[3, H, W]`` (float32 pixel values from the
family's image processor):

* **Patch embedding**: the stride-``p`` convolution of ``p x p`` patches is a
  reshape of the image into ``[patches, 3 * p * p]`` rows and one product
  with the kernel flattened alike (no new op: the conformance kit covers it).
* **Position embedding**: one learned row per patch (CLIP: a class token
  first, with its own row).
* **Encoder**: pre-norm blocks (LayerNorm with biases), bidirectional
  multi-head attention with biases (every patch sees every patch: one
  sequence of the contract's attention op, ``causal=False``), then an MLP
  (SigLIP: gelu-tanh; CLIP: quick-gelu, ``x * sigmoid(1.702 x)``).
* CLIP norms the embeddings before the encoder (``pre_layrnorm``, spelled as
  in the checkpoints); SigLIP norms the last layer's output
  (``post_layernorm``), which CLIP applies only to its pooled output.

:meth:`VisionTower.hidden_states` returns the stream after each layer (index
0: before the first), as transformers' ``output_hidden_states``: LLaVA reads
one of them (``vision_feature_layer``), Gemma 3 the post-normed last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import CausalLM, host_array
from infer.config import from_dict
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, LayerState
from infer.ops import Array, AttentionBatch, Backend

def activation_bytes(ops: Backend, tokens: int, hidden: int, intermediate: int, heads: int) -> int:
    """The most memory one encoder layer over ``tokens`` rows holds at once,
    from the shapes (an upper estimate, which the engine's admission
    reserves for an image: docs/vision.md, "Memory"): per row the residual
    stream, the normed rows, queries, keys, values and the attention output
    (6 x ``hidden``), the MLP's intermediate rows with the activation's
    temporaries (4 x ``intermediate``: quick-gelu's exp and quotient live
    beside its input), and every head's scores with their softmax (2 x
    ``heads`` x ``tokens``: the numpy backend's non-causal attention makes
    them whole, measured 1.1-1.2 x; fused attention makes less); and one
    weight matrix's size (a backend may lay a weight out anew per call)."""
    itemsize = 4 if ops.compute_dtype == "float32" else 2
    return itemsize * (tokens * (6 * hidden + 4 * intermediate + 2 * heads * tokens) + hidden * intermediate)


def exact_gelu_bytes(rows: int, width: int) -> int:
    """What an exact (erf) GELU over ``rows x width`` values may hold while it
    runs: the numpy backend evaluates erf through Python floats (measured
    about 80 bytes a value), far above the values' own size. A projector's
    exact GELU (LLaVA's ``gelu``, Qwen's merger) adds this to its estimate."""
    return 80 * rows * width


#: ``hidden_act`` names of the towers.
TOWER_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu", "quick_gelu")


@dataclass
class VisionConfig:
    """``vision_config`` fields (transformers' names and defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    model_type: str = "siglip_vision_model"

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                     "patch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: vision_config.{name} must be positive, found {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config.json: vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.image_size % self.patch_size:
            raise ConfigError(f"config.json: vision_config.image_size ({self.image_size}) must be a multiple of "
                              f"patch_size ({self.patch_size})")
        if self.hidden_act not in TOWER_ACTIVATIONS:
            raise ConfigError(f"config.json: vision_config.hidden_act {self.hidden_act!r} is not supported; "
                              f"supported: {', '.join(TOWER_ACTIVATIONS)}")
        if self.model_type not in ("siglip_vision_model", "clip_vision_model"):
            raise ConfigError(f"config.json: vision_config.model_type {self.model_type!r} is not a supported tower "
                              "(siglip_vision_model, clip_vision_model)")

    @property
    def clip(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def vision_config(config: dict[str, Any]) -> VisionConfig:
    """A ``vision_config`` dict read (``model_type`` defaults to SigLIP's)."""
    raw = config.get("vision_config")
    if not isinstance(raw, dict):
        raise ConfigError("config.json: a vision-language config needs a vision_config object")
    return from_dict(VisionConfig, raw)


class VisionTower:
    """A SigLIP or CLIP vision tower on the op contract (module docstring)."""

    def __init__(self, config: VisionConfig, weights: Any, ops: Backend, prefix: str, *,
                 layers: int | None = None, post_norm: bool = True) -> None:
        """``prefix``: where its weights are (``...vision_tower.vision_model.``);
        ``layers``: how many encoder layers to read (the ones after the last
        layer anyone reads are skipped); ``post_norm=False``: SigLIP's
        post-norm is not read (LLaVA reads hidden states, never the post-normed
        output, and llama.cpp's mmproj files for it leave the norm out)."""
        cfg, w = config, weights
        self.config, self.ops = cfg, ops
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.heads, self.head_dim = cfg.num_attention_heads, d // cfg.num_attention_heads
        e = prefix + "embeddings."
        self.patch_weight = w.get(e + "patch_embedding.weight", (d, c, p, p),
                                  transform=lambda a: a.reshape(d, c * p * p))
        self.patch_bias = None if cfg.clip else w.get(e + "patch_embedding.bias", (d,))
        tokens = cfg.patches_per_side ** 2 + (1 if cfg.clip else 0)
        self.positions = w.get(e + "position_embedding.weight", (tokens, d))
        self.class_embedding = w.get(e + "class_embedding", (d,), transform=lambda a: a.reshape(1, d)) \
            if cfg.clip else None
        ln = lambda name: (w.get(name + ".weight", (d,)), w.get(name + ".bias", (d,)))  # noqa: E731
        self.pre_norm = ln(prefix + "pre_layrnorm") if cfg.clip else None
        self.post_norm = None if cfg.clip or not post_norm else ln(prefix + "post_layernorm")
        self.layers = []
        for i in range(cfg.num_hidden_layers if layers is None else layers):
            q = f"{prefix}encoder.layers.{i}."
            lin = lambda name, o=d, n=d: (w.get(q + name + ".weight", (o, n)), w.get(q + name + ".bias", (o,)))  # noqa: E731
            self.layers.append({
                "norm1": ln(q + "layer_norm1"), "norm2": ln(q + "layer_norm2"),
                "q": lin("self_attn.q_proj"), "k": lin("self_attn.k_proj"), "v": lin("self_attn.v_proj"),
                "o": lin("self_attn.out_proj"),
                "fc1": lin("mlp.fc1", cfg.intermediate_size, d), "fc2": lin("mlp.fc2", d, cfg.intermediate_size),
            })
        n = tokens
        # One sequence, its keys the layer's own rows: the contract's attention op over a "pool" of them.
        self._batch = AttentionBatch(ops.from_numpy(host_array([0, n], "int32")),
                                     ops.from_numpy(host_array([n], "int32")),
                                     ops.from_numpy(host_array([0], "int32").reshape(1, 1)), n, n)

    @property
    def tokens(self) -> int:
        """Rows of one image in the encoder: its patches (and CLIP's class token)."""
        return self.config.patches_per_side ** 2 + (1 if self.config.clip else 0)

    def activation_bytes(self, kept: int = 0) -> int:
        """The most memory one image's forward holds at once (:func:`activation_bytes`),
        with ``kept`` more of the stream's states held (LLaVA keeps the layers it reads)."""
        cfg, ops = self.config, self.ops
        itemsize = 4 if ops.compute_dtype == "float32" else 2
        return (activation_bytes(ops, self.tokens, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads)
                + kept * itemsize * self.tokens * cfg.hidden_size)

    def embed(self, pixel_values: Array) -> Array:
        """``[tokens, hidden]``: patches (and CLIP's class token) with their positions."""
        ops, cfg = self.ops, self.config
        c, p, side = cfg.num_channels, cfg.patch_size, cfg.patches_per_side
        shape = tuple(ops.shape(pixel_values))
        if shape != (c, cfg.image_size, cfg.image_size):
            raise ConfigError(f"vision tower: pixel values of shape {list(shape)}; it reads "
                              f"[{c}, {cfg.image_size}, {cfg.image_size}]")
        x = ops.reshape(pixel_values, (c, side, p, side, p))
        x = ops.reshape(ops.transpose(x, (1, 3, 0, 2, 4)), (side * side, c * p * p))  # row-major patches
        h = ops.linear(x, self.patch_weight, self.patch_bias)
        if self.class_embedding is not None:
            h = ops.concat([self.class_embedding, h], 0)
        h = ops.add(h, self.positions)
        if self.pre_norm is not None:
            h = ops.layer_norm(h, *self.pre_norm, cfg.layer_norm_eps)
        return h

    def hidden_states(self, pixel_values: Array, upto: int | None = None) -> list[Array]:
        """The stream before the first layer and after each (of the first ``upto``)."""
        states = [self.embed(pixel_values)]
        for layer in self.layers[:upto]:
            states.append(self.block(states[-1], layer))
        return states

    def last_hidden_state(self, pixel_values: Array) -> Array:
        """The last layer's output, post-normed where the tower does (SigLIP)."""
        h = self.hidden_states(pixel_values)[-1]
        return h if self.post_norm is None else self.ops.layer_norm(h, *self.post_norm, self.config.layer_norm_eps)

    def block(self, h: Array, w: dict[str, Any]) -> Array:
        """One pre-norm encoder layer."""
        ops, eps = self.ops, self.config.layer_norm_eps
        n = ops.shape(h)[0]
        x = ops.layer_norm(h, *w["norm1"], eps)
        q, k, v = (ops.reshape(ops.linear(x, *w[name]), (n, self.heads, self.head_dim)) for name in "qkv")
        o = ops.attention(q, k, v, self._batch, scale=self.head_dim ** -0.5, causal=False)
        h = ops.add(h, ops.linear(ops.reshape(o, (n, self.heads * self.head_dim)), *w["o"]))
        x = ops.layer_norm(h, *w["norm2"], eps)
        return ops.add(h, ops.linear(self.act(ops.linear(x, *w["fc1"])), *w["fc2"]))

    def act(self, x: Array) -> Array:
        ops, name = self.ops, self.config.hidden_act
        if name == "quick_gelu":  # x * sigmoid(1.702 x)
            return ops.div(x, ops.add(ops.exp(ops.mul(x, -1.702)), 1.0))
        return ops.gelu(x) if name == "gelu" else ops.gelu_tanh(x)


def checkpoint_prefixes(weights: Any) -> tuple[str, str, str, str]:
    """Where a vision-language checkpoint keeps its parts: the language
    model's ``model.`` (``model.language_model.`` in transformers 5's module
    names, ``language_model.model.`` as it saves them and as 4.x did), its head,
    the tower and the projector (a tower's weights under ``vision_model.`` or not)."""
    lm = next((p for p in ("language_model.model.", "model.language_model.")
               if weights.has(p + "embed_tokens.weight")), "model.language_model.")
    head = next((h for h in ("lm_head.weight", "language_model.lm_head.weight") if weights.has(h)), "lm_head.weight")
    towers = [root + sub for root in ("vision_tower.", "model.vision_tower.") for sub in ("vision_model.", "")]
    tower = next((p for p in towers if weights.has(p + "embeddings.patch_embedding.weight")), towers[0])
    projector = next((p for p in ("multi_modal_projector.", "model.multi_modal_projector.")
                      if any(weights.has(p + n) for n in ("mm_input_projection_weight", "linear_1.weight"))),
                     "multi_modal_projector.")
    return lm, head, tower, projector


def avg_pool(ops: Backend, x: Array, side: int, out_side: int) -> Array:
    """``[side * side, d]`` row-major patches averaged over ``k x k`` squares
    (``k = side // out_side``): ``[out_side * out_side, d]``, row-major."""
    k, d = side // out_side, ops.shape(x)[-1]
    x = ops.reshape(x, (out_side, k, out_side, k, d))
    x = ops.mean(ops.mean(x, axis=3), axis=1)  # [out_side, out_side, d]
    return ops.reshape(x, (out_side * out_side, d))


class WrappedLanguageModel(CausalLM):
    """A vision-language model whose text half is a language model of its own
    architecture (``self.language_model``, built by the subclass): the text
    forward, its layers' states and its head are that model's; the subclass
    adds the vision tower and ``embed_image`` (LLaVA, Idefics3 / SmolVLM)."""

    language_model: CausalLM

    def layer_states(self) -> list[LayerState]:
        return self.language_model.layer_states()

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        return self.language_model.forward(input_ids, ctx)

    def compute_logits(self, hidden: Array) -> Array:
        return self.language_model.compute_logits(hidden)
