"""The engine: the loop that keeps calling the model.

It owns the KV cache (DESIGN.md rule 3). A request is prefilled in one
forward over the whole prompt, then decoded one token per forward, each
step feeding back the token just sampled. The architecture sees only an
:class:`~infer.attention.AttentionContext` per forward.

Later engines (continuous batching, speculation) build on the same three
steps: :meth:`Engine.forward` over a batch of sequence slices,
:meth:`Engine.prefill` and :meth:`Engine.decode_one_token`.

A sequence's cache is contiguous (:class:`~infer.cache.ContiguousKVCache`,
the default) or a page table into a shared pool
(:class:`~infer.paged_cache.PagedSequenceCache`) when the engine is given a
:class:`~infer.paged_cache.PagedKVPool` (``Engine(..., kv_pool=pool)``, or
per sequence ``new_sequence(kv_pool=pool)``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from infer.architecture import CausalLM
from infer.attention import AttentionContext, SequenceSlice
from infer.cache import ContiguousKVCache
from infer.errors import ContextLengthError, GenerationError, SamplingParameterError
from infer.ops import Array, Backend
from infer.paged_cache import PagedKVPool, PagedSequenceCache
from infer.sampling import Sampler, SamplingParams
from infer.speculative import DraftJob, Speculation, SpeculativeStats, verify_greedy, verify_sampled

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """One sequence being generated: its tokens and its cache."""

    tokens: list[int]
    cache: ContiguousKVCache | PagedSequenceCache

    @property
    def cached(self) -> int:
        """Positions already in the KV cache."""
        return self.cache.length


@dataclass
class StopConditions:
    """When a request ends (text-level stop strings are handled by the caller)."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise SamplingParameterError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")


@dataclass
class ForwardOutput:
    """What one forward returns: logits, and the hidden states of every new
    token when they were asked for."""

    logits: Array
    hidden: Array | None = None


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


def _logit_rows(slices: Sequence[SequenceSlice], all_logits: bool | Sequence[bool]) -> list[int] | None:
    """The rows of a forward's flattened tokens whose logits are wanted:
    every new token of a sequence whose ``all_logits`` flag is set (one flag
    for all, or one per sequence), else its last one. None: every row."""
    every = [all_logits] * len(slices) if isinstance(all_logits, bool) else list(all_logits)
    if len(every) != len(slices):
        raise GenerationError(f"all_logits has {len(every)} flags for {len(slices)} sequences")
    rows, offset = [], 0
    for s, whole in zip(slices, every):
        rows.extend(range(offset, offset + s.length) if whole else [offset + s.length - 1])
        offset += s.length
    return None if len(rows) == offset else rows


def _rows(ops: Backend, hidden: Array, rows: list[int] | None) -> Array:
    """``rows`` of ``hidden`` (None: all of them), so the head projects only those."""
    return hidden if rows is None else ops.take(hidden, ops.from_numpy(np.asarray(rows, dtype=np.int32)), axis=0)


class Engine:
    """Runs a :class:`~infer.architecture.CausalLM` on a backend."""

    def __init__(self, model: CausalLM, backend: Backend, kv_pool: PagedKVPool | None = None) -> None:
        self.model = model
        self.backend = backend
        self.max_context = model.max_context
        #: Where new sequences keep their keys and values: pages of this pool,
        #: or (None) a contiguous cache each.
        self.kv_pool = kv_pool
        self._kv_bytes_per_position: int | None = None

    # -- sequences ----------------------------------------------------------

    def new_sequence(
        self, capacity: int | None = None, *, kv_pool: PagedKVPool | None = None, contiguous: bool = False,
    ) -> SequenceState:
        """A fresh sequence whose cache holds ``capacity`` positions (default:
        the model's context): pages of ``kv_pool`` (default: the engine's
        :attr:`kv_pool`), or a contiguous cache when there is no pool or
        ``contiguous`` is set."""
        capacity = self.max_context if capacity is None else min(capacity, self.max_context)
        pool = kv_pool if kv_pool is not None else self.kv_pool
        if pool is not None and not contiguous:
            return SequenceState(tokens=[], cache=pool.new_sequence(capacity))
        return SequenceState(tokens=[], cache=ContiguousKVCache(self.backend, self.model.num_cache_layers, capacity))

    def kv_bytes_per_position(self) -> int:
        """Bytes one position takes in every KV cache layer (the main model's
        and the MTP modules'), measured once, with a one-token forward (and
        one step of each MTP module) into a throwaway contiguous cache, so
        every layer's real key and value shapes and dtypes count
        (sliding-window layers, latent attention, ...)."""
        if self._kv_bytes_per_position is None:
            ops, model = self.backend, self.model
            cache = ContiguousKVCache(ops, model.num_cache_layers, 1)
            ids = ops.from_numpy(np.zeros(1, dtype=np.int32))
            hidden = model.forward(ids, AttentionContext(ops, [SequenceSlice(cache, 0, 1)]))
            for depth in range(model.num_mtp_modules):
                hidden = model.mtp_forward(depth, hidden, ids, AttentionContext(ops, [SequenceSlice(cache, 0, 1)]))
            self._kv_bytes_per_position = cache.nbytes_per_position
        return self._kv_bytes_per_position

    def release(self, seq: SequenceState) -> None:
        """Done with ``seq``: a paged cache's pages return to the pool now
        (a contiguous cache is simply dropped with the sequence)."""
        if isinstance(seq.cache, PagedSequenceCache):
            seq.cache.free()

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Every id must be an int within the vocabulary."""
        vocab = self.model.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise GenerationError(f"token id {t!r} at index {i} is outside the vocabulary [0, {vocab})")

    # -- the three steps ------------------------------------------------------

    def forward(self, seq: SequenceState, token_ids: Sequence[int], *, all_logits: bool = False) -> Array:
        """Run the model on ``token_ids`` appended to ``seq``; returns logits
        ``[rows, vocab]`` for every new token (``all_logits``) or the last."""
        if not token_ids:
            raise GenerationError("forward needs at least one token")
        return self.run([seq], [token_ids], all_logits=all_logits).logits

    def forward_batch(
        self, seqs: Sequence[SequenceState], token_ids: Sequence[Sequence[int]], *,
        all_logits: bool | Sequence[bool] = False,
    ) -> Array:
        """One forward over several sequences at once: ``token_ids[i]`` (non-empty)
        appended to ``seqs[i]``, all flattened into one batch of
        :class:`~infer.attention.SequenceSlice`\\ s. Returns logits of each
        sequence's last new token, or of all its new tokens where
        ``all_logits`` (one flag, or one per sequence) says so, in batch
        order. The continuous-batching engine (:mod:`infer.batching`) calls this."""
        return self.run(seqs, token_ids, all_logits=all_logits).logits

    def run(
        self, seqs: Sequence[SequenceState], token_ids: Sequence[Sequence[int]], *,
        all_logits: bool | Sequence[bool] = False, capture_hidden: bool = False,
    ) -> ForwardOutput:
        """:meth:`forward_batch`, also returning the hidden states of every
        new token when ``capture_hidden`` (for multi-token prediction)."""
        if not seqs or len(seqs) != len(token_ids) or any(len(t) == 0 for t in token_ids):
            raise GenerationError("forward_batch needs one non-empty token list per sequence")
        slices = []
        for seq, ids in zip(seqs, token_ids):
            start = seq.cache.length
            if start + len(ids) > seq.cache.capacity:
                raise ContextLengthError(
                    f"sequence would reach {start + len(ids)} positions; its cache holds "
                    f"{seq.cache.capacity} (model context {self.max_context})"
                )
            slices.append(SequenceSlice(seq.cache, start, len(ids)))
        ops = self.backend
        flat = np.asarray([int(t) for ids in token_ids for t in ids], dtype=np.int32)
        rows = _logit_rows(slices, all_logits)
        hidden = self.model.forward(ops.from_numpy(flat), AttentionContext(ops, slices))
        logits = self.model.compute_logits(_rows(ops, hidden, rows))
        for seq, ids, s in zip(seqs, token_ids, slices):
            if isinstance(seq.cache, PagedSequenceCache):
                seq.cache.commit(ids)  # the ids key its full blocks in the prefix cache
            else:
                seq.cache.length = s.start + len(ids)
            seq.tokens.extend(int(t) for t in ids)
        return ForwardOutput(logits, hidden if capture_hidden else None)

    def mtp_forward(
        self, depth: int, seqs: Sequence[SequenceState], starts: Sequence[int], hidden: Array,
        token_ids: Sequence[Sequence[int]],
    ) -> tuple[Array, Array]:
        """Run MTP module ``depth`` over several sequences: rows at positions
        ``starts[i]..`` of ``seqs[i]`` (their cache layer ``num_layers +
        depth``; nothing is committed), ``hidden`` the flattened input states,
        ``token_ids[i]`` the tokens one position ahead. Returns each
        sequence's last-row logits and the output hidden states of every row."""
        ops = self.backend
        slices = [SequenceSlice(seq.cache, start, len(ids)) for seq, start, ids in zip(seqs, starts, token_ids)]
        flat = np.asarray([int(t) for ids in token_ids for t in ids], dtype=np.int32)
        out = self.model.mtp_forward(depth, hidden, ops.from_numpy(flat), AttentionContext(ops, slices))
        return self.model.mtp_compute_logits(depth, _rows(ops, out, _logit_rows(slices, False))), out

    def truncate(self, seq: SequenceState, length: int) -> None:
        """Forget ``seq``'s positions from ``length`` on (rejected speculative
        tokens): its cache rolls back and the next forward starts there."""
        seq.cache.truncate(length)
        del seq.tokens[seq.cache.length:]

    def prefill(self, seq: SequenceState, prompt_ids: Sequence[int]) -> Array:
        """Process the whole prompt in one forward; logits of its last token."""
        return self.forward(seq, prompt_ids)[-1]

    def decode_one_token(self, seq: SequenceState, token_id: int) -> Array:
        """Feed one token; the logits for the next."""
        return self.forward(seq, [token_id])[-1]

    # -- the loop -----------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """A prompt must be non-empty, in the vocabulary, and leave room to generate."""
        if len(prompt_ids) == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        self.check_tokens(prompt_ids)
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.max_context} positions, and at least one must remain for generation: "
                f"shorten the prompt by {len(prompt_ids) - self.max_context + 1} tokens or more"
            )

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, stop: StopConditions,
        speculation: Speculation | None = None,
    ) -> Generation:
        """Start a request; iterate the result for its new token ids. With a
        :class:`~infer.speculative.Speculation`, tokens come from
        :meth:`speculative_decode` (the same tokens for greedy decoding)."""
        self.check_prompt(prompt_ids)
        prompt = [int(t) for t in prompt_ids]
        generation = Generation(tokens_iter=iter(()), prompt_tokens=len(prompt))
        if speculation is None:
            generation.tokens_iter = self._run(prompt, Sampler(sampling), stop, generation)
        else:
            generation.stats = speculation.stats
            generation.tokens_iter = self.speculative_decode(prompt, Sampler(sampling), stop, speculation, generation)
        return generation

    def _next_token(self, sampler: Sampler, logits: Array, seq: SequenceState) -> int:
        if not sampler.needs_logits:  # only the sampled id leaves the device
            return int(self.backend.to_numpy(self.backend.argmax(logits, axis=-1)))
        return sampler.sample(self.backend.to_numpy(logits), seq.tokens)

    def _run(self, prompt: list[int], sampler: Sampler, stop: StopConditions, gen: Generation) -> Iterator[int]:
        if stop.max_tokens == 0:
            gen.finish_reason = "length"
            return
        seq = self.new_sequence(len(prompt) + stop.max_tokens)
        try:
            logits = self.prefill(seq, prompt)
            produced = 0
            while True:
                token = self._next_token(sampler, logits, seq)
                produced += 1
                yield token
                if not stop.ignore_eos and token in stop.eos_token_ids:
                    gen.finish_reason = "stop"
                    return
                if produced >= stop.max_tokens or seq.cache.length >= self.max_context:
                    gen.finish_reason = "length"
                    return
                logits = self.decode_one_token(seq, token)
        finally:  # also when the consumer stops early and the generator is closed
            self.release(seq)

    # -- speculative decoding -----------------------------------------------------------

    def speculative_decode(
        self, prompt: list[int], sampler: Sampler, stop: StopConditions, spec: Speculation, gen: Generation,
    ) -> Iterator[int]:
        """Draft, verify all drafts in one forward, keep the accepted prefix
        plus one token of the target's, roll the cache back over the rest
        (see :mod:`infer.speculative`). Stops exactly where :meth:`generate`
        without speculation would."""
        if stop.max_tokens == 0:
            gen.finish_reason = "length"
            return
        source = spec.source
        capacity = min(len(prompt) + stop.max_tokens, self.max_context)
        seq = self.new_sequence(capacity)
        state = source.new_state()
        try:
            out = self.run([seq], [prompt], capture_hidden=source.needs_hidden)
            hidden, hidden_start = out.hidden, 0
            emitted = [self._next_token(sampler, out.logits[-1], seq)]
            produced = 0
            spec.record(forwards=1)
            while True:
                for token in emitted:
                    produced += 1
                    spec.record(tokens=1)
                    yield token
                    if not stop.ignore_eos and token in stop.eos_token_ids:
                        gen.finish_reason = "stop"
                        return
                    if produced >= stop.max_tokens:
                        gen.finish_reason = "length"
                        return
                if seq.cache.length >= self.max_context:
                    gen.finish_reason = "length"
                    return
                pending = emitted[-1]
                # Drafts: no more than can still be emitted (the bonus token
                # is one more) and than fit the sequence after the pending token.
                k = min(spec.num_tokens, stop.max_tokens - produced - 1, capacity - seq.cache.length - 1)
                job = DraftJob(tokens=seq.tokens + [pending], k=max(k, 0), sampler=sampler, state=state,
                               capacity=capacity, seq=seq, hidden=hidden, hidden_start=hidden_start)
                draft = source.propose([job])[0]
                drafts = draft.tokens[: max(k, 0)]
                start = seq.cache.length
                out = self.run([seq], [[pending] + drafts], all_logits=True, capture_hidden=source.needs_hidden)
                emitted = self._verify(sampler, out.logits, seq, start, drafts, draft.probs)
                accepted = len(emitted) - 1
                spec.record(forwards=1, drafted=len(drafts), accepted=accepted)
                self.truncate(seq, start + 1 + accepted)  # rejected drafts leave the cache
                hidden, hidden_start = out.hidden, start
        finally:  # also when the consumer stops early and the generator is closed
            source.release(state)
            self.release(seq)

    def _verify(
        self, sampler: Sampler, logits: Array, seq: SequenceState, start: int, drafts: list[int],
        q: np.ndarray | None,
    ) -> list[int]:
        """Accepted drafts plus one target token, from the verify forward's
        rows (row ``i``: after the pending token and drafts ``0..i-1``)."""
        ops = self.backend
        if not sampler.needs_logits:  # greedy: only the argmax of each row leaves the device
            return verify_greedy([int(t) for t in ops.to_numpy(ops.argmax(logits, axis=-1))], drafts)
        rows = ops.to_numpy(logits)
        # Each row's distribution under the request's own rules; its history
        # (repetition penalty) is every token up to and including that row's.
        p = np.stack([sampler.distribution(rows[i], seq.tokens[: start + 1 + i]) for i in range(len(drafts) + 1)])
        if sampler.params.greedy:
            return verify_greedy([int(np.argmax(r)) for r in p], drafts)
        return verify_sampled(p, drafts, q if q is None else q[: len(drafts)], sampler.rng)
