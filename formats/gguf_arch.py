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

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.errors import ConfigError, UnsupportedArchitectureError

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
    per-frequency divisors (transformers' loader ignores it). Recognise Llama 3's rule
    (factor, low/high frequency factors 1 and 4, 8192 original positions: every Llama 3.x
    release, unless ``rope.scaling.original_context_length`` says otherwise, as infer's own
    converter writes for other models) and express it as ``rope_type: llama3``; anything
    else is refused."""
    info = file.tensors.get("rope_freqs.weight")
    if info is None:
        return
    where = f"{file.path}: tensor 'rope_freqs.weight'"
    if info.type.name != "F32" or len(info.dims) != 1:
        raise ConfigError(f"{where}: expected a 1-D F32 tensor, found {info.type.name} {list(info.dims)}")
    factors = file.raw(info).view("<f4").reshape(-1).astype(np.float64)
    dim = len(factors) * 2
    if dim != config["head_dim"] or not np.all(np.isfinite(factors)) or factors[-1] <= 0:
        raise ConfigError(f"{where}: expected head_dim / 2 = {config['head_dim'] // 2} finite factors, "
                          f"found {len(factors)}")
    theta = config["rope_parameters"]["rope_theta"]
    original = _number(file.metadata, f"{arch.gguf_name}.rope.scaling.original_context_length", int, file) or 8192
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors[-1]), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    if not np.allclose(_llama3_divisors(rope, dim), factors, rtol=1e-5, atol=0):
        raise ConfigError(f"{where}: per-frequency rope factors that do not follow Llama 3's rule "
                          f"(factor {rope['factor']}, low/high 1/4, 8192 positions) are not supported")
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
        config["rope_scaling"] = scaling if scaling["rope_type"] != "default" else None
    else:
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        full = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
        config["rope_scaling"] = full if full["rope_type"] != "default" else None
    return arch, config


_BLOCK = re.compile(r"blk\.(0|[1-9][0-9]*)\.([a-z0-9_]+)\.(weight|bias)")
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
    if m is None or int(m[1]) >= layers:
        return None
    full = arch.layer_tensors.get(f"{m[2]}.{m[3]}")  # a Hugging Face name with another ending
    if full is not None:
        return f"{arch.layer_prefix}.{m[1]}.{full}"
    module = arch.layer_tensors.get(m[2]) or (arch.expert_tensors.get(m[2]) if m[3] == "weight" else None)
    return None if module is None else f"{arch.layer_prefix}.{m[1]}.{module}.{m[3]}"


def block_kind(name: str) -> str | None:
    """The kind of a block tensor (``attn_qkv`` of ``blk.3.attn_qkv.weight``), or None."""
    m = _BLOCK.fullmatch(name)
    return None if m is None else m[2]
