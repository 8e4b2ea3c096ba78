"""OLMo 2 (Team OLMo, "2 OLMo 2 Furious", 2024).

``model_type`` ``olmo2`` as transformers' ``Olmo2ForCausalLM`` computes it.
Against Llama (:mod:`.llama`), the two changes of the paper's section 3.1:

* Norms *after* each sublayer, on its output before the residual add, and
  none before it ("reordered norm"): the block's input goes straight into
  attention and the MLP (:class:`~.decoder.Block` with ``pre_norms=False,
  post_norms=True``). The final norm stays.
* RMSNorm on the queries and keys over the whole projection (``q_norm`` is
  ``heads * head_dim`` wide, ``k_norm`` ``kv_heads * head_dim``), before the
  heads split and before rope: unlike Qwen3's per-head norm, it mixes heads.

Per layer:
    h = h + post_attention_layernorm(o_proj(attention(rope(q_norm(q_proj(h))), rope(k_norm(k_proj(h))), v_proj(h))))
    h = h + post_feedforward_layernorm(down_proj(silu(gate_proj(h)) * up_proj(h)))
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
class Olmo2Config(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "olmo2"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Llama with norms after the sublayers only, and q/k norms over whole projections."""

    def attention_part(self) -> Attention:
        cfg = self.config
        return Attention(self.ops, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qk_norm="full", eps=cfg.rms_norm_eps)

    def load_attention(self, attention: Attention, w: WeightLoader, prefix: str) -> Weights:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {**attention.load(w, prefix, bias=cfg.attention_bias), "q_norm": w.get(prefix + "q_norm.weight", (q,)),
                "k_norm": w.get(prefix + "k_norm.weight", (kv,))}

    def block_options(self) -> dict[str, Any]:
        return {"pre_norms": False, "post_norms": True}

    def load_norms(self, w: WeightLoader, prefix: str) -> Weights:
        d = self.config.hidden_size
        return {"attn_post_norm": w.get(prefix + "post_attention_layernorm.weight", (d,)),
                "mlp_post_norm": w.get(prefix + "post_feedforward_layernorm.weight", (d,))}


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Olmo2ForCausalLM:
    """Build an OLMo 2 model from a ``config.json`` dict."""
    cfg = from_dict(Olmo2Config, {**config, "rope": rope_parameters(config)})
    return Olmo2ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register OLMo 2."""
    register(ArchitectureSpec(name="olmo2", model_types=("olmo2",), build=build,
                              description="OLMo 2 (1B-32B)"))
