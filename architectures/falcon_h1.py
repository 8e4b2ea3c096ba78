"""Falcon-H1 (TII, "Falcon-H1: A Family of Hybrid-Head Language Models", 2025).

``model_type`` ``falcon_h1`` as transformers' ``FalconH1ForCausalLM`` computes
it. Against Llama (:mod:`.llama`):

* Every layer is **hybrid**: a Mamba2 mixer (Dao & Gu 2024, "Transformers are
  SSMs", section 7) and grouped-query attention read the same normed input
  *in parallel*, and their outputs are summed into the residual stream
  (the report's "parallel hybrid" design):

      x = input_layernorm(h)
      h = h + ssm_out_multiplier * mamba(x) + attention_out_multiplier * attention(attention_in_multiplier * x)
      h = h + feed_forward(pre_ff_layernorm(h))

* The mixer is :class:`~.mamba2.Mamba2Mixer` with two scalings of its
  projection: ``in_proj`` (bias when ``mamba_proj_bias``) gives ``z`` (the
  gate, ``mamba_d_ssm`` wide, default ``mamba_expand * hidden``), ``xBC`` and
  ``dt`` (one per head), each section scaled by its ``ssm_multipliers`` entry
  (the muP vector; the input first by ``ssm_in_multiplier``); a depthwise
  causal convolution of ``mamba_d_conv`` taps with ``hidden_act`` (silu) over
  ``xBC`` (``mamba_conv_bias``); the selective scan ``ops.ssd`` over ``x``
  with ``A = -exp(A_log)``, ``D``, ``dt_bias`` and ``time_step_limit``; then
  either ``y * silu(z)`` or, with ``mamba_rms_norm``, a gated RMSNorm over
  ``mamba_n_groups`` groups (``mamba_norm_before_gate``: norm, then gate;
  else gate, then norm); ``out_proj`` (bias when ``projectors_bias``).
  ``mamba_chunk_size`` only tiles transformers' scan, which equals the
  recurrence in exact arithmetic, so it is read and not needed.
* Attention keys are multiplied by ``key_multiplier`` (folded into the
  softmax scale: rope and the dot product are linear in ``k``).
* The MLP multiplies the gate projection by ``mlp_multipliers[0]`` before
  the activation and the output by ``mlp_multipliers[1]``; embeddings by
  ``embedding_multiplier``, logits by ``lm_head_multiplier``.
* A layer keeps keys and values *and* a recurrent state, so each has two
  cache layers: ``i`` for attention and ``num_hidden_layers + i`` for the
  mixer's ``{"conv": (d_conv - 1, conv_dim), "ssm": (heads, head_dim, d_state)}``.

transformers' single-token decode path skips the ``time_step_limit`` clamp
(its prefill path clamps); with the default limits ``(0, inf)`` the two agree,
and here every row is clamped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, FullAttention, LayerState
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Attention, Block, Decoder, DecoderLayer, Tables, Weights, activation
from .mamba2 import Mamba2Mixer, time_step_limit
from .mlp import GatedMLP
from .rope import RotaryEmbedding, context_length


@dataclass
class FalconH1Config:
    """``config.json`` fields read (transformers' ``FalconH1Config`` names and defaults)."""

    vocab_size: int = 128000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None  # not a field of FalconH1Config; read when config.json has it (the released ones do)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False
    mamba_d_ssm: int | None = 1024
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    # transformers 5 writes float("inf") as {"__float__": "Infinity"} (JSON has no infinity).
    time_step_limit: list[Any] = field(default_factory=lambda: [0.0, float("inf")])
    projectors_bias: bool = False
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: list[float] = field(default_factory=lambda: [1.0, 1.0])
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: list[float] = field(default_factory=lambda: [1.0] * 5)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    rope: dict[str, Any] = field(default_factory=dict)
    #: Keys config.json sets to null where null means more than the default (:func:`read_config`).
    explicit_nulls: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.num_key_value_heads is None or "num_key_value_heads" in self.explicit_nulls:
            self.num_key_value_heads = self.num_attention_heads
        if "mamba_d_ssm" in self.explicit_nulls:
            self.mamba_d_ssm = None
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "mamba_n_heads", "mamba_n_groups",
                     "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        activation("hidden_act", self.hidden_act)  # the MLP's and the mixer's convolution's
        if self.mamba_d_ssm is None:
            self.mamba_d_ssm = self.mamba_expand * self.hidden_size
        inner, heads = self.mamba_d_ssm, self.mamba_n_heads
        if self.mamba_d_head == "auto":
            self.mamba_d_head = inner // heads
        if not isinstance(self.mamba_d_head, int) or self.mamba_d_head * heads != inner:
            raise ConfigError(f"config.json: mamba_d_head ({self.mamba_d_head!r}) times mamba_n_heads ({heads}) "
                              f"must equal the mixer width mamba_d_ssm ({inner})")
        if heads % self.mamba_n_groups or inner % self.mamba_n_groups:
            raise ConfigError(f"config.json: mamba_n_groups ({self.mamba_n_groups}) must divide mamba_n_heads "
                              f"({heads}) and mamba_d_ssm ({inner})")
        for name, n in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"config.json: {name} must hold {n} numbers, found {getattr(self, name)}")
        self.time_step_limit = time_step_limit(self.time_step_limit)


class FalconH1Mixer(Mamba2Mixer):
    """:class:`~.mamba2.Mamba2Mixer` with Falcon-H1's two scalings of its
    projection: the input by ``ssm_in_multiplier``, ``in_proj``'s output by the
    muP vector (one ``ssm_multipliers`` entry per section: z, x, B, C, dt).
    Without ``mamba_rms_norm`` the gated norm is ``y * silu(z)`` alone."""

    def __init__(self, ops: Backend, cfg: FalconH1Config) -> None:
        assert cfg.mamba_d_ssm is not None and isinstance(cfg.mamba_d_head, int)  # set by validate()
        super().__init__(ops, cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state,
                         cfg.mamba_n_groups, cfg.mamba_d_conv, eps=cfg.rms_norm_eps, act=cfg.hidden_act,
                         time_step_limit=tuple(cfg.time_step_limit),  # type: ignore[arg-type]
                         norm_before_gate=cfg.mamba_norm_before_gate if cfg.mamba_rms_norm else None)
        self.in_multiplier = cfg.ssm_in_multiplier
        gn = self.groups * self.state_size
        sizes = (self.inner, self.inner, gn, gn, self.heads)
        m = cfg.ssm_multipliers
        self.mup = None if all(v == 1.0 for v in m) else ops.from_numpy(
            host_array([float(v) for v, n in zip(m, sizes) for _ in range(n)]))  # [I + conv_dim + H]

    def project(self, x: Array, w: Weights) -> Array:
        ops = self.ops
        if self.in_multiplier != 1.0:
            x = ops.mul(x, self.in_multiplier)
        proj = super().project(x, w)
        return proj if self.mup is None else ops.mul(proj, self.mup)


class FalconH1Block(Block):
    """The decoder's block whose first sublayer is Falcon-H1's parallel hybrid:
    the Mamba2 mixer (its state in cache layer ``state_offset + i``) and attention
    read the same normed input, each scaled by its multipliers, and are summed."""

    def __init__(self, ops: Backend, cfg: FalconH1Config, attention: Attention, mixer: FalconH1Mixer,
                 mlp: GatedMLP) -> None:
        super().__init__(ops, attention, mlp, cfg.rms_norm_eps)
        self.mixer, self.state_offset = mixer, cfg.num_hidden_layers
        self.in_multiplier, self.attention_out = cfg.attention_in_multiplier, cfg.attention_out_multiplier
        self.ssm_out = cfg.ssm_out_multiplier

    def mix(self, x: Array, layer: DecoderLayer, ctx: AttentionContext, tables: Tables) -> Array:
        ops = self.ops
        m = self.mixer(x, layer.weights, ctx, self.state_offset + layer.index)
        a = self.attend(x if self.in_multiplier == 1.0 else ops.mul(x, self.in_multiplier), layer, ctx, tables)
        if self.ssm_out != 1.0:
            m = ops.mul(m, self.ssm_out)
        if self.attention_out != 1.0:
            a = ops.mul(a, self.attention_out)
        return ops.add(m, a)


class FalconH1ForCausalLM(Decoder):
    """Scaled embedding, parallel hybrid layers, final norm, scaled output head."""

    def __init__(self, config: FalconH1Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        assert hd is not None and nkv is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        attention = Attention(ops, d, nh, nkv, hd)
        self.mixer = FalconH1Mixer(ops, cfg)
        gate_m, down_m = cfg.mlp_multipliers
        mlp = GatedMLP(ops, d, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act], gate_multiplier=gate_m,
                       down_multiplier=down_m)
        block = FalconH1Block(ops, cfg, attention, self.mixer, mlp)
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        if cfg.embedding_multiplier != 1.0:
            self.embed_scale = ops.from_numpy(host_array([cfg.embedding_multiplier]))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)}
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            weights = {**attention.load(w, p + "self_attn.", bias=cfg.attention_bias),
                       "attn_norm": w.get(p + "input_layernorm.weight", (d,)),
                       "mlp_norm": w.get(p + "pre_ff_layernorm.weight", (d,)),
                       **self.mixer.load(w, p + "mamba."), **mlp.load(w, p + "feed_forward.")}
            # q . (m k) / sqrt(hd): key_multiplier folded into the softmax scale.
            self.layers.append(DecoderLayer(i, block, weights, scale=hd ** -0.5 * cfg.key_multiplier))
        self.norm = w.get("model.final_layernorm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    @property
    def num_cache_layers(self) -> int:
        """Two per layer: its keys and values (``i``), its mixer's state (``num_layers + i``)."""
        return 2 * self.num_layers

    def layer_states(self) -> list[LayerState]:
        return [FullAttention()] * self.num_layers + [self.mixer.state()] * self.num_layers

    def compute_logits(self, hidden: Array) -> Array:
        logits = super().compute_logits(hidden)  # [rows, vocab]
        m = self.config.lm_head_multiplier
        return logits if m == 1.0 else self.ops.mul(logits, m)


def read_config(config: dict[str, Any]) -> FalconH1Config:
    """The config of a ``config.json`` dict, read as transformers reads it: an
    explicit null ``num_key_value_heads`` means one per head, a null
    ``mamba_d_ssm`` ``mamba_expand * hidden_size`` (``from_dict`` alone would
    take the defaults, 8 and 1024)."""
    data = {**config, "rope": rope_parameters(config)}
    nulls = [k for k in ("num_key_value_heads", "mamba_d_ssm") if k in config and config[k] is None]
    return from_dict(FalconH1Config, {**data, "explicit_nulls": nulls})


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> FalconH1ForCausalLM:
    """Build a Falcon-H1 model from a ``config.json`` dict."""
    return FalconH1ForCausalLM(read_config(config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Falcon-H1."""
    register(ArchitectureSpec(name="falcon_h1", model_types=("falcon_h1",), build=build, read_config=read_config,
                              description="TII Falcon-H1 (parallel Mamba2 and attention heads; 0.5B-34B)"))
