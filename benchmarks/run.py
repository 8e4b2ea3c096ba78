"""The issue's speed table: both real models, every available engine, one run.

    python benchmarks/run.py [--repeats 3] [--models smollm2-135m,gemma3-270m,llama-1b-shape] [--peers all]
                             [--backends numpy,torch,mlx] [--update-docs] [-v]
    python benchmarks/run.py --from benchmarks/results/latest.json --update-docs
    python benchmarks/run.py --long [--repeats 3] [--models llama-1b-shape,qwen35-0.8b-shape,lfm2-1.2b-shape]

Runs :func:`infer.tools.bench.run_benchmark` on SmolLM2-135M (GGUF Q4_1) and
Gemma3-270M (GGUF Q4_K_M), both fetched by catalog alias, and on a Llama of
Llama-3.2-1B's shape in Q4_K_M with random weights (``llama-1b-shape``: written
by ``benchmarks/random_llama.py`` into the cache the first time), with infer as
``infer.load(path)`` picks it (the default), infer on every available
backend, infer on numpy with float32 weights (``quantize="off"``), and the peers that are installed (llama.cpp, transformers float32
and bfloat16, mlx-lm), ratios against llama.cpp. Writes
``benchmarks/results/latest.json`` (``{"reports": [one per model]}``) and
``latest.png``, and checks issue 36's targets on them.

The hybrids ``qwen35-0.8b-shape`` (Qwen3.5-0.8B's shape: hidden 1024, 24
layers, 3 gated-DeltaNet : 1 full attention, MLP 3584) and
``lfm2-1.2b-shape`` (LFM2-1.2B's: 10 short-conv : 6 GQA layers) are rows of
the same table, Q4_K_M with random weights written once into the cache by
``benchmarks/random_hybrid.py``; issue 51's targets are checked on them too.

``--long`` is the long-context mode, run on its own (``long.json``): each
model decodes ``--long-new-tokens`` tokens after a 4,096-token and a
16,384-token prompt (``--repeats`` at 4k, one repeat at 16k), infer with a
float16 KV pool (and a q8_0 one where the backend lists it; with
``--long-q8``, each also with int8 activations) against llama.cpp's default
float16 cache, and issue 51's long-context targets are checked.
``--update-docs`` rewrites the marked results block of
docs/performance.md and README.md from those results (``--from`` does that
from an earlier JSON without measuring again).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from infer.tools import bench, bench_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("smollm2-135m", "gemma3-270m", "llama-1b-shape", "qwen35-0.8b-shape", "lfm2-1.2b-shape")
#: The 1B-class model's name here.
LLAMA_1B = "llama-1b-shape"
#: Random-weight models written once into the cache: name -> (file name, writer module, family argument).
SYNTHETIC = {
    LLAMA_1B: ("llama-1b-ctx128k-q4_k_m.gguf", "random_llama", None),
    "qwen35-0.8b-shape": ("qwen35-0.8b-q4_k_m.gguf", "random_hybrid", "qwen35"),
    "lfm2-1.2b-shape": ("lfm2-1.2b-q4_k_m.gguf", "random_hybrid", "lfm2"),
}
HYBRIDS = ("qwen35-0.8b-shape", "lfm2-1.2b-shape")
#: The long-context mode's models and context lengths (prompt tokens), with the repeats at each
#: (None: --repeats).
LONG_MODELS = (LLAMA_1B, *HYBRIDS)
LONG_CONTEXTS = ((4096, None), (16384, 1))
#: infer's own backends (third-party plugins are measured when named with --backends).
FIRST_PARTY = ("numpy", "torch", "mlx")
FLOAT32_NUMPY = "infer numpy float32 weights"


def engines(backends: str | None, peers: str, float32: bool = True) -> list[bench.EngineSpec]:
    """infer's default, infer on each backend asked for (default: every
    available first-party one, in its default dtype), infer on numpy with
    float32 weights (``quantize="off"``, for the bandwidth bound), then the peers."""
    from infer.plugins.selection import list_backends, select_backend

    specs = [bench.infer_engine(label="infer (default)")]
    if backends is None:
        names = [f"{b.name}:{b.device}" for b in list_backends() if b.available and b.plugin in FIRST_PARTY]
    else:
        names = [b.strip() for b in backends.split(",") if b.strip()]
    specs += [bench.infer_engine(name) for name in names]
    # Issue 50's approximate mode: int8 activations, on every backend asked for that lists it.
    specs += [bench.infer_engine(name, activations="q8", label=q8_label(name)) for name in names
              if "q8" in select_backend(name, None).activation_schemes]
    # The bandwidth-bound target is about float32 weights: GGUF weights dequantized at load.
    if float32:
        specs.append(bench.infer_engine("numpy:cpu", "float32", quantize="off", label=FLOAT32_NUMPY))
    return specs + bench.parse_peers(peers)


def q8_label(backend: str) -> str:
    """The label of a backend's int8-activation row (``activations="q8"``, approximate)."""
    return f"infer {backend} q8 (approximate)"


def model_path(name: str) -> str:
    """An alias or path as run_benchmark takes it; the random-weight models (:data:`SYNTHETIC`)
    are written once, into the cache."""
    if name not in SYNTHETIC:
        return name
    import importlib

    from infer.paths import cache_dir

    file_name, module, family = SYNTHETIC[name]
    path = cache_dir() / "bench" / file_name
    if not path.exists():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        writer = importlib.import_module(module)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        writer.write(partial) if family is None else writer.write(family, partial)
        partial.replace(path)
    return str(path)


def model_name(report: dict[str, Any]) -> str:
    """The name a report's model was asked for (a :data:`SYNTHETIC` name for a cached file)."""
    reference = report["model"]["reference"]
    # (llama-1b-q4_k_m.gguf: the 1B-class file before its context was raised to 128k.)
    by_file = {"llama-1b-q4_k_m.gguf": LLAMA_1B} | {file_name: name for name, (file_name, _, _) in SYNTHETIC.items()}
    return by_file.get(Path(reference).name, reference)


def _row(report: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((e for e in report["engines"] if e["label"] == label and e["status"] == "ok"), None)


def targets(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issues 36 (speed at 1B parameters), 50 (int8 activations) and 51 (the hybrids, load),
    each with the measured value and whether it is met. Ratios are against
    llama.cpp in the same run; the torch/cpu one against the numpy backend's row."""
    out: list[dict[str, Any]] = []

    def check(model: str, what: str, value: float | None, goal: float, at_least: bool = True) -> None:
        met = None if value is None else (value >= goal if at_least else value <= goal)
        out.append({"model": model, "target": what, "measured": value, "goal": goal, "met": met})

    for report in suite["reports"]:
        name = model_name(report)
        default, peer = _row(report, "infer (default)"), _row(report, "llama.cpp")
        if default is None:
            continue
        r, m = default.get("ratios") or {}, default["median"]
        mine = (default.get("info") or {}).get("weight_bytes_per_token")
        theirs = None if peer is None else (peer.get("info") or {}).get("weight_bytes_per_token")
        if mine and theirs:
            check(name, "weight bytes read per token ≤ llama.cpp's (ratio)", mine / theirs, 1.0, at_least=False)
        if name in HYBRIDS:  # issue 51: the hybrids at llama.cpp's speed, in exact mode
            check(name, "decode (exact) ≥ 1.0× llama.cpp", r.get("decode_tok_s"), 1.0)
            check(name, "prefill (exact) ≥ 1.0× llama.cpp", r.get("prefill_tok_s"), 1.0)
        else:
            check(name, "decode ≥ 1.25× llama.cpp", r.get("decode_tok_s"), 1.25)
        if name == LLAMA_1B:
            check(name, "prefill (exact) ≥ 1.0× llama.cpp", r.get("prefill_tok_s"), 1.0)
        if peer is not None and peer["median"]["load_s"]:
            # The load includes building the tokenizer (infer.load does), what a first prompt's encoding needs.
            check(name, "load ≤ 1.0× llama.cpp's", m["load_s"] / peer["median"]["load_s"], 1.0, at_least=False)
        if m["peak_rss_bytes"] is not None and peer is not None and peer["median"]["peak_rss_bytes"]:
            check(name, "peak RSS ≤ llama.cpp's (ratio)", m["peak_rss_bytes"] / peer["median"]["peak_rss_bytes"],
                  1.0, at_least=False)
        numpy = _row(report, "infer numpy") or _row(report, "infer numpy:cpu")
        torch_cpu = _row(report, "infer torch:cpu") or _row(report, "infer torch")
        if numpy is not None and torch_cpu is not None and numpy["median"]["decode_tok_s"]:
            check(name, "torch/cpu decode ≥ 1.0× numpy",
                  torch_cpu["median"]["decode_tok_s"] / numpy["median"]["decode_tok_s"], 1.0)
        # Issue 50: int8 activations (the q8 rows) against llama.cpp, and torch/cpu against numpy in q8 too.
        q8 = _row(report, q8_label("numpy:cpu"))
        q8_ratios = (q8 or {}).get("ratios") or {}
        if name == LLAMA_1B:
            check(name, "decode (exact) ≥ 0.9× llama.cpp", r.get("decode_tok_s"), 0.9)
            if q8 is not None:
                check(name, "prefill (q8) ≥ 1.5× llama.cpp", q8_ratios.get("prefill_tok_s"), 1.5)
                check(name, "decode (q8) ≥ 1.05× llama.cpp", q8_ratios.get("decode_tok_s"), 1.05)
        elif name not in HYBRIDS and q8 is not None:
            check(name, "decode (q8) ≥ 1.25× llama.cpp", q8_ratios.get("decode_tok_s"), 1.25)
        torch_q8 = _row(report, q8_label("torch:cpu"))
        if q8 is not None and torch_q8 is not None and q8["median"]["decode_tok_s"]:
            check(name, "torch/cpu decode (q8) ≥ 1.0× numpy (q8)",
                  torch_q8["median"]["decode_tok_s"] / q8["median"]["decode_tok_s"], 1.0)
    return out


F16_POOL, Q8_POOL = "infer kv float16", "infer kv q8_0"
#: The same pools with int8 activations (activations="q8"), the products llama.cpp's own kind.
Q8_ACT = " q8 (approximate)"


def long_engines(backend: str | None, activations: bool = False) -> list[bench.EngineSpec]:
    """infer with a float16 KV pool, with a q8_0 one where the backend lists it (with
    ``activations``, each also with int8 activations), and llama.cpp (its default cache is float16)."""
    from infer.plugins.selection import select_backend

    pools = [("float16", F16_POOL)]
    if "q8_0" in select_backend(backend, None).kv_dtypes:
        pools.append(("q8_0", Q8_POOL))
    specs = [bench.infer_engine(backend, kv_dtype=kv, label=label) for kv, label in pools]
    if activations:
        specs += [bench.infer_engine(backend, kv_dtype=kv, activations="q8", label=label + Q8_ACT)
                  for kv, label in pools]
    return specs + bench.parse_peers("llama.cpp")


def run_long(models: list[str], backend: str | None, repeats: int, new_tokens: int, threads: int | None,
             contexts: tuple[tuple[int, int | None], ...] = LONG_CONTEXTS, activations: bool = False) -> dict[str, Any]:
    """The long-context mode: each model at each of ``contexts`` ((prompt tokens, repeats or None)...)."""
    reports = []
    for name in models:
        for context, fixed in contexts:
            config = bench.BenchConfig(repeats=fixed or repeats, prompt_tokens=context, new_tokens=new_tokens,
                                       threads=threads, baseline="llama.cpp")
            report = bench.run_benchmark(model_path(name), long_engines(backend, activations), config)
            report["context"] = context
            reports.append(report)
    suite = {"schema": "infer-bench-suite/1", "mode": "long", "reports": reports}
    suite["targets"] = long_targets(suite)
    return suite


def long_targets(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 51's long-context targets: decode against llama.cpp's float16 cache at 4k
    (≥ 1.0× with infer's float16 pool, ≥ 1.15× with q8_0) and 16k (≥ 1.0×), peak RSS at 4k."""
    out: list[dict[str, Any]] = []
    for report in suite["reports"]:
        name, context = model_name(report), report.get("context") or report["settings"]["prompt_tokens"]
        peer = _row(report, "llama.cpp")
        if peer is None or not peer["median"]["decode_tok_s"]:
            continue
        where = f"{name} @ {context // 1024}k" if context % 1024 == 0 else f"{name} @ {context} tokens"
        goals = ((F16_POOL, 1.0), (Q8_POOL, 1.15 if context <= 4096 else 1.0))
        for label, goal in goals + tuple((label + Q8_ACT, goal) for label, goal in goals):
            row = _row(report, label)
            if row is None or not row["median"]["decode_tok_s"]:
                continue
            value = row["median"]["decode_tok_s"] / peer["median"]["decode_tok_s"]
            out.append({"model": where, "target": f"decode, {label} ≥ {goal:g}× llama.cpp (float16 cache)",
                        "measured": value, "goal": goal, "met": value >= goal})
        mine = _row(report, F16_POOL)
        if context <= 4096 and mine is not None and mine["median"]["peak_rss_bytes"] and \
                peer["median"]["peak_rss_bytes"]:
            value = mine["median"]["peak_rss_bytes"] / peer["median"]["peak_rss_bytes"]
            out.append({"model": where, "target": "peak RSS ≤ 1.1× llama.cpp's (ratio)", "measured": value,
                        "goal": 1.1, "met": value <= 1.1})
    return out


def format_targets(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | target | measured | met |", "|---|---|---|---|"]
    for t in rows:
        value = "–" if t["measured"] is None else f"{t['measured']:.2f}"
        met = "–" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['model']} | {t['target']} | {value} | {met} |")
    return "\n".join(lines)


def update_docs(suite: dict[str, Any], image: Path | None) -> None:
    reports = suite["reports"]
    for doc, rel in ((ROOT / "docs" / "performance.md", "../benchmarks/results/latest.png"),
                     (ROOT / "README.md", "benchmarks/results/latest.png")):
        block = bench_report.results_block(reports, rel if image is not None else None)
        if doc.name == "performance.md":
            block += "\n\nThe targets of issues 36, 50 and 51, checked on these figures:\n\n" + format_targets(targets(suite))
        bench_report.update_marked_block(doc, block)
        print(f"updated {doc.relative_to(ROOT)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models (aliases or paths)")
    parser.add_argument("--backends", default=None,
                        help="infer backends (default: every available one; '' for the default row alone)")
    parser.add_argument("--no-float32", action="store_true", help="leave out the float32-weights row")
    parser.add_argument("--peers", default="all", help="as for infer bench --peers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument("--from", dest="from_json", default=None, help="use this JSON instead of measuring")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the results block of the docs")
    parser.add_argument("--long", action="store_true",
                        help="the long-context mode (4k and 16k tokens of context), written to long.json")
    parser.add_argument("--long-new-tokens", type=int, default=32, help="tokens decoded after each long prompt")
    parser.add_argument("--long-q8", action="store_true",
                        help="in --long, each KV pool also with int8 activations (activations='q8')")
    parser.add_argument("--long-contexts", default=",".join(str(c) for c, _ in LONG_CONTEXTS),
                        help="prompt lengths of the long-context mode (16384 and longer run once)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.long:
        return main_long(args)
    out = Path(args.out)
    if args.from_json:
        suite = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        config = bench.BenchConfig(repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                                   new_tokens=args.new_tokens, threads=args.threads, baseline="llama.cpp")
        specs = engines(args.backends, args.peers, float32=not args.no_float32)
        suite = {"schema": "infer-bench-suite/1",
                 "reports": [bench.run_benchmark(model_path(m.strip()), specs, config)
                             for m in args.models.split(",")]}
        suite["targets"] = targets(suite)
        bench.write_json(suite, out)
        print(f"written: {out}", file=sys.stderr)
    image = bench_report.plot(suite["reports"], out.with_suffix(".png"))
    print(f"Measured {bench_report.machine_line(suite['reports'][0])}\n")
    print(bench_report.markdown_table(suite["reports"]))
    print("\nIssue 36, 50 and 51 targets:\n")
    print(format_targets(targets(suite)))
    if args.update_docs:
        update_docs(suite, image)
    return 0


def main_long(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out != str(RESULTS / "latest.json") else RESULTS / "long.json"
    if args.from_json:
        suite = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        models = LONG_MODELS if args.models == ",".join(MODELS) else [m.strip() for m in args.models.split(",")]
        backend = args.backends.split(",")[0] if args.backends else None
        contexts = tuple((int(c), 1 if int(c) >= 16384 else None) for c in args.long_contexts.split(","))
        suite = run_long(list(models), backend, args.repeats, args.long_new_tokens, args.threads, contexts,
                         args.long_q8)
        bench.write_json(suite, out)
        print(f"written: {out}", file=sys.stderr)
    print(f"Measured {bench_report.machine_line(suite['reports'][0])}\n")
    for report in suite["reports"]:
        print(f"### {model_name(report)}, {report.get('context')} tokens of context\n")
        print(bench_report.markdown_table([report]) + "\n")
    print("Issue 51 long-context targets:\n")
    print(format_targets(long_targets(suite)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
