"""Qwen3-Next (Qwen Team, 2025): Qwen3.5's hybrid layers with a sparse MoE.

``model_type`` ``qwen3_next`` as transformers' ``Qwen3NextForCausalLM``
computes it (Qwen3-Next-80B-A3B); also Qwen3.5-MoE (``qwen3_5_moe_text``, and
the language model of a nested ``qwen3_5_moe`` checkpoint, which
:mod:`.qwen3_5_vision` registers): Qwen3.5's projections
with this MoE in every layer, always renormalised. The gated DeltaNet and gated-attention
layers, the ``1 + w`` norms and the partial rope are Qwen3.5's
(:mod:`.qwen3_5`); against it:

* The DeltaNet's input projections are two fused matrices grouped by key
  head: ``in_proj_qkvz`` holds, for each of the ``linear_num_key_heads``
  groups, its q, k, then the v and z of the value heads it serves;
  ``in_proj_ba`` per group its b then a (transformers'
  ``fix_query_key_value_ordering``). Their rows are reordered on load into
  Qwen3.5's layout (all q, all k, all v, then z; all b, then a), so both
  compute the same.
* The MLP of layer ``i`` is a sparse MoE when ``num_experts > 0``, ``i`` is
  not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``,
  else a dense MLP of ``intermediate_size``. The MoE: a float32 softmax
  router over ``num_experts`` gated MLPs of ``moe_intermediate_size``, the
  ``num_experts_per_tok`` best, renormalised when ``norm_topk_prob``
  (:class:`~.moe.SparseMoE`), plus a shared expert of
  ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` (as Qwen2-MoE).

Per layer:
    h = h + linear_attn(x) or gated_attention(x)                              x = input_layernorm(h)
    h = h + moe(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x), or mlp(x)   x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from infer.architecture import WeightLoader
from infer.errors import ConfigError
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, MLPPart, Weights
from .mlp import GatedMLP
from .moe import SparseMoE, sigmoid
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, model_config, text_config


@dataclass
class Qwen3NextConfig(Qwen3_5Config):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "qwen3_next"
    num_key_value_heads: int = 2
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Qwen3.5's checks and the MoE's."""
        super().validate()
        if self.decoder_sparse_step <= 0:
            raise ConfigError(f"config.json: decoder_sparse_step must be positive, found {self.decoder_sparse_step}")
        if self.num_experts < 0:
            raise ConfigError(f"config.json: num_experts must not be negative, found {self.num_experts}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                              f"and num_experts ({self.num_experts})")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if self.num_experts and getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the sparse MoE (transformers' ``Qwen3NextDecoderLayer`` rule)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class SharedExpertMoE:
    """Routed experts (:class:`~.moe.SparseMoE`) plus one shared expert whose
    output is scaled per token by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, ops: Backend, routed: SparseMoE, shared: GatedMLP) -> None:
        self.ops, self.routed, self.shared = ops, routed, shared

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """The router and experts, ``shared_expert.*`` and ``shared_expert_gate`` under ``prefix`` (``...mlp.``)."""
        return {"routed": self.routed.load(w, prefix), "shared_expert": self.shared.load(w, prefix + "shared_expert."),
                "shared_expert_gate": w.get(prefix + "shared_expert_gate.weight", (1, self.shared.hidden))}

    def __call__(self, x: Array, w: Weights) -> Array:
        """``[tokens, hidden]`` from the normed input."""
        ops = self.ops
        gate = sigmoid(ops, ops.linear(x, w["shared_expert_gate"]))  # [tokens, 1]
        return ops.add(self.routed(x, w["routed"]), ops.mul(self.shared(x, w["shared_expert"]), gate))


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's layers with fused DeltaNet projections and sparse MoE MLPs."""

    def load_deltanet(self, w: WeightLoader, prefix: str) -> Weights:
        """The fused projections, their rows reordered into Qwen3.5's layout (module docstring)."""
        cfg, d = self.config, self.config.hidden_size
        nk, hk, hv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        r = cfg.linear_num_value_heads // nk  # value heads per key head
        group = 2 * hk + 2 * r * hv  # rows of one key head's group in in_proj_qkvz
        spans = ((0, hk), (hk, 2 * hk), (2 * hk, 2 * hk + r * hv), (2 * hk + r * hv, group))  # q, k, v, z
        qkvz = [j * group + i for lo, hi in spans for j in range(nk) for i in range(lo, hi)]
        ba = [j * 2 * r + i for lo, hi in ((0, r), (r, 2 * r)) for j in range(nk) for i in range(lo, hi)]
        out = self.deltanet.load_common(w, prefix)
        out["in_proj_qkvz"] = w.get(prefix + "in_proj_qkvz.weight", (len(qkvz), d), transform=lambda a: a[qkvz])
        out["in_proj_ba"] = w.get(prefix + "in_proj_ba.weight", (len(ba), d), transform=lambda a: a[ba])
        return out

    def mlp_part(self, layer: int) -> MLPPart:
        """The MoE where :meth:`Qwen3NextConfig.is_moe`, else the dense MLP."""
        return self.moe if self.config.is_moe(layer) else self.dense_mlp

    @cached_property
    def moe(self) -> SharedExpertMoE:
        """The sparse MoE with its gated shared expert (one part for every MoE layer)."""
        cfg, act = self.config, ACTIVATIONS[self.config.hidden_act]
        routed = SparseMoE(self.ops, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                           cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob, activation=act)
        shared = GatedMLP(self.ops, cfg.hidden_size, cfg.shared_expert_intermediate_size, act)
        return SharedExpertMoE(self.ops, routed, shared)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE (``qwen3_5_moe_text``): Qwen3.5's four DeltaNet input
    projections, and in every layer Qwen3-Next's MoE with the top-k weights
    always renormalised (transformers' ``Qwen3_5MoeTopKRouter``)."""

    load_deltanet = Qwen3_5ForCausalLM.load_deltanet


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3NextForCausalLM:
    """Build a Qwen3-Next model from a ``config.json`` dict."""
    return Qwen3NextForCausalLM(model_config(Qwen3NextConfig, config), weights, ops)


def qwen3_5_moe_config(config: dict[str, Any], weights: WeightLoader) -> tuple[Qwen3NextConfig, str]:
    """A Qwen3.5-MoE ``config.json`` dict (text-only or nested) read as Qwen3-Next's
    settings, and the prefix of the language model's weights."""
    text, prefix = text_config(config)
    if prefix != "model." and not weights.has(prefix + "embed_tokens.weight"):
        prefix = "model."
    # Every layer sparse, always renormalised; the config has no dense MLP width (never used).
    fixed = {"intermediate_size": text.get("intermediate_size") or 1, "num_experts": text.get("num_experts", 256),
             "num_experts_per_tok": text.get("num_experts_per_tok", 8), "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "num_key_value_heads": text.get("num_key_value_heads", 2)}
    cfg = model_config(Qwen3NextConfig, {**text, **fixed})
    if not cfg.num_experts:
        raise ConfigError("config.json: num_experts must be positive for qwen3_5_moe, found 0")
    return cfg, prefix


def build_qwen3_5_moe(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3_5MoeForCausalLM:
    """Build a Qwen3.5-MoE text model from a ``config.json`` dict (text-only or nested;
    :mod:`.qwen3_5_vision` builds a nested one with its vision tower)."""
    cfg, prefix = qwen3_5_moe_config(config, weights)
    return Qwen3_5MoeForCausalLM(cfg, weights, ops, prefix=prefix)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Qwen3-Next."""
    register(ArchitectureSpec(name="qwen3_next", model_types=("qwen3_next",), build=build,
                              description="Qwen3-Next (gated DeltaNet + gated attention, sparse MoE)"))
    register(ArchitectureSpec(name="qwen3_5_moe", model_types=("qwen3_5_moe_text",),
                              build=build_qwen3_5_moe,
                              description="Qwen3.5-MoE (Qwen3.5's layers, a sparse MoE in every layer)"))
