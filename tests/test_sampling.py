"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, repetition penalty,
OpenAI's presence and frequency penalties and logit bias.

Every filter is checked against an independent computation written here (or, for the
repetition penalty, against transformers' own logits processor), on logits drawn by
hypothesis: any finite float32 values, with ties and magnitudes up to float32's limit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers import RepetitionPenaltyLogitsProcessor

from infer.engine.sampling import Sampler, SamplingParams, filter_probabilities
from infer.errors import SamplingParameterError

# Draws per hypothesis example in the "never picks" properties: enough that a filter
# letting through a token with noticeable probability is caught across the examples.
DRAWS = 24

# A few values repeated often (ties), anything finite in float32 (huge magnitudes,
# subnormals, signed zeros) otherwise.
_elements = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 2.5, -30.0]),
    st.floats(-8.0, 8.0, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
)
logits_st = st.integers(2, 200).flatmap(lambda n: arrays(np.float32, n, elements=_elements))
temperature_st = st.one_of(st.floats(0.01, 5.0), st.sampled_from([1.0, 1e-3, 100.0]))
seed_st = st.integers(0, 2**32 - 1)


def softmax64(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Reference softmax of ``logits / temperature`` in float64 (log-sum-exp form)."""
    s = logits.astype(np.float64) / temperature
    s = s - s.max()
    p = np.exp(s)
    return p / math.fsum(p)


def draws(params: SamplingParams, logits: np.ndarray, n: int = DRAWS, history=()) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits, history) for _ in range(n)]


# -- greedy ----------------------------------------------------------------------


@given(logits=logits_st)
def test_temperature_zero_is_argmax_first_index_on_ties(logits):
    top = logits.max()
    first = int(np.flatnonzero(logits == top)[0])
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == first
    # Greedy decoding ignores the filters and the seed.
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.5, min_p=0.5, seed=3)
    assert Sampler(params).sample(logits) == first


def test_greedy_ties_pick_the_first_index_explicitly():
    logits = np.array([0.0, 3.0, -1.0, 3.0, 3.0], dtype=np.float32)
    assert Sampler(SamplingParams()).sample(logits) == 1


# -- filters ----------------------------------------------------------------------


@settings(max_examples=150)
@given(logits=logits_st, k=st.integers(1, 202), temperature=temperature_st, seed=seed_st)
# Distinct logits whose probabilities are equal in float64 (exp(-1e-45) == 1.0):
# top-k must still rank them by logit.
@example(logits=np.array([0.0, 1e-45], dtype=np.float32), k=1, temperature=1.0, seed=0)
@example(logits=np.array([1.0, 0.0, 1e-45], dtype=np.float32), k=2, temperature=1.0, seed=0)
def test_top_k_never_picks_outside_the_k_largest(logits, k, temperature, seed):
    # Ties at the k-th value: any of the tied tokens may be kept, but never one
    # whose logit is below the k-th largest.
    kth = np.sort(logits)[::-1][min(k, logits.size) - 1]
    picked = draws(SamplingParams(temperature=temperature, top_k=k, seed=seed), logits)
    for token in picked:
        assert logits[token] >= kth, (token, logits[token], kth)
    assert len(set(picked)) <= k


def test_top_k_one_is_greedy_whatever_the_seed():
    logits = np.array([0.1, 0.3, 0.2, 0.29], dtype=np.float32)
    for seed in range(20):
        assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed)).sample(logits) == 1


def nucleus_floor(probs: np.ndarray, top_p: float, slack: float) -> float:
    """The smallest probability inside the smallest set of most likely tokens whose
    mass reaches ``top_p + slack``: written independently of the library (sorted,
    summed term by term)."""
    target = top_p + slack
    total = 0.0
    for p in sorted(probs.tolist(), reverse=True):
        total += p
        if total >= target:
            return p
    return float(probs[probs > 0].min())


# float64 sums of <= 200 probabilities differ between summation orders by ~1e-14;
# 1e-9 of slack keeps the check off that rounding and still far below any real
# difference of nucleus (random p lands that close to a cumulative sum with
# probability ~1e-9).
P_SLACK = 1e-9


@settings(max_examples=150)
@given(logits=logits_st, top_p=st.floats(1e-6, 1.0),
       temperature=temperature_st, seed=seed_st)
def test_top_p_never_picks_outside_the_smallest_nucleus(logits, top_p, temperature, seed):
    probs = softmax64(logits, temperature)
    # Largest nucleus rounding could justify: anything picked must be inside it.
    floor = nucleus_floor(probs, top_p, P_SLACK)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    for token in draws(params, logits):
        assert probs[token] >= floor, (token, probs[token], floor)
    # And the filter keeps every token of the smallest nucleus that is not tied at
    # its boundary (top-p must not cut more than it should either).
    kept = filter_probabilities(probs, params) > 0
    inner_floor = nucleus_floor(probs, max(top_p - P_SLACK, 0.0), 0.0)
    assert kept[probs > inner_floor].all()
    assert not kept[probs < floor].any()


@settings(max_examples=150)
@given(logits=logits_st, min_p=st.floats(0.0, 1.0, exclude_max=True),
       temperature=temperature_st, seed=seed_st)
def test_min_p_never_picks_a_token_below_min_p_times_the_top(logits, min_p, temperature, seed):
    s = logits.astype(np.float64) / temperature
    ratio = np.exp(s - s.max())  # prob / max prob, without normalising
    params = SamplingParams(temperature=temperature, min_p=min_p, seed=seed)
    # Relative slack 1e-12: the library compares normalised float64 probabilities,
    # whose rounding differs from this ratio by a few ulps.
    for token in draws(params, logits):
        assert ratio[token] >= min_p * (1 - 1e-12), (token, ratio[token], min_p)
    kept = filter_probabilities(softmax64(logits, temperature), params) > 0
    assert kept[ratio > min_p * (1 + 1e-12)].all()


@given(logits=logits_st, k=st.integers(1, 20), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 0.5), temperature=temperature_st)
def test_filters_together_leave_a_normalised_distribution(logits, k, top_p, min_p, temperature):
    probs = softmax64(logits, temperature)
    out = filter_probabilities(probs, SamplingParams(temperature=temperature, top_k=k, top_p=top_p,
                                                     min_p=min_p))
    assert np.all(out >= 0)
    assert math.isclose(out.sum(), 1.0, rel_tol=1e-12)
    assert out[int(np.argmax(probs))] > 0  # the most likely token always survives
    assert np.count_nonzero(out) <= k


# -- seeds --------------------------------------------------------------------------


@given(logits=logits_st, seed=seed_st, temperature=temperature_st)
def test_a_seed_repeats_a_run_exactly(logits, seed, temperature):
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=seed)
    assert draws(params, logits, 16) == draws(params, logits, 16)


@given(a=seed_st, b=seed_st)
def test_different_seeds_differ_on_a_flat_distribution(a, b):
    if a == b:
        b = a + 1
    flat = np.zeros(200, dtype=np.float32)
    # Two independent runs of 32 draws from 200 equally likely tokens coincide
    # with probability 200**-32: equal runs mean the seed is ignored.
    assert draws(SamplingParams(temperature=1.0, seed=a), flat, 32) != draws(
        SamplingParams(temperature=1.0, seed=b), flat, 32)


def test_no_seed_is_not_a_fixed_seed():
    flat = np.zeros(200, dtype=np.float32)
    assert draws(SamplingParams(temperature=1.0), flat, 32) != draws(SamplingParams(temperature=1.0), flat, 32)


# -- repetition penalty ----------------------------------------------------------------


@settings(max_examples=150)
@given(data=st.data(), logits=logits_st, penalty=st.floats(0.05, 20.0))
def test_repetition_penalty_matches_transformers(data, logits, penalty):
    from infer.engine.sampling import apply_repetition_penalty

    history = data.draw(st.lists(st.integers(0, logits.size - 1), min_size=1, max_size=30))
    reference = RepetitionPenaltyLogitsProcessor(penalty=float(penalty))(
        torch.tensor([history], dtype=torch.long), torch.tensor(logits[None, :], dtype=torch.float64)
    )[0].numpy()
    ours = apply_repetition_penalty(logits.astype(np.float64), history, penalty)
    # One IEEE multiply or divide per entry on both sides: exactly equal.
    np.testing.assert_array_equal(ours, reference)
    # And the sampler uses it: greedy with a penalty picks the reference's argmax.
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert Sampler(params).sample(logits, history) == int(np.argmax(reference))


def test_repetition_penalty_changes_the_greedy_choice():
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler(params).sample(logits, history=[0]) == 1
    assert Sampler(params).sample(logits, history=[]) == 0


# -- OpenAI's presence and frequency penalties, logit bias --------------------------------


@settings(max_examples=150)
@given(data=st.data(), logits=st.integers(2, 60).flatmap(lambda n: arrays(np.float32, n, elements=st.floats(-8, 8, width=32))),
       presence=st.floats(-2, 2), frequency=st.floats(-2, 2))
def test_presence_and_frequency_penalties_follow_openais_formula(data, logits, presence, frequency):
    """OpenAI's API reference: mu[j] - c[j] * frequency - (c[j] > 0) * presence,
    c[j] counting token j among the tokens generated so far (not the prompt)."""
    prompt = data.draw(st.lists(st.integers(0, logits.size - 1), max_size=10))
    generated = data.draw(st.lists(st.integers(0, logits.size - 1), max_size=30))
    want = logits.astype(np.float64).copy()
    for j in set(generated):
        c = generated.count(j)
        want[j] = want[j] - c * frequency - presence
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    got = Sampler(params, prompt_tokens=len(prompt)).adjust(logits, prompt + generated)
    # The same one multiply-add per penalised entry in float64, in another order: within 4 ulp of ~10.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)
    assert Sampler(params, len(prompt)).sample(logits, prompt + generated) == int(np.argmax(got))


def test_penalties_count_generated_tokens_not_the_prompt():
    logits = np.array([2.0, 1.5, 0.0], dtype=np.float32)
    params = SamplingParams(presence_penalty=1.0)
    assert Sampler(params, prompt_tokens=2).sample(logits, [0, 0]) == 0    # 0 only in the prompt
    assert Sampler(params, prompt_tokens=2).sample(logits, [1, 1, 0]) == 1  # 0 generated once
    frequent = SamplingParams(frequency_penalty=0.3)
    assert Sampler(frequent, 0).sample(logits, [0]) == 0                  # 2.0 - 0.3 still leads
    assert Sampler(frequent, 0).sample(logits, [0, 0]) == 1                # 2.0 - 0.6 < 1.5


def test_logit_bias_bans_and_forces_tokens():
    logits = np.array([3.0, 1.0, 0.0, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(logit_bias={0: -100})).sample(logits) == 1
    assert Sampler(SamplingParams(logit_bias={3: 100})).sample(logits) == 3
    # Sampled: a banned token is never drawn (its probability is below e^-100).
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100, 1: -100}))
    assert 0 not in {sampler.sample(logits) for _ in range(200)}
    with pytest.raises(SamplingParameterError, match="token id 9"):
        Sampler(SamplingParams(logit_bias={9: 1.0})).sample(logits)
    # A mapping is kept as sorted pairs: the params stay hashable and compare by value.
    assert SamplingParams(logit_bias={3: 1, 1: 2}) == SamplingParams(logit_bias=((1, 2.0), (3, 1.0)))
    hash(SamplingParams(logit_bias={3: 1}))


def test_penalties_and_bias_reach_generate_and_batches():
    """generate() takes them; a batched request follows the same rules as a lone
    one (the batch counts each request's generated tokens from its own prompt)."""
    from reference import load_tiny

    model = load_tiny("smollm2_like")
    plain = model.generate_tokens(model.tokenizer.encode("Once upon a time"), max_tokens=12, ignore_eos=True)
    tokens = list(plain)
    first = tokens[0]
    banned = model.generate("Once upon a time", max_tokens=12, ignore_eos=True, logit_bias={first: -100})
    assert model.tokenizer.encode(banned, add_special_tokens=False)[:1] != [first]
    kwargs = dict(max_tokens=16, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0)
    alone = model.generate("Once upon a time", **kwargs)
    assert alone != model.generate("Once upon a time", max_tokens=16, ignore_eos=True)
    assert model.generate(["Once upon a time", "The capital of France"], **kwargs)[0] == alone
    with pytest.raises(SamplingParameterError, match="vocabulary"):
        model.generate("Once", logit_bias={10**6: 1.0})


# -- the distribution itself --------------------------------------------------------------


def chi2_sf_even_df(x: float, df: int) -> float:
    """Survival function of chi-square for even ``df`` (closed form:
    exp(-x/2) * sum_{i < df/2} (x/2)**i / i!)."""
    assert df % 2 == 0
    half = x / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))


def chi2_statistic(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


N = 20_000


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_empirical_distribution_matches_the_softmax(temperature):
    # Pearson's chi-square with df = vocab - 1 = 4 (even: closed-form tail). With
    # a correct sampler the p-value is uniform, so p < 1e-6 fails a correct
    # sampler one run in a million (and the seed is fixed, so the outcome is
    # reproducible). A wrong temperature or an off-by-one in the inverse-CDF
    # lookup shifts ~1% of 20k draws or more, a statistic in the hundreds.
    logits = np.array([1.0, 0.5, 0.0, -0.5, -2.0], dtype=np.float32)
    expected = softmax64(logits, temperature) * N  # smallest expected count ~ 1000
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1234))
    counts = np.bincount([sampler.sample(logits) for _ in range(N)], minlength=logits.size)
    stat = chi2_statistic(counts, expected)
    assert chi2_sf_even_df(stat, logits.size - 1) > 1e-6, (counts, expected.round(1), stat)


def test_empirical_distribution_after_top_k_is_the_renormalised_softmax():
    # Same test on the 3 tokens top-k keeps (df = 2); the other two never appear.
    logits = np.array([-1.0, 1.0, 0.2, -3.0, 0.6], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=99))
    counts = np.bincount([sampler.sample(logits) for _ in range(N)], minlength=logits.size)
    kept = np.array([1, 2, 4])
    assert counts[[0, 3]].sum() == 0
    p = softmax64(logits[kept], 1.0)
    stat = chi2_statistic(counts[kept], p * N)
    assert chi2_sf_even_df(stat, kept.size - 1) > 1e-6, (counts, stat)


def test_chi2_tail_formula_is_right():
    # Known quantiles: chi2(2) 0.95 quantile 5.991; chi2(4) 0.99 quantile 13.277.
    assert math.isclose(chi2_sf_even_df(5.991, 2), 0.05, rel_tol=1e-3)
    assert math.isclose(chi2_sf_even_df(13.277, 4), 0.01, rel_tol=1e-3)


# -- invalid parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"temperature": "1.0"},
    {"temperature": True},
    {"top_p": 0.0},
    {"top_p": 1.0001},
    {"top_p": -0.5},
    {"top_p": float("nan")},
    {"min_p": 1.0},
    {"min_p": -0.01},
    {"min_p": float("inf")},
    {"top_k": -1},
    {"top_k": 2.0},
    {"top_k": True},
    {"top_k": "5"},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": -1.0},
    {"repetition_penalty": float("-inf")},
    {"repetition_penalty": False},
    {"seed": -1},
    {"seed": 1.5},
    {"seed": True},
    {"seed": "42"},
    {"presence_penalty": 2.5},
    {"frequency_penalty": -3},
    {"frequency_penalty": float("nan")},
    {"logit_bias": {"5": 1.0}},
    {"logit_bias": {5: 101}},
    {"logit_bias": {-1: 1}},
    {"logit_bias": "x"},
], ids=repr)
def test_invalid_parameters_raise_sampling_parameter_error(kwargs):
    with pytest.raises(SamplingParameterError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    name = next(iter(kwargs))
    assert name in str(info.value)  # the message names the parameter at fault


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1.0}, {"top_p": 1e-9}, {"min_p": 0.0},
    {"min_p": 0.999}, {"top_k": 0}, {"repetition_penalty": 1e-3}, {"seed": 0}, {"seed": 2**70},
], ids=repr)
def test_valid_edge_parameters_are_accepted(kwargs):
    SamplingParams(**kwargs)
