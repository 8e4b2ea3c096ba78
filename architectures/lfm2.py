"""LFM2 (Liquid AI, "LFM2 Technical Report", 2025): short convolutions and attention.

``model_type`` ``lfm2`` as transformers' ``Lfm2ForCausalLM`` computes it.
Against Llama (:mod:`.llama`):

* Most layers are gated **short convolutions** instead of attention
  (``layer_types`` ``"conv"``; the others ``"full_attention"``). A conv
  layer projects its input to three gates, ``B, C, x = in_proj(x)``, runs a
  depthwise causal convolution of ``conv_L_cache`` taps over ``B * x`` and
  gates the result with ``C`` before ``out_proj``:

      y = out_proj(C * conv1d(B * x))

  Its state is the last ``conv_L_cache - 1`` inputs of the convolution
  (:class:`~infer.kv.attention.Recurrent` ``{"conv": (L - 1, hidden)}``),
  so decoding a token costs the same at any length. ``conv_bias`` puts
  biases on ``in_proj``, the convolution and ``out_proj`` alike.
* Attention layers are grouped-query with RMSNorm on each head's q and k
  (``q_layernorm``, ``k_layernorm``), as Qwen3, no biases; the output
  projection is ``out_proj``.
* Every layer has the same SwiGLU feed-forward (``w1``, ``w3``, ``w2``)
  whose width follows Llama's rule when ``block_auto_adjust_ff_dim`` (the
  default): ``2/3`` of ``intermediate_size`` (``block_ff_dim`` in Liquid's
  configs), times ``block_ffn_dim_multiplier``, rounded up to a multiple of
  ``block_multiple_of``.
* The norms are ``operator_norm`` (before the conv or attention) and
  ``ffn_norm``; the final norm is called ``embedding_norm``. The output head
  is tied to the embedding by default (``tie_embedding`` in Liquid's configs).
* Configs without ``layer_types`` name the attention layers in
  ``full_attn_idxs`` (every layer when both are missing, as transformers).

Per layer (``op`` the conv or the attention):
    h = h + op(operator_norm(h))
    h = h + w2(silu(w1(x)) * w3(x))       x = ffn_norm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader
from infer.config import check_layer_types, check_range, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, FullAttention, LayerState, Recurrent
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import Attention, Block, Decoder, DecoderLayer, Weights
from .mlp import GatedMLP
from .projections import load_qkv
from .rope import RotaryEmbedding, context_length

LAYER_TYPES = ("full_attention", "conv")


@dataclass
class Lfm2Config:
    """``config.json`` fields read (transformers' ``Lfm2Config`` names and defaults)."""

    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # not a field of Lfm2Config; read when a config.json has it
    max_position_embeddings: int = 128_000
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    tie_embedding: bool | None = None  # Liquid's name; wins over tie_word_embeddings
    block_ff_dim: int | None = None  # Liquid's name for intermediate_size; wins over it
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None
    rope: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.tie_embedding is not None:
            self.tie_word_embeddings = self.tie_embedding
        if self.block_ff_dim is not None:
            self.intermediate_size = self.block_ff_dim
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "block_multiple_of"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        check_range("conv_L_cache", self.conv_L_cache, 1, 1 << 12)
        check_range("norm_eps", self.norm_eps, 0.0, 1.0)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads  # transformers floors it too
        if self.layer_types is None:
            n = self.num_hidden_layers
            attn = self.full_attn_idxs if self.full_attn_idxs is not None else list(range(n))
            self.layer_types = ["full_attention" if i in attn else "conv" for i in range(n)]
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)
        if self.block_ffn_dim_multiplier is not None and not self.block_ffn_dim_multiplier > 0:
            raise ConfigError(f"config.json: block_ffn_dim_multiplier must be positive, "
                              f"found {self.block_ffn_dim_multiplier}")
        if self.ff_dim() <= 0:
            raise ConfigError(f"config.json: the feed-forward width from intermediate_size {self.intermediate_size} "
                              f"is {self.ff_dim()} (block_auto_adjust_ff_dim takes 2/3 of it); it must be positive")

    def ff_dim(self) -> int:
        """The feed-forward width: transformers' ``Lfm2MLP`` rule (module docstring)."""
        n = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            n = int(2 * n / 3)
            if self.block_ffn_dim_multiplier is not None:
                m = self.block_multiple_of
                n = int(self.block_ffn_dim_multiplier * n)
                n = m * ((n + m - 1) // m)
        return n


class ShortConv:
    """LFM2's gated short convolution (module docstring): ``in_proj`` to
    ``B, C, x``, a depthwise causal convolution of ``B * x`` carrying its
    last ``kernel - 1`` inputs per sequence, ``C *`` it, ``out_proj``."""

    def __init__(self, ops: Backend, hidden: int, kernel: int) -> None:
        self.ops, self.hidden, self.kernel = ops, hidden, kernel

    def state(self) -> Recurrent:
        """The layer's state: the convolution's window, in the compute dtype (its inputs' own)."""
        return Recurrent({"conv": (self.kernel - 1, self.hidden)}, self.ops.compute_dtype)

    def load(self, w: WeightLoader, prefix: str, *, bias: bool) -> Weights:
        """``in_proj``, ``conv`` (``[hidden, kernel]``) and ``out_proj`` under ``prefix`` (``...conv.``)."""
        d, k = self.hidden, self.kernel
        out = {"in_proj": w.get(prefix + "in_proj.weight", (3 * d, d)),
               "conv": w.get(prefix + "conv.weight", (d, 1, k), transform=lambda a: a.reshape(d, k)),
               "out_proj": w.get(prefix + "out_proj.weight", (d, d))}
        if bias:
            out |= {"in_proj.bias": w.get(prefix + "in_proj.bias", (3 * d,)),
                    "conv.bias": w.get(prefix + "conv.bias", (d,)),
                    "out_proj.bias": w.get(prefix + "out_proj.bias", (d,))}
        return out

    def __call__(self, x: Array, w: Weights, ctx: AttentionContext, layer: int) -> Array:
        ops, d = self.ops, self.hidden
        bcx = ops.linear(x, w["in_proj"], w.get("in_proj.bias"))  # [tokens, 3 * hidden]: B, C, x
        b, c, xs = (ops.slice(bcx, 1, i * d, (i + 1) * d) for i in range(3))
        y, window, at_rows = ops.causal_conv1d(ops.mul(b, xs), ctx.state(layer)["conv"], w["conv"],
                                               w.get("conv.bias"), ctx.query_start, ctx.checkpoint_rows)
        ctx.set_state(layer, {"conv": window}, {"conv": at_rows})
        return ops.linear(ops.mul(c, y), w["out_proj"], w.get("out_proj.bias"))


class Lfm2ForCausalLM(Decoder):
    """Embedding, conv and attention layers, final norm, (tied) output head."""

    def __init__(self, config: Lfm2Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        assert hd is not None and cfg.layer_types is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)
        self.eps = cfg.norm_eps
        self.mlp = GatedMLP(ops, d, cfg.ff_dim(), "silu", names=("w1", "w3", "w2"))
        self.conv = ShortConv(ops, d, cfg.conv_L_cache)
        attention = Attention(ops, d, nh, nkv, hd, qk_norm="head", eps=cfg.norm_eps)
        block = Block(ops, attention, self.mlp, cfg.norm_eps, mixers={"conv": self.conv})
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            norms = {"attn_norm": w.get(p + "operator_norm.weight", (d,)),
                     "mlp_norm": w.get(p + "ffn_norm.weight", (d,))}
            mlp = self.mlp.load(w, p + "feed_forward.")
            if kind == "conv":
                weights = norms | self.conv.load(w, p + "conv.", bias=cfg.conv_bias) | mlp
                self.layers.append(DecoderLayer(i, block, weights, kind="conv"))
                continue
            a = p + "self_attn."
            weights = {**norms, **load_qkv(w, a, nh, nkv, hd, d, bias=False),
                       "q_norm": w.get(a + "q_layernorm.weight", (hd,)),
                       "k_norm": w.get(a + "k_layernorm.weight", (hd,)),
                       "o_proj": w.get(a + "out_proj.weight", (d, nh * hd)), **mlp}
            self.layers.append(DecoderLayer(i, block, weights, scale=hd ** -0.5))
        self.norm = w.get("model.embedding_norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def layer_states(self) -> list[LayerState]:
        """Conv layers keep their window of inputs; attention layers their keys and values."""
        return [self.conv.state() if layer.kind == "conv" else FullAttention() for layer in self.layers]


def read_config(config: dict[str, Any]) -> Lfm2Config:
    """The config of a ``config.json`` dict, defaults as transformers' (rope theta 1e6)."""
    cfg = from_dict(Lfm2Config, {**config, "rope": rope_parameters(config, default_theta=1e6)})
    if "block_ffn_dim_multiplier" in config and config["block_ffn_dim_multiplier"] is None:
        # An explicit null (from_dict reads null as the default): no multiplier, and no rounding.
        cfg.block_ffn_dim_multiplier = None
        cfg.validate()
    return cfg


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Lfm2ForCausalLM:
    """Build an LFM2 model from a ``config.json`` dict."""
    return Lfm2ForCausalLM(read_config(config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register LFM2."""
    register(ArchitectureSpec(name="lfm2", model_types=("lfm2",), build=build,
                              description="Liquid AI LFM2 (short convolutions and attention; 350M-2.6B)"))
