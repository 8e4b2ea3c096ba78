"""From generated tokens to text results: :class:`Completion` and its stream.

A request's new tokens (a :class:`~infer.engine.generate.Generation`) are
detokenized incrementally and cut at the first stop string; text that might be
the start of a stop string is held back until it is known not to be one, so a
stop string is never partly emitted. :func:`stream_chunks` yields
:class:`CompletionChunk` objects — text, the tokens that produced it and their
log-probabilities — and a last chunk with the finish reason and the token
usage; :func:`collect` joins them into one :class:`Completion`. The text
itself comes through a :class:`TextStream`, which tokens are pushed into.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from infer.engine.generate import Generation
from infer.engine.sampling import TokenLogprob
from infer.errors import IncompleteOutputError, SamplingParameterError
from infer.tokenizer import Tokenizer

T = TypeVar("T")
_END = object()

#: How a :class:`~infer.engine.generate.Generation`'s reason reads in a completion.
_REASONS = {"stop": "eos", "stop_string": "stop"}


@dataclass(frozen=True)
class Usage:
    """Tokens a request consumed."""

    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens found in the prefix cache (a restored state, an earlier
    #: request's blocks) instead of computed; part of :attr:`prompt_tokens`.
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class CompletionChunk:
    """One piece of a streamed completion: new text, the tokens generated
    since the previous chunk, and their log-probabilities (with
    ``logprobs=``). The last chunk of a stream has :attr:`finish_reason` and
    :attr:`usage` (its text may be empty); joining every chunk's text gives
    the completion's text."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    #: On the last chunk of a constrained request: whether the text matches
    #: the constraint in full (None without a constraint).
    valid: bool | None = None


@dataclass
class Completion:
    """A finished generation, in detail.

    ``finish_reason`` is ``"eos"`` (the model emitted an end-of-sequence
    token), ``"stop"`` (a stop string; it is not in :attr:`text`),
    ``"length"`` (``max_tokens``, or the model's context, ran out) or
    ``"cancelled"``. ``token_ids`` are every generated token: with a stop
    string, up to and including the one in which it began; an end-of-sequence
    token is included, and not in the text.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    #: With ``logprobs=k``: one per token of :attr:`token_ids`, with its
    #: ``k`` most likely alternatives.
    logprobs: list[TokenLogprob] | None = None
    #: The prompt's token ids.
    prompt_token_ids: list[int] = field(default_factory=list)
    #: With ``echo=True``: one per prompt token, None for the first (nothing
    #: predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: With ``json_schema=``, ``regex=`` or ``grammar=``: whether :attr:`text`
    #: matches it in full; False when generation ended first (``finish_reason``
    #: says why). None without a constraint.
    valid: bool | None = None


class Stream(Iterator[T], AsyncIterator[T], Generic[T]):
    """What ``stream=True`` returns: the pieces of one request as they come.
    Iterate it (``for``), or ``async for`` it in a notebook or a server: then
    each piece is computed in a worker thread, so the event loop keeps
    running. Steps of streams of one model never run at once (they share the
    model's lock), so concurrent async streams interleave safely.
    :meth:`close` ends the request early and frees its cache."""

    def __init__(self, pieces: Iterator[T], lock: threading.RLock) -> None:
        self._pieces = pieces
        self._lock = lock

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        with self._lock:
            return next(self._pieces)

    def __aiter__(self) -> Stream[T]:
        return self

    async def __anext__(self) -> T:
        import asyncio  # here: its import is a noticeable share of a small model's load

        piece = await asyncio.to_thread(self._next_or_end)
        if piece is _END:
            raise StopAsyncIteration
        return piece  # type: ignore[return-value]

    def _next_or_end(self) -> object:
        with self._lock:
            return next(self._pieces, _END)

    def close(self) -> None:
        """End the request now (its KV cache is freed)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            with self._lock:
                close()


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``generate``'s ``stop`` argument as a tuple of non-empty strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def stream_chunks(
    tokenizer: Tokenizer, generation: Generation, stops: tuple[str, ...], *, logprobs: bool = False,
    skip_special_tokens: bool = True, eos_token_ids: frozenset[int] = frozenset(),
) -> Iterator[CompletionChunk]:
    """The chunks of ``generation`` (see the module docs); ``logprobs``: attach
    the log-probabilities its sampler recorded. With ``skip_special_tokens``
    False (a reasoning or tool-call format written in special tokens), the
    special tokens are in the text, except the ``eos_token_ids``."""
    sent = 0  # tokens already in a chunk

    def chunk(text: str, last: bool = False) -> CompletionChunk:
        nonlocal sent
        tokens = generation.tokens
        recorded = generation.sampler.recorded if logprobs and generation.sampler is not None else None
        piece = CompletionChunk(text, tokens[sent:], None if recorded is None else recorded[sent:len(tokens)])
        sent = len(tokens)
        if last:
            reason = generation.finish_reason or "length"
            piece.finish_reason = _REASONS.get(reason, reason)
            piece.usage = Usage(generation.prompt_tokens, len(tokens), generation.cached_tokens)
            constraint = None if generation.sampler is None else generation.sampler.constraint
            # A constraint whose `complete` is None constrains no output (it only forces the end of thinking).
            if constraint is not None and getattr(constraint, "complete", None) is not None:
                # A stop string cut the text, so it may not match even where the matcher does.
                piece.valid = bool(constraint.complete) and reason != "stop_string"  # type: ignore[attr-defined]
        return piece

    text = TextStream(tokenizer, stops, skip_special_tokens=skip_special_tokens)
    for token in generation:
        piece = "" if not skip_special_tokens and token in eos_token_ids else text.push(token)
        if text.stopped:
            generation.finish_reason = "stop_string"
            generation.tokens_iter.close()  # type: ignore[attr-defined]
            yield chunk(piece, last=True)
            return
        if piece:
            yield chunk(piece)
    piece = text.finish()
    if text.stopped:
        generation.finish_reason = "stop_string"
    yield chunk(piece, last=True)


class TextStream:
    """Generated token ids in, text out as soon as it is final, cut before
    the first stop string (the stop string itself is never shown): what
    :func:`stream_chunks` reads a generation with, and what a caller that is
    handed tokens (the HTTP server) pushes them through.

    Text that might be the start of a stop string is held back until it is
    known not to be one. Once :attr:`stopped` is true, :meth:`push` returns
    "" and the caller should end the request.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.stops = tuple(stops)
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
        self._pending = ""
        #: Whether a stop string has appeared.
        self.stopped = False
        #: The stop string that appeared (None until one does).
        self.stop_string: str | None = None

    def push(self, token: int) -> str:
        """Add one token; the text that is now certain (maybe "")."""
        if self.stopped:
            return ""
        self._pending += self._decoder.push(token)
        return self._emit(final=False)

    def finish(self) -> str:
        """The generation ended: the text still held back."""
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        pending = self._pending
        if not pending:
            return ""
        cut = _first_stop(pending, self.stops) if self.stops else None
        if cut is not None:
            self.stopped, self._pending = True, ""
            self.stop_string = min((s for s in self.stops if pending.find(s) == cut), key=len)
            return pending[:cut]
        keep = 0 if final or not self.stops else _held_back(pending, self.stops)
        self._pending = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]


def collect(
    chunks: Iterable[CompletionChunk], prompt_ids: Sequence[int], *, logprobs: bool = False,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> Completion:
    """One :class:`Completion` from a whole stream of chunks."""
    text, tokens, recorded = [], [], []
    reason, usage, valid = "length", Usage(len(prompt_ids), 0), None
    for c in chunks:
        if c.valid is not None:
            valid = c.valid
        text.append(c.text)
        tokens.extend(c.token_ids)
        recorded.extend(c.logprobs or ())
        if c.finish_reason is not None:
            reason = c.finish_reason
        if c.usage is not None:
            usage = c.usage
    return Completion("".join(text), tokens, reason, usage, recorded if logprobs else None, list(prompt_ids),
                      prompt_logprobs, valid)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


def texts(chunks: Iterable[CompletionChunk]) -> Iterator[str]:
    """The text of each chunk; raises :class:`~infer.errors.IncompleteOutputError`
    at the end when a constrained output does not match in full."""
    text = []
    for c in chunks:
        if c.text:
            text.append(c.text)
            yield c.text
        if c.valid is False:
            raise IncompleteOutputError(incomplete(c.finish_reason, "the output"), "".join(text))


def incomplete(reason: str | None, what: str) -> str:
    """The message of :class:`~infer.errors.IncompleteOutputError` for ``what``
    (an output), which generation ended for ``reason`` before it matched its constraint."""
    why = {"length": "max_tokens (or the model's context) ran out", "stop": "a stop string cut it"}.get(
        reason or "", f"generation ended ({reason})")
    return (f"{what} does not match its constraint in full: {why} first; raise max_tokens, or use "
            "complete(), whose Completion has valid=False and the text")
