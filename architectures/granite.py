"""IBM Granite 3.x (IBM, "Granite 3.0 Language Models", 2024).

``model_type`` ``granite`` as transformers' ``GraniteForCausalLM`` computes it
(Granite 3.0-3.3 dense models). Against Llama (:mod:`.llama`), four scalar
multipliers from muP-style training (the report's section on hyperparameters):

* ``embedding_multiplier`` scales the token embeddings;
* ``residual_multiplier`` scales each sublayer's output before it joins the
  residual stream (:class:`~.decoder.Block`'s ``residual_scale``);
* ``attention_multiplier`` *is* the softmax scale (instead of ``head_dim ** -0.5``);
* the logits are divided by ``logits_scaling``.

Biases where ``attention_bias`` / ``mlp_bias`` put them.

Per layer (``m``: residual_multiplier):
    h = h + m * o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   x = input_layernorm(h)
    h = h + m * down_proj(silu(gate_proj(x)) * up_proj(x))                       x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import WeightLoader, host_array
from infer.config import from_dict, rope_parameters
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .llama import LlamaConfig, LlamaForCausalLM


@dataclass
class GraniteConfig(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "granite"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with the four multipliers."""

    def __init__(self, config: GraniteConfig, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        self.embed_scale = ops.from_numpy(host_array([config.embedding_multiplier]))

    def block_options(self) -> dict[str, Any]:
        return {"residual_scale": self.config.residual_multiplier}

    def attention_scale(self) -> float:
        return self.config.attention_multiplier

    def compute_logits(self, hidden: Array) -> Array:
        return self.ops.div(super().compute_logits(hidden), self.config.logits_scaling)  # [rows, vocab]


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> GraniteForCausalLM:
    """Build a Granite model from a ``config.json`` dict."""
    cfg = from_dict(GraniteConfig, {**config, "rope": rope_parameters(config)})
    return GraniteForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Granite."""
    register(ArchitectureSpec(name="granite", model_types=("granite",), build=build,
                              description="IBM Granite 3.x dense models (embedding, residual, attention and "
                                          "logit multipliers)"))
