"""Mixtral (Jiang et al. 2024, "Mixtral of Experts").

``model_type`` ``mixtral`` as transformers' ``MixtralForCausalLM`` computes it
(Mixtral 8x7B, 8x22B and models of that shape). Against Llama (:mod:`.llama`):

* Every layer's MLP is a sparse mixture of ``num_local_experts`` gated MLPs
  (paper section 2.1): the router ``block_sparse_moe.gate`` scores the
  experts, each token goes to its ``num_experts_per_tok`` best, and their
  outputs are summed with the softmax of the chosen logits as weights
  (:class:`~.moe.SparseMoE` with ``norm_topk_prob``; the softmax over all
  experts, renormalised over the top-k, is the same number). Experts are
  ``block_sparse_moe.experts.{i}.w1`` (gate), ``w3`` (up), ``w2`` (down), as
  the released checkpoints name them.
* An optional ``sliding_window`` on every layer (as Mistral; null in the
  released Mixtrals).

Per layer:
    h = h + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))     x = input_layernorm(h)
    h = h + sum_{e in topk(router(x))} softmax_topk(router(x))_e * expert_e(x) x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import ACTIVATIONS, MLPPart
from .llama import LlamaConfig, LlamaForCausalLM
from .moe import SparseMoE


@dataclass
class MixtralConfig(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "mixtral"
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5

    def validate(self) -> None:
        super().validate()
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                              f"and num_local_experts ({self.num_local_experts})")


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama with a sparse mixture of experts for every MLP."""

    def mlp_part(self, layer: int) -> tuple[MLPPart, str]:
        return self.moe, "block_sparse_moe."

    @cached_property
    def moe(self) -> SparseMoE:
        cfg = self.config
        return SparseMoE(self.ops, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                         cfg.num_experts_per_tok, norm_topk_prob=True, activation=ACTIVATIONS[cfg.hidden_act],
                         names=("w1", "w3", "w2"))


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> MixtralForCausalLM:
    """Build a Mixtral model from a ``config.json`` dict."""
    cfg = from_dict(MixtralConfig, {**config, "rope": rope_parameters(config, 1e6)})
    return MixtralForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Mixtral."""
    register(ArchitectureSpec(name="mixtral", model_types=("mixtral",), build=build,
                              description="Mixtral 8x7B, 8x22B (sparse mixture of experts, softmax top-k)"))
