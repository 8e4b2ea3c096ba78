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
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Attention, Block, Decoder, DecoderLayer, activation
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


class LlamaForCausalLM(Decoder):
    """Embedding, decoder layers, final norm, output head."""

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d, hd = config, weights, config.hidden_size, config.head_dim
        assert hd is not None and cfg.num_key_value_heads is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        attention = Attention(ops, d, cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        mlp = GatedMLP(ops, d, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act])
        block = Block(ops, attention, mlp, cfg.rms_norm_eps)
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            attn_in, attn_out = attention.load(w, p + "self_attn.")  # biases where present (Qwen2: q, k, v)
            self.layers.append(DecoderLayer(
                i, block, scale=hd ** -0.5, window=cfg.window(i),
                attn_in={"attn_norm": w.get(p + "input_layernorm.weight", (d,)), **attn_in},
                attn_out={**attn_out, "mlp_norm": w.get(p + "post_attention_layernorm.weight", (d,)),
                          **mlp.load(w, p + "mlp.")},
            ))
        self.norm = w.get("model.norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))


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
