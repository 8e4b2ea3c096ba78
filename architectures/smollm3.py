"""SmolLM3 (Hugging Face, "SmolLM3: smol, multilingual, long-context reasoner", 2025).

``model_type`` ``smollm3`` as transformers' ``SmolLM3ForCausalLM`` computes
it. Against Llama (:mod:`.llama`):

* NoPE layers (Kazemnejad et al. 2023; Yang et al. 2025, "RoPE to NoRoPE and
  back again"): ``no_rope_layers[i]`` is 1 where layer ``i`` rotates its
  queries and keys and 0 where it uses no positions at all; without the list,
  every ``no_rope_layer_interval``-th layer (the 4th, 8th, ...) has none.
* Sliding windows only with ``use_sliding_window``, on the layers
  ``layer_types`` marks ``sliding_attention``.
* Biases where ``attention_bias`` / ``mlp_bias`` put them; tied head by default.

Per layer (``rope_i`` the identity on NoPE layers):
    h = h + o_proj(attention(rope_i(q_proj(x)), rope_i(k_proj(x)), v_proj(x)))   x = input_layernorm(h)
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))                           x = post_attention_layernorm(h)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.architecture import WeightLoader
from infer.config import from_dict, rope_parameters
from infer.errors import ConfigError
from infer.ops import Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .llama import LlamaConfig, LlamaForCausalLM


@dataclass
class SmolLM3Config(LlamaConfig):
    """``config.json`` fields read (transformers names and defaults)."""

    model_type: str = "smollm3"
    tie_word_embeddings: bool = True
    use_sliding_window: bool = False
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4

    def validate(self) -> None:
        super().validate()
        n = self.num_hidden_layers
        if self.no_rope_layers is None:
            if self.no_rope_layer_interval <= 0:
                raise ConfigError(f"config.json: no_rope_layer_interval must be positive, "
                                  f"found {self.no_rope_layer_interval}")
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if len(self.no_rope_layers) != n or any(v not in (0, 1) for v in self.no_rope_layers):
            raise ConfigError(f"config.json: no_rope_layers must be {n} entries of 0 or 1, found {self.no_rope_layers}")

    def window(self, layer: int) -> int | None:
        return super().window(layer) if self.use_sliding_window else None


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama with rope switched off in the NoPE layers."""

    def layer_rope(self, layer: int) -> str | None:
        assert self.config.no_rope_layers is not None  # set by validate()
        return "default" if self.config.no_rope_layers[layer] else None


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> SmolLM3ForCausalLM:
    """Build a SmolLM3 model from a ``config.json`` dict."""
    cfg = from_dict(SmolLM3Config, {**config, "rope": rope_parameters(config, 2e6)})
    return SmolLM3ForCausalLM(cfg, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register SmolLM3."""
    register(ArchitectureSpec(name="smollm3", model_types=("smollm3",), build=build,
                              description="SmolLM3 (3B; rope off in every 4th layer)"))
