"""Gemma 3 text models (Gemma Team, "Gemma 3 Technical Report", 2025).

``model_type`` ``gemma3_text``: Gemma 3 270M/1B and the text half of the larger
ones, as transformers' ``Gemma3ForCausalLM`` computes them. Against Llama:

* Local and global layers (report section 2.2): most layers attend within a
  ``sliding_window``; every ``sliding_window_pattern``-th layer (5 local : 1
  global in the released models) attends to everything. transformers 5 lists
  the kinds in ``layer_types``; older configs give only the pattern.
* Two rope settings: local layers rotate with base ``rope_local_base_freq``
  (10 000, never scaled), global ones with ``rope_theta`` (1 000 000) and the
  optional scaling (linear, factor 8, in the 4B-27B models). transformers 5
  writes one ``rope_parameters`` dict per layer type; 4.x wrote
  ``rope_theta`` + ``rope_local_base_freq`` + ``rope_scaling``. Both are read.
* RMSNorm on each head's queries and keys (``q_norm``, ``k_norm``), and norms
  before *and after* both attention and feed-forward.
* Hugging Face checkpoints store Gemma's norm weights as ``w`` and scale by
  ``1 + w``; they are loaded as ``1 + w`` so the contract's ``rms_norm``
  (``x / rms * weight``) applies. (GGUF files store ``1 + w`` already; the
  format module turns them back into the Hugging Face form.)
* Embeddings scaled by ``sqrt(hidden_size)``, rounded to the compute dtype as
  transformers does; attention scaled by ``query_pre_attn_scalar ** -0.5``
  instead of ``head_dim ** -0.5``; gelu-tanh feed-forward; tied output head.
* ``final_logit_softcapping``, when set, caps the logits: ``c * tanh(x / c)``.
  ``attn_logit_softcapping`` is ignored, as transformers' Gemma 3 ignores it
  (no attention implementation there receives it: Gemma 3 replaced Gemma 2's
  attention soft-capping with the q/k norms, report section 2.1), so a config
  that sets it still computes what the reference computes.
* ``use_bidirectional_attention`` ("EmbeddingGemma: Powerful and
  Lightweight Text Representations", 2025): every layer attends both ways
  (``causal=False``), a sliding layer to keys less than
  ``sliding_window // 2 + 1`` positions away on either side, as transformers'
  config halves the window; the model then embeds (:mod:`infer.embedding`)
  and does not generate.

Per layer (the block of :mod:`.decoder` with its post norms; ``kind`` = sliding or full attention):
    h = h + post_attention_layernorm(o_proj(attention(rope_kind(q_norm(q)), rope_kind(k_norm(k)), v)))
    h = h + post_feedforward_layernorm(down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)))
with x = input_layernorm(h) resp. pre_feedforward_layernorm(h).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import FullAttention, LayerState, SlidingWindow
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Attention, Block, Decoder, DecoderLayer, activation
from .mlp import GatedMLP
from .rope import RotaryEmbedding, context_length

log = logging.getLogger(__name__)

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class Gemma3Config:
    """``config.json`` fields read by this architecture (transformers names and
    defaults: a key missing from config.json means what it means there)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6  # transformers 4.x: every Nth layer is global
    layer_types: list[str] | None = None  # transformers 5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> rope settings

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                     "sliding_window_pattern"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"config.json: {name} must be positive, found {value}")
        activation("hidden_activation", self.hidden_activation)
        if self.use_bidirectional_attention and self.sliding_window:
            # As transformers' Gemma3TextConfig: config.json's window w becomes w // 2 + 1, every key
            # less than that away on either side (w // 2 tokens each way; 257 for EmbeddingGemma's 512).
            self.sliding_window = self.sliding_window // 2 + 1
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for full attention."""
        assert self.layer_types is not None  # set by validate()
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def layer_rope(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope settings per layer type, from either config form (module docstring).

    Missing values default as in transformers' ``Gemma3TextConfig``: global
    layers ``rope_theta`` 1e6 with any ``rope_scaling``, local layers
    ``rope_local_base_freq`` 1e4, unscaled.
    """
    raw = config.get("rope_parameters")
    local_theta = config.get("rope_local_base_freq", 10_000.0)
    if isinstance(raw, dict) and any(kind in raw for kind in LAYER_TYPES):  # transformers 5
        full = rope_parameters({**config, "rope_parameters": raw.get("full_attention") or {}}, 1e6)
        local_params = raw.get("sliding_attention") or {}
        local = rope_parameters({"rope_theta": local_theta, "rope_parameters": local_params})
    else:  # transformers 4.x
        full = rope_parameters(config, 1e6)
        local = rope_parameters({"rope_theta": local_theta})
    return {"full_attention": full, "sliding_attention": local}


def _gemma_norm(w: Any) -> Any:
    """Gemma's RMSNorm scales by ``1 + w`` (computed in float32, as here)."""
    return w + 1.0


class Gemma3ForCausalLM(Decoder):
    """Scaled embedding, decoder layers, final norm, tied output head, optional soft-cap."""

    def __init__(self, config: Gemma3Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w = config, weights
        hd, nh, d = cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size
        assert cfg.layer_types is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope["full_attention"], cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.final_softcap = cfg.final_logit_softcapping
        #: EmbeddingGemma (``use_bidirectional_attention``): every layer attends both ways (the sliding ones
        #: to keys less than a window away on either side, as transformers' bidirectional window overlay),
        #: so it embeds whole texts (infer.embedding) and generates nothing.
        self.is_encoder = cfg.use_bidirectional_attention
        if cfg.attn_logit_softcapping is not None:
            log.warning("gemma3: attn_logit_softcapping=%s is ignored, as in transformers' Gemma 3",
                        cfg.attn_logit_softcapping)
        attention = Attention(ops, d, nh, cfg.num_key_value_heads, hd, qk_norm=True, eps=cfg.rms_norm_eps)
        mlp = GatedMLP(ops, d, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_activation])
        block = Block(ops, attention, mlp, cfg.rms_norm_eps, post_norms=True)
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        # from_numpy rounds sqrt(hidden) to the compute dtype, as transformers casts the
        # normalizer to the embedding's dtype (sqrt(3072) = 55.4256 becomes 55.5 in bfloat16).
        self.embed_scale = ops.from_numpy(host_array([d ** 0.5]))
        self.rope = {kind: RotaryEmbedding(ops, hd, cfg.rope[kind], cfg.max_position_embeddings)
                     for kind in sorted(set(cfg.layer_types))}
        norm = lambda name, n=d: w.get(name + ".weight", (n,), transform=_gemma_norm)  # noqa: E731
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            attn = attention.load(w, a, bias=cfg.attention_bias)  # qkv_proj where stored alike
            weights = {"attn_norm": norm(p + "input_layernorm"), **attn,
                       "q_norm": norm(a + "q_norm", hd), "k_norm": norm(a + "k_norm", hd),
                       "attn_post_norm": norm(p + "post_attention_layernorm"),
                       "mlp_norm": norm(p + "pre_feedforward_layernorm"), **mlp.load(w, p + "mlp."),
                       "mlp_post_norm": norm(p + "post_feedforward_layernorm")}
            self.layers.append(DecoderLayer(i, block, weights, scale=cfg.query_pre_attn_scalar ** -0.5,
                                            window=cfg.window(i), rope=kind,
                                            causal=not cfg.use_bidirectional_attention))
        self.norm = norm("model.norm")
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def layer_states(self) -> list[LayerState]:
        """Local layers keep their window's keys and values only."""
        return [FullAttention() if layer.window is None else SlidingWindow(layer.window) for layer in self.layers]

    def compute_logits(self, hidden: Array) -> Array:
        logits = super().compute_logits(hidden)  # [rows, vocab]
        return logits if self.final_softcap is None else self.ops.softcap(logits, self.final_softcap)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Gemma3ForCausalLM:
    """Build a Gemma 3 text model from a ``config.json`` dict."""
    cfg = from_dict(Gemma3Config, {**config, "rope": layer_rope(config)})
    return Gemma3ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Gemma 3 (text)."""
    register(ArchitectureSpec(
        name="gemma3", model_types=("gemma3_text",), build=build,
        description="Gemma 3 text models (270M, 1B; the text part of 4B-27B)",
    ))
