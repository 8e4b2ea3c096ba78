"""Each sampler's cost per token against plain temperature sampling, at batch 1 and 8.

    python benchmarks/samplers.py [--model smollm2-135m] [--backend numpy] [--tokens 32] [--history 512]

Two figures per sampler setting. "sample": the host time of one
``Sampler.sample`` on the model's real logits (float32 ``[vocab]``, SmolLM2's
49,152 ids) after a ``--history``-token sequence with repeats in it (what DRY
and the penalties scan), median of ``--tokens`` calls. "step @ 1" and "step @ 8":
the wall time of one decode step of the batch engine with 1 and 8 requests,
each sampled with the setting, median over ``--tokens`` steps: the model's
forward plus every request's sampling. Prints a Markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import infer
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions
from infer.engine.sampling import Sampler, SamplingParams

PLAIN = dict(temperature=0.8, seed=1)
SETTINGS: dict[str, dict[str, Any]] = {
    "temperature (baseline)": {},
    "top_k 40 + top_p 0.95 + min_p 0.05": dict(top_k=40, top_p=0.95, min_p=0.05),
    "penalties (repetition 1.1, last 64)": dict(repetition_penalty=1.1, penalty_last_n=64),
    "dry 0.8": dict(dry_multiplier=0.8),
    "xtc 0.5 / 0.1": dict(xtc_probability=0.5, xtc_threshold=0.1),
    "top_n_sigma 1.0": dict(top_n_sigma=1.0),
    "typical_p 0.9": dict(typical_p=0.9),
    "mirostat 1": dict(mirostat=1),
    "mirostat 2": dict(mirostat=2),
    "all of llama.cpp's chain": dict(top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, penalty_last_n=64,
                                     dry_multiplier=0.8, xtc_probability=0.5, top_n_sigma=1.0, typical_p=0.9),
}


def sample_ms(model: Any, logits: np.ndarray, history: list[int], options: dict[str, Any], n: int) -> float:
    breakers = model.dry_breakers(SamplingParams().dry_sequence_breakers)
    sampler = Sampler(SamplingParams(**PLAIN, **options), prompt_tokens=len(history) // 2, breakers=breakers)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sampler.sample(logits, history)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def step_ms(model: Any, prompts: list[list[int]], options: dict[str, Any], n: int) -> float:
    engine = model.engine
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=16, num_blocks=64 * len(prompts)))
    breakers = model.dry_breakers(SamplingParams().dry_sequence_breakers)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(**{**PLAIN, "seed": i, **options})
        batch.submit(prompt, Sampler(params, breakers=breakers), StopConditions(max_tokens=n + 1, ignore_eos=True))
    batch.step()  # the prefill
    times = []
    while batch.running:
        t = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--history", type=int, default=512)
    args = parser.parse_args()
    model = infer.load(args.model, backend=args.backend, progress=False)
    text = "The cat sat on the mat. " * 200
    ids = model.tokenizer.encode(text)[: args.history]
    seq = model.engine.new_sequence()
    logits = model.engine.backend.to_numpy(model.engine.forward(seq, ids))[-1].astype(np.float32)
    model.engine.release(seq)
    prompts = [model.tokenizer.encode(f"Story {i}: once upon a time") for i in range(8)]
    step_ms(model, prompts, {}, args.tokens)  # a warm-up: the first steps of a process are slower
    rows = []
    for name, options in SETTINGS.items():
        rows.append((name, sample_ms(model, logits, ids, options, args.tokens),
                     step_ms(model, prompts[:1], options, args.tokens), step_ms(model, prompts, options, args.tokens)))
    base = rows[0]
    print(f"{args.model} on {args.backend}, vocabulary {logits.size}, history {len(ids)} tokens, "
          f"median of {args.tokens}\n")
    print("| sampler | sample (ms) | step @ 1 (ms) | vs baseline | step @ 8 (ms) | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, one, b1, b8 in rows:
        print(f"| {name} | {one:.2f} | {b1:.1f} | {b1 - base[2]:+.1f} | {b8:.1f} | {b8 - base[3]:+.1f} |")


if __name__ == "__main__":
    main()
