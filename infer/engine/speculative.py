"""Speculative decoding: draft cheaply, verify in one forward, keep what the target agrees with.

A *draft source* proposes up to ``k`` next tokens (and, when sampling, the
distribution ``q`` it drew each from). The engine feeds the pending token and
the ``k`` drafts to the target model in **one** forward with the logits of
every row, so row ``i`` is the target's distribution ``p`` after draft ``i``.
:func:`verify_greedy` or :func:`verify_sampled` keeps the longest accepted
prefix of the drafts plus one token of the target's own (the correction at
the first rejection, or a bonus token when every draft was accepted), and the
engine rolls the KV cache back over the rejected rows. Every forward of the
target thus yields between 1 and ``k + 1`` tokens, and the tokens are those
the target alone would give: exactly so for greedy decoding, in distribution
for sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", appendix A.1; Chen et al. 2023).

Three sources share the :class:`DraftSource` interface:

* :class:`NGramDraft` — prompt lookup: the tokens that followed the most
  recent earlier occurrence of the sequence's last ``n`` tokens (no model);
* :class:`DraftModelSource` — a small model sharing the tokenizer, with a KV
  cache of its own kept in step with the accepted tokens;
* :class:`MTPDraft` — the target's own multi-token-prediction modules
  (:meth:`~infer.architecture.CausalLM.mtp_forward`), fed the target's hidden
  states.

The loops are :mod:`infer.engine.generate` (one request, a
:func:`~infer.engine.generate.speculative_decode` round per forward) and
:class:`infer.engine.batch.BatchEngine` (speculating requests inside a batch);
this module holds what is the same for both: the accept/reject rule
(:func:`verify`), the sources, the draft budget (:meth:`Speculation.budget`)
and the figures (:class:`SpeculativeStats`).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.engine.sampling import Sampler, draw
from infer.errors import GenerationError, SamplingParameterError
from infer.ops import Array

if TYPE_CHECKING:
    from infer.engine.runner import Engine, ForwardOutput, SequenceState

log = logging.getLogger(__name__)

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


# -- the accept/reject rule ---------------------------------------------------------


def verify(
    sampler: Sampler, out: ForwardOutput, first: int, history: Sequence[int], drafts: Sequence[int],
    q: np.ndarray | None,
) -> list[int]:
    """Accepted drafts plus one token of the target's, from a verify
    forward: row ``first + i`` of ``out`` holds the target's logits after the
    pending token and drafts ``0..i-1``; ``history`` is the request's tokens
    up to and including the pending one; ``q`` the draft distributions (None:
    one-hot). Each row's distribution follows the request's own sampling
    rules, its penalties and DRY over every token up to that row; XTC's is
    its mixture (drawing its coin and then a token gives exactly it), and
    mirostat's uses the ``mu`` the drafts before it would leave, so the
    accept/reject rule keeps the filtered distribution exactly."""
    count = len(drafts) + 1
    if not sampler.needs_logits:  # greedy: only the argmax of each row leaves the device
        return verify_greedy([int(t) for t in out.argmax()[first:first + count]], drafts)
    p = sampler.distributions(out.host_logits()[first:first + count], history, drafts)
    if sampler.params.greedy:  # a repetition penalty: p is one-hot at each row's penalised argmax
        return verify_greedy([int(np.argmax(r)) for r in p], drafts)
    emitted = verify_sampled(p, drafts, q, sampler.rng)
    # Row i's distribution is the target's after emitted[:i] (mirostat's mu included: distributions()
    # carried it through the drafts), so emitted[i] moves the sampler's state as a plain draw from it would.
    for i, token in enumerate(emitted):
        sampler.observe(p[i], token)
    return emitted


def verify_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Greedy verification. ``targets[i]`` is the target's choice after the
    pending token and drafts ``0..i-1`` (``len(draft) + 1`` of them). Keeps
    drafts while they equal the target's choice; then appends the target's
    choice at the first mismatch (or after the last draft). These are
    exactly the tokens plain greedy decoding would produce one by one."""
    out: list[int] = []
    for i, token in enumerate(draft):
        if token != targets[i]:
            break
        out.append(int(token))
    out.append(int(targets[len(out)]))
    return out


def verify_sampled(
    p: np.ndarray, draft: Sequence[int], q: np.ndarray | None, rng: np.random.Generator
) -> list[int]:
    """Speculative rejection sampling (Leviathan et al. 2023, Algorithm 1).

    ``p``: ``[len(draft) + 1, vocab]`` target distributions, row ``i`` after
    drafts ``0..i-1``; ``q``: ``[len(draft), vocab]`` draft distributions, row
    ``i`` the one ``draft[i]`` was drawn from (None: every draft was
    deterministic, ``q`` one-hot). Returns the accepted drafts and one more
    token, drawn so that each emitted token has exactly the target's
    distribution given everything before it.

    Why: for a draft ``x ~ q``, accept with probability ``min(1, p(x)/q(x))``.
    The chance to emit ``x`` by acceptance is ``q(x) min(1, p(x)/q(x)) =
    min(q(x), p(x))``. The chance of rejecting is ``1 - sum_x min(p, q) =
    sum_x max(0, p(x) - q(x))``, and on rejection we draw from
    ``normalize(max(0, p - q))``, which emits ``x`` with total probability
    ``max(0, p(x) - q(x))``. Summed: ``min(p, q) + max(0, p - q) = p(x)``.
    After an acceptance the next draft is judged the same way against the
    target's distribution given the accepted token, so by induction the
    whole run is distributed as the target's own samples. When every draft
    is accepted, the bonus token is drawn from ``p``'s last row directly.
    """
    k = len(draft)
    out: list[int] = []
    for i in range(k):
        x = int(draft[i])
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        # qx > 0 always holds for a token drawn from q; guard anyway (accept
        # nothing q claims it could not have drawn).
        if qx > 0 and rng.random() * qx < px:  # u < p/q, without dividing
            out.append(x)
            continue
        if q is None:
            residual = p[i].copy()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        if total <= 0.0:  # p == q on the support: rejection had probability 0 (rounding)
            residual, total = p[i], p[i].sum()
        out.append(draw(residual / total, rng))
        return out
    out.append(draw(p[k], rng))
    return out


# -- figures ------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """How well speculation worked, for one draft source (cumulative).

    ``tokens_per_forward`` counts the prefill forward and its first token, so
    plain decoding scores exactly 1.0 and ``k`` drafts at most ``k + 1``.
    """

    #: The draft source (``"ngram"``, ``"mtp"`` or ``"draft_model"``).
    source: str
    #: Forward passes of the target model.
    forwards: int = 0
    #: Tokens generated (emitted).
    tokens: int = 0
    #: Draft tokens proposed and verified.
    drafted: int = 0
    #: Draft tokens accepted.
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens generated per forward of the target model."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counts and both ratios, e.g. for JSON."""
        return dict(source=self.source, forwards=self.forwards, tokens=self.tokens, drafted=self.drafted,
                    accepted=self.accepted, acceptance_rate=self.acceptance_rate,
                    tokens_per_forward=self.tokens_per_forward)


# -- draft sources ---------------------------------------------------------------------


@dataclass
class Draft:
    """What a source proposes: up to ``k`` tokens and the distributions they
    were drawn from (``probs[i]`` for ``tokens[i]``; None when each was chosen
    deterministically, i.e. ``q`` is one-hot)."""

    tokens: list[int]
    probs: np.ndarray | None = None


@dataclass
class DraftJob:
    """One request asking its draft source for tokens."""

    #: Every token of the request so far; the last (the pending token) is not
    #: in the target's cache yet.
    tokens: list[int]
    #: Most tokens to propose (0: only keep the source's state in step).
    k: int
    #: The request's sampler (its parameters and random generator).
    sampler: Sampler
    #: The source's per-request state (:meth:`DraftSource.new_state`).
    state: Any
    #: Most positions the request can occupy.
    capacity: int
    #: The target's sequence (MTP modules keep their keys and values in it).
    seq: SequenceState | None = None
    #: Target hidden states ``[rows, d]`` of positions ``hidden_start..`` up to
    #: the pending token's (for sources with ``needs_hidden``).
    hidden: Array | None = None
    hidden_start: int = 0


class DraftSource(abc.ABC):
    """Proposes draft tokens for a batch of requests."""

    #: Name used in the figures.
    name: str = "draft"
    #: True when the engine must keep the target's hidden states (what the
    #: model's ``forward`` returns) and pass them in :attr:`DraftJob.hidden`.
    needs_hidden: bool = False

    def new_state(self) -> Any:
        """Per-request state, kept by the engine and passed back in each job."""
        return None

    @abc.abstractmethod
    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """Up to ``job.k`` draft tokens for each job (fewer, even none, is fine)."""

    def release(self, state: Any) -> None:
        """The request ended: free what its state holds (e.g. a KV cache)."""


class NGramDraft(DraftSource):
    """Prompt lookup (Saxena 2023): find the most recent earlier occurrence of
    the last ``n`` tokens, longest ``n`` first from ``max_n`` down to
    ``min_n``, and propose the tokens that followed it. Deterministic, so
    ``q`` is one-hot. Strong on tasks that copy from their input (editing,
    rewriting code, summarising with quotes)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        for label, value in (("min_n", min_n), ("max_n", max_n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SamplingParameterError(f"n-gram lookup: {label} must be a positive integer, got {value!r}")
        if min_n > max_n:
            raise SamplingParameterError(f"n-gram lookup: min_n ({min_n}) is larger than max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        return [Draft(self.lookup(job.tokens, job.k)) for job in jobs]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the
        longest suffix of ``tokens`` (of ``max_n`` down to ``min_n`` tokens)."""
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        size = arr.size
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows starting at 0..size-n-1: each has a token after it, and
            # none is the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in arr[start:start + k]]
        return []


@dataclass
class _DraftModelState:
    seq: SequenceState | None = None


class DraftModelSource(DraftSource):
    """A separate, smaller model sharing the target's tokenizer.

    It decodes ``k`` tokens autoregressively in its own KV cache (one
    contiguous cache per request). Before each proposal the cache is synced
    with the request's tokens: the longest common prefix is kept (this is
    the rollback of rejected drafts) and the rest is fed in one forward.
    When sampling, drafts are drawn with the request's own sampling
    parameters from the draft model's logits, and that distribution is ``q``.
    """

    name = "draft_model"

    def __init__(self, draft: Engine, vocab_size: int) -> None:
        self.engine = draft
        #: The target's logit width: ``q`` is padded or cut to it.
        self.vocab_size = vocab_size

    def new_state(self) -> _DraftModelState:
        return _DraftModelState()

    def release(self, state: _DraftModelState) -> None:
        if state.seq is not None:
            self.engine.release(state.seq)
            state.seq = None

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        engine = self.engine
        drafts = [Draft([]) for _ in jobs]
        active, feeds, budget = [], [], []
        for i, job in enumerate(jobs):
            state: _DraftModelState = job.state
            capacity = min(job.capacity, engine.max_context)
            # Draft positions needed: every token, then drafts 0..k-2.
            k = min(job.k, capacity - len(job.tokens) + 1)
            if k <= 0:
                continue
            if state.seq is None:
                state.seq = engine.new_sequence(capacity)
            seq = state.seq
            common = _common_prefix(seq.tokens, job.tokens, len(job.tokens) - 1)
            engine.truncate(seq, common)  # rejected drafts of the last round leave here
            active.append(i)
            feeds.append(job.tokens[common:])
            budget.append(k)
        if not active:
            return drafts
        probs: dict[int, list[np.ndarray]] = {i: [] for i in active}
        out = engine.run(engine.prepare([jobs[i].state.seq for i in active], feeds))
        for step in range(max(budget)):
            rows = out.host_logits()
            nxt = []
            for row, (i, k) in enumerate(zip(active, budget)):
                if step >= k:
                    continue
                job = jobs[i]
                history = job.tokens + drafts[i].tokens
                token, q = _choose(job.sampler, rows[row], history, self.vocab_size)
                drafts[i].tokens.append(token)
                if q is not None:
                    probs[i].append(q)
                if step + 1 < k:
                    nxt.append(i)
            # Which requests continue (the last step's tokens need no forward).
            budget = [k for i, k in zip(active, budget) if i in nxt]
            active = nxt
            if not active:
                break
            out = engine.run(engine.prepare([jobs[i].state.seq for i in active],
                                            [[drafts[i].tokens[-1]] for i in active]))
        for i, qs in probs.items():
            if qs:
                drafts[i].probs = np.stack(qs)
        return drafts


@dataclass
class _MTPState:
    #: The pending token's position at the last proposal: MTP module ``d``'s
    #: cache entries before ``valid - d`` are final.
    valid: int = 0
    #: The target's hidden states of the ``D - 1`` positions before ``valid``
    #: (deeper modules lag one position per depth and recompute them).
    tail: Array | None = None
    tail_start: int = 0


class MTPDraft(DraftSource):
    """The target's own multi-token-prediction modules (DeepSeek-V3 style).

    Module ``d`` at position ``p`` takes a hidden state at ``p`` (the
    target's for ``d = 0``, module ``d - 1``'s output for deeper ones) and the
    token at ``p + 1 + d``, and predicts the token at ``p + 2 + d``; its keys
    and values live in cache layer ``num_layers + d`` of the target's own
    sequence. With ``c`` the pending token's position, each proposal runs the
    modules in turn over the positions from where their caches are no longer
    final up to ``c - 1``: module ``d``'s entries are final before ``c - d``
    (their tokens are accepted ones), and its last row, fed draft ``d``,
    predicts draft ``d + 1``. So ``D`` modules give ``D`` drafts from one
    position, as they were trained. Past ``D`` drafts, the last module is
    chained on its own output and the last draft, one position further each
    time, as engines do with a single-module checkpoint. Entries written from
    draft tokens are overwritten by the next proposal. See docs/mtp.md.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, target: Engine) -> None:
        if target.model.num_mtp_modules < 1:
            raise GenerationError(
                f"speculative='mtp' needs multi-token-prediction modules, but this "
                f"{type(target.model).__name__} checkpoint ships none (num_mtp_modules = 0); "
                f"use speculative='ngram' or a draft model instead"
            )
        self.engine = target
        self.modules = target.model.num_mtp_modules

    def new_state(self) -> _MTPState:
        return _MTPState()

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        engine, ops, depths = self.engine, self.engine.backend, self.modules
        drafts = [Draft([]) for _ in jobs]
        probs: dict[int, list[np.ndarray]] = {}
        # Per job: [index, first position, c, input hidden rows from the first position on].
        work: list[list[Any]] = []
        for i, job in enumerate(jobs):
            if job.hidden is None or job.seq is None:
                continue
            state: _MTPState = job.state
            c = len(job.tokens) - 1
            rows, first = job.hidden, job.hidden_start
            if state.tail is not None and state.valid == first:  # the kept rows continue these
                rows, first = ops.concat([state.tail, rows], 0), state.tail_start
            start = max(first, state.valid - (depths - 1))
            if start >= c:
                continue
            keep = max(first, c - (depths - 1))
            state.tail = ops.slice(rows, 0, keep - first, c - first) if depths > 1 and keep < c else None
            state.tail_start, state.valid = keep, c
            work.append([i, start, c, ops.slice(rows, 0, start - first, c - first)])
        for depth in range(depths):
            batch = []
            for w in work:
                i, start, c, _ = w
                job = jobs[i]
                end = c if depth < job.k else c - depth  # to c - 1 when drafting, else the final entries
                if end > start:
                    ext = job.tokens + drafts[i].tokens
                    batch.append((w, end, ext[start + 1 + depth:end + 1 + depth]))
            if not batch:
                break
            logits, hidden = engine.mtp_forward(
                depth, [jobs[w[0]].seq for w, _, _ in batch], [w[1] for w, _, _ in batch],  # type: ignore[misc]
                _concat(ops, [ops.slice(w[3], 0, 0, end - w[1]) for w, end, _ in batch]), [t for _, _, t in batch])
            rows_np = ops.to_numpy(logits)
            offset = 0
            for r, (w, end, _) in enumerate(batch):
                w[3] = ops.slice(hidden, 0, offset, offset + end - w[1])  # module depth + 1's input
                offset += end - w[1]
                if end == w[2]:  # its last row is position c - 1: a draft
                    self._add(jobs[w[0]], drafts[w[0]], probs, rows_np[r])
            work = [w for w, _, _ in batch]
        # More drafts than modules: chain the last module past c - 1.
        chain = [w for w in work if len(drafts[w[0]].tokens) == depths and jobs[w[0]].k > depths]
        position = {w[0]: w[2] - 1 for w in chain}
        hid = {w[0]: ops.slice(w[3], 0, w[2] - w[1] - 1, w[2] - w[1]) for w in chain}
        idx = [w[0] for w in chain]
        while idx:
            for i in idx:
                position[i] += 1
            logits, hidden = engine.mtp_forward(
                depths - 1, [jobs[i].seq for i in idx], [position[i] for i in idx],  # type: ignore[misc]
                _concat(ops, [hid[i] for i in idx]), [[drafts[i].tokens[-1]] for i in idx])
            rows_np = ops.to_numpy(logits)
            for r, i in enumerate(idx):
                hid[i] = ops.slice(hidden, 0, r, r + 1)
                self._add(jobs[i], drafts[i], probs, rows_np[r])
            idx = [i for i in idx if len(drafts[i].tokens) < jobs[i].k]
        for draft in drafts:
            if id(draft) in probs:
                draft.probs = np.stack(probs[id(draft)])
        return drafts

    @staticmethod
    def _add(job: DraftJob, draft: Draft, probs: dict[int, list[np.ndarray]], logits: np.ndarray) -> None:
        token, q = _choose(job.sampler, logits, job.tokens + draft.tokens, None)
        draft.tokens.append(token)
        if q is not None:
            probs.setdefault(id(draft), []).append(q)


def _choose(sampler: Sampler, logits: np.ndarray, history: list[int], width: int | None) -> tuple[int, np.ndarray | None]:
    """A draft token from a draft's logits, by the request's own rules:
    greedy picks the argmax (q one-hot: None); sampling draws from the
    processed distribution, which is q (cut or zero-padded to ``width``)."""
    if width is not None and logits.shape[-1] > width:
        logits = logits[:width]  # ids past the target's vocabulary are padding
    if sampler.params.greedy:
        return int(np.argmax(sampler.distribution(logits, history))), None
    q = sampler.distribution(logits, history)
    token = sampler.draw(q)
    if width is not None and q.size < width:
        q = np.concatenate([q, np.zeros(width - q.size)])
    return token, q


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _concat(ops: Any, parts: list[Array]) -> Array:
    return parts[0] if len(parts) == 1 else ops.concat(parts, 0)


# -- choosing a source -------------------------------------------------------------------


@dataclass
class Speculation:
    """A request's speculative decoding: its source and ``k`` (the most draft
    tokens per target forward)."""

    source: DraftSource
    num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    #: Further counters to add this request's figures to (e.g. a model's or
    #: a batch engine's totals).
    totals: list[SpeculativeStats] = field(default_factory=list)
    #: This request's figures.
    stats: SpeculativeStats = field(init=False)

    def __post_init__(self) -> None:
        k = self.num_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SamplingParameterError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if not isinstance(self.source, DraftSource):
            raise SamplingParameterError(f"a speculation's source must be a DraftSource, got {self.source!r}")
        self.stats = SpeculativeStats(self.source.name)

    def budget(self, left: int, room: int) -> int:
        """Drafts the next verify forward may hold: at most
        :attr:`num_tokens`, fewer than the ``left`` tokens the request may
        still emit (the target's own token is one more) and than the ``room``
        positions its sequence has from the pending token's on."""
        return max(0, min(self.num_tokens, left - 1, room - 1))

    def record(self, *, forwards: int = 0, tokens: int = 0, drafted: int = 0, accepted: int = 0) -> None:
        """Count a target forward's outcome here and in every total."""
        for stats in (self.stats, *self.totals):
            stats.forwards += forwards
            stats.tokens += tokens
            stats.drafted += drafted
            stats.accepted += accepted
