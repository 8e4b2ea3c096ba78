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

``--llama-cpp`` adds the peer's row (llama-cpp-python, optional, never needed
by the tests): KL(infer exact ‖ llama.cpp), llama.cpp's logits (``logits_all``)
on the same GGUF file and the same token ids, in the same windows, through the
same :func:`infer.engine.scoring.divergence` (llama.cpp stands in as its Q
engine), so the table shows whether q8 mode is further from exact than
llama.cpp is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

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


class _LlamaCppRun:
    """One forward of :class:`LlamaCppEngine`: the chunk's logit rows."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def host_logits(self) -> np.ndarray:
        return self.rows


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python, ``logits_all=True``) as the Q side of
    :func:`infer.engine.scoring.divergence`: the few engine members it calls.
    A window is a fresh context (``reset``); each chunk is evaluated after the
    ones before it, and its rows are llama.cpp's logits for those positions."""

    def __init__(self, path: str, context: int, vocab_size: int, threads: int = 2) -> None:
        import llama_cpp

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(path, n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads,
                                   logits_all=True, verbose=False)
        if self.llm.n_vocab() != vocab_size:
            raise SystemExit(f"{path}: llama.cpp reads {self.llm.n_vocab()} tokens, infer {vocab_size}")
        self.max_context = context
        self.model = SimpleNamespace(vocab_size=vocab_size)

    def check_tokens(self, ids: list[int]) -> None:
        pass  # infer's tokenizer made them, and the vocabularies are checked equal

    def new_sequence(self, capacity: int) -> None:
        self.llm.reset()

    def prepare(self, seqs: list, chunks: list[list[int]], all_logits: bool = False) -> list[int]:
        return chunks[0]

    def run(self, chunk: list[int]) -> _LlamaCppRun:
        start = self.llm.n_tokens
        self.llm.eval(chunk)
        return _LlamaCppRun(np.array(self.llm.scores[start:start + len(chunk)], np.float32))

    def release(self, seq: None) -> None:
        pass


def measure_llama_cpp(reference: str, text: str, window: int, threads: int = 2) -> dict:
    """KL(infer exact ‖ llama.cpp) on ``reference``'s GGUF file, the same token ids and windows."""
    import infer
    from infer import catalog
    from infer.engine.scoring import divergence

    path = Path(reference) if Path(reference).is_file() else catalog.model_path(reference)
    exact = infer.load(str(path), backend="numpy")
    ids = exact.tokenizer.encode(text, add_special_tokens=True)
    peer = LlamaCppEngine(str(path), window, exact.engine.model.vocab_size, threads)
    d = divergence(exact.engine, peer, ids, context=window, progress=True)
    return {"model": f"{reference}, llama.cpp {peer.version}", "backend": "numpy", "tokens": len(d.kl),
            "window": window, "perplexity_exact": d.p.perplexity, "perplexity_q8": d.q.perplexity, "kl_mean": d.mean,
            "kl_max": max(d.kl), "top1_agree": d.top_agreement}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"],
                        help="catalog aliases, GGUF files or model folders (default: both catalog models)")
    parser.add_argument("--text", default=str(TEXT), help="UTF-8 text to score (default: tests/data/public_domain.txt)")
    parser.add_argument("--window", type=int, default=512, help="window in tokens (default 512)")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="add KL(infer exact ‖ llama.cpp) on the same files (llama-cpp-python)")
    parser.add_argument("--no-q8", action="store_true", help="only the llama.cpp rows")
    parser.add_argument("--llama-threads", type=int, default=2,
                        help="llama.cpp's threads (default 2; 1 on a machine other work keeps busy, where its "
                        "threads' barriers wait on each other)")
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    results = [] if args.no_q8 else [measure(m, text, args.window, args.backend) for m in args.models]
    if args.llama_cpp:
        results += [measure_llama_cpp(m, text, args.window, args.llama_threads) for m in args.models]
    print("| model | tokens | perplexity, exact | perplexity, q8 or llama.cpp | mean KL(exact ‖ q8 or llama.cpp) "
          "(nats/token) | largest KL | same top token |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['tokens']} | {r['perplexity_exact']:.4f} | {r['perplexity_q8']:.4f} | "
              f"{r['kl_mean']:.2e} | {r['kl_max']:.2e} | {100 * r['top1_agree']:.2f}% |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
