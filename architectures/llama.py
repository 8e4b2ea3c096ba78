"""Llama and its close relatives (Touvron et al. 2023; Llama 3 report 2024).

One file covers Llama 2/3/3.1/3.2, TinyLlama, SmolLM2 (``model_type``
``llama``), Mistral (``mistral``: sliding-window attention) and Qwen2/2.5
(``qwen2``: biases on q, k and v). Differences between them are data, not
code paths: biases are used when the checkpoint has them, the window comes
from the config, the output head is tied to the embedding when the config
says so.

Per layer (pre-norm residual block):
    h = h + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   x = rms_norm(h)
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))                         x = rms_norm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import CausalLM, WeightLoader
from infer.attention import AttentionContext
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.hookspecs import hookimpl
from infer.ops import Array, Backend
from infer.registry import ArchitectureSpec

from .mlp import GatedMLP
from .rope import RotaryEmbedding

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}


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
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"config.json: hidden_act {self.hidden_act!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        if self.model_type == "qwen2":  # Qwen2 slides only when asked, from max_window_layers on
            if not self.use_sliding_window:
                return None
            return self.sliding_window if layer >= (self.max_window_layers or 0) else None
        return self.sliding_window


class Attention:
    def __init__(self, cfg: LlamaConfig, layer: int, w: WeightLoader, ops: Backend) -> None:
        p = f"model.layers.{layer}.self_attn."
        hd, nh, nkv, d = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        assert hd is not None and nkv is not None  # set by validate()
        self.ops, self.layer, self.heads, self.kv_heads, self.head_dim = ops, layer, nh, nkv, hd
        self.q_proj = w.get(p + "q_proj.weight", (nh * hd, d))
        self.k_proj = w.get(p + "k_proj.weight", (nkv * hd, d))
        self.v_proj = w.get(p + "v_proj.weight", (nkv * hd, d))
        self.o_proj = w.get(p + "o_proj.weight", (d, nh * hd))
        bias = lambda name, n: w.get(p + name, (n,)) if w.has(p + name) else None  # noqa: E731
        self.q_bias, self.k_bias = bias("q_proj.bias", nh * hd), bias("k_proj.bias", nkv * hd)
        self.v_bias, self.o_bias = bias("v_proj.bias", nkv * hd), bias("o_proj.bias", d)
        self.scale = hd ** -0.5
        self.window = cfg.window(layer)

    def __call__(self, x: Array, cos: Array, sin: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        t = ops.shape(x)[0]
        q = ops.reshape(ops.linear(x, self.q_proj, self.q_bias), (t, self.heads, self.head_dim))
        k = ops.reshape(ops.linear(x, self.k_proj, self.k_bias), (t, self.kv_heads, self.head_dim))
        v = ops.reshape(ops.linear(x, self.v_proj, self.v_bias), (t, self.kv_heads, self.head_dim))
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ctx.attention(self.layer, q, k, v, scale=self.scale, window=self.window)
        return ops.linear(ops.reshape(o, (t, self.heads * self.head_dim)), self.o_proj, self.o_bias)


class DecoderLayer:
    def __init__(self, cfg: LlamaConfig, layer: int, w: WeightLoader, ops: Backend) -> None:
        p = f"model.layers.{layer}."
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.input_layernorm = w.get(p + "input_layernorm.weight", (cfg.hidden_size,))
        self.self_attn = Attention(cfg, layer, w, ops)
        self.post_attention_layernorm = w.get(p + "post_attention_layernorm.weight", (cfg.hidden_size,))
        self.mlp = GatedMLP(f"{p}mlp.", cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act], w, ops)

    def __call__(
        self, h: Array, residual: Array | None, cos: Array, sin: Array, ctx: AttentionContext
    ) -> tuple[Array, Array]:
        """Returns the block's output *before* its residual add, and the residual
        stream; the next norm fuses the add."""
        ops = self.ops
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, self.input_layernorm, self.eps)
        a = self.self_attn(x, cos, sin, ctx)
        x, residual = ops.fused_add_rms_norm(a, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    """Embedding, decoder layers, final norm, output head."""

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg = config
        self.num_layers = cfg.num_hidden_layers
        self.max_context = cfg.max_position_embeddings
        if cfg.rope.get("rope_type") == "dynamic":
            # Dynamic NTK scaling exists to run past the trained length, by its factor.
            self.max_context = int(cfg.max_position_embeddings * float(cfg.rope["factor"]))
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.embed_tokens = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.rope = RotaryEmbedding(ops, cfg.head_dim or 0, cfg.rope, cfg.max_position_embeddings)
        self.layers = [DecoderLayer(cfg, i, weights, ops) for i in range(cfg.num_hidden_layers)]
        self.norm = weights.get("model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = weights.get("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        h = ops.embedding(self.embed_tokens, input_ids)  # [tokens, hidden]
        cos, sin = self.rope(ctx)  # [tokens, head_dim/2], shared by every layer
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, ctx)
        h, _ = ops.fused_add_rms_norm(h, residual, self.norm, self.eps)
        if ctx.capture_hidden:  # [tokens, hidden]: what the output head reads
            ctx.hidden = h
        if ctx.logits_indices is not None:
            h = ops.take(h, ctx.logits_indices, axis=0)
        return ops.linear(h, self.lm_head)  # [rows, vocab]


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
