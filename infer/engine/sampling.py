"""Choosing the next token from logits.

The rules, applied in the order transformers applies them:

1. repetition penalty (CTRL, Keskar et al. 2019): the logit of every token
   already in the sequence is divided by the penalty if positive, multiplied
   if negative;
2. temperature 0 picks the argmax (greedy; the first index wins ties);
   otherwise logits are divided by the temperature;
3. top-k keeps the k most likely tokens;
4. top-p (nucleus, Holtzman et al. 2019) keeps the smallest set of most
   likely tokens whose probability reaches p;
5. min-p keeps tokens whose probability is at least ``min_p`` times the most
   likely one's;
6. a token is drawn from what remains, renormalised.

Sampling runs on the host in float64 over a ``[vocab]`` array, with a
per-request :class:`numpy.random.Generator`, so a seed repeats a run exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    keep = np.ones(probs.shape, dtype=bool)
    if params.top_k and params.top_k < probs.size:
        rank = probs if scores is None else scores
        kth = np.partition(rank, -params.top_k)[-params.top_k]
        # Ties at the k-th value: keep the first k by index, as a stable sort would.
        above = rank > kth
        ties = np.flatnonzero(rank == kth)[: params.top_k - int(above.sum())]
        keep = above
        keep[ties] = True
    if params.top_p < 1.0:
        order = np.argsort(-np.where(keep, probs, 0.0), kind="stable")
        sorted_probs = np.where(keep, probs, 0.0)[order]
        cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
        # Smallest prefix whose mass reaches top_p; the first token always stays.
        cutoff = int(np.searchsorted(cumulative, params.top_p - 1e-12)) + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:cutoff]] = True
        keep &= nucleus
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs[keep].max()
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


class Sampler:
    """Samples one request's tokens; owns its random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def needs_logits(self) -> bool:
        """False when the argmax alone decides (greedy without penalty), so
        the engine can compute it on the device and copy one integer."""
        return not (self.params.greedy and self.params.repetition_penalty == 1.0)

    def sample(self, logits: np.ndarray, history: Iterable[int] = ()) -> int:
        """The next token id from ``[vocab]`` logits."""
        p = self.params
        if p.greedy:
            logits = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, p.repetition_penalty)
            return int(np.argmax(logits))
        return self.draw(self.distribution(logits, history))

    def distribution(self, logits: np.ndarray, history: Iterable[int] = ()) -> np.ndarray:
        """The float64 ``[vocab]`` distribution :meth:`sample` draws from:
        every rule above applied to ``logits``, renormalised. Greedy gives
        the one-hot vector of the argmax. Speculative decoding compares
        these distributions of target and draft."""
        p = self.params
        logits = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, p.repetition_penalty)
        if p.greedy:
            probs = np.zeros(logits.shape, dtype=np.float64)
            probs[int(np.argmax(logits))] = 1.0
            return probs
        # Shifted before scaling, so a tiny temperature gives -inf, never inf - inf;
        # clipped, so a penalty that overflowed a logit keeps its order, not NaN.
        finite = np.clip(logits, -np.finfo(np.float64).max, np.finfo(np.float64).max)
        with np.errstate(over="ignore"):
            scaled = (finite - finite.max()) / p.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        return filter_probabilities(probs, p, scores=logits)

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
