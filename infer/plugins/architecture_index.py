"""infer's own architectures, registered without importing their modules.

Each architecture module registers its specs through the
``infer_register_architectures`` hook, as a third party's would. Calling the
hooks meant importing all 26 modules (about 25 ms of every process that
loads a model, most of a small model's plugin discovery) to build the one a
file names. So for the modules listed here, discovery
(:mod:`infer.plugins.discovery`) registers a stand-in under the module's
entry-point name instead: its hook registers the specs this index describes,
whose ``build`` and ``read_config`` import the module on their first call.
tests/test_plugins.py checks that every entry is what the module's own hook
registers, and that every first-party architecture is listed. A module left
out is imported at discovery as before.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

__all__ = ["INDEX", "Deferred", "stand_in"]


@dataclass(frozen=True)
class Deferred:
    """``module.attribute``, imported when first called."""

    module: str
    attribute: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.attribute)(*args, **kwargs)


@dataclass(frozen=True)
class Entry:
    """One :class:`ArchitectureSpec` a module registers; callables by attribute name."""

    name: str
    model_types: tuple[str, ...]
    description: str
    build: str = "build"
    read_config: str | None = None


#: Module -> the specs its hook registers, in order.
INDEX: dict[str, tuple[Entry, ...]] = {
    "infer.architectures.llama": (Entry("llama", ("llama", "mistral", "qwen2"),
                                        "Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2/2.5"),),
    "infer.architectures.gemma3": (Entry("gemma3", ("gemma3_text",),
                                         "Gemma 3 text models (270M, 1B; the text part of 4B-27B)"),),
    "infer.architectures.deepseek_v3": (Entry("deepseek_v3", ("deepseek_v3",),
                                              "DeepSeek-V3/R1 and models of its shape (MLA, DeepSeekMoE, MTP modules)"),),
    "infer.architectures.qwen3": (Entry("qwen3", ("qwen3",), "Qwen3 dense models (0.6B-32B)"),),
    "infer.architectures.mixtral": (Entry("mixtral", ("mixtral",),
                                          "Mixtral 8x7B, 8x22B (sparse mixture of experts, softmax top-k)"),),
    "infer.architectures.qwen3_moe": (Entry("qwen3_moe", ("qwen3_moe",),
                                            "Qwen3 mixture-of-experts models (30B-A3B, 235B-A22B)"),),
    "infer.architectures.phi3": (Entry("phi3", ("phi3",), "Phi-3/3.5-mini, Phi-3-medium, Phi-4-mini"),),
    "infer.architectures.olmo2": (Entry("olmo2", ("olmo2",), "OLMo 2 (1B-32B)"),),
    "infer.architectures.smollm3": (Entry("smollm3", ("smollm3",), "SmolLM3 (3B; rope off in every 4th layer)"),),
    "infer.architectures.granite": (Entry("granite", ("granite",),
                                          "IBM Granite 3.x dense models (embedding, residual, attention and "
                                          "logit multipliers)"),),
    "infer.architectures.gpt2": (Entry("gpt2", ("gpt2",), "GPT-2 (small to XL), DistilGPT2"),),
    "infer.architectures.gemma4": (Entry("gemma4", ("gemma4_text", "gemma4"),
                                         "Gemma 4 text models (E2B, E4B, 31B, 26B-A4B; the language model of the "
                                         "multimodal ones)"),),
    "infer.architectures.lfm2": (Entry("lfm2", ("lfm2",),
                                       "Liquid AI LFM2 (short convolutions and attention; 350M-2.6B)"),),
    "infer.architectures.gpt_oss": (Entry("gpt_oss", ("gpt_oss",),
                                          "gpt-oss 20b, 120b (attention sinks, alternating banded layers, MoE)"),),
    "infer.architectures.falcon_h1": (Entry("falcon_h1", ("falcon_h1",),
                                            "TII Falcon-H1 (parallel Mamba2 and attention heads; 0.5B-34B)",
                                            read_config="read_config"),),
    "infer.architectures.mamba2": (Entry("mamba2", ("mamba2",), "Mamba2 state space models (SSD mixers, no attention)",
                                         read_config="read_config"),),
    "infer.architectures.granitemoehybrid": (Entry("granitemoehybrid", ("granitemoehybrid",),
                                                   "IBM Granite 4.0-H (Mamba2 and attention layers, optional MoE, "
                                                   "Granite's multipliers)", read_config="read_config"),),
    "infer.architectures.qwen3_5": (Entry("qwen3_5", ("qwen3_5_text",), "Qwen3.5 (gated DeltaNet + gated attention)"),),
    "infer.architectures.qwen3_5_vision": (
        Entry("qwen3_5_vl", ("qwen3_5",), "Qwen3.5 (Qwen3_5ForConditionalGeneration): its vision tower with 2D rope "
              "and 2x2 merger, M-RoPE positions; the language model alone without it"),
        Entry("qwen3_5_moe_vl", ("qwen3_5_moe",), "Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration): the same vision "
              "tower and positions; the language model alone without it", build="build_moe"),
    ),
    "infer.architectures.idefics3": (Entry("idefics3", ("idefics3", "smolvlm"),
                                           "Idefics3 / SmolVLM: image tiles through a SigLIP-style encoder, pixel "
                                           "shuffle and a projection, into a Llama-family language model"),),
    "infer.architectures.qwen3_next": (
        Entry("qwen3_next", ("qwen3_next",), "Qwen3-Next (gated DeltaNet + gated attention, sparse MoE)"),
        Entry("qwen3_5_moe", ("qwen3_5_moe_text",), "Qwen3.5-MoE (Qwen3.5's layers, a sparse MoE in every layer)",
              build="build_qwen3_5_moe"),
    ),
    "infer.architectures.bert": (Entry("bert", ("bert", "distilbert", "roberta", "xlm-roberta"),
                                       "BERT and (XLM-)RoBERTa encoders for embeddings and reranking "
                                       "(all-MiniLM, bge, e5, cross-encoders)"),),
    "infer.architectures.gemma3_vl": (Entry("gemma3_vl", ("gemma3",),
                                            "Gemma 3 4B-27B with images (SigLIP tower, 256 soft tokens per image)"),),
    "infer.architectures.llava": (Entry("llava", ("llava",), "LLaVA-style models: a CLIP or SigLIP tower, an MLP "
                                        "projector, a language model of this package"),),
}


def specs(module: str) -> list[ArchitectureSpec]:
    """The specs :data:`INDEX` lists for ``module``, their callables deferred."""
    return [ArchitectureSpec(name=e.name, model_types=e.model_types, build=Deferred(module, e.build),
                             description=e.description,
                             read_config=Deferred(module, e.read_config) if e.read_config else None)
            for e in INDEX[module]]


class _StandIn:
    """Registers what an indexed module would, without importing it. ``__name__`` is the
    module's, so discovery counts it first-party as it would the module."""

    def __init__(self, module: str) -> None:
        self.__name__ = module

    def __dir__(self) -> list[str]:  # what pluggy looks through (infer.plugins.discovery._Hooks)
        return ["infer_register_architectures"]

    @hookimpl
    def infer_register_architectures(self, register: Any) -> None:
        for spec in specs(self.__name__):
            register(spec)


def stand_in(module: str) -> object | None:
    """The plugin to register in place of ``module``, or None where it is not indexed."""
    return _StandIn(module) if module in INDEX else None
