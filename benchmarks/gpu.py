"""The GPU run: CUDA tests, the real models' greedy tokens on torch/cuda
against the float32 reference, and the harness on both models in bfloat16
and int4 against transformers bfloat16 on the same GPU.

It is written to fit a short lease on a GPU machine (one call, stages in
order of importance, each with its own time limit, everything written to
``--out``), and runs anywhere torch sees a CUDA device:

    # on a machine with the models and no GPU needed: the float32 reference tokens
    python benchmarks/gpu.py --reference-only --smollm2 S.gguf --gemma3 G.gguf --reference ref.json
    # on the GPU machine
    python benchmarks/gpu.py --smollm2 S.gguf --gemma3 G.gguf --reference ref.json --out results/

Figures from the last run are in docs/performance.md ("On a GPU").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, in a small village,"]
TOKENS = 32
#: (label, dtype, quantize) of the infer engines checked and measured on the GPU.
VARIANTS = [("float32", "float32", None), ("bfloat16", "bfloat16", None), ("int4", "bfloat16", "q4")]


def reference(models: dict[str, str]) -> dict[str, Any]:
    """Greedy tokens from the numpy backend in float32 (equal to transformers
    float32 on these models: tests/test_real_gguf.py)."""
    import infer

    out: dict[str, Any] = {}
    for name, path in models.items():
        model = infer.load(path, backend="numpy")
        out[name] = [list(model.generate_tokens(model.tokenizer.encode(p), max_tokens=TOKENS, ignore_eos=True))
                     for p in PROMPTS]
    return out


def tokens(models: dict[str, str], want: dict[str, Any], device: str) -> dict[str, Any]:
    """For each model and variant on torch/cuda: how many leading greedy
    tokens equal the float32 reference, per prompt."""
    import infer

    out: dict[str, Any] = {}
    for name, path in models.items():
        for label, dtype, quantize in VARIANTS:
            t0 = time.perf_counter()
            kwargs = {"quantize": quantize} if quantize else {}
            model = infer.load(path, backend=f"torch:{device}", dtype=dtype, **kwargs)
            agree = []
            for prompt, ref in zip(PROMPTS, want[name]):
                got = list(model.generate_tokens(model.tokenizer.encode(prompt), max_tokens=TOKENS, ignore_eos=True))
                agree.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref)))
            out[f"{name} {label}"] = {"leading_tokens_equal": agree, "of": TOKENS, "seconds": time.perf_counter() - t0}
            print(f"tokens {name} {label}: {agree} of {TOKENS}", flush=True)
            del model
    return out


def bench(models: dict[str, str], out: Path, repeats: int, compile_too: bool, device: str, peer_too: bool) -> None:
    from infer import bench as b
    from infer.tools import bench_report

    engines = [b.infer_engine(f"torch:{device}", dtype, quantize, label=f"infer torch/{device} {label}")
               for label, dtype, quantize in VARIANTS if label != "float32"]
    if compile_too:
        engines.append(b.infer_engine(f"torch:{device}", "bfloat16", compile=True,
                                      label=f"infer torch/{device} bfloat16 compiled"))
    peer = b.peer_engine("transformers", "bfloat16", device=device) if peer_too else None
    if peer is not None:
        engines.append(peer)
    reports = []
    for name, path in models.items():
        config = b.BenchConfig(repeats=repeats, baseline=peer.label if peer else engines[0].label, timeout_s=300)
        report = b.run_benchmark(path, engines, config)
        b.write_json(report, out / f"gpu-{name}.json")
        reports.append(report)
        print(bench_report.machine_line(report), flush=True)
    table = bench_report.markdown_table(reports)
    (out / f"gpu-table-{'-'.join(models)}.md").write_text(table + "\n")
    print(table, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", help="SmolLM2-135M Q4_1 GGUF")
    ap.add_argument("--gemma3", help="Gemma3-270M Q4_K_M GGUF")
    ap.add_argument("--reference", help="JSON of float32 reference tokens (needed unless tokens is skipped)")
    ap.add_argument("--reference-only", action="store_true", help="write the reference and stop")
    ap.add_argument("--out", default="gpu-results")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tests-timeout", type=float, default=240)
    ap.add_argument("--compile", action="store_true", help="also measure compile=True")
    ap.add_argument("--no-peer", action="store_true",
                    help="leave out transformers bfloat16 (its GGUF load takes most of the bench stage's time)")
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: tests,tokens,bench")
    ap.add_argument("--device", default="cuda", help="torch device (cpu only to try the script out)")
    args = ap.parse_args(argv)
    # Either model may be left out, so a lease can measure one while the other is still on its way.
    models = {name: path for name, path in (("smollm2", args.smollm2), ("gemma3", args.gemma3)) if path}
    skip = set(filter(None, args.skip.split(",")))
    if not models and not {"tokens", "bench"} <= skip:
        ap.error("name a model (--smollm2, --gemma3), or skip the tokens and bench stages")
    if models and "tokens" not in skip and not args.reference:
        ap.error("--reference is needed for the tokens stage")
    if args.reference_only:
        Path(args.reference).write_text(json.dumps(reference(models)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "tests" not in skip:  # the CUDA tests, then the conformance kit on torch/cuda in each dtype
        runs = {"cuda tests": ["tests/test_torch_backend.py", "tests/test_quantization.py", "-k", "cuda or CUDA"],
                "graph capture": ["tests/test_graph_capture.py", "-k", "cuda"],
                "conformance": ["--pyargs", "infer.testing", "--infer-backend", f"torch:{args.device}",
                                "--infer-examples", "10"]}
        logs = []
        for what, extra in runs.items():
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
            try:
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout)
                log = done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:
                partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
                log = f"{partial or ''}\ntimed out after {args.tests_timeout} s"
            logs.append(f"== {what}: {' '.join(cmd)}\n{log}")
            print(f"{what}:", log.strip().splitlines()[-1] if log.strip() else "no output", flush=True)
        (out / "gpu-tests.txt").write_text("\n".join(logs))
    if "tokens" not in skip and models:
        want = json.loads(Path(args.reference).read_text())
        (out / f"gpu-tokens-{'-'.join(models)}.json").write_text(json.dumps(tokens(models, want, args.device), indent=1))
    if "bench" not in skip and models:
        bench(models, out, args.repeats, args.compile, args.device, not args.no_peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
