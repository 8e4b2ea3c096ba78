"""GGUF LoRA adapters, as llama.cpp's ``convert_lora_to_gguf.py`` writes them
and ``llama_adapter_lora_init`` reads them.

Metadata: ``general.type = "adapter"``, ``general.architecture`` (the base
model's GGUF architecture, which the reader checks), ``adapter.type =
"lora"``, ``adapter.lora.alpha``. Tensors: per adapted weight
``<gguf name>.lora_a`` (``[r, in]``) and ``<gguf name>.lora_b`` (``[out, r]``),
in float32 (or F16/BF16); llama.cpp scales each pair by ``alpha / r``. Q and
K of the llama family are stored with llama.cpp's row permutation, as the base
weights are, so ``lora_b``'s rows are permuted too.

A GGUF adapter has one alpha: an rsLoRA adapter, or one with
``rank_pattern`` / ``alpha_pattern``, is written with each module's true
scale folded into its ``lora_b`` (``b * scale / (alpha / r)``), so that
llama.cpp's ``alpha / r`` gives back the right product (its own converter
writes ``lora_alpha`` alone and gets rsLoRA wrong).

The core reaches this module through the format's spec
(:attr:`~infer.plugins.registry.FormatSpec.read_adapter`, ``write_adapter``),
in plain arrays: ``{hf module name: (a, b, scale)}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import AdapterFormatError, AdapterMismatchError, FormatError, MissingDependencyError, UnsupportedArchitectureError

from .gguf_arch import ARCHITECTURES, canonical_name
from .gguf_file import read_gguf
from .gguf_write import _permute_rows, architecture_for, gguf_tensor_name

Modules = dict[str, tuple[np.ndarray, np.ndarray, float]]


def read_adapter(path: Path, config: dict[str, Any] | None = None) -> tuple[str, Modules]:
    """(the base's GGUF architecture, the adapter's modules) of GGUF adapter
    ``path``, checked against the base model's ``config`` where given. Q/K ``lora_b`` rows are un-permuted
    for the llama family, as the base weights are, with the heads the file
    states or else those of ``config`` (the base model's config.json; an
    adapter written by llama.cpp's converter states none).

    Raises:
        AdapterFormatError: not a LoRA adapter file, or a pair is incomplete or malformed.
    """
    try:
        file = read_gguf(path)
    except FormatError as exc:
        raise AdapterFormatError(f"{path}: not a readable GGUF file ({exc})") from exc
    try:
        md = file.metadata
        if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
            raise AdapterFormatError(f"{path}: general.type {md.get('general.type')!r} / adapter.type "
                                     f"{md.get('adapter.type')!r}: not a GGUF LoRA adapter (a model file?)")
        gguf_arch = md.get("general.architecture")
        arch = ARCHITECTURES.get(gguf_arch)
        if arch is None:
            raise AdapterFormatError(f"{path}: general.architecture {gguf_arch!r} is not one infer reads")
        base_type = (config or {}).get("model_type")
        if base_type is not None:
            try:
                base_arch = _arch_of(base_type).gguf_name
            except UnsupportedArchitectureError:
                base_arch = base_type
            if base_arch != gguf_arch:
                raise AdapterMismatchError(f"{path}: the adapter is for architecture {gguf_arch!r}; the model is "
                                           f"{base_type!r} ({base_arch!r}): it was made for another base model")
        alpha = float(md.get("adapter.lora.alpha", 0.0))
        pairs: dict[str, dict[str, np.ndarray]] = {}
        for info in file.tensors.values():
            base, _, part = info.name.rpartition(".lora_")
            if part not in ("a", "b"):
                raise AdapterFormatError(f"{path}: tensor {info.name!r} is not a .lora_a / .lora_b factor")
            if info.type.name not in ("F32", "F16", "BF16"):
                raise AdapterFormatError(f"{path}: {info.name} is stored as {info.type.name}; infer reads float "
                                         f"adapters (F32, F16, BF16)")
            raw = file.raw(info)
            value = raw.view("<f4") if info.type.name == "F32" else raw.view("<f2") if info.type.name == "F16" \
                else (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
            pairs.setdefault(base, {})[part] = np.array(value, np.float32).reshape(info.shape)
        layers = 1 + max((int(n.split(".")[1]) for n in pairs if n.startswith("blk.")), default=-1)
        modules: Modules = {}
        for base, ab in pairs.items():
            if set(ab) != {"a", "b"}:
                raise AdapterFormatError(f"{path}: {base} has lora_{''.join(ab)} only")
            a, b = ab["a"], ab["b"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise AdapterFormatError(f"{path}: {base}: lora_a {list(a.shape)} and lora_b {list(b.shape)} are "
                                         f"not [r, in] and [out, r]")
            hf = canonical_name(arch, base, layers)
            if hf is None or not hf.endswith(".weight"):
                raise AdapterFormatError(f"{path}: {base} names no weight of architecture {gguf_arch!r}")
            if arch.permute_qk and base.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = _heads(md, gguf_arch, config or {}, q=base.endswith("attn_q.weight"))
                b = b[np.argsort(_permute_rows(b.shape[0], heads))]  # the inverse of llama.cpp's permute
            rank = a.shape[0]
            modules[hf[:-len(".weight")]] = (a, b, alpha / rank if alpha else 1.0)
        return gguf_arch, modules
    finally:
        file.close()


def _arch_of(model_type: str) -> Any:
    """The GGUF architecture of Hugging Face ``model_type`` (every row infer reads: an adapter
    needs only the tensor names, not the whole-model writer's support)."""
    for arch in ARCHITECTURES.values():
        if model_type == arch.model_type or model_type in arch.also_from:
            return arch
    try:
        return architecture_for(model_type)
    except UnsupportedArchitectureError:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} has no GGUF architecture: its adapters "
                                           f"cannot be written or checked as GGUF") from None


def _heads(md: dict[str, Any], arch: str, config: dict[str, Any], q: bool) -> int:
    """Heads of q or k: from the file (infer's writer states them), else the base model's config."""
    heads = md.get(f"{arch}.attention.head_count" + ("" if q else "_kv"))
    if heads is None:
        heads = config.get("num_attention_heads") if q else (config.get("num_key_value_heads")
                                                             or config.get("num_attention_heads"))
    if not heads:
        raise AdapterFormatError(f"the adapter's {'q' if q else 'k'} rows are in llama.cpp's permuted order and "
                                 f"neither the file nor the base model states the heads to undo it")
    return int(heads)


def write_adapter(path: Path, model_type: str, modules: Modules, config: dict[str, Any],
                  alpha: float | None = None) -> None:
    """Write ``modules`` (``{hf module: (a, b, scale)}``) as a GGUF LoRA adapter
    for a base of ``model_type`` whose ``config`` (config.json) gives the heads
    llama.cpp's Q/K permutation needs. ``alpha`` (default: the first module's
    ``scale * r``) is the file's one ``adapter.lora.alpha``; every module's
    scale is folded into its ``lora_b`` relative to ``alpha / r``.

    Raises:
        UnsupportedArchitectureError: no GGUF architecture writes ``model_type``.
        FormatError: a module has no llama.cpp name.
    """
    try:
        import gguf
    except ImportError as exc:
        raise MissingDependencyError("writing GGUF files needs the gguf package: "
                                     "pip install 'infer-engine[convert]'") from exc
    arch = _arch_of(model_type)
    if not modules:
        raise AdapterFormatError("an adapter without modules has nothing to write")
    if alpha is None:
        a0, _, s0 = next(iter(modules.values()))
        alpha = float(s0 * a0.shape[0])
    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    nh, nkv = config.get("num_attention_heads"), config.get("num_key_value_heads") or config.get("num_attention_heads")
    if arch.permute_qk and nh:  # the reader above un-permutes with these (llama.cpp ignores them)
        writer.add_uint32(f"{arch.gguf_name}.attention.head_count", int(nh))
        writer.add_uint32(f"{arch.gguf_name}.attention.head_count_kv", int(nkv))
    for module, (a, b, scale) in sorted(modules.items()):
        name = gguf_tensor_name(arch, module + ".weight")
        if name is None:
            raise UnsupportedArchitectureError(f"{module} has no llama.cpp name in {arch.gguf_name!r}")
        rank = a.shape[0]
        b = b * np.float32(scale / (alpha / rank))  # llama.cpp multiplies by alpha / r: fold the rest in
        if arch.permute_qk and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = int(nh if name.endswith("attn_q.weight") else nkv)
            b = b[_permute_rows(b.shape[0], heads)]
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a, np.float32))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
