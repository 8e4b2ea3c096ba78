"""Prefill, greedy decode and batched decode of one model, in one process: the
figures docs/performance.md ("One forward for every batch") compares across
two checkouts, each run in its own environment, alternating.

    python benchmarks/decode_paths.py [--model smollm2-135m] [--backend numpy] [--repeats 3]

Prefill is one 128-token forward on a contiguous cache; decode is 128 greedy
steps after it through the engine's captured step where the backend captures
(numpy's recorded program by default); batched is 4 requests of 64 new tokens
each through the batch engine on a paged pool. Each figure is the median of
``--repeats`` runs after one warm-up generation (which records the programs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import infer
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = infer.load(args.model, backend=args.backend)
    engine = model.engine
    prompt = model.tokenizer.encode("Once upon a time, " * 20)[:128]
    list(generate(engine, prompt[:16], SamplingParams(), StopConditions(max_tokens=8, ignore_eos=True)))
    prefill, decode = [], []
    for _ in range(args.repeats):
        seq = engine.new_sequence(512)
        t0 = time.perf_counter()
        out = engine.forward(seq, prompt)
        t1 = time.perf_counter()
        token = int(model.backend.to_numpy(out).argmax())
        for _ in range(128):
            nxt = engine.greedy_step(seq, token)
            token = nxt if nxt is not None else int(model.backend.to_numpy(engine.forward(seq, [token])).argmax())
        t2 = time.perf_counter()
        engine.release(seq)
        prefill.append(len(prompt) / (t1 - t0))
        decode.append(128 / (t2 - t1))
    batch = model.configure_batching(kv_layout="paged", kv_memory=2**26)
    t0 = time.perf_counter()
    for i in range(4):
        batch.submit(prompt[:100 + i], infer.SamplingParams(), infer.StopConditions(max_tokens=64, ignore_eos=True))
    batch.run_until_done()
    batched = 4 * 64 / (time.perf_counter() - t0)
    print(f"prefill {statistics.median(prefill):.1f} tok/s  decode {statistics.median(decode):.1f} tok/s  "
          f"batch 4x64 {batched:.1f} tok/s")


if __name__ == "__main__":
    main()
