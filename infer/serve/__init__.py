"""``infer serve``: an OpenAI-compatible HTTP server over the batch engine.

:func:`create_app` returns the ASGI app (Starlette) for a loaded model, to
run under any ASGI server or mount in an application of one's own;
:func:`serve` runs it with uvicorn, as ``infer serve`` does. Endpoints,
parameters and limits: docs/serving.md.

Needs the ``serve`` extra: ``pip install "infer-engine[serve]"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infer.errors import MissingDependencyError

if TYPE_CHECKING:
    from infer.model import Model

__all__ = ["create_app", "serve"]

_NEEDED = ("starlette", "uvicorn", "sse_starlette", "prometheus_client", "pydantic")


def _require() -> None:
    import importlib.util

    missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"infer's server needs {', '.join(missing)}: pip install \"infer-engine[serve]\"")


def create_app(model: Model, **options: Any) -> Any:
    """The ASGI app serving ``model`` with OpenAI's API; ``options`` are those
    of :func:`infer.serve.app.create_app` (``model_name``, ``api_key``,
    ``max_queue``, ``max_body_bytes``, ``batch_engine``)."""
    _require()
    from infer.serve.app import create_app as make

    return make(model, **options)


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          **options: Any) -> None:
    """Serve ``model`` on ``host:port`` until interrupted (uvicorn);
    ``options`` as for :func:`create_app`."""
    app = create_app(model, **options)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
