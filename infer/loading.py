"""``infer.load``: from a model reference to a ready :class:`~infer.model.Model`.

The steps, each owned by a different part: resolve the reference to a path;
the format that recognises the path opens it as a
:class:`~infer.package.ModelPackage`; the backend is selected; the
architecture registered for the package's ``model_type`` builds the network,
pulling its weights through a :class:`~infer.architecture.WeightLoader`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping
import re
import time
from pathlib import Path
from typing import Any

from infer import catalog
from infer.architecture import WeightLoader
from infer.errors import ConfigError, ModelNotFoundError, UnsupportedAdapterError
from infer.model import TENSOR_PARALLEL_ADAPTERS, Model
from infer.ops import ACTIVATION_SCHEMES, Backend, LoadSettings  # ACTIVATION_SCHEMES: its older home was here
from infer.plugins import get_registry
from infer.plugins.selection import select_backend
from infer.progress import progress_bar

log = logging.getLogger(__name__)


HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.gguf", "*.txt", "*.model"]


def resolve(reference: str | os.PathLike[str], *, progress: bool = False) -> Path:
    """The local path a model reference names, in this order:

    1. an ``os.PathLike`` (a :class:`~pathlib.Path`), or a string written as a
       path (absolute, or starting with ``.`` or ``~``, or ending in
       ``.gguf``): that file or folder, which must exist;
    2. a catalog alias (``smollm2-135m``; downloaded once into the cache, see
       :mod:`infer.catalog`), even where a file of that name exists here;
    3. a relative path to an existing model: a file, or a folder holding
       ``config.json`` or a ``.gguf`` file (``models/SmolLM2-135M-Instruct``);
    4. a Hugging Face reference, resolved through ``huggingface_hub`` (which
       answers from its local cache when offline, e.g. with
       ``HF_HUB_OFFLINE=1``): ``org/name`` (the model's files),
       ``org/name:Q4_K_M`` (only the GGUF file whose name ends with that
       quantization) or ``org/name/file.gguf`` (only that file, when no
       local file of that name exists).

    So a file in the working directory never stands in for a catalog alias
    (write ``./smollm2-135m`` to mean it), and a folder that holds no model
    never stands in for a repository.

    Raises:
        ModelNotFoundError: the reference is empty, or names nothing of these.
    """
    if not isinstance(reference, (str, os.PathLike)):
        raise ModelNotFoundError(f"a model reference is a path or a string, got {type(reference).__name__}")
    text = os.fspath(reference)
    if not isinstance(text, str) or not text.strip():
        raise ModelNotFoundError(f"the model reference {text!r} is empty; pass a path, a catalog alias "
                                 f"({', '.join(sorted(catalog.CATALOG))}) or a Hugging Face id org/name")
    if not isinstance(reference, str) or _written_as_path(text):
        path = Path(text).expanduser()
        if not isinstance(reference, str) or path.exists() or _hub_file(text) is None:
            return _local_model(path, text)
    if text in catalog.CATALOG:
        return catalog.fetch(text, progress=progress)
    if _holds_model(Path(text)):
        return Path(text)
    if _looks_like_repo_id(text):
        return _from_hub(text, progress)
    repo, _, tag = text.rpartition(":")
    if _looks_like_repo_id(repo) and re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
        return _from_hub(repo, progress, quantization=tag)
    hub_file = _hub_file(text)
    if hub_file is not None:
        return _from_hub(hub_file[0], progress, filename=hub_file[1])
    if Path(text).exists():
        return _local_model(Path(text), text)  # raises: it is no model
    raise ModelNotFoundError(
        f"no model at {text!r}: not a file or folder, not a catalog alias "
        f"({', '.join(sorted(catalog.CATALOG))}), and not a Hugging Face reference (org/name, "
        "org/name:QUANT for one GGUF quantization, org/name/file.gguf)"
    )


def _written_as_path(text: str) -> bool:
    return os.path.isabs(text) or text.startswith((".", "~")) or text.lower().endswith(".gguf")


def _hub_file(text: str) -> tuple[str, str] | None:
    """``(repo, filename)`` of a reference ``org/name/file.gguf``, else None."""
    parts = text.split("/")
    if len(parts) > 2 and text.lower().endswith(".gguf") and _looks_like_repo_id("/".join(parts[:2])):
        return "/".join(parts[:2]), "/".join(parts[2:])
    return None


def _holds_model(path: Path) -> bool:
    if path.is_dir():
        return (path / "config.json").is_file() or any(path.glob("*.gguf"))
    return path.is_file()


def _local_model(path: Path, text: str) -> Path:
    if not path.exists():
        raise ModelNotFoundError(f"no model at {text!r}: no such file or folder")
    if not _holds_model(path):
        raise ModelNotFoundError(f"{text!r} is a folder without a model: expected a Hugging Face folder "
                                 "(config.json) or a .gguf file")
    return path


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not {"\\", ":"} & set(text)


@functools.cache
def _silent_progress() -> type:
    """A tqdm class that never shows (made on first use: tqdm's import is not cheap)."""
    from tqdm.auto import tqdm

    class _SilentProgress(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return _SilentProgress


def _from_hub(repo_id: str, progress: bool, *, quantization: str | None = None,
              filename: str | None = None) -> Path:
    """A repository's model through huggingface_hub (its cache first): the
    whole model (``HUB_ALLOW_PATTERNS``), or only the GGUF file whose name
    ends with ``quantization`` (``Q4_K_M``, any case), or only ``filename``."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a Hugging Face repository id, but huggingface_hub is not installed "
            "(pip install huggingface_hub)"
            + (f"; a local {repo_id!r} exists but holds no model" if Path(repo_id).exists() else "")
        ) from None
    quiet = {} if progress else {"tqdm_class": _silent_progress()}  # the library prints only when asked
    try:
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename, **quiet))
        if quantization is not None:
            spellings = sorted({quantization, quantization.upper(), quantization.lower()})
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=[f"*{q}.gguf" for q in spellings], **quiet)
            return _one_quantization(repo_id, Path(folder), quantization)
        folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, **quiet)
    except (HfHubHTTPError, OSError, ValueError) as exc:  # offline without a cached copy, unknown repo, ...
        what = f" file {filename!r}" if filename else ""
        hint = f" (a local {repo_id!r} exists but holds no model)" if Path(repo_id).exists() else ""
        raise ModelNotFoundError(
            f"cannot resolve Hugging Face repository {repo_id!r}{what}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def _one_quantization(repo_id: str, folder: Path, quantization: str) -> Path:
    """The one GGUF file of ``folder`` whose name ends with ``quantization``."""
    found = sorted(p for p in folder.rglob("*.gguf") if p.stem.lower().endswith(quantization.lower()))
    if len(found) == 1:
        return found[0]
    if not found:
        present = sorted(p.name for p in folder.rglob("*.gguf"))
        raise ModelNotFoundError(
            f"Hugging Face repository {repo_id!r} has no GGUF file ending in {quantization!r}"
            + (f" (cached: {', '.join(present)})" if present else "")
            + "; give the file itself as org/name/file.gguf")
    raise ModelNotFoundError(
        f"Hugging Face repository {repo_id!r} has {len(found)} GGUF files ending in {quantization!r} "
        f"({', '.join(p.name for p in found)}); give one as org/name/file.gguf")


def load(
    reference: str | os.PathLike[str],
    *,
    backend: str | Backend | None = None,
    dtype: str | None = None,
    format: str | None = None,
    progress: bool = False,
    quantize: str | None = None,
    compile: bool | None = None,
    tensor_parallel: int | None = None,
    kv_dtype: str | None = None,
    activations: str | None = None,
    adapters: Mapping[str, str | os.PathLike[str]] | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    max_lora_rank: int | None = None,
    mmproj: str | os.PathLike[str] | None = None,
) -> Model:
    """Load a model.

    Args:
        reference: a model folder or file, a catalog alias
            (``smollm2-135m``, ``gemma3-270m``) or a Hugging Face repository id
            (see :func:`resolve`).
        backend: a backend name (``"numpy"``, ``"torch:cuda"``...), a
            :class:`~infer.ops.Backend`, or None for ``$INFER_BACKEND`` or the
            best available.
        dtype: compute dtype (default: the backend's).
        format: force a registered format instead of detecting it.
        progress: show progress bars on stderr while downloading and
            loading weights.
        compile: where the backend can compile
            (:meth:`~infer.ops.Backend.compile`: ``torch.compile``,
            ``mx.compile``, the numpy backend's recorded programs), capture
            each greedy decode step as one graph
            (:mod:`infer.engine.capture`; ``model.engine.decode_step``
            says whether it is captured and why not), and the pieces of each
            layer between attention calls for every other forward. Costs
            compile time at the first step of each new shape. Outputs equal
            the uncompiled ones within rounding. ``None`` (default): the
            decode step is captured where the backend says that is faster
            at no compile cost (:attr:`~infer.ops.Backend.capture_by_default`:
            numpy with its C kernels, torch on the CPU in float32), nothing
            else; ``False``: all eager.
        quantize: ``None`` (default): float weights stay float, quantized
            (GGUF) weights stay quantized where the backend computes on them
            exactly and natively, and are dequantized otherwise; ``"q8"`` or
            ``"q4"``: also quantize float linear weights on load with the
            backend's native scheme (see docs/quantization.md); ``"off"``:
            dequantize every weight to the compute dtype.
        tensor_parallel: run the model over this many ranks of a process
            group (``torch:cpu`` over gloo, ``torch:cuda`` over NCCL), each
            holding its share of the heads and intermediate units; this
            process is rank 0 and starts the others, or joins the group
            ``torchrun`` started (see :mod:`infer.distributed` and
            docs/distributed.md). ``None`` or 1: one process.
        kv_dtype: the dtype the KV cache stores keys and values in.
            ``None`` (default): as computed, exact. ``"float16"`` (every
            backend here) or ``"bfloat16"`` (torch, MLX): half the cache's
            memory and half the bytes each decode step's attention reads,
            for keys and values rounded once as they are written (the
            measured effect on perplexity and speed: docs/kv-cache.md,
            "Storing keys and values narrower"). Recurrent state is not
            affected.
        activations: ``None`` (default): the products compute on exact
            float activations. ``"q8"``: the activations (inputs) of the
            products with quantized weights are rounded to int8 per 32
            values, one float scale each, for integer dot products on the
            weights' codes: faster prefill and batched decoding,
            approximate, off by default (the measured effect:
            docs/quantization.md, "Quantized activations"). Weights that
            are float are not affected; a backend without the scheme
            (:attr:`~infer.ops.Backend.activation_schemes`) is an error.

        adapters: LoRA adapters to load, by name: ``{"name": path}`` (a
            PEFT folder or a GGUF adapter file); requests ask for one with
            ``adapter="name"`` (docs/adapters.md). More load later with
            :meth:`Model.load_adapter`.
        max_loras, max_cpu_loras, max_lora_rank: the adapter limits
            (:meth:`Model.configure_adapters`; None: its defaults).
        mmproj: with a text GGUF ``reference``, llama.cpp's vision
            projector file for it (``mmproj-*.gguf``): the two load as one
            vision-language model (docs/vision.md, "GGUF pairs"; see
            :func:`find_mmproj` for the file beside a model).

    ``quantize``, ``activations``, ``kv_dtype`` and ``compile`` become the
    model's :class:`~infer.ops.LoadSettings` (``model.backend.settings``),
    handed to the backend with :meth:`~infer.ops.Backend.configure`: a
    backend instance passed as ``backend`` is never changed, so several
    models loaded on it keep their own settings.

    Raises:
        InvalidQuantizationError: ``quantize`` or ``activations`` is not
            one of those, or the backend has no such scheme.
        CacheConfigError: the backend cannot store keys and values in ``kv_dtype``.
        TensorParallelConfigError: ``tensor_parallel`` below 1, a backend
            without collectives, or a model it cannot split.
        WorkerError: the ranks did not meet, or one failed while loading.
        MmprojError: ``mmproj`` is not a vision projector file, or
            ``reference`` is not a GGUF model to pair it with;
            ``UnknownProjectorError`` and ``MmprojMismatchError`` (its
            kinds) say which projector or which mismatch.
    """
    settings = LoadSettings(quantize=quantize, activations=activations, kv_dtype=kv_dtype, compile=compile)
    started = time.perf_counter()
    path = resolve(reference, progress=progress)
    registry = get_registry()
    fmt = registry.format_for(path, format)
    log.info("opening %s as %s", path, fmt.name)
    package = fmt.open(path) if mmproj is None else _open_pair(path, fmt.name, mmproj)
    release_free_heap()  # the tokenizer's parse left its temporaries in the heap
    arch = registry.architecture_for(package.model_type)
    # The backend with this load's settings, before any weight is prepared (prepare_weight
    # reads them); a backend instance given here is never changed (LoadSettings says why).
    ops = select_backend(backend, dtype).configure(settings)
    capture = ops.capture_by_default if compile is None else compile
    if compile and not ops.supports("compile"):
        log.info("%s/%s has no graph capture; compile=True changes nothing", ops.name, ops.device)
    if tensor_parallel is not None and (tensor_parallel != 1 or isinstance(tensor_parallel, bool)):
        if adapters or any(v is not None for v in (max_loras, max_cpu_loras, max_lora_rank)):
            # Refused before any rank starts (the model, once loaded, refuses load_adapter too).
            raise UnsupportedAdapterError(TENSOR_PARALLEL_ADAPTERS.format(ranks=tensor_parallel))
        return _load_parallel(path, package, arch, fmt.name, ops, backend, dtype, tensor_parallel, progress,
                              started, settings)
    total = len(package.tensors.names())
    with progress_bar(progress, total=total, desc=f"Loading {path.name}", unit="tensor", leave=False) as bar:
        weights = WeightLoader(package.tensors, ops, progress=bar.update)
        try:
            network = arch.build(package.config, weights, ops)
        except ConfigError as exc:  # name the file: the architecture knows only config.json's keys
            source = path if path.is_dir() else f"{path} (its metadata in config.json names)"
            raise ConfigError(f"{source}: {exc}") from exc
    release_free_heap()
    log.info("weights on %r: %s", ops, weights.summary())
    unused = weights.unused(ignore=getattr(network, "ignored_tensors", ()))
    if unused:
        log.info("%d tensors not used by %s: %s", len(unused), arch.name, ", ".join(unused[:8]))
    log.info("loaded %s (%s, %s) on %r in %.2f s", path, package.model_type, fmt.name, ops,
             time.perf_counter() - started)
    model = Model(package, network, ops, kv_dtype=settings.kv_dtype)
    model.weight_sources = weights.sources  # where adapters attach (model.load_adapter)
    if capture and ops.supports("compile") and not getattr(network, "is_encoder", False):
        model.engine.capture_decode()
    limits = {k: v for k, v in (("max_loras", max_loras), ("max_cpu_loras", max_cpu_loras),
                                ("max_lora_rank", max_lora_rank)) if v is not None}
    if limits:
        model.configure_adapters(**limits)
    for name, adapter in (adapters or {}).items():
        model.load_adapter(name, adapter)
    return model


def _open_pair(path: Path, format: str, mmproj: str | os.PathLike[str]) -> Any:
    """The text GGUF ``path`` with its vision projector file ``mmproj``, as one package."""
    from infer.errors import MmprojError

    spec = get_registry().formats.get(format)
    if spec is None or spec.open_pair is None or not path.is_file():
        raise MmprojError(f"mmproj= pairs a vision projector with a text GGUF file; {path} is a {format} model")
    projector = Path(mmproj).expanduser()
    if not projector.is_file():
        raise MmprojError(f"no mmproj file at {projector}")
    log.info("pairing %s with the vision projector %s", path, projector)
    return spec.open_pair(path, projector)


def find_mmproj(model: str | os.PathLike[str]) -> Path | None:
    """The vision projector beside the GGUF file ``model``, named as llama.cpp's
    converter and the Hugging Face repositories name it (``mmproj*.gguf`` in the
    same folder; the model file itself never counts): the only one, or among
    several the one whose name holds the model's (``mmproj-<model>.gguf``);
    None where there is none.

    Raises:
        MmprojError: several candidates and none names the model.
    """
    from infer.errors import MmprojError

    path = Path(model).expanduser()
    if not path.is_file():
        return None
    found = sorted(p for p in path.parent.glob("*.gguf") if p.name.lower().startswith("mmproj") and p != path)
    if len(found) <= 1:
        return found[0] if found else None
    named = [p for p in found if path.stem.lower() in p.stem.lower()]
    if len(named) == 1:
        return named[0]
    raise MmprojError(f"{len(found)} mmproj files beside {path} ({', '.join(p.name for p in found)}) and "
                      f"{'several' if named else 'none'} named after it; pass the one to use (--mmproj)")


def _load_parallel(path: Path, package: Any, arch: Any, format: str, ops: Backend, backend: str | Backend | None,
                   dtype: str | None, ranks: int, progress: bool, started: float, settings: LoadSettings) -> Model:
    """``load`` over ``ranks`` ranks (:mod:`infer.distributed`), each rank's
    backend configured with ``settings``."""
    from infer import distributed

    distributed.check(ops, package, ranks, compile=bool(settings.compile))
    name = f"{ops.name}:{ops.device}"  # what the other ranks select
    total = len(package.tensors.names())
    with progress_bar(progress, total=total, desc=f"Loading {path.name} (rank 0 of {ranks})", unit="tensor",
                      leave=False) as bar:
        network = distributed.driver(package, arch, ops, ranks, format=format, backend=name,
                                     dtype=dtype or ops.compute_dtype, settings=settings, progress=bar.update)
    release_free_heap()
    log.info("loaded %s (%s, %s) over %d ranks of %r in %.2f s", path, package.model_type, format, ranks, ops,
             time.perf_counter() - started)
    return Model(package, network, ops, kv_dtype=settings.kv_dtype)


_malloc_trim: object = None


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's
    ``malloc_trim``); False where the C library has none (macOS, musl, Windows).

    Parsing a tokenizer (in Rust) and converting weights free hundreds of MB of
    temporaries that glibc keeps in its heap, while the large arrays allocated
    afterwards are mapped afresh beside it: the resident set then counts both
    (what it saves: docs/performance.md, "The targets still missed").
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (AttributeError, OSError, TypeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)  # type: ignore[operator]
    return True
