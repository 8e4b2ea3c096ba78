"""Writing a model package as a GGUF file that llama.cpp and transformers read.

The reverse of :mod:`infer.formats.gguf`: the Hugging Face names, layouts and
``config.json`` fields of a :class:`~infer.package.ModelPackage` become
llama.cpp's tensor names (the same :data:`~infer.formats.gguf_arch.ARCHITECTURES`
row the reader uses, read backwards), its ``{arch}.*`` metadata, its layout
fixes (the Q/K row permutation of ``llama``, Gemma's ``w + 1`` norms) and its
``tokenizer.ggml.*`` vocabulary (:mod:`infer.formats.gguf_write_tokenizer`). Tensors are quantized one at a time, a slab
of rows at a time (:func:`~infer.formats.gguf_quantize.quantize_rows`), and
streamed into the file, so memory holds one tensor, never the model.

Output types (:data:`TYPES`): ``f32``, ``f16`` and ``bf16`` store every matrix
in that type; the block types too, except the output projection (Q6_K, as
``llama-quantize`` makes it); ``q4_k_m`` / ``q5_k_m`` follow ``llama-quantize``'s
mix (:func:`tensor_type`). Norms and biases stay F32, as in llama.cpp's files. A matrix whose rows do not fit the type's block falls
back as llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import ConfigError, FormatError, MissingDependencyError, UnsupportedArchitectureError
from infer.ops import QuantizedTensor
from infer.package import ModelPackage

from . import gguf_ssm
from .gguf_arch import ARCHITECTURES, GLOBAL_TENSORS, POOLING_TYPES, ArchitectureMap, _llama3_divisors
from .gguf_quantize import quantize_rows
from .gguf_quants import TYPES_BY_NAME
from .gguf_write_tokenizer import tokenizer_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputType:
    """One ``--type``: the GGML type of matrices, llama.cpp's ``general.file_type``,
    and whether ``llama-quantize``'s per-tensor mix applies."""

    ggml: str
    file_type: int
    mix: bool = False


#: ``--type`` -> how tensors are stored. ``file_type`` is llama.cpp's ``LlamaFileType``;
#: q4_k / q5_k (one type but for the output, no per-layer tweaks) carry the ``_S`` numbers.
TYPES: dict[str, OutputType] = {
    "f32": OutputType("F32", 0), "f16": OutputType("F16", 1), "bf16": OutputType("BF16", 32),
    "q8_0": OutputType("Q8_0", 7), "q4_0": OutputType("Q4_0", 2), "q4_1": OutputType("Q4_1", 3),
    "q5_0": OutputType("Q5_0", 8), "q5_1": OutputType("Q5_1", 9), "q4_k": OutputType("Q4_K", 14),
    "q5_k": OutputType("Q5_K", 16), "q6_k": OutputType("Q6_K", 18),
    "q4_k_m": OutputType("Q4_K", 15, mix=True), "q5_k_m": OutputType("Q5_K", 17, mix=True),
}

#: llama.cpp's fallback for a row that is not a whole number of 256-value super-blocks.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _more_bits(layer: int, layers: int) -> bool:
    """``llama-quantize``'s ``use_more_bits``: the first and last eighth of the layers,
    and every third one between, get the bigger type in the _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


#: Matrices llama.cpp's converter keeps in float32 whatever the type (its ``tensor_force_quant``
#: list): routers and convolution kernels.
_ALWAYS_F32 = re.compile(r"\.(ffn_gate_inp|ssm_conv1d)\.weight$")


def tensor_type(gguf_name: str, cols: int, ndim: int, out: OutputType, layers: int, tied: bool) -> str:
    """The GGML type of tensor ``gguf_name`` (rows of ``cols`` values) in a file of type ``out``.

    Vectors (norms, biases) stay F32. As ``llama-quantize`` does for every block
    type (``llama_tensor_get_type``, dense models, no importance matrix), the output
    projection -- the token embedding when it is tied -- is Q6_K unless the type is
    Q8_0; in the _M mixes ``attn_v`` and ``ffn_down`` of the layers :func:`_more_bits`
    picks are Q6_K too.
    """
    if (ndim < 2 or out.ggml == "F32" or not gguf_name.endswith(".weight") or ".ffn_gate_inp." in gguf_name
            or _ALWAYS_F32.search(gguf_name)):
        return "F32"  # as convert_hf_to_gguf.py: vectors, every non-weight (gpt-oss's [experts, out] biases), routers
    qtype = out.ggml
    block_type = TYPES_BY_NAME[qtype].quantized
    layer = re.match(r"blk\.(\d+)\.", gguf_name)
    if block_type and qtype != "Q8_0" and (gguf_name == "output.weight" or
                                             (tied and gguf_name == "token_embd.weight")):
        qtype = "Q6_K"
    elif out.mix and layer and gguf_name.endswith((".attn_v.weight", ".ffn_down.weight")) and \
            _more_bits(int(layer[1]), layers):
        qtype = "Q6_K"
    block = TYPES_BY_NAME[qtype].block_size
    if cols % block:
        qtype = _FALLBACK.get(qtype, qtype)
        if cols % TYPES_BY_NAME[qtype].block_size:
            qtype = "F16"
    return qtype


# -- the architecture, backwards -------------------------------------------------------------


#: The rows of :data:`ARCHITECTURES` this writer is checked for (round trips,
#: llama.cpp loading them). The others are read-only until writing them is
#: tested: their expert tensors, GPT-2's transposed weights and the like.
WRITTEN = frozenset({"llama", "qwen2", "gemma3", "gpt-oss", "gemma4", "qwen35", "qwen35moe", "qwen3next"}) | {"mamba2", "granitehybrid", "falcon-h1"}  # + gguf_ssm's
#: Hugging Face model_types read from GGUF but refused by the writer, and why.
REFUSED_MODEL_TYPES = {"gemma4": "its vision and audio towers go to llama.cpp's separate mmproj file, which infer "
                                  "does not write; write the text model (a gemma4_text folder)"}


def architecture_for(model_type: str) -> ArchitectureMap:
    """The :data:`ARCHITECTURES` row that writes Hugging Face ``model_type``."""
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} cannot be written as GGUF: "
                                           f"{REFUSED_MODEL_TYPES[model_type]}")
    rows = [arch for arch in ARCHITECTURES.values() if arch.gguf_name in WRITTEN]
    for arch in rows:
        if model_type == arch.model_type or model_type in arch.also_from:
            return arch
    known = sorted({a.model_type for a in rows} | {m for a in rows for m in a.also_from})
    raise UnsupportedArchitectureError(f"model_type {model_type!r} cannot be written as GGUF; supported: "
                                       f"{', '.join(known)}")


_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)\.(weight|bias)")
_LAYER_PARAM = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")
#: A vision-language checkpoint's text model (Qwen3.5): its weights, and what is not written.
_TEXT_PREFIX = "model.language_model."
_NOT_TEXT = re.compile(r"(model\.visual|mtp)\..*")
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer some old checkpoints saved


def gguf_tensor_name(arch: ArchitectureMap, name: str) -> str | None:
    """llama.cpp's name for Hugging Face tensor ``name`` (None: not stored)."""
    if _SKIPPED.fullmatch(name):
        return None
    base, _, kind = name.rpartition(".")
    for gguf_base, hf in (GLOBAL_TENSORS if arch.global_tensors is None else arch.global_tensors).items():
        if base == hf and kind in ("weight", "bias"):
            return f"{gguf_base}.{kind}"
    m = _LAYER.fullmatch(name)
    if m is not None:
        for gguf_base, hf in arch.layer_tensors.items():
            if hf == m[2] and "." not in gguf_base:
                return f"blk.{m[1]}.{gguf_base}.{m[3]}"
    m = _LAYER_PARAM.fullmatch(name)
    if m is not None:  # a parameter without a .weight ending (gpt-oss's sinks)
        for gguf_full, hf in arch.layer_tensors.items():
            if hf == m[2] and "." in gguf_full:
                return f"blk.{m[1]}.{gguf_full}"
    raise FormatError(f"tensor {name!r} has no llama.cpp name in architecture {arch.gguf_name!r}; "
                      f"it cannot be written as GGUF")


def _permute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order of llama.cpp's ``permute`` (the inverse of the reader's ``_unpermute_rows``):
    within each head, rows i and i + head_dim/2 of a rope pair become neighbours."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


# -- metadata -------------------------------------------------------------------------------


def _rope(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rope of full attention, the sliding layers' rope or None) in transformers 5 form,
    from either ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {}) or None
    if isinstance(params, dict) and params:
        return dict(params), None
    rope = dict(config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    return rope, None


def hyperparameters(arch: ArchitectureMap, config: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray | None]:
    """The ``{arch}.*`` metadata for ``config`` and, for Llama 3 rope scaling or
    per-frequency ``freq_factors``, the ``rope_freqs`` tensor llama.cpp stores them as."""
    c = dict(config)
    heads = c["num_attention_heads"]
    c.setdefault("num_key_value_heads", heads)
    c.setdefault("head_dim", c["hidden_size"] // heads)
    rope, local = _rope(c)
    theta = rope.get("rope_theta")
    if theta is not None:
        c["rope_theta"] = theta
    if arch.gguf_name == "gemma4":
        _gemma4_config(c)
    if c.get("sliding_window") is None or (arch.model_type == "qwen2" and not c.get("use_sliding_window")):
        c.pop("sliding_window", None)  # Qwen2 keeps a window size it does not use
    md: dict[str, Any] = {}
    for h in arch.hparams:
        value = c.get(h.name)
        if value is None or isinstance(value, bool):
            if h.required:
                raise ConfigError(f"config.json has no {h.name}, which GGUF's {arch.gguf_name}.{h.key} needs")
            continue
        md[f"{arch.gguf_name}.{h.key}"] = h.kind(value)
    md[f"{arch.gguf_name}.attention.value_length"] = c["head_dim"]
    pooling = {name: code for code, name in POOLING_TYPES.items()}.get(c.get("pooling_type"))
    if pooling is not None:  # an embedding model's pooling, as llama.cpp reads it
        md[f"{arch.gguf_name}.pooling_type"] = pooling
    md[f"{arch.gguf_name}.rope.dimension_count"] = int(c["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    freqs = None
    kind = rope.get("rope_type", "default")
    p = f"{arch.gguf_name}.rope.scaling"
    if kind in ("linear", "yarn"):
        md[f"{p}.type"], md[f"{p}.factor"] = kind, float(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            md[f"{p}.original_context_length"] = int(rope["original_max_position_embeddings"])
    elif kind == "llama3" and arch.gguf_name == "llama":
        # llama.cpp reads only the divisors; infer reads them back as llama3 where they follow
        # its rule with these original positions, else as freq_factors (the same frequencies).
        freqs = _llama3_divisors({"low_freq_factor": 1.0, "high_freq_factor": 4.0, **rope},
                                 c["head_dim"]).astype(np.float32)
        if rope["original_max_position_embeddings"] != 8192:
            md[f"{p}.original_context_length"] = int(rope["original_max_position_embeddings"])
    elif kind == "default" and rope.get("freq_factors") is not None and arch.gguf_name == "llama":
        freqs = np.asarray(rope["freq_factors"], np.float32)
    elif kind == "proportional" and arch.gguf_name == "gemma4":
        freqs = _gemma4_rope_freqs(c, rope)
    elif kind != "default":
        raise ConfigError(f"rope scaling {kind!r} has no GGUF form for {arch.gguf_name}; supported: linear, yarn"
                          f"{', llama3' if arch.gguf_name == 'llama' else ''}")
    if rope.get("freq_factors") is not None and not (kind == "default" and arch.gguf_name == "llama"):
        raise ConfigError(f"rope freq_factors with rope type {kind!r} have no GGUF form for {arch.gguf_name}; "
                          "supported: llama with the default rope type")
    for key, value in arch.defaults.items():  # what llama.cpp assumes for the family
        if c.get(key, value) != value:
            raise ConfigError(f"config.json {key} is {c[key]!r}; GGUF's {arch.gguf_name} computes {value!r}")
    extra = _EXTRAS.get(arch.gguf_name)
    if extra is not None:
        extra(md, c, local)
    return md, freqs


def _gemma3_metadata(md: dict[str, Any], config: dict[str, Any], local: dict[str, Any] | None) -> None:
    """What the reader's ``_finish_gemma3`` recovers: the layer pattern, the local rope base
    and the attention scale, each written only where it differs from llama.cpp's default."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in types]
    if sliding != [(i + 1) % 6 != 0 for i in range(layers)]:
        md["gemma3.attention.sliding_window_pattern"] = np.array(sliding, dtype=bool)
    base = (local or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    if base != 10000.0:
        md["gemma3.rope.freq_base_swa"] = float(base)
    scalar = config.get("query_pre_attn_scalar", config["head_dim"])
    default = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    if scalar != default:
        md["gemma3.attention.scale"] = float(scalar) ** -0.5
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is None:
            md.pop(f"gemma3.{key}", None)


def _gpt_oss_metadata(md: dict[str, Any], config: dict[str, Any], local: dict[str, Any] | None) -> None:
    """gpt-oss as convert_hf_to_gguf.py writes it (the experts' width as
    ``expert_feed_forward_length`` too), refusing what llama.cpp hard-codes otherwise: the
    layer pattern (even layers sliding), YaRN without truncation's rounding, a window."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
    if list(types) != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]:
        raise ConfigError(f"config.json layer_types {types!r} has no GGUF form: llama.cpp's gpt-oss makes "
                          f"even layers sliding and odd ones full")
    if not config.get("sliding_window"):
        raise ConfigError("config.json sliding_window is null; llama.cpp's gpt-oss needs a window "
                          "(attention.sliding_window)")
    md["gpt-oss.expert_feed_forward_length"] = int(config["intermediate_size"])
    experts = config.get("num_local_experts", config.get("num_experts"))
    md["gpt-oss.expert_count"] = int(experts)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        if rope.get("truncate", True) is not False:
            raise ConfigError("config.json: gpt-oss YaRN with truncate true has no GGUF form infer reads back "
                              "(its files mean the released models' truncate false)")
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            if float(rope.get(key, default)) != default:
                md[f"gpt-oss.rope.scaling.yarn_{key}"] = float(rope[key])


def _gemma4_config(c: dict[str, Any]) -> None:
    """Gemma 4's per-layer head sizes and key/value heads, in place, in the released
    configs' form (``global_head_dim``, ``num_global_key_value_heads``) that
    convert_hf_to_gguf.py reads, from either that form or transformers 5.24's
    ``per_layer_config``; what llama.cpp cannot hold is refused."""
    n, types = c["num_hidden_layers"], c.get("layer_types")
    if not types or len(types) != n:
        raise ConfigError(f"config.json layer_types must list the {n} layers' kinds for GGUF's gemma4")
    if c.get("attention_bias"):
        raise ConfigError("config.json attention_bias is true; llama.cpp's gemma4 loads no attention biases")
    overrides = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    heads, kv = [], []
    for i, kind in enumerate(types):
        o, full = overrides.get(i), kind == "full_attention"
        heads.append(int(o.get("head_dim", c["head_dim"])) if o else
                     int(c.get("global_head_dim") or c["head_dim"]) if full else int(c["head_dim"]))
        global_kv = c.get("num_global_key_value_heads") if full and c.get("attention_k_eq_v") else None
        kv.append(int(o.get("num_key_value_heads", c["num_key_value_heads"])) if o else
                  int(global_kv or c["num_key_value_heads"]))
    for kind in ("sliding_attention", "full_attention"):
        seen = {(h, k) for h, k, t in zip(heads, kv, types) if t == kind}
        if len(seen) > 1:
            raise ConfigError(f"config.json gives {kind} layers different head sizes or key/value heads {sorted(seen)};"
                              f" GGUF's gemma4 has one of each per layer kind")
        if kind == "sliding_attention" and seen and seen != {(c["head_dim"], c["num_key_value_heads"])}:
            raise ConfigError("config.json per_layer_config changes sliding layers' head_dim or "
                              "num_key_value_heads; GGUF's gemma4 stores those once")
    full = [(h, k) for h, k, t in zip(heads, kv, types) if t == "full_attention"]
    c["global_head_dim"] = full[0][0] if full else c["head_dim"]
    if full and full[0][1] != c["num_key_value_heads"]:
        if not c.get("attention_k_eq_v"):
            raise ConfigError("config.json gives full layers their own key/value heads without attention_k_eq_v; "
                              "infer reads a GGUF's per-kind counts back only with keys as values")
        c["num_global_key_value_heads"] = full[0][1]
    else:
        c.pop("num_global_key_value_heads", None)


def _gemma4_rope_freqs(c: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """The full layers' proportional rope as Gemma4Model writes it: ``rope_freqs``, 1 for the
    rotated frequency pairs and 1e30 (no rotation) for the rest."""
    if float(rope.get("factor", 1.0)) != 1.0:
        raise ConfigError(f"config.json: Gemma 4's proportional rope with factor {rope['factor']} has no GGUF form "
                          f"infer has verified")
    dim = c["global_head_dim"]
    rotated = int(dim * rope.get("partial_rotary_factor", 1.0) / 2)
    return np.array([1.0] * rotated + [1e30] * (dim // 2 - rotated), np.float32)


def _gemma4_metadata(md: dict[str, Any], config: dict[str, Any], local: dict[str, Any] | None) -> None:
    """convert_hf_to_gguf.py's Gemma4Model keys: per-layer arrays where layers differ (the
    sliding pattern always; key/value heads with ``num_global_key_value_heads``; the MLP
    widths with ``use_double_wide_mlp``), both head sizes, both rope dimension counts and
    bases, the shared-KV count, the per-layer input width."""
    p, c, n = "gemma4", config, config["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    local = local or {"rope_type": "default", "rope_theta": 10000.0}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json: Gemma 4 sliding layers' rope {local.get('rope_type')!r} has no GGUF form; "
                          f"supported: default")
    shared = int(c.get("num_kv_shared_layers") or 0)
    ff = int(c["intermediate_size"])
    md[f"{p}.feed_forward_length"] = (np.array([ff if i < n - shared else 2 * ff for i in range(n)], np.int32)
                                      if c.get("use_double_wide_mlp") and shared else ff)
    md[f"{p}.attention.head_count_kv"] = int(c["num_key_value_heads"])
    if c.get("num_global_key_value_heads") is not None:
        md[f"{p}.attention.head_count_kv"] = np.array(
            [c["num_key_value_heads"] if s else c["num_global_key_value_heads"] for s in swa], np.int32)
    md[f"{p}.attention.sliding_window_pattern"] = np.array(swa, dtype=bool)
    head, full = int(c["head_dim"]), int(c["global_head_dim"])
    md.update({f"{p}.attention.key_length": full, f"{p}.attention.value_length": full,
               f"{p}.attention.key_length_swa": head, f"{p}.attention.value_length_swa": head,
               f"{p}.rope.dimension_count": full,
               f"{p}.rope.dimension_count_swa": int(head * local.get("partial_rotary_factor", 1.0)),
               f"{p}.rope.freq_base_swa": float(local.get("rope_theta", 10000.0)),
               f"{p}.attention.shared_kv_layers": shared,
               f"{p}.embedding_length_per_layer_input": int(c.get("hidden_size_per_layer_input") or 0)})
    if c.get("final_logit_softcapping") is None:
        md.pop(f"{p}.final_logit_softcapping", None)
def _delta_net_metadata(md: dict[str, Any], config: dict[str, Any], local: dict[str, Any] | None) -> None:
    """Qwen3.5 / Qwen3-Next (convert_hf_to_gguf.py's ``Qwen3NextModel``): the DeltaNet's sizes, the
    layer pattern as ``full_attention_interval`` (else ``attention.recurrent_layers``), the rotated
    share (transformers' default 0.25) and, for Qwen3.5, the M-RoPE sections llama.cpp requires (text positions are equal on every
    axis, so any split is plain rope; ``[rotated / 2, 0, 0, 0]`` when the config names none)."""
    from .gguf_delta_net import check_config, full_attention_interval

    arch = architecture_for(config["model_type"])
    p = arch.gguf_name
    types = check_config(arch, config)
    interval = full_attention_interval(types)
    md.pop(f"{p}.full_attention_interval", None)
    if interval is not None:  # what llama.cpp's converter writes
        md[f"{p}.full_attention_interval"] = interval
    else:  # no interval gives the pattern: one boolean per layer, which llama.cpp's loaders read first
        md[f"{p}.attention.recurrent_layers"] = np.array([t == "linear_attention" for t in types], dtype=bool)
        log.warning("layer_types is not every k-th layer full attention: written as %s.attention.recurrent_layers, "
                    "which llama.cpp builds without it read as full_attention_interval 4", p)
    md[f"{p}.ssm.inner_size"] = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    rope, _ = _rope(config)
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    rotated = int(config["head_dim"] * factor)
    md[f"{p}.rope.dimension_count"] = rotated
    if p in ("qwen35", "qwen35moe"):
        sections = list(rope.get("mrope_section") or [rotated // 2])[:4]
        md[f"{p}.rope.dimension_sections"] = np.array(sections + [0] * (4 - len(sections)), dtype=np.int32)
    if p == "qwen35moe":  # transformers' Qwen3.5-MoE always renormalises; no dense layers
        md.pop(f"{p}.feed_forward_length", None)
    if config["linear_key_head_dim"] != config["linear_value_head_dim"]:
        log.warning("linear_key_head_dim %s != linear_value_head_dim %s: llama.cpp's %s loader assumes them "
                    "equal (infer reads the file)", config["linear_key_head_dim"], config["linear_value_head_dim"], p)


#: Family-specific metadata beyond the shared hyperparameters, by GGUF architecture.
_EXTRAS: dict[str, Callable[[dict[str, Any], dict[str, Any], dict[str, Any] | None], None]] = {
    "gemma3": _gemma3_metadata, "gpt-oss": _gpt_oss_metadata, "gemma4": _gemma4_metadata,
    "qwen35": _delta_net_metadata, "qwen35moe": _delta_net_metadata, "qwen3next": _delta_net_metadata}


# -- writing -----------------------------------------------------------------------------------


@dataclass
class _Planned:
    hf: str | None  # None: a tensor made here (rope_freqs)
    gguf: str
    shape: tuple[int, ...]  # canonical (Hugging Face) shape
    qtype: str
    heads: int | None  # permute the rows for this many heads
    offset: float  # added to the values (gemma3 norms)
    make: Callable[[], np.ndarray] | None = None  # the values, made in llama.cpp's layout (gguf_ssm)
    sources: tuple[str, ...] = ()  # the Hugging Face tensors ``make`` reads (released after)
    #: llama.cpp's part of the Hugging Face tensor (gpt-oss's experts split and transposed).
    pick: Callable[[np.ndarray], np.ndarray] | None = None


_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _gpt_oss_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Callable]] | None:
    """How convert_hf_to_gguf.py's GptOssModel writes gpt-oss's stacked experts (its default,
    unfused layout): ``gate_up_proj`` ``[experts, in, 2I]`` (gate and up interleaved) as
    ``ffn_gate_exps`` and ``ffn_up_exps`` ``[experts, I, in]``, ``down_proj`` transposed to
    ``ffn_down_exps`` ``[experts, hidden, I]``, the interleaved bias split likewise; None for
    any other tensor. Each entry: (GGUF name, shape, the part of the Hugging Face array)."""
    m = _GPT_OSS_EXPERTS.fullmatch(name)
    if m is None:
        return None
    blk = f"blk.{m[1]}"
    if m[2] == "down_proj":
        if m[3]:
            return [(f"{blk}.ffn_down_exps.bias", shape, lambda v: v)]
        return [(f"{blk}.ffn_down_exps.weight", (shape[0], shape[2], shape[1]), lambda v: v.transpose(0, 2, 1))]
    if m[3]:
        half = (shape[0], shape[1] // 2)
        return [(f"{blk}.ffn_gate_exps.bias", half, lambda v: v[:, 0::2]),
                (f"{blk}.ffn_up_exps.bias", half, lambda v: v[:, 1::2])]
    half = (shape[0], shape[2] // 2, shape[1])
    return [(f"{blk}.ffn_gate_exps.weight", half, lambda v: v.transpose(0, 2, 1)[:, 0::2]),
            (f"{blk}.ffn_up_exps.weight", half, lambda v: v.transpose(0, 2, 1)[:, 1::2])]


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: a vision-language config.json's ``text_config`` (Qwen3.5), with
    ``tie_word_embeddings`` from the top, where transformers reads it; else ``config``."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    return {**nested, "tie_word_embeddings": config.get("tie_word_embeddings", False),
            "model_type": nested.get("model_type") or config["model_type"]}


def _text_name(name: str) -> str:
    return "model." + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name


def _plan(package: ModelPackage, arch: ArchitectureMap, out: OutputType, freqs: np.ndarray | None,
          config: dict[str, Any] | None = None) -> list[_Planned]:
    config, src = config or package.config, package.tensors
    layers = config["num_hidden_layers"]
    tied = bool(config.get("tie_word_embeddings", False))
    plan = []
    handled: set[str] = set()
    if arch.fix_entries is not None:  # the DeltaNet families' own layouts
        from .gguf_delta_net import plan as delta_net_plan

        for w in delta_net_plan(package, arch, config, _text_name):
            handled.update(w.sources)
            qtype = tensor_type(w.gguf, w.shape[-1], len(w.shape), out, layers, tied)
            plan.append(_Planned(w.sources[0], w.gguf, w.shape, qtype, None, 0.0, w.make, w.sources))
    for name in src.names():
        if (tied and name == "lm_head.weight") or name in handled:
            continue
        if _NOT_TEXT.fullmatch(name) and arch.fix_entries is not None:
            log.info("not written: %s (not part of the text model llama.cpp's %s reads)", name, arch.gguf_name)
            continue
        layer = _LAYER.fullmatch(_text_name(name))
        if layer is not None and int(layer[1]) >= layers and arch.fix_entries is not None:
            # MTP modules (model.layers.{num_hidden_layers + N}): llama.cpp's Qwen3-Next converter skips them
            log.info("not written: %s (a multi-token prediction module)", name)
            continue
        parts = _gpt_oss_parts(name, tuple(src.shape(name))) if arch.gguf_name == "gpt-oss" else None
        if parts is not None:
            mxfp4 = src.storage_dtype(name) == "mxfp4"  # the released checkpoints' experts
            for gguf_name, shape, pick in parts:
                qtype = tensor_type(gguf_name, shape[-1], len(shape), out, layers, tied)
                if mxfp4 and gguf_name.endswith(".weight") and shape[-1] % 32 == 0:
                    qtype = "MXFP4"  # kept, as convert_hf_to_gguf.py repacks them: the values are exact
                plan.append(_Planned(name, gguf_name, shape, qtype, None, 0.0, pick=pick))
            continue
        gguf_name = gguf_tensor_name(arch, _text_name(name))
        if gguf_name is None:
            continue
        shape = tuple(src.shape(name))
        heads = None
        if arch.permute_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name):
            heads = config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
            heads = heads or config["num_attention_heads"]
        plain = re.sub(r"^blk\.\d+\.|\.weight$", "", gguf_name) in arch.plain_norms
        offset = arch.norm_offset if re.search(r"norm\.weight$", gguf_name) and not plain else 0.0
        qtype = tensor_type(gguf_name, shape[-1], len(shape), out, layers, tied)
        plan.append(_Planned(name, gguf_name, shape, qtype, heads, offset))
    if "token_embd.weight" not in {p.gguf for p in plan}:
        raise FormatError(f"{package.path}: no model.embed_tokens.weight; not a complete model")
    if freqs is not None:
        plan.append(_Planned(None, "rope_freqs.weight", freqs.shape, "F32", None, 0.0))
    return plan


#: Tensors of the Mamba-2 families llama.cpp keeps in float32 whatever the file type.
_SSM_F32 = re.compile(r"blk\.\d+\.(ssm_a|ssm_d|ssm_conv1d\.weight|ssm_norm\.weight|ffn_gate_inp\.weight)")


def _ssm_plan(package: ModelPackage, arch: ArchitectureMap, out: OutputType) -> list[_Planned]:
    """The plan of a Mamba-2 family's file: :func:`gguf_ssm.tensors` with their types."""
    config = package.config
    layers, tied = config["num_hidden_layers"], bool(config.get("tie_word_embeddings", False))
    plan = []
    for gguf_name, shape, sources, make in gguf_ssm.tensors(arch, package):
        qtype = "F32" if _SSM_F32.fullmatch(gguf_name) else tensor_type(gguf_name, shape[-1], len(shape), out,
                                                                        layers, tied)
        plan.append(_Planned(sources[0], gguf_name, shape, qtype, None, 0.0, make=make, sources=sources))
    if "token_embd.weight" not in {p.gguf for p in plan}:
        raise FormatError(f"{package.path}: no token embedding; not a complete model")
    return plan


def _values(package: ModelPackage, p: _Planned, freqs: np.ndarray | None) -> np.ndarray:
    """The tensor's values in llama.cpp's layout, as a float array [rows, cols] or [n]."""
    if p.make is not None:
        return p.make()
    if p.hf is None:
        return freqs  # type: ignore[return-value]
    value = package.tensors.get(p.hf)
    if isinstance(value, QuantizedTensor):
        value = value.dequantize()
    value = np.asarray(value)
    if p.pick is not None:
        value = np.ascontiguousarray(p.pick(value))
    if p.heads:
        value = value[_permute_rows(value.shape[0], p.heads)]
    if p.offset:
        value = value.astype(np.float32) + np.float32(p.offset)
    return value


def write_gguf(package: ModelPackage, path: Path, *, type: str = "f16", progress: bool | None = None) -> None:
    """Write ``package`` to the GGUF file ``path`` with tensors stored as ``type``
    (a key of :data:`TYPES`). ``progress``: a tqdm bar on stderr (None: only on a terminal).

    The caller owns ``path`` (see :func:`infer.convert`, which writes to a temporary
    name and renames it into place once this returns).

    Raises:
        UnsupportedArchitectureError: the package's model type has no GGUF architecture.
        ConfigError, FormatError, TokenizerError: a field, tensor or tokenizer with no
            GGUF form (the message names it).
    """
    from tqdm.auto import tqdm

    try:
        import gguf
    except ImportError as exc:
        raise MissingDependencyError("writing GGUF files needs the gguf package: "
                                     "pip install 'infer-engine[convert]'") from exc
    out = TYPES[type]
    arch = architecture_for(package.model_type)
    config = text_config(package.config)
    ssm = arch.build is not None  # the Mamba-2 families (gguf_ssm)
    md, freqs = (gguf_ssm.metadata(arch, config, package.read_config), None) if ssm else hyperparameters(arch, config)
    vocab = int(config.get("vocab_size") or package.tensors.shape("model.embed_tokens.weight")[0])
    md.update(tokenizer_metadata(package, vocab, arch.gguf_name))
    plan = _ssm_plan(package, arch, out) if ssm else _plan(package, arch, out, freqs, config)

    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    name = config.get("_name_or_path") or config.get("_model_name_or_path")
    writer.add_name(str(name or (package.path.name if package.path else "model")))
    writer.add_file_type(out.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in md.items():
        _add(writer, key, value)
    for p in plan:
        t = TYPES_BY_NAME[p.qtype]
        rows = int(np.prod(p.shape[:-1])) if len(p.shape) > 1 else 1
        nbytes = rows * t.row_bytes(p.shape[-1])
        if p.qtype in ("F32", "F16"):
            writer.add_tensor_info(p.gguf, p.shape, np.dtype(np.float32 if p.qtype == "F32" else np.float16), nbytes)
        else:
            writer.add_tensor_info(p.gguf, (*p.shape[:-1], t.row_bytes(p.shape[-1])), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[p.qtype])
    total = sum(int(np.prod(p.shape)) for p in plan)
    last = {p.hf: p for p in plan}  # a tensor split in parts is released after its last
    bar = tqdm(total=total, unit="value", unit_scale=True, desc=f"{path.name} ({type})", leave=False,
               disable=None if progress is None else not progress)
    try:
        with bar:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for p in plan:
                value = _values(package, p, freqs)
                if p.qtype in ("F32", "F16") and value.ndim == 1:
                    data = value.astype("<f4" if p.qtype == "F32" else "<f2")
                    bar.update(value.size)
                else:
                    matrix = value.reshape(-1, p.shape[-1])
                    data = quantize_rows(matrix, p.qtype, name=f"tensor {p.hf!r}", advance=bar.update)
                    if p.qtype in ("F32", "F16"):
                        data = data.view("<f4" if p.qtype == "F32" else "<f2").reshape(p.shape)
                writer.write_tensor_data(data)
                if p.sources:  # made from several Hugging Face tensors (gguf_ssm)
                    for source in p.sources:
                        package.tensors.release(source)
                elif p.hf is not None and last.get(p.hf) is p:  # the last part written of its tensor
                    package.tensors.release(p.hf)
    finally:
        writer.close()


def _add(writer: Any, key: str, value: Any) -> None:
    """One metadata entry, typed as llama.cpp's converter types it."""
    import gguf

    V = gguf.GGUFValueType
    if isinstance(value, (bool, np.bool_)):
        writer.add_bool(key, bool(value))
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, np.ndarray) and value.dtype == bool:
        writer.add_array(key, [bool(v) for v in value])
    elif isinstance(value, np.ndarray) and value.dtype == np.float32:
        writer.add_key_value(key, value.tolist(), V.ARRAY, sub_type=V.FLOAT32)
    elif isinstance(value, np.ndarray):
        writer.add_key_value(key, [int(v) for v in value], V.ARRAY, sub_type=V.INT32)
    elif len(value):
        writer.add_array(key, list(value))
