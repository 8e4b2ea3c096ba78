"""OpenAI's two generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

A handler validates the body (:mod:`infer.serve.protocol`), makes its
:class:`~infer.request.GenerationRequest`, submits one request per choice
through the server (:class:`~infer.serve.protocol.ServerLike`), and hands
each choice to its stream state: :class:`CompletionStream` (text and
log-probabilities) or :class:`ChatStream` (text, reasoning and tool calls),
which makes OpenAI's item of a whole reply or its stream of ``data:``
chunks (ending in ``[DONE]``). What every body of one reply repeats is a
:class:`Reply`.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.engine.sampling import TokenLogprob
from infer.errors import RequestError, StructuredOutputError
from infer.request import PreparedRequest
from infer.serve.choice import Choice, Emit, Events, ReplyEvents
from infer.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from infer.serve.protocol import ChatRequest, CompletionRequest, ServerLike, parse, response_schema
from infer.tokenizer import Tokenizer
from infer.tool_parsers import Call

#: OpenAI's default ``max_tokens`` of the completions endpoint.
COMPLETIONS_MAX_TOKENS = 16

#: ``(token, its log-probability)`` pairs; a prompt's first token has none.
Entries = list[tuple[int, TokenLogprob | None]]


@dataclass(frozen=True)
class Reply:
    """What every body of one OpenAI reply repeats: its id, its time and the model's name."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Reply:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def body(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A body of ``kind`` (``"text_completion"``, ``"chat.completion"``, ``"chat.completion.chunk"``)."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def openai_error(err: BaseException) -> dict[str, Any]:
    """OpenAI's body of a failure in the middle of a stream."""
    return {"error": {"message": str(err), "type": "server_error", "param": None, "code": None}}


# -- /v1/completions ----------------------------------------------------------------------------------


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer, vocab: int) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids and their texts; a token id outside the vocabulary is a 400."""
    given = body.prompts()
    for i, p in enumerate(given):
        if isinstance(p, list) and not all(0 <= t < vocab for t in p):
            bad = next(t for t in p if not 0 <= t < vocab)
            raise RequestError(f"prompt {i} has token id {bad}, but the vocabulary has {vocab} ids "
                               f"(0..{vocab - 1})", "prompt")
    prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in given]
    texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in given]
    return prompts, texts


async def completion_request(server: ServerLike, body: CompletionRequest,
                             prompts: list[list[int]]) -> PreparedRequest:
    """The prepared request of ``body``; a prompt too long for the context fails here, before any work."""
    max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    schema = response_schema(body.response_format, "response_format")
    try:
        generation = server.sampling_request(body, max_tokens=max_tokens, logprobs=body.logprobs, json_schema=schema)
        prepared = await server.prepare(generation)
    except StructuredOutputError as err:
        raise RequestError(str(err), "response_format") from None
    for p in prompts:
        prepared.stop_conditions(len(p))
    return prepared


async def echoed_logprobs(server: ServerLike, body: CompletionRequest, prompts: list[list[int]]) -> list[Entries]:
    """Each prompt's own log-probabilities when ``echo`` asks for them
    (scored on the engine thread, between two steps); else none."""
    if not body.echo or body.logprobs is None:
        return [[] for _ in prompts]
    engine, k = server.model.engine, body.logprobs
    return [list(zip(prompt, await server.loop.call(functools.partial(prompt_logprobs, engine, prompt, k))))
            for prompt in prompts]


def completion_choice(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class CompletionStream:
    """One choice of a completion on the wire: its chunks as it streams
    (:meth:`start`, :meth:`text` per piece, :meth:`finish`), or its item of
    the whole reply (:meth:`whole`). :attr:`offset` is where its next text
    starts, as ``logprobs.text_offset`` counts (from the prompt's start)."""

    def __init__(self, reply: Reply, choice: Choice, prompt: str, echoed: Entries | None,
                 tokenizer: Tokenizer, k: int | None) -> None:
        self.reply, self.choice, self.prompt, self.echoed = reply, choice, prompt, echoed
        self.tokenizer, self.k = tokenizer, k
        self.offset = 0 if echoed is not None else len(prompt)

    def _logprobs(self, entries: Entries, offset: int) -> Any:
        return None if self.k is None else completion_logprobs(self.tokenizer, entries, offset)

    def _generated(self) -> Entries:
        return [(e.token, e) for e in self.choice.new_logprobs()]

    def _chunk(self, text: str, finish: str | None, entries: Entries) -> dict[str, Any]:
        logprobs = self._logprobs(entries, self.offset)
        self.offset += len(text)
        return self.reply.body("text_completion", [completion_choice(self.choice.index, text, logprobs, finish)])

    def start(self) -> Events:
        """The prompt, when ``echo`` asks for it back."""
        return [] if self.echoed is None else [self._chunk(self.prompt, None, self.echoed)]

    def text(self, piece: str) -> dict[str, Any]:
        return self._chunk(piece, None, self._generated())

    def finish(self) -> dict[str, Any]:
        return self._chunk("", self.choice.finish_reason, self._generated())

    def whole(self) -> dict[str, Any]:
        """The choice's item of a reply that is not streamed."""
        head, entries = ("", []) if self.echoed is None else (self.prompt, self.echoed)
        return completion_choice(self.choice.index, head + self.choice.output,
                                 self._logprobs(entries + self._generated(), self.offset), self.choice.finish_reason)


async def completions(server: ServerLike, request: Request) -> Response:
    """``POST /v1/completions``."""
    body: CompletionRequest = parse(CompletionRequest, await server.read_body(request))
    server.check_model(body.model)
    if body.best_of not in (None, 1):
        raise server.unsupported("best_of", "generate n choices instead")
    if body.suffix is not None:
        raise server.unsupported("suffix", "no model infer runs is trained to fill in the middle here")
    tokenizer = server.model.tokenizer
    prompts, texts = completion_prompts(body, tokenizer, server.model.network.vocab_size)
    prepared = await completion_request(server, body, prompts)
    echoed = await echoed_logprobs(server, body, prompts)
    choices = await server.start(prepared, prompts, body.n)
    reply = Reply.new("cmpl", server.name)
    streams = [CompletionStream(reply, c, texts[c.index // body.n], echoed[c.index // body.n] if body.echo else None,
                                tokenizer, body.logprobs) for c in choices]
    if not body.stream:
        await server.run_all(request, choices, "completions")
        return JSONResponse(reply.body("text_completion", [s.whole() for s in streams],
                                       usage=server.usage(prompts, choices)))

    async def one(s: CompletionStream, emit: Emit) -> None:
        for chunk in s.start():
            await emit(chunk)
        await s.choice.run(server.loop, lambda c, piece: emit(s.text(piece)))
        await emit(s.finish())

    async def events(emit: Emit) -> None:
        await asyncio.gather(*(one(s, emit) for s in streams))
        if body.stream_options is not None and body.stream_options.include_usage:
            await emit(reply.body("text_completion", [], usage=server.usage(prompts, choices)))

    return server.sse(events, choices, "completions", failure=openai_error)


# -- /v1/chat/completions ---------------------------------------------------------------------------


def chat_generation_options(body: ChatRequest) -> dict[str, Any]:
    """``body``'s :class:`~infer.request.GenerationRequest` options beyond its sampling ones."""
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return {"max_tokens": requested, "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
            **body.chat_options()}


class ChatStream(ReplyEvents):
    """One choice of a chat completion on the wire: its chunks as it
    streams (one method per event, as :class:`~infer.serve.choice.ReplyEvents`),
    or its item of the whole reply (:meth:`whole`). It sends what it is
    given as it is given, so it keeps no more than its choice."""

    def __init__(self, reply: Reply, choice: Choice, tokenizer: Tokenizer, k: int | None) -> None:
        super().__init__(choice)
        self.reply, self.tokenizer, self.k = reply, tokenizer, k

    def _logprobs(self) -> Any:
        """The tokens' log-probabilities since the last call (OpenAI's ``logprobs``), or None without ``logprobs``."""
        return None if self.k is None else {"content": chat_logprobs(self.tokenizer, self.choice.new_logprobs())}

    def _finish_reason(self) -> str | None:
        return "tool_calls" if self.choice.reply.calls else self.choice.finish_reason

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        item = {"index": self.choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.reply.body("chat.completion.chunk", [item])

    def start(self) -> Events:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, text: str) -> Events:
        return [self._chunk({"content": text}, None, self._logprobs())]

    def reasoning(self, text: str) -> Events:
        return [self._chunk({"reasoning_content": text}, None, self._logprobs())]

    def tool_call(self, index: int, call_id: str, call: Call) -> Events:
        # The head (id and name) first, then the arguments: the shape OpenAI streams a call in.
        head = {"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        arguments = {"index": index, "function": {"arguments": call.arguments}}
        return [self._chunk({"tool_calls": [head]}), self._chunk({"tool_calls": [arguments]}, None, self._logprobs())]

    def finish(self) -> Events:
        return [self._chunk({}, self._finish_reason(), self._logprobs())]

    def error(self, err: BaseException) -> dict[str, Any]:
        return openai_error(err)

    def whole(self) -> dict[str, Any]:
        """The choice's item of a reply that is not streamed (its reader has read all of it)."""
        reader = self.choice.reply
        message: dict[str, Any] = {"role": "assistant", "content": reader.content}
        if reader.reasoning:
            message["reasoning_content"] = reader.reasoning
        if reader.calls:
            message["content"] = reader.content or None
            message["tool_calls"] = reader.openai_calls()
        return {"index": self.choice.index, "message": message, "logprobs": self._logprobs(),
                "finish_reason": self._finish_reason()}


async def chat_completions(server: ServerLike, request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    body: ChatRequest = parse(ChatRequest, await server.read_body(request))
    server.check_model(body.model)
    options = chat_generation_options(body)
    plan = await server.chat_plan(body.conversation(), server.sampling_request(body, **options))
    choices = await server.start_chat(plan, body.n)
    prompts = [plan.prompt_ids]
    reply = Reply.new("chatcmpl", server.name)
    streams = [ChatStream(reply, c, server.model.tokenizer, options["logprobs"]) for c in choices]
    if not body.stream:
        await server.run_replies(request, choices, "chat")
        return JSONResponse(reply.body("chat.completion", [s.whole() for s in streams],
                                       usage=server.usage(prompts, choices)))

    async def events(emit: Emit) -> None:
        await asyncio.gather(*(server.stream_reply(s, emit) for s in streams))
        if body.stream_options is not None and body.stream_options.include_usage:
            await emit(reply.body("chat.completion.chunk", [], usage=server.usage(prompts, choices)))

    return server.sse(events, choices, "chat", failure=openai_error)
