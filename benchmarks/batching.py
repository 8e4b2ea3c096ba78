"""Continuous batching throughput and prefix-cache hit rate (issue 5, item 7).

    python benchmarks/batching.py [--model smollm2-135m] [--backend numpy] [--concurrency 1,4,16,64]
                                  [--prompt-tokens 64] [--new-tokens 32] [--repeats 1] [--update-docs]
                                  [--activations exact|q8|both]

Throughput: for each KV layout (paged, contiguous; and paged with the
captured batched decode step off, ``paged-eager``) and each number of
concurrent requests N, N requests with different prompts are submitted at
once to a fresh :class:`infer.engine.batch.BatchEngine` and run to the end
(greedy, end-of-sequence ignored); the figure is total new tokens over the
wall time, and total tokens processed (prompt + new) over it too.

Prefix cache: requests share a long system prompt and differ in a short
question. They arrive one per engine step (each after the previous one's
first forward), the way requests reach a server; the hit rate is
``BatchStats.tokens_reused`` over the prompt tokens submitted, next to the
best possible rate (the shared prompt's full blocks, for every request after
the first). The paged layout only: the contiguous one has no prefix cache.

Writes ``benchmarks/results/batching.json``; ``--update-docs`` rewrites the
``batching`` block of docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import infer
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.tools import bench, bench_report

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("benchmarks.batching")

SYSTEM_PROMPT = (
    "You are a careful assistant for a small public library. Answer questions about opening hours, "
    "borrowing rules, fines, events and the catalogue. Be brief and polite, say when you do not know, "
    "never invent a book that is not in the catalogue, and point visitors to the front desk for anything "
    "about their own account. The library opens at nine and closes at six on weekdays, at one on Saturdays."
)
QUESTIONS = [f"Question {i}: can I borrow {k} books at once for {d} weeks?"
             for i, (k, d) in enumerate(((k, d) for k in range(1, 20) for d in range(1, 5)))]


def _prompts(model: Any, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each starting at a different
    place of the benchmark text (so no two share a prefix block)."""
    base = bench.prompt_ids(Path(model.package.path), length + count * 7)
    return [base[i * 7:i * 7 + length] for i in range(count)]


def throughput(model: Any, layout: str, n: int, prompt_tokens: int, new_tokens: int,
               kv_memory: int) -> dict[str, Any]:
    """N concurrent requests through a fresh batch engine; tokens/s. Layout
    ``paged-eager``: the paged layout with the captured batched decode step
    off (every forward eager), to measure what the capture gives."""
    engine = model.engine
    saved = engine.batch_step
    if layout == "paged-eager":
        engine.batch_step = None
    try:
        batch = BatchEngine(engine, kv_layout=layout.split("-")[0], kv_memory=kv_memory)  # type: ignore[arg-type]
        greedy = SamplingParams(temperature=0.0)
        stop = StopConditions(max_tokens=new_tokens, ignore_eos=True)
        prompts = _prompts(model, n, prompt_tokens)
        t0 = time.perf_counter()
        handles = [batch.submit(p, greedy, stop) for p in prompts]
        batch.run_until_done()
        wall = time.perf_counter() - t0
    finally:
        engine.batch_step = saved
    generated = sum(len(h.tokens) for h in handles)
    return {"layout": layout, "requests": n, "wall_s": wall, "new_tokens": generated,
            "new_tok_s": generated / wall, "total_tok_s": (generated + n * prompt_tokens) / wall,
            "forwards": batch.stats.forwards, "preemptions": batch.stats.preemptions}


def prefix_hit_rate(model: Any, requests: int, system_tokens: int, new_tokens: int,
                    kv_memory: int) -> dict[str, Any]:
    """Shared system prompt (its first ``system_tokens`` tokens), different
    questions, one arrival per step."""
    batch = BatchEngine(model.engine, kv_layout="paged", kv_memory=kv_memory)
    tok = model.tokenizer
    system = tok.encode(SYSTEM_PROMPT)[:system_tokens]
    prompts = [system + tok.encode(" " + q, add_special_tokens=False) for q in QUESTIONS[:requests]]
    greedy = SamplingParams(temperature=0.0)
    stop = StopConditions(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        batch.submit(p, greedy, stop)
        batch.step()
    batch.run_until_done()
    wall = time.perf_counter() - t0
    submitted = sum(len(p) for p in prompts)
    block = batch.pool.block_size if batch.pool is not None else 0
    best = (requests - 1) * (len(system) // block * block) if block else 0
    return {"requests": requests, "system_prompt_tokens": len(system), "prompt_tokens": submitted,
            "tokens_reused": batch.stats.tokens_reused, "hit_rate": batch.stats.tokens_reused / submitted,
            "best_hit_rate": best / submitted, "block_size": block, "wall_s": wall}


def markdown(result: dict[str, Any]) -> str:
    rows = {}
    for r in result["throughput"]:
        rows.setdefault(r["requests"], {})[r["layout"]] = r
    layouts = sorted({r["layout"] for r in result["throughput"]}, reverse=True)
    head = ["concurrent requests"] + [f"{lay} new tok/s" for lay in layouts] + \
        [f"{lay} total tok/s" for lay in layouts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, by in sorted(rows.items()):
        cells = [str(n)] + [f"{by[lay]['new_tok_s']:.1f}" if lay in by else "–" for lay in layouts] + \
            [f"{by[lay]['total_tok_s']:.1f}" if lay in by else "–" for lay in layouts]
        lines.append("| " + " | ".join(cells) + " |")
    p = result["prefix_cache"]
    lines += ["", f"Prefix cache: {p['requests']} requests sharing a {p['system_prompt_tokens']}-token system "
              f"prompt, arriving one per step: {p['tokens_reused']} of {p['prompt_tokens']} prompt tokens "
              f"reused, hit rate {p['hit_rate']:.0%} (best possible with {p['block_size']}-token blocks: "
              f"{p['best_hit_rate']:.0%})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--concurrency", default="1,4,16,64", help="numbers of concurrent requests")
    parser.add_argument("--layouts", default="paged,paged-eager,contiguous",
                        help="paged (decode steps captured where the backend can), paged-eager, contiguous")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="median of this many runs per point")
    parser.add_argument("--prefix-requests", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=96, help="shared system prompt length, at most")
    parser.add_argument("--kv-memory-mb", type=int, default=1024, help="KV memory of each batch engine")
    parser.add_argument("--activations", choices=["exact", "q8", "both"], default="exact",
                        help="exact float32 products, int8 activations (activations='q8', approximate), or both: "
                             "two loads, run in turn each repeat, the q8 rows labelled with 'q8'")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batching.json"))
    parser.add_argument("--update-docs", action="store_true", help="rewrite the batching block of docs/performance.md")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    kinds = ["exact", "q8"] if args.activations == "both" else [args.activations]
    models = {kind: infer.load(args.model, backend=args.backend, **({"activations": "q8"} if kind == "q8" else {}))
              for kind in kinds}
    model = models[kinds[0]]
    kv_memory = args.kv_memory_mb * 2**20
    for each in models.values():
        for layout in args.layouts.split(","):  # warm-up: first calls of every op, out of the timings
            throughput(each, layout, 2, args.prompt_tokens, 4, kv_memory)
    points = []
    for n in (int(c) for c in args.concurrency.split(",")):
        for layout in args.layouts.split(","):
            runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
            for _ in range(args.repeats):  # the loads in turn, so a drift in the machine's load moves them alike
                for kind, each in models.items():
                    runs[kind].append(throughput(each, layout, n, args.prompt_tokens, args.new_tokens, kv_memory))
            for kind in kinds:
                best = dict(runs[kind][0], new_tok_s=statistics.median(r["new_tok_s"] for r in runs[kind]),
                            total_tok_s=statistics.median(r["total_tok_s"] for r in runs[kind]),
                            activations=kind, layout=layout + (" q8" if kind == "q8" else ""))
                log.info("%s, %d requests: %.1f new tok/s", best["layout"], n, best["new_tok_s"])
                points.append(best)
    result = {"schema": "infer-bench-batching/1",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": bench.machine_info(), "model": args.model, "backend": repr(model.backend),
              "settings": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "kv_memory_bytes": kv_memory,
                           "thread_env": {k: v for k, v in os.environ.items() if k.endswith("_NUM_THREADS")}},
              "throughput": points,
              "prefix_cache": prefix_hit_rate(model, args.prefix_requests, args.system_tokens, args.new_tokens, kv_memory)}
    out = bench.write_json(result, args.out)
    text = markdown(result)
    print(text)
    print(f"\nwritten: {out}", file=sys.stderr)
    if args.update_docs:
        block = (f"Measured {result['date']} on {result['machine']['cpu']} ({result['machine']['cores']} cores), "
                 f"{args.model} on {result['backend']}, prompts of {args.prompt_tokens} tokens, "
                 f"{args.new_tokens} new tokens each.\n\n{text}")
        bench_report.update_marked_block(ROOT / "docs" / "performance.md", block, name="batching")
    return 0


if __name__ == "__main__":
    sys.exit(main())
