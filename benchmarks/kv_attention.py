"""One decode step's attention over a float32 pool and over the same pool in float16 and in q8_0.

    python benchmarks/kv_attention.py [--positions 256,1024,4096,16384] [--repeats 30]
    INFER_NUMPY_KERNELS=portable python benchmarks/kv_attention.py   # the kernels' fallback path

A layer of Llama-3.2-1B's shape (32 query heads over 8 KV heads of 64), one
query row, through the numpy backend's ``attention`` (its C kernel): float32
keys and values, then the same values stored as float16 and as q8_0 blocks
(``kv_dtype``), alternating, medians of ``--repeats``. Prints milliseconds per
call and the ratios to float32; float16 gives float32's bits
(tests/test_numpy_kernels.py), q8_0 is approximate (tests/test_kv_q8_0.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from infer.oplib import quantize_q8_0
from infer.ops import AttentionBatch
from infer.plugins.selection import select_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", default="256,1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    ops = select_backend("numpy")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, 64)).astype(np.float32)
    print("| positions | float32 pool ms | float16 pool ms | q8_0 pool ms | float16 / float32 | q8_0 / float32 |")
    print("|---|---|---|---|---|---|")
    for n in (int(p) for p in args.positions.split(",")):
        k = rng.standard_normal((n, 8, 64)).astype(np.float32)
        v = rng.standard_normal((n, 8, 64)).astype(np.float32)
        pools = {"float32": (k, v), "float16": (k.astype(np.float16), v.astype(np.float16)),
                 "q8_0": (quantize_q8_0(k), quantize_q8_0(v))}
        host = AttentionBatch(np.array([0, 1], np.int32), np.array([n], np.int32), np.array([[0]], np.int32),
                              block_size=n, max_query=1)
        batch = AttentionBatch(host.query_start, host.seq_lens, host.block_tables, n, 1, host)
        times: dict[str, list[float]] = {name: [] for name in pools}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, (kp, vp) in pools.items():
                start = time.perf_counter()
                ops.attention(q, kp, vp, batch, scale=0.125)
                times[name].append(time.perf_counter() - start)
        f32, f16, q8 = (1000 * float(np.median(times[name][1:])) for name in ("float32", "float16", "q8_0"))
        print(f"| {n:,} | {f32:.3f} | {f16:.3f} | {q8:.3f} | {f16 / f32:.2f} | {q8 / f32:.2f} |")


if __name__ == "__main__":
    main()
