"""Write a GGUF Llama of Llama-3.2-1B's shape with random weights (Q4_K_M types).

The speed of decoding a 1B model is set by its shapes and its blocks' types,
not by what its weights say, so this file stands in for a real Llama 3.2 1B
where none can be downloaded: hidden 2048, 16 layers, 32 heads, 8 KV heads,
MLP 8192, a tied head, each tensor in the type llama-quantize's Q4_K_M mix
gives it (``infer.formats.gguf_write.tensor_type``: Q4_K, with Q6_K for the
head and for the ``attn_v``/``ffn_down`` of the layers it picks). The blocks
are random but finite (``gguf_quants.random_blocks``). The tokenizer is
SmolLM2's (a 49k vocabulary), copied from the catalog's file, so the model
loads and generates like any GGUF file.

    python benchmarks/random_llama.py /tmp/llama-1b-q4_k_m.gguf
    infer bench /tmp/llama-1b-q4_k_m.gguf --backend numpy --peers none
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from infer import catalog
from infer.formats import gguf_quants
from infer.formats.gguf_write import TYPES, tensor_type

SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192)


def tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The ``tokenizer.*`` fields of ``source``: (key, value, type, array item type)."""
    reader = gguf.GGUFReader(str(source))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            item = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], item))
    return out


def write(path: Path, seed: int = 0, context: int = 131072) -> None:
    h, layers, heads, kv, mlp = (SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads", "mlp"))
    head_dim = h // heads
    fields = tokenizer_fields(catalog.model_path("smollm2-135m"))
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    out = TYPES["q4_k_m"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random Llama 1B shape")
    w.add_block_count(layers)
    w.add_context_length(context)  # 131,072 by default (Llama 3.2's): room for benchmarks/run.py's long-context mode
    w.add_embedding_length(h)
    w.add_feed_forward_length(mlp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(out.file_type)
    for key, value, kind, item in fields:
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    matrices = [("token_embd.weight", vocab, h)]
    for i in range(layers):
        p = f"blk.{i}."
        matrices += [(p + "attn_q.weight", h, h), (p + "attn_k.weight", kv * head_dim, h),
                     (p + "attn_v.weight", kv * head_dim, h), (p + "attn_output.weight", h, h),
                     (p + "ffn_gate.weight", mlp, h), (p + "ffn_up.weight", mlp, h), (p + "ffn_down.weight", h, mlp)]
    for n, (name, rows, cols) in enumerate(matrices):
        qtype = tensor_type(name, cols, 2, out, layers, tied=True)
        raw = gguf_quants.random_blocks(qtype, rows, cols, seed + n)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    ones = np.ones(h, np.float32)
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=131072,
                        help="context length in the metadata (default 131072, Llama 3.2's)")
    args = parser.parse_args(argv)
    write(args.path, args.seed, args.context)
    print(f"{args.path}: {args.path.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
