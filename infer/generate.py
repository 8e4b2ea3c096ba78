"""Generating one request's tokens, a step at a time.

Each step is a function named after it:

* :func:`prefill` — the whole prompt in one forward; the first new token;
* :func:`decode_one_token` — feed the pending token; the next one;
* :func:`decode_n_tokens` — one token per forward until a stop rule ends the request;
* :func:`speculative_decode` — a draft source guesses up to ``k`` tokens,
  one forward verifies them all, and the tokens the target agrees with are
  kept (:mod:`infer.speculative`), until a stop rule ends the request.

:func:`generate` starts a request on one of the two loops. The rules every
loop follows live here once, and the batch engine (:mod:`infer.batching`)
uses them too: :meth:`StopConditions.finish_reason` (when a request ends),
:func:`sample` (a token from a forward's row of logits) and
:func:`accept_drafts` (what a verify forward gives a speculating request).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from infer.engine import Engine, ForwardOutput, SequenceState
from infer.errors import SamplingParameterError
from infer.sampling import Sampler, SamplingParams
from infer.speculative import DraftJob, Speculation, SpeculativeStats, verify


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

    def __iter__(self) -> Iterator[int]:
        for token in self.tokens_iter:
            self.tokens.append(token)
            yield token


def generate(
    engine: Engine, prompt_ids: Sequence[int], sampling: SamplingParams, stop: StopConditions,
    speculation: Speculation | None = None,
) -> Generation:
    """Start a request; iterate the result for its new token ids. With a
    :class:`~infer.speculative.Speculation`, tokens come from
    :func:`speculative_decode` (the same tokens for greedy decoding)."""
    engine.check_prompt(prompt_ids)
    prompt = [int(t) for t in prompt_ids]
    gen = Generation(tokens_iter=iter(()), prompt_tokens=len(prompt),
                     stats=None if speculation is None else speculation.stats)
    gen.tokens_iter = _tokens(engine, prompt, Sampler(sampling), stop, speculation, gen)
    return gen


def _tokens(
    engine: Engine, prompt: list[int], sampler: Sampler, stop: StopConditions, spec: Speculation | None,
    gen: Generation,
) -> Iterator[int]:
    if stop.max_tokens == 0:
        gen.finish_reason = "length"
        return
    seq = engine.new_sequence(len(prompt) + stop.max_tokens)
    try:
        if spec is None:
            yield from decode_n_tokens(engine, seq, prefill(engine, seq, prompt, sampler), sampler, stop, gen)
        else:
            yield from speculative_decode(engine, seq, prompt, sampler, stop, spec, gen)
    finally:  # also when the consumer stops early and the generator is closed
        engine.release(seq)


def sample(sampler: Sampler, out: ForwardOutput, row: int, history: Sequence[int]) -> int:
    """The next token from logits row ``row`` of ``out``. When the argmax
    alone decides (greedy, no penalty) it comes from the device and only the
    ids leave it; otherwise the request's rules run on the host, with
    ``history`` (the tokens so far) for the repetition penalty."""
    if not sampler.needs_logits:
        return int(out.argmax()[row])
    return sampler.sample(out.host_logits()[row], history)


def prefill(engine: Engine, seq: SequenceState, prompt: list[int], sampler: Sampler) -> int:
    """The whole prompt in one forward; the first new token."""
    out = engine.run(engine.prepare([seq], [prompt]))
    return sample(sampler, out, 0, seq.tokens)


def decode_one_token(engine: Engine, seq: SequenceState, token: int, sampler: Sampler) -> int:
    """Feed ``token``, the pending one; the token after it."""
    out = engine.run(engine.prepare([seq], [[token]]))
    return sample(sampler, out, 0, seq.tokens)


def decode_n_tokens(
    engine: Engine, seq: SequenceState, token: int, sampler: Sampler, stop: StopConditions, gen: Generation,
) -> Iterator[int]:
    """``token``, the first new one, then one token per forward until a
    stop rule ends the request (:attr:`Generation.finish_reason` says which)."""
    produced = 0
    while True:
        produced += 1
        yield token
        reason = stop.finish_reason(token, produced, gen.prompt_tokens, engine.max_context)
        if reason is not None:
            gen.finish_reason = reason
            return
        token = decode_one_token(engine, seq, token, sampler)


def speculative_decode(
    engine: Engine, seq: SequenceState, prompt: list[int], sampler: Sampler, stop: StopConditions,
    spec: Speculation, gen: Generation,
) -> Iterator[int]:
    """Prefill, then rounds of: the draft source proposes up to ``k`` tokens
    after the pending one, one forward verifies them all, the accepted ones
    and one of the target's come out, the cache rolls back over the rest.
    Stops exactly where :func:`decode_n_tokens` would."""
    source = spec.source
    state = source.new_state()
    try:
        out = engine.run(engine.prepare([seq], [prompt], capture_hidden=source.needs_hidden))
        spec.record(forwards=1)
        emitted, start, produced = [sample(sampler, out, 0, seq.tokens)], 0, 0
        while True:
            for token in emitted:
                produced += 1
                spec.record(tokens=1)
                yield token
                reason = stop.finish_reason(token, produced, gen.prompt_tokens, engine.max_context)
                if reason is not None:
                    gen.finish_reason = reason
                    return
            pending = emitted[-1]
            k = spec.budget(stop.max_tokens - produced, seq.cache.capacity - seq.cached)
            job = DraftJob(tokens=seq.tokens + [pending], k=k, sampler=sampler, state=state,
                           capacity=seq.cache.capacity, seq=seq, hidden=out.hidden, hidden_start=start)
            draft = source.propose([job])[0]
            drafts = draft.tokens[:k]
            start = seq.cached
            out = engine.run(engine.prepare([seq], [[pending] + drafts], all_logits=True,
                                            capture_hidden=source.needs_hidden))
            emitted = accept_drafts(engine, seq, spec, sampler, out, 0, drafts, draft.probs)
    finally:  # also when the consumer stops early and the generator is closed
        source.release(state)


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
    accepted = len(emitted) - 1
    engine.truncate(seq, start + 1 + accepted)  # the pending token and the accepted drafts stay
    spec.record(forwards=1, drafted=len(drafts), accepted=accepted)
    return emitted
