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
``message_delta``, ``message_stop``). :class:`MessageStream` makes both, one
method per event of the reply. Errors have Anthropic's shape
(:func:`infer.serve.http.error_response`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.chat import ReplyParser
from infer.errors import RequestError
from infer.serve import media
from infer.serve.choice import Choice, Events, ReplyEvents
from infer.serve.protocol import (
    MAX_STOP_SEQUENCES, LlamaSamplers, ServerLike, _Body, check_stops, joined_text, parse,
)
from infer.tool_parsers import Call


class _Counted(_Body):
    """What both endpoints take: the conversation and its tools."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Counted, LlamaSamplers):
    """The body of ``POST /v1/messages`` (llama.cpp's samplers as extra fields)."""

    #: Anthropic's API requires at least 1.
    max_tokens: int = Field(ge=1)
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
    return joined_text(content, where, "content blocks", ("text",), lambda j, kind: RequestError(
        f"{where}[{j}] is a {kind!r} block; only text blocks are supported here", where))


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
        parts: list[dict[str, Any]] = []  # text and image blocks in order, where a user message has images
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image", "image": media.image_source(block, at), "where": at})
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
                                   "(text, image, tool_use, tool_result and thinking blocks are)", at)
        if any(p["type"] == "image" for p in parts):
            out.append({"role": role, "content": parts})
        elif texts or calls or role == "assistant":
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


def request_options(body: MessagesRequest) -> dict[str, Any]:
    """Every :class:`~infer.request.GenerationRequest` option of ``body``."""
    stops = check_stops(body.stop_sequences, "stop_sequences", MAX_STOP_SEQUENCES)
    return dict(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                stop=stops, **body.sampler_options(), **chat_options(body), **body.output_options())


def stop_reason(c: Choice) -> tuple[str, str | None]:
    """The message's ``stop_reason`` and ``stop_sequence``."""
    if c.reply.calls:
        return "tool_use", None
    if c.text.stop_string is not None:
        return "stop_sequence", c.text.stop_string
    return ("end_turn" if c.finish_reason == "stop" else "max_tokens"), None


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call_id: str, call: Call, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_id(call_id), "name": call.name, "input": arguments}


def content_blocks(reader: ReplyParser) -> list[dict[str, Any]]:
    """A whole reply's content: its thinking, its text (also an empty one
    when it made no call), its tool calls."""
    blocks: list[dict[str, Any]] = []
    if reader.reasoning:
        blocks.append({"type": "thinking", "thinking": reader.reasoning, "signature": ""})
    if reader.content or not reader.calls:
        blocks.append({"type": "text", "text": reader.content})
    return blocks + [tool_use_block(cid, call, json.loads(call.arguments)) for _, cid, call in reader.calls]


class MessageStream(ReplyEvents):
    """One reply of the Messages API on the wire: its events as it streams
    (one method per event, as :class:`~infer.serve.choice.ReplyEvents`), or
    the whole message (:meth:`whole`). Its fields: the kind of the content
    block being streamed (None when none is open) and that block's index."""

    def __init__(self, choice: Choice, model: str, prompt_tokens: int) -> None:
        super().__init__(choice)
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex[:24]}", model, prompt_tokens
        self.kind: str | None = None
        self.index = -1

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                output: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": self.usage(output)}

    def usage(self, output: int) -> dict[str, int]:
        """Anthropic's usage: ``input_tokens`` are the prompt tokens computed,
        ``cache_read_input_tokens`` those the prefix cache held (their sum is
        the prompt; before admission nothing is known to be cached)."""
        cached = self.choice.cached_tokens
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output}

    def _close(self) -> Events:
        out: Events = []
        if self.kind == "reasoning":  # a thinking block ends with its signature (empty: nothing signs it here)
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        if self.kind is not None:
            out.append({"type": "content_block_stop", "index": self.index})
            self.kind = None
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> Events:
        out = self._close()
        self.kind, self.index = kind, self.index + 1
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, kind: str, empty: dict[str, Any], delta: dict[str, Any]) -> Events:
        out = self._open(kind, empty) if self.kind != kind else []
        return [*out, {"type": "content_block_delta", "index": self.index, "delta": delta}]

    def start(self) -> Events:
        return [{"type": "message_start", "message": self.message([], (None, None), 0)}]

    def text(self, text: str) -> Events:
        return self._delta("content", {"type": "text", "text": ""}, {"type": "text_delta", "text": text})

    def reasoning(self, text: str) -> Events:
        return self._delta("reasoning", {"type": "thinking", "thinking": "", "signature": ""},
                           {"type": "thinking_delta", "thinking": text})

    def tool_call(self, index: int, call_id: str, call: Call) -> Events:
        out = self._open("tool_call", tool_use_block(call_id, call, {}))
        out.append({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return out + self._close()

    def finish(self) -> Events:
        # Nothing was said: an empty text block, as Anthropic sends.
        out = self._open("content", {"type": "text", "text": ""}) if self.index < 0 else []
        out += self._close()
        reason, sequence = stop_reason(self.choice)
        usage = self.usage(self.choice.tokens)
        # message_start went out before admission: a cache hit is told here, with the input it changes.
        delta = {"output_tokens": usage["output_tokens"]} if not usage["cache_read_input_tokens"] else usage
        return [*out, {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": delta}, {"type": "message_stop"}]

    def error(self, err: BaseException) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "api_error", "message": str(err)}}

    def whole(self) -> dict[str, Any]:
        """The message of a reply that is not streamed (its reader has read all of it)."""
        return self.message(content_blocks(self.choice.reply), stop_reason(self.choice), self.choice.tokens)


async def messages(server: ServerLike, request: Request) -> Response:
    """``POST /v1/messages``."""
    body: MessagesRequest = parse(MessagesRequest, await server.read_body(request))
    server.check_model(body.model)
    generation = server.build_request(**request_options(body))
    plan = await server.chat_plan(conversation(body), generation, param="output_config")
    (choice,) = await server.start_chat(plan)
    stream = MessageStream(choice, server.name, len(plan.prompt_ids))
    return await server.respond(request, stream, "messages", body.stream)


async def count_tokens(server: ServerLike, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as the template renders it."""
    body: _Counted = parse(_Counted, await server.read_body(request))
    server.check_model(body.model)
    generation = server.build_request(**chat_options(body))
    plan = await server.chat_plan(conversation(body), generation)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})
