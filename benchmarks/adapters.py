"""Decode speed with LoRA adapters against the base model alone (docs/performance.md).

Rank-16 adapters with random factors on all seven projections of every layer
(``q k v o gate up down``: what PEFT's ``target_modules="all-linear"`` adapts in a
Llama), built in memory. Measured, per backend, in one process and interleaved
(each round runs every case once; the figure is the median over rounds), so the
ratios hold on a loaded machine:

* decode: one sequence, greedy, ``--tokens`` new tokens, base vs one adapter;
* batched decode: ``--batch`` sequences in one continuous batch (the batch
  engine), all base, then 1, 4 and 8 distinct adapters spread over them.

    python benchmarks/adapters.py MODEL --backends numpy,torch:cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def decode_rate(model: infer.Model, adapter: str | None, tokens: int) -> float:
    start = time.perf_counter()
    model.generate("Once upon a time", adapter=adapter, max_tokens=tokens, ignore_eos=True, temperature=0)
    return tokens / (time.perf_counter() - start)


def batched_rate(model: infer.Model, adapters: list[str | None], tokens: int) -> float:
    prompts = [f"Story {i}: once upon a time" for i in range(len(adapters))]
    start = time.perf_counter()
    model.generate(prompts, adapter=adapters, max_tokens=tokens, ignore_eos=True, temperature=0)
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--backends", default="numpy,torch:cpu")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for backend in args.backends.split(","):
        model = infer.load(args.model, backend=backend)
        for i in range(8):
            model.load_adapter(f"a{i}", random_adapter(model, args.rank, i))
        n = args.batch
        cases = {
            "decode, base": lambda: decode_rate(model, None, args.tokens),
            "decode, 1 adapter": lambda: decode_rate(model, "a0", args.tokens),
            f"batch {n}, base": lambda: batched_rate(model, [None] * n, args.tokens),
            f"batch {n}, 1 adapter": lambda: batched_rate(model, ["a0"] * n, args.tokens),
            f"batch {n}, 4 adapters": lambda: batched_rate(model, [f"a{i % 4}" for i in range(n)], args.tokens),
            f"batch {n}, 8 adapters": lambda: batched_rate(model, [f"a{i % 8}" for i in range(n)], args.tokens),
        }
        for fn in cases.values():  # warm up (captured steps, caches)
            fn()
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                rates[name].append(fn())
        print(f"## {backend} ({args.model}, rank {args.rank}, {args.tokens} tokens, {args.rounds} rounds)")
        base = {"decode": statistics.median(rates["decode, base"]),
                "batch": statistics.median(rates[f"batch {n}, base"])}
        for name, values in rates.items():
            med = statistics.median(values)
            ref = base["decode" if name.startswith("decode") else "batch"]
            print(f"| {name} | {med:.1f} tok/s | {med / ref:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
