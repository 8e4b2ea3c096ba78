"""Choosing the next token from logits.

The rules, applied in the order transformers applies them:

1. logit bias (OpenAI's ``logit_bias``): a fixed number added to the logit
   of each listed token id (-100 in effect bans a token, +100 forces it);
   then the repetition penalty (CTRL, Keskar et al. 2019): the logit of every
   token already in the sequence, prompt included, is divided by the penalty
   if positive, multiplied if negative; then OpenAI's presence and frequency
   penalties over the tokens *generated* so far: token ``j`` produced
   ``c[j]`` times loses ``c[j] * frequency_penalty + (c[j] > 0) *
   presence_penalty`` (the formula of OpenAI's API reference);
2. temperature 0 picks the argmax (greedy; the first index wins ties);
   otherwise logits are divided by the temperature;
3. top-k keeps the k most likely tokens;
4. top-p (nucleus, Holtzman et al. 2019) keeps the smallest set of most
   likely tokens whose probability reaches p;
5. min-p keeps tokens whose probability is at least ``min_p`` times the most
   likely one's;
6. a token is drawn from what remains, renormalised.

llama.cpp's samplers join these (:mod:`infer.engine.samplers`): DRY after
the penalties, top-nσ, locally typical sampling and XTC among the filters,
mirostat instead of them, a window (``penalty_last_n``) for the penalties,
and a ``samplers`` list that orders the chain. Each is off by default, and
the order above stays unless ``samplers`` is given, so an output that used
none of them is what it was before them.

Temperature 0 is greedy decoding: the argmax of the logits after the bias,
the penalties and DRY (those the chain has); the filters (which all keep the
most likely token but XTC) and mirostat do not apply.

Sampling runs on the host in float64 over a ``[vocab]`` array, with a
per-request :class:`numpy.random.Generator`, so a seed repeats a run exactly.

A :class:`Sampler` may also record each chosen token's log-probability and
its most likely alternatives (:class:`TokenLogprob`), under the model's own
distribution: the log-softmax of the raw logits, before any rule above, so a
recorded value equals what scoring the text gives (:mod:`infer.engine.scoring`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from infer.engine import samplers as chain
from infer.errors import SamplingParameterError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. The defaults are greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    #: OpenAI's penalties, each in [-2, 2] (0 = off; see the module docs).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Token id -> bias added to its logit, each in [-100, 100]; a mapping
    #: given here is kept as sorted ``(id, bias)`` pairs (the params stay hashable).
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    #: The penalties' window: the last this many tokens (-1: the whole sequence; 0: no penalties).
    penalty_last_n: int = -1
    #: DRY (0 = off): a repeat ``n >= dry_allowed_length`` tokens long costs the token that would
    #: extend it ``dry_multiplier * dry_base ** (n - dry_allowed_length)``, over the last
    #: ``dry_penalty_last_n`` tokens (-1: all; 0: off); ``dry_sequence_breakers`` end a repeat.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = chain.DRY_SEQUENCE_BREAKERS
    #: XTC (0 = off): with this probability, remove the tokens at least ``xtc_threshold`` likely but the least.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    #: Top-nσ (<= 0 = off): keep logits within this many standard deviations of the largest.
    top_n_sigma: float = -1.0
    #: Locally typical sampling (1 = off).
    typical_p: float = 1.0
    #: Mirostat 1 or 2 (0 = off) with target surprise ``mirostat_tau`` and learning rate ``mirostat_eta``.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    #: The chain's order, llama.cpp's names (:data:`~infer.engine.samplers.SAMPLERS`); None: the
    #: default order (:data:`~infer.engine.samplers.DEFAULT_ORDER`). A sampler left out does not run.
    samplers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        def number(name: str, value: object, integer: bool = False) -> float:
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if not ok or isinstance(value, bool) or (isinstance(value, float) and not np.isfinite(value)):
                kind = "an integer" if integer else "a finite number"
                raise SamplingParameterError(f"{name} must be {kind}, got {value!r}")
            try:
                return float(value)  # type: ignore[arg-type]
            except OverflowError:  # an int past float's range
                raise SamplingParameterError(f"{name} must be a finite number, got an integer of "
                                             f"{value.bit_length()} bits") from None  # type: ignore[union-attr]

        if number("temperature", self.temperature) < 0:
            raise SamplingParameterError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if number("top_k", self.top_k, integer=True) < 0:
            raise SamplingParameterError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise SamplingParameterError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= number("min_p", self.min_p) < 1:
            raise SamplingParameterError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise SamplingParameterError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or self.seed < 0):
            raise SamplingParameterError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name, getattr(self, name)) <= 2:
                raise SamplingParameterError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias, number))

        def window(name: str) -> None:
            if number(name, getattr(self, name), integer=True) < -1:
                raise SamplingParameterError(f"{name} must be an integer >= -1 (-1 = the whole sequence, "
                                             f"0 = off), got {getattr(self, name)}")

        window("penalty_last_n")
        window("dry_penalty_last_n")
        if number("dry_multiplier", self.dry_multiplier) < 0:
            raise SamplingParameterError(f"dry_multiplier must be >= 0 (0 = off), got {self.dry_multiplier}")
        if number("dry_base", self.dry_base) < 1:
            raise SamplingParameterError(f"dry_base must be >= 1, got {self.dry_base}")
        if number("dry_allowed_length", self.dry_allowed_length, integer=True) < 0:
            raise SamplingParameterError(f"dry_allowed_length must be an integer >= 0, got {self.dry_allowed_length}")
        breakers = self.dry_sequence_breakers
        if (isinstance(breakers, (str, bytes)) or not isinstance(breakers, Iterable)
                or not (breakers := tuple(breakers)) or not all(isinstance(s, str) and s for s in breakers)):
            raise SamplingParameterError(
                f"dry_sequence_breakers must be a non-empty list of non-empty strings, got {self.dry_sequence_breakers!r}")
        object.__setattr__(self, "dry_sequence_breakers", breakers)
        for name in ("xtc_probability", "xtc_threshold"):
            if not 0 <= number(name, getattr(self, name)) <= 1:
                raise SamplingParameterError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        number("top_n_sigma", self.top_n_sigma)
        if not 0 <= number("typical_p", self.typical_p) <= 1:
            raise SamplingParameterError(f"typical_p must be in [0, 1] (1 = off), got {self.typical_p}")
        if not isinstance(self.mirostat, int) or isinstance(self.mirostat, bool) or self.mirostat not in (0, 1, 2):
            raise SamplingParameterError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat!r}")
        for name in ("mirostat_tau", "mirostat_eta"):
            if number(name, getattr(self, name)) < 0:
                raise SamplingParameterError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.samplers is not None:
            object.__setattr__(self, "samplers", chain.sampler_order(self.samplers))

    @property
    def order(self) -> tuple[str, ...]:
        """The chain's steps: :attr:`samplers`, else the default order."""
        return chain.DEFAULT_ORDER if self.samplers is None else self.samplers

    @property
    def penalties_on(self) -> bool:
        """Whether the ``penalties`` step changes anything."""
        return bool("penalties" in self.order and self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty))

    @property
    def dry_on(self) -> bool:
        """Whether the ``dry`` step changes anything."""
        return bool("dry" in self.order and self.dry_multiplier and self.dry_penalty_last_n != 0)

    @property
    def penalized(self) -> bool:
        """Whether any rule reads the history or shifts logits (so greedy
        decoding needs the logits on the host, not just their argmax)."""
        return bool(self.penalties_on or self.dry_on or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _bias_pairs(bias: object, number: Callable[[str, object], float]) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(id, bias)`` pairs, each checked (``number`` checks a value)."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise SamplingParameterError(f"logit_bias must map token ids to numbers, got {bias!r}")
    pairs = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise SamplingParameterError(f"logit_bias must map token ids to numbers, got {bias!r}")
        token, value = item
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise SamplingParameterError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not -100 <= number(f"logit_bias[{token}]", value) <= 100:
            raise SamplingParameterError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """``logits`` with each ``(id, bias)`` added; raises
    :class:`~infer.errors.SamplingParameterError` for an id past the vocabulary."""
    if not bias:
        return logits
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    if ids[-1] >= logits.shape[-1]:
        raise SamplingParameterError(
            f"logit_bias names token id {int(ids[-1])}, but the vocabulary has {logits.shape[-1]} ids")
    out = logits.copy()
    out[ids] += np.fromiter((b for _, b in bias), dtype=np.float64, count=len(bias))
    return out


def apply_presence_frequency_penalties(
    logits: np.ndarray, generated: Iterable[int], presence: float, frequency: float,
) -> np.ndarray:
    """OpenAI's penalties: token ``j`` generated ``c[j]`` times loses
    ``c[j] * frequency + (c[j] > 0) * presence``."""
    if not presence and not frequency:
        return logits
    ids, counts = np.unique(np.fromiter(generated, dtype=np.int64), return_counts=True)
    if ids.size == 0:
        return logits
    out = logits.copy()
    out[ids] -= counts * frequency + presence
    return out


def apply_repetition_penalty(logits: np.ndarray, history: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL's penalty on every token id in ``history`` (each counted once)."""
    if penalty == 1.0:
        return logits
    ids = np.unique(np.fromiter(history, dtype=np.int64))
    if ids.size == 0:
        return logits
    out = logits.copy()
    picked = out[ids]
    with np.errstate(over="ignore"):  # an extreme penalty overflows to inf; distribution() clips it
        out[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def filter_probabilities(
    probs: np.ndarray, params: SamplingParams, scores: np.ndarray | None = None
) -> np.ndarray:
    """Zero the probabilities that top-k, top-p and min-p exclude, and
    renormalise. ``probs`` is a float64 ``[vocab]`` distribution; ``scores``
    (default ``probs``) are what top-k ranks: the sampler passes the logits,
    because logits that differ by less than float64 resolves after ``exp``
    (e.g. 0 and 1e-45) give equal probabilities but must still rank apart."""
    c = chain.Candidates(probs if scores is None else scores, probs)
    chain.top_k(c, params.top_k)
    chain.top_p(c, params.top_p)
    chain.min_p(c, params.min_p)
    return c.kept()


@dataclass(frozen=True)
class TokenLogprob:
    """A token's natural-log probability under the model, and the most likely
    tokens at its position (``top``: ``(token id, logprob)`` pairs, most
    likely first, ties by lower id; empty when none were asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``logits - logsumexp(logits)`` in float64, over the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def token_logprob(logits: np.ndarray, token: int, k: int = 0) -> TokenLogprob:
    """``token``'s :class:`TokenLogprob` from the ``[vocab]`` logits that
    predicted it, with the ``k`` most likely tokens there."""
    logp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, logp.size)
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.lexsort((best, -logp[best]))]  # most likely first, ties by id
        top = tuple((int(t), float(logp[t])) for t in best)
    return TokenLogprob(int(token), float(logp[token]), top)


class Constraint(Protocol):
    """What a :class:`Sampler` asks of a constraint on its tokens (one per
    request; :class:`infer.engine.structured.Matcher` is one)."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (float64 ``[vocab]``) with every forbidden token at ``-inf``."""

    def advance(self, token: int) -> None:
        """``token`` was chosen."""


class Sampler:
    """Samples one request's tokens; owns its random generator and, with
    mirostat, its running target surprise :attr:`mu`.

    ``history``, wherever a method takes it, is the request's whole token
    sequence before the position sampled: its first :attr:`prompt_tokens` are
    the prompt, the rest were generated (what the presence and frequency
    penalties count).

    Args:
        params: the sampling rules.
        prompt_tokens: the prompt's length (the engine that runs the request
            sets it: :func:`~infer.engine.generate.generate`,
            :meth:`~infer.engine.batch.BatchEngine.submit`).
        logprobs: record each chosen token's :class:`TokenLogprob` in
            :attr:`recorded`, with this many alternatives (0: the chosen
            token's only); None records nothing.
        constraint: only tokens it allows are chosen: its mask applies
            before every rule above (forbidden logits are ``-inf``), greedy
            or sampled, and it learns each chosen token.
        breakers: DRY's sequence breakers as token ids
            (:func:`~infer.engine.samplers.dry_breakers`; what
            :meth:`infer.Model.prepare` resolves from
            ``params.dry_sequence_breakers``); None: no breakers.
    """

    def __init__(self, params: SamplingParams, prompt_tokens: int = 0, *, logprobs: int | None = None,
                 constraint: Constraint | None = None, breakers: chain.Breakers | None = None) -> None:
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise SamplingParameterError(f"logprobs must be a non-negative integer or None, got {logprobs!r}")
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.rng = np.random.default_rng(params.seed)
        self.logprobs = logprobs
        self.constraint = constraint
        self.breakers: chain.Breakers = breakers or {}
        #: Mirostat's target surprise, in bits; starts at ``2 * tau`` (llama.cpp's start).
        self.mu = 2.0 * params.mirostat_tau
        #: One :class:`TokenLogprob` per token chosen so far (with ``logprobs``).
        self.recorded: list[TokenLogprob] = []

    @property
    def needs_logits(self) -> bool:
        """False when the argmax alone decides (greedy, no bias or penalty,
        no constraint) and nothing is recorded, so the engine can compute it
        on the device and copy one integer."""
        return not (self.params.greedy and not self.params.penalized and self.logprobs is None
                    and self.constraint is None)

    @property
    def mirostat(self) -> bool:
        """Whether tokens are sampled by mirostat (whose state each token moves)."""
        return bool(self.params.mirostat) and not self.params.greedy

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id from ``[vocab]`` logits (recorded, see :meth:`chose`)."""
        if self.params.greedy:
            token = int(np.argmax(self.adjust(logits, history)))
        else:
            probs = self.distribution(logits, history)
            token = self.draw(probs)
            self.observe(probs, token)
        self.chose(logits, token)
        return token

    def chose(self, logits: np.ndarray, token: int) -> None:
        """``token`` was chosen from ``logits`` (by :meth:`sample`, or by
        speculative verification): recorded when log-probabilities are asked
        for, and the constraint learns it."""
        if self.logprobs is not None:
            self.recorded.append(token_logprob(logits, token, self.logprobs))
        if self.constraint is not None:
            self.constraint.advance(token)

    def observe(self, probs: np.ndarray, token: int) -> None:
        """``token`` was drawn from ``probs`` (what :meth:`distribution`
        gave): mirostat moves :attr:`mu` by the token's surprise."""
        if self.mirostat:
            self.mu = self.next_mu(self.mu, probs, token)

    def next_mu(self, mu: float, probs: np.ndarray, token: int) -> float:
        """Mirostat's ``mu`` after ``token`` was drawn from ``probs``."""
        return chain.mirostat_mu(mu, probs, token, self.params.mirostat_tau, self.params.mirostat_eta)

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float64)
        return x if self.constraint is None else self.constraint.mask(x)

    def _shift(self, name: str, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logit rule ``name`` (``penalties`` or ``dry``) applied to ``logits``."""
        p = self.params
        if name == "dry":
            return chain.apply_dry(logits, history, p, self.breakers) if p.dry_on else logits
        if not p.penalties_on:
            return logits
        start = max(len(history) - p.penalty_last_n, 0) if p.penalty_last_n > 0 else 0
        out = apply_repetition_penalty(logits, history[start:], p.repetition_penalty)
        generated = list(history)[max(start, self.prompt_tokens):] if (
            p.presence_penalty or p.frequency_penalty) else ()
        return apply_presence_frequency_penalties(out, generated, p.presence_penalty, p.frequency_penalty)

    def adjust(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """``logits`` in float64 after the constraint's mask, the logit bias,
        the penalties and DRY (those the chain has, in its order), before
        temperature: what greedy decoding takes the argmax of."""
        out = apply_logit_bias(self._masked(logits), self.params.logit_bias)
        for name in self.params.order:
            if name in ("penalties", "dry"):
                out = self._shift(name, out, history)
        return out

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (), *, mu: float | None = None) -> np.ndarray:
        """The float64 ``[vocab]`` distribution :meth:`sample` draws from:
        every rule above applied to ``logits``, renormalised. Greedy gives
        the one-hot vector of the argmax. Speculative decoding compares
        these distributions of target and draft. ``mu``: mirostat's state to
        use (default :attr:`mu`)."""
        p = self.params
        if p.greedy:
            probs = np.zeros(logits.shape, dtype=np.float64)
            probs[int(np.argmax(self.adjust(logits, history)))] = 1.0
            return probs
        biased = apply_logit_bias(self._masked(logits), p.logit_bias)
        c = chain.Candidates(biased)
        if self.mirostat:  # llama.cpp's mirostat chain: temperature, then the truncation (the logit rules first)
            c.logits = self.adjust(logits, history)
            c.temperature = p.temperature
            mu = self.mu if mu is None else mu
            if p.mirostat == 1:
                return chain.mirostat_v1(c.probs, mu, c.logits.size)
            return chain.mirostat_v2(c.probs, mu)
        return chain.run_chain(c, p.order, p, lambda name, x: self._shift(name, x, history))

    def distributions(self, rows: np.ndarray, history: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """``[len(drafts) + 1, vocab]``: row ``i``'s :meth:`distribution`
        after ``history`` and ``drafts[:i]`` (speculative verification), with
        mirostat's ``mu`` carried through the drafts as if each were drawn;
        :attr:`mu` itself moves only with :meth:`observe`."""
        mu = self.mu
        out = []
        for i in range(len(drafts) + 1):
            probs = self.distribution(rows[i], [*history, *drafts[:i]], mu=mu)
            if self.mirostat and i < len(drafts):
                mu = self.next_mu(mu, probs, int(drafts[i])) if probs[int(drafts[i])] > 0 else mu
            out.append(probs)
        return np.stack(out)

    def draw(self, probs: np.ndarray) -> int:
        """A token id drawn from ``probs`` with this request's random generator."""
        return draw(probs, self.rng)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token id drawn from ``probs`` (``[vocab]``, summing to 1), one
    uniform number per draw (sampling and speculative rejection sampling
    draw alike, so a seed repeats either exactly)."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    if index >= probs.size or probs[index] == 0.0:  # rounding at the very top end
        index = int(np.flatnonzero(probs)[-1])
    return index

