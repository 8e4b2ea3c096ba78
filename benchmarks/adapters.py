"""Decode speed with LoRA adapters against the base model alone, and against
llama.cpp with the same adapter (docs/performance.md).

Rank-16 adapters with random factors on all seven projections of every layer
(``q k v o gate up down``: what PEFT's ``target_modules="all-linear"`` adapts in a
Llama), built in memory. Measured, per backend, in one process and interleaved
(each round runs every case once; the figure is the median over rounds), so the
ratios hold on a loaded machine:

* decode: one decode step of one sequence, base vs one adapter;
* batched decode: one step of ``--batch`` sequences, all base, then 1, 4 and 8
  distinct adapters spread over them (one forward: the mixed batch).

Steps run as the batch engine runs them: sequences in a paged pool, each step
through the captured step (base and adapter rows alike; ``--eager``: the
engine's eager forward instead).

    python benchmarks/adapters.py MODEL --backends numpy,torch:cpu

``--llama-cpp``: the same adapter written as a GGUF adapter (what ``infer
convert`` writes from a PEFT folder) and loaded by llama.cpp
(llama-cpp-python's ``lora_path``) beside infer on a GGUF ``MODEL``: one
sequence's decode step of each, with and without the adapter, interleaved.

    python benchmarks/random_llama.py /tmp/llama-1b-q4_k_m.gguf
    python benchmarks/adapters.py /tmp/llama-1b-q4_k_m.gguf --llama-cpp
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import infer
from infer.adapters import LoraAdapter, LoraModule

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Once upon a time there was a"


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
    return LoraAdapter(f"random-{seed}", modules, alpha=2.0 * rank)


def step_timer(model: infer.Model, adapters: list[str | None]) -> Callable[[], float]:
    """Seconds of one decode step of ``len(adapters)`` sequences (one token each, sequence
    ``i`` with ``adapters[i]``) after an 8-token prompt, in a paged pool as the batch
    engine keeps them; each call rolls the caches back, so every step sees the same lengths."""
    engine, ops = model.engine, model.backend
    prompt = model.tokenizer.encode(PROMPT, add_special_tokens=False)[:8]
    pool = engine.new_kv_pool(block_size=16, num_blocks=4 * len(adapters) + 4)
    seqs = [engine.new_sequence(64, kv_pool=pool, adapter=a) for a in adapters]
    engine.run(engine.prepare(seqs, [prompt] * len(seqs)))

    def step() -> float:
        start = time.perf_counter()
        ops.to_numpy(engine.run(engine.prepare(seqs, [[5]] * len(seqs))).logits)
        elapsed = time.perf_counter() - start
        for seq in seqs:
            engine.truncate(seq, len(prompt))
        return elapsed

    return step


def llama_cpp_timer(model_path: str, lora_path: str | None, prompt: list[int]) -> Callable[[], float]:
    """Seconds of one llama.cpp decode step (``eval`` of one token) after ``prompt``,
    with the adapter at ``lora_path`` (None: the base); rolled back after each."""
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, lora_path=lora_path, lora_scale=1.0, n_ctx=64, n_batch=64,
                n_threads=os.cpu_count(), verbose=False)
    llm.eval(prompt)

    def step() -> float:
        start = time.perf_counter()
        llm.eval([5])
        elapsed = time.perf_counter() - start
        llm.n_tokens = len(prompt)  # the next eval drops the step's position from the cache
        return elapsed

    return step


def report(title: str, times: dict[str, list[float]], rows: dict[str, int], base_of: dict[str, str]) -> None:
    print(title)
    print("| case | tokens/s | vs the base |")
    print("|------|---------:|------------:|")
    for name, values in times.items():
        rate = rows[name] / statistics.median(values)
        base = rows[base_of[name]] / statistics.median(times[base_of[name]])
        print(f"| {name} | {rate:.2f} | {rate / base:.2f}x |", flush=True)


def run_rounds(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    for step in cases.values():  # once each first: traces and first-touch costs stay out of the figures
        step()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):  # interleaved: each round runs every case once
        for name, step in cases.items():
            times[name].append(step())
    return times


def against_base(args: argparse.Namespace) -> None:
    for backend in args.backends.split(","):
        model = infer.load(args.model, backend=backend, compile=False if args.eager else None)
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
        times = run_rounds(cases, args.rounds)
        rows = {k: 1 if k.startswith("decode") else n for k in cases}
        report(f"## {backend} ({args.model}, rank {args.rank}, median of {args.rounds} interleaved steps; "
               f"{'eager' if args.eager else 'captured'} steps; {model.engine.batch_step and model.engine.batch_step.describe()})",
               times, rows, {k: "decode, base" if rows[k] == 1 else f"batch {n}, base" for k in cases})


def against_llama_cpp(args: argparse.Namespace) -> None:
    from infer.adapters.gguf import write_gguf_adapter

    with tempfile.TemporaryDirectory() as tmp:
        lora_path = str(Path(tmp) / "adapter.gguf")
        cases: dict[str, Callable[[], float]] = {}
        for backend in args.backends.split(","):
            model = infer.load(args.model, backend=backend, compile=False if args.eager else None)
            adapter = random_adapter(model, args.rank, 0)
            if not os.path.exists(lora_path):
                write_gguf_adapter(adapter, lora_path, model.config["model_type"], model.config)
            model.load_adapter("a", lora_path)  # the file llama.cpp loads, read back
            cases[f"infer {backend}, base"] = step_timer(model, [None])
            cases[f"infer {backend}, 1 adapter"] = step_timer(model, ["a"])
        prompt = model.tokenizer.encode(PROMPT, add_special_tokens=False)[:8]
        cases["llama.cpp, base"] = llama_cpp_timer(args.model, None, prompt)
        cases["llama.cpp, 1 adapter"] = llama_cpp_timer(args.model, lora_path, prompt)
        times = run_rounds(cases, args.rounds)
        report(f"## decode of one sequence against llama.cpp ({args.model}, rank {args.rank}, median of "
               f"{args.rounds} interleaved steps; vs the same engine's base)", times, dict.fromkeys(cases, 1),
               {k: k.replace("1 adapter", "base") for k in cases})
        print("\n| infer / llama.cpp | base | 1 adapter |\n|---|---:|---:|")
        for backend in args.backends.split(","):
            ratios = [statistics.median(times[f"llama.cpp, {c}"]) / statistics.median(times[f"infer {backend}, {c}"])
                      for c in ("base", "1 adapter")]
            print(f"| {backend} | {ratios[0]:.2f}x | {ratios[1]:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--backends", default="numpy,torch:cpu")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--eager", action="store_true", help="eager steps (no captured step) on both sides")
    parser.add_argument("--llama-cpp", action="store_true", help="one adapter against llama.cpp (a GGUF MODEL)")
    args = parser.parse_args()
    if args.llama_cpp:
        against_llama_cpp(args)
    else:
        against_base(args)


if __name__ == "__main__":
    main()
