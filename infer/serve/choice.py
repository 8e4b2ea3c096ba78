"""One generated choice, and the stream state every chat API's events grow from.

A :class:`Choice` is one submitted request read into text: its
:class:`~infer.serve.loop.TokenStream`'s tokens through a
:class:`~infer.completion.TextStream` (stop strings), and for a chat request
the :class:`~infer.chat.ReplyParser` that reads its reply (reasoning, content,
tool calls). The server (:class:`~infer.serve.app.Server`) makes and runs
choices; each endpoint module turns them into its API's items.

:class:`ReplyEvents` is what each chat API's stream state is: fields for
what it has sent so far, and one method per event of a reply (its start, a
piece of text, of reasoning, a tool call, its finish, a failure), each
returning the wire events (dicts, no I/O) that the event makes; and the
item of a whole reply, for a request that is not streamed.
:meth:`ReplyEvents.delta` routes a :class:`~infer.chat.Delta` to its method,
so the server drives a state (:meth:`~infer.serve.app.Server.stream_reply`)
and a test can feed one by hand.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from infer.chat import Delta, ReplyParser
from infer.completion import TextStream
from infer.engine.sampling import TokenLogprob
from infer.serve.loop import EngineLoop, TokenStream
from infer.tool_parsers import Call

#: How a stream hands one event (a chunk) to the response: ``await emit(event)``.
Emit = Callable[[dict[str, Any]], Awaitable[None]]
#: The events one event of a reply makes, in the order they go out.
Events = list[dict[str, Any]]


@dataclass
class Choice:
    """One generated choice: its request's stream and what became of it."""

    index: int
    stream: TokenStream
    text: TextStream
    tokens: int = 0
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)
    #: Log-probabilities handed out so far (:meth:`new_logprobs`).
    _logprobs_taken: int = 0
    #: A chat choice's reader of its reply (reasoning, content, tool calls).
    reader: ReplyParser | None = None
    #: Token ids kept out of the text (end-of-sequence ones, when special tokens are decoded).
    hidden: frozenset[int] = frozenset()

    def new_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens consumed since the last call
        (empty without ``logprobs``)."""
        entries = self.stream.logprobs[self._logprobs_taken:self.tokens]
        self._logprobs_taken += len(entries)
        return entries

    async def run(self, loop: EngineLoop, emit: Callable[[Choice, str], Awaitable[None]] | None = None) -> None:
        """Consume the stream: text pieces (to ``emit`` as they are final), until EOS, the length or a stop string."""
        async for ids in self.stream:
            for token in ids:
                self.tokens += 1
                piece = "" if token in self.hidden else self.text.push(token)
                if piece:
                    await self._piece(piece, emit)
                if self.text.stopped:
                    loop.cancel(self.stream)  # its pages go back before the next step
                    self.finish_reason = "stop"
                    return
        piece = self.text.finish()
        if piece:
            await self._piece(piece, emit)
        self.finish_reason = "stop" if self.stream.finish_reason == "stop" or self.text.stopped else "length"

    async def _piece(self, piece: str, emit: Callable[[Choice, str], Awaitable[None]] | None) -> None:
        self.pieces.append(piece)
        if emit is not None:
            await emit(self, piece)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens its request found in the prefix cache (0 before admission)."""
        handle = self.stream.handle
        return 0 if handle is None else handle.cached_tokens or 0

    @property
    def output(self) -> str:
        return "".join(self.pieces)

    @property
    def reply(self) -> ReplyParser:
        """A chat choice's reader (:meth:`~infer.serve.app.Server.start_chat` gives every chat choice one)."""
        if self.reader is None:
            raise TypeError(f"choice {self.index} is not a chat choice: it has no reply reader")
        return self.reader


class ReplyEvents(ABC):
    """One chat choice's stream state: the events of its reply, one method
    per event (see the module docs). Subclasses keep, as fields, what they
    have sent so far."""

    def __init__(self, choice: Choice) -> None:
        self.choice = choice

    def delta(self, d: Delta) -> Events:
        """The events of one settled piece of the reply."""
        if d.kind == "tool_call":
            assert d.call is not None  # a tool_call delta always carries its call
            return self.tool_call(d.index, d.call_id, d.call)
        if d.kind == "reasoning":
            return self.reasoning(d.text)
        return self.text(d.text)

    @abstractmethod
    def start(self) -> Events:
        """The events before the reply's first piece."""

    @abstractmethod
    def text(self, text: str) -> Events:
        """A piece of the answer's text."""

    @abstractmethod
    def reasoning(self, text: str) -> Events:
        """A piece of the reasoning."""

    @abstractmethod
    def tool_call(self, index: int, call_id: str, call: Call) -> Events:
        """A whole tool call: the ``index``-th of the reply, with its id."""

    @abstractmethod
    def finish(self) -> Events:
        """The events after the last piece (the choice has finished)."""

    @abstractmethod
    def error(self, err: BaseException) -> dict[str, Any]:
        """The event that ends the stream when generation fails midway."""

    @abstractmethod
    def whole(self) -> dict[str, Any]:
        """The choice's item of a reply that is not streamed (its reader has read all of it)."""
