"""Wall-clock speedup of n-gram speculative decoding over plain greedy decoding.

The task copies from its prompt (rewriting a given code snippet), where prompt
lookup finds its drafts. Plain and speculative runs alternate, after one
warm-up of each, so drift of the machine hits both alike; each figure is the
median of ``--repeats`` runs. Both runs must produce the same tokens (greedy
speculation is exact), which the script checks.

    python benchmarks/speculative.py                       # smollm2-135m on the default backend
    python benchmarks/speculative.py --backend torch:cpu --max-tokens 128 --repeats 5 --json out.json
    python benchmarks/speculative.py --threads 1     # one BLAS thread: steadier on a shared machine

Prints a table and writes JSON: seconds and tokens/s of each mode, their ratio
(``speedup``), the acceptance rate and tokens per target forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import infer

SNIPPET = '''\
def summarize_orders(orders, customers, tax_rate, discount_codes):
    totals = {}
    for order in orders:
        customer = customers[order.customer_id]
        subtotal = 0
        for line in order.lines:
            subtotal = subtotal + line.price * line.quantity
        if order.discount_code in discount_codes:
            subtotal = subtotal * (1 - discount_codes[order.discount_code])
        total = subtotal * (1 + tax_rate)
        if customer.name in totals:
            totals[customer.name] = totals[customer.name] + total
        else:
            totals[customer.name] = total
    return totals
'''
TASK = (
    "Rewrite the following Python function with type hints on every argument and on the "
    "return value. Keep the body exactly as it is.\n\n" + SNIPPET
)


def _prompt_ids(model: infer.Model) -> list[int]:
    tokenizer = model.tokenizer
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": TASK}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(TASK + "\n")


def _run(model: infer.Model, ids: list[int], max_tokens: int, **spec: object) -> tuple[float, list[int], object]:
    start = time.perf_counter()
    gen = model.generate_tokens(ids, max_tokens=max_tokens, ignore_eos=True, **spec)  # type: ignore[arg-type]
    tokens = list(gen)
    model.backend.synchronize()
    return time.perf_counter() - start, tokens, gen.stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model reference (default: smollm2-135m)")
    parser.add_argument("--backend", default=None, help="backend, e.g. numpy, torch:cpu (default: infer's choice)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (median reported; >= 3)")
    parser.add_argument("--json", type=Path, default=Path("speculative-benchmark.json"), help="where to write results")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for BLAS and torch (default: the libraries' own choice)")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    if args.threads is not None:  # before numpy or torch start their thread pools
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import infer

    if args.threads is not None and args.backend and args.backend.startswith("torch"):
        import torch

        torch.set_num_threads(args.threads)

    model = infer.load(args.model, backend=args.backend)
    ids = _prompt_ids(model)
    spec = dict(speculative="ngram", num_speculative_tokens=args.num_speculative_tokens)

    # Warm-up: one run of each (first-call allocations, caches, kernels).
    _, plain_tokens, _ = _run(model, ids, args.max_tokens)
    _, spec_tokens, _ = _run(model, ids, args.max_tokens, **spec)
    if spec_tokens != plain_tokens:
        print("speculative output differs from plain greedy output", file=sys.stderr)
        return 1

    plain_s, spec_s, stats = [], [], []
    for _ in range(args.repeats):  # alternating
        seconds, _, _ = _run(model, ids, args.max_tokens)
        plain_s.append(seconds)
        seconds, tokens, st = _run(model, ids, args.max_tokens, **spec)
        if tokens != plain_tokens:
            print("speculative output differs from plain greedy output", file=sys.stderr)
            return 1
        spec_s.append(seconds)
        stats.append(st)

    n = len(plain_tokens)
    plain_med, spec_med = statistics.median(plain_s), statistics.median(spec_s)
    last = stats[-1]
    result = {
        "model": args.model,
        "backend": f"{model.backend.name}/{model.backend.device}",
        "machine": platform.platform(),
        "threads": args.threads,
        "prompt_tokens": len(ids),
        "new_tokens": n,
        "num_speculative_tokens": args.num_speculative_tokens,
        "repeats": args.repeats,
        "plain": {"seconds": plain_s, "median_s": plain_med, "tokens_per_s": n / plain_med},
        "ngram": {"seconds": spec_s, "median_s": spec_med, "tokens_per_s": n / spec_med},
        "speedup": plain_med / spec_med,
        "acceptance_rate": last.acceptance_rate,
        "tokens_per_forward": last.tokens_per_forward,
        "stats": last.as_dict(),
    }
    print(f"{args.model} on {result['backend']}: {len(ids)} prompt tokens, {n} new tokens, "
          f"k = {args.num_speculative_tokens}, median of {args.repeats}")
    print(f"  plain greedy    {plain_med:8.3f} s  {n / plain_med:8.1f} tok/s")
    print(f"  n-gram lookup   {spec_med:8.3f} s  {n / spec_med:8.1f} tok/s")
    print(f"  speedup {result['speedup']:.2f}x; acceptance rate {last.acceptance_rate:.2f}; "
          f"tokens per target forward {last.tokens_per_forward:.2f}")
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
