"""The ``infer`` command line.

    infer run MODEL PROMPT [sampling flags] [--backend NAME] [--image FILE] [--mmproj FILE]
    infer chat MODEL [--system TEXT] [sampling flags]
    infer perplexity MODEL FILE [--context N] [--stride S] [--kv-dtype float16] [--activations q8 --kl-against exact]
    infer embed MODEL FILE [--dimensions N] [--prompt-name NAME] [--no-normalize]
    infer backends
    infer doctor
    infer diff MODEL --backends [A,]B [--prompt TEXT] [--activations q8]
    infer bench MODEL [--backend NAME ...] [--peers all|none|LIST] [--repeats N] [-o FILE]
    infer serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--kv-memory 2GiB] [--tool-parser NAME]
    infer convert SRC OUT [--type TYPE] [--force] [--mmproj FILE]

Generated text goes to stdout as it is produced; progress bars, logs and
errors go to stderr. An :class:`~infer.errors.InferError` ends the command
with its message and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import Any

from infer.errors import ChatTemplateError, GenerationError, InferError

log = logging.getLogger(__name__)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="catalog alias (smollm2-135m, gemma3-270m), model folder, .gguf file, or org/name")
    p.add_argument("--backend", default=None, help="backend name, e.g. numpy or torch:cuda (default: best available)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    p.add_argument("--quantize", default=None,
                   help="q8 or q4: quantize float weights on load; off: dequantize everything (see docs/quantization.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the decode step and each layer's pieces as compiled graphs (torch, MLX); "
                        "--no-compile: all eager (default: the backend's choice, numpy captures its decode step)")
    _add_kv_dtype(p)
    _add_activations(p)
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="run the model over N ranks (torch:cpu or torch:cuda; see docs/distributed.md)")
    _add_lora(p)
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="with a .gguf text model: llama.cpp's vision projector file for it (mmproj-*.gguf); with "
                        "--image, one beside the model is found (docs/vision.md, \"GGUF pairs\")")
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=None, help="most new tokens")
    g.add_argument("-t", "--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    # llama.cpp's samplers (docs/sampling.md); unset: off, and the order is infer's.
    g.add_argument("--penalty-last-n", type=int, default=None,
                   help="the penalties' window in tokens (-1: all, the default; 0: off; llama.cpp's --repeat-last-n)")
    g.add_argument("--dry-multiplier", type=float, default=None, help="DRY's strength (0 = off)")
    g.add_argument("--dry-base", type=float, default=None, help="DRY's growth per repeated token (default 1.75)")
    g.add_argument("--dry-allowed-length", type=int, default=None, help="repeats this long go unpenalised (2)")
    g.add_argument("--dry-penalty-last-n", type=int, default=None, help="DRY's window (-1: all; 0: off)")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, dest="dry_sequence_breakers",
                   help="a string that ends DRY's repeats (repeatable; default \\n : \" *)")
    g.add_argument("--xtc-probability", type=float, default=None, help="XTC's chance per token (0 = off)")
    g.add_argument("--xtc-threshold", type=float, default=None, help="XTC's threshold (0.1)")
    g.add_argument("--top-n-sigma", type=float, default=None, help="top-nσ (<= 0 = off)")
    g.add_argument("--typical-p", type=float, default=None, help="locally typical sampling (1 = off)")
    g.add_argument("--mirostat", type=int, default=None, choices=(0, 1, 2), help="mirostat version (0 = off)")
    g.add_argument("--mirostat-tau", type=float, default=None, help="mirostat's target surprise (5.0)")
    g.add_argument("--mirostat-eta", type=float, default=None, help="mirostat's learning rate (0.1)")
    g.add_argument("--samplers", default=None, metavar="NAMES",
                   help="the sampler chain's order, llama.cpp's names separated by ';' or ',' "
                        "(e.g. 'penalties;dry;top_k;typ_p;top_p;min_p;xtc;temperature')")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--speculative", default=None, choices=("ngram", "mtp"),
                   help="speculative decoding with n-gram prompt lookup or the model's MTP modules")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="draft tokens per step")


def _add_kv_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                   help="store keys and values as float16 (or bfloat16 on torch, MLX): half the cache's bytes, "
                        "slightly approximate; q8_0 (numpy): llama.cpp's 8-bit blocks "
                        "(default: the compute dtype; see docs/kv-cache.md)")


#: ``infer.ops.ACTIVATION_SCHEMES``, spelt out: the command line imports no model code until a command runs.
_ACTIVATION_SCHEMES = ("q8",)


def _add_activations(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", default=None, choices=_ACTIVATION_SCHEMES,
                   help="q8: int8 activations in the quantized products (faster prefill, approximate)")


#: The sampling flags passed on only when given (their defaults are GenerationRequest's).
_LLAMA_CPP_SAMPLING = ("penalty_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                       "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "top_n_sigma", "typical_p",
                       "mirostat", "mirostat_tau", "mirostat_eta")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                   speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    options.update({name: getattr(args, name) for name in _LLAMA_CPP_SAMPLING if getattr(args, name) is not None})
    if args.samplers is not None:
        options["samplers"] = [name for name in args.samplers.replace(",", ";").split(";") if name]
    return options


def _add_lora(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="a LoRA adapter (PEFT folder or GGUF adapter) and its scale (default 1.0); run and chat "
                   "generate with it; serve serves each one as a model named after its file or folder "
                   "(docs/adapters.md)")


def lora_option(value: str) -> tuple[str, str, float]:
    """``PATH[:SCALE]`` -> (name, path, scale); the name is the folder's or
    file's name without its suffix. A colon not followed by a number is part of the path."""
    path, sep, scale = value.rpartition(":")
    if sep and path:
        try:
            return Path(path).stem, path, float(scale)
        except ValueError:
            pass
    return Path(value).stem, value, 1.0


def _loras(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    return [lora_option(v) for v in getattr(args, "lora", None) or []]


def _load(args: argparse.Namespace) -> Any:
    """``infer.load`` with the command's flags; :func:`main` closes the model
    when the command ends (a tensor-parallel model's workers then exit)."""
    import infer

    model = infer.load(args.model, backend=args.backend, dtype=args.dtype, progress=not args.quiet,
                      quantize=args.quantize, compile=args.compile, kv_dtype=getattr(args, "kv_dtype", None),
                      activations=getattr(args, "activations", None),
                      tensor_parallel=getattr(args, "tensor_parallel", None), mmproj=_mmproj(args))
    _LOADED.append(model)
    for name, path, _ in _loras(args):
        model.load_adapter(name, path)
    return model


def _mmproj(args: argparse.Namespace) -> str | None:
    """``--mmproj``, else for a run with ``--image`` on a local .gguf file the
    mmproj file beside it (llama.cpp's naming, :func:`infer.loading.find_mmproj`)."""
    if getattr(args, "mmproj", None):
        return str(args.mmproj)
    if getattr(args, "image", None) and str(args.model).lower().endswith(".gguf") and os.path.isfile(args.model):
        from infer.loading import find_mmproj

        found = find_mmproj(args.model)
        if found is not None:
            log.info("using the vision projector %s beside %s", found, args.model)
            return str(found)
    return None


def _adapter_options(args: argparse.Namespace) -> dict[str, Any]:
    """run's and chat's: the one ``--lora`` they generate with."""
    loras = _loras(args)
    if len(loras) > 1:
        raise GenerationError("run and chat take one --lora (a sequence runs one adapter); serve takes several")
    return {} if not loras else {"adapter": loras[0][0], "adapter_scale": loras[0][2]}


_LOADED: list[Any] = []


def _write_stream(chunks: Iterator[str]) -> str:
    text = []
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
        text.append(chunk)
    return "".join(text)


def cmd_run(args: argparse.Namespace) -> int:
    model = _load(args)
    images = {"images": args.image} if args.image else {}
    _write_stream(model.generate(args.prompt, stream=True, **images, **_sampling(args), **_adapter_options(args)))
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    template = None
    if args.template:
        try:
            with open(args.template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read the chat template file {args.template!r}: {exc}") from exc
    model = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    # Render once up front so a model without a template fails before the prompt.
    if template is None and model.tokenizer.chat_template is None:
        raise ChatTemplateError(
            f"{args.model} has no chat template (it may be a base model): use `infer run` for plain "
            "completion, or pass a Jinja chat template file with --template FILE"
        )
    model.tokenizer.apply_chat_template(messages + [{"role": "user", "content": "hi"}], template=template)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write(">>> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        reply = _write_stream(model.chat(messages, template=template, stream=True, **_sampling(args),
                                            **_adapter_options(args)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InferError(f"cannot read the text file {args.file!r}: {exc}") from exc
    model = _load(args)
    if args.kl_against is None:
        score = model.score(text, context=args.context, stride=args.stride, progress=not args.quiet)
        print(_perplexity_line(score))
        return 0
    return _perplexity_against_exact(args, model, text)


def _perplexity_line(score: Any, label: str = "") -> str:
    mean = score.logprob / max(len(score.logprobs), 1)
    return (f"{label}perplexity {score.perplexity:.4f} over {len(score.logprobs)} tokens "
            f"(mean log-probability {mean:.4f} nats)")


def _perplexity_against_exact(args: argparse.Namespace, model: Any, text: str) -> int:
    """``--kl-against exact``: the same model loaded again with exact
    activations is P, the one the flags load is Q; both are scored in the same
    windows and KL(P ‖ Q) is averaged over the tokens."""
    from infer.engine.scoring import kl_divergence

    if args.activations is None:
        raise InferError("--kl-against exact compares an approximate load with the exact one: "
                         "give the approximate mode too, e.g. --activations q8")
    exact = _load(argparse.Namespace(**{**vars(args), "activations": None}))
    result = kl_divergence(exact, model, text, window=512 if args.context is None else args.context,
                           stride=args.stride, progress=not args.quiet)
    mode = f"activations={args.activations}"
    print(_perplexity_line(result.p, "exact: "))
    print(_perplexity_line(result.q, f"{mode}: "))
    print(f"KL(exact || {mode}): mean {result.mean:.6f} nats over {len(result.kl)} tokens, "
          f"same top token {100 * result.top_agreement:.2f}%")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """One JSON array per line of FILE (``-``: stdin), in order: the line's embedding."""
    import json

    try:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InferError(f"cannot read the text file {args.file!r}: {exc}") from exc
    if not lines:
        raise InferError(f"{args.file!r} has no lines to embed")
    model = _load(args)
    vectors = model.embed(lines, normalize=args.normalize, dimensions=args.dimensions, pooling=args.pooling,
                          prompt_name=args.prompt_name)
    for row in vectors:
        sys.stdout.write(json.dumps([round(float(x), 7) for x in row]) + "\n")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    import infer
    from infer.plugins import get_registry

    rows = [("backend", "available", "native optional ops", "notes")]
    for b in infer.list_backends():
        rows.append((b.key, "yes" if b.available else "no", ", ".join(b.native_ops) or "-",
                     (b.description if b.available else b.reason) or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    failures = get_registry().failures
    if failures:
        print("\nplugins that failed to load:")
        for f in failures:
            print(f"  {f.name} ({f.value}): {f.reason}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import importlib.metadata
    import os
    import platform

    import infer
    from infer.plugins.selection import BACKEND_ENV, select_backend

    print(f"infer {infer.__version__} (op contract {'.'.join(map(str, infer.API_VERSION))}), "
          f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    for dist in ("numpy", "tokenizers", "torch", "mlx", "transformers"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {dist:<12} {version}")
    from infer.plugins import get_registry

    for spec in get_registry().backends.values():
        if spec.details is not None:
            try:
                print(f"  {spec.details()}")
            except Exception as exc:  # the contract says details() never raises; still, never fatal
                print(f"  {spec.key}: details raised {type(exc).__name__}: {exc}")
    print()
    cmd_backends(args)
    print()
    why = f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r}" if os.environ.get(BACKEND_ENV) else "highest score"
    try:
        chosen = select_backend()
        print(f"infer.load() would run on {chosen.name}/{chosen.device} ({chosen.compute_dtype}; {why})")
        path = ("paged KV pool, native attention through block tables" if chosen.supports("attention")
                else "contiguous caches (no native attention; a paged pool would be gathered)")
        print(f"batched KV cache on {chosen.name}/{chosen.device}: {path}")
        served = ("greedy decoding of one sequence on a contiguous cache; and every forward of a paged pool, "
                  "decode rows and prompt chunks mixed, one graph per shape bucket")
        if not chosen.supports("compile"):
            step = "eager: this backend has no graph capture"
        elif chosen.capture_by_default:
            step = f"captured as programs by default ({served}; infer.load(..., compile=False) runs them eagerly)"
        else:
            step = f"captured as graphs with infer.load(..., compile=True) ({served})"
        print(f"steps on {chosen.name}/{chosen.device}: {step}")
    except InferError as exc:
        print(f"infer.load() has no backend to run on: {exc}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from infer.tools.diff import diff

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    from infer.loading import resolve
    from infer.plugins import get_registry

    path = resolve(args.model, progress=not args.quiet)
    package = get_registry().format_for(path).open(path)  # only the tokenizer is needed here
    if package.tokenizer is None:
        raise InferError(f"{args.model} has no tokenizer to encode --prompt with")
    ids = package.tokenizer.encode(args.prompt)
    package.tensors.close()
    report = diff(args.model, backends, ids, steps=args.steps, tolerance=args.tolerance, dtype=args.dtype,
                  activations=args.activations)
    print(report.format())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from infer.tools import bench, bench_report

    backends = [b.strip() for item in args.backend or [] for b in item.split(",") if b.strip()] or [None]
    engines = [bench.infer_engine(b, args.dtype, args.quantize, compile=args.compile, kv_dtype=args.kv_dtype,
                                  activations=args.activations)
               for b in backends]
    engines += bench.parse_peers(args.peers)
    config = bench.BenchConfig(repeats=args.repeats, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                               warmup_tokens=args.warmup_tokens, threads=args.threads,
                               baseline=None if args.baseline == "none" else args.baseline,
                               bandwidth=not args.no_bandwidth, timeout_s=args.timeout)
    report = bench.run_benchmark(args.model, engines, config, hf_folder=args.hf, progress=not args.quiet)
    out = bench.write_json(report, args.output)
    print(f"Measured {bench_report.machine_line(report)}\n")
    print(bench_report.markdown_table([report]))
    if report.get("baseline_note"):
        print(f"\n{report['baseline_note']}")
    print(f"\nreport: {out}", file=sys.stderr)
    if not args.no_plot:
        image = bench_report.plot([report], args.plot or out.with_suffix(".png"))
        if image is not None:
            print(f"plot: {image}", file=sys.stderr)
    failed = [e for e in report["engines"] if e["status"] == "failed"]
    for e in failed:
        print(f"infer: error: {e['label']} failed: {e['reason']}", file=sys.stderr)
    if not any(e["status"] == "ok" for e in report["engines"]):
        print("infer: error: no engine could be measured", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _bytes(text: str) -> int:
    """``536870912``, ``512MiB``, ``2GiB``, ``500MB``: a number of bytes."""
    units = {"": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30}
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512MiB, 2GiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value)


def cmd_serve(args: argparse.Namespace) -> int:
    from infer.serve import serve

    api_key = args.api_key or os.environ.get("INFER_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model "
                    "(set --api-key or INFER_API_KEY)", args.host)
    model = _load(args)
    model.configure_batching(kv_memory=args.kv_memory, max_batch_tokens=args.max_batch_tokens,
                             prompt_cache_dir=args.prompt_cache_dir, prompt_cache_bytes=args.prompt_cache_bytes,
                             encoder_memory=args.encoder_memory)
    serve(model, host=args.host, port=args.port, model_name=args.model_name, api_key=api_key,
          enable_adapter_updates=args.enable_lora_updates, adapter_scales={n: s for n, _, s in _loras(args)},
          max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, reasoning_parser=args.reasoning_parser,
          tool_parser=args.tool_parser, body_timeout=args.body_timeout, slot_save_path=args.slot_save_path,
          allowed_media_domains=args.allowed_media_domains, log_level="warning" if args.quiet else "info")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from infer.convert import convert

    out = convert(args.src, args.out, type=args.type, force=args.force, progress=not args.quiet, base=args.base,
                  mmproj=args.mmproj)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="Run language models on pluggable backends.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate a continuation of PROMPT (streamed)")
    _add_model_args(run)
    run.add_argument("prompt", help="the text to continue")
    run.add_argument("--image", action="append", default=[], metavar="FILE",
                     help="an image the prompt shows (repeat for several; a model that reads images: docs/vision.md)")
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="chat interactively through the model's chat template")
    _add_model_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--template", default=None, help="file with a Jinja chat template to use instead")
    chat.set_defaults(func=cmd_chat)
    ppl = sub.add_parser("perplexity", help="perplexity of a text file, in sliding windows")
    ppl.add_argument("model", help="catalog alias, model folder, .gguf file, or org/name")
    ppl.add_argument("file", help="UTF-8 text file to score")
    ppl.add_argument("--context", type=int, default=None, help="window in tokens (default: the model's context)")
    ppl.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: half a window)")
    ppl.add_argument("--backend", default=None, help="backend name, e.g. numpy or torch:cuda")
    ppl.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    ppl.add_argument("--quantize", default=None, help="q8 or q4: quantize float weights on load; off: dequantize")
    ppl.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="capture each layer's pieces as compiled graphs (--no-compile: all eager)")
    _add_kv_dtype(ppl)
    _add_activations(ppl)
    ppl.add_argument("--kl-against", default=None, choices=("exact",),
                     help="also load the model exact and report its perplexity and the mean KL(exact || this load) "
                          "per token (--context defaults to 512 here; see docs/quantization.md)")
    ppl.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                     help="run the model over N ranks (torch:cpu or torch:cuda; see docs/distributed.md)")
    ppl.set_defaults(func=cmd_perplexity)
    emb = sub.add_parser("embed", help="embed each line of a text file: one JSON vector per line")
    emb.add_argument("model", help="catalog alias, model folder, .gguf file, or org/name")
    emb.add_argument("file", help="UTF-8 text file, one text per line (- for stdin)")
    emb.add_argument("--dimensions", type=int, default=None, help="keep the first N values (Matryoshka models)")
    emb.add_argument("--pooling", default=None, help="cls, mean, max, lasttoken, ... (default: the model's)")
    emb.add_argument("--prompt-name", default=None, help="a prompt of the model's config_sentence_transformers.json")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                     help="unit-length vectors (default; --no-normalize keeps the model's own)")
    emb.add_argument("--backend", default=None, help="backend name, e.g. numpy or torch:cuda")
    emb.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    emb.add_argument("--quantize", default=None, help="q8 or q4: quantize float weights on load; off: dequantize")
    emb.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS)
    emb.set_defaults(func=cmd_embed)
    backends = sub.add_parser("backends", help="list backends, whether each is usable here, and why not")
    backends.set_defaults(func=cmd_backends)
    doctor = sub.add_parser("doctor", help="versions, backends, and which backend infer.load would pick and why")
    doctor.set_defaults(func=cmd_doctor)
    d = sub.add_parser("diff", help="run one prompt on two backends and report where they diverge")
    d.add_argument("model", help="catalog alias, model folder, .gguf file, or org/name")
    d.add_argument("--backends", required=True, help="a backend to compare with the reference backend, or two, "
                   "comma-separated; 'transformers' for transformers float32, e.g. torch:cpu, numpy,torch:cpu or "
                   "numpy,transformers")
    d.add_argument("--prompt", default="The capital of France is", help="the prompt")
    d.add_argument("--steps", type=int, default=4, help="greedy decode steps after the prompt")
    d.add_argument("--tolerance", type=float, default=1e-3, help="relative error that counts as divergence")
    d.add_argument("--dtype", default=None, help="compute dtype of the backends")
    d.add_argument("--activations", default=None, choices=_ACTIVATION_SCHEMES,
                   help="run the second backend with q8 activations (approximate): each of its products is held "
                        "to the mode's bound (docs/conformance.md)")
    d.set_defaults(func=cmd_diff)
    srv = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API (needs infer-engine[serve])")
    srv.add_argument("model", help="catalog alias, model folder, .gguf file, or org/name")
    srv.add_argument("--backend", default=None, help="backend name, e.g. numpy or torch:cuda (default: best available)")
    srv.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    srv.add_argument("--quantize", default=None, help="q8, q4 or off (see docs/quantization.md)")
    srv.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="capture each layer's pieces as compiled graphs (--no-compile: all eager)")
    _add_kv_dtype(srv)
    _add_activations(srv)
    srv.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                     help="run the model over N ranks (torch:cpu or torch:cuda; see docs/distributed.md)")
    _add_lora(srv)
    srv.add_argument("--mmproj", default=None, metavar="FILE",
                     help="with a .gguf text model: llama.cpp's vision projector file for it, so requests may carry "
                          "images (docs/vision.md, \"GGUF pairs\")")
    srv.add_argument("--enable-lora-updates", action="store_true",
                     help="let clients load and unload adapters at run time (POST /v1/load_lora_adapter, "
                     "/v1/unload_lora_adapter); off by default")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--model-name", default=None, help="the id clients pass as model (default: the folder or "
                     "file name)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $INFER_API_KEY; "
                     "none: no key)")
    srv.add_argument("--kv-memory", type=_bytes, default=None, help="bytes of keys and values for all requests, "
                     "e.g. 2GiB (default 256MiB)")
    srv.add_argument("--max-batch-tokens", type=int, default=512, help="most tokens one forward processes "
                     "(default 512)")
    srv.add_argument("--encoder-memory", type=_bytes, default=None, help="bytes of vision-tower activations and "
                     "image embeddings for all requests with images, e.g. 8GiB (default 4GiB)")
    srv.add_argument("--max-queue", type=int, default=256, help="requests that may wait before new ones get 429 "
                     "(default 256)")
    srv.add_argument("--max-body-bytes", type=_bytes, default=2**20, help="largest request body (default 1MiB; "
                     "raise it for images sent as data: URLs)")
    srv.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                     help="hosts (and their subdomains) whose http(s) image URLs the server fetches; other remote "
                     "images are refused (default: none; data: URLs always work)")
    srv.add_argument("--body-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="seconds a client may take to send its request body; 408 beyond (default 10)")
    srv.add_argument("--reasoning-parser", default=None, metavar="NAME",
                     help="how replies' reasoning is told apart: think, harmony, granite or none (default: chosen "
                     "from the chat template)")
    srv.add_argument("--tool-parser", default=None, metavar="NAME",
                     help="the tool-call format: hermes, llama3_json, mistral, qwen3_coder, pythonic, deepseek_v3 or "
                     "harmony (default: chosen from the chat template)")
    srv.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                     help="keep prefix blocks on disk as they leave use, and read them back for a later request "
                     "that starts with them, across restarts (default: memory only)")
    srv.add_argument("--prompt-cache-bytes", type=_bytes, default=4 * 2**30, metavar="BYTES",
                     help="the most the prompt cache folder holds, e.g. 20GiB (default 4GiB)")
    srv.add_argument("--slot-save-path", default=None, metavar="DIR",
                     help="folder of the saved states POST /slots/NAME?action=save|restore|erase names "
                     "(default: slots are off)")
    srv.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="measure speed and memory against llama.cpp, transformers and mlx-lm")
    b.add_argument("model", help="catalog alias, model folder, .gguf file, or org/name")
    b.add_argument("--backend", action="append", default=None,
                   help="infer backend to measure (repeatable or comma-separated; default: the one infer.load picks)")
    b.add_argument("--dtype", default=None, help="compute dtype of infer's backends (default: each backend's)")
    b.add_argument("--quantize", default=None, help="passed to infer.load(quantize=...): q8, q4 or off")
    b.add_argument("--compile", action="store_true", help="passed to infer.load(compile=True): graph capture")
    b.add_argument("--kv-dtype", default=None, help="passed to infer.load(kv_dtype=...): float16 or q8_0 keys and "
                   "values (reported as approximate)")
    b.add_argument("--activations", default=None, choices=_ACTIVATION_SCHEMES,
                   help="passed to infer.load(activations=...): q8: int8 activations in the quantized products "
                   "(reported as approximate)")
    b.add_argument("--peers", default="all", help="peers to measure too: all (default), none, or a comma-separated "
                   "list of llama.cpp, transformers[:DTYPE], mlx-lm; those not installed are skipped")
    b.add_argument("--baseline", default="llama.cpp", help="engine label or kind the ratios are against, or none "
                   "(default: llama.cpp)")
    b.add_argument("--repeats", type=int, default=3, help="repeats; figures are medians (default 3)")
    b.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    b.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    b.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the warm-up run (default 16; 0: none)")
    b.add_argument("--threads", type=int, default=None, help="CPU threads of every engine (default: all cores)")
    b.add_argument("--hf", default=None, help="Hugging Face folder of the same model for mlx-lm (default: made "
                   "from the GGUF file with transformers, once)")
    b.add_argument("--timeout", type=float, default=1800.0, help="seconds one engine process may take")
    b.add_argument("--no-bandwidth", action="store_true", help="skip measuring memory bandwidth and decode bounds")
    b.add_argument("-o", "--output", default="infer-bench.json", help="JSON report (default: infer-bench.json)")
    b.add_argument("--plot", default=None, help="PNG plot (default: the report's name with .png; needs matplotlib)")
    b.add_argument("--no-plot", action="store_true", help="write no plot")
    b.set_defaults(func=cmd_bench)
    c = sub.add_parser("convert", help="write a model as a GGUF file (quantized) or a Hugging Face folder")
    c.add_argument("src", help="catalog alias, model folder or .gguf file")
    c.add_argument("out", help="OUT.gguf for a GGUF file; any other path for a Hugging Face folder")
    c.add_argument("--type", default=None, help="storage type. GGUF: f32, f16 (default), bf16, q8_0, q4_0, q4_1, "
                   "q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m, q5_k_m; folder: f32 (default), f16, bf16")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--base", default=None, help="for a PEFT LoRA folder SRC (written as a GGUF adapter): the base "
                   "model it adapts (default: its adapter_config.json's base_model_name_or_path)")
    c.add_argument("--mmproj", default=None, metavar="FILE",
                   help="for a Gemma 3, LLaVA, Idefics3 / SmolVLM or Qwen3.5 folder SRC written as OUT.gguf: where the vision "
                        "tower and projector go, llama.cpp's mmproj file (default: mmproj-OUT.gguf beside OUT)")
    c.set_defaults(func=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``infer`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except InferError as exc:
        print(f"infer: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        while _LOADED:
            _LOADED.pop().close()


if __name__ == "__main__":
    sys.exit(main())
