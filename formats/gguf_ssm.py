"""GGUF for the Mamba-2 families: llama.cpp's ``mamba2``, ``granitehybrid`` and ``falcon-h1``.

These architectures do not fit the generic rows of :mod:`.gguf_arch` (no attention heads
in ``mamba2``, per-layer KV head counts, tensors llama.cpp's converter reshaped, split or
rescaled), so each row here builds its own config (``ArchitectureMap.build``) and names
its own rebuilt tensors (``ArchitectureMap.rebuilt``); :mod:`.gguf_write` calls
:func:`metadata` and :func:`tensors` to write them. What llama.cpp's ``convert_hf_to_gguf.py``
(``Mamba2Model``, ``GraniteHybridModel``, ``FalconH1Model``) does to the tensors, undone
on reading:

* ``A_log`` is stored as ``ssm_a = -exp(A_log)``, shaped ``[heads, 1]`` (no ``.weight``
  suffix); read back as ``log(-ssm_a)`` (computed in float64, rounded to float32: the model
  then computes ``-exp`` of it, within an ulp or two of the stored ``A``). ``D`` is
  ``ssm_d`` ``[heads, 1]``; ``dt_bias`` is ``ssm_dt.bias``.
* the convolution ``[channels, 1, width]`` is squeezed to ``[channels, width]``; the gated
  norm ``[inner]`` is reshaped to ``[groups, inner / groups]``.
* Granite's merged expert projection ``input_linear`` ``[experts, 2 ff, hidden]`` is split
  into ``ffn_gate_exps`` and ``ffn_up_exps`` (the shared MLP's into ``ffn_gate_shexp`` /
  ``ffn_up_shexp``, or ``ffn_gate`` / ``ffn_up`` when there are no experts); Q and K rows
  carry llama.cpp's rope permutation (``undo_permute``).
* Falcon-H1's muP multipliers are multiplied into the weights (embedding, output head, Q,
  K, V, O, the MLP's gate and down projections, the mixer's in- and out-projections, each
  ``in_proj`` section by its ``ssm_multipliers`` entry); the file's model has every
  multiplier 1.

What llama.cpp's graphs cannot compute is refused when writing (a typed error names the
field): biases of the mixer's projections (llama.cpp's Mamba-2 layer has none), a clamped
``time_step_limit``, Falcon-H1's norm-before-gate and attention biases, rope on a hybrid
Granite model without llama.cpp's ``rope.scaling.finetuned`` flag (written here).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.errors import ConfigError, FormatError

from .gguf_arch import ARCHITECTURES, GLOBAL_TENSORS, ArchitectureMap, _number

if TYPE_CHECKING:
    from infer.package import ModelPackage

    from .gguf_file import GGUFFile, TensorInfo

#: One rebuilt tensor: (Hugging Face shape, the GGUF tensors it is made of, how).
Rebuilt = tuple[tuple[int, ...], tuple["TensorInfo", ...], Callable[..., np.ndarray]]
#: One tensor to write: (GGUF name, llama.cpp shape, Hugging Face sources, its values).
Written = tuple[str, tuple[int, ...], tuple[str, ...], Callable[[], np.ndarray]]

#: The mixer's tensors (Hugging Face suffix under the mixer -> llama.cpp base name).
_MIXER = {"in_proj": "ssm_in", "conv1d": "ssm_conv1d", "norm": "ssm_norm", "out_proj": "ssm_out"}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _ssm_sizes(file: GGUFFile, p: str) -> dict[str, int]:
    md = file.metadata
    out = {}
    for key in ("embedding_length", "block_count", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
                "ssm.time_step_rank", "ssm.group_count"):
        value = _number(md, f"{p}.{key}", int, file)
        if value is None and key == "ssm.group_count":
            value = 1
        if not value or value <= 0:
            raise ConfigError(f"{file.path}: metadata {p}.{key} must be a positive integer, found {value!r}")
        out[key] = value
    inner, heads, groups = out["ssm.inner_size"], out["ssm.time_step_rank"], out["ssm.group_count"]
    if inner % heads or heads % groups or inner % groups:
        raise ConfigError(f"{file.path}: {p}.ssm.inner_size {inner} must be a multiple of ssm.time_step_rank "
                          f"{heads} (the heads), which a multiple of ssm.group_count {groups}")
    return out


def _eps(file: GGUFFile, p: str) -> float:
    return _number(file.metadata, f"{p}.attention.layer_norm_rms_epsilon", float, file) or 1e-5


def _vocab(file: GGUFFile) -> int:
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise FormatError(f"{file.path}: no token_embd.weight")
    return int(embed.shape[0])


def _has(file: GGUFFile, name: str, layers: range) -> bool:
    return any(f"blk.{i}.{name}" in file.tensors for i in layers)


def _build_mamba2(file: GGUFFile, arch: ArchitectureMap) -> dict[str, Any]:
    """``mamba2`` metadata -> transformers' ``Mamba2Config`` fields."""
    s = _ssm_sizes(file, arch.gguf_name)
    d, inner, heads, n = s["embedding_length"], s["ssm.inner_size"], s["ssm.time_step_rank"], s["block_count"]
    expand = inner // d if inner % d == 0 else inner / d
    return {"model_type": "mamba2", "hidden_size": d, "num_hidden_layers": n, "vocab_size": _vocab(file),
            "num_heads": heads, "head_dim": inner // heads, "state_size": s["ssm.state_size"],
            "n_groups": s["ssm.group_count"], "expand": expand, "conv_kernel": s["ssm.conv_kernel"],
            "layer_norm_epsilon": _eps(file, arch.gguf_name), "hidden_act": "silu",
            "use_bias": _has(file, "ssm_in.bias", range(n)), "use_conv_bias": _has(file, "ssm_conv1d.bias", range(n)),
            "time_step_limit": [0.0, float("inf")], "tie_word_embeddings": "output.weight" not in file.tensors}


def _attention_sizes(file: GGUFFile, p: str, config: dict[str, Any]) -> None:
    md = file.metadata
    for key, name in (("attention.head_count", "num_attention_heads"), ("feed_forward_length", "intermediate_size"),
                      ("context_length", "max_position_embeddings")):
        value = _number(md, f"{p}.{key}", int, file)
        if not value or value <= 0:
            raise ConfigError(f"{file.path}: metadata {p}.{key} must be a positive integer, found {value!r}")
        config[name] = value
    config["rope_theta"] = _number(md, f"{p}.rope.freq_base", float, file) or 10000.0
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if md.get(f"{p}.rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"{file.path}: rope scaling {md[f'{p}.rope.scaling.type']!r} is not supported for {p}")


def _build_granitehybrid(file: GGUFFile, arch: ArchitectureMap) -> dict[str, Any]:
    """``granitehybrid`` metadata -> ``GraniteMoeHybridConfig`` fields. A block is Mamba-2
    where its ``attention.head_count_kv`` entry is 0 (llama.cpp's rule); rope applies only
    with ``rope.scaling.finetuned`` (llama.cpp's ``use_rope``); an absent ``attention.scale``
    is llama.cpp's ``1/sqrt(head_dim)``, absent embedding/residual/logit scales are 1."""
    p, md = arch.gguf_name, file.metadata
    s = _ssm_sizes(file, p)
    d, inner, heads, n = s["embedding_length"], s["ssm.inner_size"], s["ssm.time_step_rank"], s["block_count"]
    config: dict[str, Any] = {"model_type": "granitemoehybrid", "hidden_size": d, "num_hidden_layers": n,
                              "vocab_size": _vocab(file)}
    _attention_sizes(file, p, config)
    kv = md.get(f"{p}.attention.head_count_kv")
    if isinstance(kv, int) and not isinstance(kv, bool):
        kv = np.full(n, kv)
    if not isinstance(kv, np.ndarray) or kv.shape != (n,) or np.any(kv < 0):
        raise ConfigError(f"{file.path}: metadata {p}.attention.head_count_kv must be {n} counts (0: a Mamba-2 "
                          f"block), found {kv!r}")
    attn = [i for i in range(n) if kv[i] > 0]
    if len({int(kv[i]) for i in attn}) > 1:
        raise ConfigError(f"{file.path}: {p}.attention.head_count_kv differs between attention blocks "
                          f"({[int(k) for k in kv]}); one count is supported")
    if inner % d:
        raise ConfigError(f"{file.path}: {p}.ssm.inner_size {inner} is not a multiple of the hidden size {d} "
                          f"(GraniteMoeHybrid's mamba_expand is an integer)")
    head_dim = d // config["num_attention_heads"]
    experts = _number(md, f"{p}.expert_count", int, file) or 0
    shared = _number(md, f"{p}.expert_shared_feed_forward_length", int, file)
    if shared is None:
        down = file.tensors.get("blk.0.ffn_down_shexp.weight" if experts else "blk.0.ffn_down.weight")
        if down is None:
            raise ConfigError(f"{file.path}: no {p}.expert_shared_feed_forward_length and no shared MLP tensors")
        shared = int(down.shape[-1])
    scale = _number(md, f"{p}.attention.scale", float, file)
    config.update(
        num_key_value_heads=int(kv[attn[0]]) if attn else config["num_attention_heads"],
        layer_types=["attention" if i in attn else "mamba" for i in range(n)],
        rms_norm_eps=_eps(file, p), hidden_act="silu", num_local_experts=experts,
        num_experts_per_tok=_number(md, f"{p}.expert_used_count", int, file) or 2,
        shared_intermediate_size=shared,
        position_embedding_type="rope" if md.get(f"{p}.rope.scaling.finetuned", False) is True else "nope",
        embedding_multiplier=_number(md, f"{p}.embedding_scale", float, file) or 1.0,
        residual_multiplier=_number(md, f"{p}.residual_scale", float, file) or 1.0,
        attention_multiplier=scale or head_dim ** -0.5,
        logits_scaling=_number(md, f"{p}.logit_scale", float, file) or 1.0,
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_n_groups=s["ssm.group_count"],
        mamba_d_state=s["ssm.state_size"], mamba_d_conv=s["ssm.conv_kernel"], mamba_expand=inner // d,
        mamba_conv_bias=_has(file, "ssm_conv1d.bias", range(n)), mamba_proj_bias=_has(file, "ssm_in.bias", range(n)),
        attention_bias=_has(file, "attn_q.bias", range(n)), time_step_limit=[0.0, float("inf")],
        tie_word_embeddings="output.weight" not in file.tensors)
    return config


def _build_falcon_h1(file: GGUFFile, arch: ArchitectureMap) -> dict[str, Any]:
    """``falcon-h1`` metadata -> ``FalconH1Config`` fields, every multiplier 1 (they are in
    the weights); the gated norm where the file has ``ssm_norm`` (gate, then norm: llama.cpp's
    Mamba-2 layer)."""
    p, md = arch.gguf_name, file.metadata
    s = _ssm_sizes(file, p)
    inner, heads, n = s["ssm.inner_size"], s["ssm.time_step_rank"], s["block_count"]
    biased = [b for b in ("ssm_in", "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output") if _has(file, f"{b}.bias",
                                                                                                   range(n))]
    if biased:  # the converter scales a bias by the input multipliers too, or fails on it
        raise FormatError(f"{file.path}: falcon-h1 tensors {', '.join(b + '.bias' for b in biased)} are not "
                          f"supported: llama.cpp's falcon-h1 graph adds no such biases, and its converter "
                          f"cannot store them faithfully")
    config: dict[str, Any] = {"model_type": "falcon_h1", "hidden_size": s["embedding_length"],
                              "num_hidden_layers": n, "vocab_size": _vocab(file)}
    _attention_sizes(file, p, config)
    kv = _number(md, f"{p}.attention.head_count_kv", int, file) or config["num_attention_heads"]
    head_dim = (_number(md, f"{p}.attention.key_length", int, file)
                or config["hidden_size"] // config["num_attention_heads"])
    config.update(
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=_eps(file, p), hidden_act="silu",
        mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_n_groups=s["ssm.group_count"],
        mamba_d_state=s["ssm.state_size"], mamba_d_conv=s["ssm.conv_kernel"],
        mamba_conv_bias=_has(file, "ssm_conv1d.bias", range(n)), mamba_proj_bias=False, projectors_bias=False,
        mamba_rms_norm=_has(file, "ssm_norm.weight", range(n)), mamba_norm_before_gate=False,
        attention_bias=False, mlp_bias=_has(file, "ffn_up.bias", range(n)), time_step_limit=[0.0, float("inf")],
        tie_word_embeddings="output.weight" not in file.tensors,
        lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=[1.0, 1.0], key_multiplier=1.0,
        attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_multipliers=[1.0] * 5,
        ssm_in_multiplier=1.0, ssm_out_multiplier=1.0)
    return config


# -- reading: the rebuilt tensors ------------------------------------------------------------


def _a_log(a: np.ndarray) -> np.ndarray:
    """``A_log`` from llama.cpp's ``ssm_a = -exp(A_log)``, ``[heads, 1]`` -> ``[heads]``."""
    with np.errstate(all="ignore"):
        return np.log(-a.astype(np.float64)).astype(np.float32).reshape(-1)


def _mixer_rebuilt(file: GGUFFile, i: int, prefix: str, out: dict[str, Rebuilt]) -> None:
    """Block ``i``'s mixer tensors whose layout llama.cpp changed, under ``prefix``."""
    t = file.tensors
    a, dd, conv, norm = (t.get(f"blk.{i}.{n}") for n in ("ssm_a", "ssm_d", "ssm_conv1d.weight", "ssm_norm.weight"))
    if a is None and dd is None and conv is None:
        return
    # llama.cpp's converter writes [heads, 1] and [channels, width]; [heads] and
    # [channels, 1, width] (the Hugging Face shapes) are read too.
    if a is None or dd is None or conv is None or a.shape[1:] not in ((), (1,)) or dd.shape != a.shape \
            or not (len(conv.shape) == 2 or (len(conv.shape) == 3 and conv.shape[1] == 1)):
        raise FormatError(f"{file.path}: block {i} needs ssm_a and ssm_d [heads, 1] and ssm_conv1d.weight "
                          f"[channels, width]; found {a and list(a.shape)}, {dd and list(dd.shape)}, "
                          f"{conv and list(conv.shape)}")
    out[prefix + "A_log"] = ((a.shape[0],), (a,), _a_log)
    out[prefix + "D"] = ((dd.shape[0],), (dd,), lambda v: v.reshape(-1))
    c, k = conv.shape[0], conv.shape[-1]
    out[prefix + "conv1d.weight"] = ((c, 1, k), (conv,), lambda v: v.reshape(c, 1, k))
    if norm is not None:
        out[prefix + "norm.weight"] = ((int(np.prod(norm.shape)),), (norm,), lambda v: v.reshape(-1))


def _rebuilt_mixers(prefix: str) -> Callable[[GGUFFile, dict[str, Any], ArchitectureMap], dict[str, Rebuilt]]:
    def rebuilt(file: GGUFFile, config: dict[str, Any], arch: ArchitectureMap) -> dict[str, Rebuilt]:
        out: dict[str, Rebuilt] = {}
        for i in range(config["num_hidden_layers"]):
            _mixer_rebuilt(file, i, f"{arch.layer_prefix}.{i}.{prefix}", out)
        return out
    return rebuilt


def _rebuilt_falcon_h1(file: GGUFFile, config: dict[str, Any], arch: ArchitectureMap) -> dict[str, Rebuilt]:
    """The mixers, and ``blk.N.ffn_norm``: gguf-py maps ``pre_ff_layernorm.weight`` whole, so
    llama.cpp's converter (and loader) name it without the ``.weight`` suffix."""
    out = _rebuilt_mixers("mamba.")(file, config, arch)
    for i in range(config["num_hidden_layers"]):
        info = file.tensors.get(f"blk.{i}.ffn_norm")
        if info is not None:
            out[f"{arch.layer_prefix}.{i}.pre_ff_layernorm.weight"] = (tuple(info.shape), (info,), lambda v: v)
    return out


def _rebuilt_granite(file: GGUFFile, config: dict[str, Any], arch: ArchitectureMap) -> dict[str, Rebuilt]:
    """The mixers, and the merged gate/up projections joined back (experts and shared MLP)."""
    out = _rebuilt_mixers("mamba.")(file, config, arch)
    t = file.tensors
    for i in range(config["num_hidden_layers"]):
        p = f"{arch.layer_prefix}.{i}."
        for gate, up, name, axis in (("ffn_gate_exps", "ffn_up_exps", "block_sparse_moe.input_linear.weight", 1),
                                     ("ffn_gate_shexp", "ffn_up_shexp", "shared_mlp.input_linear.weight", 0),
                                     ("ffn_gate", "ffn_up", "shared_mlp.input_linear.weight", 0)):
            g, u = t.get(f"blk.{i}.{gate}.weight"), t.get(f"blk.{i}.{up}.weight")
            if g is None and u is None:
                continue
            if g is None or u is None or g.shape != u.shape:
                raise FormatError(f"{file.path}: block {i} needs {gate} and {up} of one shape; found "
                                  f"{g and list(g.shape)} and {u and list(u.shape)}")
            shape = list(g.shape)
            shape[axis] *= 2
            out[p + name] = (tuple(shape), (g, u), lambda a, b, axis=axis: np.concatenate([a, b], axis=axis))
    return out


#: Plain renames, block tensors: llama.cpp base name -> the Hugging Face module under the block.
_MAMBA2_LAYER = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_out": "mixer.out_proj",
                 "ssm_conv1d.bias": "mixer.conv1d.bias", "ssm_dt.bias": "mixer.dt_bias"}
_GRANITE_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj", "ssm_conv1d.bias": "mamba.conv1d.bias",
                  "ssm_dt.bias": "mamba.dt_bias", **{v: f"self_attn.{k}" for k, v in _ATTENTION.items()},
                  "ffn_gate_inp": "block_sparse_moe.router.layer", "ffn_down_exps": "block_sparse_moe.output_linear",
                  "ffn_down_shexp": "shared_mlp.output_linear", "ffn_down": "shared_mlp.output_linear"}
_FALCON_H1_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm",
                    "ssm_in.weight": "mamba.in_proj.weight", "ssm_out.weight": "mamba.out_proj.weight",
                    "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias",
                    **{f"{v}.weight": f"self_attn.{k}.weight" for k, v in _ATTENTION.items()},
                    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                    "ffn_down": "feed_forward.down_proj"}

ROWS = (
    ArchitectureMap("mamba2", "mamba2", (), _MAMBA2_LAYER, layer_prefix="backbone.layers",
                    global_tensors={"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f",
                                    "output": "lm_head"}, build=_build_mamba2, rebuilt=_rebuilt_mixers("mixer.")),
    ArchitectureMap("granitehybrid", "granitemoehybrid", (), _GRANITE_LAYER, permute_qk=True,
                    build=_build_granitehybrid, rebuilt=_rebuilt_granite),
    ArchitectureMap("falcon-h1", "falcon_h1", (), _FALCON_H1_LAYER,
                    global_tensors={"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm",
                                    "output": "lm_head"}, build=_build_falcon_h1, rebuilt=_rebuilt_falcon_h1),
)
ARCHITECTURES.update({a.gguf_name: a for a in ROWS})


# -- writing ---------------------------------------------------------------------------------


def _refuse(config: dict[str, Any], arch: str, checks: dict[str, tuple[Any, Any]]) -> None:
    """``checks``: field -> (its value in this config, the only value llama.cpp's graph computes)."""
    for key, (value, ok) in checks.items():
        if value != ok:
            raise ConfigError(f"config.json {key} is {value!r}; llama.cpp's {arch} computes only {ok!r}, so "
                              f"this model has no faithful GGUF form")


def _limit(config: dict[str, Any]) -> list[float]:
    """``time_step_limit`` as two floats (transformers 5 writes infinity as ``{"__float__": "Infinity"}``)."""

    def number(v: Any) -> float:
        if isinstance(v, dict) and set(v) == {"__float__"}:
            v = v["__float__"]
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: time_step_limit {value!r} is not a pair of numbers") from None

    value = config.get("time_step_limit")
    if value is None:
        return [0.0, float("inf")]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"config.json: time_step_limit {value!r} is not [min, max]")
    return [number(value[0]), number(value[1])]


def _mixer_config(config: dict[str, Any], model_type: str,
                  read_config: Callable[[dict[str, Any]], Any] | None) -> dict[str, Any]:
    """The mixer's sizes of a Hugging Face config, through the architecture's own config
    reader (``ModelPackage.read_config``, which :func:`infer.convert` attaches from the
    architecture's registration: transformers' defaults, nulls and ``"auto"`` resolved
    as the architecture resolves them when it loads the model)."""
    if read_config is None:
        raise ConfigError(f"writing {model_type} as GGUF needs its architecture's config reader "
                          "(ModelPackage.read_config; infer.convert attaches it)")
    c = read_config(config)
    if model_type == "mamba2":
        return {"hidden": c.hidden_size, "inner": c.num_heads * c.head_dim, "heads": c.num_heads,
                "groups": c.n_groups, "state": c.state_size, "conv": c.conv_kernel, "config": c}
    inner = c.mamba_n_heads * c.mamba_d_head
    return {"hidden": c.hidden_size, "inner": inner, "heads": c.mamba_n_heads, "groups": c.mamba_n_groups,
            "state": c.mamba_d_state, "conv": c.mamba_d_conv, "config": c}


def _ssm_metadata(p: str, m: dict[str, int], eps: float) -> dict[str, Any]:
    return {f"{p}.ssm.conv_kernel": m["conv"], f"{p}.ssm.inner_size": m["inner"], f"{p}.ssm.state_size": m["state"],
            f"{p}.ssm.time_step_rank": m["heads"], f"{p}.ssm.group_count": m["groups"],
            f"{p}.attention.layer_norm_rms_epsilon": float(eps)}


def metadata(arch: ArchitectureMap, config: dict[str, Any],
             read_config: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """The ``{arch}.*`` keys llama.cpp's converter writes for ``config`` (read through
    ``read_config``, the architecture's reader).

    Raises:
        ConfigError: a field llama.cpp's graph for the architecture does not compute.
    """
    p, n = arch.gguf_name, config["num_hidden_layers"]
    m = _mixer_config(config, arch.model_type, read_config)
    if arch.model_type == "mamba2":
        _refuse(config, p, {"use_bias": (bool(config.get("use_bias", False)), False),
                            "time_step_limit": (_limit(config), [0.0, float("inf")]),
                            "hidden_act": (config.get("hidden_act", "silu"), "silu")})
        return {f"{p}.context_length": 2**20, f"{p}.embedding_length": m["hidden"], f"{p}.feed_forward_length": 0,
                f"{p}.attention.head_count": 0, f"{p}.block_count": n,
                **_ssm_metadata(p, m, config.get("layer_norm_epsilon", 1e-5))}
    c: Any = m["config"]
    rope = c.rope  # the architectures' config readers keep the rope settings in ``rope``
    theta = rope.get("rope_theta", 10000.0)
    roped = arch.model_type == "falcon_h1" or getattr(c, "position_embedding_type", None) == "rope"
    if roped and rope.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json rope scaling {rope.get('rope_type')!r} has no GGUF form for {p}; "
                          f"supported: default")
    md: dict[str, Any] = {f"{p}.block_count": n, f"{p}.embedding_length": c.hidden_size,
                          f"{p}.feed_forward_length": c.intermediate_size,
                          f"{p}.attention.head_count": c.num_attention_heads, f"{p}.rope.freq_base": float(theta),
                          **_ssm_metadata(p, m, c.rms_norm_eps)}
    if arch.model_type == "granitemoehybrid":
        _refuse(config, p, {"mamba_proj_bias": (c.mamba_proj_bias, False),
                            "time_step_limit": (_limit(config), [0.0, float("inf")]),
                            "hidden_act": (config.get("hidden_act", "silu"), "silu")})
        types = [c.kind(i) for i in range(n)]
        attn = [t != "mamba" for t in types]
        md.update({f"{p}.context_length": c.max_position_embeddings if c.position_embedding_type == "rope" else 2**20,
                   f"{p}.attention.head_count_kv": np.array([c.num_key_value_heads if a else 0 for a in attn],
                                                            dtype=np.uint32),
                   f"{p}.expert_count": c.num_local_experts, f"{p}.expert_used_count": c.num_experts_per_tok,
                   f"{p}.attention.scale": float(c.attention_multiplier),
                   f"{p}.embedding_scale": float(c.embedding_multiplier),
                   f"{p}.residual_scale": float(c.residual_multiplier), f"{p}.logit_scale": float(c.logits_scaling),
                   f"{p}.expert_shared_feed_forward_length": c.shared_intermediate_size,
                   f"{p}.rope.scaling.finetuned": c.position_embedding_type == "rope"})
        return md
    # falcon-h1
    tied = bool(c.tie_word_embeddings)
    _refuse(config, p, {"mamba_proj_bias": (c.mamba_proj_bias, False), "projectors_bias": (c.projectors_bias, False),
                        "attention_bias": (c.attention_bias, False),
                        "time_step_limit": (_limit(config), [0.0, float("inf")])})
    if c.mamba_rms_norm:
        _refuse(config, p, {"mamba_norm_before_gate": (c.mamba_norm_before_gate, False)})
    if tied and c.embedding_multiplier != c.lm_head_multiplier:
        raise ConfigError(f"config.json ties the output head to the embedding but embedding_multiplier "
                          f"({c.embedding_multiplier}) differs from lm_head_multiplier ({c.lm_head_multiplier}); "
                          f"llama.cpp stores the multipliers in the one shared tensor")
    md.update({f"{p}.vocab_size": c.vocab_size, f"{p}.context_length": c.max_position_embeddings,
               f"{p}.attention.head_count_kv": c.num_key_value_heads, f"{p}.attention.key_length": c.head_dim,
               f"{p}.attention.value_length": c.head_dim})
    return md


def _f32(value: Any) -> np.ndarray:
    from infer.ops import QuantizedTensor

    if isinstance(value, QuantizedTensor):
        value = value.dequantize()
    return np.asarray(value, dtype=np.float32)


_HF_LAYER = re.compile(r"(?:model|backbone)\.layers\.(0|[1-9][0-9]*)\.(.+)")


def tensors(arch: ArchitectureMap, package: ModelPackage) -> list[Written]:
    """Every tensor of ``package`` as llama.cpp's converter writes it for ``arch``, in the
    package's order (a merged projection where its Hugging Face tensor is).

    Raises:
        FormatError: a tensor with no llama.cpp name in the architecture.
    """
    config, src = package.config, package.tensors
    m = _mixer_config(config, arch.model_type, package.read_config)
    c: Any = m.get("config")
    get = src.get
    out: list[Written] = []
    falcon = arch.model_type == "falcon_h1"

    def add(gguf: str, shape: tuple[int, ...], sources: tuple[str, ...], make: Callable[[], np.ndarray]) -> None:
        out.append((gguf, tuple(int(s) for s in shape), sources, make))

    def scaled(name: str, *factors: float) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            value = _f32(get(name))
            for f in factors:  # one multiplication per factor, in the converter's order
                value = value * np.float32(f)
            return value
        return make

    globals_ = GLOBAL_TENSORS if arch.global_tensors is None else arch.global_tensors
    tied = bool(config.get("tie_word_embeddings", False))
    for name in src.names():
        shape = tuple(src.shape(name))
        base, _, kind = name.rpartition(".")
        top = next((g for g, hf in globals_.items() if hf == base), None)
        if base.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        if top is not None:
            factor = ([c.embedding_multiplier] if top == "token_embd" else [c.lm_head_multiplier]
                      if top == "output" else []) if falcon else []
            add(f"{top}.{kind}", shape, (name,), scaled(name, *factor))
            continue
        lm = _HF_LAYER.fullmatch(name)
        if lm is None:
            raise FormatError(f"tensor {name!r} has no llama.cpp name in architecture {arch.gguf_name!r}")
        i, rest = lm[1], lm[2]
        blk = f"blk.{i}"
        mixer = rest.split(".", 1)[1] if rest.startswith(("mixer.", "mamba.")) else None
        if mixer == "A_log":
            add(f"{blk}.ssm_a", shape + (1,), (name,),
                lambda name=name: (-np.exp(_f32(get(name)).astype(np.float64))).astype(np.float32).reshape(-1, 1))
        elif mixer == "D":
            add(f"{blk}.ssm_d", shape + (1,), (name,), lambda name=name: _f32(get(name)).reshape(-1, 1))
        elif mixer == "dt_bias":
            add(f"{blk}.ssm_dt.bias", shape, (name,), scaled(name))
        elif mixer == "conv1d.weight":
            add(f"{blk}.ssm_conv1d.weight", (shape[0], shape[2]), (name,),
                lambda name=name, s=shape: _f32(get(name)).reshape(s[0], s[2]))
        elif mixer == "norm.weight":
            g = m["groups"]
            add(f"{blk}.ssm_norm.weight", (g, shape[0] // g), (name,),
                lambda name=name, g=g: _f32(get(name)).reshape(g, -1))
        elif mixer is not None and mixer.rsplit(".", 1)[0] in _MIXER:
            module, _, kind = mixer.rpartition(".")
            if falcon and module == "in_proj":
                make = _falcon_in_proj(name, get, c, m)
            elif falcon and module == "out_proj":
                make = scaled(name, c.ssm_out_multiplier)
            else:
                make = scaled(name)
            add(f"{blk}.{_MIXER[module]}.{kind}", shape, (name,), make)
        elif arch.model_type == "granitemoehybrid" and rest.endswith("input_linear.weight"):
            moe = rest.startswith("block_sparse_moe.")
            half = shape[-2] // 2
            names = ("ffn_gate_exps", "ffn_up_exps") if moe else (
                ("ffn_gate_shexp", "ffn_up_shexp") if c.num_local_experts else ("ffn_gate", "ffn_up"))
            part = shape[:-2] + (half, shape[-1])
            for j, g in enumerate(names):
                add(f"{blk}.{g}.weight", part, (name,),
                    lambda name=name, j=j, half=half: _f32(get(name))[..., j * half:(j + 1) * half, :].copy())
        else:
            gguf = _layer_name(arch, rest, c)
            if gguf is None:
                raise FormatError(f"tensor {name!r} has no llama.cpp name in architecture {arch.gguf_name!r}; "
                                  f"it cannot be written as GGUF")
            make = scaled(name)
            if falcon and gguf == "ffn_norm.weight":
                gguf = "ffn_norm"  # see _rebuilt_falcon_h1
            if arch.permute_qk and re.fullmatch(r"self_attn\.[qk]_proj\.(weight|bias)", rest):
                heads = c.num_attention_heads if ".q_proj." in rest else c.num_key_value_heads
                make = _permuted(name, get, heads)
            elif falcon:
                make = scaled(name, *_falcon_factors(rest, c))
            add(f"{blk}.{gguf}", shape, (name,), make)
    return out


def _layer_name(arch: ArchitectureMap, rest: str, c: Any) -> str | None:
    """llama.cpp's name (``attn_q.weight``) of block tensor ``rest`` (``self_attn.q_proj.weight``)."""
    module, _, kind = rest.rpartition(".")
    for gguf, hf in arch.layer_tensors.items():
        if hf == rest:
            return gguf
        if hf == module and "." not in gguf:
            if gguf == "ffn_down" and getattr(c, "num_local_experts", 0):
                continue  # with experts the shared MLP's down projection is ffn_down_shexp
            if gguf == "ffn_down_shexp" and not getattr(c, "num_local_experts", 1):
                continue
            return f"{gguf}.{kind}"
    return None


def _permuted(name: str, get: Callable[[str], Any], heads: int) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        value = _f32(get(name))
        rows = value.shape[0]
        order = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
        return value[order]
    return make


def _falcon_factors(rest: str, c: Any) -> list[float]:
    """The multipliers llama.cpp's ``FalconH1Model`` multiplies block tensor ``rest`` by, in its order."""
    if "down_proj" in rest:
        return [c.mlp_multipliers[1]]
    if "gate_proj" in rest:
        return [c.mlp_multipliers[0]]
    if "k_proj" in rest:
        return [c.key_multiplier, c.attention_in_multiplier]
    if "q_proj" in rest or "v_proj" in rest:
        return [c.attention_in_multiplier]
    if "o_proj" in rest:
        return [c.attention_out_multiplier]
    return []


def _falcon_in_proj(name: str, get: Callable[[str], Any], c: Any, m: dict[str, int]) -> Callable[[], np.ndarray]:
    """``in_proj`` times ``ssm_in_multiplier``, then each section (z, x, B, C, dt) by its
    ``ssm_multipliers`` entry, as llama.cpp's converter does."""
    def make() -> np.ndarray:
        value = _f32(get(name)) * np.float32(c.ssm_in_multiplier)
        inner, gs = m["inner"], m["groups"] * m["state"]
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, value.shape[0]]
        for k, f in enumerate(c.ssm_multipliers):
            value[bounds[k]:bounds[k + 1]] *= np.float32(f)
        return value
    return make
