"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"; ``model_type`` ``llava``).

A CLIP or SigLIP tower (:mod:`.vision`), a two-layer MLP projector
(``linear_1``, ``projector_hidden_act``, ``linear_2``) and any language model
of this package (``text_config.model_type``: the llama family, Qwen3, Gemma 3
text). As transformers' ``LlavaForConditionalGeneration``:

* the image's features are the tower's hidden states after layer
  ``vision_feature_layer`` (-2: the one before last; a list: those layers
  concatenated along the features), without the post-norm;
* ``vision_feature_select_strategy`` ``"default"`` drops their first row (CLIP's
  class token), ``"full"`` keeps every row;
* each of the prompt's ``<image>`` tokens (``image_token_index``) takes one
  projected row, in order; attention stays causal throughout.

The parts' weights are where the checkpoint keeps them (:func:`~.vision.checkpoint_prefixes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infer.architecture import CausalLM, VisionSpec, WeightLoader
from infer.errors import ConfigError
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from . import gemma3, llama, qwen3
from .gemma3_vl import LanguageModelWeights
from .vision import VisionTower, WrappedLanguageModel, checkpoint_prefixes, exact_gelu_bytes, vision_config

#: Language models a LLaVA checkpoint may carry: ``text_config.model_type`` -> build.
TEXT_MODELS = {"llama": llama.build, "mistral": llama.build, "qwen2": llama.build, "qwen3": qwen3.build,
               "gemma3_text": gemma3.build}

PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "silu")


class LlavaForConditionalGeneration(WrappedLanguageModel):
    """A language model that reads images through a tower and an MLP projector."""

    def __init__(self, config: dict[str, Any], weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: a llava config needs a text_config object")
        kind = text.get("model_type", "llama")
        if kind not in TEXT_MODELS:
            raise ConfigError(f"config.json: text_config.model_type {kind!r} is not a language model LLaVA runs "
                              f"here; supported: {', '.join(TEXT_MODELS)}")
        lm, head, tower, projector = checkpoint_prefixes(weights)
        # transformers ties the head by the top-level flag (which follows text_config's when unset).
        text = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
        #: The language model, built by its own architecture.
        self.language_model: CausalLM = TEXT_MODELS[kind](text, LanguageModelWeights(weights, lm, head), ops)  # type: ignore[arg-type]
        vcfg = vision_config(config)
        layers = config.get("vision_feature_layer", -2)
        self.feature_layers = [layers] if isinstance(layers, int) else [int(x) for x in layers]
        total = vcfg.num_hidden_layers + 1  # hidden_states: the embeddings, then each layer's output
        resolved = [x if x >= 0 else total + x for x in self.feature_layers]
        if any(not 0 <= x < total for x in resolved):
            raise ConfigError(f"config.json: vision_feature_layer {layers} is outside the tower's {total} "
                              "hidden states")
        self.feature_rows = resolved
        self.strategy = config.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ConfigError(f"config.json: vision_feature_select_strategy {self.strategy!r} is not 'default' or "
                              "'full'")
        self.vision_tower = VisionTower(vcfg, weights, ops, tower, layers=max(resolved), post_norm=False)
        act = config.get("projector_hidden_act", "gelu")
        if act not in PROJECTOR_ACTIVATIONS:
            raise ConfigError(f"config.json: projector_hidden_act {act!r} is not supported; supported: "
                              f"{', '.join(PROJECTOR_ACTIVATIONS)}")
        self.projector_act = act
        bias = config.get("multimodal_projector_bias", True)
        dv, dt = vcfg.hidden_size * len(resolved), int(text["hidden_size"])
        self.text_width = dt
        lin = lambda name, o, n: (weights.get(projector + name + ".weight", (o, n)),  # noqa: E731
                                  weights.get(projector + name + ".bias", (o,)) if bias else None)
        self.linear_1, self.linear_2 = lin("linear_1", dt, dv), lin("linear_2", dt, dt)
        lm_net = self.language_model
        self.num_layers, self.max_context, self.vocab_size = lm_net.num_layers, lm_net.max_context, lm_net.vocab_size
        self.lm_head = lm_net.lm_head
        self.vision = VisionSpec("llava", int(config.get("image_token_index", config.get("image_token_id", 32000))),
                                 config=config)

    def image_activation_bytes(self, shape: Sequence[int], meta: Mapping[str, Any]) -> int:
        """The most memory :meth:`embed_image` holds at once: a tower layer's, with the
        stream's states up to the last one read kept (``hidden_states``)."""
        tower = self.vision_tower
        projector = exact_gelu_bytes(tower.tokens, self.text_width) if self.projector_act == "gelu" else 0
        return tower.activation_bytes(kept=max(self.feature_rows) + 1) + projector

    def embed_image(self, pixel_values: Array, meta: Mapping[str, Any]) -> Array:
        """The chosen hidden states of the tower, projected: ``[image tokens, text hidden]``."""
        ops = self.ops
        states = self.vision_tower.hidden_states(pixel_values, upto=max(self.feature_rows))
        chosen = [states[i] for i in self.feature_rows]
        if self.strategy == "default":
            chosen = [ops.slice(h, 0, 1, ops.shape(h)[0]) for h in chosen]
        x = chosen[0] if len(chosen) == 1 else ops.concat(chosen, -1)
        x = ops.linear(x, *self.linear_1)
        act = self.projector_act
        x = ops.gelu(x) if act == "gelu" else ops.silu(x) if act == "silu" else ops.gelu_tanh(x)
        return ops.linear(x, *self.linear_2)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> LlavaForConditionalGeneration:
    """Build a LLaVA model from a ``llava`` ``config.json`` dict."""
    return LlavaForConditionalGeneration(config, weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register LLaVA."""
    register(ArchitectureSpec(
        name="llava", model_types=("llava",), build=build,
        description="LLaVA-style models: a CLIP or SigLIP tower, an MLP projector, a language model of this package",
    ))
