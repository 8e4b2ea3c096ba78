"""``infer.load``: from a model reference to a ready :class:`~infer.model.Model`.

The steps, each owned by a different part: resolve the reference to a path;
the format that recognises the path opens it as a
:class:`~infer.package.ModelPackage`; the backend is selected; the
architecture registered for the package's ``model_type`` builds the network,
pulling its weights through a :class:`~infer.architecture.WeightLoader`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from infer import catalog
from infer.architecture import WeightLoader
from infer.errors import InvalidQuantizationError, ModelNotFoundError
from infer.model import Model
from infer.ops import Backend
from infer.plugins import get_registry
from infer.plugins.selection import select_backend
from infer.quantize import SCHEME_BITS

log = logging.getLogger(__name__)


HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.gguf", "*.txt", "*.model"]


def resolve(reference: str | os.PathLike[str], *, progress: bool = False) -> Path:
    """The local path a model reference names.

    In order: an existing file or folder; a catalog alias (downloaded once
    into the cache, see :mod:`infer.catalog`); a Hugging Face repository id
    ``org/name``, resolved through ``huggingface_hub`` (which answers from
    its local cache when offline, e.g. with ``HF_HUB_OFFLINE=1``).
    """
    path = Path(reference).expanduser()
    if path.exists():
        return path
    text = str(reference)
    if text in catalog.CATALOG:
        return catalog.fetch(text, progress=progress)
    if _looks_like_repo_id(text):
        return _from_hub(text, progress)
    raise ModelNotFoundError(
        f"no model at {text!r}: not a file or folder, not a catalog alias "
        f"({', '.join(sorted(catalog.CATALOG))}), and not a Hugging Face repository id (org/name)"
    )


def _check_quantize(quantize: object) -> None:
    if quantize is not None and quantize != "off" and quantize not in SCHEME_BITS:
        raise InvalidQuantizationError(
            f"quantize={quantize!r}: expected None, 'off' or one of "
            f"{', '.join(repr(s) for s in SCHEME_BITS)}")


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and "\\" not in text


class _SilentProgress(tqdm):  # type: ignore[misc]
    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _from_hub(repo_id: str, progress: bool) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a Hugging Face repository id, but huggingface_hub is not installed "
            "(pip install huggingface_hub)"
        ) from None
    try:
        quiet = {} if progress else {"tqdm_class": _SilentProgress}  # the library prints only when asked
        folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, **quiet)
    except (HfHubHTTPError, OSError, ValueError) as exc:  # offline without a cached copy, unknown repo, ...
        raise ModelNotFoundError(
            f"cannot resolve Hugging Face repository {repo_id!r}: {type(exc).__name__}: {exc}"
        ) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def load(
    reference: str | os.PathLike[str],
    *,
    backend: str | Backend | None = None,
    dtype: str | None = None,
    format: str | None = None,
    progress: bool = False,
    quantize: str | None = None,
    compile: bool = False,
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
            ``mx.compile``), capture each greedy decode step as one graph
            (:mod:`infer.engine.capture`; ``model.engine.decode_step``
            says whether it is captured and why not), and the pieces of each
            layer between attention calls for every other forward. Costs
            compile time at the first step of each new shape. Outputs equal
            the uncompiled ones within rounding.
        quantize: ``None`` (default): float weights stay float, quantized
            (GGUF) weights stay quantized where the backend computes on them
            exactly and natively, and are dequantized otherwise; ``"q8"`` or
            ``"q4"``: also quantize float linear weights on load with the
            backend's native scheme (see docs/quantization.md); ``"off"``:
            dequantize every weight to the compute dtype.

    Raises:
        InvalidQuantizationError: ``quantize`` is not one of those, or the
            backend has no such scheme.
    """
    _check_quantize(quantize)
    started = time.perf_counter()
    path = resolve(reference, progress=progress)
    registry = get_registry()
    fmt = registry.format_for(path, format)
    log.info("opening %s as %s", path, fmt.name)
    package = fmt.open(path)
    release_free_heap()  # the tokenizer's parse left its temporaries in the heap
    arch = registry.architecture_for(package.model_type)
    ops = select_backend(backend, dtype)
    if compile:
        if not ops.supports("compile"):
            log.info("%s/%s has no graph capture; compile=True changes nothing", ops.name, ops.device)
        ops.graph_capture = True
    if quantize in SCHEME_BITS and quantize not in ops.quantize_schemes:
        raise InvalidQuantizationError(
            f"quantize={quantize!r}: backend {ops.name}/{ops.device} has no on-load quantization "
            f"{quantize!r}; it has {', '.join(sorted(ops.quantize_schemes)) or 'none'}")
    ops.quantize = quantize
    total = len(package.tensors.names())
    with tqdm(total=total, desc=f"Loading {path.name}", unit="tensor", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        weights = WeightLoader(package.tensors, ops, progress=bar.update)
        network = arch.build(package.config, weights, ops)
    release_free_heap()
    log.info("weights on %r: %s", ops, weights.summary())
    unused = weights.unused(ignore=getattr(network, "ignored_tensors", ()))
    if unused:
        log.info("%d tensors not used by %s: %s", len(unused), arch.name, ", ".join(unused[:8]))
    log.info("loaded %s (%s, %s) on %r in %.2f s", path, package.model_type, fmt.name, ops,
             time.perf_counter() - started)
    model = Model(package, network, ops)
    if compile and ops.supports("compile"):
        model.engine.capture_decode()
    return model


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
