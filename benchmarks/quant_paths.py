"""Decode and prefill tokens/s of SmolLM2-135M Q4_1 GGUF on each CPU path, alternating.

    .venv/bin/python benchmarks/quant_paths.py [--repeats 3] [--prompt 128] [--new 64]

Each path is loaded once; then, ``repeats`` times, every path runs one prefill of
``prompt`` tokens and one greedy decode of ``new`` tokens, in turn (the machine is
shared: alternating spreads its noise over all paths). Medians are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import infer

PATHS: dict[str, dict[str, str]] = {
    "numpy f32 (GGUF dequantized)": dict(backend="numpy"),
    "torch/cpu f32": dict(backend="torch:cpu", dtype="float32"),
    "torch/cpu bf16": dict(backend="torch:cpu", dtype="bfloat16"),
    "torch/cpu int4pack f32 (quantize=q4)": dict(backend="torch:cpu", dtype="float32", quantize="q4"),
    "mlx/cpu f32 (GGUF dequantized)": dict(backend="mlx:cpu"),
    "mlx/cpu affine (GGUF kept quantized)": dict(backend="mlx:cpu", quantize="q4"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--paths", default="", help="comma-separated substrings selecting paths (default: all)")
    args = ap.parse_args()
    wanted = [p for p in args.paths.split(",") if p]
    paths = {n: kw for n, kw in PATHS.items() if not wanted or any(w in n for w in wanted)}
    models = {}
    for name, kw in paths.items():
        t = time.perf_counter()
        models[name] = infer.load(args.model, **kw)
        print(f"loaded {name} in {time.perf_counter() - t:.2f} s", flush=True)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    ids = next(iter(models.values())).tokenizer.encode(text)[: args.prompt]
    runs: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in paths}
    for _ in range(args.repeats):
        for name, model in models.items():
            t = time.perf_counter()
            list(model.generate_tokens(ids, max_tokens=1, ignore_eos=True))
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            list(model.generate_tokens(ids, max_tokens=args.new + 1, ignore_eos=True))
            total = time.perf_counter() - t
            runs[name]["prefill"].append(args.prompt / prefill)
            runs[name]["decode"].append(args.new / max(total - prefill, 1e-9))
            print(name, f"prefill {runs[name]['prefill'][-1]:.1f} decode {runs[name]['decode'][-1]:.1f}", flush=True)
    out = {n: {k: round(statistics.median(v), 1) for k, v in r.items()} for n, r in runs.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
