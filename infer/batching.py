"""Continuous batching: many requests, one forward per step.

:class:`BatchEngine` keeps a queue of waiting requests and a set of running
ones, each with its own :class:`~infer.sampling.Sampler` and
:class:`~infer.engine.StopConditions`, all keeping their keys and values in
one :class:`~infer.paged_cache.PagedKVPool`. Each :meth:`BatchEngine.step`
runs **one** forward (:meth:`~infer.engine.Engine.forward_batch`) over every
running request: one token for each decoding request and a chunk of the
prompt for each request still prefilling, flattened into one batch, within
``max_batch_tokens``. Requests join and leave between steps.

A request is uniform whatever its phase: its *known* tokens are the prompt
plus the tokens sampled so far, and a step feeds it (some of) the known tokens
its cache does not hold yet. When a step feeds the last of them, the logits
of that step give the next token. Prefill, decode and recomputation after a
preemption are therefore one code path.

Memory (issue 5, items 3–5):

* **Prefix caching** — on admission a request's cache starts with the pool's
  cached blocks for the longest full-block prefix of its prompt (without the
  last token, which must be computed for the first logits), so shared prompt
  prefixes are not recomputed (:attr:`BatchStats.tokens_reused`).
* **Admission control** — a request is admitted (FIFO) only when the pool,
  counting evictable cached blocks and the blocks already-admitted requests
  still need for their known tokens, can hold its prompt + ``max_tokens``. A
  request that could never fit, even in an empty pool, fails at
  :meth:`~BatchEngine.submit` with :class:`~infer.errors.CacheFullError`.
* **Preemption** — admission does not reserve the blocks decoding will need
  later; when a step cannot get the blocks it needs, the most recently
  admitted running request is preempted: its pages are freed and it goes back
  to the front of the queue, to be recomputed from prompt + tokens generated
  so far. Blocks are taken for the whole step *before* the forward, so a
  forward never runs out of pages half way.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from infer.engine import Engine, SequenceState, StopConditions
from infer.errors import CacheFullError, GenerationError
from infer.paged_cache import PagedKVPool, PagedSequenceCache
from infer.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

#: Bytes of keys and values a :class:`BatchEngine` reserves when given no pool.
DEFAULT_KV_MEMORY = 256 * 2**20
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BATCH_TOKENS = 512


@dataclass
class BatchStats:
    """Counters of a :class:`BatchEngine` (cumulative)."""

    #: Forward passes run.
    forwards: int = 0
    #: Tokens fed through the model, over all forwards.
    tokens_processed: int = 0
    #: Tokens per forward, in order.
    tokens_per_forward: list[int] = field(default_factory=list)
    #: Prompt positions taken from the prefix cache instead of computed.
    tokens_reused: int = 0
    #: Requests preempted (pages freed, recomputed later).
    preemptions: int = 0


class RequestHandle:
    """One submitted request. Iterate it for its new token ids (iterating
    drives :meth:`BatchEngine.step` until this request has a new token or is
    finished); afterwards :attr:`finish_reason` says why it ended
    (``"stop"``, ``"length"`` or ``"cancelled"``)."""

    def __init__(self, engine: BatchEngine, rid: int, prompt: list[int], sampler: Sampler, stop: StopConditions):
        self.engine = engine
        self.id = rid
        self.prompt = prompt
        self.sampler = sampler
        self.stop = stop
        #: Token ids generated so far.
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._seq: SequenceState | None = None
        self._admitted_at = -1
        self._read = 0

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self._seq is not None else "waiting")
        return f"<RequestHandle {self.id} {state}, {len(self.prompt)} prompt + {len(self.tokens)} new tokens>"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def __iter__(self) -> Iterator[int]:
        while True:
            while self._read < len(self.tokens):
                self._read += 1
                yield self.tokens[self._read - 1]
            if self.finished:
                return
            self.engine.step()

    def cancel(self) -> None:
        """Stop this request now; its pages return to the pool at once."""
        self.engine.cancel(self)

    # -- the engine's view ----------------------------------------------------------

    def _known(self) -> list[int]:
        return self.prompt + self.tokens

    def _total(self) -> int:
        """Most positions this request can occupy."""
        return min(len(self.prompt) + self.stop.max_tokens, self.engine.engine.max_context)


class BatchEngine:
    """Runs many requests through one :class:`~infer.engine.Engine`, one
    forward per :meth:`step` over all of them (continuous batching).

    ``kv_pool``: the pool every request's pages come from (default: one of
    :data:`DEFAULT_KV_MEMORY` bytes). ``max_batch_tokens``: most tokens one
    forward processes; a long prompt is prefilled in chunks.
    """

    def __init__(
        self, engine: Engine, *, kv_pool: PagedKVPool | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    ) -> None:
        if max_batch_tokens < 1:
            raise GenerationError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        self.engine = engine
        if kv_pool is None:
            kv_pool = PagedKVPool.for_engine(engine, block_size=DEFAULT_BLOCK_SIZE, memory_budget=DEFAULT_KV_MEMORY)
        self.pool = kv_pool
        self.max_batch_tokens = max_batch_tokens
        self.stats = BatchStats()
        self.waiting: deque[RequestHandle] = deque()
        #: Admitted requests, in admission order.
        self.running: list[RequestHandle] = []
        self._lock = threading.RLock()
        self._next_id = 0
        self._admissions = 0

    # -- requests -------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop: StopConditions) -> RequestHandle:
        """Queue a request; it joins the running batch at a later :meth:`step`.

        Raises :class:`~infer.errors.CacheFullError` when its prompt +
        ``max_tokens`` could not fit even in an empty pool.
        """
        self.engine.check_prompt(prompt_ids)
        prompt = [int(t) for t in prompt_ids]
        with self._lock:
            handle = RequestHandle(self, self._next_id, prompt, Sampler(sampling), stop)
            self._next_id += 1
            if stop.max_tokens == 0:
                handle.finish_reason = "length"
                return handle
            need = self.pool.allocator.blocks_for(handle._total())
            if need > self.pool.num_blocks:
                raise self._never_fits(handle, need)
            self.waiting.append(handle)
            return handle

    def cancel(self, handle: RequestHandle) -> None:
        """End ``handle`` now (``finish_reason`` ``"cancelled"``); its pages
        return to the pool at once. Cancelling a finished request does nothing."""
        with self._lock:
            if handle.finished:
                return
            if handle in self.waiting:
                self.waiting.remove(handle)
            self._finish(handle, "cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run_until_done(self) -> None:
        """Step until every submitted request has finished."""
        while self.has_work():
            self.step()

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, then run one forward over every running request
        and sample a token for each one whose known tokens are all cached."""
        with self._lock:
            self._admit()
            if not self.running:
                if self.waiting:  # nothing of ours runs, yet the head of the queue does not fit
                    head, alloc = self.waiting[0], self.pool.allocator
                    raise CacheFullError(
                        f"request {head.id} needs {alloc.blocks_for(head._total())} blocks of "
                        f"{alloc.block_size} positions but only {alloc.available()} of the pool's "
                        f"{self.pool.num_blocks} are available, and this batch engine holds none: "
                        f"sequences outside it hold the rest ({self.pool.stats()}); free them first"
                    )
                return
            batch = self._schedule()
            seqs = [r._seq for r, _ in batch]
            chunks = [r._known()[r._seq.cached:r._seq.cached + n] for r, n in batch]  # type: ignore[union-attr]
            logits = self.engine.forward_batch(seqs, chunks)  # type: ignore[arg-type]
            tokens = sum(len(c) for c in chunks)
            self.stats.forwards += 1
            self.stats.tokens_processed += tokens
            self.stats.tokens_per_forward.append(tokens)
            self._sample(batch, logits)

    def _admit(self) -> None:
        """Admit waiting requests in order while the pool can hold them."""
        alloc = self.pool.allocator
        while self.waiting:
            handle = self.waiting[0]
            seq = self.engine.new_sequence(handle._total(), kv_pool=self.pool)
            cache: PagedSequenceCache = seq.cache  # type: ignore[assignment]
            known = handle._known()
            reused = cache.reuse_prefix(known[:-1])
            # Blocks the running requests still need for tokens they already know.
            pending = sum(self._blocks_to_cache(r) for r in self.running)
            need = alloc.blocks_for(handle._total()) - len(cache.table.blocks)
            if need > alloc.available() - pending:
                cache.free()
                return
            self.waiting.popleft()
            seq.tokens = list(known[:reused])
            handle._seq = seq
            handle._admitted_at = self._admissions
            self._admissions += 1
            self.running.append(handle)
            self.stats.tokens_reused += reused

    def _blocks_to_cache(self, r: RequestHandle) -> int:
        seq = r._seq
        assert seq is not None
        cache: PagedSequenceCache = seq.cache  # type: ignore[assignment]
        return self.pool.allocator.blocks_needed(cache.table, cache.length, len(r.prompt) + len(r.tokens))

    def _schedule(self) -> list[tuple[RequestHandle, int]]:
        """Tokens to feed each running request this step, with their pages
        taken already; preempts the newest requests until the pages suffice."""
        while True:
            budget = self.max_batch_tokens
            plan: dict[int, int] = {}
            # Decoding requests first (one token each), then prompt chunks.
            for r in self.running:
                if budget and self._to_feed(r) == 1:
                    plan[r.id], budget = 1, budget - 1
            for r in self.running:
                todo = self._to_feed(r)
                if budget and todo > 1:
                    plan[r.id] = n = min(todo, budget)
                    budget -= n
            batch = [(r, plan[r.id]) for r in self.running if r.id in plan]
            try:
                for r, n in batch:
                    cache: PagedSequenceCache = r._seq.cache  # type: ignore[union-attr, assignment]
                    copies = self.pool.allocator.prepare_write(cache.table, cache.length, cache.length + n)
                    if copies:
                        self.pool.copy_blocks(copies)
                return batch
            except CacheFullError:
                if len(self.running) == 1:
                    raise  # nothing left to preempt: the pool is held by someone else
                self._preempt(max(self.running, key=lambda h: h._admitted_at))

    def _to_feed(self, r: RequestHandle) -> int:
        return len(r.prompt) + len(r.tokens) - r._seq.cached  # type: ignore[union-attr]

    def _preempt(self, r: RequestHandle) -> None:
        log.debug("preempting request %d (%d tokens to recompute)", r.id, len(r.prompt) + len(r.tokens))
        self._release(r)
        self.waiting.appendleft(r)
        self.stats.preemptions += 1

    def _sample(self, batch: list[tuple[RequestHandle, int]], logits: object) -> None:
        ops = self.engine.backend
        ready = [(i, r) for i, (r, _) in enumerate(batch) if self._to_feed(r) == 0]
        if not ready:
            return
        argmax = ops.to_numpy(ops.argmax(logits, axis=-1))
        rows = ops.to_numpy(logits) if any(r.sampler.needs_logits for _, r in ready) else None
        for i, r in ready:
            if r.sampler.needs_logits:
                token = r.sampler.sample(rows[i], r._seq.tokens)  # type: ignore[index, union-attr]
            else:
                token = int(argmax[i])
            r.tokens.append(token)
            # Same rules, in the same order, as Engine.generate.
            if not r.stop.ignore_eos and token in r.stop.eos_token_ids:
                self._finish(r, "stop")
            elif len(r.tokens) >= r.stop.max_tokens or r._seq.cached >= self.engine.max_context:  # type: ignore[union-attr]
                self._finish(r, "length")

    def _finish(self, r: RequestHandle, reason: str) -> None:
        self._release(r)
        r.finish_reason = reason

    def _release(self, r: RequestHandle) -> None:
        if r._seq is not None:
            self.engine.release(r._seq)
            r._seq = None
        if r in self.running:
            self.running.remove(r)

    # -- errors -----------------------------------------------------------------------

    def _never_fits(self, r: RequestHandle, need: int) -> CacheFullError:
        alloc = self.pool.allocator
        per = alloc.bytes_per_block or self._bytes_per_block()
        err = CacheFullError(
            f"a request of {len(r.prompt)} prompt tokens + max_tokens {r.stop.max_tokens} needs "
            f"{r._total()} positions = {need} blocks of {alloc.block_size} ({need * per:,} bytes of keys and "
            f"values), but the whole KV pool is {self.pool.num_blocks} blocks ({self.pool.num_blocks * per:,} "
            f"bytes): shorten the prompt, lower max_tokens, or size the pool larger"
        )
        err.blocks_needed, err.blocks_available = need, self.pool.num_blocks  # type: ignore[attr-defined]
        err.bytes_needed, err.bytes_available = need * per, self.pool.num_blocks * per  # type: ignore[attr-defined]
        return err

    def _bytes_per_block(self) -> int:
        """Measured with a one-token forward into a throwaway contiguous cache."""
        return self.engine.kv_bytes_per_position() * self.pool.block_size
