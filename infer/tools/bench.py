"""The benchmark harness: infer and its peers on one model, in one run.

:func:`run_benchmark` measures, for each engine, prefill and decode tokens
per second, time to first token, load time and peak resident memory above
the process's import baseline, on the same prompt token ids:

* infer on any backend, dtype and quantization (:func:`infer_engine`);
* when installed, its peers (:func:`peer_engine`): llama-cpp-python on the
  GGUF file, transformers in float32 and bfloat16 (from the GGUF file, which
  it dequantizes, or a Hugging Face folder) and mlx-lm (on a Hugging Face
  folder, made from the GGUF file with transformers when needed). A peer
  that is not installed, or cannot read the model's form, is *skipped* with
  the reason in the report.

Method: every engine runs in its own process per repeat
(:mod:`infer.tools.bench_worker`), so load time and memory are its own; each
process loads, runs one short warm-up generation, then the measured one
(greedy, ``new_tokens`` tokens, end-of-sequence ignored). Engines take turns
within a repeat, in an order rotated from repeat to repeat, so slow drifts of
a shared machine spread over all of them. Each figure is the median over the
repeats, reported as is and as a ratio to a baseline engine measured in the
same run (by default llama.cpp). The memory read bandwidth of the machine is
measured too, before each repeat (the median counts), giving each engine
whose weight bytes are known its decode bound: bandwidth / bytes of weights
read per token (see docs/performance.md).

The library prints only when asked: with ``progress=True`` (``infer bench``
without ``-q``) one progress bar on stderr counts the engine processes and
names the repeat and engine running, as each can take minutes; logs go to
the ``infer.tools.bench`` logger.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from infer.errors import BenchmarkError, InferError
from infer.tools.bench_machine import (
    dist_version,
    gpu_info,
    machine_info,
    measure_gpu_read_bandwidth,
    measure_read_bandwidth,
)

log = logging.getLogger(__name__)

SCHEMA = "infer-bench/1"

#: Figures of one measured generation / process, and which way is better.
METRICS: dict[str, str] = {
    "prefill_tok_s": "higher",
    "decode_tok_s": "higher",
    "ttft_s": "lower",
    "load_s": "lower",
    "peak_rss_bytes": "lower",
}


@dataclass(frozen=True)
class Peer:
    """Another inference library the harness can measure."""

    kind: str
    module: str
    distribution: str
    #: The model forms it reads: "gguf" (a .gguf file), "hf" (a folder).
    reads: tuple[str, ...]


PEERS: dict[str, Peer] = {p.kind: p for p in (
    Peer("llama.cpp", "llama_cpp", "llama-cpp-python", ("gguf",)),
    Peer("transformers", "transformers", "transformers", ("gguf", "hf")),
    Peer("mlx-lm", "mlx_lm", "mlx-lm", ("hf",)),
)}


@dataclass(frozen=True)
class EngineSpec:
    """One engine to measure: ``kind`` is ``"infer"`` or a key of :data:`PEERS`."""

    kind: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)


def infer_engine(backend: str | None = None, dtype: str | None = None, quantize: str | None = None,
                 label: str | None = None, compile: bool = False, kv_dtype: str | None = None,
                 activations: str | None = None) -> EngineSpec:
    """infer itself, through ``infer.load(path, backend=, dtype=[, quantize=][, compile=True][, kv_dtype=]
    [, activations=])`` (``quantize``, ``compile``, ``kv_dtype`` and ``activations`` are passed only when
    given). A narrower ``kv_dtype`` and quantized ``activations`` are approximate and the label says so."""
    parts = ["infer", backend or "default"]
    if dtype:
        parts.append(dtype)
    if quantize:
        parts.append(f"quantize={quantize}")
    if compile:
        parts.append("compiled")
    if kv_dtype:
        parts.append(f"kv_dtype={kv_dtype} (approximate)")
    if activations:
        parts.append(f"activations={activations} (approximate)")
    return EngineSpec("infer", label or " ".join(parts),
                      {"backend": backend, "dtype": dtype, "quantize": quantize, "compile": compile,
                       "kv_dtype": kv_dtype, "activations": activations})


def peer_engine(kind: str, dtype: str | None = None, label: str | None = None,
                device: str | None = None) -> EngineSpec:
    """A peer library; ``dtype`` and ``device`` (``"cpu"`` or ``"cuda"``, the
    CPU by default) apply to transformers (float32 by default)."""
    if kind not in PEERS:
        raise BenchmarkError(f"unknown peer {kind!r}; known peers: {', '.join(PEERS)}")
    if kind == "transformers":
        dtype = dtype or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise BenchmarkError(f"transformers dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if device not in (None, "cpu", "cuda"):
            raise BenchmarkError(f"transformers device must be cpu or cuda, got {device!r}")
    elif dtype is not None or device is not None:
        raise BenchmarkError(f"peer {kind!r} takes no dtype or device (got {dtype or device!r})")
    where = f" on {device}" if device and device != "cpu" else ""
    options = {"dtype": dtype, **({"device": device} if device and device != "cpu" else {})}
    return EngineSpec(kind, label or ((f"{kind} {dtype}" if dtype else kind) + where), options)


def default_peers() -> list[EngineSpec]:
    """llama.cpp, transformers float32 and bfloat16, mlx-lm."""
    return [peer_engine("llama.cpp"), peer_engine("transformers", "float32"),
            peer_engine("transformers", "bfloat16"), peer_engine("mlx-lm")]


def parse_peers(text: str) -> list[EngineSpec]:
    """``"all"``, ``"none"`` or a comma-separated list of peers, each
    ``kind`` or ``kind:dtype``, with ``@cuda`` to run it on the GPU
    (``transformers`` alone means float32 and bfloat16)."""
    text = text.strip()
    if text == "all":
        return default_peers()
    if text in ("", "none"):
        return []
    out: list[EngineSpec] = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        item, _, device = item.partition("@")
        kind, _, dtype = item.partition(":")
        if kind == "transformers" and not dtype:
            out += [peer_engine(kind, "float32", device=device or None),
                    peer_engine(kind, "bfloat16", device=device or None)]
        else:
            out.append(peer_engine(kind, dtype or None, device=device or None))
    return out


@dataclass
class BenchConfig:
    """How to measure (defaults: the issue's method)."""

    repeats: int = 3
    prompt_tokens: int = 128
    new_tokens: int = 128
    warmup_tokens: int = 16
    #: CPU threads for every engine (default: all logical cores).
    threads: int | None = None
    #: Label or kind of the engine ratios are taken against (None: no ratios).
    baseline: str | None = "llama.cpp"
    #: Measure the memory read bandwidth and each engine's decode bound.
    bandwidth: bool = True
    #: Seconds one engine process may take.
    timeout_s: float = 1800.0

    def check(self) -> None:
        for name in ("repeats", "prompt_tokens", "new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BenchmarkError(f"{name} must be a positive integer, got {value!r}")
        if self.new_tokens < 2:
            raise BenchmarkError(f"new_tokens must be at least 2 to time decoding, got {self.new_tokens}")
        if not isinstance(self.warmup_tokens, int) or self.warmup_tokens < 0:
            raise BenchmarkError(f"warmup_tokens must be a non-negative integer, got {self.warmup_tokens!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise BenchmarkError(f"threads must be a positive integer, got {self.threads!r}")


# -- statistics ---------------------------------------------------------------------------


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Median of each metric over the runs that have it."""
    return {m: median([r.get(m) for r in runs]) for m in METRICS}


def ratios(summary: dict[str, float | None], baseline: dict[str, float | None]) -> dict[str, float | None]:
    """``summary[m] / baseline[m]`` per metric (None where either is missing or zero)."""
    out: dict[str, float | None] = {}
    for m in METRICS:
        a, b = summary.get(m), baseline.get(m)
        out[m] = a / b if a is not None and b else None
    return out


# -- versions -----------------------------------------------------------------------------


def _peer_version(peer: Peer) -> str | None:
    """The installed distribution's version, else the module's ``__version__``
    (a development install may have no distribution metadata)."""
    found = dist_version(peer.distribution)
    if found is None and importlib.util.find_spec(peer.module) is not None:
        try:
            found = getattr(importlib.import_module(peer.module), "__version__", None)
        except Exception:  # a broken install is reported when the engine runs
            found = None
    return found


# -- running ------------------------------------------------------------------------------

#: Text the benchmark prompt is cut from (repeated when a model's tokenizer needs more).
PROMPT_TEXT = (
    "The harbour town woke slowly that autumn morning. Fishing boats rocked against the stone quay "
    "while gulls argued over the remains of yesterday's catch, and the baker on the corner pulled the "
    "first loaves from an oven that had been burning since four. Down by the lighthouse, an old "
    "keeper wrote the weather into a ledger he had kept for thirty years: wind from the south-west, "
    "a long swell, visibility good but failing toward noon. Children ran past him on their way to "
    "school, counting the ships at anchor and arguing about which of them had come the farthest. "
    "Nobody in the town expected anything unusual from the day, which is exactly why the arrival of "
    "the tall grey ship, flying no flag at all, was talked about for the rest of the year. "
)


def prompt_ids(model_path: Path, count: int) -> list[int]:
    """``count`` token ids of :data:`PROMPT_TEXT` in the model's own
    tokenizer (with its BOS token), the same ids for every engine."""
    from infer.plugins import get_registry

    package = get_registry().format_for(model_path).open(model_path)
    try:
        if package.tokenizer is None:
            raise BenchmarkError(f"{model_path} has no tokenizer to build the benchmark prompt with")
        text = PROMPT_TEXT
        ids = package.tokenizer.encode(text)
        while len(ids) < count:
            text += PROMPT_TEXT
            ids = package.tokenizer.encode(text)
        return [int(i) for i in ids[:count]]
    finally:
        package.tensors.close()


def stored_weight_bytes(model_path: Path) -> int:
    """Bytes of the tensors a decode step reads, as stored in the model file
    (quantized blocks as they are; the token embedding left out when a
    separate output head exists, since decoding reads one row of it). Counted
    here, in the parent, from the file's index: no engine is charged for it."""
    from infer.plugins import get_registry

    package = get_registry().format_for(model_path).open(model_path)
    try:
        sizes = {name: package.tensors.stored_nbytes(name) for name in package.tensors.names()}
    finally:
        package.tensors.close()
    total = sum(sizes.values())
    if "lm_head.weight" in sizes:
        total -= sizes.get("model.embed_tokens.weight", 0)
    return total


def _model_form(path: Path) -> str:
    return "gguf" if path.is_file() and path.suffix == ".gguf" else "hf"


def _check_infer(spec: EngineSpec) -> str | None:
    """None when the engine can run here, else why not; raises on bad options."""
    from infer.plugins.selection import list_backends, select_backend

    backend, dtype = spec.options.get("backend"), spec.options.get("dtype")
    import inspect

    import infer
    from infer.ops import LoadSettings

    for option in ("quantize", "compile", "kv_dtype", "activations"):
        if spec.options.get(option) and option not in inspect.signature(infer.load).parameters:
            raise BenchmarkError(f"this infer's load() has no {option} option (asked for "
                                 f"{option}={spec.options[option]!r} for {spec.label!r})")
    try:  # the values first, before any backend is probed
        settings = LoadSettings(quantize=spec.options.get("quantize"), activations=spec.options.get("activations"),
                                kv_dtype=spec.options.get("kv_dtype"))
    except InferError as exc:
        raise BenchmarkError(f"{spec.label}: {exc}") from exc
    if backend is not None:
        name, _, device = backend.partition(":")
        known = list_backends()
        if not any(b.name == name and (not device or b.device == device) for b in known):
            raise BenchmarkError(f"unknown backend {backend!r} for {spec.label!r}; registered: "
                                 f"{', '.join(b.key for b in known)}")
    try:
        chosen = select_backend(backend, dtype)  # bad dtypes raise here, before any process starts
    except InferError as exc:
        from infer.errors import BackendUnavailableError

        if isinstance(exc, BackendUnavailableError):
            return str(exc)
        raise BenchmarkError(f"{spec.label}: {exc}") from exc
    try:  # then what the chosen backend can do
        settings.check(chosen)
    except InferError as exc:
        raise BenchmarkError(f"{spec.label}: {exc}") from exc
    return None


def unavailable_reason(spec: EngineSpec, model_path: Path, hf_folder: Path | None = None) -> str | None:
    """Why ``spec`` cannot be measured on this model here, or None."""
    if spec.kind == "infer":
        return _check_infer(spec)
    peer = PEERS[spec.kind]
    if importlib.util.find_spec(peer.module) is None:
        return f"{peer.distribution} is not installed (pip install {peer.distribution})"
    if spec.kind == "transformers" and importlib.util.find_spec("torch") is None:
        return "transformers needs torch, which is not installed"
    form = _model_form(model_path)
    if form not in peer.reads and not (spec.kind == "mlx-lm" and (hf_folder or form == "gguf")):
        return f"{spec.kind} reads only {' or '.join(peer.reads)} models; {model_path} is a {form} model"
    return None


def _hf_folder_for(gguf: Path, timeout_s: float) -> Path:
    """A Hugging Face folder dequantized from ``gguf`` (made once, cached)."""
    from infer.paths import cache_dir

    stat = gguf.stat()
    folder = cache_dir() / "bench" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-hf"
    if (folder / "config.json").is_file():
        return folder
    if importlib.util.find_spec("transformers") is None:
        raise BenchmarkError(f"mlx-lm needs a Hugging Face folder; making one from {gguf.name} needs transformers")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    log.info("writing a Hugging Face folder for %s to %s (once)", gguf.name, folder)
    done = subprocess.run([sys.executable, "-m", "infer.tools.bench_worker", "--convert", str(gguf), str(tmp)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise BenchmarkError(f"converting {gguf} to a Hugging Face folder failed: {_tail(done.stderr)}")
    os.replace(tmp, folder)
    return folder


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(no output)"


def _run_process(spec: EngineSpec, job: dict[str, Any], threads: int, timeout_s: float) -> dict[str, Any]:
    """One engine process; its result, or ``{"error": ...}``."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory(prefix="infer-bench-") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(job), encoding="utf-8")
        try:
            done = subprocess.run([sys.executable, "-m", "infer.tools.bench_worker", str(spec_path), str(result_path)],
                                  capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        if done.stderr.strip():
            log.debug("%s stderr:\n%s", spec.label, done.stderr.strip())
        if done.returncode != 0 or not result_path.is_file():
            return {"error": f"exit {done.returncode}: {_tail(done.stderr)}"}
        return json.loads(result_path.read_text(encoding="utf-8"))


def run_benchmark(model: str | os.PathLike[str], engines: Sequence[EngineSpec], config: BenchConfig | None = None,
                  *, hf_folder: str | os.PathLike[str] | None = None, progress: bool = False) -> dict[str, Any]:
    """Measure ``engines`` on ``model`` (a path or catalog alias); returns the
    report (a JSON-ready dict, see docs/performance.md for its fields).
    ``progress``: progress bars on stderr (a catalog model's download, then
    one step per engine process, named by repeat and engine)."""
    from infer.loading import resolve

    config = config or BenchConfig()
    config.check()
    labels = [e.label for e in engines]
    if not engines:
        raise BenchmarkError("no engines to measure")
    if len(set(labels)) != len(labels):
        raise BenchmarkError(f"engine labels must be distinct, got {labels}")
    path = resolve(model, progress=progress)
    hf = Path(hf_folder) if hf_folder is not None else None
    if hf is not None and not (hf / "config.json").is_file():
        raise BenchmarkError(f"--hf folder {hf} has no config.json")
    threads = config.threads or os.cpu_count() or 1
    ids = prompt_ids(path, config.prompt_tokens)
    file_weight_bytes = stored_weight_bytes(path)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": {"reference": str(model), "path": str(path), "form": _model_form(path),
                  "bytes": path.stat().st_size if path.is_file() else
                  sum(p.stat().st_size for p in path.rglob("*") if p.is_file())},
        "settings": {"repeats": config.repeats, "prompt_tokens": len(ids), "new_tokens": config.new_tokens,
                     "warmup_tokens": config.warmup_tokens, "threads": threads, "baseline": config.baseline,
                     "sampling": "greedy, end-of-sequence ignored"},
        "engines": [],
    }

    rows: list[dict[str, Any]] = []
    runnable: list[tuple[EngineSpec, dict[str, Any]]] = []
    for spec in engines:
        row: dict[str, Any] = {"label": spec.label, "kind": spec.kind, "options": dict(spec.options),
                               "version": dist_version("infer-engine") if spec.kind == "infer"
                               else _peer_version(PEERS[spec.kind]),
                               "status": "ok", "reason": None, "processes": []}
        rows.append(row)
        reason = unavailable_reason(spec, path, hf)
        target = path
        if reason is None and spec.kind == "mlx-lm" and _model_form(path) == "gguf":
            try:
                target = hf or _hf_folder_for(path, config.timeout_s)
            except (BenchmarkError, OSError, subprocess.SubprocessError) as exc:
                reason = str(exc)
        if reason is not None:
            row.update(status="skipped", reason=reason)
            log.info("skipping %s: %s", spec.label, reason)
            continue
        row["model_path"] = str(target)
        job = {"kind": spec.kind, "options": dict(spec.options), "model_path": str(target), "prompt_ids": ids,
               "prompt_tokens": len(ids), "new_tokens": config.new_tokens,
               "warmup_tokens": config.warmup_tokens, "threads": threads, "runs": 1,
               "stored_weight_bytes": file_weight_bytes}
        runnable.append((spec, job))

    by_label = {r["label"]: r for r in rows}
    on_gpu = any(_on_gpu(spec) for spec, _ in runnable)
    if on_gpu:
        report["machine"]["gpu"] = _in_process(gpu_info)
    bandwidths: list[float] = []
    gpu_bandwidths: list[float] = []
    with tqdm(total=config.repeats * len(runnable), desc="infer bench", unit="run", file=sys.stderr,
              disable=not progress or not runnable) as bar:
        for repeat in range(config.repeats):
            step = f"repeat {repeat + 1}/{config.repeats}"
            if config.bandwidth:  # once per repeat, between the engines, like them a median
                bar.set_description(f"{step}: memory bandwidth")
                bandwidths.append(measure_read_bandwidth(threads=threads))
                log.info("memory read bandwidth: %.1f GB/s", bandwidths[-1] / 1e9)
                if on_gpu:
                    gpu_bandwidths.append(_in_process(measure_gpu_read_bandwidth))
                    log.info("GPU memory read bandwidth: %.1f GB/s", gpu_bandwidths[-1] / 1e9)
            shift = repeat % len(runnable) if runnable else 0
            for spec, job in runnable[shift:] + runnable[:shift]:
                bar.set_description(f"{step}: {spec.label}")  # named before it runs: one can take minutes
                log.info("%s: %s", step, spec.label)
                result = _run_process(spec, job, threads, config.timeout_s)
                if "error" in result:
                    log.warning("%s failed: %s", spec.label, result["error"])
                by_label[spec.label]["processes"].append(result)
                bar.update()

    if bandwidths:
        report["machine"]["read_bandwidth_bytes_s"] = median(bandwidths)
        report["machine"]["read_bandwidth_samples"] = bandwidths
    ran_on_gpu = [r for r in rows if any(_ran_on_gpu(p) for p in r["processes"])]
    if ran_on_gpu and config.bandwidth and not gpu_bandwidths:  # the default backend picked the GPU
        report["machine"]["gpu"] = _in_process(gpu_info)
        gpu_bandwidths = [_in_process(measure_gpu_read_bandwidth) for _ in range(config.repeats)]
    if gpu_bandwidths:
        report["machine"]["gpu_read_bandwidth_bytes_s"] = median(gpu_bandwidths)
        report["machine"]["gpu_read_bandwidth_samples"] = gpu_bandwidths
    for row in rows:
        if row["status"] == "ok":
            bandwidth = "gpu_read_bandwidth_bytes_s" if row in ran_on_gpu else "read_bandwidth_bytes_s"
            _summarize_row(row, report["machine"].get(bandwidth))
    _add_ratios(rows, config.baseline, report)
    report["engines"] = rows
    return report


def _on_gpu(spec: EngineSpec) -> bool:
    """Whether the engine computes on a CUDA GPU (its bound is the GPU's bandwidth)."""
    backend = spec.options.get("backend") or ""
    return spec.options.get("device") == "cuda" or backend.split(":")[0] == "torch" and backend.endswith(":cuda")


def _ran_on_gpu(process: dict[str, Any]) -> bool:
    info = process.get("info") or {}
    return info.get("backend") == "torch/cuda" or str(info.get("device", "")).startswith("cuda")


def _in_process(fn: Any) -> Any:
    """Run a GPU measurement in a child process, so that this one never holds
    a CUDA context (or the memory it keeps) while the engines run."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn).result()


def _summarize_row(row: dict[str, Any], bandwidth: float | None) -> None:
    good = [p for p in row["processes"] if "error" not in p]
    if not good:
        row.update(status="failed", reason=row["processes"][0]["error"] if row["processes"] else "never ran")
        return
    runs = [dict(run, load_s=p["load_s"], peak_rss_bytes=p["peak_rss_bytes"]) for p in good for run in p["runs"]]
    row["median"] = summarize(runs)
    row["info"] = good[0].get("info", {})
    row["rss_method"] = good[0].get("rss_method")
    row["tokens"] = good[0]["runs"][0]["tokens"] if good[0]["runs"] else []
    for p in good:  # the token lists are kept once, above
        for run in p["runs"]:
            run.pop("tokens", None)
    weight_bytes = row["info"].get("weight_bytes_per_token")
    decode = row["median"]["decode_tok_s"]
    if bandwidth and weight_bytes:
        bound = bandwidth / weight_bytes
        row["decode_bound_tok_s"] = bound
        row["bound_fraction"] = decode / bound if decode else None


def _add_ratios(rows: list[dict[str, Any]], baseline: str | None, report: dict[str, Any]) -> None:
    report["baseline"] = None
    if baseline is None:
        return
    chosen = next((r for r in rows if r["label"] == baseline), None) or \
        next((r for r in rows if r["kind"] == baseline), None)
    if chosen is None or chosen["status"] != "ok":
        why = "not among the engines" if chosen is None else f"{chosen['status']}: {chosen['reason']}"
        report["baseline_note"] = f"no ratios: baseline {baseline!r} {why}"
        return
    report["baseline"] = chosen["label"]
    for row in rows:
        if row["status"] == "ok":
            row["ratios"] = ratios(row["median"], chosen["median"])
            ref = chosen.get("tokens") or []
            same = next((i for i, (a, b) in enumerate(zip(row.get("tokens", []), ref)) if a != b),
                        min(len(row.get("tokens", [])), len(ref)))
            row["tokens_agreeing_with_baseline"] = same


def write_json(report: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as indented JSON (creating the folder)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return out
