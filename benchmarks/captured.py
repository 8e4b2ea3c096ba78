"""Decode speed of the recorded (captured) decode step against the eager one, in one process.

    python benchmarks/captured.py [--model smollm2-135m] [--backends numpy,torch:cpu] [--tokens 64]
                                  [--repeats 5] [--compiled]

Loads the model once per configuration — each backend eagerly
(``compile=False``) and as ``infer.load`` does by default (the greedy decode
step recorded as one program on numpy and torch/cpu), and with
``--compiled`` also ``compile=True`` — then decodes ``--tokens`` tokens
greedily from the same 128-token prompt with each in turn, ``--repeats``
times, so a slow minute of a shared machine falls on all of them. Prints
the median decode rate of each (tokens after the first over the time after
the first), every repeat's rate, each configuration's first-step time (the
recording, or torch.compile's compile) and what its decode step is.
Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import infer

PROMPT = "The history of the city begins in the Roman era, when a small settlement grew along the river. " * 4


def decode_rate(model: infer.Model, prompt: list[int], tokens: int) -> float:
    """Tokens per second after the first new token."""
    first, count = None, 0
    for _ in model.generate_tokens(prompt, max_tokens=tokens, ignore_eos=True):
        if first is None:
            first = time.perf_counter()
        count += 1
    assert first is not None
    return (count - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backends", default="numpy,torch:cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="also compile=True (torch.compile, mx.compile)")
    args = parser.parse_args()
    configs = {}
    for backend in (b.strip() for b in args.backends.split(",") if b.strip()):
        configs[f"{backend} eager"] = dict(backend=backend, compile=False)
        configs[f"{backend} default"] = dict(backend=backend)
        if args.compiled:
            configs[f"{backend} compile=True"] = dict(backend=backend, compile=True)
    models = {name: infer.load(args.model, **options) for name, options in configs.items()}
    prompt = next(iter(models.values())).tokenizer.encode(PROMPT)[:128]
    for name, model in models.items():
        start = time.perf_counter()
        list(model.generate_tokens(prompt, max_tokens=4, ignore_eos=True))  # records or compiles the step
        step = model.engine.decode_step
        print(f"{name}: first steps {time.perf_counter() - start:.2f} s; "
              f"{step.describe() if step is not None else 'eager, op by op'}")
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            rates[name].append(decode_rate(model, prompt, args.tokens))
    print(f"{args.model}, {len(prompt)}-token prompt, {args.tokens} new tokens, median of {args.repeats}:")
    for name, values in rates.items():
        print(f"  {name:28s} {statistics.median(values):7.1f} tok/s   {' '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
