"""What storing keys and values in float16 costs in quality: perplexity and KL.

    python benchmarks/kv_dtype_quality.py smollm2-135m gemma3-270m [--text FILE] [--tokens N]

Each model is loaded twice on the numpy backend, exact (keys and values in
float32) and with ``kv_dtype="float16"``, and both are teacher-forced over the
same text in chunks of 256 tokens (one cache each, so later positions attend
to every earlier one through the rounded pool). Reported per model: both
perplexities, the mean KL divergence of the float16 run's next-token
distribution from the exact one (nats per token), the largest per-token KL,
and how often the top token agrees. docs/kv-cache.md's figures come from here.
The default text is docs/design.md (English prose, code and tables).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

CHUNK = 256


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def measure(reference: str, text: str, tokens: int) -> dict:
    import infer

    exact = infer.load(reference, backend="numpy")
    half = infer.load(reference, backend="numpy", kv_dtype="float16")
    ids = exact.tokenizer.encode(text)[:tokens]
    seqs = [m.engine.new_sequence(len(ids)) for m in (exact, half)]
    nll = [0.0, 0.0]
    kls: list[np.ndarray] = []
    agree = 0
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        targets = np.asarray(ids[start + 1:start + 1 + len(chunk)])
        rows = [_log_softmax(m.backend.to_numpy(m.engine.forward(s, chunk, all_logits=True)))
                for m, s in zip((exact, half), seqs)]
        rows = [r[:len(targets)] for r in rows]
        for i, r in enumerate(rows):
            nll[i] -= float(r[np.arange(len(targets)), targets].sum())
        p = np.exp(rows[0])
        kls.append((p * (rows[0] - rows[1])).sum(axis=-1))
        agree += int((rows[0].argmax(-1) == rows[1].argmax(-1)).sum())
    n = len(ids) - 1
    kl = np.concatenate(kls)
    return {"model": reference, "tokens": n, "perplexity_exact": float(np.exp(nll[0] / n)),
            "perplexity_float16": float(np.exp(nll[1] / n)), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "top1_agree": agree / n,
            "kv_bytes_per_position": [exact.engine.kv_bytes_per_position(), half.engine.kv_bytes_per_position()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="catalog aliases, GGUF files or model folders")
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "docs" / "design.md"))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored (default 2048)")
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    results = [measure(m, text, args.tokens) for m in args.models]
    print("| model | tokens | perplexity, float32 KV | perplexity, float16 KV | mean KL (nats/token) | "
          "largest KL | top-1 agrees | KV bytes/position |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b = r["kv_bytes_per_position"]
        print(f"| {r['model']} | {r['tokens']} | {r['perplexity_exact']:.4f} | {r['perplexity_float16']:.4f} | "
              f"{r['kl_mean']:.2e} | {r['kl_max']:.2e} | {100 * r['top1_agree']:.2f}% | {b[0]:,} → {b[1]:,} |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
