"""Model.complete: text, tokens, log-probabilities, finish reason and usage.

A generated token's log-probability is the model's (the log-softmax of its raw
logits, before temperature and filters), so it equals what scoring the prompt
and completion gives at that position, up to the float32 rounding of two
routes through the model (cached decoding vs one forward over everything):
``2 * LOGIT_RTOL * max|logit|`` (tests/test_scoring.py says why).
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import LOGIT_RTOL, reference_logits, tiny_model_dir

import infer
from infer.completion import Completion, CompletionChunk
from infer.errors import SamplingParameterError

PROMPT = "The capital of France is Paris. Once upon a time"


@pytest.fixture(scope="module")
def model() -> infer.Model:
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


def _tolerance(model: infer.Model, ids: list[int]) -> float:
    logits = reference_logits(tiny_model_dir("smollm2_like"), ids, [])["prefill"]
    return 2 * LOGIT_RTOL * float(np.abs(logits).max())


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 40, "seed": 3}])
def test_token_logprobs_equal_the_score_of_the_generated_text(model: infer.Model, sampling: dict) -> None:
    c = model.complete(PROMPT, max_tokens=12, ignore_eos=True, logprobs=5, **sampling)
    assert isinstance(c, Completion) and len(c.token_ids) == 12 and len(c.logprobs) == 12
    assert c.text == model.tokenizer.decode(c.token_ids)
    assert [lp.token for lp in c.logprobs] == c.token_ids
    ids = c.prompt_token_ids + c.token_ids
    score = model.score(ids)
    want = np.asarray(score.logprobs[len(c.prompt_token_ids) - 1:])
    err = np.abs(np.asarray([lp.logprob for lp in c.logprobs]) - want).max()
    assert err <= _tolerance(model, ids), err
    assert c.usage.prompt_tokens == len(c.prompt_token_ids) and c.usage.completion_tokens == 12
    assert c.usage.total_tokens == len(ids)


def test_top_alternatives_are_sorted_and_greedy_picks_the_first(model: infer.Model) -> None:
    c = model.complete(PROMPT, max_tokens=10, ignore_eos=True, logprobs=4)
    assert c.text == model.generate(PROMPT, max_tokens=10, ignore_eos=True)
    for lp in c.logprobs:
        values = [v for _, v in lp.top]
        assert len(lp.top) == 4 and values == sorted(values, reverse=True)
        assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the chosen token is the most likely
        assert all(v <= 0 for v in values) and sum(np.exp(values)) <= 1 + 1e-9
    assert all(lp.top == () for lp in model.complete(PROMPT, max_tokens=3, logprobs=0).logprobs)
    assert model.complete(PROMPT, max_tokens=3).logprobs is None


def test_streamed_chunks_add_up_to_the_completion(model: infer.Model) -> None:
    whole = model.complete(PROMPT, max_tokens=16, ignore_eos=True, logprobs=2)
    chunks = list(model.complete(PROMPT, max_tokens=16, ignore_eos=True, logprobs=2, stream=True))
    assert all(isinstance(c, CompletionChunk) for c in chunks) and len(chunks) > 2
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert [lp for c in chunks for lp in c.logprobs] == whole.logprobs
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].usage == whole.usage and all(c.usage is None for c in chunks[:-1])


def test_finish_reasons(model: infer.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    full = model.complete(PROMPT, max_tokens=24, ignore_eos=True)
    assert full.finish_reason == "length"
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cut = model.complete(PROMPT, max_tokens=24, ignore_eos=True, stop=stop)
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24
    # Make the model's end-of-sequence token the one it generates fourth.
    monkeypatch.setattr(model.package.generation, "eos_token_ids", (full.token_ids[3],))
    first = full.token_ids.index(full.token_ids[3])
    eos = model.complete(PROMPT, max_tokens=24)
    assert eos.finish_reason == "eos" and eos.token_ids == full.token_ids[: first + 1]


def test_token_id_prompts_and_echo(model: infer.Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    by_ids = model.complete(ids, max_tokens=6, ignore_eos=True, logprobs=1, echo=True)
    assert by_ids.token_ids == model.complete(PROMPT, max_tokens=6, ignore_eos=True).token_ids
    assert by_ids.prompt_token_ids == ids
    echo = by_ids.prompt_logprobs
    assert echo[0] is None and [lp.token for lp in echo[1:]] == ids[1:]
    assert [lp.logprob for lp in echo[1:]] == model.score(ids).logprobs
    assert all(len(lp.top) == 1 for lp in echo[1:])


def test_a_list_of_prompts_completes_as_each_alone(model: infer.Model) -> None:
    prompts = [PROMPT, "Hello", "Once"]
    together = model.complete(prompts, max_tokens=6, ignore_eos=True, logprobs=2)
    for prompt, c in zip(prompts, together):
        alone = model.complete(prompt, max_tokens=6, ignore_eos=True, logprobs=2)
        assert (c.text, c.token_ids, c.finish_reason, c.usage) == (alone.text, alone.token_ids, alone.finish_reason,
                                                                   alone.usage)
        tol = _tolerance(model, c.prompt_token_ids + c.token_ids)
        assert np.abs(np.asarray([a.logprob for a in alone.logprobs]) -
                      [b.logprob for b in c.logprobs]).max() <= tol


def test_speculative_decoding_records_the_same_logprobs(model: infer.Model) -> None:
    plain = model.complete(PROMPT * 2, max_tokens=12, ignore_eos=True, logprobs=3)
    spec = model.complete(PROMPT * 2, max_tokens=12, ignore_eos=True, logprobs=3, speculative="ngram")
    assert spec.token_ids == plain.token_ids
    tol = _tolerance(model, plain.prompt_token_ids + plain.token_ids)
    assert np.abs(np.asarray([a.logprob for a in spec.logprobs]) - [b.logprob for b in plain.logprobs]).max() <= tol
    assert [[t for t, _ in a.top] for a in spec.logprobs] == [[t for t, _ in b.top] for b in plain.logprobs]


def test_bad_logprobs_is_a_typed_error(model: infer.Model) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(SamplingParameterError, match="logprobs"):
            model.complete(PROMPT, max_tokens=2, logprobs=bad)
