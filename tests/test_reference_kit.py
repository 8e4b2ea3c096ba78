"""Checks that the reference kit (tests/reference.py) builds what it promises.

The central one validates the reference itself: transformers' cached decode logits
equal the rows of one full forward pass. The real-model checks are marked slow.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import reference
from reference import (
    LOGIT_RTOL,
    FAMILY_VARIANTS,
    TINY_VARIANTS,
    assert_logits_close,
    encode,
    reference_greedy,
    reference_logits,
    tiny_model_dir,
)

PROMPT = "The capital of France is Paris. Once upon a time"
FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def _decode_matches_full(result: dict, n_prompt: int) -> None:
    # transformers against itself: one full forward (gemm over all rows) and cached
    # decoding (gemv, one row) sum in different orders, on kernels chosen for the
    # CPU at run time: the float32 rounding bound of every logit comparison.
    full = result["full"]
    assert_logits_close(result["prefill"], full[:n_prompt], "transformers prefill vs full forward")
    assert_logits_close(np.stack(result["decode"]), full[n_prompt:], "transformers cached decode vs full forward")


@pytest.mark.parametrize("variant", TINY_VARIANTS + FAMILY_VARIANTS)
def test_tiny_model_folder(variant: str) -> None:
    model_dir = tiny_model_dir(variant)
    assert FILES <= {p.name for p in model_dir.iterdir()}
    assert tiny_model_dir(variant) == model_dir  # cached: a second call builds nothing
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] in (2, [2, 0])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.decode(encode(model_dir, PROMPT)) == PROMPT


@pytest.mark.parametrize("variant", [v for v in TINY_VARIANTS + FAMILY_VARIANTS if v != "llama_dynamic"])
def test_cached_decode_equals_full_forward(variant: str) -> None:
    model_dir = tiny_model_dir(variant)
    prompt = encode(model_dir, PROMPT)
    greedy = reference_greedy(model_dir, prompt, 16)
    assert len(greedy) == 16
    result = reference_logits(model_dir, prompt, greedy[:-1])
    assert result["prefill"].shape == (len(prompt), reference.VOCAB_SIZE)
    assert result["prefill"].dtype == np.float32 and len(result["decode"]) == 15
    _decode_matches_full(result, len(prompt))
    # generate() is the argmax chain of these logits, with no near-ties to make it
    # fragile: every step's two best logits are further apart than two correct
    # float32 implementations can disagree (each by up to LOGIT_RTOL * max|logit|),
    # so the greedy parity tests compare whole continuations on any CPU.
    steps = np.stack([result["prefill"][-1], *result["decode"]])
    assert steps.argmax(axis=1).tolist() == greedy
    top2 = np.sort(steps, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * LOGIT_RTOL * np.abs(steps).max()
    assert len(set(greedy)) > 1  # not a single token repeated


def test_mistral_sliding_window_is_exercised() -> None:
    config = json.loads((tiny_model_dir("mistral") / "config.json").read_text())
    assert config["sliding_window"] == 8 < len(encode(tiny_model_dir("mistral"), PROMPT))


def test_dynamic_rope_cached_decode() -> None:
    """Dynamic NTK rope: cached decode equals full forward only up to max_position_embeddings."""
    model_dir = tiny_model_dir("llama_dynamic")
    prompt = encode(model_dir, PROMPT)
    limit = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    greedy = reference_greedy(model_dir, prompt, 80 - len(prompt))
    _decode_matches_full(reference_logits(model_dir, prompt, greedy[: limit - len(prompt)]), len(prompt))
    # Past the limit transformers rescales rope as the sequence grows, and cached keys
    # keep their old rotation: a known property of its dynamic rope, not a kit bug.
    longer = reference_logits(model_dir, prompt, greedy[:-1])
    assert np.abs(np.stack(longer["decode"]) - longer["full"][len(prompt) :]).max() > 1e-2


def test_legacy_config_reads_back_as_llama3() -> None:
    from transformers import AutoConfig

    legacy, modern = tiny_model_dir("legacy_config"), tiny_model_dir("llama3")
    raw = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["rope_theta"] == 500000.0
    assert "rope_parameters" in json.loads((modern / "config.json").read_text())
    assert AutoConfig.from_pretrained(legacy).rope_parameters == AutoConfig.from_pretrained(modern).rope_parameters
    prompt = encode(legacy, PROMPT)
    a, b = reference_logits(legacy, prompt, [5, 6, 7]), reference_logits(modern, prompt, [5, 6, 7])
    np.testing.assert_array_equal(a["full"], b["full"])


def test_qwen2_has_nonzero_qkv_biases_and_tied_head() -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(tiny_model_dir("qwen2") / "model.safetensors"))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert np.abs(tensors[f"model.layers.0.self_attn.{name}.bias"]).min() > 0
    assert "lm_head.weight" not in tensors


def test_tokenizer_is_deterministic() -> None:
    assert reference.tiny_tokenizer_json() == reference.tiny_tokenizer_json()


@pytest.mark.slow
def test_smollm2_fixture() -> None:
    model_dir = reference.smollm2_hf_dir()
    assert FILES | {"chat_template.jinja"} <= {p.name for p in model_dir.iterdir()}
    assert reference.smollm2_gguf_path().stat().st_size == 98362432  # via infer.catalog
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    [continuation] = reference.smollm2_reference_greedy(["The capital of France is"], 8)
    assert len(continuation) == 8
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(continuation)
    assert "Paris" in text
    # The template adds SmolLM2's default system prompt; its special tokens encode as single ids.
    ids = reference.smollm2_reference_chat_ids([{"role": "user", "content": "Hi!"}])
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == encode(model_dir, expected)
    assert ids[0] == 1 and ids.count(2) == 2
