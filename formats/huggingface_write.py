"""Writing a model package as a Hugging Face folder that transformers loads.

The reverse of :mod:`infer.formats.huggingface`: ``config.json`` (the
package's hyperparameters plus ``architectures`` and ``dtype``),
``model.safetensors`` written with the ``safetensors`` package -- split into
``model-0000i-of-0000n.safetensors`` shards with a
``model.safetensors.index.json`` above :data:`SHARD_BYTES` -- and, from the
package's tokenizer, ``tokenizer.json``, ``tokenizer_config.json`` (special
tokens, BOS/EOS flags, chat template) and ``generation_config.json``.
Quantized weights are dequantized (bit-exact with ggml) and stored as the
chosen float type; only one shard's tensors are in memory at a time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import ConfigError, MissingDependencyError, UnsupportedArchitectureError
from infer.ops import QuantizedTensor
from infer.package import ModelPackage

log = logging.getLogger(__name__)

#: ``--type`` -> the safetensors dtype the weights are stored in.
TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
#: Above this many bytes of weights the checkpoint is split into shards of at most this size.
SHARD_BYTES = 2 * 1024**3

#: transformers' model class for each model_type infer reads.
CLASS_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
CLASS_NAMES.update({"mamba2": "Mamba2ForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
                    "falcon_h1": "FalconH1ForCausalLM"})  # from GGUF: formats/gguf_ssm.py
CLASS_NAMES.update({"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                    "qwen3_next": "Qwen3NextForCausalLM"})
_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _shards(package: ModelPackage, dtype: str, limit: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``limit`` bytes (a bigger tensor alone)."""
    size = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    shards: list[list[str]] = [[]]
    used = 0
    for name in package.tensors.names():
        n = int(np.prod(package.tensors.shape(name))) * size
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def _save(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """One safetensors file; bfloat16 goes through torch (numpy has no bfloat16)."""
    try:
        import safetensors.numpy
    except ImportError as exc:
        raise MissingDependencyError("writing Hugging Face folders needs the safetensors package: "
                                     "pip install 'infer-engine[convert]'") from exc
    if dtype != "BF16":
        safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
        return
    try:
        import torch
        from safetensors.torch import save_file as save_torch
    except ImportError as exc:
        raise MissingDependencyError("writing bfloat16 safetensors needs torch (pip install torch); "
                                     "or convert with --type f32 / f16") from exc
    save_torch({k: torch.from_numpy(np.array(v, dtype=np.float32)).to(torch.bfloat16) for k, v in tensors.items()},
               str(path), metadata={"format": "pt"})


def _config(package: ModelPackage, dtype: str) -> dict[str, Any]:
    config = dict(package.config)
    model_type = package.model_type
    if model_type == "llama" and config.get("sliding_window"):
        # GGUF's llama architecture carries Mistral too; only Mistral's class slides a window.
        model_type = "mistral"
    if model_type not in CLASS_NAMES:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} has no transformers class known here; "
                                           f"supported: {', '.join(sorted(CLASS_NAMES))}")
    rope = config.get("rope_parameters") or {}
    if any(isinstance(r, dict) and r.get("freq_factors") is not None for r in [rope, *rope.values()]):
        raise ConfigError(f"{package.path}: the rope's per-frequency divisors (a GGUF rope_freqs tensor that "
                          "follows no rule a config.json names) have no form transformers reads")
    # GGUF stores floats as float32: write the shortest decimal of that float32 (1e-06, not
    # 9.99999997e-07), which is what the model's own config.json said.
    config = {k: _short(v) for k, v in config.items()}
    config["model_type"] = model_type
    config["architectures"] = [CLASS_NAMES[model_type]]
    config["dtype"] = _TORCH_DTYPES[dtype]
    return config


def _short(value: Any) -> Any:
    if isinstance(value, float) and np.isfinite(value) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def _tokenizer_files(package: ModelPackage, path: Path) -> None:
    tok = package.tokenizer
    if tok is None:
        log.warning("%s has no tokenizer: the folder gets no tokenizer.json", package.path)
        return
    (path / "tokenizer.json").write_text(tok.backend.to_str(pretty=True), encoding="utf-8")
    empty = tok.encode("")
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
        "add_bos_token": tok.bos_token_id is not None and empty[:1] == [tok.bos_token_id],
        "add_eos_token": tok.eos_token_id is not None and empty[-1:] == [tok.eos_token_id],
        "clean_up_tokenization_spaces": False,
        "model_max_length": package.config.get("max_position_embeddings", 2048),
    }
    templates = tok.chat_templates
    if templates:
        settings["chat_template"] = (templates["default"] if list(templates) == ["default"] else
                                     [{"name": k, "template": v} for k, v in templates.items()])
    settings = {k: v for k, v in settings.items() if v is not None}
    (path / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")


def _generation_config(package: ModelPackage) -> dict[str, Any]:
    g = package.generation
    ends = list(g.eos_token_ids)
    out: dict[str, Any] = {"bos_token_id": g.bos_token_id,
                           "eos_token_id": ends[0] if len(ends) == 1 else (ends or None)}
    out.update(g.sampling_overrides())
    if g.max_new_tokens is not None:
        out["max_new_tokens"] = g.max_new_tokens
    return {k: v for k, v in out.items() if v is not None}


def write_folder(package: ModelPackage, path: Path, *, type: str = "f32", progress: bool | None = None,
                 shard_bytes: int | None = None) -> None:
    """Write ``package`` as a Hugging Face folder ``path`` (created; the caller owns it),
    weights stored as ``type`` (a key of :data:`TYPES`). ``progress``: a tqdm bar on
    stderr (None: only on a terminal). ``shard_bytes``: split the weights into
    shards of at most this size (default :data:`SHARD_BYTES`).

    Raises:
        UnsupportedArchitectureError: no transformers class is known for the model type.
        ConfigError: a setting with no config.json form (a rope's ``freq_factors``).
        MissingDependencyError: ``bf16`` without torch installed.
    """
    from tqdm.auto import tqdm

    dtype = TYPES[type]
    config = _config(package, dtype)
    path.mkdir(parents=True, exist_ok=False)
    shards = _shards(package, dtype, SHARD_BYTES if shard_bytes is None else shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    index: dict[str, str] = {}
    total = sum(int(np.prod(package.tensors.shape(n))) for n in package.tensors.names())
    with tqdm(total=total, unit="value", unit_scale=True, desc=f"{path.name} ({type})",
              disable=None if progress is None else not progress, leave=False) as bar:
        for file_name, shard in zip(names, shards):
            tensors = {}
            for name in shard:
                value = package.tensors.get(name)
                if isinstance(value, QuantizedTensor):
                    value = value.dequantize()
                value = np.asarray(value)
                tensors[name] = value.astype(np.float32 if dtype in ("F32", "BF16") else np.float16, copy=False)
                index[name] = file_name
                bar.update(value.size)
            _save(tensors, path / file_name, dtype)
            for name in shard:
                package.tensors.release(name)
    if len(shards) > 1:
        size = {"F32": 4, "F16": 2, "BF16": 2}[dtype] * total
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": size}, "weight_map": index}, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / "generation_config.json").write_text(json.dumps(_generation_config(package), indent=2) + "\n")
    _tokenizer_files(package, path)
