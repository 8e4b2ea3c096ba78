"""Scoring: the log-probability a model gives each token of a text.

``log p(token i | tokens 0..i-1)`` is read off the logits row that predicts
token ``i``, as ``logit[token] - logsumexp(logits)`` in float64 on the host,
so the only float32 error is the forward's own (tests/README.md).

A text longer than the window (``context``) is scored in overlapping windows,
the way the Hugging Face perplexity guide and llama.cpp's ``perplexity`` tool
do: window ``w`` covers tokens ``[w * stride, w * stride + context)`` and
scores only the tokens the previous window did not reach, so every token after
the first is scored exactly once, each with at least ``context - stride``
tokens before it (except in the first window).

Every window of every text is one sequence; :func:`score_sequences` feeds them
to the runner in chunks of at most ``max_batch_tokens`` tokens per forward,
many sequences per forward, with the logits of every row
(``Engine.prepare(..., all_logits=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from infer.engine.runner import Engine, SequenceState
from infer.engine.sampling import log_softmax, token_logprob
from infer.errors import GenerationError
from infer.progress import progress_bar

#: Tokens one scoring forward feeds at most (all sequences together).
DEFAULT_SCORE_BATCH_TOKENS = 512
#: Floats of logits one forward may bring to the host (rows * vocab): 64 MiB.
_MAX_LOGIT_FLOATS = 16 * 2**20


@dataclass
class Score:
    """The log-probabilities of a text's tokens under a model.

    ``logprobs[i]`` is ``log p(token_ids[i + 1] | token_ids[: i + 1])`` (natural
    log): the first token has no prediction, so there is one value fewer than
    tokens. In a sliding window the tokens before ``token_ids[i + 1]`` that the
    model sees are those of its window (:func:`windows`).
    """

    #: The scored token ids (the text's, with the tokenizer's special tokens).
    token_ids: list[int]
    #: One natural-log probability per token after the first.
    logprobs: list[float]
    #: Per token after the first: whether it is the model's most likely one
    #: there (what greedy decoding would have chosen).
    greedy: list[bool] = field(default_factory=list)
    #: With ``top_logprobs=k``: per token after the first, the ``k`` most
    #: likely tokens there as ``(token id, logprob)``, most likely first.
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    @property
    def logprob(self) -> float:
        """The sum of :attr:`logprobs`: log p(text after its first token)."""
        return float(math.fsum(self.logprobs))

    @property
    def perplexity(self) -> float:
        """``exp(-mean(logprobs))``; ``nan`` for a text of one token."""
        if not self.logprobs:
            return math.nan
        return math.exp(-self.logprob / len(self.logprobs))


def windows(length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The sliding windows over ``length`` tokens: ``(begin, end, first)`` each,
    the window being tokens ``[begin, end)`` and the scored ones ``[first, end)``
    (``first >= 1``). Consecutive windows start ``stride`` apart; each scores
    what the previous one did not, and the last ends at ``length``."""
    if context < 2:
        raise GenerationError(f"a scoring window needs at least 2 tokens, got context={context}")
    if not 1 <= stride <= context:
        raise GenerationError(f"stride must be between 1 and the window ({context}), got {stride}")
    out, done, begin = [], 1, 0
    while done < length:
        end = min(begin + context, length)
        out.append((begin, end, done))
        done, begin = end, begin + stride
    return out


def score_sequences(
    engine: Engine, texts: Sequence[Sequence[int]], *, context: int | None = None, stride: int | None = None,
    max_batch_tokens: int = DEFAULT_SCORE_BATCH_TOKENS, top_logprobs: int = 0, progress: bool = False,
) -> list[Score]:
    """Score each token sequence of ``texts`` (see the module docs).

    Args:
        engine: the runner of the model.
        texts: token id sequences, each of at least one token.
        context: window length in tokens (default: the model's context).
        stride: how far consecutive windows start apart (default: half a
            window, so each token after the first window has at least half a
            window before it).
        max_batch_tokens: most tokens one forward feeds.
        top_logprobs: also keep the this many most likely tokens at every
            position (:attr:`Score.top`).
        progress: show a progress bar of the tokens scored (stderr; renders
            in Jupyter too).
    """
    window = engine.max_context if context is None else context
    if not isinstance(window, int) or window > engine.max_context:
        raise GenerationError(f"context must be an integer of at most the model's {engine.max_context} positions, "
                              f"got {context!r}")
    step = max(window // 2, 1) if stride is None else stride
    if max_batch_tokens < 1:
        raise GenerationError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
    scores = []
    jobs: list[_Window] = []
    for ids in texts:
        ids = [int(t) for t in ids]
        if not ids:
            raise GenerationError("cannot score an empty text: give at least one token")
        engine.check_tokens(ids)
        n = len(ids) - 1
        score = Score(ids, [math.nan] * n, [False] * n, [()] * n if top_logprobs else [])
        scores.append(score)
        jobs.extend(_Window(score, begin, end, first) for begin, end, first in windows(len(ids), window, step))
    total = sum(j.end - j.first for j in jobs)
    # Rows of logits per forward: within the batch, and within what the host takes at once.
    budget = max(1, min(max_batch_tokens, _MAX_LOGIT_FLOATS // max(engine.model.vocab_size, 1)))
    with progress_bar(progress, total=total, desc="Scoring", unit="tok") as bar:
        live = list(jobs)
        while live:
            bar.update(_step(engine, live, budget, top_logprobs))
            live = [j for j in live if not j.done]
    return scores


@dataclass
class _Window:
    """One window being scored: tokens ``[begin, end)`` of ``score.token_ids``,
    scoring ``[first, end)``; ``fed`` tokens of it are in ``seq``'s cache."""

    score: Score
    begin: int
    end: int
    first: int
    seq: SequenceState | None = None
    fed: int = 0

    @property
    def done(self) -> bool:
        return self.begin + self.fed >= self.end


def _step(engine: Engine, live: list[_Window], budget: int, top_logprobs: int) -> int:
    """One forward: the next chunk of as many live windows as ``budget``
    tokens allow (at least one token of the first); records the scored
    tokens' log-probabilities and returns how many were scored."""
    plan: list[tuple[_Window, list[int]]] = []
    for job in live:
        if budget <= 0:
            break
        if job.seq is None:
            job.seq = engine.new_sequence(job.end - job.begin)
        start = job.begin + job.fed
        n = min(job.end - start, budget)
        plan.append((job, job.score.token_ids[start:start + n]))
        budget -= n
    try:
        out = engine.run(engine.prepare([j.seq for j, _ in plan], [c for _, c in plan], all_logits=True))
        logits = out.host_logits()
    except BaseException:
        for job in live:
            _release(engine, job)
        raise
    scored = 0
    for i, (job, chunk) in enumerate(plan):
        first_row, _ = out.batch.rows(i)
        start = job.begin + job.fed  # the chunk's first token; row r predicts token start + r + 1
        for r in range(len(chunk)):
            target = start + r + 1
            if job.first <= target < job.end:
                row = logits[first_row + r]
                token = job.score.token_ids[target]
                got = token_logprob(row, token, top_logprobs)
                job.score.logprobs[target - 1] = got.logprob
                job.score.greedy[target - 1] = bool(row[token] == row.max())
                if top_logprobs:
                    job.score.top[target - 1] = got.top
                scored += 1
        job.fed += len(chunk)
        if job.done:
            _release(engine, job)
    return scored


def _release(engine: Engine, job: _Window) -> None:
    if job.seq is not None:
        engine.release(job.seq)
        job.seq = None


# -- how far one model's predictions are from another's ----------------------------------------


@dataclass
class Divergence:
    """KL(P ‖ Q) between two models' next-token distributions over one text,
    with each model's :class:`Score` of it (the same windows for both).

    ``kl[i]`` is ``sum_v p(v) * (log p(v) - log q(v))`` over the whole
    vocabulary at the position that predicts ``token_ids[i + 1]``, in nats,
    from float64 log-softmax rows of both models' logits.
    """

    #: The scored token ids.
    token_ids: list[int]
    #: One KL value per token after the first.
    kl: list[float]
    #: How P scores the text.
    p: Score
    #: How Q scores the text.
    q: Score

    @property
    def mean(self) -> float:
        """The mean over tokens of :attr:`kl` (llama.cpp's "Mean KLD")."""
        return float(math.fsum(self.kl) / len(self.kl)) if self.kl else math.nan

    @property
    def top_agreement(self) -> float:
        """The fraction of positions where P and Q have the same most likely token."""
        same = [a[0][0] == b[0][0] for a, b in zip(self.p.top, self.q.top)]  # the ids, not their logprobs
        return sum(same) / len(same) if same else math.nan


#: Floats of logits a divergence forward brings to the host per model: both
#: models' rows are taken to float64 at once, so a quarter of scoring's budget.
_MAX_DIVERGENCE_FLOATS = _MAX_LOGIT_FLOATS // 4


def divergence(
    engine_p: Engine, engine_q: Engine, ids: Sequence[int], *, context: int = 512, stride: int | None = None,
    max_batch_tokens: int = DEFAULT_SCORE_BATCH_TOKENS, progress: bool = False,
) -> Divergence:
    """KL(P ‖ Q) per token of ``ids`` between the models of two engines (see
    :class:`Divergence`), in the sliding windows of :func:`windows`.

    Both engines are fed the same chunks in lockstep, so only one chunk's rows
    of each model's logits are on the host at a time: a vocabulary of 262k
    (Gemma 3) makes a window's rows hundreds of megabytes. The tokens of a
    window before its first scored one are fed without logits.

    Args:
        engine_p, engine_q: the runners of P (the reference) and Q; their
            vocabularies must be the same size.
        ids: the text's token ids (at least one).
        context: window length in tokens (llama.cpp's ``--kl-divergence``
            with ``-c 512`` is the usual comparison).
        stride: how far consecutive windows start apart (default half a window).
        max_batch_tokens: most tokens one forward feeds.
        progress: a progress bar of the tokens scored (stderr).
    """
    vocab = engine_p.model.vocab_size
    if engine_q.model.vocab_size != vocab:
        raise GenerationError(f"cannot compare models with different vocabularies: {vocab} and "
                              f"{engine_q.model.vocab_size} tokens")
    window = context
    limit = min(engine_p.max_context, engine_q.max_context)
    if not isinstance(window, int) or window > limit:
        raise GenerationError(f"context must be an integer of at most both models' {limit} positions, got {context!r}")
    step = max(window // 2, 1) if stride is None else stride
    if max_batch_tokens < 1:
        raise GenerationError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
    ids = [int(t) for t in ids]
    if not ids:
        raise GenerationError("cannot score an empty text: give at least one token")
    engine_p.check_tokens(ids)
    engine_q.check_tokens(ids)
    n = len(ids) - 1
    out = Divergence(ids, [math.nan] * n, Score(ids, [math.nan] * n, [False] * n, [()] * n),
                     Score(ids, [math.nan] * n, [False] * n, [()] * n))
    budget = max(1, min(max_batch_tokens, _MAX_DIVERGENCE_FLOATS // max(vocab, 1)))
    spans = windows(len(ids), window, step)
    with progress_bar(progress, total=n, desc="Comparing", unit="tok") as bar:
        for begin, end, first in spans:
            _compare_window(engine_p, engine_q, out, begin, end, first, max_batch_tokens, budget)
            bar.update(end - first)
    return out


def _compare_window(engine_p: Engine, engine_q: Engine, out: Divergence, begin: int, end: int, first: int,
                    max_batch_tokens: int, budget: int) -> None:
    """Feed tokens ``[begin, end - 1)`` to both engines; the row of token
    ``t`` predicts ``t + 1``, so rows from token ``first - 1`` on are compared."""
    engines = (engine_p, engine_q)
    seqs = [e.new_sequence(end - begin) for e in engines]
    ids = out.token_ids
    try:
        for start in range(begin, first - 1, max_batch_tokens):  # context only: no logits needed
            chunk = ids[start:min(start + max_batch_tokens, first - 1)]
            for e, s in zip(engines, seqs):
                e.run(e.prepare([s], [chunk]))
        for start in range(first - 1, end - 1, budget):
            chunk = ids[start:min(start + budget, end - 1)]
            targets = np.asarray(ids[start + 1:start + 1 + len(chunk)])
            logp = [log_softmax(e.run(e.prepare([s], [chunk], all_logits=True)).host_logits())
                    for e, s in zip(engines, seqs)]
            kl = (np.exp(logp[0]) * (logp[0] - logp[1])).sum(axis=-1)
            rows = np.arange(len(chunk))
            for score, lp in zip((out.p, out.q), logp):
                got = lp[rows, targets]
                best = lp.argmax(axis=-1)
                for r in range(len(chunk)):
                    score.logprobs[start + r] = float(got[r])
                    score.greedy[start + r] = bool(lp[r, targets[r]] == lp[r, best[r]])
                    score.top[start + r] = ((int(best[r]), float(lp[r, best[r]])),)
            for r in range(len(chunk)):
                out.kl[start + r] = float(kl[r])
    finally:
        for e, s in zip(engines, seqs):
            e.release(s)


class _Loaded(Protocol):
    """What :func:`kl_divergence` needs of a model (an :class:`infer.Model`)."""

    engine: Engine
    tokenizer: Any


def kl_divergence(
    model_p: _Loaded, model_q: _Loaded, text: str | Sequence[int], *, window: int = 512, stride: int | None = None,
    add_special_tokens: bool = True, max_batch_tokens: int = DEFAULT_SCORE_BATCH_TOKENS, progress: bool = False,
) -> Divergence:
    """KL(P ‖ Q) per token of ``text`` between two loaded models, e.g. one
    model loaded exact (P) and with ``activations="q8"`` (Q): see
    :func:`divergence`. A text is tokenized by P's tokenizer; token ids are
    used as they are."""
    if isinstance(text, str):
        ids = model_p.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        ids = [int(t) for t in text]
    return divergence(model_p.engine, model_q.engine, ids, context=window, stride=stride,
                      max_batch_tokens=max_batch_tokens, progress=progress)
