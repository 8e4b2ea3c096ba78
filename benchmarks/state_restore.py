"""Restoring a saved sequence state against computing its prompt again.

    python benchmarks/state_restore.py [--model smollm2-135m] [--positions 1024,4096] [--backend numpy]

For each length ``n``: a prompt of ``n`` random token ids; the time to the
first new token of a model that computes it (``recompute``: one request,
``Model.complete``); ``Model.save_state`` of its first ``n - 1`` tokens into
a file (it computes them in the batch engine's pool, then writes) and the
file's size; the same save again, the prompt cached now (reading the pool
and writing the file only); then, in a fresh model whose prefix cache is
empty, the time ``Model.load_state`` takes (read, checksum, fingerprint,
into the pool) and the time to the first token of the whole prompt after it
(one position computed). The weights hash is taken once before the timings
(it is remembered across processes). Prints a Markdown table of seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import infer


def fresh(ref: str, backend: str | None, positions: int) -> infer.Model:
    model = infer.load(ref, backend=backend)
    per = model.engine.kv_bytes_per_position()
    model.configure_batching(kv_memory=2 * (positions + 64) * per)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--positions", default="1024,4096")
    parser.add_argument("--backend", default="numpy")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"model {args.model}, backend {args.backend}")
    print("| positions | recompute: s to first token | save_state (computes) s | save_state (cached) s | "
          "file MB | load_state s | first token after load_state s | (load + first token) / recompute |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(p) for p in args.positions.split(",")):
            model = fresh(args.model, args.backend, n)
            vocab = model.network.vocab_size
            ids = [int(t) for t in rng.integers(100, vocab - 100, n)]
            path = Path(tmp) / f"{n}.state"
            start = time.perf_counter()
            model.complete(ids, max_tokens=1)
            recompute = time.perf_counter() - start
            start = time.perf_counter()
            model.save_state(path, ids[:-1])
            compute_and_save = time.perf_counter() - start
            start = time.perf_counter()
            saved = model.save_state(path, ids[:-1])
            save = time.perf_counter() - start
            assert saved.cached_tokens == n - 1
            other = fresh(args.model, args.backend, n)
            start = time.perf_counter()
            restored = other.load_state(path)
            load = time.perf_counter() - start
            start = time.perf_counter()
            done = other.complete(ids, max_tokens=1)
            first = time.perf_counter() - start
            assert restored.cached == n - 1 and done.usage.cached_tokens == n - 1, (restored, done.usage)
            print(f"| {n:,} | {recompute:.2f} | {compute_and_save:.2f} | {save:.2f} | {saved.nbytes / 2**20:.1f} | "
                  f"{load:.2f} | "
                  f"{first:.3f} | {(load + first) / recompute:.3f} |")


if __name__ == "__main__":
    main()
