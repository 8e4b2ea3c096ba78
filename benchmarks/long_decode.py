"""Decode at long context with float16 and q8_0 pools: tokens per second, and attention's share.

    python benchmarks/long_decode.py MODEL [--positions 4096,16384] [--kv-dtypes float16,q8_0]
        [--activations exact|q8] [--steps 16] [--repeats 3] [--profile]

Decode speed at N positions does not depend on what the cached keys and values
say, only on how many there are, so instead of a prefill of N tokens (minutes
per run on a 1B model) each run fills the cache directly: one real forward
allocates the layers' arrays, every storage layer's rows up to N are then
written with random keys and values (through the backend's own KV write, so a
q8_0 pool holds real blocks), and the cache's length is set to N. Then
``--steps`` greedy decode steps run through the engine's captured step (the
numpy backend's recorded program) and are timed. The kv dtypes alternate
within each repeat (one model loaded per dtype, both kept), and each figure is
the median over ``--repeats``. ``--profile`` also runs the steps eagerly with
the backend's ``attention`` timed, giving the share of a step spent in
attention (the rest is the products, norms and the head).

    python benchmarks/random_llama.py /tmp/llama-1b-q4_k_m.gguf
    python benchmarks/long_decode.py /tmp/llama-1b-q4_k_m.gguf --profile
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import infer


def fill(model: Any, positions: int, seed: int = 0) -> Any:
    """A sequence whose cache holds ``positions`` positions of random keys and values."""
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence(positions + 64)
    engine.forward(seq, [1])
    cache = seq.cache
    rng = np.random.default_rng(seed)
    store = cache.store
    rows = ops.from_numpy(np.arange(1, positions, dtype=np.int32))
    for layer in store.storage_layers(engine.model.num_cache_layers):
        keys, values = store.stored(layer)
        shapes = []
        for new in (cache.read(layer, 0, 1)):  # the written rows' shape in values (a q8_0 pool's in blocks)
            shapes.append(ops.shape(new)[1:])
        k = ops.from_numpy(rng.standard_normal((positions - 1, *shapes[0])).astype(np.float32))
        v = ops.from_numpy(rng.standard_normal((positions - 1, *shapes[1])).astype(np.float32))
        store.set_layer_arrays(layer, ops.scatter_rows(keys, rows, k), ops.scatter_rows(values, rows, v))
    filler = [2] * (positions - 1)
    cache.commit(filler)
    seq.tokens.extend(filler)
    return seq


def decode(model: Any, seq: Any, steps: int) -> float:
    """Tokens per second of ``steps`` greedy steps from ``seq``."""
    engine = model.engine
    token = 3
    start = time.perf_counter()
    for _ in range(steps):
        nxt = engine.greedy_step(seq, token)
        token = nxt if nxt is not None else int(model.backend.to_numpy(engine.forward(seq, [token])).argmax())
    return steps / (time.perf_counter() - start)


def attention_share(model: Any, seq: Any, steps: int) -> float:
    """The fraction of ``steps`` eager decode steps spent in the backend's attention."""
    ops, engine = model.backend, model.engine
    spent = [0.0]
    original = ops.attention

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    ops.attention = timed
    try:
        start = time.perf_counter()
        token = 3
        for _ in range(steps):
            token = int(ops.to_numpy(engine.forward(seq, [token])).argmax())
        total = time.perf_counter() - start
    finally:
        del ops.attention
    return spent[0] / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--positions", default="4096,16384")
    parser.add_argument("--kv-dtypes", default="float16,q8_0")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--activations", choices=["exact", "q8"], default="exact",
                        help="the products' activations (q8: int8, approximate)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dtypes = args.kv_dtypes.split(",")
    options = {} if args.activations == "exact" else {"activations": args.activations}
    models = {d: infer.load(args.model, backend="numpy", kv_dtype=d, **options) for d in dtypes}
    print("| positions | kv_dtype | decode tok/s (median) | runs | attention share (eager) |")
    print("|---|---|---|---|---|")
    for n in (int(p) for p in args.positions.split(",")):
        rates: dict[str, list[float]] = {d: [] for d in dtypes}
        shares: dict[str, float] = {}
        for r in range(args.repeats + 1):  # the first round records the captured steps
            for d in dtypes:
                seq = fill(models[d], n, seed=r)
                rate = decode(models[d], seq, args.steps)
                if r:
                    rates[d].append(rate)
                if args.profile and r == args.repeats:
                    shares[d] = attention_share(models[d], seq, max(4, args.steps // 4))
                models[d].engine.release(seq)
        for d in dtypes:
            share = f"{100 * shares[d]:.0f}%" if d in shares else "-"
            print(f"| {n:,} | {d} | {statistics.median(rates[d]):.2f} | "
                  f"{', '.join(f'{x:.2f}' for x in rates[d])} | {share} |", flush=True)


if __name__ == "__main__":
    main()
