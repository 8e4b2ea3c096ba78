"""Generating one request's tokens, a step at a time.

Each step is a function named after it:

* :func:`prefill` — the prompt, in forwards of at most
  :attr:`~infer.engine.runner.Engine.prefill_chunk` tokens; the first new token;
* :func:`decode_one_token` — feed the pending token; the next one;
* :func:`speculative_decode` — a draft source guesses up to ``k`` tokens,
  one forward verifies them all, and the tokens the target agrees with are
  kept (:mod:`infer.engine.speculative`);
* :func:`decode_n_tokens` — tokens, by either of the two above, until a
  stop rule ends the request.

:func:`generate` starts a request. The rules every request follows live here
once, and the batch engine (:mod:`infer.engine.batch`) uses them too:
:meth:`StopConditions.finish_reason` (when a request ends), :func:`sample` (a
token from a forward's row of logits), :func:`accept_drafts` (what a verify
forward gives a speculating request) and :class:`Drafting` (a speculating
request's state between forwards).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from infer.adapters.slots import AdapterUse
from infer.engine.runner import Engine, ForwardOutput, SequenceState
from infer.engine.sampling import Sampler, SamplingParams
from infer.engine.speculative import DraftJob, Speculation, SpeculativeStats, verify
from infer.errors import GenerationError, SamplingParameterError
from infer.kv.paged import PagedKVPool
from infer.ops import Array


@dataclass
class StopConditions:
    """When a request ends (text-level stop strings are handled by the caller)."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise SamplingParameterError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")

    def finish_reason(self, token: int, produced: int, prompt_tokens: int, context: int) -> str | None:
        """Why a request ends on emitting ``token``, its ``produced``-th new
        token after a prompt of ``prompt_tokens``, in a context of
        ``context`` positions; None when it goes on. An end-of-sequence token
        is ``"stop"``; ``max_tokens`` reached, or no position left in the
        context to feed ``token`` at, is ``"length"``."""
        if not self.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if produced >= self.max_tokens or prompt_tokens + produced - 1 >= context:
            return "length"
        return None


@dataclass
class Generation:
    """A running request: iterate it for token ids; afterwards
    :attr:`finish_reason` says why it ended (``"stop"`` for an EOS token,
    ``"length"`` for max_tokens or the context, or whatever the consumer set,
    e.g. ``"stop_string"``)."""

    tokens_iter: Iterator[int]
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: Speculative decoding figures (acceptance rate, tokens per forward),
    #: updated as tokens come; None without speculation.
    stats: SpeculativeStats | None = None
    #: The request's sampler (its :attr:`~infer.engine.sampling.Sampler.recorded`
    #: log-probabilities, when it was asked for them).
    sampler: Sampler | None = None
    #: Prompt positions taken from the prefix cache instead of computed
    #: (known once the first token is out).
    cached_tokens: int = 0

    def __iter__(self) -> Iterator[int]:
        for token in self.tokens_iter:
            self.tokens.append(token)
            yield token

    def close(self) -> None:
        """End the request now: its KV memory goes back and it lets go of its
        adapter (what dropping the last reference to it also does). Iterating
        afterwards gives no more tokens."""
        close = getattr(self.tokens_iter, "close", None)
        if close is not None:
            close()


def owner(gen: Generation) -> Generation:
    """What a token iterator refers to its :class:`Generation` through: a weak
    proxy. A strong one would make a cycle (the generation holds the iterator),
    and a request its consumer dropped part way would then keep its KV memory
    and adapter until the garbage collector finds the cycle, which a process
    that allocates few objects may not run for many requests (measured:
    SmolLM2's 11.8 MB cache per abandoned request, six of them held)."""
    return cast(Generation, weakref.proxy(gen))  # it answers as the Generation while that lives


def generate(
    engine: Engine, prompt_ids: Sequence[int], sampling: SamplingParams | Sampler, stop: StopConditions,
    speculation: Speculation | None = None, *, kv_pool: PagedKVPool | None = None, media: Any = None,
    adapter: str | AdapterUse | None = None, adapter_scale: float = 1.0,
) -> Generation:
    """Start a request; iterate the result for its new token ids. ``sampling``
    is its rules, or a :class:`~infer.engine.sampling.Sampler` made for it
    (one that records log-probabilities). With a
    :class:`~infer.engine.speculative.Speculation`, each forward after the prefill
    is a :func:`speculative_decode` round (the same tokens for greedy
    decoding). With a ``kv_pool`` the request keeps its keys and values in
    pages of it and starts from the longest prefix of its prompt that the
    pool's prefix cache holds (:attr:`Generation.cached_tokens`). ``media``:
    the prompt's images (:class:`infer.multimodal.PromptMedia`), which key
    its cached blocks too. ``adapter``: a loaded LoRA adapter's name (or a
    hold on one) every forward runs with, its term times ``adapter_scale``."""
    engine.check_prompt(prompt_ids)
    use = engine.adapter_use(adapter, adapter_scale)
    prompt = [int(t) for t in prompt_ids]
    sampler = sampling if isinstance(sampling, Sampler) else Sampler(sampling)
    sampler.prompt_tokens = len(prompt)  # where its history's generated tokens start
    gen = Generation(tokens_iter=iter(()), prompt_tokens=len(prompt),
                     stats=None if speculation is None else speculation.stats, sampler=sampler)
    gen.tokens_iter = _tokens(engine, prompt, sampler, stop, speculation, owner(gen), kv_pool, media, use)
    return gen


def _tokens(
    engine: Engine, prompt: list[int], sampler: Sampler, stop: StopConditions, spec: Speculation | None,
    gen: Generation, kv_pool: PagedKVPool | None, media: Any = None, adapter: AdapterUse | None = None,
) -> Iterator[int]:
    try:
        yield from _run_tokens(engine, prompt, sampler, stop, spec, gen, kv_pool, media, adapter)
    finally:  # the request no longer holds its adapter, however it ended
        if adapter is not None:
            adapter.done = True


def _run_tokens(
    engine: Engine, prompt: list[int], sampler: Sampler, stop: StopConditions, spec: Speculation | None,
    gen: Generation, kv_pool: PagedKVPool | None, media: Any, adapter: AdapterUse | None,
) -> Iterator[int]:
    if stop.max_tokens == 0:
        gen.finish_reason = "length"
        return
    seq = engine.new_sequence(len(prompt) + stop.max_tokens, kv_pool=kv_pool, adapter=adapter)
    seq.media = media
    drafting = None if spec is None else Drafting(spec)
    try:
        found = None
        if kv_pool is not None:  # the last token is left to compute, unless its logits were kept
            if media is not None:  # after the adapter's key (engine.new_sequence): shared only under both
                seq.cache.extra_key += media.extra_key  # type: ignore[attr-defined]
            if drafting is not None and drafting.spec.source.needs_hidden:
                # An MTP source drafts from the last token's hidden state, which is not kept with its logits.
                gen.cached_tokens = seq.cache.reuse_prefix(prompt[:-1])  # type: ignore[attr-defined]
            else:
                gen.cached_tokens, found = seq.cache.reuse_prompt(prompt)  # type: ignore[attr-defined]
            seq.tokens = prompt[:gen.cached_tokens]
        if found is not None:  # the whole prompt was restored with its logits: nothing to compute
            token = sample_host(sampler, found, seq.tokens)
        else:
            token = prefill(engine, seq, prompt[gen.cached_tokens:], sampler, drafting)
        yield from decode_n_tokens(engine, seq, token, sampler, stop, gen, drafting)
    finally:  # also when the consumer stops early and the generator is closed
        if drafting is not None:
            drafting.release()
        engine.release(seq)


class Drafting:
    """One request's speculation between its forwards: the draft source's
    per-request state, and the target's hidden states of the last forward
    (rows from position :attr:`hidden_start` on) for a source that drafts
    from them (MTP)."""

    def __init__(self, spec: Speculation) -> None:
        self.spec = spec
        self.state = spec.source.new_state()
        self.hidden: Array | None = None
        self.hidden_start = 0

    def job(self, seq: SequenceState, pending: int, k: int, sampler: Sampler) -> DraftJob:
        """Ask for up to ``k`` drafts after ``pending``, the token that follows ``seq``'s."""
        return DraftJob(tokens=seq.tokens + [pending], k=k, sampler=sampler, state=self.state,
                        capacity=seq.cache.capacity, seq=seq, hidden=self.hidden, hidden_start=self.hidden_start)

    def keep(self, out: ForwardOutput, i: int) -> None:
        """Keep sequence ``i``'s hidden states of ``out`` where the source drafts from them."""
        if self.spec.source.needs_hidden and out.hidden is not None:
            self.hidden, self.hidden_start = out.hidden_of(i), out.batch.slices[i].start

    def release(self) -> None:
        """The request ended: the source frees what it held for it (e.g. a draft model's cache)."""
        self.spec.source.release(self.state)


def sample(sampler: Sampler, out: ForwardOutput, row: int, history: Sequence[int]) -> int:
    """The next token from logits row ``row`` of ``out``. When the argmax
    alone decides (greedy, no penalty) it comes from the device and only the
    ids leave it; otherwise the request's rules run on the host, with
    ``history`` (the tokens so far) for the repetition penalty."""
    if not sampler.needs_logits:
        return int(out.argmax()[row])
    return sampler.sample(out.host_logits()[row], history)


def sample_host(sampler: Sampler, logits: np.ndarray, history: Sequence[int]) -> int:
    """The next token from one logits row already on the host (a restored
    state's, :meth:`~infer.kv.paged.PagedSequenceCache.reuse_prompt`), by
    the same rules as :func:`sample`."""
    if not sampler.needs_logits:
        return int(np.argmax(logits))  # the lowest id among ties, as the device's argmax
    return sampler.sample(logits.copy(), history)  # the rules may work in place; the kept row stays


def prefill(
    engine: Engine, seq: SequenceState, prompt: list[int], sampler: Sampler, drafting: Drafting | None = None,
) -> int:
    """The prompt in forwards of at most :attr:`Engine.prefill_chunk
    <infer.engine.runner.Engine.prefill_chunk>` tokens (a chunk never splits
    an image's bidirectional span); the first new token. A speculating
    request's last forward counts in its figures, and when its draft source
    drafts from hidden states the prompt goes in one forward, whose hidden
    states are kept."""
    needs_hidden = drafting is not None and drafting.spec.source.needs_hidden
    chunk = engine.prefill_chunk
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise GenerationError(f"prefill_chunk must be a whole number of tokens, at least 1 (or None), got {chunk!r}")
    start = 0
    while chunk is not None and not needs_hidden and len(prompt) - start > chunk:
        stop = start + chunk
        if seq.media is not None:
            stop = seq.media.chunk_end(seq.cached, seq.cached + chunk) - seq.cached + start
            if stop >= len(prompt):  # an image span runs to the prompt's end
                break
        engine.run(engine.prepare([seq], [prompt[start:stop]]))
        start = stop
    prompt = prompt[start:]
    out = engine.run(engine.prepare([seq], [prompt], capture_hidden=needs_hidden))
    if drafting is not None:
        drafting.keep(out, 0)
        drafting.spec.record(forwards=1)
    return sample(sampler, out, 0, seq.tokens)


def decode_one_token(engine: Engine, seq: SequenceState, token: int, sampler: Sampler) -> int:
    """Feed ``token``, the pending one; the token after it. Greedy tokens
    come from the captured decode step where it is on and serves this
    sequence (:meth:`~infer.engine.runner.Engine.greedy_step`)."""
    if not sampler.needs_logits:
        nxt = engine.greedy_step(seq, token)
        if nxt is not None:
            return nxt
    out = engine.run(engine.prepare([seq], [[token]]))
    return sample(sampler, out, 0, seq.tokens)


def decode_n_tokens(
    engine: Engine, seq: SequenceState, token: int, sampler: Sampler, stop: StopConditions, gen: Generation,
    drafting: Drafting | None = None,
) -> Iterator[int]:
    """``token``, the first new one, then more until a stop rule ends the
    request (:attr:`Generation.finish_reason` says which): one per forward
    (:func:`decode_one_token`) or, speculating, the accepted drafts and one
    token of the target's per forward (:func:`speculative_decode`)."""
    emitted, produced = [token], 0
    while True:
        for token in emitted:
            produced += 1
            if drafting is not None:
                drafting.spec.record(tokens=1)
            yield token
            reason = stop.finish_reason(token, produced, gen.prompt_tokens, engine.max_context)
            if reason is not None:
                gen.finish_reason = reason
                return
        if drafting is None:
            emitted = [decode_one_token(engine, seq, token, sampler)]
        else:
            k = drafting.spec.budget(stop.max_tokens - produced, seq.cache.capacity - seq.cached)
            emitted = speculative_decode(engine, seq, token, k, sampler, drafting)


def speculative_decode(
    engine: Engine, seq: SequenceState, pending: int, k: int, sampler: Sampler, drafting: Drafting,
) -> list[int]:
    """One round: the draft source proposes up to ``k`` tokens after
    ``pending``, one forward feeds ``pending`` and the drafts and verifies
    them all; returns the accepted drafts and one token of the target's
    (the rejected drafts leave the cache)."""
    source = drafting.spec.source
    draft = source.propose([drafting.job(seq, pending, k, sampler)])[0]
    drafts = draft.tokens[:k]
    out = engine.run(engine.prepare([seq], [[pending] + drafts], all_logits=True, capture_hidden=source.needs_hidden))
    drafting.keep(out, 0)
    return accept_drafts(engine, seq, drafting.spec, sampler, out, 0, drafts, draft.probs)


def accept_drafts(
    engine: Engine, seq: SequenceState, spec: Speculation, sampler: Sampler, out: ForwardOutput, first: int,
    drafts: list[int], q: np.ndarray | None,
) -> list[int]:
    """The tokens a verify forward gives a speculating request: its pending
    token and ``drafts`` were the last tokens fed to ``seq``, rows
    ``first..`` of ``out`` are the target's logits after each. Returns the
    accepted drafts and one token of the target's; the rejected drafts leave
    the cache, and the figures count the forward."""
    start = seq.cached - len(drafts) - 1  # the pending token's position
    q = None if q is None or not drafts else q[:len(drafts)]
    emitted = verify(sampler, out, first, seq.tokens[:start + 1], drafts, q)
    if sampler.logprobs is not None:  # row first + j predicted emitted[j]
        for j, token in enumerate(emitted):
            sampler.chose(out.host_logits()[first + j], token)
    accepted = len(emitted) - 1
    engine.truncate(seq, start + 1 + accepted)  # the pending token and the accepted drafts stay
    spec.record(forwards=1, drafted=len(drafts), accepted=accepted)
    return emitted
