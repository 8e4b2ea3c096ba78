"""Qwen3.5 text models: gated DeltaNet layers between gated full-attention ones.

``model_type`` ``qwen3_5_text`` as transformers' ``Qwen3_5ForCausalLM``
computes it, and the text half of a ``qwen3_5`` checkpoint
(``Qwen3_5ForConditionalGeneration``: ``text_config`` nested in config.json,
weights under ``model.language_model.``; :mod:`.qwen3_5_vision` registers
``qwen3_5`` and builds this with the vision tower and M-RoPE positions).
Qwen3-Next (:mod:`.qwen3_next`) has the same layers with a sparse MoE.
Against Qwen3 (:mod:`.qwen3`):

* ``layer_types`` mixes ``linear_attention`` and ``full_attention`` layers
  (without the list: every ``full_attention_interval``-th layer, default 4,
  is full attention, as transformers fills it in).
* A **linear-attention** layer is a gated DeltaNet (Yang et al. 2024, "Gated
  Delta Networks: Improving Mamba2 with Delta Rule"): ``in_proj_qkv`` gives q,
  k, v (``linear_num_key_heads`` heads of ``linear_key_head_dim`` for q and k,
  ``linear_num_value_heads`` of ``linear_value_head_dim`` for v), which run
  through a depthwise causal convolution of width ``linear_conv_kernel_dim``
  and ``hidden_act`` (silu); ``in_proj_b`` gives ``beta = sigmoid(b)``, ``in_proj_a`` the
  log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``; q and k are L2
  normalised and the gated delta rule (:meth:`~infer.ops.Backend.gated_delta_rule`)
  carries a ``[key_dim, value_dim]`` state per value head. Its output is
  RMS-normed per value head with a *plain* weight (``linear_attn.norm``,
  initialised to ones) and gated by ``silu(z)``, ``z = in_proj_z(x)``, then
  ``out_proj``. Per sequence the layer keeps the convolution's last
  ``K - 1`` inputs and the rule's state: ``Recurrent({"conv": (K - 1,
  conv_dim), "ssm": (Hv, Dk, Dv)})``.
* A **full-attention** layer is Qwen3's (per-head q/k RMSNorm, GQA) with an
  output gate: ``q_proj`` is twice as wide, each head's ``head_dim`` queries
  followed by as many gate logits, and ``o = o * sigmoid(gate)`` before
  ``o_proj`` (Qiu et al. 2025, "Gated Attention for Large Language Models").
  ``head_dim`` defaults to 256.
* Partial rope: ``partial_rotary_factor`` (default 0.25, transformers'
  default when config.json names none) of each head rotates. Qwen3.5's rope
  is multimodal (``mrope_section``), but text positions are the same on its
  three axes, which makes it plain rope.
* Every RMSNorm but the gated one scales by ``1 + w`` (zero-centred weights,
  loaded as ``1 + w``).

Per layer:
    h = h + linear_attn(x) or gated_attention(x)     x = input_layernorm(h)
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))  x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from infer.architecture import WeightLoader
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, FullAttention, LayerState, Recurrent
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Block, Decoder, DecoderLayer, MLPPart, Tables, Weights, activation
from .mlp import GatedMLP
from .moe import sigmoid
from .rope import RotaryEmbedding, context_length

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5Config:
    """``config.json`` fields read (transformers names and defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    model_type: str = "qwen3_5_text"
    num_key_value_heads: int = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    rope: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Ranges, head divisibility, the activation and ``layer_types`` (filled in as transformers does)."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "linear_conv_kernel_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "full_attention_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"config.json: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                              f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        activation("hidden_act", self.hidden_act)  # the MLPs' and the DeltaNet convolution's
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                else "linear_attention" for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)

    @property
    def key_dim(self) -> int:
        """Width of q (and of k) over all key heads."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of z) over all value heads."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet:
    """The linear-attention sublayer (module docstring), its weights in one dict:
    ``in_proj_qkvz`` (q, k, v then z rows), ``in_proj_ba`` (b then a rows),
    ``conv1d`` ``[conv_dim, K]``, ``dt_bias``, ``neg_A`` (``-exp(A_log)``),
    ``norm`` and ``out_proj``."""

    def __init__(self, ops: Backend, cfg: Qwen3_5Config) -> None:
        self.ops, self.cfg = ops, cfg

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """Qwen3.5's four input projections, stacked in twos where stored alike."""
        cfg, d = self.cfg, self.cfg.hidden_size
        nv = cfg.linear_num_value_heads
        out = self.load_common(w, prefix)
        for name, parts in (("in_proj_qkvz", (("in_proj_qkv", cfg.conv_dim), ("in_proj_z", cfg.value_dim))),
                            ("in_proj_ba", (("in_proj_b", nv), ("in_proj_a", nv)))):
            stacked = w.get_stacked(prefix + name + ".weight", [(f"{prefix}{p}.weight", (n, d)) for p, n in parts])
            if stacked is None:
                out.update((p, w.get(f"{prefix}{p}.weight", (n, d))) for p, n in parts)
            else:
                out[name] = stacked
        return out

    def load_common(self, w: WeightLoader, prefix: str) -> Weights:
        """The weights after the input projections."""
        ops, cfg = self.ops, self.cfg
        k, nv, dv = cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        a_log = w.get(prefix + "A_log", (nv,))
        return {"conv1d": w.get(prefix + "conv1d.weight", (cfg.conv_dim, 1, k),
                                transform=lambda a: a.reshape(cfg.conv_dim, k)),
                "dt_bias": w.get(prefix + "dt_bias", (nv,)),
                "neg_A": ops.mul(ops.exp(ops.astype(a_log, "float32")), -1.0),
                "norm": w.get(prefix + "norm.weight", (dv,)),
                "out_proj": w.get(prefix + "out_proj.weight", (cfg.hidden_size, cfg.value_dim))}

    def state(self) -> Recurrent:
        """What the layer keeps per sequence."""
        cfg = self.cfg
        return Recurrent({"conv": (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim),
                          "ssm": (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)})

    def __call__(self, x: Array, w: Weights, ctx: AttentionContext, layer: int) -> Array:
        """The sublayer's output ``[t, hidden]`` for the normed input ``x`` ``[t, hidden]``,
        reading and writing cache layer ``layer``'s recurrent state."""
        ops, cfg = self.ops, self.cfg
        t = ops.shape(x)[0]
        kd, cd, nv = cfg.key_dim, cfg.conv_dim, cfg.linear_num_value_heads
        if "in_proj_qkvz" in w:
            y = ops.linear(x, w["in_proj_qkvz"])
            qkv, z = ops.slice(y, 1, 0, cd), ops.slice(y, 1, cd, cd + cfg.value_dim)
        else:
            qkv, z = ops.linear(x, w["in_proj_qkv"]), ops.linear(x, w["in_proj_z"])
        if "in_proj_ba" in w:
            ba = ops.linear(x, w["in_proj_ba"])
            b, a = ops.slice(ba, 1, 0, nv), ops.slice(ba, 1, nv, 2 * nv)
        else:
            b, a = ops.linear(x, w["in_proj_b"]), ops.linear(x, w["in_proj_a"])
        state = ctx.state(layer)
        act = ACTIVATIONS[cfg.hidden_act]  # transformers runs the convolution with hidden_act
        qkv, conv, conv_ckpt = ops.causal_conv1d(qkv, ops.astype(state["conv"], ops.dtype(qkv)), w["conv1d"], None,
                                                 ctx.query_start, ctx.checkpoint_rows,
                                                 activation="silu" if act == "silu" else None)
        if act != "silu":
            qkv = getattr(ops, act)(qkv)
        q = ops.reshape(ops.slice(qkv, 1, 0, kd), (t, cfg.linear_num_key_heads, cfg.linear_key_head_dim))
        k = ops.reshape(ops.slice(qkv, 1, kd, 2 * kd), (t, cfg.linear_num_key_heads, cfg.linear_key_head_dim))
        v = ops.reshape(ops.slice(qkv, 1, 2 * kd, cd), (t, nv, cfg.linear_value_head_dim))
        beta = sigmoid(ops, ops.astype(b, "float32"))
        g = ops.mul(ops.softplus(ops.add(ops.astype(a, "float32"), ops.astype(w["dt_bias"], "float32"))), w["neg_A"])
        o, ssm, ssm_ckpt = ops.gated_delta_rule(q, k, v, g, beta, state["ssm"], ctx.query_start,
                                                ctx.checkpoint_rows)  # o: [t, nv, dv]
        ctx.set_state(layer, {"conv": ops.astype(conv, "float32"), "ssm": ssm},
                      {"conv": ops.astype(conv_ckpt, "float32"), "ssm": ssm_ckpt})
        # The gated RMSNorm: norm before gate, per value head (transformers' Qwen3_5RMSNormGated).
        z = ops.reshape(z, (t, nv, cfg.linear_value_head_dim))
        o = ops.mul(ops.rms_norm(o, w["norm"], cfg.rms_norm_eps), ops.silu(z))
        return ops.linear(ops.reshape(o, (t, cfg.value_dim)), w["out_proj"])


class GatedAttention:
    """Qwen3's attention with an output gate (module docstring)."""

    def __init__(self, ops: Backend, cfg: Qwen3_5Config) -> None:
        self.ops, self.cfg = ops, cfg
        #: False: Qwen3's ungated output (the gate logits unused), for comparisons.
        self.gated = True

    def load(self, w: WeightLoader, prefix: str, norm: Any) -> Weights:
        """``q_proj`` (twice as wide: queries and gates), ``k_proj``, ``v_proj``,
        ``o_proj`` (biases with ``attention_bias``) and the q/k norms (``norm``
        reads a ``1 + w`` weight)."""
        cfg, d = self.cfg, self.cfg.hidden_size
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out: Weights = {}
        for name, rows in (("q_proj", 2 * nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", d)):
            out[name] = w.get(f"{prefix}{name}.weight", (rows, nh * hd if name == "o_proj" else d))
            if cfg.attention_bias:
                out[name + ".bias"] = w.get(f"{prefix}{name}.bias", (rows,))
        out["q_norm"], out["k_norm"] = norm(prefix + "q_norm", hd), norm(prefix + "k_norm", hd)
        return out

    def __call__(self, x: Array, w: Weights, ctx: AttentionContext, layer: int, cos: Array, sin: Array) -> Array:
        """The sublayer's output ``[t, hidden]``; ``cos``, ``sin``: the rotary tables ``[t, rot / 2]``."""
        ops, cfg = self.ops, self.cfg
        t, nh, nkv, hd = ops.shape(x)[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = ops.reshape(ops.linear(x, w["q_proj"], w.get("q_proj.bias")), (t, nh, 2 * hd))
        q, gate = ops.slice(qg, 2, 0, hd), ops.slice(qg, 2, hd, 2 * hd)  # per head: queries, then gate logits
        k = ops.reshape(ops.linear(x, w["k_proj"], w.get("k_proj.bias")), (t, nkv, hd))
        v = ops.reshape(ops.linear(x, w["v_proj"], w.get("v_proj.bias")), (t, nkv, hd))
        q = ops.rope(ops.rms_norm(q, w["q_norm"], cfg.rms_norm_eps), cos, sin)
        k = ops.rope(ops.rms_norm(k, w["k_norm"], cfg.rms_norm_eps), cos, sin)
        o = ctx.attention(layer, q, k, v, scale=hd ** -0.5)  # [t, nh, hd]
        if self.gated:
            o = ops.mul(o, sigmoid(ops, gate))
        return ops.linear(ops.reshape(o, (t, nh * hd)), w["o_proj"], w.get("o_proj.bias"))


class GatedBlock(Block):
    """The decoder's block with Qwen3.5's mixers: the gated DeltaNet in
    ``linear_attention`` layers, gated attention in the others."""

    def __init__(self, ops: Backend, cfg: Qwen3_5Config, deltanet: GatedDeltaNet, attention: GatedAttention,
                 mlp: MLPPart) -> None:
        super().__init__(ops, None, mlp, cfg.rms_norm_eps, mixers={"linear_attention": deltanet})
        self.gated_attention = attention

    def attend(self, x: Array, layer: DecoderLayer, ctx: AttentionContext, tables: Tables) -> Array:
        return self.gated_attention(x, layer.weights, ctx, layer.index, *tables[layer.rope])


class Qwen3_5ForCausalLM(Decoder):
    """Embedding, DeltaNet and gated-attention layers, final norm, output head."""

    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(self, config: Qwen3_5Config, weights: WeightLoader, ops: Backend, *, prefix: str = "model.") -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        self.num_layers, self.vocab_size, self.eps = cfg.num_hidden_layers, cfg.vocab_size, cfg.rms_norm_eps
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)

        def norm(name: str, dim: int = d) -> Array:  # zero-centred: the model scales by 1 + w
            return w.get(name + ".weight", (dim,), transform=lambda a: a + 1.0)

        self.deltanet, self.attention = GatedDeltaNet(ops, cfg), GatedAttention(ops, cfg)
        blocks: dict[int, GatedBlock] = {}  # one block per distinct MLP part
        self.embed_tokens = w.get(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
        self.rope = {"default": RotaryEmbedding(ops, cfg.head_dim, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"{prefix}layers.{i}."
            mixer = (self.load_deltanet(w, p + "linear_attn.") if kind == "linear_attention"
                     else self.attention.load(w, p + "self_attn.", norm))
            mlp = self.mlp_part(i)
            block = blocks.setdefault(id(mlp), GatedBlock(ops, cfg, self.deltanet, self.attention, mlp))
            weights = {**mixer, "attn_norm": norm(p + "input_layernorm"),
                       "mlp_norm": norm(p + "post_attention_layernorm"), **mlp.load(w, p + "mlp.")}
            self.layers.append(DecoderLayer(i, block, weights, kind=kind))
        self.norm = norm(prefix + "norm")
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def load_deltanet(self, w: WeightLoader, prefix: str) -> Weights:
        """A DeltaNet's weights under ``prefix`` (``...linear_attn.``)."""
        return self.deltanet.load(w, prefix)

    def mlp_part(self, layer: int) -> MLPPart:
        """The MLP of ``layer``: the gated MLP of ``intermediate_size`` in Qwen3.5."""
        return self.dense_mlp

    @cached_property
    def dense_mlp(self) -> GatedMLP:
        """The gated MLP of ``intermediate_size``."""
        cfg = self.config
        return GatedMLP(self.ops, cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act])

    def layer_states(self) -> list[LayerState]:
        """DeltaNet layers keep a convolution window and the rule's state; the others keys and values."""
        return [self.deltanet.state() if layer.kind == "linear_attention" else FullAttention()
                for layer in self.layers]


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The text model's config and the prefix of its weights: a
    ``Qwen3_5ForConditionalGeneration`` config.json nests the text model's
    under ``text_config`` (weights under ``model.language_model.``) and keeps
    ``tie_word_embeddings`` at the top, where transformers reads it."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config, "model."
    text = dict(nested)
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
    return text, "model.language_model."


def model_config(cls: type, config: dict[str, Any]) -> Any:
    """``cls`` read from a (text) config dict, rope settings included, with
    transformers' default ``partial_rotary_factor`` of 0.25."""
    rope = rope_parameters(config)
    rope.setdefault("partial_rotary_factor", 0.25)
    return from_dict(cls, {**config, "rope": rope})


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3_5ForCausalLM:
    """Build a Qwen3.5 text model from a ``config.json`` dict (text-only or nested;
    :mod:`.qwen3_5_vision` builds a nested one with its vision tower)."""
    text, prefix = text_config(config)
    if prefix != "model." and not weights.has(prefix + "embed_tokens.weight") and weights.has(
            "model.embed_tokens.weight"):
        prefix = "model."
    return Qwen3_5ForCausalLM(model_config(Qwen3_5Config, text), weights, ops, prefix=prefix)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Qwen3.5 (text; ``qwen3_5`` checkpoints are :mod:`.qwen3_5_vision`'s)."""
    register(ArchitectureSpec(name="qwen3_5", model_types=("qwen3_5_text",), build=build,
                              description="Qwen3.5 (gated DeltaNet + gated attention)"))
