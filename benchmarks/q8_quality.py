"""What int8 activations cost in quality: perplexity and KL(exact ‖ q8).

    python benchmarks/q8_quality.py [smollm2-135m gemma3-270m] [--text FILE] [--window 512]

Each model is loaded twice on the numpy backend, exact and with
``activations="q8"``, and both score the same text in the same sliding windows
(512 tokens, starting 256 apart: every token after the first window has at
least 256 before it) through :func:`infer.engine.scoring.kl_divergence`.
Reported per model: both perplexities, the mean over tokens of KL(exact ‖ q8)
from float64 log-softmax rows over the whole vocabulary, the largest per-token
KL, and how often the two runs' most likely token is the same. The default
text is tests/data/public_domain.txt (the Declaration of Independence and two
addresses by Lincoln). docs/quantization.md's table ("Quantized activations")
comes from here; ``infer perplexity MODEL FILE --activations q8 --kl-against
exact`` gives the same figures for one model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain.txt"


def measure(reference: str, text: str, window: int, backend: str) -> dict:
    import infer
    from infer.engine.scoring import kl_divergence

    exact = infer.load(reference, backend=backend)
    q8 = infer.load(reference, backend=backend, activations="q8")
    d = kl_divergence(exact, q8, text, window=window, progress=True)
    return {"model": reference, "backend": backend, "tokens": len(d.kl), "window": window,
            "perplexity_exact": d.p.perplexity, "perplexity_q8": d.q.perplexity, "kl_mean": d.mean,
            "kl_max": max(d.kl), "top1_agree": d.top_agreement}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"],
                        help="catalog aliases, GGUF files or model folders (default: both catalog models)")
    parser.add_argument("--text", default=str(TEXT), help="UTF-8 text to score (default: tests/data/public_domain.txt)")
    parser.add_argument("--window", type=int, default=512, help="window in tokens (default 512)")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    results = [measure(m, text, args.window, args.backend) for m in args.models]
    print("| model | tokens | perplexity, exact | perplexity, q8 | mean KL(exact ‖ q8) (nats/token) | largest KL | "
          "same top token |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['tokens']} | {r['perplexity_exact']:.4f} | {r['perplexity_q8']:.4f} | "
              f"{r['kl_mean']:.2e} | {r['kl_max']:.2e} | {100 * r['top1_agree']:.2f}% |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
