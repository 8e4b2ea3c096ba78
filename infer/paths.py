"""Where infer keeps files on disk: one cache folder for the whole process.

``$INFER_CACHE`` if set, else ``$XDG_CACHE_HOME/infer``, else
``~/.cache/infer``. Its users each take a subfolder: the catalog's downloaded
models (``models/``), the GGUF format's rebuilt tokenizers (``tokenizers/``),
the benchmark harness's converted folders (``bench/``). A module of its own so
that a format plugin can find the folder without importing the catalog.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "INFER_CACHE"


def cache_dir() -> Path:
    """Where infer keeps downloaded models and built tokenizers."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "infer"
