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
``"incomplete"``), each with its ``sequence_number``.

Nothing is stored (``store`` is false; ``store: true`` and
``previous_response_id`` are refused by name), and anything else the server
does not implement is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.chat import Delta
from infer.errors import RequestError
from infer.serve.protocol import _Body, check_tools, parse, response_schema, tool_choice

# The server and its choices (infer.serve.app.Server, .Choice) are typed Any here: app imports this module.
Server = Any
Choice = Any


class ResponsesRequest(_Body):
    """The body of ``POST /v1/responses``."""

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


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}] is of type {kind!r}; this server takes text only", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


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
                        "content": _text_of(item.get("content", ""), f"{where}.content")})
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
                        "content": _text_of(output if output is not None else "", f"{where}.output")})
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


async def responses(server: Server, request: Request) -> Response:
    """``POST /v1/responses``."""
    body: ResponsesRequest = parse(ResponsesRequest, await server.read_body(request))
    server.check_model(body.model)
    generation = server.build_request(max_tokens=body.max_output_tokens, temperature=body.temperature,
                                      top_p=body.top_p, top_k=body.top_k, **chat_options(body))
    plan = await server.chat_plan(conversation(body), generation, param="text.format")
    (choice,) = await server.start_chat(plan)
    prompt = len(plan.prompt_ids)
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    fmt = (body.text or {}).get("format") or {"type": "text"}

    def response(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        done = status != "in_progress"
        reasoning = choice.reader.reasoning if choice.reader is not None else ""
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": choice.tokens,
                 "output_tokens_details": {"reasoning_tokens": len(server.model.tokenizer.encode(
                     reasoning, add_special_tokens=False)) if reasoning else 0},
                 "total_tokens": prompt + choice.tokens}
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": server.name,
                "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "text": {"format": fmt}, "store": False,
                "metadata": body.metadata or {}, "error": None, "truncation": "disabled",
                "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage if done else None}

    def status() -> str:
        calls = choice.reader is not None and choice.reader.calls
        return "incomplete" if choice.finish_reason == "length" and not calls else "completed"

    def reasoning_item(item_id: str, text: str, state: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": item_id, "summary": [], "status": state,
                "content": [{"type": "reasoning_text", "text": text}] if text or state == "completed" else []}

    def message_item(item_id: str, text: str | None, state: str) -> dict[str, Any]:
        parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": state, "role": "assistant", "content": parts}

    def call_item(item_id: str, call_id: str, name: str, arguments: str, state: str) -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": state}

    def new_id(prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex[:24]}"

    if not body.stream:
        await server.run_all(request, [choice], "responses")
        reader = choice.reader
        assert reader is not None
        reader.feed(choice.output)
        reader.finish()
        state = status()
        output: list[dict[str, Any]] = []
        if reader.reasoning:
            output.append(reasoning_item(new_id("rs"), reader.reasoning, "completed"))
        text = reader.content
        if text or not reader.calls:
            output.append(message_item(new_id("msg"), text, state))
        output += [call_item(new_id("fc"), cid, call.name, call.arguments, "completed")
                   for _, cid, call in reader.calls]
        return JSONResponse(response(state, output))

    async def events(emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        sequence = [0]
        done: list[dict[str, Any]] = []  # the output items finished so far
        current: dict[str, Any] = {}  # the item being streamed: kind, id, text

        async def send(kind: str, **fields: Any) -> None:
            await emit({"type": kind, "sequence_number": sequence[0], **fields})
            sequence[0] += 1

        async def close() -> None:
            if not current:
                return
            index, item_id, text = len(done), current["id"], current["text"]
            if current["kind"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                await send("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text)
                item = reasoning_item(item_id, text, "completed")
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                await send("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[])
                item = message_item(item_id, text, "completed")
            await send("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
            await send("response.output_item.done", output_index=index, item=item)
            done.append(item)
            current.clear()

        async def open_item(kind: str) -> None:
            await close()
            item_id = new_id("rs" if kind == "reasoning" else "msg")
            current.update(kind=kind, id=item_id, text="")
            index = len(done)
            if kind == "reasoning":
                await send("response.output_item.added", output_index=index, item=reasoning_item(item_id, "",
                                                                                                  "in_progress"))
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                await send("response.output_item.added", output_index=index, item=message_item(item_id, None,
                                                                                                "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            await send("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)

        async def delta(c: Choice, d: Delta) -> None:
            if d.kind == "tool_call":
                assert d.call is not None
                await close()
                item_id, index = new_id("fc"), len(done)
                await send("response.output_item.added", output_index=index,
                           item=call_item(item_id, d.call_id, d.call.name, "", "in_progress"))
                await send("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                           delta=d.call.arguments)
                await send("response.function_call_arguments.done", item_id=item_id, output_index=index,
                           name=d.call.name, arguments=d.call.arguments)
                item = call_item(item_id, d.call_id, d.call.name, d.call.arguments, "completed")
                await send("response.output_item.done", output_index=index, item=item)
                done.append(item)
                return
            if current.get("kind") != d.kind:
                await open_item(d.kind)
            current["text"] += d.text
            kind = "response.reasoning_text.delta" if d.kind == "reasoning" else "response.output_text.delta"
            extra = {} if d.kind == "reasoning" else {"logprobs": []}
            await send(kind, item_id=current["id"], output_index=len(done), content_index=0, delta=d.text, **extra)

        await send("response.created", response=response("in_progress", []))
        await send("response.in_progress", response=response("in_progress", []))
        await server.run_deltas(choice, delta)
        if not done and not current:  # nothing was said: an empty message, as OpenAI sends
            await open_item("content")
        await close()
        # Always response.completed, its response's status saying "incomplete" where it is: the
        # openai client's stream helper ends on that event alone (as vLLM sends it).
        await send("response.completed", response=response(status(), done))

    def failure(err: BaseException) -> dict[str, Any]:
        return {"type": "error", "code": "server_error", "message": str(err), "param": None, "sequence_number": 0}

    return server.sse(events, [choice], "responses", named=True, failure=failure)
