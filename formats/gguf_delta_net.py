"""GGUF layouts of the gated DeltaNet families: Qwen3.5, Qwen3.5-MoE and Qwen3-Next.

llama.cpp's converter (convert_hf_to_gguf.py, ``Qwen3NextModel`` and
``_LinearAttentionVReorderBase``) changes these tensors on the way to a GGUF file;
:func:`fix_entries` undoes each change when reading, :func:`plan` makes it when writing
(``infer convert``), so a file round-trips to the Hugging Face tensors:

* ``A_log`` is stored as ``ssm_a = -exp(A_log)`` (read back as ``log(-ssm_a)``: within an
  ulp or two of the checkpoint's float32, not bit for bit; the model computes ``-exp`` of it
  again), ``dt_bias`` as ``ssm_dt.bias``, the convolution ``[channels, 1, K]`` squeezed to
  ``[channels, K]``.
* Qwen3-Next's fused ``in_proj_qkvz`` (q, k, v, z grouped per key head) is split into
  ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (all z); ``in_proj_ba`` is kept.
* Qwen3.5 and Qwen3.5-MoE, where key heads are fewer than value heads: the value heads are
  reordered from grouped by key head (``[k0: v0 v1, k1: v0 v1]``) to tiled (``[k0v0 k1v0
  k0v1 k1v1]``) in the v rows of ``in_proj_qkv`` and of the convolution, the rows of
  ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias`` and the columns of
  ``out_proj``.
* Every RMSNorm weight but the DeltaNet's gated one (``ssm_norm``) is stored as ``1 + w``
  (:attr:`~.gguf_arch.ArchitectureMap.norm_offset`); experts are stacked ``[experts, rows,
  cols]``.

Quantized rows that are only reordered or joined stay quantized (whole blocks); the
columns of a quantized ``out_proj`` are reordered in float32.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from infer.errors import ConfigError
from infer.ops import QuantizedTensor

# ``arch`` arguments below are gguf_arch.ArchitectureMap rows, not imported here: gguf_arch
# imports this module (for its rows' entry fixes), and the layering forbids the cycle.


def _dims(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head width, value head width) of the DeltaNet."""
    return (config["linear_num_key_heads"], config["linear_num_value_heads"], config["linear_key_head_dim"],
            config["linear_value_head_dim"])


def tiled_order(key_heads: int, value_heads: int, width: int) -> np.ndarray:
    """llama.cpp's value-head order: entry ``s`` of the stored rows is row ``order[s]`` of the
    Hugging Face rows (``value_heads`` heads of ``width`` rows, grouped by key head)."""
    r = value_heads // key_heads
    return np.arange(value_heads * width).reshape(key_heads, r, width).transpose(1, 0, 2).reshape(-1)


def grouped_order(key_heads: int, value_heads: int, width: int) -> np.ndarray:
    """The inverse of :func:`tiled_order`: Hugging Face row ``h`` is stored row ``order[h]``."""
    return np.argsort(tiled_order(key_heads, value_heads, width))


def _reorders(config: dict[str, Any],
              order: Callable[[int, int, int], np.ndarray]) -> dict[str, tuple[str, np.ndarray]]:
    """Hugging Face tensor (under ``linear_attn.``) -> (``"rows"`` or ``"cols"``, index order) of the
    value-head reorder of Qwen3.5 (empty when key and value heads are as many)."""
    nk, nv, hk, hv = _dims(config)
    if nk == nv:
        return {}
    kd = 2 * nk * hk
    qk = np.arange(kd)
    v = np.concatenate([qk, kd + order(nk, nv, hv)])
    one = order(nk, nv, 1)
    return {"in_proj_qkv.weight": ("rows", v), "conv1d.weight": ("rows", v),
            "in_proj_z.weight": ("rows", order(nk, nv, hv)), "in_proj_a.weight": ("rows", one),
            "in_proj_b.weight": ("rows", one), "A_log": ("rows", one), "dt_bias": ("rows", one),
            "out_proj.weight": ("cols", order(nk, nv, hv))}


def qkvz_rows(config: dict[str, Any]) -> np.ndarray:
    """Rows of Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, v, z) in ``attn_qkv`` followed by
    ``attn_gate`` (all q, all k, all v, then all z)."""
    nk, nv, hk, hv = _dims(config)
    kd, vd, rv = nk * hk, nv * hv, nv // nk * hv
    return np.concatenate([np.concatenate([np.arange(j * hk, (j + 1) * hk), kd + np.arange(j * hk, (j + 1) * hk),
                                           2 * kd + np.arange(j * rv, (j + 1) * rv),
                                           2 * kd + vd + np.arange(j * rv, (j + 1) * rv)]) for j in range(nk)])


def _a_log(a: np.ndarray) -> np.ndarray:
    return np.log(-a.astype(np.float64)).astype(np.float32)


def fix_entries(entries: dict[str, Any], file: Any, arch: Any, config: dict[str, Any]) -> None:
    """Undo llama.cpp's layout changes (module docstring) on the reader's entries, in place."""
    nk, nv, hk, hv = _dims(config)
    conv = 2 * nk * hk + nv * hv
    reorder = _reorders(config, grouped_order) if arch.gguf_name in ("qwen35", "qwen35moe") else {}
    for i, kind in enumerate(config["layer_types"]):
        if kind != "linear_attention":
            continue
        p = f"{arch.layer_prefix}.{i}.linear_attn."
        for name in ("A_log", "conv1d.weight"):
            if p + name not in entries:
                raise ConfigError(f"{file.path}: DeltaNet block {i} has no {name} "
                                  f"({'ssm_a' if name == 'A_log' else 'ssm_conv1d.weight'})")
        e = entries[p + "A_log"]
        entries[p + "A_log"] = dataclasses.replace(e, inverse=_a_log)
        e = entries[p + "conv1d.weight"]
        if int(np.prod(e.info.shape)) != conv * config["linear_conv_kernel_dim"]:
            raise ConfigError(f"{file.path}: {e.info.name} has shape {list(e.info.shape)}; expected "
                              f"[{conv}, {config['linear_conv_kernel_dim']}]")
        entries[p + "conv1d.weight"] = dataclasses.replace(e, shape=(conv, 1, config["linear_conv_kernel_dim"]),
                                                           rows=np.arange(conv))
        for name, (axis, order) in reorder.items():
            e = entries.get(p + name)
            if e is not None:
                entries[p + name] = dataclasses.replace(e, **{axis: order})
        qkv, z = entries.get(p + "in_proj_qkv.weight"), entries.get(p + "in_proj_z.weight")
        if arch.gguf_name == "qwen3next" and qkv is not None and z is not None:
            del entries[p + "in_proj_qkv.weight"], entries[p + "in_proj_z.weight"]
            entries[p + "in_proj_qkvz.weight"] = dataclasses.replace(
                qkv, shape=(conv + nv * hv, qkv.shape[1]), parts=(z.info,), rows=qkvz_rows(config))


# -- writing ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Written:
    """One GGUF tensor made from Hugging Face tensors: its name, shape (the stored one, numpy
    order), how to make its values (float32, llama.cpp's layout) and what it reads."""

    gguf: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    sources: tuple[str, ...]


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def check_config(arch: Any, config: dict[str, Any]) -> list[str]:
    """The config's layer kinds, refusing what llama.cpp's files cannot say: for Qwen3-Next, a
    dense MLP in any layer."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if arch.gguf_name == "qwen3next":
        dense = sorted(set(config.get("mlp_only_layers") or ()))
        if not config.get("num_experts") or config.get("decoder_sparse_step", 1) != 1 or dense:
            raise ConfigError(f"config.json has dense MLP layers (num_experts {config.get('num_experts')}, "
                              f"decoder_sparse_step {config.get('decoder_sparse_step', 1)}, mlp_only_layers "
                              f"{dense}); llama.cpp's qwen3next has a mixture of experts in every block, so "
                              f"this model has no GGUF form")
    return list(types)


def full_attention_interval(types: list[str]) -> int | None:
    """The ``full_attention_interval`` that gives ``types`` (llama.cpp: layer ``i`` is full attention
    when ``(i + 1) % interval == 0``), or None when no interval does."""
    n = len(types)
    for interval in range(1, n + 2):
        if types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]:
            return interval
    return None


def plan(package: Any, arch: Any, config: dict[str, Any], name_of: Callable[[str], str]) -> list[Written]:
    """The tensors llama.cpp's converter changes (module docstring), as :class:`Written` rows;
    ``name_of`` gives a source tensor's text-model name (``model.layers...``). The rest are
    written as usual (names from the architecture row, norms plus one)."""
    src = package.tensors
    nk, nv, hk, hv = _dims(config)
    reorder = _reorders(config, tiled_order) if arch.gguf_name in ("qwen35", "qwen35moe") else {}
    by_name = {name_of(n): n for n in src.names()}
    stored_names = {hf: g for g, hf in arch.layer_tensors.items()}
    out: list[Written] = []

    def read(hf: str) -> np.ndarray:
        value = src.get(by_name[hf])
        return np.asarray(value.dequantize() if isinstance(value, QuantizedTensor) else value, dtype=np.float32)

    def layout(hf: str, rest: str) -> Callable[[], np.ndarray]:
        axis, order = reorder.get(rest, (None, None))

        def make() -> np.ndarray:
            value = read(hf)
            if rest == "A_log":
                value = -np.exp(value)
            if rest == "conv1d.weight":
                value = value.reshape(value.shape[0], -1)  # [channels, 1, K] -> [channels, K]
            if axis == "rows":
                value = value[order]
            elif axis == "cols":
                value = value[:, order]
            return np.ascontiguousarray(value)
        return make

    experts: dict[tuple[int, str], dict[int, str]] = {}
    for hf in by_name:
        m = re.match(r"model\.layers\.(\d+)\.", hf)
        if m is not None and int(m[1]) >= config["num_hidden_layers"]:  # an MTP module: not written
            continue
        m = _EXPERT.fullmatch(hf)
        if m is not None:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = hf
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.linear_attn\.(.+)", hf)
        if m is None:
            continue
        i, rest = m[1], m[2]
        shape = tuple(src.shape(by_name[hf]))
        if rest == "in_proj_qkvz.weight":  # Qwen3-Next: split into attn_qkv and attn_gate
            rows = np.argsort(qkvz_rows(config))  # Hugging Face rows of [attn_qkv; attn_gate]
            conv = 2 * nk * hk + nv * hv
            for gguf, part in (("attn_qkv", slice(0, conv)), ("attn_gate", slice(conv, None))):
                out.append(Written(f"blk.{i}.{gguf}.weight", (len(rows[part]), shape[1]),
                                   lambda hf=hf, part=part, rows=rows: np.ascontiguousarray(read(hf)[rows[part]]),
                                   (by_name[hf],)))
            continue
        gguf = {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias", "conv1d.weight": "ssm_conv1d.weight"}.get(rest)
        if gguf is None and rest in reorder:  # a projection: its name from the architecture row
            gguf = stored_names[f"linear_attn.{rest.removesuffix('.weight')}"] + ".weight"
        if gguf is None:
            continue
        stored = (shape[0], int(np.prod(shape[1:]))) if rest == "conv1d.weight" else shape
        out.append(Written(f"blk.{i}.{gguf}", stored, layout(hf, rest), (by_name[hf],)))
    for (layer, proj), by_expert in sorted(experts.items()):
        names = [by_expert[e] for e in sorted(by_expert)]
        if sorted(by_expert) != list(range(len(names))):
            raise ConfigError(f"layer {layer}: experts {sorted(by_expert)} of {proj} are not 0..{len(names) - 1}")
        shape = (len(names), *src.shape(by_name[names[0]]))
        out.append(Written(f"blk.{layer}.{_STACKED[proj]}.weight", shape,
                           lambda names=names: np.stack([read(n) for n in names]),
                           tuple(by_name[n] for n in names)))
    return out
