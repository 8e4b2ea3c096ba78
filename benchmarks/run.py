"""The issue's speed table: both real models, every available engine, one run.

    python benchmarks/run.py [--repeats 3] [--models smollm2-135m,gemma3-270m,llama-1b-shape] [--peers all]
                             [--backends numpy,torch,mlx] [--update-docs] [-v]
    python benchmarks/run.py --from benchmarks/results/latest.json --update-docs

Runs :func:`infer.tools.bench.run_benchmark` on SmolLM2-135M (GGUF Q4_1) and
Gemma3-270M (GGUF Q4_K_M), both fetched by catalog alias, and on a Llama of
Llama-3.2-1B's shape in Q4_K_M with random weights (``llama-1b-shape``: written
by ``benchmarks/random_llama.py`` into the cache the first time), with infer as
``infer.load(path)`` picks it (the default), infer on every available
backend, infer on numpy with float32 weights (``quantize="off"``), and the peers that are installed (llama.cpp, transformers float32
and bfloat16, mlx-lm), ratios against llama.cpp. Writes
``benchmarks/results/latest.json`` (``{"reports": [one per model]}``) and
``latest.png``, and checks issue 36's targets on them.
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
MODELS = ("smollm2-135m", "gemma3-270m", "llama-1b-shape")
#: The 1B-class model's name here, and where it is written.
LLAMA_1B = "llama-1b-shape"
#: infer's own backends (third-party plugins are measured when named with --backends).
FIRST_PARTY = ("numpy", "torch", "mlx")
FLOAT32_NUMPY = "infer numpy float32 weights"


def engines(backends: str | None, peers: str) -> list[bench.EngineSpec]:
    """infer's default, infer on each backend asked for (default: every
    available first-party one, in its default dtype), infer on numpy with
    float32 weights (``quantize="off"``, for the bandwidth bound), then the peers."""
    from infer.plugins.selection import list_backends

    specs = [bench.infer_engine(label="infer (default)")]
    if backends is None:
        names = [f"{b.name}:{b.device}" for b in list_backends() if b.available and b.plugin in FIRST_PARTY]
    else:
        names = [b.strip() for b in backends.split(",") if b.strip()]
    specs += [bench.infer_engine(name) for name in names]
    # The bandwidth-bound target is about float32 weights: GGUF weights dequantized at load.
    specs.append(bench.infer_engine("numpy:cpu", "float32", quantize="off", label=FLOAT32_NUMPY))
    return specs + bench.parse_peers(peers)


def model_path(name: str) -> str:
    """An alias or path as run_benchmark takes it; ``llama-1b-shape`` is written once, into the cache."""
    if name != LLAMA_1B:
        return name
    from infer.paths import cache_dir

    path = cache_dir() / "bench" / "llama-1b-q4_k_m.gguf"
    if not path.exists():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import random_llama

        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        random_llama.write(partial)
        partial.replace(path)
    return str(path)


def _row(report: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((e for e in report["engines"] if e["label"] == label and e["status"] == "ok"), None)


def targets(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issue 36 (speed at 1B parameters), each with the measured
    value and whether it is met. Ratios are against llama.cpp in the same run;
    the torch/cpu one against the numpy backend's row."""
    out: list[dict[str, Any]] = []

    def check(model: str, what: str, value: float | None, goal: float, at_least: bool = True) -> None:
        met = None if value is None else (value >= goal if at_least else value <= goal)
        out.append({"model": model, "target": what, "measured": value, "goal": goal, "met": met})

    for report in suite["reports"]:
        name = report["model"]["reference"]
        name = LLAMA_1B if name.endswith("llama-1b-q4_k_m.gguf") else name
        default, peer = _row(report, "infer (default)"), _row(report, "llama.cpp")
        if default is None:
            continue
        r, m = default.get("ratios") or {}, default["median"]
        mine = (default.get("info") or {}).get("weight_bytes_per_token")
        theirs = None if peer is None else (peer.get("info") or {}).get("weight_bytes_per_token")
        if mine and theirs:
            check(name, "weight bytes read per token ≤ llama.cpp's (ratio)", mine / theirs, 1.0, at_least=False)
        check(name, "decode ≥ 1.25× llama.cpp", r.get("decode_tok_s"), 1.25)
        if name == LLAMA_1B:
            check(name, "prefill (exact) ≥ 1.0× llama.cpp", r.get("prefill_tok_s"), 1.0)
        if peer is not None and peer["median"]["load_s"]:
            check(name, "load ≤ 1.0× llama.cpp's", m["load_s"] / peer["median"]["load_s"], 1.0, at_least=False)
        if m["peak_rss_bytes"] is not None and peer is not None and peer["median"]["peak_rss_bytes"]:
            check(name, "peak RSS ≤ llama.cpp's (ratio)", m["peak_rss_bytes"] / peer["median"]["peak_rss_bytes"],
                  1.0, at_least=False)
        numpy = _row(report, "infer numpy") or _row(report, "infer numpy:cpu")
        torch_cpu = _row(report, "infer torch:cpu") or _row(report, "infer torch")
        if numpy is not None and torch_cpu is not None and numpy["median"]["decode_tok_s"]:
            check(name, "torch/cpu decode ≥ 1.0× numpy",
                  torch_cpu["median"]["decode_tok_s"] / numpy["median"]["decode_tok_s"], 1.0)
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
            block += "\n\nThe targets of issue 36, checked on these figures:\n\n" + format_targets(targets(suite))
        bench_report.update_marked_block(doc, block)
        print(f"updated {doc.relative_to(ROOT)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models (aliases or paths)")
    parser.add_argument("--backends", default=None, help="infer backends (default: every available one)")
    parser.add_argument("--peers", default="all", help="as for infer bench --peers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument("--from", dest="from_json", default=None, help="use this JSON instead of measuring")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the results block of the docs")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    out = Path(args.out)
    if args.from_json:
        suite = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        config = bench.BenchConfig(repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                                   new_tokens=args.new_tokens, threads=args.threads, baseline="llama.cpp")
        specs = engines(args.backends, args.peers)
        suite = {"schema": "infer-bench-suite/1",
                 "reports": [bench.run_benchmark(model_path(m.strip()), specs, config)
                             for m in args.models.split(",")]}
        suite["targets"] = targets(suite)
        bench.write_json(suite, out)
        print(f"written: {out}", file=sys.stderr)
    image = bench_report.plot(suite["reports"], out.with_suffix(".png"))
    print(f"Measured {bench_report.machine_line(suite['reports'][0])}\n")
    print(bench_report.markdown_table(suite["reports"]))
    print("\nIssue 36 targets:\n")
    print(format_targets(targets(suite)))
    if args.update_docs:
        update_docs(suite, image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
