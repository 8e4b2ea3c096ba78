"""A worker rank started by the driver: ``python -m infer.distributed.worker SPEC``.

``SPEC`` is JSON (:func:`infer.distributed.start` writes it): the model's
path and format, the backend, dtype and quantization, this rank, the number
of ranks, the rendezvous address and timeout, and the driver's pid. The
worker exits when the driver closes the model, when a collective fails, or
when its stdin (a pipe from the driver) reaches end of file: the driver has
died, and nothing else would stop this process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path


def _watch_driver() -> None:
    """End this process when the driver's end of stdin closes."""
    fd = sys.stdin.fileno()
    try:
        while os.read(fd, 4096):  # raw reads: no buffer lock held at interpreter shutdown
            pass
    finally:
        os._exit(3)


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    logging.basicConfig(level=os.environ.get("INFER_TP_LOG", "WARNING"),
                        format=f"infer rank {spec['rank']}: %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_driver, name="infer-tp-watch", daemon=True).start()
    log = logging.getLogger("infer.distributed.worker")
    try:
        run(spec)
    except Exception as exc:  # the driver names this rank; its own log says why
        log.error("rank %d of %d stops: %s: %s", spec["rank"], spec["ranks"], type(exc).__name__, exc,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # the watcher thread still blocks on stdin; nothing else is left to finish


def run(spec: dict) -> None:
    """Open the model, join the group, serve rank 0 until it closes the model."""
    from infer.distributed import serve
    from infer.ops import LoadSettings
    from infer.plugins import get_registry
    from infer.plugins.selection import select_backend

    registry = get_registry()
    path = Path(spec["path"])
    package = registry.format_for(path, spec["format"]).open(path)
    arch = registry.architecture_for(package.model_type)
    ops = select_backend(spec["backend"], spec["dtype"])
    ops.join_group(spec["rank"], spec["ranks"], init_method=spec["init_method"], timeout=spec["timeout"])
    # Rank 0's settings, before this rank prepares its weights; configured after joining, so
    # that rank 0 hears of a backend without them as a rank that failed to load, not a timeout.
    ops = ops.configure(LoadSettings(**spec["settings"]))
    serve(package, arch, ops, spec["ranks"])


if __name__ == "__main__":
    main(sys.argv[1:])
