"""HTTP plumbing of the server: OpenAI's error body, the guard that checks the
API key and the body size before any route, and reading a request's JSON."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from infer.errors import (
    AdapterInUseError,
    AdapterMemoryError,
    AdapterNotFoundError,
    CacheFullError,
    ContextLengthError,
    RequestError,
    ServerBusyError,
)

#: Anthropic's error types by status (its API reference, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of the Anthropic Messages API's, whose errors have its shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``;
    for a ``path`` of the Anthropic Messages API, Anthropic's:
    ``{"type": "error", "error": {"type", "message"}}``."""
    if anthropic_path(path):
        error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                          path=request.url.path)


async def infer_error(request: Request, exc: Exception) -> Response:
    path = request.url.path
    if isinstance(exc, RequestError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(exc.status, str(exc), kind=kind, param=exc.param, code=exc.code, path=path)
    if isinstance(exc, ServerBusyError):
        return error_response(429, str(exc), kind="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(exc.retry_after)}, path=path)
    if isinstance(exc, CacheFullError):
        return error_response(400, str(exc), param="max_tokens", code="kv_cache_too_small", path=path)
    if isinstance(exc, AdapterMemoryError):  # the KV pool's free pages cannot hold the adapter's factors now
        return error_response(507, str(exc), kind="server_error", param="lora_path", code="adapter_memory_exceeded",
                              path=path)
    if isinstance(exc, AdapterInUseError):  # a running stream uses it: refused, never changed under it
        return error_response(409, str(exc), code="adapter_in_use", path=path)
    if isinstance(exc, AdapterNotFoundError):
        return error_response(404, str(exc), param="lora_name", code="adapter_not_found", path=path)
    if isinstance(exc, ContextLengthError):
        param = "prompt" if path.endswith("/completions") and "chat" not in path else (
            "input" if path.endswith("/responses") else "messages")
        return error_response(400, str(exc), param=param, code="context_length_exceeded", path=path)
    return error_response(400, str(exc), path=path)  # any other typed error is about the request


class Guard:
    """API key and body size, before any route: pure ASGI, so a refused
    request costs no parsing."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if not api_key else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.expected is not None and path != "/health":
            given = headers.get(b"authorization", b"")
            ok = hmac.compare_digest(given, self.expected)  # constant time in the key's bytes
            if b"x-api-key" in headers:  # Anthropic's clients send the key so
                ok = hmac.compare_digest(b"Bearer " + headers[b"x-api-key"], self.expected) or ok
            if not ok:
                reply = error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>' "
                                       "or 'x-api-key: <key>'", code="invalid_api_key", path=path)
                return await reply(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            reply = error_response(413, f"the request body has {int(length)} bytes; this server takes at most "
                                   f"{self.max_body_bytes}", code="request_too_large", path=path)
            return await reply(scope, receive, send)
        await self.app(scope, receive, send)


#: Deepest nesting of arrays and objects a request body may have (a real one needs a handful of levels).
MAX_JSON_DEPTH = 64
#: Seconds a client may take to send its whole body, by default (a slow or silent one is refused with 408):
#: 1 MiB, the default body limit, at 1 Mbit/s takes about 8.
DEFAULT_BODY_TIMEOUT = 10.0


async def read_json(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT) -> Any:
    """The body as JSON, counting bytes as they come (a chunked body has no
    Content-Length), within ``timeout`` seconds (a client that sends half a
    body and goes silent gets 408, and holds nothing). NaN and infinities,
    nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not
    Unicode (lone surrogates) are refused: each would fail somewhere later."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(f"the request body exceeds {limit} bytes", status=413,
                                       code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout:g} seconds", status=408,
                           code="request_timeout") from None
    try:
        body = json.loads(b"".join(chunks), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json(body)
    return body


def _no_constant(name: str) -> Any:
    raise RequestError(f"the request body is not valid JSON: {name} is not a JSON number")


def _check_json(value: Any) -> None:
    """Nesting depth and strings of a decoded body (iteratively: a deep body must not recurse here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body has a string with a lone surrogate (\\ud800-\\udfff), "
                                   "which is not Unicode text") from None
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        children = list(item.items()) if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, tuple):
                stack.append((child[0], depth + 1))
                stack.append((child[1], depth + 1))
            else:
                stack.append((child, depth + 1))


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
