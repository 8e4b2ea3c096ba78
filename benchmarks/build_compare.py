"""Two builds of the CPU kernels, alternating in one process: the same calls, timed on each.

Builds the C kernels of another revision (``--old``) and of this
working tree, each with its own setup.py (the same compiler and flags), loads both
modules side by side, and times the same work on each, alternating round by round
(the order swapped every round), so that a machine whose speed drifts, or which
other work shares, moves both alike:

* kernel calls: the quantized products of decoding (one row of x, every GGML block
  type as stored and the converted affine forms), of batched decoding (8 rows), with
  int8 activations (64 rows), dequantization for prefill's BLAS, float32 products,
  attention over float32 and float16 keys, rms_norm and rope;
* with ``--model``: greedy decoding (a token's time, the recorded program) and a
  prefill (``--prompt`` tokens) of the numpy backend, one loaded model pointed at one
  build and then the other.

Each round takes the fastest of ``--inner`` tries of each item on each build
(alternating), so that a try another process interrupted drops out. Prints, per
item, each build's median and the median of the per-round ratios (new over old:
below 1 is faster). Rounds where other processes took more than ``--quiet`` cores
are not counted (as benchmarks/stored_blocks.py); on a shared machine, a large
``--quiet``, one thread (``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``: no thread
of a product waits on a descheduled one) and ``--clock cpu`` (the process's CPU
time, which time spent descheduled does not add to) keep the comparison fair.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/build_compare.py --old f4d65c8 \\
        --rounds 30 --clock cpu --quiet 2 --model ~/.cache/infer/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_sample() -> tuple[float, float, float]:
    """(wall seconds, machine busy CPU seconds, this process's CPU seconds)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    mine = os.times()
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, mine.user + mine.system


def build(tree: pathlib.Path, into: pathlib.Path) -> ModuleType:
    """The extension of ``tree`` (a copy holding setup.py and backends/), built by its
    own setup.py into ``into`` and loaded under its own module name."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(into / "lib"),
                    "--build-temp", str(into / "temp")], cwd=tree, check=True)
    found = sorted((into / "lib").rglob("*.so"))
    if len(found) != 1:
        raise SystemExit(f"expected one extension module in {into}, found {found}")
    name = found[0].name.split(".")[0]  # its PyInit_ name: _affine before the split, _kernels after
    spec = importlib.util.spec_from_file_location(name, found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkout(rev: str | None, into: pathlib.Path) -> pathlib.Path:
    """setup.py and backends/ of ``rev`` (None: the working tree) copied into ``into``."""
    into.mkdir(parents=True)
    if rev is None:
        shutil.copy(ROOT / "setup.py", into)
        shutil.copytree(ROOT / "backends", into / "backends", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    else:
        archive = subprocess.run(["git", "archive", rev, "setup.py", "backends"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def kernel_work() -> dict[str, Callable[[ModuleType], None]]:
    """The kernel calls timed, by name: each takes a build and makes its calls."""
    from infer.backends.cpu.kernels import BLOCK_FORMS, Q8_FLAG
    from infer.formats import gguf_quants
    from infer.quantize import quantize_affine

    rng = np.random.default_rng(0)
    k, n = 2048, 2048
    x1, x8, x64 = (rng.standard_normal((m, k)).astype(np.float32) for m in (1, 8, 64))
    work: dict[str, Callable[[ModuleType], None]] = {}

    def product(name: str, args: tuple, x: np.ndarray, bits: int, calls: int) -> None:
        out = np.empty((x.shape[0], n), np.float32)
        codes, scales, biases, group, half, factor = args

        def run(mod: ModuleType) -> None:
            for _ in range(calls):
                mod.gemv(bits, x, codes, scales, biases, out, x.shape[0], k, n, group, half, factor)
        work[name] = run

    empty = np.empty(0, np.float32)
    for qtype, form in sorted(BLOCK_FORMS.items()):
        raw = gguf_quants.random_blocks(qtype, n, k, 0)
        args = (raw, empty, None, 256 if qtype.endswith("_K") else 32, False, 0.0)
        product(f"gemv 1x{k}x{n} {qtype} blocks", args, x1, form, 20)
        if qtype in ("Q4_0", "Q4_K", "Q6_K"):
            product(f"gemv 8x{k}x{n} {qtype} blocks", args, x8, form, 5)
        if qtype == "Q4_K":
            product(f"gemv 64x{k}x{n} {qtype} blocks q8", args, x64, form | Q8_FLAG, 1)
            slab = np.empty((256, k), np.float32)

            def dequantize(mod: ModuleType, raw: np.ndarray = raw, form: int = form) -> None:
                for r0 in range(0, n, 256):  # prefill's slabs, on the calling thread
                    mod.dequantize(form, raw[r0:r0 + 256], empty, None, slab, 256, k, False, 256, False, 0.0)
            work[f"dequantize {k}x{n} {qtype} slabs"] = dequantize
    w = rng.standard_normal((n, k)).astype(np.float32)
    for scheme in ("q4", "q8"):
        a = quantize_affine(w, scheme)
        args = (a.packed, a.scales.astype(np.float16), a.biases.astype(np.float16), 32, True, 0.0)
        product(f"gemv 1x{k}x{n} {scheme} affine float16 scales", args, x1, a.bits, 20)
    out_f = np.empty((1, n), np.float32)
    work[f"gemv_f32 1x{k}x{n}"] = lambda mod: [mod.gemv_f32(x1, w, out_f, 1, k, n) for _ in range(5)]
    tk, hq, hkv, d = 1024, 16, 4, 64
    q = rng.standard_normal((1, hq, d)).astype(np.float32)
    kv = rng.standard_normal((2, tk, hkv, d)).astype(np.float32)
    kv16 = kv.astype(np.float16)
    att = np.empty((1, hq, d), np.float32)
    for label, pool in (("float32", kv), ("float16", kv16)):
        work[f"attention 1x{tk} {hq}/{hkv} heads {label}"] = (
            lambda mod, p=pool: [mod.attention(q, p[0], p[1], att, 1, tk, hq, hkv, d, d, 0.125, True, 0, 0.0, None, 0,
                                               True, None, p.dtype == np.float16) for _ in range(20)])
    h = rng.standard_normal((1, k)).astype(np.float32)
    norm_w, normed = np.ones(k, np.float32), np.empty((1, k), np.float32)
    work[f"rms_norm 1x{k}"] = lambda mod: [mod.rms_norm(h, norm_w, normed, 1, k, 1e-6) for _ in range(200)]
    xr = rng.standard_normal((1, hq, d)).astype(np.float32)
    cos, sin, rot = np.ones((1, d // 2), np.float32), np.zeros((1, d // 2), np.float32), np.empty_like(xr)
    work[f"rope 1x{hq}x{d}"] = lambda mod: [mod.rope(xr, cos, sin, rot, 1, hq, d, d // 2) for _ in range(200)]
    return work


#: The build the recorded programs run on (point_at sets it).
CURRENT: list[ModuleType] = []


def point_at(mod: ModuleType) -> None:
    """The numpy backend's kernels made ``mod``: its eager ops, and the recorded
    programs (one model serves both builds, so that both compute in the same memory:
    two loaded models differ by their buffers' placement alone by up to 6%)."""
    from infer.backends.cpu import backend, kernels, plan

    kernels.native = backend._native = mod
    if kernels.GOVERNOR is not None:
        kernels.GOVERNOR.kernels = mod
    if not CURRENT:
        def run(self: plan.Plan, leaves: tuple[np.ndarray, ...], originals: list[Any]) -> Any:
            CURRENT[0].run_plan(self.code, self.floats, leaves, self.sizes)  # Plan.__call__, on the build in use
            return self.result_for(originals)
        plan.Plan.__call__ = run  # type: ignore[method-assign]
        CURRENT.append(mod)
    CURRENT[0] = mod


def model_work(path: str, builds: dict[str, ModuleType], tokens: int, prompt: int,
               clock: Callable[[], float]) -> dict[str, Callable[[ModuleType], float]]:
    """Decode and prefill of the model at ``path``, on whichever build is passed."""
    import infer

    point_at(builds["new"])
    model = infer.load(path, backend="numpy")
    base = model.tokenizer.encode("The capital of France is a city that " * 64)[:prompt]
    list(model.generate_tokens(base[:8], max_tokens=8, ignore_eos=True))  # records the decode program
    calls = [0]

    def decode(mod: ModuleType) -> float:
        point_at(mod)
        steps = iter(model.generate_tokens(base[:8], max_tokens=tokens + 1, ignore_eos=True))
        next(steps)
        start = clock()
        count = sum(1 for _ in steps)
        return (clock() - start) / count  # seconds a token

    def prefill(mod: ModuleType) -> float:
        point_at(mod)
        calls[0] += 1  # a prompt of its own each call, so no cached prefix serves it
        ids = list(np.random.default_rng(calls[0]).permutation(base))
        start = clock()
        next(iter(model.generate_tokens(ids, max_tokens=1, ignore_eos=True)))
        return clock() - start
    return {f"decode a token ({tokens} greedy)": decode, f"prefill {prompt} tokens": prefill}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the revision built as the baseline")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=3, help="tries of each item per build and round (the fastest counts)")
    parser.add_argument("--model", help="a model to time decoding and prefill on (numpy backend)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded a round")
    parser.add_argument("--prompt", type=int, default=128, help="tokens of the prefill timed")
    parser.add_argument("--path", default=None, help="kernel path both builds run (portable, avx2+fma, avx512)")
    parser.add_argument("--quiet", type=float, default=0.5, help="most cores other work may take in a counted round")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with one thread, what other processes cannot stretch)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        builds = {"old": build(checkout(args.old, t / "old"), t / "old-build"),
                  "new": build(checkout(None, t / "new"), t / "new-build")}
    for name, mod in builds.items():
        if args.path:
            mod.use_simd(args.path)
        print(f"{name}: {mod.__name__} {mod.simd()}, {mod.threads()} threads", flush=True)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    work: dict[str, Callable[[ModuleType], Any]] = kernel_work()
    timed_by_return = set()
    if args.model:
        extra = model_work(os.path.expanduser(args.model), builds, args.tokens, args.prompt, clock)
        work.update(extra)
        timed_by_return = set(extra)
    for run in work.values():  # warm both: pages, caches, OpenMP's threads
        for mod in builds.values():
            run(mod)
    times: dict[str, dict[str, list[float]]] = {item: {"old": [], "new": []} for item in work}
    ratios: dict[str, list[float]] = {item: [] for item in work}
    for r in range(args.rounds):
        before = cpu_sample()
        this: dict[str, dict[str, float]] = {}
        for item, run in work.items():
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            this[item] = {"old": float("inf"), "new": float("inf")}
            for _ in range(args.inner):  # the fastest of a few tries each: an interrupted try drops out
                for name in order:
                    start = clock()
                    result = run(builds[name])
                    seconds = result if item in timed_by_return else clock() - start
                    this[item][name] = min(this[item][name], seconds)
        after = cpu_sample()
        others = max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])
        counted = others < args.quiet
        print(f"round {r}: {'counted' if counted else 'busy'} (others {others:.2f} cores)", flush=True)
        if counted:
            for item, pair in this.items():
                for name, seconds in pair.items():
                    times[item][name].append(seconds)
                ratios[item].append(pair["new"] / pair["old"])
    width = max(map(len, work))
    print(f"\n{'':{width}}  {'old ms':>9}  {'new ms':>9}  new/old (median of {len(ratios[next(iter(work))])} rounds)")
    for item in work:
        if ratios[item]:
            print(f"{item:{width}}  {1e3 * statistics.median(times[item]['old']):9.3f}  "
                  f"{1e3 * statistics.median(times[item]['new']):9.3f}  {statistics.median(ratios[item]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
