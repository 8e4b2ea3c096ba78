"""OpenAI's two generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

A handler validates the body (:mod:`infer.serve.protocol`), makes its
:class:`~infer.request.GenerationRequest`, submits one request per choice
through the :class:`~infer.serve.app.Server`, and turns the tokens that come
back into text, reasoning and tool calls, then OpenAI's response or its
stream of ``data:`` chunks ending in ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.chat import Delta
from infer.engine.sampling import TokenLogprob
from infer.errors import RequestError, StructuredOutputError
from infer.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from infer.serve.protocol import ChatRequest, CompletionRequest, parse, response_schema

# The server and its choices (infer.serve.app.Server, .Choice) are typed Any here: app imports this module.
Server = Any
Choice = Any

#: OpenAI's default ``max_tokens`` of the completions endpoint.
COMPLETIONS_MAX_TOKENS = 16


async def completions(server: Server, request: Request) -> Response:
    """``POST /v1/completions``."""
    body: CompletionRequest = parse(CompletionRequest, await server.read_body(request))
    server.check_model(body.model)
    if body.best_of not in (None, 1):
        raise server.unsupported("best_of", "generate n choices instead")
    if body.suffix is not None:
        raise server.unsupported("suffix", "no model infer runs is trained to fill in the middle here")
    tokenizer = server.model.tokenizer
    given = body.prompts()
    vocab = server.model.network.vocab_size
    for i, p in enumerate(given):
        if isinstance(p, list) and not all(0 <= t < vocab for t in p):
            bad = next(t for t in p if not 0 <= t < vocab)
            raise RequestError(f"prompt {i} has token id {bad}, but the vocabulary has {vocab} ids "
                               f"(0..{vocab - 1})", "prompt")
    prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in given]
    texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in given]
    k = body.logprobs
    max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    schema = response_schema(body.response_format, "response_format")
    try:
        generation = server.sampling_request(body, max_tokens=max_tokens, logprobs=k, json_schema=schema)
        prepared = await server.prepare(generation)
    except StructuredOutputError as err:
        raise RequestError(str(err), "response_format") from None
    for p in prompts:
        prepared.stop_conditions(len(p))  # a prompt too long for the context fails before any work
    echoed: list[list[tuple[int, TokenLogprob | None]]] = [[] for _ in prompts]
    if body.echo and k is not None:  # the prompt's own log-probabilities, between two steps
        engine = server.model.engine
        for i, prompt in enumerate(prompts):
            scored = await server.loop.call(functools.partial(prompt_logprobs, engine, prompt, k))
            echoed[i] = list(zip(prompt, scored))
    choices = await server.start(prepared, prompts, body.n)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def source(c: Choice) -> int:  # the prompt a choice continues
        return c.index // body.n

    def logprobs(c: Choice, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> Any:
        return None if k is None else completion_logprobs(tokenizer, entries, offset)

    def generated(c: Choice, entries: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
        return [(e.token, e) for e in entries]

    def chunk(c: Choice | None, text: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": server.name,
                               "choices": []}
        if c is not None:
            out["choices"] = [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}]
        return out

    if not body.stream:
        await server.run_all(request, choices, "completions")
        out = []
        for c in choices:
            head = texts[source(c)] if body.echo else ""
            entries = (echoed[source(c)] if body.echo else []) + generated(c, c.new_logprobs())
            offset = 0 if body.echo else len(texts[source(c)])
            out.append({"index": c.index, "text": head + c.output, "logprobs": logprobs(c, entries, offset),
                        "finish_reason": c.finish_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": server.name,
                             "choices": out, "usage": server.usage(prompts, choices)})

    async def events(emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        offsets = {c.index: 0 if body.echo else len(texts[source(c)]) for c in choices}

        async def send(c: Choice, text: str, finish: str | None,
                       entries: list[tuple[int, TokenLogprob | None]]) -> None:
            lp = logprobs(c, entries, offsets[c.index])
            offsets[c.index] += len(text)
            await emit(chunk(c, text, finish, lp))

        async def piece(c: Choice, text: str) -> None:
            await send(c, text, None, generated(c, c.new_logprobs()))

        async def one(c: Choice) -> None:
            if body.echo:
                await send(c, texts[source(c)], None, echoed[source(c)])
            await c.run(server.loop, piece)
            await send(c, "", c.finish_reason, generated(c, c.new_logprobs()))

        await asyncio.gather(*(one(c) for c in choices))
        if body.stream_options is not None and body.stream_options.include_usage:
            await emit({**chunk(None, "", None), "usage": server.usage(prompts, choices)})

    return server.sse(events, choices, "completions")


async def chat_completions(server: Server, request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    body: ChatRequest = parse(ChatRequest, await server.read_body(request))
    server.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    k = (body.top_logprobs or 0) if body.logprobs else None
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    options = body.chat_options()
    generation = server.sampling_request(body, max_tokens=requested, logprobs=k, **options)
    plan = await server.chat_plan(body.conversation(), generation)
    choices = await server.start_chat(plan, body.n)
    prompt = plan.prompt_ids
    tokenizer = server.model.tokenizer

    def logprobs(c: Choice) -> Any:
        return None if k is None else {"content": chat_logprobs(tokenizer, c.new_logprobs())}
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if not body.stream:
        await server.run_all(request, choices, "chat")
        out = []
        for c in choices:
            reader = c.reader
            assert reader is not None
            reader.feed(c.output)
            reader.finish()
            message: dict[str, Any] = {"role": "assistant", "content": reader.content}
            if reader.reasoning:
                message["reasoning_content"] = reader.reasoning
            finish = c.finish_reason
            if reader.calls:
                message["content"] = reader.content or None
                message["tool_calls"] = reader.openai_calls()
                finish = "tool_calls"
            out.append({"index": c.index, "message": message, "logprobs": logprobs(c), "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": server.name,
                             "choices": out, "usage": server.usage([prompt], choices)})

    def chunk(index: int | None, delta: dict[str, Any], finish: str | None, lp: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": server.name, "choices": []}
        if index is not None:
            out["choices"] = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]
        return out

    async def events(emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        async def delta(c: Choice, d: Delta) -> None:
            if d.kind == "tool_call":
                assert d.call is not None
                head = {"index": d.index, "id": d.call_id, "type": "function",
                        "function": {"name": d.call.name, "arguments": ""}}
                await emit(chunk(c.index, {"tool_calls": [head]}, None))
                args = {"index": d.index, "function": {"arguments": d.call.arguments}}
                await emit(chunk(c.index, {"tool_calls": [args]}, None, logprobs(c)))
            else:
                field = "reasoning_content" if d.kind == "reasoning" else "content"
                await emit(chunk(c.index, {field: d.text}, None, logprobs(c)))

        async def one(c: Choice) -> None:
            await emit(chunk(c.index, {"role": "assistant", "content": ""}, None))
            await server.run_deltas(c, delta)
            finish = "tool_calls" if c.reader is not None and c.reader.calls else c.finish_reason
            await emit(chunk(c.index, {}, finish, logprobs(c)))

        await asyncio.gather(*(one(c) for c in choices))
        if body.stream_options is not None and body.stream_options.include_usage:
            await emit({**chunk(None, {}, None), "usage": server.usage([prompt], choices)})

    return server.sse(events, choices, "chat")
