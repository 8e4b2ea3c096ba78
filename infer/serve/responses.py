"""OpenAI's Responses API: ``POST /v1/responses``, stateless.

What agents built on the Responses API send: ``input`` as a string or as
items (messages, ``function_call`` and ``function_call_output`` items, the
reasoning items of earlier turns), ``instructions``, ``max_output_tokens``,
``temperature``/``top_p``, function ``tools`` and ``tool_choice``, and
``text.format`` for structured output. The input becomes the conversation
the chat template reads and runs as a chat completion does, so greedy output
is :meth:`infer.Model.chat`'s. The reply's ``output`` is a ``reasoning``
item (a reasoning model's thinking), a ``message`` with ``output_text`` and
``function_call`` items; a stream is the named events the openai client
reads (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
..., ``response.completed``, whose response's ``status`` may be
``"incomplete"``), each with its ``sequence_number``. :class:`ResponseStream`
makes both, one method per event of the reply; the items are pure builders
(:func:`message_item`, :func:`call_item`, :func:`reasoning_item`).

Nothing is stored (``store`` is false; ``store: true`` and
``previous_response_id`` are refused by name), and anything else the server
does not implement is a 400 naming it.
"""

from __future__ import annotations

import time
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
    LlamaSamplers, ServerLike, _Body, check_tools, joined_text, parse, response_schema, tool_choice,
)
from infer.tokenizer import Tokenizer
from infer.tool_parsers import Call


class ResponsesRequest(LlamaSamplers):
    """The body of ``POST /v1/responses`` (llama.cpp's samplers as extra fields)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    # Beyond OpenAI (vLLM): a cap on the reasoning's tokens.
    top_k: int | None = Field(None, ge=0)
    thinking_budget: int | None = Field(None, ge=0)


def _text(content: Any, where: str) -> str:
    """A content part list's (or a string's) text; any part but text is a 400 naming it."""
    return joined_text(content, where, "content parts", ("input_text", "output_text", "text"),
                       lambda j, kind: RequestError(f"{where}[{j}] is of type {kind!r}; this server takes text only",
                                                    f"{where}[{j}]"))


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's text, or its text and ``input_image`` parts (:func:`infer.serve.media.content`)."""
    return media.content(content, where, ("input_text", "output_text", "text"), lambda j, kind: RequestError(
        f"{where}[{j}] is of type {kind!r}; this server takes input_text, output_text and input_image parts",
        f"{where}[{j}]"), part_param=True)


def conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as the OpenAI-shaped messages chat templates read."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input must not be empty", "input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer", where)
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise RequestError(f"{where} (a function_call) needs a name and its arguments as JSON text", where)
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if not out or out[-1]["role"] != "assistant" or "tool_calls" not in out[-1] and out[-1]["content"]:
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(output if output is not None else "", f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: templates drop it from the history anyway
        else:
            raise RequestError(f"{where} is of type {kind!r}; this server takes message, function_call, "
                               "function_call_output and reasoning items", where)
    return out


def chat_options(body: ResponsesRequest) -> dict[str, Any]:
    """Tools, tool choice, output format and reasoning of ``body`` as
    :class:`~infer.request.GenerationRequest` options."""
    if body.store:
        raise RequestError("store: true is not supported: this server keeps no responses (send store: false, "
                           "and the whole conversation as input)", "store")
    out: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise RequestError(f"tools[{i}] is of type {kind!r}; this server runs function tools only", "tools")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        out["tools"] = check_tools(tools, "tools")
    choice = body.tool_choice
    if isinstance(choice, dict) and "function" not in choice:
        choice = {"type": choice.get("type"), "function": {"name": choice.get("name")}}
    out["tool_choice"] = tool_choice(choice)
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    text = body.text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise RequestError(f"text.{unknown[0]} is not supported", "text")
    out["json_schema"] = response_schema(text.get("format"), "text.format")
    reasoning = body.reasoning or {}
    if set(reasoning) - {"effort", "summary"}:
        raise RequestError(f"reasoning.{sorted(set(reasoning) - {'effort', 'summary'})[0]} is not supported",
                           "reasoning")
    effort = reasoning.get("effort")
    if effort is not None:
        if effort == "none":
            out["enable_thinking"] = False
        else:
            out["reasoning_effort"] = effort
    out["thinking_budget"] = body.thinking_budget
    return out


def request_options(body: ResponsesRequest) -> dict[str, Any]:
    """Every :class:`~infer.request.GenerationRequest` option of ``body``."""
    return dict(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                **body.sampler_options(), **chat_options(body))


def new_id(prefix: str) -> str:
    """An output item's id: ``rs_`` (reasoning), ``msg_`` (message), ``fc_`` (function call)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(reader: ReplyParser, status: str) -> list[dict[str, Any]]:
    """A whole reply's output: its reasoning, its message (also an empty one
    when it made no call), its function calls."""
    output: list[dict[str, Any]] = []
    if reader.reasoning:
        output.append(reasoning_item(new_id("rs"), reader.reasoning, "completed"))
    if reader.content or not reader.calls:
        output.append(message_item(new_id("msg"), reader.content, status))
    return output + [call_item(new_id("fc"), cid, call.name, call.arguments, "completed")
                     for _, cid, call in reader.calls]


class ResponseStream(ReplyEvents):
    """One reply of the Responses API on the wire: its events as it streams
    (one method per event, as :class:`~infer.serve.choice.ReplyEvents`), or
    the whole response (:meth:`whole`). Its fields: the next event's
    ``sequence_number``, the output items finished so far, and the item
    being streamed (its kind, None when none is open; its id and text)."""

    def __init__(self, choice: Choice, body: ResponsesRequest, model: str, prompt_tokens: int,
                 tokenizer: Tokenizer) -> None:
        super().__init__(choice)
        self.body, self.model, self.prompt_tokens, self.tokenizer = body, model, prompt_tokens, tokenizer
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.sequence = 0
        self.done: list[dict[str, Any]] = []
        self.kind: str | None = None
        self.item_id = ""
        self.item_text = ""

    def usage(self) -> dict[str, Any]:
        reasoning = self.choice.reply.reasoning
        tokens = self.choice.tokens
        thought = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        cached = self.choice.cached_tokens
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": tokens, "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": self.prompt_tokens + tokens}

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The response object, ``status`` ``"in_progress"``, ``"completed"`` or ``"incomplete"``."""
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "store": False,
                "metadata": body.metadata or {}, "error": None, "truncation": "disabled",
                "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": self.usage() if status != "in_progress" else None}

    def status(self) -> str:
        """``"incomplete"`` when the length cut the reply short (a reply that made its calls is complete)."""
        return "incomplete" if self.choice.finish_reason == "length" and not self.choice.reply.calls else "completed"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _close(self) -> Events:
        """The events that finish the item being streamed, if any."""
        if self.kind is None:
            return []
        index, item_id, text = len(self.done), self.item_id, self.item_text
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        part: dict[str, Any]
        if self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = [self._event("response.reasoning_text.done", **at, text=text)]
            item = reasoning_item(item_id, text, "completed")
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [self._event("response.output_text.done", **at, text=text, logprobs=[])]
            item = message_item(item_id, text, "completed")
        out.append(self._event("response.content_part.done", **at, part=part))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.done.append(item)
        self.kind = None
        return out

    def _open(self, kind: str) -> Events:
        """The events that open a reasoning item or a message (``kind`` ``"content"``)."""
        out = self._close()
        self.kind, self.item_id, self.item_text = kind, new_id("rs" if kind == "reasoning" else "msg"), ""
        index = len(self.done)
        if kind == "reasoning":
            item = reasoning_item(self.item_id, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(self.item_id, None, "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        out.append(self._event("response.content_part.added", item_id=self.item_id, output_index=index,
                               content_index=0, part=part))
        return out

    def _delta(self, kind: str, text: str, event: str, **extra: Any) -> Events:
        out = self._open(kind) if self.kind != kind else []
        self.item_text += text
        out.append(self._event(event, item_id=self.item_id, output_index=len(self.done), content_index=0,
                               delta=text, **extra))
        return out

    def start(self) -> Events:
        return [self._event("response.created", response=self.response("in_progress", [])),
                self._event("response.in_progress", response=self.response("in_progress", []))]

    def text(self, text: str) -> Events:
        return self._delta("content", text, "response.output_text.delta", logprobs=[])

    def reasoning(self, text: str) -> Events:
        return self._delta("reasoning", text, "response.reasoning_text.delta")

    def tool_call(self, index: int, call_id: str, call: Call) -> Events:
        out = self._close()
        item_id, at = new_id("fc"), len(self.done)
        item = call_item(item_id, call_id, call.name, call.arguments, "completed")
        out += [self._event("response.output_item.added", output_index=at,
                            item=call_item(item_id, call_id, call.name, "", "in_progress")),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                            name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=at, item=item)]
        self.done.append(item)
        return out

    def finish(self) -> Events:
        # Nothing was said: an empty message, as OpenAI sends.
        out = self._open("content") if not self.done and self.kind is None else []
        out += self._close()
        # Always response.completed, its response's status saying "incomplete" where it is: the
        # openai client's stream helper ends on that event alone (as vLLM sends it).
        return [*out, self._event("response.completed", response=self.response(self.status(), self.done))]

    def error(self, err: BaseException) -> dict[str, Any]:
        return {"type": "error", "code": "server_error", "message": str(err), "param": None, "sequence_number": 0}

    def whole(self) -> dict[str, Any]:
        """The response of a reply that is not streamed (its reader has read all of it)."""
        status = self.status()
        return self.response(status, output_items(self.choice.reply, status))


async def responses(server: ServerLike, request: Request) -> Response:
    """``POST /v1/responses``."""
    body: ResponsesRequest = parse(ResponsesRequest, await server.read_body(request))
    server.check_model(body.model)
    generation = server.build_request(**request_options(body))
    plan = await server.chat_plan(conversation(body), generation, param="text.format")
    (choice,) = await server.start_chat(plan)
    stream = ResponseStream(choice, body, server.name, len(plan.prompt_ids), server.model.tokenizer)
    return await server.respond(request, stream, "responses", body.stream)
