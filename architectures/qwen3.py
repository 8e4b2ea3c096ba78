"""Qwen3 dense models (Qwen Team, "Qwen3 Technical Report", 2025).

``model_type`` ``qwen3`` as transformers' ``Qwen3ForCausalLM`` computes it.
Against Llama (:mod:`.llama`), and Qwen2 before it:

* RMSNorm on each head's queries and keys (``q_norm``, ``k_norm``, over
  ``head_dim``), before rope (report section 2: it replaces Qwen2's qkv bias
  for stable training). The norm weights are per head dimension, shared by
  every head.
* No qkv bias by default; ``attention_bias`` puts biases on q, k, v *and* o.
* ``head_dim`` is explicit (128 when config.json omits it, transformers'
  default), not ``hidden_size / heads``: Qwen3-0.6B has 16 heads of 128 over
  a hidden size of 1024.
* Sliding windows only with ``use_sliding_window``, from ``max_window_layers``
  on (as Qwen2; transformers 5 writes the result as ``layer_types``).

Per layer:
    h = h + o_proj(attention(rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x))), v_proj(x)))
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))
with x = input_layernorm(h) resp. post_attention_layernorm(h).
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
class Qwen3Config(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "qwen3"
    head_dim: int | None = 128
    attention_bias: bool = False
    max_window_layers: int | None = 28


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head q/k RMSNorm."""

    def attention_part(self) -> Attention:
        cfg = self.config
        return Attention(self.ops, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qk_norm="head", eps=cfg.rms_norm_eps)

    def load_attention(self, attention: Attention, w: WeightLoader, prefix: str) -> Weights:
        hd = self.config.head_dim
        return {**attention.load(w, prefix, bias=self.config.attention_bias),
                "q_norm": w.get(prefix + "q_norm.weight", (hd,)), "k_norm": w.get(prefix + "k_norm.weight", (hd,))}


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3ForCausalLM:
    """Build a Qwen3 model from a ``config.json`` dict."""
    cfg = from_dict(Qwen3Config, {**config, "rope": rope_parameters(config)})
    return Qwen3ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Qwen3."""
    register(ArchitectureSpec(name="qwen3", model_types=("qwen3",), build=build,
                              description="Qwen3 dense models (0.6B-32B)"))
