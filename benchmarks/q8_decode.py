"""Decoding's products (one activation row) on the stored blocks, exact against q8.

    python benchmarks/q8_decode.py [--rounds 9] [--threads 2]

For each shape (a weight of random GGML blocks of the catalog models' and the
1B-class model's types and widths), times one-row products with exact float32
activations (backends/cpu/x86/blocks_x86.c, the blocks decoded in registers)
and with ``activations="q8"`` (backends/cpu/x86/q8row_x86.c, int8 dot products
on the blocks as stored), alternating within each round, and prints each one's
weight bytes read a second (wall clock, the OpenMP threads of a decode step)
and q8's time over exact's (the median of per-round ratios, so a drift in the
machine's load moves both sides alike). A product that reads the weight at
the memory's speed is bound by it; one below it is bound by its arithmetic
(docs/performance.md, "Decoding on int8 activations").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

#: (type, n, k, where): the 1B-class model's Q4_K_M products (Q6_K: its value and down projections and the tied
#: head), Gemma 3 270M's (head Q8_0 over 640 columns, Q5_0 layers) and SmolLM2-135M's (Q4_1 over 576 columns).
SHAPES = [("Q4_K", 2048, 2048, "1B q, o"), ("Q4_K", 8192, 2048, "1B gate, up"), ("Q6_K", 2048, 8192, "1B down"),
          ("Q6_K", 32768, 2048, "1B head (a quarter)"), ("Q8_0", 65536, 640, "Gemma 3 head (a quarter)"),
          ("Q5_0", 2048, 640, "Gemma 3 gate, up"), ("Q4_1", 1536, 576, "SmolLM2 gate, up"),
          ("Q4_1", 576, 1536, "SmolLM2 down"), ("Q8_0", 49152, 576, "SmolLM2 head")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20, help="products timed together in one measurement")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (set before the kernels load)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from infer.backends.cpu import kernels
    from infer.formats import gguf_quants

    native = kernels.native
    if native is None or not kernels.Q8_FLAG:
        raise SystemExit("the C kernels are not built here")
    print(f"paths {native.paths()}, chosen {native.simd()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print("| product | type | n x k | exact GB/s | q8 GB/s | q8 / exact time |")
    print("|---|---|---|---|---|---|")
    for qtype, n, k, where in SHAPES:
        raw = gguf_quants.random_blocks(qtype, n, k, 0)
        form = kernels.BLOCK_FORMS[qtype]
        group = 256 if qtype.endswith("_K") else 32
        x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
        y = np.empty((1, n), np.float32)
        empty = np.empty(0, np.float32)

        def timed(flag: int) -> float:
            start = time.perf_counter()
            for _ in range(args.calls):
                native.gemv(form | flag, x, raw, empty, None, y, 1, k, n, group, False, 0.0)
            return (time.perf_counter() - start) / args.calls

        timed(0), timed(kernels.Q8_FLAG)  # warm: the weight's pages, the threads
        exact, q8, ratio = [], [], []
        for _ in range(args.rounds):
            e, q = timed(0), timed(kernels.Q8_FLAG)
            exact.append(e), q8.append(q), ratio.append(q / e)
        e, q = statistics.median(exact), statistics.median(q8)
        print(f"| {where} | {qtype} | {n} x {k} | {raw.nbytes / e / 1e9:.1f} | {raw.nbytes / q / 1e9:.1f} "
              f"| {statistics.median(ratio):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
