"""Continuous batching: many requests, one forward per step.

:class:`BatchEngine` keeps a queue of waiting requests and a set of running
ones, each with its own :class:`~infer.engine.sampling.Sampler` and
:class:`~infer.engine.generate.StopConditions`, all keeping their keys and values
in one KV layout (below). Each :meth:`BatchEngine.step` runs **one** forward
(:meth:`~infer.engine.Engine.run`) over every running request: one token for
each decoding request and a chunk of the prompt for each request still
prefilling, flattened into one batch, within ``max_batch_tokens``. Requests join and leave between steps.

A request is uniform whatever its phase: its *known* tokens are the prompt
plus the tokens sampled so far, and a step feeds it (some of) the known tokens
its cache does not hold yet. When a step feeds the last of them, the logits
of that step give the next token. Prefill, decode and recomputation after a
preemption are therefore one code path. The rules are those of a single
request (:mod:`infer.engine.generate`): the same stop rules, sampling and
speculative verification, called from here.

Memory (:mod:`infer.engine.budget`: the batch engine asks its budget, never
which kind of cache it holds):

* **Prefix caching** — on admission a request's cache starts with the pool's
  cached blocks for the longest full-block prefix of its prompt (without the
  last token, which must be computed for the first logits), so shared prompt
  prefixes are not recomputed (:attr:`BatchStats.tokens_reused`).
* **Admission control** — a request is admitted (FIFO) only when the pool,
  counting evictable cached blocks and the blocks already-admitted requests
  still need for their known tokens, can hold its prompt + ``max_tokens``. A
  request that could never fit, even in an empty pool, fails at
  :meth:`~BatchEngine.submit` with :class:`~infer.errors.CacheFullError`.
* **Vision memory** — a request with images is admitted only when the
  vision tower's memory for them (activations while encoded, then their
  embeddings for the request's lifetime) fits within ``encoder_memory``
  beside the running requests' (:class:`~infer.engine.budget.EncoderBudget`);
  images that could never fit fail at submission with
  :class:`~infer.errors.EncoderMemoryError`.
* **Preemption** — admission does not reserve the blocks decoding will need
  later; when a step cannot get the blocks it needs, the most recently
  admitted running request is preempted: its pages are freed and it goes back
  to the front of the queue, to be recomputed from prompt + tokens generated
  so far. Blocks are taken for the whole step *before* the forward, so a
  forward never runs out of pages half way.

Speculative decoding runs inside the batch (a request submitted with a
:class:`~infer.engine.speculative.Speculation`): after each step its draft source
proposes up to ``k`` tokens for every speculating request that is decoding,
and the next step feeds such a request its pending token *and* its drafts in
the same single forward, asking the logits of all those rows
(``prepare(..., all_logits=[...])``). Each request is then verified on its
own (:func:`~infer.engine.generate.accept_drafts`) and its cache truncated after the
last accepted draft. The pages a step's drafts need are taken when they are
proposed; when there are none, the request simply does not speculate that
step. Drafts are capped to the tokens a request may still produce, so
admission needs no more than prompt + ``max_tokens``. Figures per draft
source: :attr:`BatchStats.speculative`.

Two KV layouts (``kv_layout``), the same tokens either way:

* ``"paged"`` — every request's keys and values are pages of one
  :class:`~infer.kv.paged.PagedKVPool`, with prefix caching and
  preemption as above. The default where the backend implements
  ``attention`` natively (numpy, torch, MLX), reading pages through their
  block tables.
* ``"contiguous"`` — every admitted request gets its own
  :class:`~infer.kv.cache.ContiguousKVCache` of prompt + ``max_tokens``
  positions, within a memory budget; admission reserves the whole cache, so
  nothing is ever preempted, and there is no prefix caching. The default on
  a backend without a native ``attention`` (the contract's default gathers
  each sequence's pages into a contiguous copy at every layer of every step,
  where a contiguous cache is one slice).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from infer.adapters.slots import AdapterUse
from infer.engine.budget import DEFAULT_ENCODER_MEMORY, ContiguousBudget, EncoderBudget, KVBudget, PagedBudget
from infer.engine.generate import Drafting, StopConditions, accept_drafts, sample, sample_host
from infer.engine.runner import Engine, ForwardOutput, SequenceState
from infer.engine.sampling import Sampler, SamplingParams
from infer.engine.speculative import Draft, DraftJob, DraftSource, Speculation, SpeculativeStats
from infer.errors import CacheFullError, EncoderMemoryError, GenerationError
from infer.kv.paged import PagedKVPool

log = logging.getLogger(__name__)

#: Bytes of keys and values a :class:`BatchEngine` reserves when given no pool.
DEFAULT_KV_MEMORY = 256 * 2**20
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BATCH_TOKENS = 512
#: Steps a request held back for its adapter waits before no request for
#: another adapter is admitted until it runs (:meth:`BatchEngine._admit`).
ADAPTER_WAIT_STEPS = 16

KVLayout = Literal["auto", "paged", "contiguous"]


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
    #: Speculative decoding figures per draft source name (acceptance rate,
    #: tokens per target forward; see :class:`~infer.engine.speculative.SpeculativeStats`).
    speculative: dict[str, SpeculativeStats] = field(default_factory=dict)


class RequestHandle:
    """One submitted request. Iterate it for its new token ids (iterating
    drives :meth:`BatchEngine.step` until this request has a new token or is
    finished); afterwards :attr:`finish_reason` says why it ended
    (``"stop"``, ``"length"`` or ``"cancelled"``)."""

    def __init__(self, engine: BatchEngine, rid: int, prompt: list[int], sampler: Sampler, stop: StopConditions,
                 speculation: Speculation | None = None, media: Any = None, adapter: AdapterUse | None = None):
        self.engine = engine
        #: The request's LoRA adapter (None: the base model); kept across preemptions.
        self.adapter = adapter
        self.id = rid
        self.prompt = prompt
        self.sampler = sampler
        self.stop = stop
        #: Speculative decoding of this request (None: one token per forward).
        self.speculation = speculation
        #: Its prompt's images (:class:`infer.multimodal.PromptMedia`), or None.
        self.media = media
        #: Token ids generated so far.
        self.tokens: list[int] = []
        #: Prompt positions its first admission found in the prefix cache (None before it).
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self._seq: SequenceState | None = None
        self._admitted_at = -1
        #: Steps it was held back for its adapter (BatchEngine._admit).
        self._adapter_wait = 0
        self._read = 0
        # Speculation: its state between forwards, and the drafts (and their
        # q) for the next forward.
        self._drafting = None if speculation is None else Drafting(speculation)
        self._draft = Draft([])

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self._seq is not None else "waiting")
        return f"<RequestHandle {self.id} {state}, {len(self.prompt)} prompt + {len(self.tokens)} new tokens>"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def stats(self) -> SpeculativeStats | None:
        """This request's speculative decoding figures (None without speculation)."""
        return None if self.speculation is None else self.speculation.stats

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

    Args:
        engine: the engine (model + backend) to run.
        kv_layout: ``"paged"``, ``"contiguous"`` or ``"auto"`` (paged where the
            backend has a native ``attention``; see the module docs).
        kv_pool: the pool every request's pages come from (paged layout only;
            default: one of ``kv_memory`` bytes).
        kv_memory: bytes of keys and values all requests together may hold
            (default :data:`DEFAULT_KV_MEMORY`).
        block_size: positions per page of a pool made here.
        max_batch_tokens: most tokens one forward processes; a long prompt is
            prefilled in chunks.
        encoder_memory: bytes of vision-tower activations and image
            embeddings all requests together may hold (default
            :data:`~infer.engine.budget.DEFAULT_ENCODER_MEMORY`).
    """

    def __init__(
        self, engine: Engine, *, kv_layout: KVLayout = "auto", kv_pool: PagedKVPool | None = None,
        kv_memory: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, encoder_memory: int | None = None,
    ) -> None:
        if max_batch_tokens < 1:
            raise GenerationError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        if kv_layout not in ("auto", "paged", "contiguous"):
            raise GenerationError(f"kv_layout must be 'auto', 'paged' or 'contiguous', got {kv_layout!r}")
        if kv_memory is not None and (not isinstance(kv_memory, int) or kv_memory < 1):
            raise GenerationError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        if encoder_memory is not None and (not isinstance(encoder_memory, int) or encoder_memory < 1):
            raise GenerationError(f"encoder_memory must be a positive number of bytes, got {encoder_memory!r}")
        if kv_layout == "auto":
            kv_layout = "paged" if engine.backend.supports("attention") or kv_pool is not None else "contiguous"
        if kv_pool is not None and kv_layout == "contiguous":
            raise GenerationError("kv_pool is for the paged layout; kv_layout='contiguous' takes kv_memory")
        self.engine = engine
        #: ``"paged"`` or ``"contiguous"``.
        self.kv_layout: str = kv_layout
        memory = DEFAULT_KV_MEMORY if kv_memory is None else kv_memory
        #: Where the requests' keys and values go (:mod:`infer.engine.budget`).
        self.budget: KVBudget
        if kv_layout == "paged":
            pool = kv_pool if kv_pool is not None else engine.new_kv_pool(block_size=block_size, memory_budget=memory)
            self.budget = PagedBudget(engine, pool)
            # An adapter loaded while requests run never takes the pages the largest of them needs.
            pool.keep_for.append(weakref.WeakMethod(self._largest_request_blocks))
        else:
            self.budget = ContiguousBudget(engine, memory)
        self.max_batch_tokens = max_batch_tokens
        #: The vision tower's memory that requests with images share.
        self.encoder = EncoderBudget(DEFAULT_ENCODER_MEMORY if encoder_memory is None else encoder_memory)
        self.stats = BatchStats()
        self.waiting: deque[RequestHandle] = deque()
        #: Admitted requests, in admission order.
        self.running: list[RequestHandle] = []
        self._lock = threading.RLock()
        self._next_id = 0
        self._admissions = 0

    @property
    def pool(self) -> PagedKVPool | None:
        """The paged pool (None in the contiguous layout)."""
        return self.budget.pool

    def _largest_request_blocks(self) -> int:
        """Blocks the largest running or waiting request holds at its longest
        (its prompt + ``max_tokens``): the pool keeps them usable, so that it
        can always finish (the others preempted if need be)."""
        budget = self.budget
        if not isinstance(budget, PagedBudget):
            return 0
        with self._lock:
            return max((budget.blocks_for(r._total()) for r in (*self.running, *self.waiting)), default=0)

    # -- requests -------------------------------------------------------------------

    def submit(
        self, prompt_ids: Sequence[int], sampling: SamplingParams | Sampler, stop: StopConditions,
        speculation: Speculation | None = None, media: Any = None, *, adapter: str | AdapterUse | None = None,
        adapter_scale: float = 1.0,
    ) -> RequestHandle:
        """Queue a request; it joins the running batch at a later :meth:`step`.
        ``sampling`` is its rules, or a :class:`~infer.engine.sampling.Sampler`
        made for it (one that records log-probabilities; one per request).
        With a :class:`~infer.engine.speculative.Speculation`, each of its forwards
        verifies draft tokens (see :mod:`infer.engine.speculative`).
        ``adapter``: a loaded LoRA adapter's name (or a hold on one) the
        request runs with, its term times ``adapter_scale``; requests of
        different adapters and of the base model share each step.

        Raises :class:`~infer.errors.CacheFullError` when its prompt +
        ``max_tokens`` could not fit even in an empty pool. ``media``: the
        prompt's images (:class:`infer.multimodal.PromptMedia`);
        :class:`~infer.errors.EncoderMemoryError` when they could not be
        encoded within ``encoder_memory`` even alone. (Speculation
        needs no more: drafts are capped to the tokens still allowed, so a
        request never occupies more than prompt + ``max_tokens`` positions.)
        """
        self.engine.check_prompt(prompt_ids)
        prompt = [int(t) for t in prompt_ids]
        use = self.engine.adapter_use(adapter, adapter_scale)
        if speculation is not None:
            name = speculation.source.name
            totals = self.stats.speculative.setdefault(name, SpeculativeStats(name))
            if not any(t is totals for t in speculation.totals):
                speculation.totals.append(totals)
        with self._lock:
            sampler = sampling if isinstance(sampling, Sampler) else Sampler(sampling)
            sampler.prompt_tokens = len(prompt)  # where its history's generated tokens start
            handle = RequestHandle(self, self._next_id, prompt, sampler, stop, speculation, media, use)
            self._next_id += 1
            if stop.max_tokens == 0:
                handle.finish_reason = "length"
                if use is not None:
                    use.done = True
                return handle
            self.budget.check(len(prompt), stop.max_tokens, handle._total())
            self.encoder.check(media)
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
                if self.waiting:  # nothing of ours runs, yet the head does not fit
                    head = self.waiting[0]
                    if not self.encoder.fits(head.media, self.encoder_held()):
                        raise EncoderMemoryError(
                            f"request {head.id}'s images need more of encoder_memory ({self.encoder.memory:,} "
                            f"bytes) than the {self.encoder_held():,} bytes the preempted requests' image "
                            "embeddings leave, and none of the batch engine's requests runs")
                    raise self.budget.blocked(head.id, head._total())
                return
            plan = self._schedule()
            chunks, whole = [], []
            for r, n in plan:
                seq = r._seq
                assert seq is not None
                feed = r._known()[seq.cached:seq.cached + n]
                drafts = n - len(feed)  # a decoding request: its pending token, then drafts
                chunks.append(feed + r._draft.tokens[:drafts])
                whole.append(drafts > 0)  # verification needs the logits of every row
            hidden = any(r.speculation is not None and r.speculation.source.needs_hidden for r, _ in plan)
            batch = self.engine.prepare([r._seq for r, _ in plan], chunks, all_logits=whole,  # type: ignore[misc]
                                        capture_hidden=hidden)
            out = self.engine.run(batch)
            tokens = len(batch.ids)
            self.stats.forwards += 1
            self.stats.tokens_processed += tokens
            self.stats.tokens_per_forward.append(tokens)
            self._sample(plan, out)
            self._propose(plan)

    def _admit(self) -> None:
        """Admit waiting requests in order while the budget can hold them; a
        request whose adapter the running batch cannot take beside its own
        (:meth:`_adapter_waits`) waits, in its place, while later ones pass,
        but not for ever: once it has waited :data:`ADAPTER_WAIT_STEPS` steps,
        later requests that would keep its place taken wait too
        (:meth:`_blocks_starved`), the running requests of other adapters
        finish, and it goes in."""
        held: list[RequestHandle] = []
        try:
            self._admit_in_order(held)
        finally:
            self.waiting.extendleft(reversed(held))

    def _adapter_waits(self, handle: RequestHandle) -> bool:
        """Whether ``handle`` must wait for its adapter: the running requests
        use ``max_loras`` other adapters already (vLLM's meaning: adapters
        in one batch), or one of them, or it, replaces whole modules
        (``modules_to_save``) and so runs only beside its own adapter's
        requests. A running request ends and frees its adapter's place."""
        adapters = self.engine.adapters
        if adapters is None:
            return False
        mine = handle.adapter if handle.adapter is not None and not handle.adapter.loaded.merged else None
        others = [r.adapter for r in self.running]
        if any(u is not None and u.loaded.saved for u in others):
            return mine is None or not mine.loaded.saved or any(u is None or u.name != mine.name for u in others)
        if mine is None:
            return False
        if mine.loaded.saved:
            return bool(others) and any(u is None or u.name != mine.name for u in others)
        names = {u.name for u in others if u is not None and not u.loaded.merged}
        return mine.name not in names and len(names) >= adapters.max_loras

    @staticmethod
    def _blocks_starved(starved: RequestHandle, handle: RequestHandle) -> bool:
        """Whether admitting ``handle`` could keep ``starved`` (a request held
        for its adapter too long) waiting: a request for any adapter (one of
        another adapter holds a place; one of the same adapter could not run
        before it anyway), or for the base model when ``starved``'s adapter
        replaces whole modules and so runs only beside its own."""
        mine = handle.adapter if handle.adapter is not None and not handle.adapter.loaded.merged else None
        if mine is not None:
            return True
        return starved.adapter is not None and bool(starved.adapter.loaded.saved)

    def _admit_in_order(self, held: list[RequestHandle]) -> None:
        starved: RequestHandle | None = None
        while self.waiting:
            handle = self.waiting[0]
            if self._adapter_waits(handle) or (starved is not None and self._blocks_starved(starved, handle)):
                handle._adapter_wait += 1
                if starved is None and handle._adapter_wait > ADAPTER_WAIT_STEPS:
                    starved = handle  # the first request held too long: nothing passes it that would hold it more
                held.append(self.waiting.popleft())
                continue
            if handle.media is not None and not self.encoder.fits(handle.media, self.encoder_held()):
                return  # the running requests' images hold too much of the tower's memory: wait
            running = [(r._seq, len(r.prompt) + len(r.tokens)) for r in self.running]
            extra = b"" if handle.media is None else handle.media.extra_key
            seq = self.budget.admit(handle._total(), handle._known(), running, extra, handle.adapter)  # type: ignore[arg-type]
            if seq is None:
                return
            seq.media = handle.media
            self.waiting.popleft()
            handle._seq = seq
            handle._admitted_at = self._admissions
            self._admissions += 1
            self.running.append(handle)
            logits, seq.cache.kept_logits = seq.cache.kept_logits, None
            if logits is not None and handle.speculation is not None and handle.speculation.source.needs_hidden:
                # An MTP source drafts from the last token's hidden state, which is not kept: compute it.
                del seq.tokens[seq.cache.truncate(seq.cached - 1):]
                logits = None
            self.stats.tokens_reused += seq.cached
            if handle.cached_tokens is None:
                handle.cached_tokens = seq.cached
            if logits is not None:
                self._first_from_kept(handle, seq, logits)

    def _first_from_kept(self, r: RequestHandle, seq: SequenceState, logits: np.ndarray) -> None:
        """A request admitted with every known position cached and the logits
        after them kept (a restored state): its next token is drawn from those
        logits now, with no forward."""
        token = sample_host(r.sampler, logits, seq.tokens)
        r.tokens.append(token)
        if r.speculation is not None:
            r.speculation.record(tokens=1)
        reason = r.stop.finish_reason(token, len(r.tokens), len(r.prompt), self.engine.max_context)
        if reason is not None:
            self._finish(r, reason)

    def _schedule(self) -> list[tuple[RequestHandle, int]]:
        """Tokens to feed each running request this step, with their cache
        positions reserved already; preempts the newest requests until the
        memory suffices."""
        while True:
            budget = self.max_batch_tokens
            plan: dict[int, int] = {}
            # Decoding requests first (one token each, plus their drafts),
            # then prompt chunks.
            for r in self.running:
                if budget and self._to_feed(r) == 1:
                    plan[r.id] = n = min(1 + len(r._draft.tokens), budget)
                    budget -= n
            for r in self.running:
                todo = self._to_feed(r)
                if budget and todo > 1:
                    n = min(todo, budget)
                    if r.media is not None:  # a chunk never splits a bidirectional image span
                        cached = r._seq.cached  # type: ignore[union-attr]
                        n = r.media.chunk_end(cached, cached + n) - cached
                    plan[r.id] = n
                    budget = max(0, budget - n)
            batch = [(r, plan[r.id]) for r in self.running if r.id in plan]
            try:
                for r, n in batch:
                    seq = r._seq
                    assert seq is not None
                    seq.cache.reserve(seq.cached + n)
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

    def _sample(self, plan: list[tuple[RequestHandle, int]], out: ForwardOutput) -> None:
        """New tokens for every request whose known tokens are all cached now:
        one sampled token, or (speculating) the accepted drafts plus one."""
        context = self.engine.max_context
        for i, (r, _) in enumerate(plan):
            if r._drafting is not None:  # an MTP source drafts from the target's hidden states
                r._drafting.keep(out, i)
            if self._to_feed(r) > 0:
                continue  # still prefilling
            seq = r._seq
            assert seq is not None
            first, count = out.batch.rows(i)
            if r.speculation is None:
                emitted = [sample(r.sampler, out, first, seq.tokens)]
            else:
                drafts = out.batch.token_ids[i][1:] if count > 1 else []  # fed after the pending token
                emitted = accept_drafts(self.engine, seq, r.speculation, r.sampler, out, first, drafts,
                                        r._draft.probs)
                r._draft = Draft([])
            for token in emitted:
                r.tokens.append(token)
                if r.speculation is not None:
                    r.speculation.record(tokens=1)
                reason = r.stop.finish_reason(token, len(r.tokens), len(r.prompt), context)
                if reason is not None:
                    self._finish(r, reason)
                    break

    def _propose(self, plan: list[tuple[RequestHandle, int]]) -> None:
        """Drafts for the next step of every speculating request that is
        decoding (and, for MTP, the module's cache brought up to date for
        every request the forward advanced)."""
        groups: dict[int, tuple[DraftSource, list[RequestHandle], list[DraftJob]]] = {}
        for r, _ in plan:
            drafting = r._drafting
            if drafting is None or r.finished or r._seq is None:
                continue
            spec, seq = drafting.spec, r._seq
            k = 0
            if self._to_feed(r) == 1:
                k = spec.budget(r.stop.max_tokens - len(r.tokens), seq.cache.capacity - seq.cached)
                if k:
                    try:  # the positions of the verify forward, taken now (drafting may write them)
                        seq.cache.reserve(seq.cached + 1 + k)
                    except CacheFullError:
                        k = 0  # no room to speculate this step
            elif not spec.source.needs_hidden:
                continue
            job = drafting.job(seq, r._known()[seq.cached], k, r.sampler)
            groups.setdefault(id(spec.source), (spec.source, [], []))
            groups[id(spec.source)][1].append(r)
            groups[id(spec.source)][2].append(job)
        for source, handles, jobs in groups.values():
            for r, job, draft in zip(handles, jobs, source.propose(jobs)):
                draft.tokens = draft.tokens[:job.k]
                r._draft = draft if job.k else Draft([])
                r._drafting.hidden = None  # type: ignore[union-attr]

    def encoder_held(self) -> int:
        """Bytes of the vision tower's memory the requests hold (:class:`~infer.engine.budget.EncoderBudget`)."""
        return sum(self.encoder.held(r.media, r._seq) for r in (*self.running, *self.waiting) if r.media is not None)

    def _finish(self, r: RequestHandle, reason: str) -> None:
        self._release(r)
        if r.media is not None:  # its image embeddings leave the encoder cache
            r.media.release()
        r.finish_reason = reason
        if r.adapter is not None:  # it no longer holds its adapter (a preempted request keeps it)
            r.adapter.done = True

    def _release(self, r: RequestHandle) -> None:
        if r._seq is not None:
            self.engine.release(r._seq)
            r._seq = None
        if r.speculation is not None:  # drafts and draft caches start afresh if it comes back
            r._drafting.release()  # type: ignore[union-attr]
            r._drafting, r._draft = Drafting(r.speculation), Draft([])
        if r in self.running:
            self.running.remove(r)
