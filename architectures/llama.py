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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.architecture import CausalLM, WeightLoader, capture
from infer.attention import AttentionContext
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.hookspecs import hookimpl
from infer.ops import Array, Backend
from infer.registry import ArchitectureSpec

from .mlp import GatedMLP, gated_mlp
from .projections import load_qkv
from .projections import qkv as project_qkv
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


class DecoderLayer:
    """One layer's weights. The math is in :func:`layer_pieces`, shared by all
    layers: the pieces before and after attention are pure functions of
    arrays, so with graph capture on they compile once for every layer."""

    def __init__(self, cfg: LlamaConfig, layer: int, w: WeightLoader, ops: Backend) -> None:
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        hd, nh, nkv, d = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        assert hd is not None and nkv is not None  # set by validate()
        self.layer, self.scale, self.window = layer, hd ** -0.5, cfg.window(layer)
        self.mlp = GatedMLP(f"{p}mlp.", d, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act], w, ops)
        #: Weights the piece before attention reads (biases only where present).
        self.attn_in = {
            "input_layernorm": w.get(p + "input_layernorm.weight", (d,)),
            **load_qkv(w, a, nh, nkv, hd, d),  # stacked as qkv_proj where stored alike
        }
        #: Weights the piece after attention reads.
        self.attn_out = {
            "o_proj": w.get(a + "o_proj.weight", (d, nh * hd)),
            "post_attention_layernorm": w.get(p + "post_attention_layernorm.weight", (d,)),
            **self.mlp.weights(),
        }
        if w.has(a + "o_proj.bias"):
            self.attn_out["o_proj.bias"] = w.get(a + "o_proj.bias", (d,))


def layer_pieces(ops: Backend, cfg: LlamaConfig) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The math of a decoder layer around its attention call:

    * ``first(h, w, cos, sin) -> (q, k, v, residual)`` for layer 0;
    * ``before(h, residual, w, cos, sin) -> (q, k, v, residual)``, which also
      adds the previous layer's output to the residual stream (fused with the
      input norm);
    * ``after(o, residual, w) -> (mlp_out, residual)``, returning the block's
      output *before* its residual add, which the next norm fuses.
    """
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim or 0, cfg.num_attention_heads, cfg.num_key_value_heads or 0
    activation = ACTIVATIONS[cfg.hidden_act]

    def qkv(x: Array, w: dict[str, Array], cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        q, k, v = project_qkv(ops, x, w, nh, nkv, hd)
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin), v

    def first(h: Array, w: dict[str, Array], cos: Array, sin: Array) -> tuple[Array, ...]:
        return (*qkv(ops.rms_norm(h, w["input_layernorm"], eps), w, cos, sin), h)

    def before(h: Array, residual: Array, w: dict[str, Array], cos: Array, sin: Array) -> tuple[Array, ...]:
        x, residual = ops.fused_add_rms_norm(h, residual, w["input_layernorm"], eps)
        return (*qkv(x, w, cos, sin), residual)

    def after(o: Array, residual: Array, w: dict[str, Array]) -> tuple[Array, Array]:
        t = ops.shape(o)[0]
        a = ops.linear(ops.reshape(o, (t, nh * hd)), w["o_proj"], w.get("o_proj.bias"))
        x, residual = ops.fused_add_rms_norm(a, residual, w["post_attention_layernorm"], eps)
        return gated_mlp(ops, activation, x, w), residual

    return capture(ops, first), capture(ops, before), capture(ops, after)


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
        self.first, self.before, self.after = layer_pieces(ops, cfg)
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
            if residual is None:
                q, k, v, residual = self.first(h, layer.attn_in, cos, sin)
            else:
                q, k, v, residual = self.before(h, residual, layer.attn_in, cos, sin)
            o = ctx.attention(layer.layer, q, k, v, scale=layer.scale, window=layer.window)
            h, residual = self.after(o, residual, layer.attn_out)
        h, _ = ops.fused_add_rms_norm(h, residual, self.norm, self.eps)
        return h  # [tokens, hidden]


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
