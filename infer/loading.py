"""``infer.load``: from a model reference to a ready :class:`~infer.model.Model`.

The steps, each owned by a different part: resolve the reference to a path;
the format that recognises the path opens it as a
:class:`~infer.package.ModelPackage`; the backend is selected; the
architecture registered for the package's ``model_type`` builds the network,
pulling its weights through a :class:`~infer.architecture.WeightLoader`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from infer.architecture import WeightLoader
from infer.errors import ModelNotFoundError
from infer.model import Model
from infer.ops import Backend
from infer.plugins import get_registry
from infer.selection import select_backend

log = logging.getLogger(__name__)


def resolve(reference: str | os.PathLike[str]) -> Path:
    """The local path a model reference names."""
    path = Path(reference).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(f"no model at {str(reference)!r}: no such file or folder")


def load(
    reference: str | os.PathLike[str],
    *,
    backend: str | Backend | None = None,
    dtype: str | None = None,
    format: str | None = None,
    progress: bool = False,
) -> Model:
    """Load a model.

    Args:
        reference: a Hugging Face model folder (``config.json`` +
            ``*.safetensors`` + ``tokenizer.json``).
        backend: a backend name (``"numpy"``, ``"torch:cuda"``...), a
            :class:`~infer.ops.Backend`, or None for ``$INFER_BACKEND`` or the
            best available.
        dtype: compute dtype (default: the backend's).
        format: force a registered format instead of detecting it.
        progress: show a progress bar on stderr while loading weights.
    """
    started = time.perf_counter()
    path = resolve(reference)
    registry = get_registry()
    fmt = registry.format_for(path, format)
    log.info("opening %s as %s", path, fmt.name)
    package = fmt.open(path)
    arch = registry.architecture_for(package.model_type)
    ops = select_backend(backend, dtype)
    total = len(package.tensors.names())
    with tqdm(total=total, desc=f"Loading {path.name}", unit="tensor", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        weights = WeightLoader(package.tensors, ops, progress=bar.update)
        network = arch.build(package.config, weights, ops)
    unused = weights.unused(ignore=getattr(network, "ignored_tensors", ()))
    if unused:
        log.info("%d tensors not used by %s: %s", len(unused), arch.name, ", ".join(unused[:8]))
    log.info("loaded %s (%s, %s) on %r in %.2f s", path, package.model_type, fmt.name, ops,
             time.perf_counter() - started)
    return Model(package, network, ops)
