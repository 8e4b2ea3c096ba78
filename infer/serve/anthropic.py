"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

What Claude-style clients (the official ``anthropic`` package, agents built
on it) send, as llama-server, vLLM and ollama serve it: a ``system`` prompt,
messages of text, ``tool_use`` and ``tool_result`` blocks, ``tools`` with an
``input_schema``, ``tool_choice``, ``stop_sequences``, ``thinking`` with a
token budget. The conversation becomes the OpenAI-shaped one the chat
template reads, and the request runs as a chat completion does
(:meth:`~infer.serve.app.Server.chat_plan`), so greedy output is
:meth:`infer.Model.chat`'s. Replies are content blocks (``thinking``,
``text``, ``tool_use``) with a ``stop_reason``; a stream is Anthropic's named
events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``). Errors have Anthropic's shape
(:func:`infer.serve.http.error_response`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.chat import Delta
from infer.errors import RequestError
from infer.serve.protocol import MAX_STOP_SEQUENCES, _Body, check_stops, parse

# The server and its choices (infer.serve.app.Server, .Choice) are typed Any here: app imports this module.
Server = Any
Choice = Any


class _Counted(_Body):
    """What both endpoints take: the conversation and its tools."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Counted):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    #: Prompt caching: infer's prefix cache reuses every shared prefix anyway.
    cache_control: dict[str, Any] | None = None
    #: ``{"format": {"type": "json_schema", "schema": ...}, "effort": ...}``.
    output_config: dict[str, Any] | None = None

    def output_options(self) -> dict[str, Any]:
        """``output_config`` as :class:`~infer.request.GenerationRequest` options."""
        config = self.output_config or {}
        unknown = sorted(set(config) - {"format", "effort"})
        if unknown:
            raise RequestError(f"output_config.{unknown[0]} is not supported", "output_config")
        out: dict[str, Any] = {}
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise RequestError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                                   "output_config")
            out["json_schema"] = fmt["schema"]
        effort = config.get("effort")
        if effort is not None:
            levels = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
            if effort not in levels:
                raise RequestError(f"output_config.effort must be one of {sorted(levels)}", "output_config")
            out["reasoning_effort"] = levels[effort]
        return out


def _text(content: Any, where: str) -> str:
    """A block list's (or a string's) text; any block but text is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content blocks", where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RequestError(f"{where}[{j}] is a {kind!r} block; only text blocks are supported here", where)
        texts.append(block["text"])
    return "".join(texts)


def conversation(body: _Counted) -> list[dict[str, Any]]:
    """The messages in the OpenAI shape chat templates read: the system
    prompt first; an assistant's ``tool_use`` blocks as ``tool_calls``; a
    user's ``tool_result`` blocks as ``tool`` messages."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant") or set(message) - {"role", "content"}:
            raise RequestError(f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}", where)
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, thinking = [], [], None
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise RequestError(f"{at}.input must be an object", at)
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": arguments}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(result, f"{at}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking = block.get("thinking") if isinstance(block.get("thinking"), str) else None
            else:
                raise RequestError(f"{at} is a {kind!r} block, which is not supported in a {role} message here "
                                   "(text, tool_use, tool_result and thinking blocks are)", at)
        if texts or calls or role == "assistant":
            item: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                item["tool_calls"] = calls
            if thinking:
                item["reasoning_content"] = thinking
            out.append(item)
    return out


def chat_options(body: _Counted) -> dict[str, Any]:
    """The tools, tool choice and thinking of ``body`` as a
    :class:`~infer.request.GenerationRequest` takes them."""
    out: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool.get("name"), str) or tool.get("type", "custom") != "custom":
                raise RequestError(f"tools[{i}] must be a client tool with a 'name' and an 'input_schema' "
                                   "(server tools are not supported)", "tools")
            schema = tool.get("input_schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise RequestError(f"tools[{i}].input_schema must be a JSON schema object", "tools")
            function = {"name": tool["name"], "parameters": schema}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        out["tools"] = tools
    choice = body.tool_choice
    if choice is not None:
        kind = choice.get("type")
        names = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = choice["name"]
        elif kind in names:
            out["tool_choice"] = names[kind]
        else:
            raise RequestError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                               "tool_choice")
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    thinking = body.thinking
    if thinking is not None:
        if thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise RequestError("thinking.budget_tokens must be a non-negative integer", "thinking")
            out.update(enable_thinking=True, thinking_budget=budget)
        elif thinking.get("type") == "disabled":
            out["enable_thinking"] = False
        else:
            raise RequestError("thinking must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}",
                               "thinking")
    return out


def _stop_reason(c: Choice) -> tuple[str, str | None]:
    if c.reader is not None and c.reader.calls:
        return "tool_use", None
    if c.text.stop_string is not None:
        return "stop_sequence", c.text.stop_string
    return ("end_turn" if c.finish_reason == "stop" else "max_tokens"), None


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


async def messages(server: Server, request: Request) -> Response:
    """``POST /v1/messages``."""
    body: MessagesRequest = parse(MessagesRequest, await server.read_body(request))
    server.check_model(body.model)
    stops = check_stops(body.stop_sequences, "stop_sequences", MAX_STOP_SEQUENCES)
    generation = server.build_request(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                      top_k=body.top_k, stop=stops, **chat_options(body), **body.output_options())
    plan = await server.chat_plan(conversation(body), generation, param="output_config")
    (choice,) = await server.start_chat(plan)
    prompt = len(plan.prompt_ids)
    mid = f"msg_{uuid.uuid4().hex[:24]}"

    def message(content: list[dict[str, Any]], stop: tuple[str | None, str | None], output: int) -> dict[str, Any]:
        return {"id": mid, "type": "message", "role": "assistant", "model": server.name, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": prompt, "output_tokens": output}}

    if not body.stream:
        await server.run_all(request, [choice], "messages")
        reader = choice.reader
        assert reader is not None
        reader.feed(choice.output)
        reader.finish()
        blocks: list[dict[str, Any]] = []
        if reader.reasoning:
            blocks.append({"type": "thinking", "thinking": reader.reasoning, "signature": ""})
        text = reader.content
        if text or not reader.calls:
            blocks.append({"type": "text", "text": text})
        blocks += [{"type": "tool_use", "id": _tool_id(cid), "name": call.name, "input": json.loads(call.arguments)}
                   for _, cid, call in reader.calls]
        return JSONResponse(message(blocks, _stop_reason(choice), choice.tokens))

    async def events(emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        await emit({"type": "message_start", "message": message([], (None, None), 0)})
        open_block: list[Any] = [None, -1]  # the kind of the block being streamed, and its index

        async def close() -> None:
            if open_block[0] == "reasoning":
                await emit({"type": "content_block_delta", "index": open_block[1],
                            "delta": {"type": "signature_delta", "signature": ""}})
            if open_block[0] is not None:
                await emit({"type": "content_block_stop", "index": open_block[1]})
                open_block[0] = None

        async def start(kind: str, block: dict[str, Any]) -> None:
            await close()
            open_block[0], open_block[1] = kind, open_block[1] + 1
            await emit({"type": "content_block_start", "index": open_block[1], "content_block": block})

        async def delta(c: Choice, d: Delta) -> None:
            if d.kind == "tool_call":
                assert d.call is not None
                await start("tool_call", {"type": "tool_use", "id": _tool_id(d.call_id), "name": d.call.name,
                                          "input": {}})
                await emit({"type": "content_block_delta", "index": open_block[1],
                            "delta": {"type": "input_json_delta", "partial_json": d.call.arguments}})
                await close()
                return
            if open_block[0] != d.kind:
                first = {"type": "thinking", "thinking": "", "signature": ""} if d.kind == "reasoning" else \
                    {"type": "text", "text": ""}
                await start(d.kind, first)
            item = {"type": "thinking_delta", "thinking": d.text} if d.kind == "reasoning" else \
                {"type": "text_delta", "text": d.text}
            await emit({"type": "content_block_delta", "index": open_block[1], "delta": item})

        await server.run_deltas(choice, delta)
        if open_block[1] < 0:  # nothing was said: an empty text block, as Anthropic sends
            await start("content", {"type": "text", "text": ""})
        await close()
        reason, sequence = _stop_reason(choice)
        await emit({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": choice.tokens}})
        await emit({"type": "message_stop"})

    def failure(err: BaseException) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "api_error", "message": str(err)}}

    return server.sse(events, [choice], "messages", named=True, failure=failure)


async def count_tokens(server: Server, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as the template renders it."""
    body: _Counted = parse(_Counted, await server.read_body(request))
    server.check_model(body.model)
    generation = server.build_request(**chat_options(body))
    plan = await server.chat_plan(conversation(body), generation)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})
