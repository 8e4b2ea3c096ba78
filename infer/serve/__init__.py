"""``infer serve``: an HTTP server over the batch engine, speaking OpenAI's
completions, chat completions, Responses and embeddings APIs, Anthropic's
Messages API, and the llama.cpp/Jina/Cohere rerank API.

:func:`create_app` returns the ASGI app (Starlette) for a loaded model, to
run under any ASGI server or mount in an application of one's own;
:func:`load_app` loads the model first, with the options of ``infer serve``
(what a process that builds its own server calls: a Ray Serve replica,
examples/ray-serve); :func:`serve` runs it with uvicorn, as ``infer serve`` does. Endpoints,
parameters and limits: docs/serving.md.

Needs the ``serve`` extra: ``pip install "infer-engine[serve]"``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from infer.errors import MissingDependencyError

if TYPE_CHECKING:
    from infer.model import Model

__all__ = ["create_app", "load_app", "serve"]

_NEEDED = ("starlette", "uvicorn", "sse_starlette", "prometheus_client", "pydantic")


def _require() -> None:
    import importlib.util

    missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"infer's server needs {', '.join(missing)}: pip install \"infer-engine[serve]\"")


def create_app(model: Model, **options: Any) -> Any:
    """The ASGI app serving ``model``; ``options`` are those of
    :func:`infer.serve.app.create_app` (``model_name``, ``api_key``,
    ``max_queue``, ``max_body_bytes``, ``batch_engine``, ``reasoning_parser``,
    ``tool_parser``, ``body_timeout``)."""
    _require()
    from infer.serve.app import create_app as make

    return make(model, **options)


def load_app(
    reference: str | os.PathLike[str], *, backend: str | None = None, dtype: str | None = None,
    quantize: str | None = None, compile: bool | None = None, kv_dtype: str | None = None,
    activations: str | None = None, kv_memory: int | None = None, max_batch_tokens: int | None = None,
    progress: bool = False, **options: Any,
) -> Any:
    """Load a model and return the ASGI app serving it, as ``infer serve`` does.

    Args:
        reference: a catalog alias, model folder, ``.gguf`` file or
            ``org/name`` (as for :func:`infer.load`).
        backend, dtype, quantize, compile, kv_dtype, activations, progress:
            as for :func:`infer.load`.
        kv_memory: bytes of keys and values of all requests together
            (default 256 MiB), as ``--kv-memory``.
        max_batch_tokens: most tokens one forward processes (default 512),
            as ``--max-batch-tokens``.
        options: those of :func:`create_app` (``model_name``, ``api_key``,
            ``max_queue``, ``max_body_bytes``, ``reasoning_parser``,
            ``tool_parser``, ``body_timeout``).

    The model is loaded once, here; the app's lifespan starts the thread
    that steps its batch engine.
    """
    _require()
    import infer

    model = infer.load(reference, backend=backend, dtype=dtype, quantize=quantize, compile=compile,
                       kv_dtype=kv_dtype, activations=activations, progress=progress)
    batching: dict[str, Any] = {"kv_memory": kv_memory}
    if max_batch_tokens is not None:
        batching["max_batch_tokens"] = max_batch_tokens
    model.configure_batching(**batching)
    return create_app(model, **options)


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          **options: Any) -> None:
    """Serve ``model`` on ``host:port`` until interrupted (uvicorn);
    ``options`` as for :func:`create_app`."""
    app = create_app(model, **options)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
