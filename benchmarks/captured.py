"""Decode speed of the recorded (captured) decode step against the eager one, in one process.

    python benchmarks/captured.py [--model smollm2-135m[,other...]] [--backends numpy,torch:cpu] [--tokens 64]
                                  [--repeats 5] [--compiled] [--prompt-tokens 128]

Loads the model once per configuration — each backend eagerly
(``compile=False``) and as ``infer.load`` does by default (the greedy decode
step recorded as one program on numpy and torch/cpu), and with
``--compiled`` also ``compile=True`` — then decodes ``--tokens`` tokens
greedily from the same 128-token prompt with each in turn, ``--repeats``
times, so a slow minute of a shared machine falls on all of them. Prints
the median decode rate of each (tokens after the first over the time after
the first), every repeat's rate, each configuration's first-step time (the
recording, or torch.compile's compile) and what its decode step is.
Several models (``--model a,b``, e.g. the hybrid shapes of
``benchmarks/random_hybrid.py``) run in the same rounds, interleaved too.
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
    parser.add_argument("--model", default="smollm2-135m", help="a model, or several separated by commas")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--backends", default="numpy,torch:cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="also compile=True (torch.compile, mx.compile)")
    args = parser.parse_args()
    configs = {}
    paths = [m.strip() for m in args.model.split(",") if m.strip()]
    for path in paths:
        for backend in (b.strip() for b in args.backends.split(",") if b.strip()):
            label = f"{path.rsplit('/', 1)[-1]} {backend}" if len(paths) > 1 else backend
            configs[f"{label} eager"] = dict(model=path, backend=backend, compile=False)
            configs[f"{label} default"] = dict(model=path, backend=backend)
            if args.compiled:
                configs[f"{label} compile=True"] = dict(model=path, backend=backend, compile=True)
    models = {name: infer.load(options.pop("model"), **options) for name, options in configs.items()}
    prompts = {name: model.tokenizer.encode(PROMPT * 4)[:args.prompt_tokens] for name, model in models.items()}
    for name, model in models.items():
        start = time.perf_counter()
        list(model.generate_tokens(prompts[name], max_tokens=4, ignore_eos=True))  # records or compiles the step
        step = model.engine.decode_step
        print(f"{name}: first steps {time.perf_counter() - start:.2f} s; "
              f"{step.describe() if step is not None else 'eager, op by op'}")
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            rates[name].append(decode_rate(model, prompts[name], args.tokens))
    print(f"{args.model}, {args.prompt_tokens}-token prompt, {args.tokens} new tokens, median of {args.repeats}:")
    for name, values in rates.items():
        print(f"  {name:40s} {statistics.median(values):7.1f} tok/s   {' '.join(f'{v:.1f}' for v in values)}")
    for name, model in models.items():
        step = model.engine.decode_step
        if step is not None:
            print(f"{name}: {step.describe()}")


if __name__ == "__main__":
    main()
