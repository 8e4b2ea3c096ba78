"""IBM Granite 4.0-H (IBM, "Granite 4.0", 2025): Mamba2 and attention layers mixed.

``model_type`` ``granitemoehybrid`` as transformers'
``GraniteMoeHybridForCausalLM`` computes it. Each layer is a pre-norm block
whose first sublayer is either a Mamba2 mixer (:class:`~.mamba2.Mamba2Mixer`,
``layer_types`` entry ``mamba`` / ``linear_attention``) or grouped-query
attention (``attention`` / ``full_attention``), and whose second is always the
same MLP:

    h = h + m * mixer_or_attention(input_layernorm(h))
    h = h + m * (shared_mlp(x) + moe(x))              x = post_attention_layernorm(h)

* ``shared_mlp``: a gated MLP of ``shared_intermediate_size``, stored stacked
  (``input_linear``: gate rows, then up rows; ``output_linear``);
* ``moe`` (only when ``num_local_experts`` > 0): ``num_local_experts`` gated
  MLPs of ``intermediate_size``, each token to the ``num_experts_per_tok``
  best by the router's logits, weighted by the softmax of those logits
  (:class:`~.moe.SparseMoE`'s rule with renormalised top-k); stored as
  ``[experts, ...]`` stacks (``input_linear``, ``output_linear``,
  ``router.layer``, or transformers' in-memory names);
* Granite's multipliers (:mod:`.granite`): ``embedding_multiplier``,
  ``residual_multiplier`` ``m`` on both sublayers, ``attention_multiplier`` as
  the softmax scale, logits divided by ``logits_scaling``;
* rope in the attention layers only with ``position_embedding_type`` ``rope``
  (Granite 4.0-H itself uses none: the Mamba2 layers carry the order).

The Mamba2 layers read ``mamba_*`` fields (``mamba_d_head`` ``auto``:
``mamba_expand * hidden_size / mamba_n_heads``) and ``rms_norm_eps`` for the
gated norm; they carry Recurrent state, the attention layers keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.config import check_layer_types, from_dict, rope_parameters
from infer.errors import ConfigError
from infer.kv.attention import FullAttention, LayerState
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, Attention, Block, Decoder, DecoderLayer, Weights
from .llama import LlamaConfig
from .mamba2 import Mamba2Mixer, time_step_limit
from .mlp import GatedMLP
from .moe import SparseMoE
from .rope import RotaryEmbedding, context_length

#: ``layer_types`` names (transformers 5's and the released configs' older ones) -> the layer's kind.
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


@dataclass
class GraniteMoeHybridConfig(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "granitemoehybrid"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_bias: bool = False
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    layers_block_type: list[str] | None = None  # the older name of layer_types
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: Any = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list[Any] = field(default_factory=lambda: [0.0, float("inf")])

    def validate(self) -> None:
        if self.layer_types is None:
            self.layer_types = self.layers_block_type or ["mamba"] * self.num_hidden_layers
        super().validate()
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_KINDS)
        if self.position_embedding_type not in (None, "rope", "nope"):
            raise ConfigError(f"config.json: position_embedding_type {self.position_embedding_type!r} is not "
                              "supported; supported: 'rope', 'nope' or null")
        if self.num_local_experts < 0 or (self.num_local_experts and not
                                          0 < self.num_experts_per_tok <= self.num_local_experts):
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                              f"and num_local_experts ({self.num_local_experts})")
        inner = self.mamba_expand * self.hidden_size
        if self.mamba_d_head == "auto":
            self.mamba_d_head = inner // self.mamba_n_heads if self.mamba_n_heads > 0 else 0
        if not isinstance(self.mamba_d_head, int) or self.mamba_d_head * self.mamba_n_heads != inner:
            raise ConfigError(f"config.json: mamba_n_heads ({self.mamba_n_heads}) * mamba_d_head "
                              f"({self.mamba_d_head}) must equal mamba_expand * hidden_size ({inner})")
        self.time_step_limit = time_step_limit(self.time_step_limit)

    def kind(self, layer: int) -> str:
        """``"mamba"`` or ``"attention"``."""
        assert self.layer_types is not None  # set by validate()
        return LAYER_KINDS[self.layer_types[layer]]


class GraniteMoE(SparseMoE):
    """The routed experts, read from ``[experts, ...]`` stacks: each expert's
    ``gate_up_proj`` (gate rows first) and ``down_proj`` sliced out at load."""

    def load(self, w: WeightLoader, prefix: str) -> dict[str, Any]:
        e, d, n = self.num_experts, self.hidden, self.expert.intermediate
        router = w.get(prefix + "router.layer.weight", (e, d), fallback=prefix + "router.weight")
        up, down = prefix + "input_linear.weight", prefix + "output_linear.weight"
        if not w.has(up):  # transformers' in-memory names
            up, down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
        experts = [{"gate_up_proj": w.get(up, (e, 2 * n, d), transform=lambda a, i=i: a[i]),
                    "down_proj": w.get(down, (e, d, n), transform=lambda a, i=i: a[i])} for i in range(e)]
        return {"gate": router, "experts": experts}


class HybridMLP:
    """The shared MLP plus, when there are experts, the routed ones."""

    def __init__(self, ops: Backend, cfg: GraniteMoeHybridConfig) -> None:
        act = ACTIVATIONS[cfg.hidden_act]
        self.ops = ops
        self.shared = GatedMLP(ops, cfg.hidden_size, cfg.shared_intermediate_size, act)
        self.moe = (GraniteMoE(ops, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                               cfg.num_experts_per_tok, norm_topk_prob=True, activation=act)
                    if cfg.num_local_experts > 0 else None)

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """Under ``prefix`` (``model.layers.N.``): ``shared_mlp.*`` and ``block_sparse_moe.*``."""
        d, s = self.shared.hidden, self.shared.intermediate
        out: Weights = {"shared": {"gate_up_proj": w.get(prefix + "shared_mlp.input_linear.weight", (2 * s, d)),
                                   "down_proj": w.get(prefix + "shared_mlp.output_linear.weight", (d, s))}}
        if self.moe is not None:
            out["moe"] = self.moe.load(w, prefix + "block_sparse_moe.")
        return out

    def __call__(self, x: Array, w: Weights) -> Array:
        y = self.shared(x, w["shared"])
        if self.moe is None:
            return y
        return self.ops.add(self.moe(x, w["moe"]), y)


class GraniteMoeHybridForCausalLM(Decoder):
    """Embedding, Mamba2 and attention layers (module docstring), final norm, scaled head."""

    def __init__(self, config: GraniteMoeHybridConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d, hd = config, weights, config.hidden_size, config.head_dim
        assert hd is not None  # set by validate()
        self.num_layers, self.vocab_size = cfg.num_hidden_layers, cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        rotary = cfg.position_embedding_type == "rope"
        self.max_context = context_length(cfg.rope, cfg.max_position_embeddings) if rotary \
            else cfg.max_position_embeddings
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, d))
        self.embed_scale = ops.from_numpy(host_array([cfg.embedding_multiplier]))
        self.rope = {"default": RotaryEmbedding(ops, hd, cfg.rope, cfg.max_position_embeddings)} if rotary else {}
        self.mixer = Mamba2Mixer(ops, d, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups,
                                 cfg.mamba_d_conv, eps=cfg.rms_norm_eps, act=cfg.hidden_act,
                                 time_step_limit=tuple(cfg.time_step_limit))
        self.mlp = HybridMLP(ops, cfg)
        attention = Attention(ops, d, cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        block = Block(ops, attention, self.mlp, cfg.rms_norm_eps, mixers={"mamba": self.mixer},
                      residual_scale=cfg.residual_multiplier)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p, kind = f"model.layers.{i}.", cfg.kind(i)
            weights = {"attn_norm": w.get(p + "input_layernorm.weight", (d,)),
                       "mlp_norm": w.get(p + "post_attention_layernorm.weight", (d,)), **self.mlp.load(w, p)}
            if kind == "mamba":
                self.layers.append(DecoderLayer(i, block, weights | self.mixer.load(w, p + "mamba."), kind="mamba"))
            else:
                weights |= attention.load(w, p + "self_attn.", bias=cfg.attention_bias)
                self.layers.append(DecoderLayer(i, block, weights, scale=cfg.attention_multiplier,
                                                rope="default" if rotary else None))
        self.norm = w.get("model.norm.weight", (d,))
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else w.get("lm_head.weight", (cfg.vocab_size, d))

    def layer_states(self) -> list[LayerState]:
        return [self.mixer.state() if layer.kind == "mamba" else FullAttention() for layer in self.layers]

    def compute_logits(self, hidden: Array) -> Array:
        return self.ops.div(super().compute_logits(hidden), self.config.logits_scaling)  # [rows, vocab]


def read_config(config: dict[str, Any]) -> GraniteMoeHybridConfig:
    """The config of a ``config.json`` dict (rope settings in ``rope``)."""
    return from_dict(GraniteMoeHybridConfig, {**config, "rope": rope_parameters(config)})


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> GraniteMoeHybridForCausalLM:
    """Build a Granite 4.0-H model from a ``config.json`` dict."""
    return GraniteMoeHybridForCausalLM(read_config(config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Granite 4.0-H."""
    register(ArchitectureSpec(name="granitemoehybrid", model_types=("granitemoehybrid",), build=build,
                              read_config=read_config,
                              description="IBM Granite 4.0-H (Mamba2 and attention layers, optional MoE, "
                                          "Granite's multipliers)"))
