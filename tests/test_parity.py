"""Every llama-family variant matches transformers in float32, logit by logit.

One shared runner; each variant is a tiny random model built by
``reference.tiny_model_dir``. Tolerance: absolute error at most
``reference.LOGIT_RTOL * max|logit|`` (2.0e-5 relative; about 4e-4 for these
models, whose logits reach ~20). Both sides compute in float32 but sum in
different orders (BLAS blocking, kernels chosen for the CPU, fused vs separate
residual adds); ``reference.rounding_rtol`` derives the bound, and the largest
error measured on AVX-512, AVX2 and portable kernels is 1.8e-6 relative
(tests/README.md), while any real mistake (a dropped bias, a wrong rope pair or a
mask off by one) shows up at 1e-2 or more.
"""

from __future__ import annotations

import numpy as np
import pytest

import infer
from reference import TINY_VARIANTS, assert_logits_close, encode, reference_greedy, reference_logits, tiny_model_dir

PROMPT = "The capital of France is Paris. Once upon a time"
DECODE_TEXT = " the quick brown fox jumps over"
# llama_dynamic has max_position_embeddings 64: a prompt past it exercises the
# dynamic NTK update in prefill and in every decode step.
LONG_PROMPT = " ".join([PROMPT] * 4)



@pytest.fixture(scope="module", params=TINY_VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[str, infer.Model]:
    path = tiny_model_dir(request.param)
    return request.param, infer.load(path, backend="numpy")


def prompt_for(variant: str) -> str:
    return LONG_PROMPT if variant == "llama_dynamic" else PROMPT


def test_prefill_and_decode_logits_match_transformers(variant: tuple[str, infer.Model]) -> None:
    name, model = variant
    path = tiny_model_dir(name)
    prompt, decode = encode(path, prompt_for(name)), encode(path, DECODE_TEXT)
    assert len(decode) >= 5
    if name == "llama_dynamic":
        assert len(prompt) > model.config["max_position_embeddings"]
    if name == "mistral":
        assert len(prompt) > model.config["sliding_window"]
    ref = reference_logits(path, prompt, decode)
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence()
    prefill = ops.to_numpy(engine.forward(seq, prompt, all_logits=True))
    assert_logits_close(prefill, ref["prefill"], f"{name} prefill")
    for step, (token, want) in enumerate(zip(decode, ref["decode"])):
        got = ops.to_numpy(engine.forward(seq, [token])[-1])
        assert_logits_close(got, want, f"{name} decode step {step}")


def test_greedy_tokens_match_transformers(variant: tuple[str, infer.Model]) -> None:
    name, model = variant
    path = tiny_model_dir(name)
    prompt = encode(path, prompt_for(name))
    want = reference_greedy(path, prompt, 16)
    got = list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    assert got == want


@pytest.mark.parametrize("name", [v for v in TINY_VARIANTS if v != "llama_dynamic"])
def test_cached_decode_equals_full_forward(name: str) -> None:
    # (Dynamic NTK rope changes every position's frequencies with the sequence
    # length, so for it cached decoding legitimately differs from one full
    # pass past max_position_embeddings, in transformers as here.)
    path = tiny_model_dir(name)
    model = infer.load(path, backend="numpy")
    ids = encode(path, PROMPT + DECODE_TEXT)
    engine, ops = model.engine, model.backend
    full = ops.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))
    seq = engine.new_sequence()
    rows = [ops.to_numpy(engine.forward(seq, ids[:5], all_logits=True))]
    rows += [ops.to_numpy(engine.forward(seq, [t], all_logits=True)) for t in ids[5:]]
    assert_logits_close(np.concatenate(rows), full, f"{name} cached vs full")


def test_prefill_computes_only_last_row_by_default() -> None:
    model = infer.load(tiny_model_dir("llama2"), backend="numpy")
    engine = model.engine
    seq = engine.new_sequence()
    logits = engine.forward(seq, [5, 6, 7, 8])
    assert model.backend.shape(logits) == (1, model.network.vocab_size)
    full = engine.forward(engine.new_sequence(), [5, 6, 7, 8], all_logits=True)
    assert_logits_close(model.backend.to_numpy(logits)[0], model.backend.to_numpy(full)[-1], "last row")
