"""Prefill and decode rates on torch/cpu, one process against N ranks.

    python benchmarks/tensor_parallel.py MODEL RANKS...     (e.g. gemma3-270m 1 2)

Gemma 3 270M (4 heads, 1 KV head) splits over 2 ranks; SmolLM2-135M (9 heads, 3 KV
heads) over 3, not 2. Prompt 128 tokens, 32 new tokens greedy, median of 3 repeats
after one warm-up; results in docs/distributed.md.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import infer

log = logging.getLogger("benchmarks.tensor_parallel")


def measure(reference: str, ranks: int, repeats: int = 3) -> tuple[float, float]:
    model = infer.load(reference, backend="torch:cpu", tensor_parallel=ranks)
    try:
        ids = (model.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 20)[:128]
        prefill, decode = [], []
        for _ in range(repeats + 1):  # the first run warms up
            seq = model.engine.new_sequence(256)
            t0 = time.perf_counter()
            logits = model.engine.forward(seq, ids)
            token = int(model.backend.to_numpy(model.backend.argmax(logits, -1))[-1])
            t1 = time.perf_counter()
            for _ in range(32):
                logits = model.engine.forward(seq, [token])
                token = int(model.backend.to_numpy(model.backend.argmax(logits, -1))[-1])
            t2 = time.perf_counter()
            model.engine.release(seq)
            prefill.append(len(ids) / (t1 - t0))
            decode.append(32 / (t2 - t1))
        log.info("%s ranks %d: prefill %s, decode %s tok/s", reference, ranks, prefill, decode)
        return statistics.median(prefill[1:]), statistics.median(decode[1:])
    finally:
        model.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("infer").setLevel(logging.WARNING)
    for n in [int(a) for a in sys.argv[2:]]:
        p, d = measure(sys.argv[1], n)
        print(f"{sys.argv[1]} ranks {n}: prefill {p:.1f} tok/s, decode {d:.1f} tok/s", flush=True)
