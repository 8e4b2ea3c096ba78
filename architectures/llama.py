"""Llama and its close relatives (Touvron et al. 2023; Llama 3 report 2024).

One file covers Llama 2/3/3.1/3.2, TinyLlama, SmolLM2 (``model_type``
``llama``), Mistral (``mistral``: sliding-window attention) and Qwen2/2.5
(``qwen2``: biases on q, k and v). Differences between them are data, not
code paths: biases are used when the checkpoint has them, the window comes
from the config, the output head is tied to the embedding when the config
says so.

Per layer (the pre-norm block of :mod:`.decoder`):
    h = h + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   x = input_layernorm(h)
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))                         x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from infer.architecture import WeightLoader
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import (
    ACTIVATIONS,
    Attention,
    Block,
    Decoder,
    DecoderLayer,
    MLPPart,
    Weights,
    activation,
)
from .mlp import GatedMLP
from .rope import RotaryEmbedding, context_length


@dataclass
class LlamaConfig:
    """``config.json`` fields read by this architecture (transformers names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "llama"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    use_sliding_window: bool | None = None  # qwen2
    max_window_layers: int | None = None  # qwen2
    layer_types: list[str] | None = None  # transformers 5: per-layer attention kind
    rope: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"config.json: hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_attention_heads}) and head_dim is not given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        activation("hidden_act", self.hidden_act)
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_hidden_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):  # slide only when asked, from max_window_layers on
            if not self.use_sliding_window:
                return None
            return self.sliding_window if layer >= (self.max_window_layers or 0) else None
        return self.sliding_window


class LlamaForCausalLM(Decoder):
    """Embedding, decoder layers, final norm, output head.

    The families built on Llama (qwen3, mixtral, phi3, olmo2, smollm3,
    granite, ...) subclass it and override the hooks below, each one
    difference: the attention and MLP parts, the block variant, the norm
    weights of a layer, its rope table, the attention scale.
    """

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d, hd = config, weights, config.hidden_size, config.head_dim
        assert hd is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        attention = self.attention_part()
        blocks: dict[int, Block] = {}  # one block per distinct MLP part
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            mlp, mlp_prefix = self.mlp_part(i)
            if id(mlp) not in blocks:
                blocks[id(mlp)] = Block(ops, attention, mlp, cfg.rms_norm_eps, **self.block_options())
            block = blocks[id(mlp)]
            attn = self.load_attention(attention, w, p + "self_attn.")
            weights = self.load_norms(w, p) | attn | mlp.load(w, p + mlp_prefix)
            self.layers.append(DecoderLayer(i, block, weights, scale=self.attention_scale(), window=cfg.window(i),
                                            rope=self.layer_rope(i)))
        self.norm = w.get("model.norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    # ---- the hooks a family overrides

    def attention_part(self) -> Attention:
        """The attention part of every layer."""
        cfg = self.config
        return Attention(self.ops, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    def load_attention(self, attention: Attention, w: WeightLoader, prefix: str) -> Weights:
        """Its weights under ``prefix`` (``...self_attn.``): biases where present (Qwen2: q, k, v)."""
        return attention.load(w, prefix)

    def mlp_part(self, layer: int) -> tuple[MLPPart, str]:
        """The MLP part of ``layer`` and the prefix of its weights after ``model.layers.N.``;
        layers that share a part (the same object) share their block."""
        return self.dense_mlp, "mlp."

    @cached_property
    def dense_mlp(self) -> GatedMLP:
        """The gated MLP of ``intermediate_size`` (every layer's, in Llama)."""
        cfg = self.config
        return GatedMLP(self.ops, cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act])

    def block_options(self) -> dict[str, Any]:
        """Keywords of :class:`~.decoder.Block`: the pre-norm block here."""
        return {}

    def load_norms(self, w: WeightLoader, prefix: str) -> Weights:
        """A layer's norm weights by role (``attn_norm``, ``mlp_norm``, ...)."""
        d = self.config.hidden_size
        return {"attn_norm": w.get(prefix + "input_layernorm.weight", (d,)),
                "mlp_norm": w.get(prefix + "post_attention_layernorm.weight", (d,))}

    def layer_rope(self, layer: int) -> str | None:
        """The rotary table ``layer`` uses (None: no rope)."""
        return "default"

    def attention_scale(self) -> float:
        """The softmax scale."""
        return self.config.head_dim ** -0.5


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> LlamaForCausalLM:
    """Build a llama-family model from a ``config.json`` dict."""
    cfg = from_dict(LlamaConfig, {**config, "rope": rope_parameters(config)})
    return LlamaForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register the llama family."""
    register(ArchitectureSpec(
        name="llama", model_types=("llama", "mistral", "qwen2"), build=build,
        description="Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2/2.5",
    ))
