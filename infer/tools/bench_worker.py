"""One engine, one process: the measuring side of the benchmark harness.

:mod:`infer.tools.bench` starts ``python -m infer.tools.bench_worker SPEC RESULT`` once
per engine and repeat, so every process imports, loads and measures one
engine alone: its load time is a cold start of the library on a warm page
cache, and its peak resident memory is its own. The parent writes the job as
JSON to ``SPEC``; the worker writes its figures as JSON to ``RESULT`` (not to
stdout, where libraries are free to print).

Inside, every engine runs the same protocol on the same prompt token ids:
import the framework, record the resident set size (the *import baseline*)
and reset the peak counter, load the model (timed), one warm-up generation,
then the measured generations. A generation feeds the prompt and takes
``new_tokens`` greedy tokens without stopping at end-of-sequence; the first
token marks the end of prefill (time to first token), the rest are decode.

The engines, each driven through its own public API:

* ``infer`` — :func:`infer.load` and :meth:`~infer.model.Model.generate_tokens`.
* ``llama.cpp`` — ``llama_cpp.Llama`` on a GGUF file and its token generator,
  with the context reset before each generation so nothing of the prompt is
  reused from the previous one. Its timed load is that call alone: the
  weight bytes its decode reads come from the parent (``stored_weight_bytes``).
* ``transformers`` — ``AutoModelForCausalLM.from_pretrained`` (a GGUF file is
  dequantized by transformers) and ``generate`` with a streamer that records
  when each token arrives.
* ``mlx-lm`` — ``mlx_lm.load`` on a Hugging Face folder and
  ``mlx_lm.generate.generate_step``.

``python -m infer.tools.bench_worker --convert GGUF OUT`` writes a Hugging Face
folder dequantized from a GGUF file with transformers (for mlx-lm, which
reads only that form).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# -- memory ---------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class PeakMemory:
    """Peak resident set size above a baseline taken after the imports.

    On Linux the kernel's high-water mark (``VmHWM``) is reset to the current
    size by writing 5 to ``/proc/self/clear_refs``, so an import that briefly
    used more memory does not hide the load's peak. Elsewhere the peak is
    ``ru_maxrss`` at the end minus ``ru_maxrss`` at the baseline.
    """

    def __init__(self) -> None:
        self.method = "ru_maxrss difference"
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            if _status_kib("VmHWM") is not None:
                self.method = "VmHWM reset after imports"
        except OSError:
            pass
        now = _status_kib("VmRSS")
        self.baseline = now * 1024 if now is not None and self.method.startswith("VmHWM") else _maxrss_bytes()

    def peak_above_baseline(self) -> int:
        if self.method.startswith("VmHWM"):
            peak = (_status_kib("VmHWM") or 0) * 1024
        else:
            peak = _maxrss_bytes()
        return max(0, peak - self.baseline)


# -- timing -----------------------------------------------------------------------------


def time_generation(tokens: Iterator[int], prompt_tokens: int, new_tokens: int,
                    started: float | None = None) -> dict[str, Any]:
    """Consume ``new_tokens`` tokens of a generation and time them.

    ``started`` is when the prompt was handed over (default: now, before the
    first ``next``). Prefill speed is prompt tokens over the time to the first
    token; decode speed counts the tokens after the first over the time after it.
    """
    t0 = time.perf_counter() if started is None else started
    out: list[int] = []
    t1 = t0
    for token in tokens:
        out.append(int(token))
        if len(out) == 1:
            t1 = time.perf_counter()
        if len(out) >= new_tokens:
            break
    t2 = time.perf_counter()
    close = getattr(tokens, "close", None)
    if close is not None:
        close()
    return _figures(out, prompt_tokens, t0, t1, t2)


def _figures(out: list[int], prompt_tokens: int, t0: float, t1: float, t2: float) -> dict[str, Any]:
    ttft = t1 - t0
    decode_s = t2 - t1
    return {
        "ttft_s": ttft,
        "prefill_tok_s": prompt_tokens / ttft if ttft > 0 else None,
        "decode_tok_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        "decode_s": decode_s,
        "new_tokens": len(out),
        "tokens": out,
    }


# -- engines ------------------------------------------------------------------------------
# Each returns (load, generate): load() -> info dict, generate(ids, n) -> figures.

Loaded = tuple[Callable[[], dict[str, Any]], Callable[[list[int], int], dict[str, Any]]]


def _weights_nbytes(value: Any, seen: set[Any]) -> int:
    """Bytes of a prepared weight: an array (``nbytes``) or a container of them.
    Memory is counted once: a torch tensor viewing a numpy array's memory (the
    torch/cpu backend hands its C kernels the affine weight's own arrays) adds
    nothing (``seen`` holds object ids and data addresses)."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    from infer.ops import PackedWeight

    if isinstance(value, PackedWeight):  # its host ``rows`` serve embedding lookups: one row per token
        return _weights_nbytes(value.data, seen)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        address = _data_address(value)
        if address is not None:
            if ("data", address) in seen:
                return 0
            seen.add(("data", address))
        else:  # an object that counts its own arrays (infer.quantize.AffineTensor): theirs are counted now
            for field in (getattr(value, "__dict__", None) or {}).values():
                inner = _data_address(field)
                if inner is not None:
                    seen.add(("data", inner))
        return nbytes
    if isinstance(value, (list, tuple)):
        return sum(_weights_nbytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(_weights_nbytes(v, seen) for v in value.values())
    fields = getattr(value, "__dict__", None)
    return sum(_weights_nbytes(v, seen) for v in fields.values()) if fields else 0


def _data_address(value: Any) -> int | None:
    """Where an array's data starts (numpy, or anything with ``data_ptr``), or None."""
    interface = getattr(value, "__array_interface__", None)
    if isinstance(interface, dict):
        return int(interface["data"][0])
    pointer = getattr(value, "data_ptr", None)
    return int(pointer()) if callable(pointer) else None


def _infer(spec: dict[str, Any]) -> Loaded:
    import infer
    from infer.ops import LoadSettings
    from infer.plugins.selection import select_backend

    options = spec["options"]
    model: Any = None
    prepared_bytes: dict[str, int] = {}
    # Starting the backend imports its framework (torch, mlx): part of the import
    # baseline, as importing torch is for transformers.
    backend = select_backend(options.get("backend"), options.get("dtype"))

    def load() -> dict[str, Any]:
        nonlocal model
        # Count the bytes of every weight the backend prepares (what a decode
        # step reads), keeping no reference: a weight the loader replaces
        # (stacked, repacked) must be freed as it would be without the count.
        # The count wraps the backend the load will run on: configured with
        # the load's settings first (what it keeps as stored, or quantizes,
        # depends on them), so that ``infer.load`` finds them and uses it as is.
        kwargs: dict[str, Any] = {"quantize": options.get("quantize"), "compile": True if options.get("compile") else None,
                                  "kv_dtype": options.get("kv_dtype") or None,
                                  "activations": options.get("activations") or None}
        configured = backend.configure(LoadSettings(**kwargs))
        original = configured.prepare_weight

        def recording(tensor: Any, *, name: str = "") -> Any:
            out = original(tensor, name=name)
            prepared_bytes[name] = _weights_nbytes(out, set())
            return out

        configured.prepare_weight = recording  # type: ignore[method-assign]
        model = infer.load(spec["model_path"], backend=configured, **kwargs)
        del configured.prepare_weight  # the class's method again
        # An untied input embedding is read one row per token; a tied one is the output head.
        head = getattr(model.network, "lm_head", None)
        embed = getattr(model.network, "embed_tokens", None)
        total = sum(prepared_bytes.values())
        if embed is not None and head is not None and embed is not head:
            total -= _weights_nbytes(embed, set())
        return {"backend": f"{backend.name}/{backend.device}", "dtype": backend.compute_dtype,
                "weight_bytes_per_token": total}

    def generate(ids: list[int], n: int) -> dict[str, Any]:
        started = time.perf_counter()
        gen = model.generate_tokens(ids, max_tokens=n, ignore_eos=True, temperature=0.0)
        return time_generation(iter(gen), len(ids), n, started)

    return load, generate


def _llama_cpp(spec: dict[str, Any]) -> Loaded:
    import llama_cpp

    llm: Any = None
    threads = spec["threads"]

    def load() -> dict[str, Any]:
        nonlocal llm
        n_ctx = spec["prompt_tokens"] + spec["new_tokens"] + 16
        llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=n_ctx, n_batch=max(512, spec["prompt_tokens"]),
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        # The weight bytes were counted by the parent from the file's index
        # (bench.stored_weight_bytes): reading the file here would be charged
        # to llama.cpp's load time and memory.
        return {"threads": threads, "weight_bytes_per_token": spec.get("stored_weight_bytes")}

    def generate(ids: list[int], n: int) -> dict[str, Any]:
        llm.reset()  # forget the previous prompt, so its cached prefix is not reused
        started = time.perf_counter()
        tokens = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        return time_generation(tokens, len(ids), n, started)

    return load, generate


def _tree_weight_bytes(named: dict[str, Any]) -> int:
    """Bytes of named parameters, an untied input embedding left out."""
    total = sum(int(v.nbytes) for v in named.values())
    if any(k.endswith("lm_head.weight") for k in named):
        total -= sum(int(v.nbytes) for k, v in named.items() if k.endswith("embed_tokens.weight"))
    return total


class _TimingStreamer:
    """A transformers streamer that notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _transformers(spec: dict[str, Any]) -> Loaded:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["options"].get("dtype") or "float32")
    device = spec["options"].get("device") or "cpu"
    model: Any = None

    def load() -> dict[str, Any]:
        nonlocal model
        path = Path(spec["model_path"])
        if path.suffix == ".gguf":
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                      dtype=dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        model.to(device).eval()
        if device == "cuda":
            torch.cuda.synchronize()
        # generate() fills unset fields from the model's generation config: with
        # no eos there, it runs exactly max_new_tokens without masking any logit.
        model.generation_config = transformers.GenerationConfig(do_sample=False, pad_token_id=0)
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        if embed is not None and head is not None and embed.weight is not head.weight:
            total -= embed.weight.numel() * embed.weight.element_size()
        return {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "device": device,
                "weight_bytes_per_token": total}

    def generate(ids: list[int], n: int) -> dict[str, Any]:
        streamer = _TimingStreamer()
        input_ids = torch.tensor([ids], device=device)
        with torch.inference_mode():
            started = time.perf_counter()
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                           min_new_tokens=0, do_sample=False, streamer=streamer)
            ended = time.perf_counter()
        first = streamer.times[0] if streamer.times else ended
        return _figures(streamer.tokens, len(ids), started, first, ended)

    return load, generate


def _mlx_lm(spec: dict[str, Any]) -> Loaded:
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step

    model: Any = None

    def load() -> dict[str, Any]:
        nonlocal model
        model, _tokenizer = mlx_lm.load(spec["model_path"])
        return {"device": str(mx.default_device()),
                "weight_bytes_per_token": _tree_weight_bytes(dict(tree_flatten(model.parameters())))}

    def generate(ids: list[int], n: int) -> dict[str, Any]:
        started = time.perf_counter()
        steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
        return time_generation((token for token, _ in steps), len(ids), n, started)

    return load, generate


ENGINES: dict[str, Callable[[dict[str, Any]], Loaded]] = {
    "infer": _infer,
    "llama.cpp": _llama_cpp,
    "transformers": _transformers,
    "mlx-lm": _mlx_lm,
}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine's job (see the module docstring) and return its figures."""
    t_import = time.perf_counter()
    load, generate = ENGINES[spec["kind"]](spec)
    import_s = time.perf_counter() - t_import
    memory = PeakMemory()
    t_load = time.perf_counter()
    info = load()
    load_s = time.perf_counter() - t_load
    ids = list(spec["prompt_ids"])
    if spec.get("warmup_tokens", 0) > 0:
        generate(ids, spec["warmup_tokens"])
    runs = [generate(ids, spec["new_tokens"]) for _ in range(spec.get("runs", 1))]
    gpu = _peak_gpu_bytes()
    if gpu is not None:
        info["peak_gpu_bytes"] = gpu
    return {"import_s": import_s, "load_s": load_s, "peak_rss_bytes": memory.peak_above_baseline(),
            "baseline_rss_bytes": memory.baseline, "rss_method": memory.method, "info": info, "runs": runs}


def _peak_gpu_bytes() -> int | None:
    """Peak bytes torch's CUDA allocator held in this process (None when no
    CUDA context was made: torch never imported, or no GPU used)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def convert_gguf_to_hf(gguf: Path, out: Path) -> None:
    """Write a Hugging Face folder (float32 safetensors + tokenizer) dequantized
    from ``gguf`` by transformers."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized (its weights are plain
    # float32 by now) and then refuses to save it: drop that mark first.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--convert":
        convert_gguf_to_hf(Path(argv[1]), Path(argv[2]))
        return 0
    if len(argv) != 2:
        sys.stderr.write("usage: python -m infer.tools.bench_worker SPEC.json RESULT.json | --convert GGUF OUT\n")
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run(spec)
    tmp = argv[1] + ".tmp"
    Path(tmp).write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
