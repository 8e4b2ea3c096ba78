"""The prefill products against the machine's peaks, measured in one process.

For each product (a weight of random GGML blocks, ``m`` activation rows) and each
kernel path this CPU runs, times, alternating round by round:

* the peak loops of the C kernels (``peak``: twelve independent chains of one
  instruction: AVX-512 VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw``+``vpmaddwd``, float32
  FMA), the most multiply-adds a second one thread can do;
* the int8-activation product (``activations="q8"``, backends/cpu/q8.c) on that path;
* the exact product as prefill runs it (slabs dequantized to float32, then numpy's
  BLAS), against the FMA peak.

and prints each one's multiply-adds a second and its fraction of the peak that
bounds it. One thread, and the process's CPU time (not the wall clock): on a
machine other work shares, time spent descheduled does not count, and the
ratios are medians of per-round ratios, so a drift moves both sides alike.
Run it as

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/q8_gemm.py --rounds 7

``--model FILE`` adds a prefill (``--prompt`` tokens) of that GGUF file, exact and
q8 alternating, as tokens a second of wall time (docs/performance.md, "The int8
prefill kernel").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from infer.backends.cpu import kernels
from infer.formats import gguf_quants

PEAK_ITERATIONS = 2_000_000
#: (type, n, k): a 1B-class Llama's products (hidden 2048, MLP 8192) in its Q4_K_M types, and two legacy types.
SHAPES = [("Q4_K", 2048, 2048), ("Q4_K", 2048, 8192), ("Q6_K", 2048, 8192), ("Q4_0", 2048, 2048),
          ("Q8_0", 2048, 2048)]
#: The peak a q8 product on each path is bounded by.
Q8_PEAK = {"avx512": "vnni512", "avx2+fma": "maddubs256"}


def cpu_seconds(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def peak_rate(kind: str) -> float:
    """Multiply-adds a second of one thread's CPU time in the peak loop ``kind``."""
    seconds, done = cpu_seconds(lambda: kernels.native.peak(kind, PEAK_ITERATIONS))
    return float(done) / seconds  # type: ignore[arg-type]


def product(qtype: str, n: int, k: int, m: int, q8: bool) -> Callable[[], None]:
    """One product of ``m`` rows on random ``qtype`` blocks: q8, or exact as prefill runs it (BLAS on slabs)."""
    raw = gguf_quants.random_blocks(qtype, n, k, 0)
    x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    y = np.empty((m, n), np.float32)
    form = kernels.BLOCK_FORMS[qtype]
    group = 256 if qtype.endswith("_K") else 32
    empty = np.empty(0, np.float32)
    if q8:
        return lambda: kernels.native.gemv(form | kernels.Q8_FLAG, x, raw, empty, None, y, m, k, n, group, False, 0.0)
    rows = max(1, kernels.SLAB_BYTES // (4 * k))
    slab = np.empty((rows, k), np.float32)

    def exact() -> None:
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            kernels.native.dequantize(form, raw[r0:r1], empty, None, slab[:r1 - r0], r1 - r0, k, True, group, False, 0.0)
            np.matmul(x, slab[:r1 - r0].T, out=y[:, r0:r1])
    return exact


def kernels_table(rounds: int, m: int) -> None:
    paths = [p for p in kernels.native.paths() if p in Q8_PEAK]
    chosen = kernels.native.simd()
    try:
        for path in paths:
            kernels.native.use_simd(path)
            fma = "fma512" if path == "avx512" else "fma256"
            for qtype, n, k in SHAPES:
                work = {"q8": product(qtype, n, k, m, True), "exact": product(qtype, n, k, m, False)}
                for fn in work.values():
                    fn()
                rates: dict[str, list[float]] = {name: [] for name in (*work, Q8_PEAK[path], fma)}
                for r in range(rounds):
                    order = list(rates) if r % 2 == 0 else list(rates)[::-1]
                    for name in order:
                        if name in work:
                            seconds = min(cpu_seconds(work[name])[0] for _ in range(3))
                            rates[name].append(m * n * k / seconds)
                        else:
                            rates[name].append(max(peak_rate(name) for _ in range(2)))
                med = {name: statistics.median(v) for name, v in rates.items()}
                print(f"{path:9s} {qtype} n={n} k={k} m={m}: q8 {med['q8'] / 1e9:6.1f} G MAC/s "
                      f"({med['q8'] / med[Q8_PEAK[path]]:5.1%} of {Q8_PEAK[path]} {med[Q8_PEAK[path]] / 1e9:.0f}); "
                      f"exact {2 * med['exact'] / 1e9:6.1f} GFLOP/s ({med['exact'] / med[fma]:5.1%} of {fma} "
                      f"{2 * med[fma] / 1e9:.0f} GFLOP/s)", flush=True)
    finally:
        kernels.native.use_simd(chosen)


def prefill(path: str, rounds: int, tokens: int) -> None:
    import infer

    models = {"exact": infer.load(path, backend="numpy"), "q8": infer.load(path, backend="numpy", activations="q8")}
    tok = models["exact"].tokenizer
    prompt = tok.decode(tok.encode("The history of the city begins in the ancient times when " * 64)[:tokens])
    n = len(tok.encode(prompt))

    def run(model: object) -> float:
        start = time.perf_counter()
        model.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)  # type: ignore[attr-defined]
        return time.perf_counter() - start

    for model in models.values():
        run(model)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            times[name].append(run(models[name]))
    ratio = statistics.median(e / q for e, q in zip(times["exact"], times["q8"]))
    print(f"prefill {n} tokens: exact {n / statistics.median(times['exact']):.1f} tok/s, "
          f"q8 {n / statistics.median(times['q8']):.1f} tok/s, q8 / exact {ratio:.2f}x (medians of {rounds})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=128, help="activation rows of each product (a prompt chunk)")
    parser.add_argument("--model", help="a GGUF file to time prefill on, exact and q8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    if kernels.native is None or not hasattr(kernels.native, "peak"):
        raise SystemExit("the C kernels are not built here")
    if not args.skip_kernels:
        kernels_table(args.rounds, args.rows)
    if args.model:
        prefill(args.model, args.rounds, args.prompt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
