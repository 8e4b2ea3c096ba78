"""Decode speed of GGUF weights as the file stores them against converted, in one process.

The C kernels' backends compute on the types of ``infer.backends.cpu.kernels.stored_types``
(``STORED_TYPES``, or ``STORED_TYPES_Q8`` with ``--activations q8``) as the file stores
them (``--types`` names another set); emptying that set
gives the conversion at load that came before. This loads the model both ways and times
greedy decoding of each, alternating round by round (the order swapped every
round), so that a machine whose speed drifts moves both alike. For every round
it also prints the CPU other processes took meanwhile (``/proc/stat`` less this
process's own, in cores): the medians count only the rounds where that stayed
under ``--quiet`` cores.

    python benchmarks/stored_blocks.py /tmp/llama-1b-q4_k_m.gguf --rounds 10
    OMP_NUM_THREADS=1 python benchmarks/stored_blocks.py gemma3-270m --quiet 0.9
    python benchmarks/stored_blocks.py gemma3-270m --types Q5_0,Q4_K --baseline Q4_K --activations q8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import Counter

import infer
from infer.backends.cpu import kernels
from infer.ops import PackedWeight


def cpu_sample() -> tuple[float, float, float]:
    """(wall seconds, machine busy CPU seconds, this process's CPU seconds)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    mine = os.times()
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, mine.user + mine.system


def kernel_weights() -> Counter[str]:
    """How the live weights the C kernels take are held (``PackedWeight.scheme``), counted."""
    return Counter(w.scheme for w in gc.get_objects() if isinstance(w, PackedWeight) and w.scheme.endswith("C kernel"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16, help="tokens timed per round")
    parser.add_argument("--quiet", type=float, default=0.1, help="most cores other work may take in a counted round")
    parser.add_argument("--types", help="comma-separated GGML types to keep as stored "
                        "(default: the path's own choice for the activations)")
    parser.add_argument("--baseline", default="", help="comma-separated types the other side keeps as stored (default: none)")
    parser.add_argument("--activations", default=None, help='"q8": both sides with int8 activations')
    args = parser.parse_args(argv)

    stored = frozenset(args.types.split(",")) if args.types else kernels.stored_types(args.activations)
    models: dict[str, infer.Model] = {}
    baseline = frozenset(t for t in args.baseline.split(",") if t)
    for name, types in (("converted", baseline), ("stored", stored)):
        # keeps_stored reads the kernels module's sets at load (the q8 one with --activations q8): set there.
        kernels.STORED_TYPES = kernels.STORED_TYPES_Q8 = types
        before = kernel_weights()
        models[name] = infer.load(args.model, backend="numpy", activations=args.activations)
        print(name, dict(kernel_weights() - before), flush=True)  # what each side computes on
    ids = models["stored"].tokenizer.encode("The capital of France is a city that")
    for m in models.values():  # records each one's decode program
        list(m.generate_tokens(ids, max_tokens=8, ignore_eos=True))
    counted: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        order = list(models.items()) if r % 2 == 0 else list(reversed(models.items()))
        round_: dict[str, tuple[float, float]] = {}
        for name, m in order:
            tokens = iter(m.generate_tokens(ids, max_tokens=args.tokens + 1, ignore_eos=True))
            next(tokens)  # the prefill's token
            before, start = cpu_sample(), time.perf_counter()
            n = sum(1 for _ in tokens)
            seconds, after = time.perf_counter() - start, cpu_sample()
            others = max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])
            round_[name] = (n / seconds, others)
        quiet = all(others < args.quiet for _, others in round_.values())
        print(r, "counted" if quiet else "busy", {k: (round(v, 1), round(o, 2)) for k, (v, o) in round_.items()},
              flush=True)
        if quiet:
            for name, (rate, _) in round_.items():
                counted[name].append(rate)
    for name, rates in counted.items():
        print(name, f"median of {len(rates)} rounds: {statistics.median(rates):.1f} tokens/s" if rates else
              "no round counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
