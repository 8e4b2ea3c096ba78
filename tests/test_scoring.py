"""Model.score: log-probabilities of a text equal transformers' float32 log-softmax.

Tolerance. ``logprob = z[t] - logsumexp(z)`` of a row ``z`` of logits. Two
correct float32 implementations' logits differ by at most ``eps = rtol *
max|z|`` per logit (``reference.rounding_rtol``; ``LOGIT_RTOL`` for the tiny
kit, ``float32_rtol`` for a real model), and ``logsumexp`` moves by at most
``max|dz|`` (its gradient is the softmax, which sums to 1). infer and the
reference both take the log-softmax in float64 (infer: ``infer.engine.sampling.log_softmax``),
so they differ by at most ``2 * eps``: :func:`assert_logprobs_close`.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import (
    LOGIT_RTOL,
    TINY_VARIANTS,
    float32_rtol,
    load_reference_model,
    reference_logits,
    reference_teacher_forced,
    smollm2_hf_dir,
    tiny_model_dir,
)

import infer
from infer.engine.sampling import log_softmax
from infer.engine.scoring import windows
from infer.errors import GenerationError
from infer.tools.cli import main

# 40 ids spread over the tiny vocabulary (every variant's context holds 64 positions).
IDS = [(7 * i * i + 3 * i + 11) % 250 + 3 for i in range(40)]


def reference_logprobs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """log p(ids[i + 1] | ids[: i + 1]) from the float32 logits rows predicting ids[1:]."""
    logp = log_softmax(np.asarray(logits, np.float64))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def assert_logprobs_close(got: list[float], want: np.ndarray, logits: np.ndarray, rtol: float, what: str) -> None:
    """Within ``2 * rtol * max|logit|`` (the module docstring says why)."""
    got_a = np.asarray(got, np.float64)
    assert got_a.shape == want.shape, f"{what}: {got_a.shape} log-probabilities, want {want.shape}"
    tol = 2 * rtol * float(np.abs(logits).max())
    err = float(np.abs(got_a - want).max(initial=0.0))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_score_equals_transformers_log_softmax_on_every_tiny_architecture(variant: str) -> None:
    path = tiny_model_dir(variant)
    logits = reference_logits(path, IDS, [])["prefill"][:-1]
    score = infer.load(path, backend="numpy").score(IDS)
    assert score.token_ids == IDS
    assert_logprobs_close(score.logprobs, reference_logprobs(logits, IDS), logits, LOGIT_RTOL, variant)
    assert score.perplexity == pytest.approx(math.exp(-np.mean(score.logprobs)), rel=1e-12)
    assert score.greedy == (logits.argmax(axis=-1) == np.asarray(IDS[1:])).tolist()


@pytest.fixture(scope="module")
def tiny() -> infer.Model:
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


def test_a_list_is_scored_batched_as_each_text_alone(tiny: infer.Model) -> None:
    texts = [IDS, IDS[5:30], IDS[:2], [IDS[3]]]
    logits = reference_logits(tiny_model_dir("smollm2_like"), IDS, [])["prefill"]
    alone = [tiny.score(t) for t in texts]
    # A small batch budget splits the texts into chunks across several forwards too.
    for batch in (tiny.score(texts), tiny.score(texts, max_batch_tokens=7)):
        for a, b in zip(alone, batch):
            assert a.token_ids == b.token_ids
            assert_logprobs_close(b.logprobs, np.asarray(a.logprobs), logits, LOGIT_RTOL, "batched")
    assert alone[3].logprobs == [] and math.isnan(alone[3].perplexity)


def test_a_text_is_tokenized_with_its_special_tokens(tiny: infer.Model) -> None:
    text = "Once upon a time there was a tiny model."
    assert tiny.score(text).token_ids == tiny.tokenizer.encode(text)
    assert tiny.score(text, add_special_tokens=False).token_ids == tiny.tokenizer.encode(text, add_special_tokens=False)


def test_sliding_windows_score_every_token_once() -> None:
    for length, context, stride in [(40, 16, 5), (40, 16, 16), (17, 16, 8), (3, 16, 8), (100, 7, 1)]:
        spans = windows(length, context, stride)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert scored == list(range(1, length)), (length, context, stride)
        assert all(end - begin <= context for begin, end, _ in spans)
        assert spans[-1][1] == length


def test_sliding_window_perplexity_equals_the_same_loop_in_transformers(tiny: infer.Model) -> None:
    """The Hugging Face perplexity guide's loop (windows of `context`, moved by
    `stride`, each scoring only the tokens the last one did not reach)."""
    import torch

    path = tiny_model_dir("smollm2_like")
    ids, context, stride = IDS, 16, 5
    model = load_reference_model(path)
    want, rows, prev_end = [], [], 0
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + context, len(ids))
            logits = model(torch.tensor([ids[begin:end]])).logits[0].numpy()
            new = end - max(prev_end, 1)  # the first window cannot score its first token
            logp = log_softmax(logits[:-1].astype(np.float64))
            want.extend(logp[np.arange(end - begin - 1), ids[begin + 1:end]][-new:])
            rows.append(logits)
            prev_end = end
            if end == len(ids):
                break
    got = tiny.score(ids, context=context, stride=stride)
    assert_logprobs_close(got.logprobs, np.asarray(want), np.concatenate(rows), LOGIT_RTOL, "sliding windows")
    # The window matters: a token scored with less context has another log-probability.
    assert not np.allclose(got.logprobs, tiny.score(ids).logprobs, atol=1e-3)


def test_bad_scoring_arguments_are_typed_errors(tiny: infer.Model) -> None:
    with pytest.raises(GenerationError, match="empty"):
        tiny.score([])
    with pytest.raises(GenerationError, match="stride"):
        tiny.score(IDS, context=8, stride=9)
    with pytest.raises(GenerationError, match="context"):
        tiny.score(IDS, context=tiny.context_length + 1)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        tiny.score([1, 2, 10**6])


def test_perplexity_command_prints_the_score_of_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         tiny: infer.Model) -> None:
    text = "Once upon a time there was a tiny model that scored text in sliding windows."
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    path = str(tiny_model_dir("smollm2_like"))
    assert main(["-q", "perplexity", path, str(tmp_path / "text.txt"), "--context", "12", "--stride", "4",
                 "--backend", "numpy"]) == 0
    want = tiny.score(text, context=12, stride=4)
    assert capsys.readouterr().out.startswith(f"perplexity {want.perplexity:.4f} over {len(want.logprobs)} tokens")
    assert main(["-q", "perplexity", path, str(tmp_path / "missing.txt")]) == 1
    assert "cannot read the text file" in capsys.readouterr().err


def test_progress_bar_goes_to_stderr(tiny: infer.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    tiny.score(IDS, context=16, stride=8, progress=True)
    assert "Scoring" in err.getvalue() and "39/39" in err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_score_equals_transformers_on_smollm2(source: str) -> None:
    hf = smollm2_hf_dir()
    model = infer.load(hf if source == "hf" else "smollm2-135m", backend="numpy")
    text = "The capital of France is Paris. It is known for the Eiffel Tower and its museums."
    ids = model.tokenizer.encode(text)
    logits = reference_teacher_forced(hf, ids[:1], ids[1:])
    score = model.score(ids)
    assert_logprobs_close(score.logprobs, reference_logprobs(logits, ids), logits, float32_rtol(hf), source)


@pytest.mark.slow
def test_score_equals_transformers_on_gemma3_gguf() -> None:
    from real_models import gemma3_hf_dir

    hf = gemma3_hf_dir()
    model = infer.load("gemma3-270m", backend="numpy")
    ids = model.tokenizer.encode("The three primary colors are red, yellow and blue.")
    logits = reference_teacher_forced(hf, ids[:1], ids[1:])
    assert_logprobs_close(model.score(ids).logprobs, reference_logprobs(logits, ids), logits, float32_rtol(hf),
                          "gemma3")
