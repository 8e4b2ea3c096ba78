"""Per-token decode time inside and outside the numpy backend's C kernels.

    python benchmarks/overhead.py [--model smollm2-135m] [--tokens 128] [--repeats 3] [--eager]

Decodes greedily on the numpy backend and times every call into the C kernels
(``backends/cpu/``: the quantized and few-row products, attention, norms,
rope, and the recorded decode step's whole program, ``run_plan``) with a
wrapper around each; the rest of each token's time is "outside the kernels":
Python, the engine, numpy's small ops, sampling. ``--eager`` decodes without
the recorded step (``infer.load(..., compile=False)``), op by op. Prints the
median over repeats of each, per token. The wrappers add about a microsecond
per call (a few hundred calls per token), counted outside the kernels, so the
figure outside is an upper bound. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from infer.backends import numpy as numpy_backend

import infer

KERNELS = ("gemv", "gemv_f32", "attention", "rms_norm", "rope", "dequantize", "run_plan")


def _timed(kernels: Any, spent: list[float]) -> None:
    for name in KERNELS:
        real = getattr(kernels, name)

        def wrapper(*args: Any, _real: Any = real) -> Any:
            t = time.perf_counter()
            try:
                return _real(*args)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(kernels, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="decode op by op (compile=False)")
    args = parser.parse_args()
    kernels = numpy_backend._affine
    if kernels is None:
        raise SystemExit("the numpy backend's C kernels are not built (or INFER_NUMPY_KERNELS=off)")
    model = infer.load(args.model, backend="numpy", compile=False if args.eager else None)
    prompt = model.tokenizer.encode("The harbour town woke slowly that autumn morning.")
    list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))  # warm-up
    spent = [0.0]
    _timed(kernels, spent)
    inside, outside = [], []
    for _ in range(args.repeats):
        tokens = iter(model.generate_tokens(prompt, max_tokens=args.tokens + 1, ignore_eos=True))
        next(tokens)  # the prefill's token: not a decode step
        spent[0] = 0.0
        start = time.perf_counter()
        for _ in tokens:
            pass
        total = time.perf_counter() - start
        inside.append(spent[0] / args.tokens)
        outside.append((total - spent[0]) / args.tokens)
    step = model.engine.decode_step
    how = step.describe() if step is not None else "eager, op by op"
    print(f"{args.model} on numpy ({kernels.simd()}, {kernels.threads()} threads), {args.tokens} decode tokens, "
          f"median of {args.repeats}; {how}:")
    print(f"  inside the C kernels  {statistics.median(inside) * 1e3:.2f} ms/token")
    print(f"  outside the kernels   {statistics.median(outside) * 1e3:.2f} ms/token")


if __name__ == "__main__":
    main()
