"""llama.cpp's samplers: DRY, XTC, top-nσ, typical, mirostat, the penalties' window, the chain's order.

Table-driven on fixed logits: each case gives the token set llama.cpp's definition keeps
(worked out by hand in the comments) and checks the distribution is the softmax renormalised
over exactly that set. Then: a chain of neutral values computes bit for bit what the sampler
computed before these samplers existed; and seeded sampling with each sampler on a tiny model
repeats, alone and inside a batch of 8, on numpy and torch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from reference import backend_params, load_tiny

from infer.engine import samplers as chain
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import Sampler, SamplingParams
from infer.errors import SamplingParameterError
from infer.request import GenerationRequest

# p = softmax(L) = [.5609, .2063, .1252, .0759, .0279, .0038]; entropy 1.2267 nats;
# mean -0.0833, population std 1.5921.
L = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def softmax_over(logits: np.ndarray, kept: set[int], temperature: float = 1.0) -> np.ndarray:
    out = np.zeros(logits.size)
    ids = sorted(kept)
    e = np.exp((logits[ids] - logits[ids].max()) / temperature)
    out[ids] = e / e.sum()
    return out


ALL = set(range(6))
CASES = [
    # top-nσ: keep logits >= 2 - n * 1.5921.
    (dict(top_n_sigma=1.0), {0, 1, 2}),          # >= 0.408
    (dict(top_n_sigma=0.5), {0}),                # >= 1.204
    (dict(top_n_sigma=2.0), {0, 1, 2, 3, 4}),    # >= -1.184
    (dict(top_n_sigma=0.0), ALL),                # <= 0: off
    (dict(top_n_sigma=-1.0), ALL),
    # typical: |-ln p - H| = [.649, .351, .851, 1.351, 2.351, 4.351], so the order is 1, 0, 2, 3, 4, 5
    # with running mass .2063, .7672, .8924, .9683, .9962, 1: the first prefix whose mass passes p.
    (dict(typical_p=0.5), {0, 1}),
    (dict(typical_p=0.8), {0, 1, 2}),
    (dict(typical_p=0.2), {1}),
    (dict(typical_p=0.0), {1}),
    (dict(typical_p=1.0), ALL),                  # off
    # XTC firing always: tokens with p >= threshold, but the least likely of them, are removed.
    (dict(xtc_probability=1.0, xtc_threshold=0.1), {2, 3, 4, 5}),   # 0, 1, 2 reach .1: 0 and 1 go
    (dict(xtc_probability=1.0, xtc_threshold=0.2), {1, 2, 3, 4, 5}),
    (dict(xtc_probability=1.0, xtc_threshold=0.3), ALL),             # one token reaches .3: nothing goes
    (dict(xtc_probability=1.0, xtc_threshold=0.51), ALL),            # > 0.5: off
    (dict(xtc_probability=0.0, xtc_threshold=0.1), ALL),             # off
    (dict(xtc_probability=1.0, xtc_threshold=0.0), {5}),             # every token reaches 0: all but the last go
    # A chain of one sampler, in llama.cpp's names.
    (dict(top_k=2, samplers=["top_k"]), {0, 1}),
    (dict(top_p=0.7, samplers=["top-p"]), {0, 1}),                   # .5609 < .7 <= .7672
    (dict(min_p=0.2, samplers=["min_p"]), {0, 1, 2}),                # p >= .1122
    # Orders: top-k then XTC: the top 3 renormalised are [.6285, .2312, .1403], so 0 goes;
    # XTC then top-k: 0 goes (p >= .2: 0 and 1), then the top 3 of what is left.
    (dict(top_k=3, xtc_probability=1.0, xtc_threshold=0.2, samplers=["top_k", "xtc"]), {1, 2}),
    (dict(top_k=3, xtc_probability=1.0, xtc_threshold=0.2, samplers=["xtc", "top_k"]), {1, 2, 3}),
]


@pytest.mark.parametrize(("options", "kept"), CASES)
def test_each_sampler_keeps_the_set_llama_cpp_defines(options: dict, kept: set[int]) -> None:
    probs = Sampler(SamplingParams(temperature=1.0, **options)).distribution(L)
    assert set(np.flatnonzero(probs).tolist()) == kept
    np.testing.assert_allclose(probs, softmax_over(L, kept), rtol=1e-12, atol=0)


def _llama_cpp_kept(make, logits: np.ndarray) -> set[int]:
    """The token ids llama.cpp's sampler ``make()`` leaves of ``logits`` (llama-cpp-python's C API)."""
    import ctypes

    import llama_cpp

    data = (llama_cpp.llama_token_data * logits.size)(
        *[llama_cpp.llama_token_data(id=i, logit=float(x), p=0.0) for i, x in enumerate(logits)])
    array = llama_cpp.llama_token_data_array(data=data, size=logits.size, selected=-1, sorted=False)
    sampler = make()
    try:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return {array.data[i].id for i in range(array.size) if array.data[i].logit != -math.inf}


def test_llama_cpp_pythons_samplers_keep_the_same_sets() -> None:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: the sets above are llama.cpp's definition worked "
                            "by hand; where it is installed its own samplers are compared too")
    made = {
        "top_n_sigma": lambda o: llama_cpp.llama_sampler_init_top_n_sigma(o["top_n_sigma"]),
        "typical_p": lambda o: llama_cpp.llama_sampler_init_typical(o["typical_p"], 0),
        "xtc_probability": lambda o: llama_cpp.llama_sampler_init_xtc(o["xtc_probability"], o["xtc_threshold"], 0, 1),
    }
    for options, kept in CASES:
        name = next((n for n in made if n in options and "samplers" not in options), None)
        if name is not None and options.get("xtc_probability", 1.0) == 1.0:
            assert _llama_cpp_kept(lambda: made[name](options), L) == kept, options


def test_xtc_below_certainty_is_the_mixture_its_coin_gives() -> None:
    probs = Sampler(SamplingParams(temperature=1.0, xtc_probability=0.25, xtc_threshold=0.1)).distribution(L)
    want = 0.25 * softmax_over(L, {2, 3, 4, 5}) + 0.75 * softmax_over(L, ALL)
    np.testing.assert_allclose(probs, want, rtol=1e-12)


def test_top_n_sigma_ignores_temperature_and_masked_tokens() -> None:
    for t in (0.3, 1.0, 4.0):
        probs = Sampler(SamplingParams(temperature=t, top_n_sigma=1.0)).distribution(L)
        np.testing.assert_allclose(probs, softmax_over(L, {0, 1, 2}, t), rtol=1e-12)
    # A banned token (-inf) is not part of the standard deviation (llama.cpp skips -inf).
    banned = np.append(L, -np.inf)
    probs = Sampler(SamplingParams(temperature=1.0, top_n_sigma=1.0)).distribution(banned)
    assert set(np.flatnonzero(probs).tolist()) == {0, 1, 2}


def test_mirostat_2_keeps_tokens_up_to_the_first_too_surprising() -> None:
    p = softmax_over(L, ALL)
    # mu 2 bits: keep p >= 1/4 -> {0}; mu 3: p >= 1/8 -> {0, 1, 2} (.1252 >= .125); mu 0: the top one anyway.
    for mu, kept in ((2.0, {0}), (3.0, {0, 1, 2}), (0.0, {0}), (20.0, ALL)):
        np.testing.assert_allclose(chain.mirostat_v2(p, mu), softmax_over(L, kept), rtol=1e-12)


def test_mirostat_1_keeps_the_k_its_zipf_estimate_gives() -> None:
    p = softmax_over(L, ALL)
    i = np.arange(5.0)
    t, b = np.log((i + 2) / (i + 1)), np.log(p[:-1] / p[1:])
    s = (t * b).sum() / (t * t).sum()
    for mu in (1.0, 4.0, 10.0):
        k = ((s - 1) * 2 ** mu / (1 - 6 ** -(s - 1))) ** (1 / s)
        kept = set(range(min(max(int(k), 1), 6)))
        np.testing.assert_allclose(chain.mirostat_v1(p, mu, 6), softmax_over(L, kept), rtol=1e-12)


def test_mirostat_moves_mu_by_each_tokens_surprise() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5, seed=1))
    assert sampler.mu == 6.0  # 2 * tau, llama.cpp's start
    probs = sampler.distribution(L)
    token = sampler.sample(L)
    assert sampler.mu == pytest.approx(6.0 - 0.5 * (-math.log2(probs[token]) - 3.0))


# -- DRY ----------------------------------------------------------------------------------------

A, B, C, Y = 0, 1, 2, 3
ABC = [A, B, C, C, B, C, Y, A, B, C]  # llama.cpp's example: a b c c b c y a b c


@pytest.mark.parametrize(("history", "options", "breakers", "want"), [
    # "a b c" ends at 2 and at the end: c (after it) extends a 3-repeat; "b c" ends at 5: y extends a 2-repeat;
    # "c" alone (1 < allowed 2) costs nothing.
    (ABC, {}, {}, {C: 2.0, Y: 1.0}),
    (ABC, dict(dry_allowed_length=3), {}, {C: 1.0}),
    (ABC, dict(dry_penalty_last_n=3), {}, {}),               # the window "a b c" repeats nothing
    (ABC, dict(dry_multiplier=0.0), {}, {}),                 # off
    (ABC, dict(dry_penalty_last_n=0), {}, {}),               # off
    (ABC[:2], {}, {}, {}),                                   # no longer than allowed_length
    (ABC, {}, {B: ((),)}, {}),                               # a breaker 1 token back caps repeats at 1 < 2
    (ABC, {}, {Y: ((),)}, {C: 2.0}),                         # y breaks (caps at 3) and is never penalised
    (ABC, {}, {B: ((C,),)}, {}),                             # "b c", two tokens, ends the context
    (ABC, dict(dry_multiplier=0.5, dry_base=3.0), {}, {C: 1.5, Y: 0.5}),
])
def test_dry_penalises_what_would_extend_a_repeat(history, options, breakers, want) -> None:
    params = SamplingParams(temperature=1.0, dry_multiplier=options.pop("dry_multiplier", 1.0),
                            dry_base=options.pop("dry_base", 2.0), **options)
    sampler = Sampler(params, breakers=breakers)
    logits = np.zeros(6)
    got = -sampler.adjust(logits, history)
    assert {t: got[t] for t in np.flatnonzero(got)} == pytest.approx(want)


def test_dry_caps_the_exponent_like_llama_cpp() -> None:
    history = list(range(6)) * 2  # the last 6 tokens repeat: 0 would extend a 6-repeat
    params = SamplingParams(temperature=1.0, dry_multiplier=1.0, dry_base=1e10)
    got = -Sampler(params).adjust(np.zeros(6), history)
    # exponent 6 - 2 = 4, capped at int(88.7228391 / ln 1e10) = 3
    assert got[0] == pytest.approx(1e30) and np.count_nonzero(got) == 1


def test_dry_breakers_resolve_against_a_vocabulary() -> None:
    texts = ["a", "b\n", "x:", "c", "ab", "zz"]
    encode = {"b": [1], "\n": []}.__getitem__
    got = chain.dry_breakers(["\n", "ab"], texts, lambda s: encode(s) if s in ("b", "\n") else [9])
    # "b\n" holds "\n" whole; "ab" holds "ab"; "a" ends with "a", the start of "ab": head of the tail "b".
    assert got == {1: ((),), 4: ((),), 0: ((1,),)}


# -- the penalties' window ----------------------------------------------------------------------


def test_penalty_last_n_limits_the_penalties_to_the_last_tokens() -> None:
    history = [0, 1, 2, 3]
    params = dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.0)
    every = Sampler(SamplingParams(**params), prompt_tokens=1).adjust(np.ones(6), history)
    last2 = Sampler(SamplingParams(**params, penalty_last_n=2), prompt_tokens=1).adjust(np.ones(6), history)
    off = Sampler(SamplingParams(**params, penalty_last_n=0), prompt_tokens=1).adjust(np.ones(6), history)
    # Repetition over the window (prompt included), frequency over what the window holds of the output.
    np.testing.assert_allclose(every, [0.5, -0.5, -0.5, -0.5, 1, 1])
    np.testing.assert_allclose(last2, [1, 1, -0.5, -0.5, 1, 1])
    np.testing.assert_allclose(off, np.ones(6))


# -- checks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("dry_base", -1.0), ("dry_base", 0.5), ("dry_multiplier", -0.1), ("dry_allowed_length", -1),
    ("dry_penalty_last_n", -2), ("penalty_last_n", -5), ("dry_sequence_breakers", []),
    ("dry_sequence_breakers", [""]), ("dry_sequence_breakers", "\n"), ("xtc_probability", 2.0),
    ("xtc_threshold", -0.1), ("typical_p", 1.5), ("top_n_sigma", float("nan")), ("mirostat", 3),
    ("mirostat", True), ("mirostat_tau", -1.0), ("mirostat_eta", -1.0), ("samplers", ["top_k", "nope"]),
    ("samplers", ["top_k", "top-k"]), ("samplers", "top_k"),
])
def test_out_of_range_values_are_typed_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParameterError, match=f"^{field} "):
        GenerationRequest(**{field: value})


def test_sampler_names_follow_llama_cpp() -> None:
    assert chain.sampler_order(["nucleus", "typical", "temp", "top-n-sigma", "penalties"]) == (
        "top_p", "typ_p", "temperature", "top_n_sigma", "penalties")
    assert GenerationRequest(samplers=["top_k", "temp"]).samplers == ("top_k", "temp")


# -- neutral values -----------------------------------------------------------------------------


def old_distribution(logits: np.ndarray, p: SamplingParams, history: list[int], prompt_tokens: int) -> np.ndarray:
    """The sampler's distribution as it was computed before these samplers (copied from that version)."""
    from infer.engine.sampling import apply_presence_frequency_penalties, apply_repetition_penalty

    x = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, p.repetition_penalty)
    x = apply_presence_frequency_penalties(x, history[prompt_tokens:], p.presence_penalty, p.frequency_penalty)
    finite = np.clip(x, -np.finfo(np.float64).max, np.finfo(np.float64).max)
    with np.errstate(over="ignore"):
        scaled = (finite - finite.max()) / p.temperature
    probs = np.exp(scaled)
    probs /= probs.sum()
    keep = np.ones(probs.shape, dtype=bool)
    if p.top_k and p.top_k < probs.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        above = x > kth
        ties = np.flatnonzero(x == kth)[: p.top_k - int(above.sum())]
        keep = above
        keep[ties] = True
    if p.top_p < 1.0:
        order = np.argsort(-np.where(keep, probs, 0.0), kind="stable")
        sorted_probs = np.where(keep, probs, 0.0)[order]
        cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
        cutoff = int(np.searchsorted(cumulative, p.top_p - 1e-12)) + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:cutoff]] = True
        keep &= nucleus
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[keep].max()
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


#: Each new sampler at a neutral value (not always its default), and the default order spelt out.
NEUTRAL = dict(penalty_last_n=-1, dry_multiplier=0.0, dry_base=3.0, dry_penalty_last_n=16, xtc_probability=1.0,
               xtc_threshold=0.6, top_n_sigma=0.0, typical_p=1.0, mirostat=0, mirostat_tau=2.0,
               samplers=chain.DEFAULT_ORDER)


@settings(max_examples=60, deadline=None)
@given(logits=arrays(np.float32, st.integers(2, 64), elements=st.floats(-20, 20, width=32)),
       temperature=st.floats(0.05, 3.0), top_k=st.integers(0, 8), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 0.5), penalty=st.floats(0.5, 2.0), history=st.lists(st.integers(0, 1), max_size=6))
def test_neutral_values_give_the_distribution_bit_for_bit(logits, temperature, top_k, top_p, min_p, penalty,
                                                          history) -> None:
    rules = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty,
                 presence_penalty=0.5, frequency_penalty=0.25)
    want = old_distribution(logits, SamplingParams(**rules), history, 1)
    for extra in ({}, NEUTRAL):
        got = Sampler(SamplingParams(**rules, **extra), prompt_tokens=1).distribution(logits, history)
        assert np.array_equal(got, want)


# -- on a model: repeatable, alone as in a batch, on numpy and torch -----------------------------

SAMPLED = dict(temperature=0.9, seed=7)
EACH = {
    "dry": dict(dry_multiplier=0.8, dry_allowed_length=1),
    "xtc": dict(xtc_probability=0.5, xtc_threshold=0.05),
    "top_n_sigma": dict(top_n_sigma=1.0),
    "typical": dict(typical_p=0.7),
    "mirostat1": dict(mirostat=1, mirostat_tau=3.0),
    "mirostat2": dict(mirostat=2, mirostat_tau=3.0),
    "penalty_last_n": dict(repetition_penalty=1.5, penalty_last_n=4),
    "order": dict(top_k=20, typical_p=0.9, samplers=["top_k", "typ_p", "temperature"]),
}
PROMPTS = [list(range(3, 8)), list(range(20, 33)), [9, 9, 9], list(range(50, 57)), [4, 5, 4, 5, 4, 5],
           list(range(30, 40)), [11, 12], list(range(60, 64))]


@pytest.fixture(params=backend_params("numpy", "torch:cpu"))
def tiny(request: pytest.FixtureRequest):
    return load_tiny("llama3", request.param)


@pytest.mark.parametrize("name", sorted(EACH))
def test_seeded_sampling_repeats_alone_and_in_a_batch_of_8(tiny, name: str) -> None:
    engine = tiny.engine
    breakers = tiny.dry_breakers(chain.DRY_SEQUENCE_BREAKERS)

    def sampler(i: int) -> Sampler:  # request i: its own seed, every other request another sampler
        options = EACH[name] if i == 0 else EACH[sorted(EACH)[i % len(EACH)]]
        return Sampler(SamplingParams(**{**SAMPLED, "seed": 7 + i, **options}), breakers=breakers)

    stop = StopConditions(max_tokens=12, ignore_eos=True)
    alone = [list(generate(engine, PROMPTS[i], sampler(i), stop)) for i in range(8)]
    assert list(generate(engine, PROMPTS[0], sampler(0), stop)) == alone[0]
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=64))
    handles = [batch.submit(PROMPTS[i], sampler(i), stop) for i in range(8)]
    batch.run_until_done()
    assert [h.tokens for h in handles] == alone


def test_neutral_values_leave_greedy_and_seeded_model_outputs_unchanged() -> None:
    model = load_tiny("llama3", "numpy")
    for rules in (dict(temperature=0), dict(temperature=0.8, top_k=30, top_p=0.9, seed=5)):
        want = model.generate("Hello there", max_tokens=10, **rules)
        assert model.generate("Hello there", max_tokens=10, **rules, **NEUTRAL) == want


def test_speculative_decoding_keeps_mirostats_state_as_sequential_sampling() -> None:
    from infer.engine.speculative import NGramDraft, Speculation

    engine = load_tiny("llama3", "numpy").engine
    params = SamplingParams(temperature=0.9, seed=3, mirostat=2, mirostat_tau=2.0, dry_multiplier=0.5,
                            xtc_probability=0.5, xtc_threshold=0.05)
    sampler = Sampler(params)
    prompt = [4, 5, 6, 4, 5, 6, 4, 5]
    out = list(generate(engine, prompt, sampler, StopConditions(max_tokens=16, ignore_eos=True),
                        Speculation(NGramDraft(), 3)))
    assert len(out) == 16
    # mu after the run is what plain sampling's distributions give for the same tokens, one at a time.
    seq = engine.new_sequence()
    rows = engine.backend.to_numpy(engine.forward(seq, prompt + out[:-1], all_logits=True))[len(prompt) - 1:]
    engine.release(seq)
    replay = Sampler(params, prompt_tokens=len(prompt))
    for i, token in enumerate(out):
        replay.observe(replay.distribution(rows[i], prompt + out[:i]), token)
    assert replay.mu == pytest.approx(sampler.mu, rel=1e-6) and sampler.mu != 2 * params.mirostat_tau
