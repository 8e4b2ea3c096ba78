"""The exact many-row products, tiled kernel against slabs for BLAS, in one process.

For each product (a weight of random GGML blocks, ``m`` activation rows) and each
kernel path this CPU runs, times, alternating round by round:

* the float32 FMA peak loop of the C kernels (``peak("fma512")`` or ``"fma256"``:
  twelve independent chains of one instruction), one thread's most multiply-adds
  a second, times the threads;
* the tiled product (``kernels.native.gemm``, backends/cpu/tiled.c);
* the product as prefill ran it before (``blas``: slabs of the weight dequantized
  on one thread, then numpy's BLAS);
* with ``--small``, the decoding kernel (``gemv``) too, for the rows where it is
  the one in use (up to ``KERNEL_ROWS``);

and prints each one's GFLOP/s (2 m n k / seconds, the median of the rounds: CPU
seconds on one thread, wall seconds on more)
and its fraction of the peak. Threads: ``OMP_NUM_THREADS`` and
``OPENBLAS_NUM_THREADS``, which should name the same number (the kernels' thread
governor stays out of the way when ``OMP_NUM_THREADS`` is set). Run it as

    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 python benchmarks/tiled_gemm.py --rounds 7

``--model FILE`` adds prefills of that GGUF file (``--prompt`` tokens) with the
exact products tiled and on BLAS alternating, in one loaded model (the backend
reads :data:`infer.backends.cpu.kernels.EXACT_GEMM` at each product), as tokens
a second (of CPU time on one thread, of wall time on more) and the median of
per-round ratios (docs/performance.md, "The exact
prefill kernel").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from infer.backends.cpu import kernels
from infer.formats import gguf_quants

PEAK_ITERATIONS = 2_000_000
#: (type, n, k): a 1B-class Llama's products (hidden 2048, MLP 8192, 8 KV heads of 64) in its Q4_K_M
#: types, SmolLM2-135M's (576, 1536), and the legacy types of the catalog files.
SHAPES = [("Q4_K", 2048, 2048), ("Q4_K", 512, 2048), ("Q4_K", 8192, 2048), ("Q6_K", 2048, 8192),
          ("Q4_1", 576, 576), ("Q4_0", 1536, 576), ("Q8_0", 2048, 2048), ("Q5_0", 2048, 2048)]


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)


def peak_rate(kind: str) -> float:
    """Multiply-adds a second of one thread in the peak loop ``kind`` (CPU time: it runs on this thread alone)."""
    start = time.process_time()
    done = kernels.native.peak(kind, PEAK_ITERATIONS)
    return float(done) / (time.process_time() - start)


def products(qtype: str, n: int, k: int, m: int, small: bool) -> dict[str, Callable[[], None]]:
    """The ways to compute one product of ``m`` rows on random ``qtype`` blocks."""
    raw = gguf_quants.random_blocks(qtype, n, k, 0)
    x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    y = np.empty((m, n), np.float32)
    form = kernels.BLOCK_FORMS[qtype]
    group = 256 if qtype.endswith("_K") else 32
    empty = np.empty(0, np.float32)
    rows = max(1, kernels.SLAB_BYTES // (4 * k))
    slab = np.empty((rows, k), np.float32)

    def blas() -> None:
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            kernels.native.dequantize(form, raw[r0:r1], empty, None, slab[:r1 - r0], r1 - r0, k, False, group, False,
                                      0.0)
            np.matmul(x, slab[:r1 - r0].T, out=y[:, r0:r1])

    work = {"tiled": lambda: kernels.native.gemm(form, x, raw, empty, None, y, m, k, n, group, False, 0.0),
            "blas": blas}
    if small and m <= kernels.KERNEL_ROWS:
        work["gemv"] = lambda: kernels.native.gemv(form, x, raw, empty, None, y, m, k, n, group, False, 0.0)
    return work


def seconds(fn: Callable[[], None], repeats: int = 3) -> float:
    """The best of ``repeats`` runs: CPU time on one thread (time spent descheduled on a shared machine does not
    count), wall time on more (their CPU time would count the threads' spinning)."""
    clock = time.process_time if threads() == 1 else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def kernels_table(rounds: int, rows: list[int], small: bool) -> None:
    chosen = kernels.native.simd()
    paths = [p for p in kernels.native.paths() if p != "portable"] or ["portable"]
    t = threads()
    try:
        for path in paths:
            kernels.native.use_simd(path)
            fma = "fma512" if path == "avx512" else "fma256"
            for qtype, n, k in SHAPES:
                for m in rows:
                    work = products(qtype, n, k, m, small)
                    for fn in work.values():
                        fn()
                    times: dict[str, list[float]] = {name: [] for name in work}
                    peaks = []
                    for r in range(rounds):
                        for name in (list(work) if r % 2 == 0 else list(work)[::-1]):
                            times[name].append(seconds(work[name]))
                        peaks.append(peak_rate(fma))
                    peak = 2 * statistics.median(peaks) * t  # FLOP/s on t threads
                    flop = 2 * m * n * k
                    cells = []
                    for name, v in times.items():
                        rate = flop / statistics.median(v)
                        cells.append(f"{name} {rate / 1e9:6.1f} GFLOP/s ({rate / peak:5.1%})")
                    ratio = statistics.median(b / a for a, b in zip(times["tiled"], times["blas"]))
                    print(f"{path:8s} {t} thr {qtype} n={n:5d} k={k:5d} m={m:3d}: " + "; ".join(cells)
                          + f"; blas/tiled {ratio:.2f}x; peak {peak / 1e9:.0f}", flush=True)
    finally:
        kernels.native.use_simd(chosen)


def prefill(path: str, rounds: int, tokens: int) -> None:
    import infer

    model = infer.load(path, backend="numpy")
    tok = model.tokenizer
    ids = tok.encode("The history of the city begins in the ancient times when " * 64)[:tokens]
    prompt = tok.decode(ids)
    n = len(tok.encode(prompt))

    clock = time.process_time if threads() == 1 else time.perf_counter

    def run(how: str) -> float:
        kernels.EXACT_GEMM = how
        start = clock()
        model.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)
        return clock() - start

    ways = ("tiled", "blas")
    for how in ways:
        run(how)
    times: dict[str, list[float]] = {how: [] for how in ways}
    for r in range(rounds):
        for how in (ways if r % 2 == 0 else ways[::-1]):
            times[how].append(run(how))
    kernels.EXACT_GEMM = "tiled"
    ratio = statistics.median(b / a for a, b in zip(times["tiled"], times["blas"]))
    print(f"prefill {n} tokens, {threads()} threads, {os.path.basename(path)}: tiled "
          f"{n / statistics.median(times['tiled']):.1f} tok/s, blas {n / statistics.median(times['blas']):.1f} tok/s, "
          f"tiled / blas {ratio:.2f}x (medians of {rounds}, alternating)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="128", help="activation rows of each product, comma-separated")
    parser.add_argument("--small", action="store_true", help="also time the decoding kernel (rows up to 16)")
    parser.add_argument("--model", action="append", default=[], help="a GGUF file to time prefill on (repeatable)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    if kernels.native is None or not hasattr(kernels.native, "gemm"):
        raise SystemExit("the C kernels (with the tiled product) are not built here")
    if not args.skip_kernels:
        kernels_table(args.rounds, [int(v) for v in args.rows.split(",")], args.small)
    for path in args.model:
        prefill(path, args.rounds, args.prompt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
