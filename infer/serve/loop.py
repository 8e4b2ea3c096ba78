"""The one thread that steps the batch engine for every HTTP request.

The server's handlers run on an asyncio event loop; the model runs on a
thread of its own, :class:`EngineLoop`, which owns the
:class:`~infer.engine.batch.BatchEngine`: only it calls ``submit``, ``step``
and ``cancel``, so a forward never blocks the event loop and the engine
needs no lock held across threads. Handlers talk to it through an inbox
(submissions and cancellations, taken between steps) and get their tokens
back through one :class:`TokenStream` each, fed after every step with the
tokens that step produced.

A cancellation (a client that went away) is taken before the next step, so
the request's pages return to the pool before another forward runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infer.engine.batch import BatchEngine, RequestHandle
from infer.engine.generate import StopConditions
from infer.engine.sampling import Sampler, TokenLogprob
from infer.errors import ServerBusyError

log = logging.getLogger(__name__)

#: Seconds the loop sleeps waiting for work before it looks again for a stop request.
_IDLE_WAIT = 0.5


class TokenStream:
    """One request's new token ids, as the engine thread produces them.

    ``async for ids in stream`` gives lists of ids (each step's, at least
    one); when it ends, :attr:`finish_reason` says why (``"stop"``,
    ``"length"`` or ``"cancelled"``). An error of the engine ends it by
    raising that error. A request whose sampler records log-probabilities
    has each token's :class:`~infer.engine.sampling.TokenLogprob` in
    :attr:`logprobs` by the time its id is yielded.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_tokens: int) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[tuple[list[int], list[TokenLogprob]] | BaseException | None] = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.handle: RequestHandle | None = None
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        #: Engine-thread bookkeeping: tokens delivered, when the last came.
        self._sent = 0
        self._submitted = time.perf_counter()
        self._last: float | None = None

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._items()

    async def _items(self) -> AsyncIterator[list[int]]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            ids, logprobs = item
            self.logprobs.extend(logprobs)
            yield ids

    def _put(self, item: tuple[list[int], list[TokenLogprob]] | BaseException | None) -> None:
        """From the engine thread: hand ``item`` to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Submit:
    stream: TokenStream
    prompt: list[int]
    sampler: Sampler
    stop: StopConditions
    admitted: asyncio.Future[None]
    #: The prompt's images (:class:`infer.multimodal.PromptMedia`), or None.
    media: Any = None


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: asyncio.Future[Any]


@dataclass
class _Cancel:
    stream: TokenStream


class EngineLoop:
    """Steps ``batch`` on a background thread while it has requests.

    Args:
        batch: the batch engine; from now on only this loop may use it.
        max_queue: most requests waiting for admission (submitted, not yet
            running); one more is refused with
            :class:`~infer.errors.ServerBusyError`.
        on_tokens: called on the engine thread for each request's new
            tokens: ``(stream, count, seconds since submission or since its
            previous tokens, first)`` (the server's metrics).
    """

    def __init__(
        self, batch: BatchEngine, *, max_queue: int = 256,
        on_tokens: Callable[[TokenStream, int, float, bool], None] | None = None,
    ) -> None:
        self.batch = batch
        self.max_queue = max_queue
        self._on_tokens = on_tokens
        self._inbox: queue.SimpleQueue[_Submit | _Cancel | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, TokenStream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Submissions in the inbox, not yet handed to the batch engine.
        self._pending = 0
        self._pending_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="infer-serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Cancel every request and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (started, not stopped, not
        died): without it no request would ever be answered."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- the event loop's side ----------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet running."""
        return len(self.batch.waiting) + self._pending

    @property
    def running(self) -> int:
        return len(self.batch.running)

    async def submit(self, prompt: Sequence[int], sampler: Sampler, stop: StopConditions,
                     media: Any = None) -> TokenStream:
        """Queue a request; returns its stream once the engine has accepted it.
        ``sampler`` is the request's own (one made with ``logprobs=k``
        records what :attr:`TokenStream.logprobs` gives); ``media``: the
        prompt's images (:class:`infer.multimodal.PromptMedia`).

        Raises :class:`~infer.errors.ServerBusyError` when ``max_queue``
        requests wait already, and what
        :meth:`~infer.engine.batch.BatchEngine.submit` raises (e.g.
        :class:`~infer.errors.CacheFullError` for a request that could never fit).
        """
        if self._thread is None:
            raise RuntimeError("the engine loop is not running (start() it, or run the app under its lifespan)")
        if self.waiting >= self.max_queue:
            raise ServerBusyError(f"{self.waiting} requests are waiting already (the server's limit is "
                                  f"{self.max_queue}); retry later")
        loop = asyncio.get_running_loop()
        stream = TokenStream(loop, len(prompt))
        accepted: asyncio.Future[None] = loop.create_future()
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(_Submit(stream, list(prompt), sampler, stop, accepted, media))
        self._wake.set()
        await accepted
        return stream

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the engine thread between two steps (work on the
        model that must not overlap a forward, e.g. scoring a prompt); its
        result, or its exception."""
        if self._thread is None:
            raise RuntimeError("the engine loop is not running")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, done))
        self._wake.set()
        return await done

    def cancel(self, stream: TokenStream) -> None:
        """End ``stream``'s request before the next step (its pages return to
        the pool then); nothing happens if it has finished. Safe to call from
        any thread, any number of times."""
        self._inbox.put(_Cancel(stream))
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._take_inbox()
            if not self.batch.has_work():
                self._wake.wait(_IDLE_WAIT)
                self._wake.clear()
                continue
            try:
                self.batch.step()
            except Exception as err:  # a failed forward ends every request with the error, not the server
                log.exception("engine step failed; ending the %d running and waiting requests",
                              len(self._streams))
                for stream in list(self._streams.values()):
                    self._end(stream, err)
                continue
            self._deliver()
        self._take_inbox()
        for stream in list(self._streams.values()):
            self._end(stream, None, cancel=True)

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Cancel):
                stream = item.stream
                if stream.handle is not None and stream.handle.id in self._streams:
                    self._end(stream, None, cancel=True)
                continue
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            with self._pending_lock:
                self._pending -= 1
            self._accept(item)

    def _run_call(self, item: _Call) -> None:
        def settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        try:
            result, ok = item.fn(), True
        except Exception as err:
            result, ok = err, False
        try:
            item.done.get_loop().call_soon_threadsafe(settle, item.done, ok, result)
        except RuntimeError:
            pass

    def _accept(self, item: _Submit) -> None:
        stream = item.stream

        def resolve(error: BaseException | None) -> None:
            if item.admitted.cancelled():  # the handler is gone (its client left): so is the request
                self.cancel(stream)
                return
            if item.admitted.done():
                return
            if error is None:
                item.admitted.set_result(None)
            else:
                item.admitted.set_exception(error)

        try:
            handle = self.batch.submit(item.prompt, item.sampler, item.stop, media=item.media)
        except Exception as err:
            self._call(stream, resolve, err)
            return
        stream.handle = handle
        self._streams[handle.id] = stream
        self._call(stream, resolve, None)
        if handle.finished:  # max_tokens 0
            self._end(stream, None)

    def _call(self, stream: TokenStream, fn: Callable[[BaseException | None], None], arg: BaseException | None) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass

    def _deliver(self) -> None:
        """Every request's tokens of the last step to its stream."""
        now = time.perf_counter()
        for stream in list(self._streams.values()):
            handle = stream.handle
            assert handle is not None
            new = handle.tokens[stream._sent:]
            if new:
                logprobs = handle.sampler.recorded[stream._sent:len(handle.tokens)]
                first = stream._sent == 0
                since = now - (stream._submitted if stream._last is None else stream._last)
                stream._sent += len(new)
                stream._last = now
                stream._put((list(new), list(logprobs)))
                if self._on_tokens is not None:
                    self._on_tokens(stream, len(new), since, first)
            if handle.finished:
                self._end(stream, None)

    def _end(self, stream: TokenStream, error: BaseException | None, cancel: bool = False) -> None:
        handle = stream.handle
        if handle is not None:
            if cancel or error is not None:
                self.batch.cancel(handle)  # frees its pages now
            self._streams.pop(handle.id, None)
            stream.finish_reason = handle.finish_reason
        stream._put(error)
