"""HTTP plumbing of the server: OpenAI's error body, the guard that checks the
API key and the body size before any route, and reading a request's JSON."""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from infer.errors import CacheFullError, ContextLengthError, RequestError, ServerBusyError


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)


async def infer_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, RequestError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(exc.status, str(exc), kind=kind, param=exc.param, code=exc.code)
    if isinstance(exc, ServerBusyError):
        return error_response(429, str(exc), kind="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, CacheFullError):
        return error_response(400, str(exc), param="max_tokens", code="kv_cache_too_small")
    if isinstance(exc, ContextLengthError):
        return error_response(400, str(exc), param="messages" if "chat" in request.url.path else "prompt",
                              code="context_length_exceeded")
    return error_response(400, str(exc))  # any other typed error is about the request


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
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time in the key's bytes
                reply = error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                       code="invalid_api_key")
                return await reply(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            reply = error_response(413, f"the request body has {int(length)} bytes; this server takes at most "
                                   f"{self.max_body_bytes}", code="request_too_large")
            return await reply(scope, receive, send)
        await self.app(scope, receive, send)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, counting bytes as they come (a chunked body has no Content-Length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
