"""What storing keys and values narrower costs in quality: perplexity and KL.

    python benchmarks/kv_dtype_quality.py smollm2-135m gemma3-270m [--kv-dtypes float16,q8_0]
        [--text FILE ...] [--tokens N]

Each model is loaded on the numpy backend exact (keys and values in float32)
and once per ``kv_dtype`` named (default float16), and all are teacher-forced
over the same text in chunks of 256 tokens (one cache each, so later positions
attend to every earlier one through the rounded pool). Reported per model and
dtype: both perplexities, the mean KL divergence of the narrower run's
next-token distribution from the exact one (nats per token), the largest
per-token KL, and how often the top token agrees. docs/kv-cache.md's figures
come from here. The default text is docs/design.md (English prose, code and
tables); several ``--text`` files are joined, for contexts longer than one.

``--llama-cpp`` adds llama.cpp's own figure on the same GGUF file and the same
token ids (llama-cpp-python, optional): its q8_0 cache (``-ctk q8_0 -ctv
q8_0``) against its float32 cache, both with flash attention (which a
quantized value cache needs), teacher-forced in the same chunks.
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


def measure(reference: str, text: str, tokens: int, kv_dtypes: list[str]) -> list[dict]:
    import infer

    exact = infer.load(reference, backend="numpy")
    narrow = [infer.load(reference, backend="numpy", kv_dtype=d) for d in kv_dtypes]
    models = [exact, *narrow]
    ids = exact.tokenizer.encode(text)[:tokens]
    seqs = [m.engine.new_sequence(len(ids)) for m in models]
    nll = [0.0] * len(models)
    kls: list[list[np.ndarray]] = [[] for _ in narrow]
    agree = [0] * len(narrow)
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        targets = np.asarray(ids[start + 1:start + 1 + len(chunk)])
        rows = [_log_softmax(m.backend.to_numpy(m.engine.forward(s, chunk, all_logits=True)))[:len(targets)]
                for m, s in zip(models, seqs)]
        for i, r in enumerate(rows):
            nll[i] -= float(r[np.arange(len(targets)), targets].sum())
        p = np.exp(rows[0])
        for i, r in enumerate(rows[1:]):
            kls[i].append((p * (rows[0] - r)).sum(axis=-1))
            agree[i] += int((rows[0].argmax(-1) == r.argmax(-1)).sum())
    n = len(ids) - 1
    results = []
    for i, (dtype, model) in enumerate(zip(kv_dtypes, narrow)):
        kl = np.concatenate(kls[i])
        results.append({"model": reference, "kv_dtype": dtype, "tokens": n,
                        "perplexity_exact": float(np.exp(nll[0] / n)),
                        "perplexity": float(np.exp(nll[i + 1] / n)), "kl_mean": float(kl.mean()),
                        "kl_max": float(kl.max()), "top1_agree": agree[i] / n,
                        "kv_bytes_per_position": [exact.engine.kv_bytes_per_position(),
                                                  model.engine.kv_bytes_per_position()]})
    return results


def measure_llama_cpp(reference: str, text: str, tokens: int) -> dict:
    """KL(llama.cpp q8_0 cache || llama.cpp float32 cache) on ``reference``'s GGUF file."""
    import llama_cpp

    import infer
    from infer import catalog

    path = Path(reference) if Path(reference).is_file() else catalog.model_path(reference)
    ids = infer.load(reference, backend="numpy").tokenizer.encode(text)[:tokens]
    runs = [llama_cpp.Llama(str(path), n_ctx=len(ids), n_batch=CHUNK, n_ubatch=CHUNK, n_threads=2, logits_all=True,
                            flash_attn=True, type_k=t, type_v=t, verbose=False)
            for t in (llama_cpp.GGML_TYPE_F32, llama_cpp.GGML_TYPE_Q8_0)]
    nll = [0.0, 0.0]
    kls: list[np.ndarray] = []
    agree = 0
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        targets = np.asarray(ids[start + 1:start + 1 + len(chunk)])
        rows = []
        for llm in runs:
            llm.eval(chunk)
            rows.append(_log_softmax(np.asarray(llm.scores[start:start + len(chunk)]))[:len(targets)])
        for i, r in enumerate(rows):
            nll[i] -= float(r[np.arange(len(targets)), targets].sum())
        kls.append((np.exp(rows[0]) * (rows[0] - rows[1])).sum(axis=-1))
        agree += int((rows[0].argmax(-1) == rows[1].argmax(-1)).sum())
    n = len(ids) - 1
    kl = np.concatenate(kls)
    return {"model": f"{reference} (llama.cpp {llama_cpp.__version__})", "kv_dtype": "q8_0", "tokens": n,
            "perplexity_exact": float(np.exp(nll[0] / n)), "perplexity": float(np.exp(nll[1] / n)),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agree": agree / n,
            "kv_bytes_per_position": [0, 0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="catalog aliases, GGUF files or model folders")
    parser.add_argument("--text", nargs="+", default=[str(Path(__file__).resolve().parents[1] / "docs" / "design.md")])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored (default 2048)")
    parser.add_argument("--kv-dtypes", default="float16", help="comma-separated kv_dtypes to compare (default float16)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="add llama.cpp's q8_0 cache against its float32 cache (llama-cpp-python)")
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = parser.parse_args()
    text = "\n\n".join(Path(t).read_text(encoding="utf-8") for t in args.text)
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    results = [r for m in args.models for r in measure(m, text, args.tokens, kv_dtypes)] if kv_dtypes else []
    if args.llama_cpp:
        results += [measure_llama_cpp(m, text, args.tokens) for m in args.models]
    print("| model | KV dtype | tokens | perplexity, float32 KV | perplexity | mean KL (nats/token) | "
          "largest KL | top-1 agrees | KV bytes/position |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b = r["kv_bytes_per_position"]
        print(f"| {r['model']} | {r['kv_dtype']} | {r['tokens']} | {r['perplexity_exact']:.4f} | {r['perplexity']:.4f} | "
              f"{r['kl_mean']:.2e} | {r['kl_max']:.2e} | {100 * r['top1_agree']:.2f}% | {b[0]:,} → {b[1]:,} |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
