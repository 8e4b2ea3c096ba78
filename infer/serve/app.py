"""The ASGI app: every endpoint over one batch engine.

:class:`Server` is what the endpoints share (what they use of it is
:class:`~infer.serve.protocol.ServerLike`): it checks the model id, reads a
body within its limits, makes the :class:`~infer.request.GenerationRequest`
and the chat plan (:meth:`infer.Model.plan_chat`), submits one request per
choice to the :class:`~infer.serve.loop.EngineLoop`, runs each
:class:`~infer.serve.choice.Choice` (its tokens into text:
:class:`~infer.completion.TextStream`, stop strings; then reasoning and tool
calls: :class:`~infer.chat.ReplyParser`), drives an endpoint's stream state
(:class:`~infer.serve.choice.ReplyEvents`) and streams server-sent events. A
client that goes away cancels its requests. The endpoints themselves are one
module per API: :mod:`infer.serve.completions` (OpenAI's completions and chat
completions), :mod:`infer.serve.responses` (the Responses API),
:mod:`infer.serve.anthropic` (the Messages API) and :mod:`infer.serve.embeddings`
(``/v1/embeddings``, ``/v1/rerank``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infer.chat import ChatPlan
from infer.completion import TextStream
from infer.engine.batch import BatchEngine
from infer.errors import ImageError, InferError, RequestError, SamplingParameterError, StructuredOutputError
from infer.model import Model
from infer.reasoning import get_reasoning_parser
from infer.request import GenerationRequest, PreparedRequest
from infer.serve import anthropic, completions, embeddings, media, responses, slots
from infer.serve.choice import Choice, Emit, ReplyEvents
from infer.serve.http import DEFAULT_BODY_TIMEOUT, Guard, disconnected, http_error, infer_error, read_json
from infer.serve.loop import EngineLoop, TokenStream
from infer.serve.metrics import Metrics
from infer.serve.protocol import _Sampling
from infer.tool_parsers import get_tool_parser

log = logging.getLogger(__name__)

#: Largest request body accepted, in bytes (a 1 MiB prompt is ~250k tokens).
DEFAULT_MAX_BODY_BYTES = 2**20
#: Requests that may wait for admission before new ones get 429.
DEFAULT_MAX_QUEUE = 256


def create_app(
    model: Model, *, model_name: str | None = None, api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    batch_engine: BatchEngine | None = None, reasoning_parser: str | None = None, tool_parser: str | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT, slot_save_path: str | os.PathLike[str] | None = None,
    allowed_media_domains: Sequence[str] = (),
) -> Starlette:
    """The ASGI app serving ``model`` with OpenAI's completions, chat
    completions, Responses and embeddings APIs, Anthropic's Messages API and
    ``/v1/rerank`` (docs/serving.md, docs/embeddings.md).

    Args:
        model: the loaded model; its :attr:`~infer.Model.batch_engine`
            (or ``batch_engine``) runs every request, on a thread the app
            starts with its lifespan.
        model_name: the id clients pass as ``model`` (default: the model
            folder's or file's name); any other id is a 404.
        api_key: when set, every endpoint but ``/health`` needs
            ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_queue: requests that may wait for admission; beyond, 429 with
            ``Retry-After``.
        max_body_bytes: largest request body (413 beyond).
        batch_engine: the batch engine to run (default the model's); no one
            else may use it while the app runs.
        reasoning_parser: how replies' reasoning is told apart
            (:mod:`infer.reasoning`: ``"think"``, ``"harmony"``,
            ``"granite"``, or ``"none"``); default: chosen from the chat template.
        tool_parser: the tool-call format (:mod:`infer.tool_parsers`);
            default: chosen from the chat template.
        body_timeout: seconds a client may take to send its request body
            (408 beyond: a client that sends half a request and goes silent
            holds nothing).
        slot_save_path: the folder of ``POST /slots/{name}``'s saved states
            (:mod:`infer.serve.slots`); None: slots are off (501).
        allowed_media_domains: hosts (and their subdomains) whose ``http(s)``
            image URLs the server fetches; every other remote image is a 400
            (:mod:`infer.serve.media`; images as ``data:`` URLs always work).
    """
    if reasoning_parser not in (None, "none"):
        get_reasoning_parser(reasoning_parser)  # an unknown name fails here, not on the first request
    if tool_parser is not None:
        get_tool_parser(tool_parser)
    server = Server(model, batch_engine or model.batch_engine, model_name or _default_name(model),
                     max_queue=max_queue, max_body_bytes=max_body_bytes, reasoning_parser=reasoning_parser,
                     tool_parser=tool_parser, body_timeout=body_timeout,
                     slot_save_path=None if slot_save_path is None else Path(slot_save_path),
                     allowed_media_domains=tuple(allowed_media_domains))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_card, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/rerank", server.rerank, methods=["POST"]),
        Route("/rerank", server.rerank, methods=["POST"]),
        Route("/v1/reranking", server.rerank, methods=["POST"]),
        Route("/slots/{name:path}", server.slots, methods=["POST"]),
    ]
    handlers: dict[Any, Callable[..., Any]] = {HTTPException: http_error, InferError: infer_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    #: What tests and embedding code reach: the server (its loop, metrics).
    app.state.server = server
    return app


def constrained(request: GenerationRequest) -> bool:
    """Whether ``request`` has a grammar to compile (a constraint, or a forced tool call)."""
    return (request.json_schema is not None or request.regex is not None or request.grammar is not None
            or request.forces_tool_call)


def _param_of(err: Exception) -> str | None:
    """The request parameter a typed error's message begins with (``"tool_choice must ..."``)."""
    head = str(err).split(" ", 1)[0]
    return head if head.isidentifier() else None


def cached_tokens(prompts: list[list[int]], choices: list[Choice]) -> int:
    """Prompt tokens the prefix cache held for ``choices``' requests, each
    prompt counted once (as in ``prompt_tokens``): the least any of its
    choices found (choice ``i`` is of prompt ``i // n``)."""
    n = max(1, len(choices) // max(1, len(prompts)))
    found: dict[int, int] = {}
    for c in choices:
        found[c.index // n] = min(found.get(c.index // n, c.cached_tokens), c.cached_tokens)
    return sum(found.values())


def _default_name(model: Model) -> str:
    path = model.package.path
    return path.name if path is not None else model.model_type


# -- the server -----------------------------------------------------------------------------


class Server:
    """One served model: what every endpoint shares (see the module docs)."""

    def __init__(self, model: Model, batch: BatchEngine, name: str, *, max_queue: int, max_body_bytes: int,
                 reasoning_parser: str | None = None, tool_parser: str | None = None,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, slot_save_path: Path | None = None,
                 allowed_media_domains: tuple[str, ...] = ()) -> None:
        self.model = model
        #: Hosts whose remote image URLs are fetched (:mod:`infer.serve.media`).
        self.allowed_media_domains = allowed_media_domains
        #: The folder of the saved states ``/slots/{name}`` names (None: slots are off).
        self.slot_save_path = slot_save_path
        if slot_save_path is not None:
            slot_save_path.mkdir(parents=True, exist_ok=True)
        self.body_timeout = body_timeout
        #: The server's choice of reasoning parser and tool-call format (None: from the template).
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.name = name
        self.created = int(time.time())
        self.max_body_bytes = max_body_bytes
        self.loop = EngineLoop(batch, max_queue=max_queue, on_tokens=lambda *args: self.metrics.on_tokens(*args))
        self.metrics = Metrics(self.loop)

    # -- small endpoints ---------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        # A load balancer (or Ray Serve's health check) takes a 503 as "route elsewhere, restart me".
        if not self.loop.alive:
            return JSONResponse({"status": "error", "reason": "the engine thread is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def _card(self, request: Request) -> dict[str, Any]:
        if "anthropic-version" in request.headers:  # Anthropic's client lists models in its own shape
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
            return {"type": "model", "id": self.name, "display_name": self.name, "created_at": created}
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "infer",
                "max_model_len": self.model.context_length}

    async def models(self, request: Request) -> Response:
        if "anthropic-version" in request.headers:
            return JSONResponse({"data": [self._card(request)], "has_more": False, "first_id": self.name,
                                 "last_id": self.name})
        return JSONResponse({"object": "list", "data": [self._card(request)]})

    async def model_card(self, request: Request) -> Response:
        self.check_model(request.path_params["name"])
        return JSONResponse(self._card(request))

    async def read_body(self, request: Request) -> Any:
        """The request's JSON body, within the server's size and time limits."""
        return await read_json(request, self.max_body_bytes, self.body_timeout)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise RequestError(f"the model {name!r} does not exist; this server serves {self.name!r}", "model",
                               status=404, code="model_not_found")

    # -- what both generation endpoints share ----------------------------------------------

    def sampling_request(self, body: _Sampling, *, max_tokens: int | None, logprobs: int | None = None,
                 **options: Any) -> GenerationRequest:
        """The :class:`~infer.request.GenerationRequest` of ``body`` (what
        every endpoint submits), with ``options`` (constraints, tools,
        reasoning) beside its sampling parameters."""
        return self.build_request(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            logit_bias=body.bias(self.model.network.vocab_size), stop=body.stops(), ignore_eos=body.ignore_eos,
            logprobs=logprobs, **body.sampler_options(), **options)

    def build_request(self, **fields: Any) -> GenerationRequest:
        """A :class:`~infer.request.GenerationRequest` of ``fields``; a bad
        value is a 400 naming the parameter."""
        try:
            return GenerationRequest(**fields)
        except (SamplingParameterError, StructuredOutputError) as err:
            raise RequestError(str(err), _param_of(err)) from None

    async def start(self, prepared: PreparedRequest, prompts: list[list[int]], n: int = 1,
                     skip_special_tokens: bool = True, media: Any = None) -> list[Choice]:
        """Submit ``n`` requests per prompt, all at once; all or none (a
        refusal cancels those already in)."""
        if getattr(self.model.network, "is_encoder", False):
            raise RequestError(f"{self.name!r} is an embedding model (bidirectional, no next-token head): it "
                               "answers /v1/embeddings and /v1/rerank, not generation", "model")
        jobs = [(prompt, prepared.sampler(j), prepared.stop_conditions(len(prompt)))
                for prompt in prompts for j in range(n)]
        results = await asyncio.gather(*(self.loop.submit(*job, media=media) for job in jobs), return_exceptions=True)
        streams = [r for r in results if isinstance(r, TokenStream)]
        refused = [r for r in results if not isinstance(r, TokenStream)]
        if refused:
            for stream in streams:
                self.loop.cancel(stream)
            raise refused[0]
        stops = prepared.request.stop
        tokenizer = self.model.tokenizer
        hidden = frozenset() if skip_special_tokens else self.model.eos_token_ids
        choices = [Choice(i, stream, TextStream(tokenizer, stops, skip_special_tokens=skip_special_tokens),
                           hidden=hidden) for i, stream in enumerate(streams)]
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return choices

    def usage(self, prompts: list[list[int]], choices: list[Choice]) -> dict[str, Any]:
        """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt
        tokens the prefix cache held (a restored slot, an earlier request)."""
        prompt = sum(len(p) for p in prompts)
        completion = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached_tokens(prompts, choices)}}

    async def run_all(self, request: Request, choices: list[Choice], endpoint: str) -> None:
        """Run every choice to its end; a client that goes away first cancels them."""
        work = asyncio.gather(*(c.run(self.loop) for c in choices))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise asyncio.CancelledError
            work.result()
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                for c in choices:
                    self.loop.cancel(c.stream)
            self._count(endpoint, choices)

    def _count(self, endpoint: str, choices: list[Choice]) -> None:
        for c in choices:
            self.metrics.requests.labels(endpoint, c.finish_reason or "cancelled").inc()

    def unsupported(self, param: str, why: str) -> RequestError:
        return RequestError(f"{param} is not supported by infer's server: {why}", param, code="unsupported_parameter")

    # -- /v1/completions ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await completions.completions(self, request)

    # -- /v1/chat/completions ---------------------------------------------------------------------

    async def chat_plan(self, conversation: list[dict[str, Any]], request: GenerationRequest,
                        param: str = "response_format") -> ChatPlan:
        """The model's plan of a chat request (:meth:`infer.Model.plan_chat`),
        with the server's reasoning parser and tool-call format unless the
        request names its own; a bad constraint is a 400 naming ``param``
        (``tool_choice`` for a forced call's grammar)."""
        if request.reasoning_parser is None and self.reasoning_parser is not None:
            request = request.replace(reasoning_parser=self.reasoning_parser)
        if request.tool_parser is None and self.tool_parser is not None:
            request = request.replace(tool_parser=self.tool_parser)
        try:
            if media.has_images(conversation):
                if not self.model.reads_images:
                    where, param = media.first_image(conversation)
                    raise RequestError(f"{where} is an image, but {self.name!r} reads text only", param)
                fetched = await asyncio.to_thread(media.resolve, conversation, self.allowed_media_domains)
                # The vision tower runs on the engine thread, between two steps: never beside a forward.
                return await self.loop.call(lambda: self.model.plan_chat(fetched, request))
            if constrained(request):
                return await asyncio.to_thread(self.model.plan_chat, conversation, request)
            return self.model.plan_chat(conversation, request)
        except ImageError as err:  # the message starts with the part it names
            where = str(err).split(":", 1)[0]
            raise RequestError(str(err), where if "[" in where else "messages") from None
        except StructuredOutputError as err:
            raise RequestError(str(err), "tool_choice" if request.forces_tool_call else param) from None
        except SamplingParameterError as err:
            raise RequestError(str(err), _param_of(err)) from None

    async def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """:meth:`infer.Model.prepare`; a constraint is compiled on a worker
        thread (the first one also indexes the vocabulary, about a second for
        a large one), so the event loop keeps serving."""
        if constrained(request):
            return await asyncio.to_thread(self.model.prepare, request)
        return self.model.prepare(request)

    async def start_chat(self, plan: ChatPlan, n: int = 1) -> list[Choice]:
        """Submit ``n`` choices of ``plan``; each reads its reply with its own parser."""
        choices = await self.start(plan.prepared, [plan.prompt_ids], n, skip_special_tokens=plan.skip_special_tokens,
                                   media=plan.media)
        for c in choices:
            c.reader = plan.reply_parser()
        return choices

    async def run_replies(self, request: Request, choices: list[Choice], endpoint: str) -> None:
        """Run every chat choice to its end (:meth:`run_all`), then have its
        reader read its whole reply."""
        await self.run_all(request, choices, endpoint)
        for c in choices:
            c.reply.feed(c.output)
            c.reply.finish()

    async def respond(self, request: Request, events: ReplyEvents, endpoint: str, stream: bool) -> Response:
        """A one-choice reply of the Messages or Responses API: whole, or
        streamed as named events."""
        if not stream:
            await self.run_replies(request, [events.choice], endpoint)
            return JSONResponse(events.whole())
        return self.sse(functools.partial(self.stream_reply, events), [events.choice], endpoint, named=True,
                        failure=events.error)

    async def stream_reply(self, events: ReplyEvents, emit: Emit) -> None:
        """Run ``events``' choice to its end, its reply's events to ``emit`` as
        they settle: its start, those of each piece of the reply, its finish."""
        c, reader = events.choice, events.choice.reply

        async def send(items: list[dict[str, Any]]) -> None:
            for item in items:
                await emit(item)

        async def piece(c: Choice, text: str) -> None:
            for d in reader.feed(text):
                await send(events.delta(d))

        await send(events.start())
        await c.run(self.loop, piece)
        for d in reader.finish():
            await send(events.delta(d))
        await send(events.finish())

    async def chat_completions(self, request: Request) -> Response:
        return await completions.chat_completions(self, request)

    # -- the Anthropic Messages API (infer.serve.anthropic) -----------------------------------

    async def messages(self, request: Request) -> Response:
        return await anthropic.messages(self, request)

    async def count_tokens(self, request: Request) -> Response:
        return await anthropic.count_tokens(self, request)

    # -- the Responses API (infer.serve.responses) ----------------------------------------------

    async def responses(self, request: Request) -> Response:
        return await responses.responses(self, request)

    # -- /v1/embeddings, /v1/rerank ------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        return await embeddings.embeddings(self, request)

    async def rerank(self, request: Request) -> Response:
        return await embeddings.rerank(self, request)

    # -- /slots/{name} (infer.serve.slots) -------------------------------------------------------

    async def slots(self, request: Request) -> Response:
        return await slots.slots(self, request)

    # -- streaming -------------------------------------------------------------------------------

    def sse(self, produce: Callable[[Emit], Awaitable[None]], choices: list[Choice], endpoint: str, *,
            failure: Callable[[BaseException], dict[str, Any]], named: bool = False) -> Response:
        """Server-sent events of ``produce``'s chunks, then ``data: [DONE]``
        (OpenAI's chat and completions); with ``named``, each event named by
        its chunk's ``type`` and no ``[DONE]`` (the Anthropic Messages and
        Responses APIs). A failure mid-stream sends ``failure(error)`` (the
        API's error event) and ends the stream. A client that goes away
        cancels every choice's request."""
        def event(item: dict[str, Any]) -> Any:
            data = json.dumps(item, ensure_ascii=False)
            return {"event": item.get("type", "message"), "data": data} if named else data

        async def stream() -> AsyncIterator[Any]:
            out: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

            async def work() -> None:
                try:
                    await produce(out.put)
                except Exception as err:  # an engine failure mid-stream: an error event, then the end
                    await out.put(err)
                await out.put(None)

            task = asyncio.ensure_future(work())
            try:
                while True:
                    item = await out.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        log.warning("a streamed request failed: %s", item)
                        yield event(failure(item))
                        break
                    yield event(item)
                if not named:
                    yield "[DONE]"
            finally:  # also when the client went away and the response was cancelled
                task.cancel()
                for c in choices:
                    self.loop.cancel(c.stream)
                self._count(endpoint, choices)

        return EventSourceResponse(stream())
