"""Write GGUF hybrids of Qwen3.5-0.8B's and LFM2-1.2B's shapes with random weights (Q4_K_M types).

As for ``benchmarks/random_llama.py``: a model's speed is set by its shapes and
its tensors' types, not by what its weights say, so these files stand in for
the real models where none can be downloaded, and are written in seconds
(quantizing 0.7-1.2B random float weights to Q4_K in numpy would take most of
an hour). Tensor names, shapes and metadata are the ones llama.cpp's converter
writes:

* ``qwen35-0.8b-shape``: hidden 1024, 24 layers (3 gated-DeltaNet : 1 full
  attention), MLP 3584, 8 query / 2 KV heads of 256, DeltaNet 16 key and value
  heads of 128, a tied 248,320-token head. Names, shapes and ``qwen35.*`` keys
  come from ``infer convert``'s own writer (:mod:`infer.formats.gguf_write`,
  checked against llama.cpp's converter), planned from a transformers model
  built on the meta device, so no weights are ever materialized.
* ``lfm2-1.2b-shape``: hidden 2048, 16 layers (10 short convolutions : 6 GQA
  layers at 2, 5, 8, 10, 12, 14), 32 query / 8 KV heads, MLP 8192 adjusted by
  Liquid's rule to 5632, a tied 65,536-token head; names from the ``gguf``
  package's tensor map, keys as convert_hf_to_gguf.py's ``LFM2Model`` writes
  them (``infer convert`` does not write LFM2).

Each matrix is in the type llama-quantize's Q4_K_M mix gives it
(:func:`infer.formats.gguf_write.tensor_type`), its blocks random but finite
(:func:`infer.formats.gguf_quants.random_blocks`); norms are ones, the
DeltaNet's decay ``ssm_a`` negative, convolutions small. The tokenizer is
SmolLM2's, padded with plain tokens to the model's vocabulary.

    python benchmarks/random_hybrid.py qwen35 /tmp/qwen35-0.8b-q4_k_m.gguf
    infer bench /tmp/qwen35-0.8b-q4_k_m.gguf --backend numpy --peers llama.cpp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from infer import catalog
from infer.formats import gguf_quants
from infer.formats.gguf_write import TYPES, tensor_type

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_llama import tokenizer_fields  # noqa: E402

#: family -> (transformers config class, its fields).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen35": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, full_attention_interval=4,
        vocab_size=248320, max_position_embeddings=262144, tie_word_embeddings=True)),
    "lfm2": ("Lfm2Config", dict(
        hidden_size=2048, intermediate_size=8192, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
        block_multiple_of=256, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3, vocab_size=65536, max_position_embeddings=128000,
        tie_word_embeddings=True)),
}


def _config(family: str) -> Any:
    import transformers

    class_name, fields = FAMILIES[family]
    return getattr(transformers, class_name)(**fields)


def _shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of the model, built on the meta device (no memory)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


class _Shapes:
    """Just enough of a tensor source for the writer's planning: names and shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._shapes = shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


class _Package:
    def __init__(self, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> None:
        self.tensors, self.config, self.path = _Shapes(shapes), config, None


def _qwen35(config: Any) -> tuple[str, dict[str, Any], list[tuple[str, tuple[int, ...], str]]]:
    from infer.formats.gguf_arch import ARCHITECTURES
    from infer.formats.gguf_write import _plan, hyperparameters

    arch = ARCHITECTURES["qwen35"]
    cfg = config.to_dict()
    md, freqs = hyperparameters(arch, cfg)
    plan = _plan(_Package(_shapes(config), cfg), arch, TYPES["q4_k_m"], freqs, cfg)
    return "qwen35", md, [(p.gguf, tuple(p.shape), p.qtype) for p in plan]


def _lfm2(config: Any) -> tuple[str, dict[str, Any], list[tuple[str, tuple[int, ...], str]]]:
    from infer.architectures.lfm2 import read_config

    cfg = config.to_dict()
    layers = cfg["num_hidden_layers"]
    md = {"block_count": layers, "context_length": cfg["max_position_embeddings"],
          "embedding_length": cfg["hidden_size"], "feed_forward_length": read_config(cfg).ff_dim(),
          "attention.head_count": cfg["num_attention_heads"],
          "attention.head_count_kv": [cfg["num_key_value_heads"] if t == "full_attention" else 0
                                      for t in cfg["layer_types"]],
          "attention.layer_norm_rms_epsilon": cfg["norm_eps"],
          "rope.freq_base": cfg["rope_parameters"]["rope_theta"], "shortconv.l_cache": cfg["conv_L_cache"],
          "vocab_size": cfg["vocab_size"]}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, layers)
    tensors = []
    for hf, shape in _shapes(config).items():
        if hf == "lm_head.weight":  # tied
            continue
        base, _, suffix = hf.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        qtype = tensor_type(name, shape[-1], len(shape), TYPES["q4_k_m"], layers, tied=True)
        if hf.endswith("conv.conv.weight"):
            # [channels, 1, K] -> [channels, K], as the converter squeezes it; float32, as llama.cpp's
            # ssm_conv reads it (it aborts on float16)
            shape, qtype = (shape[0], shape[2]), "F32"
        tensors.append((name, shape, qtype))
    return "lfm2", {f"lfm2.{k}": v for k, v in md.items()}, tensors


def _float_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Plausible float tensors: norms ones, decays negative, the rest small."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
    if len(shape) == 1:
        return np.zeros(shape, np.float32)
    return rng.normal(0.0, 0.1, shape).astype(np.float32)


def write(family: str, path: Path, seed: int = 0) -> None:
    """Write ``family``'s file (a key of :data:`FAMILIES`) to ``path``."""
    from infer.formats.gguf_write import _add

    config = _config(family)
    arch, md, tensors = (_qwen35 if family == "qwen35" else _lfm2)(config)
    vocab = config.vocab_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random {family} shape")
    w.add_file_type(TYPES["q4_k_m"].file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in md.items():
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            _add(w, key, value)
    for key, value, kind, item in tokenizer_fields(catalog.model_path("smollm2-135m")):
        if kind == gguf.GGUFValueType.ARRAY and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                        "tokenizer.ggml.scores"):
            # Plain tokens no merge makes: the vocabulary's size, none of its tokenizer's cost.
            have = len(value)
            pad = ([f"<extra_{i}>" for i in range(have, vocab)] if key.endswith("tokens") else
                   [1] * (vocab - have) if key.endswith("token_type") else [0.0] * (vocab - have))
            w.add_array(key, list(value) + pad)
        elif kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    rng = np.random.default_rng(seed)
    for n, (name, shape, qtype) in enumerate(tensors):
        if qtype in ("F32", "F16"):
            value = _float_values(name, shape, rng)
            w.add_tensor(name, value if qtype == "F32" else value.astype(np.float16))
        else:
            raw = gguf_quants.random_blocks(qtype, int(np.prod(shape[:-1])), shape[-1], seed + n)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.family, args.path, args.seed)
    print(f"{args.path}: {args.path.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
