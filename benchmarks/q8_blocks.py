"""What the activations' block size costs in quality: int8 rows per 32 values
(what ``activations="q8"`` does for every weight type) against llama.cpp's
Q8_K (one scale per 256 values), which ggml uses for K-quant weights.

    python benchmarks/q8_blocks.py [gemma3-270m smollm2-135m] [--text FILE] [--window 512]

Each model is loaded exact on the numpy backend, and again on a numpy backend
whose products on quantized weights first round each activation row to int8
in blocks of ``B`` values (one scale ``max|x| / 127`` each, codes
``rint(x * 127 / max|x|)``, ggml's rounding) and then multiply exactly:
``W @ round(x)``, which is what the q8 kernels compute (their integer sums are
exact; only the float order of the scales differs). ``B = 32`` checks the
emulation against the q8 mode's own KL (benchmarks/q8_quality.py); ``B = 256``
on the K-quant products only is Q8_K's rounding (llama.cpp keeps Q8_0/Q8_1's
32-blocks for the other types). Reported: mean KL(exact ‖ rounded) over the
same 512-token windows as benchmarks/q8_quality.py. docs/quantization.md
("Why the activations keep 32-value blocks") comes from here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain.txt"


def round_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """Rows of ``x`` rounded to int8 per ``block`` values, back in float32."""
    k = x.shape[-1]
    b = x.reshape(-1, k // block, block).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.clip(np.rint(b * inv), -127, 127) * d).astype(np.float32).reshape(x.shape)


def rounding_backend(k_block: int):  # type: ignore[no-untyped-def]
    """numpy, with the inputs of products on quantized weights rounded first
    (two or more rows, as the q8 mode): per ``k_block`` values for K-quant
    weights, per 32 for the others."""
    from infer.backends.numpy import NumpyBackend
    from infer.ops import PackedWeight

    class Rounded(NumpyBackend):
        def linear(self, x, weight, bias=None):  # type: ignore[no-untyped-def]
            if isinstance(weight, PackedWeight) and x.size // x.shape[-1] >= 2:
                block = k_block if weight.qtype.endswith("_K") else 32
                x = round_blocks(np.asarray(x, np.float32), block)
            return super().linear(x, weight, bias)

    return Rounded()


def main() -> int:
    import infer
    from infer.engine.scoring import kl_divergence

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gemma3-270m", "smollm2-135m"])
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--blocks", default="32,256", help="block sizes to try (default 32,256)")
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    print("| model | activations | tokens | mean KL(exact ‖ rounded) (nats/token) | same top token |")
    print("|---|---|---|---|---|")
    for m in args.models:
        exact = infer.load(m, backend="numpy")
        for block in (int(b) for b in args.blocks.split(",")):
            rounded = infer.load(m, backend=rounding_backend(block))
            d = kl_divergence(exact, rounded, text, window=args.window, progress=True)
            label = "int8 per 32 (the q8 mode's rounding)" if block == 32 else \
                f"int8 per {block} on K-quant products, per 32 elsewhere"
            print(f"| {m} | {label} | {len(d.kl)} | {d.mean:.3e} | {100 * d.top_agreement:.2f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
