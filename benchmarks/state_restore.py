"""Restoring a saved sequence state against computing its prompt again.

    python benchmarks/state_restore.py [--model smollm2-135m] [--positions 1024,4096] [--backend numpy]
    python benchmarks/random_llama.py /tmp/llama-1b.gguf
    python benchmarks/state_restore.py --model /tmp/llama-1b.gguf --positions 4096,16384

For each length ``n``: a prompt of ``n`` random token ids. ``recompute``: the
time to the first new token of a model whose prefix cache is empty, through
the batch engine (the prompt prefilled in its chunks of ``max_batch_tokens``,
as the server does; one long forward would hold activations of every
position at once). ``save_state`` of the whole prompt on that model: its
blocks are cached then, so it computes only the partial last block and the
logits after it, and writes the file (its size is listed). Then, in a fresh
model: ``load_state`` (read, checksum, fingerprint, into the pool), the time
to the first token of exactly the saved prompt (nothing computed: the
logits after its last token are in the file) and of the prompt with 16 more
tokens (those 16 computed). The weights hash is taken once before the
timings (it is remembered across processes), and each fresh model serves
one short request first (its first forward's one-off preparations are no
part of either way). ``--repeats`` runs each
timing that many times and reports the median. Prints a Markdown table of seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import infer
from infer.engine.generate import StopConditions
from infer.kv.fingerprint import weights_hash

#: Tokens the continued request adds after the saved prompt.
MORE = 16


def fresh(ref: str, backend: str | None, positions: int) -> infer.Model:
    """A model whose batch engine's pool holds ``positions`` (and the continuation) twice over."""
    model = infer.load(ref, backend=backend)
    per = model.engine.kv_bytes_per_position()
    model.configure_batching(kv_memory=2 * (positions + MORE + 64) * per)
    # One short request first: what the first forward of a process prepares (plans, dequantized
    # tables) is not what either way of getting the prompt's state costs.
    first_token(model, [int(t) for t in np.random.default_rng(1).integers(100, 200, 40)])
    return model


def first_token(model: infer.Model, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first new token of ``ids`` through the batch engine, and its cached positions."""
    batch = model.batch_engine
    start = time.perf_counter()
    handle = batch.submit(ids, model.sampling_params(), StopConditions(max_tokens=1))
    batch.run_until_done()
    return time.perf_counter() - start, handle.cached_tokens or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--positions", default="1024,4096")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    probe = infer.load(args.model, backend=args.backend)
    if probe.package.path is not None:
        weights_hash(probe.package.path)  # computed once, remembered by path, size and mtime
    vocab = probe.network.vocab_size
    del probe
    print(f"model {args.model}, backend {args.backend}, median of {args.repeats}")
    print("| positions | recompute: s to first token | save_state s | file MB | load_state s | "
          "first token, exactly the saved prompt s | first token, 16 more tokens s | "
          "(load + first token) / recompute |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(p) for p in args.positions.split(",")):
            ids = [int(t) for t in rng.integers(100, vocab - 100, n)]
            more = ids + [int(t) for t in rng.integers(100, vocab - 100, MORE)]
            path = Path(tmp) / f"{n}.state"
            rows: dict[str, list[float]] = {k: [] for k in ("recompute", "save", "load", "exact", "more")}
            nbytes = 0
            for _ in range(args.repeats):
                model = fresh(args.model, args.backend, n)
                seconds, cached = first_token(model, ids)
                assert cached == 0
                rows["recompute"].append(seconds)
                start = time.perf_counter()
                nbytes = model.save_state(path, ids).nbytes
                rows["save"].append(time.perf_counter() - start)
                del model
                other = fresh(args.model, args.backend, n)
                start = time.perf_counter()
                restored = other.load_state(path)
                rows["load"].append(time.perf_counter() - start)
                assert restored.cached == n and restored.logits
                seconds, cached = first_token(other, ids)
                assert cached == n, cached  # nothing computed
                rows["exact"].append(seconds)
                seconds, cached = first_token(other, more)
                assert cached == n, cached
                rows["more"].append(seconds)
                del other
            m = {k: statistics.median(v) for k, v in rows.items()}
            print(f"| {n:,} | {m['recompute']:.2f} | {m['save']:.2f} | {nbytes / 2**20:.1f} | {m['load']:.2f} | "
                  f"{m['exact']:.3f} | {m['more']:.3f} | {(m['load'] + m['exact']) / m['recompute']:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
