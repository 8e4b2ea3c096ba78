"""Decode speed with LoRA adapters against the base model alone (docs/performance.md).

Rank-16 adapters with random factors on all seven projections of every layer
(``q k v o gate up down``: what PEFT's ``target_modules="all-linear"`` adapts in a
Llama), built in memory. Measured, per backend, in one process and interleaved
(each round runs every case once; the figure is the median over rounds), so the
ratios hold on a loaded machine:

* decode: one decode step of one sequence, base vs one adapter;
* batched decode: one step of ``--batch`` sequences, all base, then 1, 4 and 8
  distinct adapters spread over them (one forward: the mixed batch).

    python benchmarks/adapters.py MODEL --backends numpy,torch:cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import infer
from infer.adapters import LoraAdapter, LoraModule

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model: infer.Model, rank: int, seed: int) -> LoraAdapter:
    """Rank-``rank`` factors on every projection of every layer, scale 2."""
    rng = np.random.default_rng(seed)
    modules = {}
    for tensor in model.weight_sources:
        module = tensor.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            out_rows, in_cols = model.package.tensors.shape(tensor)
            a = (rng.standard_normal((rank, in_cols)) / np.sqrt(in_cols)).astype(np.float32)
            b = (rng.standard_normal((out_rows, rank)) * 0.01).astype(np.float32)
            modules[module] = LoraModule(a, b, 2.0)
    return LoraAdapter(f"random-{seed}", modules)


def step_timer(model: infer.Model, adapters: list[str | None]) -> Callable[[], float]:
    """Seconds of one decode step of ``len(adapters)`` sequences (one token each, sequence
    ``i`` with ``adapters[i]``) after an 8-token prompt; each call rolls the caches back, so
    every step sees the same lengths. Eager steps for the base too (the engine's forward),
    so the figures compare the products, not capture."""
    engine, ops = model.engine, model.backend
    prompt = model.tokenizer.encode("Once upon a time there was a", add_special_tokens=False)[:8]
    seqs = [engine.new_sequence(64, adapter=a) for a in adapters]
    engine.run(engine.prepare(seqs, [prompt] * len(seqs)))

    def step() -> float:
        start = time.perf_counter()
        ops.to_numpy(engine.run(engine.prepare(seqs, [[5]] * len(seqs))).logits)
        elapsed = time.perf_counter() - start
        for seq in seqs:
            engine.truncate(seq, len(prompt))
        return elapsed

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--backends", default="numpy,torch:cpu")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    for backend in args.backends.split(","):
        model = infer.load(args.model, backend=backend)
        for i in range(8):
            model.load_adapter(f"a{i}", random_adapter(model, args.rank, i))
        n = args.batch
        cases = {
            "decode, base": step_timer(model, [None]),
            "decode, 1 adapter": step_timer(model, ["a0"]),
            f"batch {n}, base": step_timer(model, [None] * n),
            f"batch {n}, 1 adapter": step_timer(model, ["a0"] * n),
            f"batch {n}, 4 adapters": step_timer(model, [f"a{i % 4}" for i in range(n)]),
            f"batch {n}, 8 adapters": step_timer(model, [f"a{i % 8}" for i in range(n)]),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):  # interleaved: each round runs every case once
            for name, step in cases.items():
                times[name].append(step())
        print(f"## {backend} ({args.model}, rank {args.rank}, median of {args.rounds} interleaved steps)")
        print("| case | tokens/s | vs the base |")
        print("|------|---------:|------------:|")
        for name, values in times.items():
            rows = 1 if name.startswith("decode") else n
            rate = rows / statistics.median(values)
            base = rows / statistics.median(times["decode, base" if rows == 1 else f"batch {n}, base"])
            print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |", flush=True)

if __name__ == "__main__":
    main()
