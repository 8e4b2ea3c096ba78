"""The retrieval endpoints: OpenAI's ``/v1/embeddings`` and ``/v1/rerank``
(the shape llama.cpp's server, Jina and Cohere share).

Both run their forwards on the engine thread between two generation steps
(:meth:`~infer.serve.loop.EngineLoop.call`), so they never overlap a
generation forward; a bad body is a 400 in OpenAI's error shape naming the
parameter (:class:`~infer.errors.RequestError`).
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.errors import EmbeddingError, RequestError
from infer.serve.protocol import ServerLike


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def embedding_inputs(value: object) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids
    or a list of token id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if _int_list(value):
            return [list(value)]
        if all(isinstance(v, str) for v in value) or all(_int_list(v) for v in value):
            return list(value)
    raise RequestError("input must be a string, a non-empty list of strings, a list of token ids or a list of "
                       "token id lists", "input")


async def _body(server: ServerLike, request: Request) -> dict[str, Any]:
    """The request's body: a JSON object naming the served model."""
    body = await server.read_body(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    server.check_model(_field(body, "model", (str,), "a string") or "")
    return body


def _field(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise RequestError(f"{key} must be {what}, got {value!r}", key)
    return value


async def embeddings(server: ServerLike, request: Request) -> Response:
    """``POST /v1/embeddings``."""
    body = await _body(server, request)
    if "input" not in body:
        raise RequestError("input is required", "input")
    inputs = embedding_inputs(body["input"])
    fmt = _field(body, "encoding_format", (str,), "'float' or 'base64'") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    dimensions = _field(body, "dimensions", (int,), "a positive integer")
    normalize = _field(body, "normalize", (bool,), "true or false")
    prompt_name = _field(body, "prompt_name", (str,), "a string")
    _field(body, "user", (str,), "a string")
    model = server.model
    run = functools.partial(_embed, model, inputs, dimensions=dimensions, prompt_name=prompt_name,
                            normalize=True if normalize is None else normalize)
    vectors, tokens = await server.loop.call(run)
    data = []
    for i, row in enumerate(vectors):
        value: Any = (base64.b64encode(np.ascontiguousarray(row, "<f4").tobytes()).decode("ascii") if fmt == "base64"
                      else [float(x) for x in row])
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": server.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _embed(model: Any, inputs: list[str | list[int]], **options: Any) -> tuple[np.ndarray, int]:
    from infer.embedding import embed

    try:
        return embed(model, inputs, **options)
    except EmbeddingError as err:
        text = str(err)
        param = "dimensions" if text.startswith("dimensions") else "prompt_name" if "prompt_name" in text else "input"
        raise RequestError(text, param) from None


def rerank_documents(value: object) -> list[str]:
    """``documents``: strings, or objects with a ``text`` (Cohere's and Jina's form)."""
    if not isinstance(value, list) or not value:
        raise RequestError("documents must be a non-empty list of strings", "documents")
    out = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            doc = doc["text"]
        if not isinstance(doc, str):
            raise RequestError(f"documents[{i}] must be a string or an object with a 'text' string", "documents")
        out.append(doc)
    return out


async def rerank(server: ServerLike, request: Request) -> Response:
    """``POST /v1/rerank`` (also ``/rerank`` and ``/v1/reranking``): ``{model,
    query, documents, top_n, return_documents}`` -> ``{results: [{index,
    relevance_score, document}]}``, most relevant first."""
    body = await _body(server, request)
    query = body.get("query")
    if not isinstance(query, str):
        raise RequestError("query must be a string", "query")
    documents = rerank_documents(body.get("documents"))
    top_n = _field(body, "top_n", (int,), "a positive integer")
    if top_n is not None and top_n < 1:
        raise RequestError(f"top_n must be a positive integer, got {top_n}", "top_n")
    returned = _field(body, "return_documents", (bool,), "true or false")
    model = server.model

    def run() -> tuple[list[float], int]:
        try:
            return model.rerank(query, documents, return_tokens=True)
        except EmbeddingError as err:
            raise RequestError(str(err), "documents") from None

    scores, tokens = await server.loop.call(run)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if returned:
            item["document"] = {"text": documents[i]}
        results.append(item)
    return JSONResponse({"object": "list", "model": server.name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
