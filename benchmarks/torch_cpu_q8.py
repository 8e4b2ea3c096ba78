"""torch/cpu against numpy on the same C kernels, exact and with ``activations="q8"``.

    python benchmarks/torch_cpu_q8.py [smollm2-135m gemma3-270m] [--rounds 5] [--prompt 128] [--new 64]

Four loads of each model in one process (numpy and torch:cpu, exact and q8);
each round runs every load once, in turn, on the same prompt: a prefill of
``--prompt`` tokens, then ``--new`` greedy tokens. Reported per model and mode:
torch/cpu's prefill and decode tokens a second over numpy's, the median of the
per-round ratios (both sides of a ratio are measured within one round, so a
machine whose load drifts moves them alike). Decoding one sequence runs one
activation row per product (q8's one-row kernels in q8 mode); prefill runs the
tile kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def one_run(model, ids: list[int], new: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(prefill tokens/s, decode tokens/s) of one greedy generation."""
    start = time.perf_counter()
    stream = iter(model.generate_tokens(ids, max_tokens=new + 1, temperature=0, ignore_eos=True))
    next(stream)
    first = time.perf_counter()
    count = sum(1 for _ in stream)
    end = time.perf_counter()
    return len(ids) / (first - start), count / (end - first)


def main() -> int:
    import infer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    print("| model | mode | numpy prefill tok/s | torch/cpu prefill × numpy | numpy decode tok/s | "
          "torch/cpu decode × numpy |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        loads = {(b, a): infer.load(name, backend=b, activations=a)
                 for a in (None, "q8") for b in ("numpy", "torch:cpu")}
        ids = (list(range(1000, 1000 + args.prompt)))
        for m in loads.values():
            one_run(m, ids[:16], 4)  # warm-up: first-call costs, the recorded step
        runs: dict[tuple[str, str | None], list[tuple[float, float]]] = {k: [] for k in loads}
        for _ in range(args.rounds):
            for key, m in loads.items():
                runs[key].append(one_run(m, ids, args.new))
        for mode in (None, "q8"):
            a, b = runs[("numpy", mode)], runs[("torch:cpu", mode)]
            pre = statistics.median(y[0] / x[0] for x, y in zip(a, b))
            dec = statistics.median(y[1] / x[1] for x, y in zip(a, b))
            print(f"| {name} | {mode or 'exact'} | {statistics.median(x[0] for x in a):.1f} | {pre:.2f} | "
                  f"{statistics.median(x[1] for x in a):.1f} | {dec:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
