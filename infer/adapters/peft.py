"""PEFT's LoRA folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

What is read from the config: ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern`` and ``alpha_pattern`` (a module's own rank and alpha, matched
as PEFT matches them: the key as a regex on the end of the module name),
``modules_to_save``, and ``target_modules`` (list or regex) to check the file
against. ``fan_in_fan_out`` (GPT-2's Conv1D) needs nothing: PEFT keeps the
factors in ``nn.Linear`` layout whatever the base layer stores, and infer's
GPT-2 reads its Conv1D weights into the same ``[out, in]`` layout.

Refused by name (:class:`~infer.errors.UnsupportedAdapterError`): DoRA
(``use_dora``), trained biases (``bias`` other than ``"none"``, ``lora_bias``),
LoRA on embeddings (``lora_embedding_A``), token additions
(``trainable_token_indices``, or a saved embedding or head with another
vocabulary: :class:`~infer.errors.AdapterResizesEmbeddingsError`), other PEFT
methods.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import AdapterFormatError, AdapterResizesEmbeddingsError, UnsupportedAdapterError
from infer.adapters.lora import LoraAdapter, LoraModule

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: The prefix PEFT saves every tensor name under (its wrapper and the base model's ``model``).
PREFIX = "base_model.model."


def is_peft_folder(path: Path) -> bool:
    """True if ``path`` is a folder holding ``adapter_config.json``."""
    return path.is_dir() and (path / CONFIG).is_file()


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """``patterns``' value for ``module`` (PEFT's ``get_pattern_key``: the
    first key that matches the end of the name, ``(.*\\.)?key$``), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft(path: str | Path) -> LoraAdapter:
    """The LoRA adapter in PEFT folder ``path``.

    Raises:
        AdapterFormatError: the config or weights are missing or malformed.
        UnsupportedAdapterError: DoRA, trained biases, LoRA on embeddings, another PEFT method.
        AdapterResizesEmbeddingsError: the adapter adds tokens.
    """
    folder = Path(path)
    config_path = folder / CONFIG
    if not config_path.is_file():
        raise AdapterFormatError(f"{folder}: no {CONFIG}; a PEFT LoRA folder holds {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterFormatError(f"{config_path}: not readable JSON ({exc})") from exc
    _check_config(config, config_path)
    weights = folder / WEIGHTS
    if not weights.is_file():
        other = " (adapter_model.bin is a pickle, which infer does not read: save with safe_serialization)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise AdapterFormatError(f"{folder}: no {WEIGHTS}{other}")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types on a damaged file
        raise AdapterFormatError(f"{weights}: not a readable safetensors file ({exc})") from exc
    return _adapter(folder, config, tensors)


def _check_config(config: dict[str, Any], where: Path) -> None:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise UnsupportedAdapterError(f"{where}: peft_type {kind!r}; infer runs LoRA adapters only")
    if config.get("use_dora"):
        raise UnsupportedAdapterError(f"{where}: use_dora is set: DoRA adapters (weight-decomposed LoRA) are not "
                                      f"supported; merge it into the base model with PEFT's merge_and_unload")
    if config.get("trainable_token_indices"):
        raise AdapterResizesEmbeddingsError(f"{where}: trainable_token_indices trains token embeddings (added "
                                            f"tokens), which infer does not support")
    if str(config.get("bias", "none")) != "none" or config.get("lora_bias"):
        raise UnsupportedAdapterError(f"{where}: bias={config.get('bias')!r} / lora_bias: adapters that train "
                                      f"biases are not supported (bias must be 'none')")
    for key in ("use_qalora", "layer_replication"):
        if config.get(key):
            raise UnsupportedAdapterError(f"{where}: {key} is set, which infer does not support")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterFormatError(f"{where}: r must be a positive integer, got {config.get('r')!r}")


def _adapter(folder: Path, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> LoraAdapter:
    factors: dict[str, dict[str, np.ndarray]] = {}
    saved: dict[str, np.ndarray] = {}
    for full, tensor in tensors.items():
        name = full[len(PREFIX):] if full.startswith(PREFIX) else full
        if ".lora_embedding_" in name:
            raise UnsupportedAdapterError(f"{folder / WEIGHTS}: {full}: LoRA on an embedding is not supported")
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", name)
        if match:
            factors.setdefault(match.group(1), {})[match.group(2)] = np.asarray(tensor, np.float32)
        elif ".lora_magnitude_vector" in name:
            raise UnsupportedAdapterError(f"{folder / WEIGHTS}: {full}: DoRA magnitudes are not supported")
        elif name.endswith(".bias"):
            raise UnsupportedAdapterError(f"{folder / WEIGHTS}: {full}: trained biases are not supported")
        else:  # a module to save, maybe under PEFT's wrapper name (``modules_to_save.default``)
            saved[re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)] = np.asarray(tensor, np.float32)
    r, alpha = config["r"], config.get("lora_alpha", 8)
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = {}
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterFormatError(f"{folder / WEIGHTS}: module {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterFormatError(f"{folder / WEIGHTS}: module {module}: lora_A {list(a.shape)} and lora_B "
                                     f"{list(b.shape)} are not [r, in] and [out, r]")
        rank = pattern_value(ranks, module, r)
        scale_alpha = pattern_value(alphas, module, alpha)
        scale = scale_alpha / math.sqrt(rank) if config.get("use_rslora") else scale_alpha / rank
        modules[module] = LoraModule(a, b, float(scale))
    if not modules and not saved:
        raise AdapterFormatError(f"{folder / WEIGHTS}: no LoRA factors (lora_A / lora_B) in it")
    return LoraAdapter(str(folder), modules, saved, base_model=config.get("base_model_name_or_path"),
                       alpha=float(alpha))
