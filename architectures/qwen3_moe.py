"""Qwen3 mixture-of-experts models (Qwen Team, "Qwen3 Technical Report", 2025).

``model_type`` ``qwen3_moe`` as transformers' ``Qwen3MoeForCausalLM`` computes
it (Qwen3-30B-A3B, 235B-A22B). Against Qwen3 (:mod:`.qwen3`), whose attention
it keeps (per-head q/k norms):

* The MLP of layer ``i`` is a sparse mixture of ``num_experts`` gated MLPs of
  width ``moe_intermediate_size`` when ``num_experts > 0``, ``i`` is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; otherwise a
  dense MLP of ``intermediate_size``.
* Routing (:class:`~.moe.SparseMoE`): float32 softmax over all experts, the
  ``num_experts_per_tok`` best, their probabilities renormalised to sum 1 only
  when ``norm_topk_prob`` (true in the released models). No shared experts
  (report section 2), unlike Qwen2-MoE.
* transformers 5 writes ``num_experts`` as ``num_local_experts``; both are read.

Per layer:
    h = h + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))     x = input_layernorm(h)
    h = h + moe(x) or mlp(x)                                         x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, MLPPart
from .moe import SparseMoE
from .qwen3 import Qwen3Config, Qwen3ForCausalLM


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "qwen3_moe"
    num_experts: int | None = None
    num_local_experts: int = 128  # transformers 5's name for num_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        if self.num_experts is None:
            self.num_experts = self.num_local_experts
        if self.decoder_sparse_step <= 0:
            raise ConfigError(f"config.json: decoder_sparse_step must be positive, found {self.decoder_sparse_step}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                              f"and num_experts ({self.num_experts})")

    def is_moe(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and bool(self.num_experts)
                and (layer + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse mixtures of experts in the layers the config names."""

    def mlp_part(self, layer: int) -> tuple[MLPPart, str]:
        return (self.moe if self.config.is_moe(layer) else self.dense_mlp), "mlp."

    @cached_property
    def moe(self) -> SparseMoE:
        cfg = self.config
        return SparseMoE(self.ops, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                         activation=ACTIVATIONS[cfg.hidden_act])


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3MoeForCausalLM:
    """Build a Qwen3-MoE model from a ``config.json`` dict."""
    cfg = from_dict(Qwen3MoeConfig, {**config, "rope": rope_parameters(config)})
    return Qwen3MoeForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Qwen3-MoE."""
    register(ArchitectureSpec(name="qwen3_moe", model_types=("qwen3_moe",), build=build,
                              description="Qwen3 mixture-of-experts models (30B-A3B, 235B-A22B)"))
