"""What each GGUF architecture means in Hugging Face terms.

One :class:`ArchitectureMap` per ``general.architecture``: which
``{arch}.*`` metadata keys become which ``config.json`` fields, which
per-block tensor names (``blk.N.<name>``) become which module of
``model.layers.N``, and the layout fixes llama.cpp's converter applied. The
values are those transformers' own GGUF loader produces (checked by the tests
against the real SmolLM2 and Gemma 3 files), except where noted. To support
another architecture, add a row to :data:`ARCHITECTURES`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.errors import ConfigError, UnsupportedArchitectureError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .gguf_file import GGUFFile


@dataclass(frozen=True)
class Hparam:
    """Metadata key ``{arch}.<key>`` -> ``config.json`` field ``name``."""

    key: str
    name: str
    kind: type  # int or float
    required: bool = False
    zero_ok: bool = False  # 0 is a meaningful value (a count of optional blocks)


@dataclass(frozen=True)
class ArchitectureMap:
    """How one GGUF architecture maps to a Hugging Face ``model_type``."""

    gguf_name: str
    model_type: str
    hparams: tuple[Hparam, ...]
    #: ``blk.N.<gguf>.weight`` -> ``model.layers.N.<hf>.weight`` (and ``.bias``).
    layer_tensors: dict[str, str]
    #: config fields GGUF does not store, at their Hugging Face values.
    defaults: dict[str, Any] = field(default_factory=dict)
    #: llama.cpp permuted the Q/K rows (its ``LlamaModel.permute``): undo it.
    permute_qk: bool = False
    #: llama.cpp stored every ``*norm.weight`` plus this; subtract it back.
    norm_offset: float = 0.0
    #: rope_theta when ``rope.freq_base`` is absent (the model family's default).
    default_rope_theta: float = 10000.0
    #: file tensors that are consumed here (into the config), not exposed.
    ignored_tensors: frozenset[str] = frozenset()
    #: architecture-specific completion of the config (it may set another ``model_type``).
    finish: Callable[[dict[str, Any], GGUFFile, ArchitectureMap], None] | None = None
    #: ``blk.N.<gguf>.weight`` holding every expert stacked (``[experts, rows, cols]``) ->
    #: the Hugging Face module of expert ``{e}`` in ``model.layers.N``.
    expert_tensors: dict[str, str] = field(default_factory=dict)
    #: Global tensors (``token_embd``...) -> Hugging Face names; None: :data:`GLOBAL_TENSORS`.
    global_tensors: dict[str, str] | None = None
    #: The Hugging Face prefix of block ``N`` is ``{layer_prefix}.N``.
    layer_prefix: str = "model.layers"
    #: Block tensors whose Hugging Face layout is the transpose of llama.cpp's (GPT-2's
    #: Conv1D weights, ``[in, out]``; llama.cpp's converter transposed them to ``[out, in]``).
    transposed: frozenset[str] = frozenset()
    #: further Hugging Face model_types llama.cpp's converter writes as this architecture.
    also_from: tuple[str, ...] = ()
    #: Block tensors llama.cpp stores with the unit axis 1 of the Hugging Face layout squeezed
    #: out (LFM2's depthwise conv weights: ``[C, 1, K]`` stored ``[C, K]``); read back 3-D.
    unsqueezed: frozenset[str] = frozenset()
    #: the whole config, for rows the generic hparams do not fit (:mod:`.gguf_ssm`).
    build: Callable[[GGUFFile, ArchitectureMap], dict[str, Any]] | None = None
    #: (file, config, row) -> {Hugging Face name: (shape, GGUF tensors, function of their float32
    #: values)}: tensors llama.cpp reshaped, split or transformed (:mod:`.gguf_ssm`).
    rebuilt: Callable[[GGUFFile, dict[str, Any], ArchitectureMap], dict[str, Any]] | None = None
    #: block kinds whose ``norm.weight`` is stored as is although :attr:`norm_offset` is set.
    plain_norms: frozenset[str] = frozenset()
    #: rearranges the reader's entries after they are made (joined, reordered tensors):
    #: ``fix_entries(entries, file, arch, config)``, see :mod:`infer.formats.gguf_delta_net`.
    fix_entries: Callable[..., None] | None = None


GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: Multi-token prediction (llama.cpp's NextN): ``{arch}.nextn_predict_layers`` trailing blocks
#: of ``block_count`` are MTP modules; their extra tensors ``blk.N.nextn.<name>.weight`` become
#: ``model.layers.N.<hf>.weight``, DeepSeek-V3's naming (docs/mtp.md); the rest of such a block
#: maps like any block.
NEXTN_TENSORS = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "embed_tokens": "embed_tokens",
                 "shared_head_head": "shared_head.head", "shared_head_norm": "shared_head.norm"}

_COMMON = (
    Hparam("embedding_length", "hidden_size", int, True),
    Hparam("feed_forward_length", "intermediate_size", int, True),
    Hparam("block_count", "num_hidden_layers", int, True),
    Hparam("attention.head_count", "num_attention_heads", int, True),
    Hparam("attention.head_count_kv", "num_key_value_heads", int),
    Hparam("attention.key_length", "head_dim", int),
    Hparam("context_length", "max_position_embeddings", int),
    Hparam("attention.layer_norm_rms_epsilon", "rms_norm_eps", float),
    Hparam("vocab_size", "vocab_size", int),
    Hparam("rope.freq_base", "rope_theta", float),
    Hparam("attention.sliding_window", "sliding_window", int),
)

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_LAYER = {"attn_norm": "input_layernorm", **_ATTENTION, "ffn_norm": "post_attention_layernorm", **_MLP}
_GEMMA3_LAYER = {
    "attn_norm": "input_layernorm", **_ATTENTION,
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", **_MLP,
}


def _finish_llama(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Llama 3.1+ files carry their rope scaling only as a ``rope_freqs`` tensor of
    per-frequency divisors (transformers' loader ignores it), which llama.cpp applies as
    stored. Where they follow Llama 3's rule (factor, low/high frequency factors 1 and 4,
    8192 original positions: every Llama 3.x release, unless
    ``rope.scaling.original_context_length`` says otherwise, as infer's own converter
    writes for other models) the config says ``rope_type: llama3``, as the model's own
    config.json does; any other divisors (llama.cpp's converter on a model trained with
    other original positions or frequency factors, which it does not record) are used
    as stored, as ``freq_factors`` (:mod:`architectures.rope`)."""
    info = file.tensors.get("rope_freqs.weight")
    if info is None:
        return
    where = f"{file.path}: tensor 'rope_freqs.weight'"
    if info.type.name != "F32" or len(info.dims) != 1:
        raise ConfigError(f"{where}: expected a 1-D F32 tensor, found {info.type.name} {list(info.dims)}")
    stored = file.raw(info).view("<f4").reshape(-1)
    factors = stored.astype(np.float64)
    dim = len(factors) * 2
    if dim != config["head_dim"] or not (np.all(np.isfinite(factors)) and np.all(factors > 0)):
        raise ConfigError(f"{where}: expected head_dim / 2 = {config['head_dim'] // 2} positive finite factors, "
                          f"found {len(factors)}: {stored.tolist()}")
    theta = config["rope_parameters"]["rope_theta"]
    original = _number(file.metadata, f"{arch.gguf_name}.rope.scaling.original_context_length", int, file) or 8192
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors[-1]), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    if not np.allclose(_llama3_divisors(rope, dim), factors, rtol=1e-5, atol=0):
        log.info("%s: rope factors follow no Llama 3 rule infer can name; used as stored", where)
        rope = {**config["rope_parameters"], "freq_factors": stored.tolist()}
    config["rope_parameters"] = rope


def _llama3_divisors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """What llama.cpp's converter stores: the divisor of each rope frequency under Llama 3
    scaling (1 for high frequencies, ``factor`` for low ones, interpolated between)."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * math.pi / freqs
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _finish_gemma3(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Sliding/global layer pattern, the two rope bases and the attention scale.

    llama.cpp hard-codes (src/llama-model.cpp, LLM_ARCH_GEMMA3) what these files do not
    store: every 6th layer is global, local layers use rope base 10 000, and the query
    scale is 1/sqrt(head_dim) except for the 62-layer 27B, whose original config has
    query_pre_attn_scalar = hidden_size / heads (168, not head_dim 128). transformers'
    loader leaves query_pre_attn_scalar at its default 256, equal to head_dim for every
    Gemma 3 but the 27B; here the llama.cpp rule is followed, right for all sizes.
    """
    md, n = file.metadata, config["num_hidden_layers"]
    key = f"{arch.gguf_name}.attention.sliding_window_pattern"
    pattern = md.get(key, 6)
    if isinstance(pattern, np.ndarray) and pattern.dtype == bool and pattern.shape == (n,):
        sliding = [bool(s) for s in pattern]  # per layer: true = sliding window
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
        config["sliding_window_pattern"] = pattern
    else:
        raise ConfigError(f"{file.path}: {key} must be a positive integer or {n} booleans, found {pattern!r}")
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    local = _number(md, f"{arch.gguf_name}.rope.freq_base_swa", float, file) or 10000.0
    config["rope_local_base_freq"] = local
    config["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    scale = _number(md, f"{arch.gguf_name}.attention.scale", float, file)
    if scale:
        # Stored as float32 1/sqrt(s): an integer s (every Gemma's) comes back a few ulps off.
        scalar = 1.0 / scale**2
        config["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) <= 1e-6 * scalar else scalar
    elif n == 62:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = config["head_dim"]


_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_QWEN3_LAYER = {**_LLAMA_LAYER, **_QK_NORMS}
_MOE = (
    Hparam("expert_count", "num_experts", int),
    Hparam("expert_used_count", "num_experts_per_tok", int),
    Hparam("expert_feed_forward_length", "moe_intermediate_size", int),
)
_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
            "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}
_OLMO2_LAYER = {**_ATTENTION, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm", **_MLP}
_PHI3_LAYER = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
_GPT2_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_HPARAMS = (
    Hparam("embedding_length", "hidden_size", int, True),
    Hparam("feed_forward_length", "n_inner", int),
    Hparam("block_count", "num_hidden_layers", int, True),
    Hparam("attention.head_count", "num_attention_heads", int, True),
    Hparam("context_length", "max_position_embeddings", int),
    Hparam("attention.layer_norm_epsilon", "layer_norm_epsilon", float),
    Hparam("vocab_size", "vocab_size", int),
)
_GRANITE_HPARAMS = (
    Hparam("embedding_scale", "embedding_multiplier", float),
    Hparam("residual_scale", "residual_multiplier", float),
    Hparam("attention.scale", "attention_multiplier", float),
    Hparam("logit_scale", "logits_scaling", float),
)


def _sparse_layers(config: dict[str, Any], file: GGUFFile) -> list[int]:
    """The blocks that hold a router (``ffn_gate_inp``), i.e. are mixtures of experts."""
    return [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" in file.tensors]


def _finish_mixtral(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """llama.cpp writes Mixtral as ``llama`` with expert tensors: then it is ``mixtral``
    (every layer sparse, softmax over the top-k router logits)."""
    _finish_llama(config, file, arch)
    if config.get("num_experts"):
        config["model_type"] = "mixtral"
        config["num_local_experts"] = config.pop("num_experts")
        config.pop("moe_intermediate_size", None)  # Mixtral's experts are intermediate_size wide
        if len(_sparse_layers(config, file)) != config["num_hidden_layers"]:
            raise ConfigError(f"{file.path}: llama.expert_count is set but not every block has a router "
                              f"(ffn_gate_inp); Mixtral files have one in every block")


def _finish_qwen3moe(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Dense blocks (no router) become ``mlp_only_layers``; the top-k weights are
    renormalised (Qwen3-MoE's released setting, llama.cpp's too) unless the file says."""
    sparse = set(_sparse_layers(config, file))
    config["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"]) if i not in sparse]
    norm = file.metadata.get(f"{arch.gguf_name}.expert_weights_norm", True)
    config["norm_topk_prob"] = bool(norm)


def _finish_smollm3(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """llama.cpp hard-codes SmolLM3's NoPE pattern (no rope in every 4th layer; its
    ``n_no_rope_layer_step``), as the released config does; the files do not store it."""
    config["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(config["num_hidden_layers"])]


def _finish_phi3(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """LongRoPE is stored as two tensors of per-frequency factors, ``rope_factors_long``
    and ``rope_factors_short``, beside ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor``."""
    long, short = file.tensors.get("rope_factors_long.weight"), file.tensors.get("rope_factors_short.weight")
    if long is None and short is None:
        return
    rope, md, p = config["rope_parameters"], file.metadata, f"{arch.gguf_name}.rope.scaling"
    factors = {}
    for key, info in (("long_factor", long), ("short_factor", short)):
        if info is None or info.type.name != "F32" or len(info.dims) != 1:
            raise ConfigError(f"{file.path}: LongRoPE needs rope_factors_long and rope_factors_short as 1-D F32 "
                              f"tensors; found {info.name if info else 'none'} for {key}")
        factors[key] = [float(v) for v in file.raw(info).view("<f4").reshape(-1)]
    original = _number(md, f"{p}.original_context_length", int, file)
    if not original:
        raise ConfigError(f"{file.path}: LongRoPE factors without {p}.original_context_length")
    rope.update(rope_type="longrope", original_max_position_embeddings=original, **factors)
    attn = _number(md, f"{p}.attn_factor", float, file)
    if attn:
        rope["attention_factor"] = attn
    config["original_max_position_embeddings"] = original


_DEEPSEEK2_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    **_MLP, "ffn_gate_inp": "mlp.gate", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_DEEPSEEK2_HPARAMS = (
    Hparam("attention.q_lora_rank", "q_lora_rank", int),
    Hparam("attention.kv_lora_rank", "kv_lora_rank", int, True),
    Hparam("rope.dimension_count", "qk_rope_head_dim", int, True),
    Hparam("leading_dense_block_count", "first_k_dense_replace", int, zero_ok=True),
    Hparam("expert_feed_forward_length", "moe_intermediate_size", int),
    Hparam("expert_count", "n_routed_experts", int),
    Hparam("expert_shared_count", "n_shared_experts", int, zero_ok=True),
    Hparam("expert_used_count", "num_experts_per_tok", int),
    Hparam("expert_weights_scale", "routed_scaling_factor", float),
    Hparam("expert_group_count", "n_group", int),
    Hparam("expert_group_used_count", "topk_group", int),
)


def _finish_deepseek2(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """DeepSeek-V3 (and Kimi K2) files: llama.cpp calls them ``deepseek2``.

    Head widths: ``attention.key_length_mla`` / ``value_length_mla`` where llama.cpp
    stores the absorbed-MLA layout (there ``key_length`` is ``kv_lora_rank + rope``),
    else ``key_length`` / ``value_length``. Only sigmoid routing
    (``expert_gating_func`` 2, DeepSeek-V3's) is supported: DeepSeek-V2's softmax
    routing is another architecture. The yarn softmax correction: llama.cpp stores
    ``0.1 * mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``; ``mscale`` is not
    stored and is taken equal to it (1.0 and 1.0 in the released V3 and R1)."""
    md, p, path = file.metadata, arch.gguf_name, file.path
    gating = md.get(f"{p}.expert_gating_func")
    if config.get("n_routed_experts") and gating != 2:
        raise ConfigError(f"{path}: {p}.expert_gating_func is {gating!r}; only 2 (sigmoid, DeepSeek-V3) is "
                          f"supported, DeepSeek-V2's softmax routing (1, or absent) is not")
    rope_dim = config["qk_rope_head_dim"]
    key = _number(md, f"{p}.attention.key_length_mla", int, file) or _number(md, f"{p}.attention.key_length", int, file)
    value = (_number(md, f"{p}.attention.value_length_mla", int, file)
             or _number(md, f"{p}.attention.value_length", int, file))
    if not key or not value or key <= rope_dim:
        raise ConfigError(f"{path}: {p}.attention.key_length(_mla) and value_length(_mla) must give the head widths "
                          f"(key {key}, value {value}, rope part {rope_dim})")
    config.update(model_type="deepseek_v3", qk_nope_head_dim=key - rope_dim, v_head_dim=value, rope_interleave=True,
                  scoring_func="sigmoid", topk_method="noaux_tc",
                  norm_topk_prob=bool(md.get(f"{p}.expert_weights_norm", False)))
    config.pop("head_dim", None)
    rope = config["rope_parameters"]
    rope.pop("partial_rotary_factor", None)
    log_mul = _number(md, f"{p}.rope.scaling.yarn_log_multiplier", float, file)
    if rope["rope_type"] == "yarn" and log_mul:
        rope.update(mscale_all_dim=log_mul / 0.1, mscale=log_mul / 0.1)


def _finish_gpt2(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """GPT-2's config names; no rope."""
    for ours, theirs in (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                         ("num_attention_heads", "n_head"), ("max_position_embeddings", "n_positions")):
        if ours in config:
            config[theirs] = config.pop(ours)
    for key in ("num_key_value_heads", "head_dim", "rope_parameters"):
        config.pop(key, None)


_LFM2_LAYER = {
    "attn_norm": "operator_norm", **_ATTENTION, "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
_LFM2_HPARAMS = (
    Hparam("embedding_length", "hidden_size", int, True),
    Hparam("feed_forward_length", "intermediate_size", int, True),  # the width after Liquid's rule
    Hparam("block_count", "num_hidden_layers", int, True),
    Hparam("attention.head_count", "num_attention_heads", int, True),
    Hparam("context_length", "max_position_embeddings", int),
    Hparam("attention.layer_norm_rms_epsilon", "norm_eps", float),
    Hparam("vocab_size", "vocab_size", int),
    Hparam("rope.freq_base", "rope_theta", float),
    Hparam("shortconv.l_cache", "conv_L_cache", int),
)


def _finish_lfm2(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Which LFM2 blocks are short convolutions: llama.cpp's converter writes
    ``attention.head_count_kv`` per block, 0 for a conv block (what llama.cpp tests
    to tell a recurrent block); a single number means every block attends. The
    file stores the feed-forward width after Liquid's rule (so no adjusting here),
    and biases on the conv blocks where ``conv_bias`` was set."""
    n, key = config["num_hidden_layers"], f"{arch.gguf_name}.attention.head_count_kv"
    kv = file.metadata.get(key, config["num_attention_heads"])
    if isinstance(kv, np.ndarray) and kv.ndim == 1 and kv.shape[0] == n and kv.dtype.kind in "iu":
        per_block = [int(v) for v in kv]
    elif isinstance(kv, int) and not isinstance(kv, bool):
        per_block = [kv] * n
    else:
        raise ConfigError(f"{file.path}: metadata {key} must be a count or {n} counts (0 for a conv block), "
                          f"found {kv!r}")
    attending = sorted({v for v in per_block if v})
    if len(attending) > 1 or any(v < 0 for v in per_block):
        raise ConfigError(f"{file.path}: metadata {key} gives the attention blocks {attending} key/value heads; "
                          f"LFM2 has one count for all of them (0 for conv blocks)")
    config["num_key_value_heads"] = attending[0] if attending else config["num_attention_heads"]
    config["layer_types"] = ["full_attention" if v else "conv" for v in per_block]
    config["conv_bias"] = any(f"blk.{i}.shortconv.in_proj.bias" in file.tensors for i in range(n))
_GPT_OSS_LAYER = {
    "attn_norm": "input_layernorm", **_ATTENTION, "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias", "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
#: gpt-oss's experts as llama.cpp stores them: gate and up split (not interleaved), every
#: matrix ``[out, in]``; one expert's rows of each stay its own blocks (MXFP4 in the released files).
_GPT_OSS_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                    "ffn_down_exps": "mlp.experts.{e}.down_proj"}


def _finish_gpt_oss(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """gpt-oss (llama.cpp's ``gpt-oss``, LLM_ARCH_OPENAI_MOE).

    llama.cpp hard-codes what the files do not store: even layers slide and odd ones see
    everything (its ``set_swa_pattern(2)``, transformers' default ``layer_types``), the
    clamped SwiGLU's alpha 1.702 and limit 7 (``arch.defaults``), YaRN's ramp from
    ``beta_fast`` 32 to ``beta_slow`` 1 unless ``rope.scaling.yarn_beta_*`` say otherwise.
    ``truncate`` is false, as transformers' ``GptOssConfig``. The q/k/v/o biases are read
    from the file (gpt-oss's default is to have them). A fused ``ffn_gate_up_exps``
    (``--fuse-gate-up-exps``) is refused by name, as an unknown tensor."""
    md, p, n = file.metadata, arch.gguf_name, config["num_hidden_layers"]
    if "num_experts" in config:
        config["num_local_experts"] = config.pop("num_experts")
    if "moe_intermediate_size" in config:  # expert_feed_forward_length: the experts' width
        config["intermediate_size"] = config.pop("moe_intermediate_size")
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    key = f"{p}.attention.sliding_window_pattern"
    pattern = md.get(key)
    if pattern is None:
        sliding = [i % 2 == 0 for i in range(n)]
    elif isinstance(pattern, np.ndarray) and pattern.dtype == bool and pattern.shape == (n,):
        sliding = [bool(s) for s in pattern]
    else:
        raise ConfigError(f"{file.path}: {key} must be {n} booleans, found {pattern!r}")
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    rope = config["rope_parameters"]
    if rope["rope_type"] == "yarn":
        rope["beta_fast"] = _number(md, f"{p}.rope.scaling.yarn_beta_fast", float, file) or 32.0
        rope["beta_slow"] = _number(md, f"{p}.rope.scaling.yarn_beta_slow", float, file) or 1.0
        rope["truncate"] = False
    elif rope["rope_type"] != "default":
        raise ConfigError(f"{file.path}: gpt-oss with rope scaling {rope['rope_type']!r} is not supported; "
                          f"supported: yarn, none")


_GEMMA4_LAYER = {
    "attn_norm": "input_layernorm", **_ATTENTION, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm", **_MLP,
    "layer_output_scale.weight": "layer_scalar", "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1", "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
}
_GEMMA4_GLOBALS = {**GLOBAL_TENSORS, "per_layer_token_embd": "model.embed_tokens_per_layer",
                   "per_layer_model_proj": "model.per_layer_model_projection",
                   "per_layer_proj_norm": "model.per_layer_projection_norm"}
_GEMMA4_HPARAMS = (
    Hparam("embedding_length", "hidden_size", int, True),
    Hparam("block_count", "num_hidden_layers", int, True),
    Hparam("attention.head_count", "num_attention_heads", int, True),
    Hparam("attention.key_length", "global_head_dim", int, True),
    Hparam("attention.key_length_swa", "head_dim", int, True),
    Hparam("context_length", "max_position_embeddings", int),
    Hparam("attention.layer_norm_rms_epsilon", "rms_norm_eps", float),
    Hparam("vocab_size", "vocab_size", int),
    Hparam("rope.freq_base", "rope_theta", float),
    Hparam("attention.sliding_window", "sliding_window", int, True),
    Hparam("attention.shared_kv_layers", "num_kv_shared_layers", int, zero_ok=True),
    Hparam("embedding_length_per_layer_input", "hidden_size_per_layer_input", int, zero_ok=True),
    Hparam("final_logit_softcapping", "final_logit_softcapping", float),
    Hparam("expert_count", "num_experts", int),
    Hparam("expert_used_count", "top_k_experts", int),
    Hparam("expert_feed_forward_length", "moe_intermediate_size", int),
)


def _per_layer(md: dict[str, Any], key: str, n: int, file: GGUFFile) -> list[int] | None:
    """An integer key given once or per layer, as ``n`` values (None if absent)."""
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu" and value.shape == (n,):
        return [int(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return [value] * n
    raise ConfigError(f"{file.path}: metadata {key} must be a positive integer or {n} integers, found {value!r}")


def _finish_gemma4(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Gemma 4's text model (llama.cpp's ``gemma4``: src/models/gemma4.cpp; the converter's
    ``Gemma4Model``). Per layer: ``attention.sliding_window_pattern`` (booleans) gives
    ``layer_types``; ``attention.head_count_kv`` the key/value heads (sliding layers'
    ``num_key_value_heads``, full layers' ``num_global_key_value_heads``, which transformers
    reads only with ``attention_k_eq_v``: full layers without ``attn_v``, whose values are
    the keys, as llama.cpp's optional ``wv``); ``feed_forward_length`` the MLP widths
    (doubled on the shared-KV layers: ``use_double_wide_mlp``). Rope: full layers'
    proportional rope is ``rope_freqs`` factors, 1 for the rotated pairs and 1e30 for the
    rest (``partial_rotary_factor`` = 2 x ones / ``global_head_dim``); sliding layers'
    ``rope.freq_base_swa`` (10 000) over ``rope.dimension_count_swa`` dimensions. Refused:
    rope scaling keys (the proportional rope's ``factor`` has no stored form that was
    verified), and key/value head counts no Hugging Face config can state."""
    md, p, n, path = file.metadata, arch.gguf_name, config["num_hidden_layers"], file.path
    pattern = md.get(f"{p}.attention.sliding_window_pattern")
    if not (isinstance(pattern, np.ndarray) and pattern.dtype == bool and pattern.shape == (n,)):
        raise ConfigError(f"{path}: {p}.attention.sliding_window_pattern must be {n} booleans, found {pattern!r}")
    sliding = [bool(v) for v in pattern]
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    kv = _per_layer(md, f"{p}.attention.head_count_kv", n, file) or [config["num_attention_heads"]] * n
    swa_kv = {kv[i] for i in range(n) if sliding[i]} or {kv[0]}
    full_kv = {kv[i] for i in range(n) if not sliding[i]}
    if len(swa_kv) != 1 or len(full_kv) > 1:
        raise ConfigError(f"{path}: {p}.attention.head_count_kv {kv} varies within a layer kind; Gemma 4 configs "
                          f"give one count for sliding layers and one for full ones")
    config["num_key_value_heads"] = swa_kv.pop()
    shared = config.get("num_kv_shared_layers", 0)
    own = [i for i in range(n - shared) if not sliding[i]]  # full layers with their own projections
    no_v = [f"blk.{i}.attn_v.weight" not in file.tensors for i in own]
    config["attention_k_eq_v"] = bool(own) and all(no_v)
    if any(no_v) and not all(no_v):
        raise ConfigError(f"{path}: some full-attention blocks have attn_v and some do not; Gemma 4 uses keys as "
                          f"values on every full layer or none")
    if full_kv:
        full = full_kv.pop()
        if config["attention_k_eq_v"]:
            config["num_global_key_value_heads"] = full
        elif full != config["num_key_value_heads"]:
            raise ConfigError(f"{path}: full layers have {full} key/value heads and sliding ones "
                              f"{config['num_key_value_heads']}; transformers' Gemma 4 gives full layers their own "
                              f"count only with keys as values (no attn_v)")
    ff = _per_layer(md, f"{p}.feed_forward_length", n, file)
    if ff is None:
        raise ConfigError(f"{path}: metadata {p}.feed_forward_length is missing; it gives intermediate_size")
    config["intermediate_size"] = ff[0]
    if ff != [ff[0]] * n:
        if not shared or ff != [ff[0] if i < n - shared else 2 * ff[0] for i in range(n)]:
            raise ConfigError(f"{path}: {p}.feed_forward_length {ff} is neither one width nor twice it on the "
                              f"{shared} shared-KV layers (use_double_wide_mlp)")
        config["use_double_wide_mlp"] = True
    config.setdefault("use_double_wide_mlp", False)
    config["enable_moe_block"] = bool(config.get("num_experts"))
    config.setdefault("num_kv_shared_layers", 0)
    config.setdefault("hidden_size_per_layer_input", 0)
    embed = file.tensors.get("per_layer_token_embd.weight")
    if config.get("hidden_size_per_layer_input") and embed is not None:
        config["vocab_size_per_layer_input"] = embed.shape[0]
    if md.get(f"{p}.rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"{path}: {p}.rope.scaling.* is set; Gemma 4's proportional rope with a scaling factor has "
                          f"no GGUF form infer has verified")
    full_rope = {"rope_type": "proportional", "rope_theta": config["rope_parameters"]["rope_theta"]}
    info = file.tensors.get("rope_freqs.weight")
    if info is not None:
        if info.type.name != "F32" or len(info.dims) != 1 or 2 * info.shape[0] != config["global_head_dim"]:
            raise ConfigError(f"{path}: rope_freqs.weight must be global_head_dim / 2 F32 values, found "
                              f"{info.type.name} {list(info.shape)}")
        factors = file.raw(info).view("<f4").reshape(-1)
        rotated = int(np.sum(factors == 1.0))
        if not (np.all(factors[:rotated] == 1.0) and np.all(factors[rotated:] >= 1e29)):
            raise ConfigError(f"{path}: rope_freqs.weight must be ones then 1e30 (proportional rope), found {factors}")
        full_rope["partial_rotary_factor"] = 2 * rotated / config["global_head_dim"]
    swa_rope = {"rope_type": "default",
                "rope_theta": _number(md, f"{p}.rope.freq_base_swa", float, file) or 10000.0}
    dims = _number(md, f"{p}.rope.dimension_count_swa", int, file)
    if dims and dims != config["head_dim"]:
        swa_rope["partial_rotary_factor"] = dims / config["head_dim"]
    config["rope_parameters"] = {"full_attention": full_rope, "sliding_attention": swa_rope}
#: Qwen3.5 / Qwen3-Next (llama.cpp ``qwen35``, ``qwen35moe``, ``qwen3next``): gated DeltaNet
#: blocks (``ssm_*``, ``attn_qkv`` = ``in_proj_qkv``, ``attn_gate`` = ``in_proj_z``) between
#: gated full-attention blocks. ``ssm_a`` has no ``.weight`` suffix (the ``"ssm_a."`` key).
_DELTA_NET_LAYER = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", **_ATTENTION, **_QK_NORMS,
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a.": "linear_attn.A_log", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj", **_MLP,
}
_SHARED_EXPERT_MOE = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_QWEN35_LAYER = {**_DELTA_NET_LAYER, "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"}
# Qwen3-Next's in_proj_ba is stored as is; its in_proj_qkvz split into attn_qkv and attn_gate (or,
# in files of llama.cpp's first Qwen3-Next converter, whole as ssm_in).
_QWEN3NEXT_LAYER = {**_DELTA_NET_LAYER, "ssm_ba": "linear_attn.in_proj_ba", "ssm_in": "linear_attn.in_proj_qkvz",
                    **_SHARED_EXPERT_MOE}
_DELTA_NET_HPARAMS = tuple(h for h in _COMMON if h.key != "feed_forward_length") + (
    Hparam("feed_forward_length", "intermediate_size", int),  # absent for Qwen3.5-MoE
    Hparam("ssm.conv_kernel", "linear_conv_kernel_dim", int, True),
    Hparam("ssm.state_size", "linear_key_head_dim", int, True),
    Hparam("ssm.group_count", "linear_num_key_heads", int, True),
    Hparam("ssm.time_step_rank", "linear_num_value_heads", int, True),
    Hparam("ssm.inner_size", "linear_value_dim", int),  # heads x value head width; required, see below
    Hparam("full_attention_interval", "full_attention_interval", int),
)
_DELTA_NET_MOE_HPARAMS = _DELTA_NET_HPARAMS + _MOE + (
    Hparam("expert_shared_feed_forward_length", "shared_expert_intermediate_size", int),)


def _finish_delta_net(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> None:
    """Qwen3.5 / Qwen3-Next: the value head width, the layer kinds, the rope share, the MoE layout.

    llama.cpp (src/models/qwen35.cpp, qwen3next.cpp) marks the DeltaNet layers from the
    boolean array ``attention.recurrent_layers`` where present, else from
    ``full_attention_interval`` (default 4: layer ``i`` is full attention when ``(i + 1) %
    interval == 0``); which tensors each block holds must agree. ``ssm.inner_size`` is
    ``linear_num_value_heads * linear_value_head_dim``. The rotated share of each head is
    ``rope.dimension_count / key_length`` (all of it when absent, as llama.cpp reads it).
    Blocks without a router are dense MLPs (``mlp_only_layers``); llama.cpp always
    renormalises the top-k weights."""
    md, p, path, n = file.metadata, arch.gguf_name, file.path, config["num_hidden_layers"]
    inner, heads = config.pop("linear_value_dim", None), config["linear_num_value_heads"]
    if inner is None:
        raise ConfigError(f"{path}: metadata {p}.ssm.inner_size is missing; it gives the value heads' width")
    if inner % heads or heads % config["linear_num_key_heads"]:
        raise ConfigError(f"{path}: {p}.ssm.inner_size {inner} is not a whole number of value heads per "
                          f"{p}.ssm.time_step_rank {heads} value heads, or those are not a multiple of "
                          f"{p}.ssm.group_count {config['linear_num_key_heads']} key heads")
    config["linear_value_head_dim"] = inner // heads
    recurrent = md.get(f"{p}.attention.recurrent_layers")
    total = n + config.get("num_nextn_predict_layers", 0)  # the array covers the MTP blocks too
    if recurrent is not None:
        if not (isinstance(recurrent, np.ndarray) and recurrent.dtype == bool and recurrent.shape in ((n,), (total,))):
            raise ConfigError(f"{path}: {p}.attention.recurrent_layers must hold {total} booleans, found {recurrent!r}")
        linear = [bool(r) for r in recurrent[:n]]
        where = f"{p}.attention.recurrent_layers"
    else:
        interval = config.get("full_attention_interval", 4)
        config["full_attention_interval"] = interval
        linear = [(i + 1) % interval != 0 for i in range(n)]
        where = f"{p}.full_attention_interval {interval}"
    for i, lin in enumerate(linear):
        if (f"blk.{i}.ssm_a" in file.tensors) != lin:
            raise ConfigError(f"{path}: block {i} is {'full attention' if lin is False else 'a DeltaNet'} by "
                              f"{where} but holds {'ssm_a' if not lin else 'no ssm_a'}; the file's layer kinds "
                              f"disagree")
    config["layer_types"] = ["linear_attention" if lin else "full_attention" for lin in linear]
    if any(f"blk.{i}.attn_q.bias" in file.tensors for i in range(n)):  # block 0 may be a DeltaNet
        config["attention_bias"] = True
    dims = _number(md, f"{p}.rope.dimension_count", int, file) or config["head_dim"]
    config["rope_parameters"]["partial_rotary_factor"] = dims / config["head_dim"]
    if arch.expert_tensors:
        sparse = set(_sparse_layers(config, file))
        if not sparse:
            raise ConfigError(f"{path}: no block of this {p} file has a router (ffn_gate_inp)")
        config["mlp_only_layers"] = [i for i in range(n) if i not in sparse]
        config["decoder_sparse_step"] = 1
        config["norm_topk_prob"] = True
        if arch.model_type == "qwen3_5_moe_text" and config["mlp_only_layers"]:
            raise ConfigError(f"{path}: blocks {config['mlp_only_layers']} have no router; every Qwen3.5-MoE "
                              f"layer is a mixture of experts")


def _fix_delta_net_entries(*args: Any) -> None:
    from .gguf_delta_net import fix_entries

    fix_entries(*args)


_DELTA_NET_ROW = dict(finish=_finish_delta_net, norm_offset=1.0,  # rope base: llama.cpp's 10 000 when absent
                      plain_norms=frozenset({"ssm_norm"}), fix_entries=_fix_delta_net_entries)


ARCHITECTURES: dict[str, ArchitectureMap] = {a.gguf_name: a for a in (
    # Mixtral too: llama with expert tensors (_finish_mixtral).
    ArchitectureMap("llama", "llama", _COMMON + _MOE, {**_LLAMA_LAYER, "ffn_gate_inp": "block_sparse_moe.gate"},
                    {"hidden_act": "silu"}, permute_qk=True, ignored_tensors=frozenset({"rope_freqs.weight"}),
                    finish=_finish_mixtral, expert_tensors=_MIXTRAL_EXPERTS, also_from=("mistral",)),
    # Qwen3, OLMo 2 and Phi-3 are converted without the Q/K permutation (their rope is
    # half-split, llama.cpp's NEOX mode); Granite and SmolLM3 with it (converted as Llama).
    ArchitectureMap("qwen3", "qwen3", _COMMON, _QWEN3_LAYER, {"hidden_act": "silu"}, default_rope_theta=1000000.0),
    ArchitectureMap("qwen3moe", "qwen3_moe", _COMMON + _MOE, {**_QWEN3_LAYER, "ffn_gate_inp": "mlp.gate"},
                    {"hidden_act": "silu"}, default_rope_theta=1000000.0, finish=_finish_qwen3moe,
                    expert_tensors=_EXPERTS),
    ArchitectureMap("olmo2", "olmo2", _COMMON, _OLMO2_LAYER, {"hidden_act": "silu"}, default_rope_theta=500000.0),
    ArchitectureMap("phi3", "phi3", _COMMON, _PHI3_LAYER, {"hidden_act": "silu"}, finish=_finish_phi3,
                    ignored_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
    ArchitectureMap("smollm3", "smollm3", _COMMON, _LLAMA_LAYER, {"hidden_act": "silu"}, permute_qk=True,
                    default_rope_theta=2000000.0, finish=_finish_smollm3),
    ArchitectureMap("granite", "granite", _COMMON + _GRANITE_HPARAMS, _LLAMA_LAYER, {"hidden_act": "silu"},
                    permute_qk=True),
    ArchitectureMap("deepseek2", "deepseek_v3", _COMMON + _DEEPSEEK2_HPARAMS, _DEEPSEEK2_LAYER,
                    {"hidden_act": "silu"}, finish=_finish_deepseek2, expert_tensors=_EXPERTS),
    ArchitectureMap("gpt2", "gpt2", _GPT2_HPARAMS, _GPT2_LAYER, {"activation_function": "gelu_new"},
                    finish=_finish_gpt2, layer_prefix="transformer.h",
                    global_tensors={"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                                    "output_norm": "transformer.ln_f", "output": "lm_head"},
                    transposed=frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})),
    # Qwen2 is converted without the Q/K permutation; q, k and v carry biases.
    ArchitectureMap("qwen2", "qwen2", _COMMON, _LLAMA_LAYER, {"hidden_act": "silu"},
                    default_rope_theta=1000000.0),
    ArchitectureMap("gemma3", "gemma3_text", _COMMON + (
        Hparam("final_logit_softcapping", "final_logit_softcapping", float),
        Hparam("attn_logit_softcapping", "attn_logit_softcapping", float),
    ), _GEMMA3_LAYER, {"hidden_activation": "gelu_pytorch_tanh"}, norm_offset=1.0,
        default_rope_theta=1000000.0, finish=_finish_gemma3),
    # LFM2's final norm is model.embedding_norm: llama.cpp's converter names it token_embd_norm.
    ArchitectureMap("lfm2", "lfm2", _LFM2_HPARAMS, _LFM2_LAYER, {"block_auto_adjust_ff_dim": False},
                    default_rope_theta=1000000.0, finish=_finish_lfm2, unsqueezed=frozenset({"shortconv.conv"}),
                    global_tensors={"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm",
                                    "output_norm": "model.embedding_norm", "output": "lm_head"}),
    ArchitectureMap("gemma4", "gemma4_text", _GEMMA4_HPARAMS, _GEMMA4_LAYER, {"hidden_activation": "gelu_pytorch_tanh"},
                    default_rope_theta=1000000.0, finish=_finish_gemma4, global_tensors=_GEMMA4_GLOBALS,
                    ignored_tensors=frozenset({"rope_freqs.weight"})),
    ArchitectureMap("gpt-oss", "gpt_oss", _COMMON + _MOE, _GPT_OSS_LAYER,
                    {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}, default_rope_theta=150000.0,
                    finish=_finish_gpt_oss, expert_tensors=_GPT_OSS_EXPERTS),
    # Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: every norm but the DeltaNet's gated one stored as 1 + w.
    ArchitectureMap("qwen35", "qwen3_5_text", _DELTA_NET_HPARAMS, _QWEN35_LAYER, {"hidden_act": "silu"},
                    also_from=("qwen3_5",), **_DELTA_NET_ROW),
    ArchitectureMap("qwen35moe", "qwen3_5_moe_text", _DELTA_NET_MOE_HPARAMS, {**_QWEN35_LAYER, **_SHARED_EXPERT_MOE},
                    {"hidden_act": "silu"}, expert_tensors=_EXPERTS, also_from=("qwen3_5_moe",), **_DELTA_NET_ROW),
    ArchitectureMap("qwen3next", "qwen3_next", _DELTA_NET_MOE_HPARAMS, _QWEN3NEXT_LAYER,
                    {"hidden_act": "silu", "norm_topk_prob": True},
                    expert_tensors=_EXPERTS, **_DELTA_NET_ROW),
)}


def _number(md: dict[str, Any], key: str, kind: type, file: GGUFFile) -> Any:
    """The metadata value at ``key`` as ``kind`` (None if absent); a per-layer array whose
    entries are all equal counts as that one value."""
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.size and np.all(value == value[0]):
        value = value[0].item()
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (kind is float and isinstance(value, float))
    if not ok or (kind is float and not math.isfinite(value)):
        what = "an integer" if kind is int else "a finite number"
        raise ConfigError(f"{file.path}: metadata {key} must be {what}, found {value!r}")
    return kind(value)


def _rope(config: dict[str, Any], file: GGUFFile, arch: ArchitectureMap) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5 form) from ``rope.*`` keys."""
    md, p = file.metadata, f"{arch.gguf_name}.rope"
    theta = config.pop("rope_theta", None) or arch.default_rope_theta
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = md.get(f"{p}.scaling.type")
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"{file.path}: metadata {p}.scaling.type must be a string, found {kind!r}")
    if kind not in (None, "none"):
        factor = _number(md, f"{p}.scaling.factor", float, file)
        if kind not in ("linear", "yarn") or not factor:
            raise ConfigError(f"{file.path}: rope scaling {kind!r} (factor {factor}) is not supported; "
                              f"supported: linear, yarn")
        rope.update(rope_type=kind, factor=factor)
        original = _number(md, f"{p}.scaling.original_context_length", int, file)
        if original:
            rope["original_max_position_embeddings"] = original
    dims = _number(md, f"{p}.dimension_count", int, file)
    if dims and dims != config["head_dim"]:
        rope["partial_rotary_factor"] = dims / config["head_dim"]
    return rope


#: llama.cpp's ``{arch}.pooling_type`` values (``enum llama_pooling_type``) by name.
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def build_config(file: GGUFFile) -> tuple[ArchitectureMap, dict[str, Any]]:
    """The architecture map and the ``config.json``-style dict of a GGUF file."""
    md, path = file.metadata, file.path
    name = md.get("general.architecture")
    if not isinstance(name, str):
        raise ConfigError(f"{path}: general.architecture is missing or not a string (found {name!r})")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {name!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    if arch.build is not None:
        return arch, arch.build(file, arch)
    config: dict[str, Any] = {"model_type": arch.model_type, **arch.defaults}
    for h in arch.hparams:
        key = f"{name}.{h.key}"
        value = _number(md, key, h.kind, file)
        if value is None:
            if h.required:
                raise ConfigError(f"{path}: metadata {key} is missing; it gives {h.name}")
            continue
        if (value < 0 or (value == 0 and not h.zero_ok)) and h.name not in ("final_logit_softcapping",
                                                                          "attn_logit_softcapping"):
            raise ConfigError(f"{path}: metadata {key} must be positive, found {value}")
        config[h.name] = value
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if layers > len(file.tensors):
        raise ConfigError(f"{path}: {name}.block_count is {layers} but the file has only "
                          f"{len(file.tensors)} tensors")
    nextn = _number(md, f"{name}.nextn_predict_layers", int, file)
    if nextn:  # block_count counts the MTP blocks too (llama.cpp's converters add them)
        if not 0 < nextn < layers:
            raise ConfigError(f"{path}: {name}.nextn_predict_layers is {nextn}, but block_count is {layers}")
        config["num_hidden_layers"] = layers - nextn
        config["num_nextn_predict_layers"] = nextn
    config.setdefault("num_key_value_heads", heads)
    if "head_dim" not in config:
        if config["hidden_size"] % heads:
            raise ConfigError(f"{path}: hidden size {config['hidden_size']} is not divisible by {heads} "
                              f"heads and {name}.attention.key_length is not given")
        config["head_dim"] = config["hidden_size"] // heads
    if "vocab_size" not in config:
        embed = file.tensors.get("token_embd.weight")
        tokens = md.get("tokenizer.ggml.tokens")
        if embed is None and (isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence)):
            raise ConfigError(f"{path}: cannot tell the vocabulary size: no {name}.vocab_size, "
                              f"token_embd.weight or tokenizer.ggml.tokens")
        config["vocab_size"] = embed.shape[0] if embed is not None else len(tokens)
    config["rope_parameters"] = _rope(config, file, arch)
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    if "blk.0.attn_q.bias" in file.tensors:  # read where the architecture asks whether to
        config["attention_bias"] = True
    if "blk.0.ffn_up.bias" in file.tensors:
        config["mlp_bias"] = True
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        value = md.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            config[f"{key}_token_id"] = value
    pooling = _number(md, f"{name}.pooling_type", int, file)
    if pooling is not None:  # an embedding model's (llama.cpp's LLAMA_POOLING_TYPE_*), read by infer.embedding
        if pooling not in POOLING_TYPES:
            raise ConfigError(f"{path}: {name}.pooling_type {pooling} is not one of llama.cpp's "
                              f"{', '.join(f'{k} ({v})' for k, v in POOLING_TYPES.items())}")
        config["pooling_type"] = POOLING_TYPES[pooling]
    if arch.finish is not None:
        arch.finish(config, file, arch)
    rope = config.get("rope_parameters")
    if rope is None:  # no rope (GPT-2)
        pass
    elif "full_attention" not in rope:  # the transformers 4 form too, for readers that know only it
        config["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        config["rope_scaling"] = scaling if scaling["rope_type"] != "default" or "freq_factors" in scaling else None
    else:
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        full = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
        config["rope_scaling"] = full if full["rope_type"] != "default" else None
    return arch, config


# Dotted kinds (LFM2's shortconv.conv) too, and Gemma 4's router ``.scale`` tensors.
_BLOCK = re.compile(r"blk\.(0|[1-9][0-9]*)\.([a-z0-9_]+(?:\.[a-z0-9_]+)*)\.(weight|bias|scale)")
_BARE = re.compile(r"blk\.(0|[1-9][0-9]*)\.([a-z0-9_]+)")  # no suffix: llama.cpp's ssm_a
_NEXTN = re.compile(r"blk\.(0|[1-9][0-9]*)\.nextn\.([a-z_]+)\.weight")


def canonical_name(arch: ArchitectureMap, name: str, layers: int) -> str | None:
    """The Hugging Face name of GGUF tensor ``name``, or None if the architecture has none.
    ``layers`` counts every block of the file, MTP blocks included. An expert tensor's
    name keeps ``{e}`` for the expert (:func:`expert_kind`)."""
    base, _, kind = name.rpartition(".")
    globals_ = GLOBAL_TENSORS if arch.global_tensors is None else arch.global_tensors
    if base in globals_ and kind in ("weight", "bias"):
        return f"{globals_[base]}.{kind}"
    m = _NEXTN.fullmatch(name)
    if m is not None:
        if int(m[1]) >= layers or m[2] not in NEXTN_TENSORS:
            return None
        return f"model.layers.{m[1]}.{NEXTN_TENSORS[m[2]]}.weight"
    m = _BLOCK.fullmatch(name)
    bare = _BARE.fullmatch(name) if m is None else None
    if bare is not None and int(bare[1]) < layers and f"{bare[2]}." in arch.layer_tensors:
        return f"{arch.layer_prefix}.{bare[1]}.{arch.layer_tensors[bare[2] + '.']}"
    if m is None or int(m[1]) >= layers:
        return None
    full = arch.layer_tensors.get(f"{m[2]}.{m[3]}")  # a Hugging Face name with another ending
    if full is not None:
        return f"{arch.layer_prefix}.{m[1]}.{full}"
    if m[3] == "scale":  # only where named in full (Gemma 4's router scales)
        return None
    module = arch.layer_tensors.get(m[2]) or (arch.expert_tensors.get(m[2]) if m[3] == "weight" else None)
    return None if module is None else f"{arch.layer_prefix}.{m[1]}.{module}.{m[3]}"


def block_kind(name: str) -> str | None:
    """The kind of a block tensor (``attn_qkv`` of ``blk.3.attn_qkv.weight``), or None."""
    m = _BLOCK.fullmatch(name)
    return None if m is None else m[2]
