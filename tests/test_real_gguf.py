"""Both real GGUF models, loaded directly by infer, against transformers float32.

The catalog fetches the files (``smollm2-135m``, ``gemma3-270m``); transformers
dequantizes the same files to float32 (``from_pretrained(dir, gguf_file=...)``)
for the reference. Prompts are fed as token ids, identical on both sides.
"""

from __future__ import annotations

import io
import sys

import pytest
from real_models import gemma3_hf_dir
from reference import (
    assert_greedy_equal,
    encode,
    float32_rtol,
    reference_greedy,
    reference_teacher_forced,
    smollm2_gguf_path,
    smollm2_hf_dir,
)

import infer
from infer.errors import ChatTemplateError
from infer.tools.cli import main

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "The three primary colors are"]


@pytest.fixture(scope="module")
def smollm2() -> infer.Model:
    return infer.load("smollm2-135m", backend="numpy")


@pytest.fixture(scope="module")
def gemma3() -> infer.Model:
    return infer.load("gemma3-270m", backend="numpy")


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_tokens_equal_transformers_float32(name: str, request: pytest.FixtureRequest) -> None:
    model: infer.Model = request.getfixturevalue(name)
    assert model.package.format == "gguf"
    hf_dir = smollm2_hf_dir() if name == "smollm2" else gemma3_hf_dir()
    for prompt in PROMPTS:
        ids = encode(hf_dir, prompt)
        if name == "gemma3":
            ids = [model.tokenizer.bos_token_id] + ids
        want = reference_greedy(hf_dir, ids, NEW_TOKENS)
        got = list(model.generate_tokens(ids, max_tokens=NEW_TOKENS, ignore_eos=True))
        logits = reference_teacher_forced(hf_dir, ids, want)
        assert_greedy_equal(got, want, logits, float32_rtol(hf_dir),
                            f"{name} {prompt!r}: {model.tokenizer.decode(got)!r} vs {model.tokenizer.decode(want)!r}")


def test_gguf_tokenizers_agree_with_the_hf_folders_on_the_prompts(smollm2: infer.Model, gemma3: infer.Model) -> None:
    for prompt in PROMPTS:
        assert smollm2.tokenizer.encode(prompt) == encode(smollm2_hf_dir(), prompt)
        assert gemma3.tokenizer.encode(prompt) == [gemma3.tokenizer.bos_token_id] + encode(gemma3_hf_dir(), prompt)


def test_smollm2_chats_through_its_chatml_template(smollm2: infer.Model, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["-q", "chat", "smollm2-135m", "--backend", "numpy", "-n", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_gemma3_base_model_has_no_chat_template(gemma3: infer.Model) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        gemma3.chat([{"role": "user", "content": "Hi"}])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert gemma3.chat([{"role": "user", "content": "The capital of France is"}], template=template, max_tokens=4)


def test_gemma3_chat_cli_error_is_clear(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "chat", "gemma3-270m", "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    assert "no chat template" in err and "--template FILE" in err


def test_stored_weight_bytes_of_a_gguf_file_are_its_tensor_bytes() -> None:
    """The benchmark's bandwidth bound reads weight bytes from infer's own GGUF
    index (no data read); gguf's reader, which parses everything, agrees."""
    import gguf

    from infer.tools.bench import stored_weight_bytes

    path = smollm2_gguf_path()
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in sizes  # SmolLM2 ties its head to the embedding: both are one tensor
    assert tied and stored_weight_bytes(path) == sum(sizes.values())
