"""The sampler chain: llama.cpp's samplers, each a step over one row's candidates.

llama.cpp (``src/llama-sampling.cpp``, ``common/sampling.cpp``) turns logits
into a token through a chain of samplers whose order a request may give
(``samplers``). The same names and definitions here:

* ``penalties`` — the repetition penalty (CTRL) and OpenAI's presence and
  frequency penalties, over the last ``penalty_last_n`` tokens;
* ``dry`` — "Don't Repeat Yourself" (koboldcpp #982): a token that would
  extend a sequence already seen ``n >= dry_allowed_length`` tokens long
  loses ``dry_multiplier * dry_base ** (n - dry_allowed_length)``; a
  sequence breaker (``"\\n"``, ``":"``...) cuts how far back a repeat counts;
* ``top_n_sigma`` — keeps tokens whose logit is within ``n`` standard
  deviations of the largest (Tang et al. 2024, "Top-nσ");
* ``top_k``, ``top_p``, ``min_p`` — as in :mod:`infer.engine.sampling`;
* ``typ_p`` — locally typical sampling (Meister et al. 2022): keeps the
  tokens whose surprise is closest to the distribution's entropy, until their
  mass passes ``typical_p``;
* ``xtc`` — "exclude top choices": with probability ``xtc_probability``,
  every token at least ``xtc_threshold`` likely except the least likely of
  them is removed (when two or more are);
* ``temperature`` — divides the logits.

Mirostat (Basu et al. 2021) replaces the chain, as in llama.cpp: temperature,
then a truncation steered by a running target surprise ``mu``
(:func:`mirostat_v1`, :func:`mirostat_v2`), which the sampler updates after
each token.

A step works on a :class:`Candidates`: the row's current logits (float64
``[vocab]``), the tokens still kept, and the softmax the filters read. A
filter only clears tokens from ``keep``; the distribution drawn from is the
kept probabilities renormalised once, at the end, so a chain without the new
samplers computes exactly what :func:`~infer.engine.sampling.filter_probabilities`
did before them. Ties are broken towards the lower token id wherever an order
decides (llama.cpp's sorts leave them unspecified).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from infer.errors import SamplingParameterError

#: llama.cpp's sampler names (``common_sampler_type_from_name``), in llama.cpp's default order.
SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
#: The other spellings llama.cpp accepts for them.
ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "top-n-sigma": "top_n_sigma",
           "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p",
           "temp": "temperature"}
#: The chain of a request that gives no ``samplers``: infer's order before the new samplers (penalties,
#: temperature, top-k, top-p, min-p), each new one where llama.cpp puts it relative to those; a
#: sampler at its neutral value leaves every output as it was.
DEFAULT_ORDER = ("penalties", "dry", "temperature", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc")
#: llama.cpp's default breakers of DRY's repeats.
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
#: llama.cpp truncates a breaker to this many characters, and its tokens after the first to this many.
DRY_MAX_BREAKER_CHARS = 40
DRY_MAX_TAIL_TOKENS = 20
#: Mirostat 1 estimates the Zipf exponent from this many most likely tokens (llama.cpp's ``m``).
MIROSTAT_M = 100

class ChainParams(Protocol):
    """What the chain reads of :class:`~infer.engine.sampling.SamplingParams`
    (named here so that this module does not import that one, which imports it)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    top_n_sigma: float
    xtc_probability: float
    xtc_threshold: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int


#: DRY's breakers resolved against a vocabulary: head token id -> the token tails that complete a
#: breaker after it (an empty tail: the head alone holds a whole breaker).
Breakers = Mapping[int, tuple[tuple[int, ...], ...]]


def sampler_order(names: object) -> tuple[str, ...]:
    """``names`` (a request's ``samplers``) as canonical names; raises
    :class:`~infer.errors.SamplingParameterError` naming ``samplers`` for a
    name llama.cpp does not know, a repeated one, or a value not a list of strings."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise SamplingParameterError(f"samplers must be a list of sampler names, got {names!r}")
    out: list[str] = []
    for name in names:
        canonical = ALIASES.get(name, name) if isinstance(name, str) else None
        if canonical not in SAMPLERS:
            raise SamplingParameterError(
                f"samplers names an unknown sampler {name!r}; the samplers are {', '.join(SAMPLERS)}")
        if canonical in out:
            raise SamplingParameterError(f"samplers names {canonical!r} twice")
        out.append(canonical)
    return tuple(out)


class Candidates:
    """One row's candidates as the chain passes them on.

    ``logits``: the current logits (float64 ``[vocab]``); ``keep``: the tokens
    no filter removed; ``temperature``: the divisor :attr:`probs` applies (the
    ``temperature`` step sets it, so the logits keep their scale for ranking).
    """

    def __init__(self, logits: np.ndarray, probs: np.ndarray | None = None) -> None:
        self.logits = logits
        self.keep = np.ones(logits.shape, dtype=bool)
        self.temperature = 1.0
        self._probs = probs

    @property
    def probs(self) -> np.ndarray:
        """The softmax of the logits over the whole vocabulary at the
        current temperature (not renormalised over :attr:`keep`)."""
        if self._probs is None:
            # Shifted before scaling, so a tiny temperature gives -inf, never inf - inf;
            # clipped, so a penalty that overflowed a logit keeps its order, not NaN.
            finite = np.clip(self.logits, -np.finfo(np.float64).max, np.finfo(np.float64).max)
            with np.errstate(over="ignore"):
                scaled = (finite - finite.max()) / self.temperature
            probs = np.exp(scaled)
            probs /= probs.sum()
            self._probs = probs
        return self._probs

    def kept(self) -> np.ndarray:
        """The kept tokens' probabilities renormalised (zeros elsewhere)."""
        filtered = np.where(self.keep, self.probs, 0.0)
        return filtered / filtered.sum()

    def shift(self, change: Callable[[np.ndarray], np.ndarray]) -> None:
        """Apply a logit rule (penalties, DRY) to the logits as the chain has them
        now: scaled, if the temperature step came first."""
        if self.temperature != 1.0:
            with np.errstate(over="ignore"):
                self.logits = self.logits / self.temperature
            self.temperature = 1.0
        self.logits = change(self.logits)
        self._probs = None

    def copy(self) -> Candidates:
        out = Candidates(self.logits, self._probs)
        out.keep = self.keep.copy()
        out.temperature = self.temperature
        return out


# -- the filters ----------------------------------------------------------------------------


def top_k(c: Candidates, k: int) -> None:
    """Keep the ``k`` highest logits (ties: the lower ids); 0 is off."""
    if not k or k >= int(c.keep.sum()):
        return
    rank = np.where(c.keep, c.logits, -np.inf) if not c.keep.all() else c.logits
    kth = np.partition(rank, -k)[-k]
    # Ties at the k-th value: keep the first k by index, as a stable sort would.
    above = rank > kth
    ties = np.flatnonzero((rank == kth) & c.keep)[: k - int(above.sum())]
    keep = above
    keep[ties] = True
    c.keep &= keep


def top_p(c: Candidates, p: float) -> None:
    """Nucleus: the smallest set of most likely tokens whose mass reaches ``p``; 1 is off."""
    if p >= 1.0:
        return
    masked = np.where(c.keep, c.probs, 0.0)
    order = np.argsort(-masked, kind="stable")
    sorted_probs = masked[order]
    cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
    # Smallest prefix whose mass reaches top_p; the first token always stays.
    cutoff = int(np.searchsorted(cumulative, p - 1e-12)) + 1
    nucleus = np.zeros_like(c.keep)
    nucleus[order[:cutoff]] = True
    c.keep &= nucleus


def min_p(c: Candidates, p: float) -> None:
    """Keep the tokens at least ``p`` times as likely as the most likely; 0 is off."""
    if p > 0.0:
        c.keep &= c.probs >= p * c.probs[c.keep].max()


def top_n_sigma(c: Candidates, n: float) -> None:
    """Keep the tokens whose logit is at least ``max - n * std`` of the kept
    finite logits (population standard deviation); ``n <= 0`` is off. The
    same set at any positive temperature, which scales max and std alike."""
    live = c.keep & np.isfinite(c.logits)
    if n <= 0.0 or int(c.keep.sum()) <= 1 or not live.any():
        return
    values = c.logits[live]
    c.keep &= c.logits >= values.max() - n * values.std()


def typical(c: Candidates, p: float) -> None:
    """Locally typical sampling: the kept tokens ordered by how far their
    surprise ``-log q`` is from the entropy ``H`` of ``q`` (the kept,
    renormalised distribution); keep that order's shortest prefix whose mass
    passes ``p`` (all, if rounding never lets it); 1 is off. Tokens of
    probability 0 add nothing to ``H`` and sort last."""
    if p >= 1.0:
        return
    q = c.kept()
    ids = np.flatnonzero(c.keep)
    qk = q[ids]
    with np.errstate(divide="ignore"):
        surprise = -np.log(qk)
    entropy = float(-(qk[qk > 0] * np.log(qk[qk > 0])).sum())
    distance = np.abs(surprise - entropy)
    # The prefix is usually short: sort the nearest `count` only, growing it until the mass passes p.
    count = 256
    while True:
        nearest = _smallest(distance, count)
        passed = np.flatnonzero(np.cumsum(qk[nearest]) > p)
        if passed.size or nearest.size == ids.size:
            break
        count *= 4
    if passed.size:
        keep = np.zeros_like(c.keep)
        keep[ids[nearest[: int(passed[0]) + 1]]] = True
        c.keep &= keep


def _smallest(values: np.ndarray, count: int) -> np.ndarray:
    """The indices of the ``count`` smallest ``values``, in order (ties by
    index, as a stable sort): a partition first, so only those are sorted."""
    index = np.arange(values.size)
    if count < values.size:
        kth = np.partition(values, count - 1)[count - 1]
        index = np.concatenate([np.flatnonzero(values < kth), np.flatnonzero(values == kth)])
    return index[np.argsort(values[index], kind="stable")][:count]


def xtc_removes(c: Candidates, threshold: float) -> np.ndarray | None:
    """The tokens XTC removes when it fires: every kept token whose
    renormalised probability is at least ``threshold``, except the least
    likely of them (ties: the higher id stays) — None when fewer than two
    are, when ``threshold > 0.5`` or when fewer than two tokens are kept."""
    if threshold > 0.5 or int(c.keep.sum()) < 2:
        return None
    q = c.kept()
    top = np.flatnonzero(c.keep & (q >= threshold))
    if top.size < 2:
        return None
    top = top[np.argsort(-q[top], kind="stable")]
    return top[:-1]


# -- mirostat ----------------------------------------------------------------------------------


def _most_likely(probs: np.ndarray, count: int) -> np.ndarray:
    """The ids of the ``count`` most likely tokens of nonzero probability, most
    likely first (ties by id); a partition first, so only those are sorted."""
    ids = np.flatnonzero(probs > 0)
    if count < ids.size:
        # Everything strictly above the count-th value, then the ties at it by id.
        kth = np.partition(probs[ids], ids.size - count)[ids.size - count]
        ids = np.concatenate([ids[probs[ids] > kth], ids[probs[ids] == kth]])
    ids = ids[np.argsort(-probs[ids], kind="stable")]
    return ids[:count]


def _only(probs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    out = np.zeros_like(probs)
    out[ids] = probs[ids]
    return out / out.sum()


def mirostat_v1(probs: np.ndarray, mu: float, vocab_size: int) -> np.ndarray:
    """Mirostat 1 (Basu et al. 2021, algorithm 1): estimate the Zipf exponent
    ``s`` from the :data:`MIROSTAT_M` most likely tokens, keep the top
    ``k = (e * 2**mu / (1 - N**-e)) ** (1/s)`` tokens (``e = s - 1``, ``N``
    the vocabulary size; at least 1; all when ``k`` is not finite), renormalised."""
    top = _most_likely(probs, MIROSTAT_M)
    if top.size <= 1:
        return _only(probs, top)
    p = probs[top]
    i = np.arange(p.size - 1, dtype=np.float64)
    t = np.log((i + 2) / (i + 1))
    b = np.log(p[:-1] / p[1:])
    s_hat = float((t * b).sum() / (t * t).sum())
    epsilon = s_hat - 1
    with np.errstate(all="ignore"):
        k = (epsilon * 2.0 ** mu / (1 - float(vocab_size) ** -epsilon)) ** (1 / s_hat)
    live = int(np.count_nonzero(probs))
    count = live if not np.isfinite(k) else min(max(int(k), 1), live)
    return _only(probs, top[:count] if count <= top.size else _most_likely(probs, count))


def mirostat_v2(probs: np.ndarray, mu: float) -> np.ndarray:
    """Mirostat 2: keep the most likely tokens up to the first whose surprise
    ``-log2 p`` exceeds ``mu`` (at least the most likely one), renormalised.
    In probability order the surprise only grows, so that prefix is every
    token of surprise at most ``mu``: no sort is needed."""
    with np.errstate(divide="ignore"):
        keep = np.flatnonzero((probs > 0) & (-np.log2(probs) <= mu))
    return _only(probs, keep if keep.size else np.array([int(np.argmax(probs))]))


def mirostat_mu(mu: float, probs: np.ndarray, token: int, tau: float, eta: float) -> float:
    """``mu`` after ``token`` was drawn from ``probs`` (the truncated
    distribution): ``mu - eta * (-log2 p(token) - tau)``."""
    return mu - eta * (-math.log2(float(probs[token])) - tau)


# -- the logit rules ---------------------------------------------------------------------------


def window(history: Sequence[int], last_n: int) -> Sequence[int]:
    """The last ``last_n`` tokens of ``history`` (-1: all of it; 0: none)."""
    if last_n < 0:
        return history
    return history[len(history) - last_n:] if last_n else history[:0]


def dry_penalties(
    tokens: np.ndarray, multiplier: float, base: float, allowed_length: int, breakers: Breakers,
) -> tuple[np.ndarray, np.ndarray]:
    """DRY's ``(token ids, penalties)`` after ``tokens`` (the window, oldest
    first), by llama.cpp's definition.

    1. The most recent breaker in the window (a head token, with its tail
       following it) caps a repeat's length at the tokens after it; a cap
       below ``allowed_length`` means no penalty.
    2. For each earlier position ``j``, ``n[j]`` is how many tokens ending at
       ``j`` equal the window's last tokens (the longest common suffix, at
       most the cap).
    3. The token after ``j`` would extend that repeat: it loses
       ``multiplier * base ** (n - allowed_length)`` for the longest ``n >=
       allowed_length`` it would extend (the exponent capped so the penalty
       stays within float32, as llama.cpp does), unless it is a breaker alone.
    """
    n = tokens.size
    none = (np.zeros(0, dtype=np.int64), np.zeros(0))
    if n <= allowed_length:
        return none
    limit = n
    heads = np.flatnonzero(np.isin(tokens, np.fromiter(breakers, dtype=np.int64, count=len(breakers))))
    for pos in heads[::-1]:  # most recent first
        back = n - 1 - int(pos)  # tokens after the head
        fits = [len(tail) for tail in breakers[int(tokens[pos])]
                if len(tail) <= back and tuple(tokens[pos + 1: pos + 1 + len(tail)].tolist()) == tail]
        if fits:
            limit = back - max(fits)
            break
    if limit < allowed_length:
        return none
    # Longest common suffix of tokens[:j + 1] and tokens, for every j < n - 1, extended one step
    # at a time over the positions still matching (numpy over the positions).
    length = np.zeros(n - 1, dtype=np.int64)
    active = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = 0
    while active.size and matched < limit:
        matched += 1
        length[active] = matched
        active = active[active >= matched]
        active = active[tokens[active - matched] == tokens[n - 1 - matched]]
    ends = np.flatnonzero(length >= allowed_length)
    if ends.size == 0:
        return none
    ids, inverse = np.unique(tokens[ends + 1], return_inverse=True)
    longest = np.zeros(ids.size, dtype=np.int64)
    np.maximum.at(longest, inverse, length[ends])
    alone = np.array([() in breakers.get(int(t), ()) for t in ids], dtype=bool)
    ids, longest = ids[~alone], longest[~alone]
    exponent = (longest - allowed_length).astype(np.float64)
    if base > 1.000001:  # llama.cpp's clamp: base ** exponent stays below float32's largest
        exponent = np.minimum(exponent, float(int(88.7228391 / math.log(base))))
    return ids, multiplier * np.power(base, exponent)


def dry_breakers(strings: Sequence[str], texts: Sequence[str], encode: Callable[[str], list[int]]) -> Breakers:
    """DRY's breakers resolved against a vocabulary (``texts[i]``: token
    ``i``'s decoded text, special tokens included; ``encode``: text to ids
    without special tokens), as llama.cpp does: a token containing a whole
    breaker is a breaker alone; a token whose text ends with the start of a
    breaker heads the tokens of the breaker's rest (at most
    :data:`DRY_MAX_TAIL_TOKENS`). Each breaker is cut to
    :data:`DRY_MAX_BREAKER_CHARS` characters."""
    found: dict[int, list[tuple[int, ...]]] = {}
    for string in strings:
        string = string[:DRY_MAX_BREAKER_CHARS]
        prefixes = [string[:size] for size in range(1, len(string))]
        for token, text in enumerate(texts):
            if string in text:
                tails = [()]
            else:
                tails = [tuple(encode(string[len(pre):])[:DRY_MAX_TAIL_TOKENS]) for pre in reversed(prefixes)
                         if text.endswith(pre)]
            for tail in tails:
                if tail not in found.setdefault(token, []):
                    found[token].append(tail)
    return {token: tuple(tails) for token, tails in found.items()}


def apply_dry(logits: np.ndarray, history: Sequence[int], params: ChainParams, breakers: Breakers) -> np.ndarray:
    """``logits`` less DRY's penalties over ``history``'s last ``dry_penalty_last_n`` tokens."""
    tokens = np.asarray(window(history, params.dry_penalty_last_n), dtype=np.int64)
    ids, penalties = dry_penalties(tokens, params.dry_multiplier, params.dry_base, params.dry_allowed_length,
                                   breakers)
    if ids.size == 0:
        return logits
    ids, penalties = ids[ids < logits.size], penalties[ids < logits.size]
    out = logits.copy()
    out[ids] -= penalties
    return out


# -- the chain ----------------------------------------------------------------------------------


FILTERS: dict[str, Callable[[Candidates, Any], None]] = {
    "top_k": lambda c, p: top_k(c, p.top_k),
    "top_p": lambda c, p: top_p(c, p.top_p),
    "min_p": lambda c, p: min_p(c, p.min_p),
    "typ_p": lambda c, p: typical(c, p.typical_p),
    "top_n_sigma": lambda c, p: top_n_sigma(c, p.top_n_sigma),
}


def run_chain(
    c: Candidates, steps: Sequence[str], params: ChainParams, shift: Callable[[str, np.ndarray], np.ndarray],
) -> np.ndarray:
    """The distribution the chain ``steps`` gives from ``c`` (float64
    ``[vocab]``, summing to 1). ``shift(name, logits)`` applies a logit rule
    (``penalties``, ``dry``). XTC's coin is not thrown: the result is the
    mixture ``P * (chain with XTC) + (1 - P) * (chain without)``, which is
    what drawing the coin and then a token gives, and what speculative
    verification must compare with."""
    for i, name in enumerate(steps):
        if name in ("penalties", "dry"):
            c.shift(lambda logits, name=name: shift(name, logits))
        elif name == "temperature":
            c.temperature = params.temperature
            c._probs = None
        elif name == "xtc":
            removes = xtc_removes(c, params.xtc_threshold) if params.xtc_probability > 0 else None
            if removes is None:
                continue
            fired = c.copy()
            fired.keep[removes] = False
            with_xtc = run_chain(fired, steps[i + 1:], params, shift)
            if params.xtc_probability >= 1:
                return with_xtc
            return params.xtc_probability * with_xtc + (1 - params.xtc_probability) * run_chain(
                c, steps[i + 1:], params, shift)
        else:
            FILTERS[name](c, params)
    return c.kept()
