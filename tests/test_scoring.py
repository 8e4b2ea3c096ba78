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
import re
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
from infer.engine.scoring import kl_divergence, windows
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
@pytest.mark.parametrize("source", ["gguf"])  # "hf" too passes; left out to keep the suite short (15 s)
def test_score_equals_transformers_on_gemma3(source: str) -> None:
    from real_models import gemma3_hf_dir

    hf = gemma3_hf_dir()
    model = infer.load(hf if source == "hf" else "gemma3-270m", backend="numpy")
    ids = model.tokenizer.encode("The three primary colors are red, yellow and blue.")
    logits = reference_teacher_forced(hf, ids[:1], ids[1:])
    assert_logprobs_close(model.score(ids).logprobs, reference_logprobs(logits, ids), logits, float32_rtol(hf),
                          f"gemma3 {source}")


# -- KL(P ‖ Q) between two loads of one model (infer.engine.scoring.kl_divergence) ------------------

LONG = [(11 * i * i + 5 * i + 3) % 250 + 3 for i in range(60)]


def _q8_pair() -> tuple[infer.Model, infer.Model]:
    """The tiny model quantized on load, with exact activations and with int8 ones."""
    path = tiny_model_dir("llama3")
    exact = infer.load(path, backend="numpy", quantize="q8", compile=False)
    if "q8" not in exact.backend.activation_schemes:
        pytest.skip("the numpy backend's C kernels are not built: no activations='q8'")
    return exact, infer.load(path, backend="numpy", quantize="q8", compile=False, activations="q8")


def test_kl_of_a_model_against_itself_is_zero() -> None:
    path = tiny_model_dir("llama3")
    a, b = infer.load(path, backend="numpy"), infer.load(path, backend="numpy")
    d = kl_divergence(a, b, LONG, window=16, stride=8)
    assert d.token_ids == LONG and len(d.kl) == len(LONG) - 1
    assert d.kl == [0.0] * (len(LONG) - 1) and d.mean == 0.0 and d.top_agreement == 1.0
    # Both sides' scores are Model.score's in the same windows, up to float32 rounding:
    # score batches windows into other forwards, so its sums run in another order.
    want = a.score(LONG, context=16, stride=8)
    np.testing.assert_allclose(d.p.logprobs, want.logprobs, rtol=1e-5, atol=1e-4)
    assert d.p.logprobs == d.q.logprobs


def test_kl_against_int8_activations_is_positive_and_equals_numpy() -> None:
    exact, q8 = _q8_pair()
    ids = LONG[:40]  # one window: the rows are those of one forward of ids[:-1] on each side
    d = kl_divergence(exact, q8, ids, window=64)
    rows = []
    for m in (exact, q8):
        seq = m.engine.new_sequence(len(ids))
        rows.append(log_softmax(m.backend.to_numpy(m.engine.forward(seq, ids[:-1], all_logits=True))))
        m.engine.release(seq)
    want = (np.exp(rows[0]) * (rows[0] - rows[1])).sum(axis=-1)
    np.testing.assert_allclose(d.kl, want, rtol=1e-12, atol=1e-15)
    assert d.mean > 0 and all(k >= -1e-12 for k in d.kl)
    same_top = np.mean(rows[0].argmax(axis=-1) == rows[1].argmax(axis=-1))
    assert d.top_agreement == pytest.approx(same_top) and d.top_agreement > 0.5
    np.testing.assert_allclose(d.q.logprobs, rows[1][np.arange(len(ids) - 1), ids[1:]], rtol=1e-12)


def test_kl_rejects_a_window_below_two_tokens() -> None:
    a = infer.load(tiny_model_dir("llama3"), backend="numpy")
    with pytest.raises(GenerationError, match="at least 2 tokens"):
        kl_divergence(a, a, LONG, window=1)


def test_cli_perplexity_kl_against_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exact, _ = _q8_pair()
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a tiny model that read very long texts. " * 6)
    path = str(tiny_model_dir("llama3"))
    assert main(["-q", "perplexity", path, str(text), "--backend", "numpy", "--quantize", "q8", "--activations", "q8",
                 "--kl-against", "exact", "--context", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("exact: perplexity ") and out[1].startswith("activations=q8: perplexity ")
    assert re.match(r"KL\(exact \|\| activations=q8\): mean \d\.\d+ nats over \d+ tokens, same top token", out[2])
    # Without an approximate mode there is nothing to compare.
    assert main(["-q", "perplexity", path, str(text), "--kl-against", "exact"]) == 1
