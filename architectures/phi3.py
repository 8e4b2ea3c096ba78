"""Phi-3 and Phi-4-mini (Abdin et al. 2024, "Phi-3 Technical Report").

``model_type`` ``phi3`` as transformers' ``Phi3ForCausalLM`` computes it
(Phi-3/3.5-mini, Phi-3-medium, Phi-4-mini). Against Llama (:mod:`.llama`):

* q, k and v are one stored projection, ``qkv_proj`` (rows: the q heads, then
  the k heads, then the v heads), and gate and up one ``gate_up_proj``
  (gate rows first): read as stored, one product each.
* Partial rotary embedding (``partial_rotary_factor``, 0.75 in Phi-4-mini):
  only the first ``head_dim * factor`` features of each head rotate, the rest
  pass through (the contract's ``rope`` does both).
* LongRoPE scaling (``rope_type`` ``longrope``, or ``su`` in the first 128k
  configs; see :mod:`.rope`) against ``original_max_position_embeddings``.
* An optional ``sliding_window`` on every layer (Phi-3-mini-4k: 2047).

Per layer:
    q, k, v = split(qkv_proj(x))                                       x = input_layernorm(h)
    h = h + o_proj(attention(partial_rope(q), partial_rope(k), v))
    gate, up = split(gate_up_proj(x))                                  x = post_attention_layernorm(h)
    h = h + down_proj(silu(gate) * up)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import Attention, Weights
from .llama import LlamaConfig, LlamaForCausalLM


@dataclass
class Phi3Config(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "phi3"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with stacked projections as stored, and partial rotary embeddings."""

    def load_attention(self, attention: Attention, w: WeightLoader, prefix: str) -> Weights:
        cfg = self.config
        nh, nkv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        return {"qkv_proj": w.get(prefix + "qkv_proj.weight", ((nh + 2 * nkv) * hd, d)),
                "o_proj": w.get(prefix + "o_proj.weight", (d, nh * hd))}


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Phi3ForCausalLM:
    """Build a Phi-3 model from a ``config.json`` dict."""
    rope = rope_parameters(config)
    if rope["rope_type"] == "su":  # the first Phi-3-128k configs' name for LongRoPE
        rope["rope_type"] = "longrope"
    if rope["rope_type"] == "longrope":  # transformers reads the original length from the top level too
        rope.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings", 4096))
    cfg = from_dict(Phi3Config, {**config, "rope": rope})
    return Phi3ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Phi-3."""
    register(ArchitectureSpec(name="phi3", model_types=("phi3",), build=build,
                              description="Phi-3/3.5-mini, Phi-3-medium, Phi-4-mini"))
