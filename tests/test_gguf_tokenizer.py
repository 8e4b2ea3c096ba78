"""Tokenizers rebuilt from GGUF metadata (``infer.formats.gguf_tokenizer``).

The reference is the ``tokenizer.json`` that transformers writes for the same
file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` then
``save_pretrained``), loaded with ``tokenizers`` and compared id for id on fixed
texts and on hypothesis-generated ones:

- SmolLM2-135M (``gpt2`` byte-level BPE, pre-tokenizer ``smollm``) and Gemma 3
  270M (``llama`` SentencePiece-style BPE, 262k tokens), the real files;
- tiny GGUF files written here: a SentencePiece BPE vocabulary trained with
  ``sentencepiece`` (the generic llama path, merges derived from scores) and a
  byte-level BPE vocabulary under several ``tokenizer.ggml.pre`` names.

One deliberate difference: for ``smollm`` (and the other digit-splitting
pre-tokenizers) infer splits digits one by one first, as llama.cpp and
SmolLM2's own ``tokenizer.json`` do; transformers' GGUF converter does not. So
SmolLM2 is compared against transformers' file with that one pre-tokenizer put
back, and a test shows where the two differ.

GGUF metadata is read with the ``gguf`` package's GGUFReader (18 s for Gemma's
262k tokens), so the tokenizer keys are cached as JSON beside the other
reference outputs (``reference.cache_root()``); so are the built tokenizers.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.errors import TokenizerError
from infer.formats import gguf_bpe, gguf_spm, gguf_tokenizer
from infer.formats.gguf_file import StringArray
from infer.formats.gguf_tokenizer import default_cache_dir, tokenizer_from_gguf
from infer.tokenizer import Tokenizer
from reference import _build_dir, _write_atomic, cache_root, smollm2_gguf_path

FIXED_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * 2; }  // C++",
    "日本語のテキストと中文和한국어",
    "Emoji: 😀🎉👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "naïve café résumé Ångström Ünïcödé ß ﬁ İ ı Σ ς",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line\n\nbreaks\r\n\r\nwindows",
    "      \n\n\n   \t ",
    "mixed    spaces  between   words",
    "3.14159 2024-11-30 1,000,000 0x1F 1e-9 12345678901234567890",
    "x =  1\n\t8 apples",
    "x² + y³ = z¹, ½ ¼, ٣٤٥",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|><pad><eos><unk><mask>",
    "<table><tr><td>1</td></tr></table>",
    "I'm sure they'll say we've done it, can't you? DON'T!",
    "\u200b zero width \u00a0 nbsp \u3000 ideographic",
    "<0x41> ▁ ▁▁ Ġ",
    "",
    " ",
    "\n",
    "a",
]

_SPECIAL_LITERALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>",
                     "<end_of_turn>", "<pad>", "<unk>", "<mask>", "<table>", "[multimodal]", "<0x41>", "▁", "Ġ"]
_PIECES = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=" \t\n\r\u00a0\u3000", max_size=8),
    st.text(alphabet="0123456789 .,-+½²٣", max_size=10),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=6),
    st.sampled_from(_SPECIAL_LITERALS),
    st.sampled_from(["def f(x):\n    return x", "Hello, World!", "日本語", "😀👍🏽", "I'm can't", "ÀÉÎõü",
                     "camelCaseWord", "a/b/c", "    ", "\n\n"]),
)
TEXTS = st.lists(_PIECES, max_size=8).map("".join)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- references


def read_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata as the format module gives it: str, int, float, bool,
    list[str] for string arrays and numpy arrays for numeric ones (GGUFReader)."""
    from gguf import GGUFReader, GGUFValueType

    out: dict[str, Any] = {}
    for name, field in GGUFReader(str(path)).fields.items():
        if name.startswith("GGUF."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            out[name] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        elif kind == GGUFValueType.ARRAY:
            out[name] = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)
        elif kind == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            out[name] = field.parts[field.data[0]][0].item()
    return out


def cached_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer keys of a GGUF file (see read_metadata), cached as JSON by name, size and time."""
    stat = path.stat()
    cached = cache_root() / "gguf-metadata" / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}.json"
    if not cached.is_file():
        keep = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in read_metadata(path).items()
                if k.startswith("tokenizer.") or k == "general.architecture"}
        _write_atomic(cached, json.dumps(keep).encode())
    data = json.loads(cached.read_text())
    for key, dtype in (("tokenizer.ggml.scores", np.float32), ("tokenizer.ggml.token_type", np.int32)):
        if key in data:
            data[key] = np.asarray(data[key], dtype=dtype)
    return data


def transformers_tokenizer_dir(gguf: Path, name: str) -> Path:
    """transformers' tokenizer for a GGUF file, saved (tokenizer.json...) and cached per version."""
    version = package_metadata.version("transformers")

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))

    return _build_dir(cache_root() / "gguf-tokenizer-ref" / f"transformers-{version}" / name, build)


def ours(metadata: dict[str, Any]) -> Tokenizer:
    return tokenizer_from_gguf(metadata, cache_dir=cache_root() / "gguf-tokenizers", source="test")


def assert_same_ids(tokenizer: Tokenizer, reference: tokenizers.Tokenizer, text: str) -> None:
    for specials in (True, False):
        got = tokenizer.encode(text, add_special_tokens=specials)
        want = reference.encode(text, add_special_tokens=specials).ids
        assert got == want, f"{text!r} (add_special_tokens={specials})"


def assert_round_trip(tokenizer: Tokenizer, reference: tokenizers.Tokenizer, text: str, exact: bool = True) -> None:
    """Decoding gives the text back (`exact`) and what the reference decodes.

    Not exact for every string: SmolLM2's vocabulary lacks 21 of the 256 byte
    tokens (0x04, 0xF1...), so characters needing them are dropped, as in the reference;
    and SentencePiece vocabularies spell a space ``▁``, so a literal ``▁`` comes back as a space.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if exact and "▁" not in text:
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def smollm2_pre_tokenizer() -> Any:
    """SmolLM2's own pre-tokenizer (its tokenizer.json), which llama.cpp's ``smollm`` rule reproduces."""
    return tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


# ----------------------------------------------------------------------------- SmolLM2 (gpt2, smollm)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, tokenizers.Tokenizer, tokenizers.Tokenizer]:
    """(infer's tokenizer, transformers' with SmolLM2's digit split, transformers' as written)."""
    gguf = smollm2_gguf_path()
    folder = transformers_tokenizer_dir(gguf, "smollm2")
    as_written = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference.pre_tokenizer = smollm2_pre_tokenizer()
    return ours(cached_metadata(gguf)), reference, as_written


@pytest.mark.slow
def test_smollm2_tokenizer_json_is_transformers_but_for_the_digit_split(smollm2) -> None:
    tokenizer, reference, as_written = smollm2
    assert json.loads(tokenizer.backend.to_str()) == json.loads(reference.to_str())
    assert json.loads(as_written.to_str())["pre_tokenizer"]["type"] == "ByteLevel"  # no digit split


@pytest.mark.slow
@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_smollm2_ids_match_reference(smollm2, text: str) -> None:
    tokenizer, reference, _ = smollm2
    assert_same_ids(tokenizer, reference, text)
    assert_round_trip(tokenizer, reference, text)


@pytest.mark.slow
@FUZZ
@given(text=TEXTS)
def test_smollm2_ids_match_reference_on_generated_text(smollm2, text: str) -> None:
    tokenizer, reference, _ = smollm2
    assert_same_ids(tokenizer, reference, text)
    assert_round_trip(tokenizer, reference, text, exact=False)


@pytest.mark.slow
def test_smollm2_splits_digits_like_llama_cpp_not_like_transformers(smollm2) -> None:
    tokenizer, _, as_written = smollm2
    # Whitespace before a digit and non-ASCII numerals after a space: transformers' GPT-2
    # regex keeps " ½" and "\n\t" + "8" differently from a digit-first split.
    for text in (" ½", "\n\t8", "x =  1"):
        got = tokenizer.encode(text)
        assert got != as_written.encode(text).ids, text
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("\n\t8")] == ["Ċĉ", "8"]
    # ASCII digits elsewhere split the same either way (SmolLM2 has no digit merges).
    assert tokenizer.encode("In 2024, 366 days.") == as_written.encode("In 2024, 366 days.").ids


@pytest.mark.slow
def test_smollm2_special_tokens_bos_and_chat_template(smollm2) -> None:
    tokenizer, reference, _ = smollm2
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                               "<|im_end|>")
    assert tokenizer.eos_token_ids == (2,)
    # tokenizer.ggml.add_bos_token is false: no BOS, as transformers.
    assert tokenizer.encode("Hello") == reference.encode("Hello").ids == [19556]
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]  # special tokens are never split
    assert tokenizer.is_special(1) and tokenizer.decode([1, 4093]) == "user"

    assert "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode(prompt, add_special_tokens=False) == reference.encode(prompt, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- Gemma 3 (llama, 262k)


@pytest.fixture(scope="module")
def gemma3() -> tuple[Tokenizer, tokenizers.Tokenizer]:
    real_models = pytest.importorskip("real_models")
    gguf = real_models.gemma3_gguf_path()
    reference = tokenizers.Tokenizer.from_file(str(transformers_tokenizer_dir(gguf, "gemma3") / "tokenizer.json"))
    return ours(cached_metadata(gguf)), reference


@pytest.mark.slow
def test_gemma3_tokenizer_json_is_transformers(gemma3) -> None:
    tokenizer, reference = gemma3
    assert json.loads(tokenizer.backend.to_str()) == json.loads(reference.to_str())


@pytest.mark.slow
@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_gemma3_ids_match_reference(gemma3, text: str) -> None:
    tokenizer, reference = gemma3
    assert_same_ids(tokenizer, reference, text)
    assert_round_trip(tokenizer, reference, text)


@pytest.mark.slow
@FUZZ
@given(text=TEXTS)
def test_gemma3_ids_match_reference_on_generated_text(gemma3, text: str) -> None:
    tokenizer, reference = gemma3
    assert_same_ids(tokenizer, reference, text)
    assert_round_trip(tokenizer, reference, text)


@pytest.mark.slow
def test_gemma3_bos_byte_fallback_and_no_chat_template(gemma3) -> None:
    tokenizer, _ = gemma3
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tokenizer.eos_token_ids == (1,)
    ids = tokenizer.encode("Hello world")
    assert ids[0] == 2 and 2 not in ids[1:]  # add_bos_token: one BOS, from the post-processor
    assert tokenizer.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tokenizer.vocab_size == 262144
    assert tokenizer.encode("  ", add_special_tokens=False) == [138]  # the respelled "▁▁" token
    assert tokenizer.encode("<start_of_turn>", add_special_tokens=False) == [105]
    rare = "\U0010fffd\U000f0000"  # private use, not in the vocabulary: byte-fallback tokens
    assert all(tokenizer.id_to_token(i).startswith("<0x") for i in tokenizer.encode(rare, add_special_tokens=False))
    assert tokenizer.decode(tokenizer.encode(rare)) == rare
    assert tokenizer.chat_template is None


# ----------------------------------------------------------------------------- tiny GGUF files written here


_TRAINING_TEXT = (Path(__file__).parent.parent / "infer" / "tokenizer.py").read_text(encoding="utf-8")


def _write_gguf(path: Path, tokenizer_keys: Any) -> None:
    """A minimal llama GGUF (one tensor) whose tokenizer metadata `tokenizer_keys(writer)` writes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2), (writer.add_rope_dimension_count, 4)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab_size = tokenizer_keys(writer)
    writer.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _sentencepiece_keys(writer: Any) -> int:
    """Tokens, scores and types of a SentencePiece BPE model, as llama.cpp's converter writes them."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAINING_TEXT.splitlines()), model_writer=model, vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<tool>", "\n\n"], control_symbols=["<|turn|>"], remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if tokens[i] in ("<tool>", "\n\n") else 1 for i in range(len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([sp.get_score(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_eot_token_id(tokens.index("<|turn|>"))
    return len(tokens)


def _byte_level_keys(pre: str) -> Any:
    def keys(writer: Any) -> int:
        from tokenizers import models, pre_tokenizers, trainers

        bpe = tokenizers.Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bpe.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainers.BpeTrainer(
            vocab_size=1200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        model = json.loads(bpe.to_str())["model"]
        tokens = sorted(model["vocab"], key=model["vocab"].get)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return len(tokens)

    return keys


def tiny_gguf(name: str, tokenizer_keys: Any) -> tuple[dict[str, Any], tokenizers.Tokenizer]:
    """(metadata, transformers' tokenizer) of a tiny GGUF written once into the cache."""
    version = package_metadata.version("transformers")

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        _write_gguf(out / "model.gguf", tokenizer_keys)
        AutoTokenizer.from_pretrained(str(out), gguf_file="model.gguf").save_pretrained(str(out / "reference"))

    folder = _build_dir(cache_root() / "gguf-tokenizer-ref" / f"transformers-{version}" / f"tiny-{name}", build)
    reference = tokenizers.Tokenizer.from_file(str(folder / "reference" / "tokenizer.json"))
    return cached_metadata(folder / "model.gguf"), reference


@pytest.fixture(scope="module")
def sentencepiece_bpe() -> tuple[dict[str, Any], Tokenizer, tokenizers.Tokenizer]:
    metadata, reference = tiny_gguf("spm-bpe", _sentencepiece_keys)
    return metadata, ours(metadata), reference


@FUZZ
@given(text=st.one_of(TEXTS, st.sampled_from(FIXED_TEXTS)))
def test_sentencepiece_bpe_ids_match_transformers(sentencepiece_bpe, text: str) -> None:
    """The generic llama path: Metaspace ``▁`` prefix, merges derived from the scores."""
    _, tokenizer, reference = sentencepiece_bpe
    assert_same_ids(tokenizer, reference, text)
    # A text starting with a space gets no extra ▁ (Metaspace, as in transformers), but the
    # decoder still strips one leading space: such texts come back one space short.
    assert_round_trip(tokenizer, reference, text, exact=not text.startswith(" "))


def test_sentencepiece_bpe_specials(sentencepiece_bpe) -> None:
    metadata, tokenizer, _ = sentencepiece_bpe
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 1  # llama vocabularies add BOS by default
    assert tokenizer.eos_token_ids == (2, metadata["tokenizer.ggml.tokens"].index("<|turn|>"))
    tool = metadata["tokenizer.ggml.tokens"].index("<tool>")
    ids = tokenizer.encode("a<tool>b", add_special_tokens=False)
    assert tool in ids and not tokenizer.is_special(tool)  # user-defined: kept whole, decoded
    assert tokenizer.decode(ids) == "a<tool>b"
    assert tokenizer.decode(tokenizer.encode("two  spaces")) == "two  spaces"
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("x", add_special_tokens=False)] == ["▁", "x"]


@pytest.mark.parametrize("pre", ["gpt-2", "default", "qwen2", "llama-bpe", "gpt-4o", "tekken"])
def test_byte_level_pre_tokenizers_match_transformers(pre: str) -> None:
    metadata, reference = tiny_gguf(f"bpe-{pre}", _byte_level_keys(pre))
    tokenizer = ours(metadata)
    for text in FIXED_TEXTS + ["camelCaseWords HTTPServer I'M we'LL 1234567 a/b/c\r\n\r\n"]:
        # BOS differs by design where the file has no add_bos_token: llama.cpp adds it for
        # llama3 and tekken, transformers does not; compare the text's own ids.
        got = tokenizer.encode(text, add_special_tokens=False)
        assert got == reference.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(got, skip_special_tokens=False) == text
    assert (tokenizer.encode("x")[:1] == [1]) == (pre in ("llama-bpe", "tekken"))


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(caplog) -> None:
    metadata, _ = tiny_gguf("bpe-gpt-2", _byte_level_keys("gpt-2"))
    reference = ours(metadata)
    with caplog.at_level(logging.WARNING, logger="infer.formats.gguf_tokenizer"):
        tokenizer = ours({**metadata, "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text
    assert tokenizer.encode(FIXED_TEXTS[2]) == reference.encode(FIXED_TEXTS[2])


# ----------------------------------------------------------------------------- the cache


def _small_gpt2() -> dict[str, Any]:
    tokens = ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "abc", "Ġa"]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3, 3, 1, 1, 1, 1, 1, 1, 1], np.int32),
        "tokenizer.ggml.merges": ["a b", "ab c", "Ġ a"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }


def _small_llama() -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "a", "b", "▁a", "ab", "▁ab"]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [0.0] * 256 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 6,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_small_vocabularies_build() -> None:
    gpt2 = tokenizer_from_gguf(_small_gpt2(), cache_dir=cache_root() / "gguf-tokenizers")
    assert gpt2.encode("abc a") == [0, 7, 8]
    assert gpt2.chat_template == "{{ messages[0]['content'] }}"
    llama = tokenizer_from_gguf(_small_llama(), cache_dir=cache_root() / "gguf-tokenizers")
    assert [llama.id_to_token(i) for i in llama.encode("ab ab!")] == ["<s>", "▁ab", "▁ab", "<0x21>"]
    assert llama.decode(llama.encode("ab ab!")) == "ab ab!"


def test_derived_merges_are_cached_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Merges derived from scores are the slow part of building a SentencePiece vocabulary in
    # tokenizers (done when its backend is asked for: the C encoder needs none): they are
    # cached as token id pairs; merges a file stores (gpt2) need no cache.
    tokenizer_from_gguf(_small_gpt2(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    metadata = _small_llama()
    first = tokenizer_from_gguf(metadata, cache_dir=tmp_path)
    first.backend  # noqa: B018  # builds tokenizers' model
    (cached,) = tmp_path.iterdir()  # nothing else left behind by the atomic write
    assert cached.name.endswith(".merges.npy") and len(cached.name.split(".")[0]) == 64  # a sha256
    pairs = np.load(cached)
    assert pairs.dtype == np.int32 and pairs.shape[1] == 2 and len(pairs)

    def no_derive(*args: Any) -> None:
        raise AssertionError("derived again although the cache holds them")

    monkeypatch.setattr(gguf_tokenizer, "_derive_merges", no_derive)
    second = tokenizer_from_gguf(dict(metadata), cache_dir=tmp_path)
    assert second.backend.to_str() == first.backend.to_str()
    text = "ab ab!"
    assert second.encode(text) == first.encode(text)
    monkeypatch.undo()

    # Metadata that changes the merges changes the file; a corrupt or out-of-range file is derived again.
    tokenizer_from_gguf({**metadata, "tokenizer.ggml.scores": [0.0] * 259 + [-6.0, -5.0, -4.0, -3.0, -2.0, -1.0]},
                        cache_dir=tmp_path).backend  # noqa: B018
    assert len(list(tmp_path.glob("*.merges.npy"))) == 2
    for bad in (b"not a numpy file", None):
        if bad is None:
            np.save(cached, np.array([[0, 10**6]], np.int32))
        else:
            cached.write_bytes(bad)
        assert tokenizer_from_gguf(metadata, cache_dir=tmp_path).backend.encode(text).ids == first.encode(text)
        assert np.array_equal(np.load(cached), pairs)


def _stored(strings: list[str]) -> StringArray:
    data = [t.encode() for t in strings]
    return StringArray(b"".join(data), np.cumsum([len(d) for d in data]))


def test_a_file_vocabulary_builds_the_same_tokenizer_as_lists(tmp_path: Path) -> None:
    # A file's string arrays arrive as StringArray (decoded in one go when built).
    metadata = _small_gpt2()
    stored = {**metadata, "tokenizer.ggml.tokens": _stored(metadata["tokenizer.ggml.tokens"]),
              "tokenizer.ggml.merges": _stored(metadata["tokenizer.ggml.merges"])}
    first = tokenizer_from_gguf(stored, cache_dir=tmp_path)
    assert first.backend.to_str() == tokenizer_from_gguf(metadata, cache_dir=tmp_path).backend.to_str()
    assert first.encode("abc a") == [0, 7, 8]


def test_a_duplicate_token_is_refused_when_the_tokenizer_is_built(tmp_path: Path) -> None:
    metadata = _small_gpt2()
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[-1] = tokens[0]
    with pytest.raises(TokenizerError, match="lists .* twice"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.tokens": _stored(tokens)}, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_unwritable_cache_only_costs_a_rebuild(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="infer.formats.gguf_tokenizer"):
        tokenizer = tokenizer_from_gguf(_small_llama(), cache_dir=blocker / "sub")
        tokenizer.backend  # noqa: B018  # builds tokenizers' model, which caches the merges
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("ab")] == ["<s>", "▁ab"]
    assert "could not cache" in caplog.text


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "infer"))
    assert default_cache_dir() == tmp_path / "infer" / "tokenizers"
    monkeypatch.delenv("INFER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "infer" / "tokenizers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "infer" / "tokenizers"


@pytest.mark.slow
def test_gemma3_cache_reused(gemma3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 262k-token vocabulary's derived merges are what the cache is for: the second call reads them."""
    tokenizer, _ = gemma3
    tokenizer.backend  # noqa: B018  # builds tokenizers' model, which caches the merges
    path = cache_root() / "gguf-tokenizers"
    assert any(p.stat().st_size > 1_000_000 for p in path.glob("*.merges.npy"))
    monkeypatch.setattr(gguf_tokenizer, "_derive_merges", lambda *args: pytest.fail("derived again"))
    again = ours(cached_metadata(pytest.importorskip("real_models").gemma3_gguf_path()))
    assert again.backend.encode(FIXED_TEXTS[4]).ids == tokenizer.encode(FIXED_TEXTS[4], add_special_tokens=True)


# ----------------------------------------------------------------------------- bad metadata


def _without(metadata: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if k != key}


BAD = [
    (_without(_small_gpt2(), "tokenizer.ggml.model"), "tokenizer.ggml.model is missing"),
    ({**_small_gpt2(), "tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model is 'bert'"),
    ({**_small_gpt2(), "tokenizer.ggml.model": 7}, "tokenizer.ggml.model must be a string"),
    (_without(_small_gpt2(), "tokenizer.ggml.tokens"), "tokenizer.ggml.tokens is missing"),
    ({**_small_gpt2(), "tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens must be an array"),
    ({**_small_gpt2(), "tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is empty"),
    ({**_small_gpt2(), "tokenizer.ggml.tokens": ["a", 3]}, "tokenizer.ggml.tokens[1] must be a string"),
    ({**_small_gpt2(), "tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries"),
    ({**_small_llama(), "tokenizer.ggml.scores": [0.0] * 3}, "tokenizer.ggml.scores has 3 entries"),
    ({**_small_llama(), "tokenizer.ggml.scores": ["x"] * 265}, "tokenizer.ggml.scores must be a 1-D numeric"),
    (_without(_small_llama(), "tokenizer.ggml.scores"), "tokenizer.ggml.scores is missing"),
    (_without(_small_gpt2(), "tokenizer.ggml.merges"), "tokenizer.ggml.merges is missing"),
    ({**_small_gpt2(), "tokenizer.ggml.merges": ["ab"]}, "tokenizer.ggml.merges[0] is 'ab'"),
    ({**_small_gpt2(), "tokenizer.ggml.merges": ["x y"]}, "merges[0] is 'x y', but 'x' is not in tokenizer.ggml"),
    ({**_small_gpt2(), "tokenizer.ggml.merges": ["b c"]}, "merges[0] is 'b c', but 'bc' is not in tokenizer.ggml"),
    ({**_small_gpt2(), "tokenizer.ggml.bos_token_id": "0"}, "tokenizer.ggml.bos_token_id must be an integer"),
    ({**_small_gpt2(), "tokenizer.ggml.add_bos_token": 1}, "tokenizer.ggml.add_bos_token must be true or false"),
    (_without(_small_gpt2(), "tokenizer.ggml.bos_token_id"), "add_bos_token is true but tokenizer.ggml.bos_token_id"),
    ({**_small_gpt2(), "tokenizer.chat_template": ["x"]}, "tokenizer.chat_template must be a string"),
    ({**_small_gpt2(), "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "abc", "<s>"],
      "tokenizer.ggml.merges": []}, "tokenizer.ggml.tokens lists '<s>' twice (ids 0 and 8)"),
]


@pytest.mark.parametrize(("metadata", "message"), BAD, ids=[message for _, message in BAD])
def test_bad_metadata_raises_tokenizer_error_naming_the_key(metadata: dict[str, Any], message: str,
                                                            tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="^test: .*" + re.escape(message)):
        tokenizer_from_gguf(metadata, cache_dir=tmp_path, source="test")


def test_out_of_range_special_ids_are_ignored_with_a_warning(tmp_path: Path, caplog) -> None:
    metadata = {**_small_gpt2(), "tokenizer.ggml.padding_token_id": 99, "tokenizer.ggml.eot_token_id": 1}
    with caplog.at_level(logging.WARNING, logger="infer.formats.gguf_tokenizer"):
        tokenizer = tokenizer_from_gguf(metadata, cache_dir=tmp_path)
    assert "tokenizer.ggml.padding_token_id = 99" in caplog.text
    assert tokenizer.pad_token is None and tokenizer.eos_token_ids == (1,)


_TOKEN = st.text(max_size=4)


@st.composite
def _metadata(draw: Any) -> dict[str, Any]:
    tokens = draw(st.lists(_TOKEN, max_size=10))
    n = len(tokens)
    base = {
        "general.architecture": draw(st.sampled_from(["llama", "gemma3", "phi3", None])),
        "tokenizer.ggml.model": draw(st.sampled_from(["gpt2", "llama", "llama", "t5", None])),
        "tokenizer.ggml.pre": draw(st.sampled_from(["gpt-2", "smollm", "qwen2", "weird", None])),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": draw(st.one_of(st.none(), st.lists(st.floats(allow_nan=False), min_size=n,
                                                                    max_size=n), st.lists(st.floats()))),
        "tokenizer.ggml.token_type": draw(st.one_of(st.none(), st.lists(st.integers(0, 7), min_size=n, max_size=n))),
        "tokenizer.ggml.merges": draw(st.one_of(st.none(), st.lists(
            st.one_of(st.builds(lambda a, b: f"{a} {b}", st.sampled_from(tokens or [""]),
                                st.sampled_from(tokens or [""])), st.text(max_size=5)), max_size=6))),
        "tokenizer.ggml.add_space_prefix": draw(st.sampled_from([True, False, None])),
        "tokenizer.chat_template": draw(st.sampled_from([None, "{{ bos_token }}"])),
    }
    for key in ("bos", "eos", "unknown", "padding", "eot"):
        base[f"tokenizer.ggml.{key}_token_id"] = draw(st.one_of(st.none(), st.integers(-1, n + 1)))
    for key in ("add_bos_token", "add_eos_token"):
        base[f"tokenizer.ggml.{key}"] = draw(st.sampled_from([True, False, None]))
    return {k: v for k, v in base.items() if v is not None}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(metadata=_metadata())
def test_metadata_never_raises_anything_but_tokenizer_error(metadata: dict[str, Any], tmp_path_factory) -> None:
    try:
        tokenizer = tokenizer_from_gguf(metadata, cache_dir=tmp_path_factory.getbasetemp() / "fuzz")
    except TokenizerError:
        return
    ids = tokenizer.encode("a b ab")
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    tokenizer.decode(ids)


# ----------------------------------------------------------------------------- the C encoder


needs_native = pytest.mark.skipif(not gguf_spm.available(), reason="the C encoder (infer.formats._sentencepiece) "
                                  "is not built")

#: (general.architecture, tokenizer.ggml.add_space_prefix): each way the encoder spells spaces.
_SPACE_RULES = [("llama", None), ("llama", False), ("llama", True), ("gemma3", False), ("gemma3", True),
                ("phi3", None), ("phi3", False)]


def assert_native_matches_tokenizers(tokenizer: Tokenizer, text: str) -> None:
    """The C encoder's ids and text are those of the tokenizers build it stands for."""
    reference = tokenizer.backend
    for specials in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=specials)
        assert ids == reference.encode(text, add_special_tokens=specials).ids, (text, specials)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def spm_variants(sentencepiece_bpe) -> dict[tuple[str, bool | None], Tokenizer]:
    metadata, _, _ = sentencepiece_bpe
    variants = {}
    for architecture, prefix in _SPACE_RULES:
        changed = {**metadata, "general.architecture": architecture}
        if prefix is not None:
            changed["tokenizer.ggml.add_space_prefix"] = prefix
        variants[architecture, prefix] = ours(changed)
    return variants


@needs_native
def test_sentencepiece_vocabularies_get_the_c_encoder(sentencepiece_bpe, spm_variants) -> None:
    _, tokenizer, _ = sentencepiece_bpe
    assert isinstance(tokenizer._native, gguf_spm.SentencePieceBackend)
    assert all(isinstance(t._native, gguf_spm.SentencePieceBackend) for t in spm_variants.values())
    assert tokenizer._backend is None  # tokenizers' model is built only when asked for
    assert isinstance(tokenizer.backend, tokenizers.Tokenizer)


@needs_native
@pytest.mark.parametrize("rule", _SPACE_RULES, ids=[f"{a}-{p}" for a, p in _SPACE_RULES])
def test_c_encoder_matches_tokenizers_on_the_corpus(spm_variants, rule: tuple[str, bool | None]) -> None:
    tokenizer = spm_variants[rule]
    for text in FIXED_TEXTS + [_TRAINING_TEXT[:4000], "▁ ▁▁  ▁x", "<tool><tool>\n\n\n<|turn|> a"]:
        assert_native_matches_tokenizers(tokenizer, text)


@needs_native
@FUZZ
@given(text=TEXTS, rule=st.sampled_from(_SPACE_RULES))
def test_c_encoder_matches_tokenizers_on_generated_text(spm_variants, text: str,
                                                         rule: tuple[str, bool | None]) -> None:
    assert_native_matches_tokenizers(spm_variants[rule], text)


@needs_native
@FUZZ
@given(data=st.data())
def test_c_decoder_matches_tokenizers_on_any_ids(spm_variants, data: st.DataObject) -> None:
    """Byte tokens that spell invalid UTF-8 (U+FFFD per byte), special tokens, ``▁``."""
    tokenizer = spm_variants[data.draw(st.sampled_from(_SPACE_RULES))]
    n = tokenizer.vocab_size
    ids = data.draw(st.lists(st.one_of(st.integers(0, n - 1), st.integers(0, 270)), max_size=12))
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.backend.decode(
            ids, skip_special_tokens=skip)
    # Streaming: the same pieces as a stream over the tokenizers build.
    plain = Tokenizer(tokenizer.backend)
    for skip in (True, False):
        ours, theirs = tokenizer.stream_decoder(skip), plain.stream_decoder(skip)
        assert [ours.push(i) for i in ids] + [ours.flush()] == [theirs.push(i) for i in ids] + [theirs.flush()]


@needs_native
def test_c_encoder_refuses_a_lone_surrogate_by_name(sentencepiece_bpe) -> None:
    _, tokenizer, _ = sentencepiece_bpe
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tokenizer.encode("a\ud800b")


@needs_native
@pytest.mark.parametrize("change", ["nan score", "missing byte token", "file merges", "no extension"])
def test_tokenizers_serves_what_the_c_encoder_does_not(sentencepiece_bpe, change: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = dict(sentencepiece_bpe[0])
    tokens = list(metadata["tokenizer.ggml.tokens"])
    if change == "nan score":
        scores = np.array(metadata["tokenizer.ggml.scores"], np.float32)
        scores[-1] = np.nan
        metadata["tokenizer.ggml.scores"] = scores
    elif change == "missing byte token":
        tokens[tokens.index("<0x41>")] = "<0x41 renamed>"
        metadata["tokenizer.ggml.tokens"] = tokens
    elif change == "file merges":
        metadata["tokenizer.ggml.merges"] = ["▁ t"] if "▁t" in tokens else []
    else:
        monkeypatch.setattr(gguf_spm, "_sentencepiece", None)
    tokenizer = ours(metadata)
    assert tokenizer._native is None
    assert tokenizer.encode("hello world") == tokenizer.backend.encode("hello world").ids


@needs_native
def test_a_stored_vocabulary_gives_the_c_encoder_its_bytes(sentencepiece_bpe) -> None:
    """A file's StringArray reaches the encoder as stored; one holding invalid UTF-8 as
    the StringArray decodes it (bytes replaced), as tokenizers sees it."""
    metadata = sentencepiece_bpe[0]
    tokens = list(metadata["tokenizer.ggml.tokens"])
    stored = ours({**metadata, "tokenizer.ggml.tokens": _stored(tokens)})
    listed = ours(metadata)
    for text in FIXED_TEXTS:
        assert stored.encode(text) == listed.encode(text)
    raw = [t.encode() for t in tokens]
    raw[-1] = b"\xffbad"
    broken = ours({**metadata, "tokenizer.ggml.tokens": StringArray(b"".join(raw), np.cumsum([len(r) for r in raw]))})
    assert broken.id_to_token(len(tokens) - 1) == "\ufffdbad" == broken.backend.id_to_token(len(tokens) - 1)
    for text in FIXED_TEXTS:
        assert_native_matches_tokenizers(broken, text)


@pytest.mark.slow
@needs_native
@FUZZ
@given(text=st.one_of(TEXTS, st.sampled_from(FIXED_TEXTS)))
def test_gemma3_c_encoder_matches_tokenizers(gemma3, text: str) -> None:
    tokenizer, _ = gemma3
    assert tokenizer._native is not None
    assert_native_matches_tokenizers(tokenizer, text)


CONTROL_TYPE, USER_TYPE = gguf_tokenizer.CONTROL, gguf_tokenizer.USER_DEFINED


@pytest.mark.parametrize("tokens", [
    ["<s>", "a", "é", "Ġb", "<tool>", "日本"],  # UTF-8 spellings respelled, a user-defined one kept
    ["<s>", "a", "é", "Ã©", "<tool>"],  # "é" respelled meets "Ã©": the later id keeps the spelling
    ["<s>", "Ã©", "é", "a", "<tool>"],
    ["<s>", "é", "ê", "", "a"],
])
def test_byte_level_vocabulary_respells_as_built_in_order(tokens: list[str]) -> None:
    """The one-pass respelling gives the dict that respelling token by token, in id order, gives."""
    types = np.array([CONTROL_TYPE if t == "<s>" else USER_TYPE if t == "<tool>" else 1 for t in tokens], np.int32)
    vocab = gguf_tokenizer._Vocab.read({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": []}, "test")
    byte = gguf_tokenizer._BYTE_TO_UNICODE
    expected: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(byte.values()).issuperset(token) and types[index] not in (CONTROL_TYPE, USER_TYPE):
            token = "".join(byte[b] for b in token.encode("utf-8"))
        expected[token] = index
    assert vocab._byte_level_vocab(tokens) == expected



# ----------------------------------------------------------------------------- the byte-level C encoder

needs_bytelevel = pytest.mark.skipif(not gguf_bpe.available(), reason="the C encoder (infer.formats._bytelevel) "
                                     "is not built")

#: Every way a byte-level vocabulary pre-tokenizes: GPT-2's regex in ByteLevel, the digit split
#: first (smollm), regexes then ByteLevel without its own (the rest), ignore_merges (llama-bpe, tekken).
_BYTE_LEVEL_PRES = ["gpt-2", "smollm", "qwen2", "llama-bpe", "gpt-4o", "tekken", "deepseek-v3"]
_CHAT_TURNS = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in [
    ("system", "You are terse.  Answer in\tone line."), ("user", "What is 12*34? Ünïcödé, 日本語, 😀"),
    ("assistant", "408.\n\n"), ("user", "   and 0x1F?")]) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def byte_level_variants() -> dict[str, Tokenizer]:
    variants = {}
    for pre in _BYTE_LEVEL_PRES:
        metadata, _ = tiny_gguf(f"bpe-{pre}", _byte_level_keys(pre))
        variants[pre] = ours(metadata)
    # Two byte characters with no token: tokenizers drops them (no unknown token), so must the encoder.
    metadata, _ = tiny_gguf("bpe-gpt-2", _byte_level_keys("gpt-2"))
    tokens = list(metadata["tokenizer.ggml.tokens"])
    for gone in ("Ā", "ÿ"):
        tokens[tokens.index(gone)] = f"<unused {ord(gone)}>"
    variants["missing bytes"] = ours({**metadata, "tokenizer.ggml.tokens": tokens})
    return variants


@needs_bytelevel
def test_byte_level_vocabularies_get_the_c_encoder(byte_level_variants) -> None:
    for name, tokenizer in byte_level_variants.items():
        assert isinstance(tokenizer._native, gguf_bpe.ByteLevelBackend), name
        assert tokenizer._backend is None  # tokenizers' model is built only when asked for
    assert isinstance(tokenizer.backend, tokenizers.Tokenizer)


@needs_bytelevel
@pytest.mark.parametrize("name", _BYTE_LEVEL_PRES + ["missing bytes"])
def test_byte_level_c_encoder_matches_tokenizers_on_the_corpus(byte_level_variants, name: str) -> None:
    tokenizer = byte_level_variants[name]
    for text in FIXED_TEXTS + [_TRAINING_TEXT[:4000], _CHAT_TURNS, "ĀÿĠ Ā\x00\xff", "<|im_end|><|im_end|>x<|im"]:
        assert_native_matches_tokenizers(tokenizer, text)


@needs_bytelevel
@FUZZ
@given(text=st.one_of(TEXTS, st.sampled_from(FIXED_TEXTS)), name=st.sampled_from(_BYTE_LEVEL_PRES + ["missing bytes"]))
def test_byte_level_c_encoder_matches_tokenizers_on_generated_text(byte_level_variants, text: str, name: str) -> None:
    assert_native_matches_tokenizers(byte_level_variants[name], text)


@needs_bytelevel
@FUZZ
@given(data=st.data())
def test_byte_level_c_decoder_matches_tokenizers_on_any_ids(byte_level_variants, data: st.DataObject) -> None:
    """Byte tokens that spell invalid UTF-8 (U+FFFD per maximal invalid run), special tokens."""
    tokenizer = byte_level_variants[data.draw(st.sampled_from(sorted(byte_level_variants)))]
    n = tokenizer.vocab_size
    ids = data.draw(st.lists(st.one_of(st.integers(0, n - 1), st.integers(0, 260)), max_size=12))
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.backend.decode(
            ids, skip_special_tokens=skip)
    for i in ids:
        assert tokenizer.id_to_token(i) == tokenizer.backend.id_to_token(i)
        assert tokenizer.token_to_id(tokenizer.id_to_token(i)) == tokenizer.backend.token_to_id(tokenizer.id_to_token(i))
    # Streaming: the same pieces as a stream over the tokenizers build (no half characters).
    plain = Tokenizer(tokenizer.backend)
    for skip in (True, False):
        ours, theirs = tokenizer.stream_decoder(skip), plain.stream_decoder(skip)
        assert [ours.push(i) for i in ids] + [ours.flush()] == [theirs.push(i) for i in ids] + [theirs.flush()]


@needs_bytelevel
def test_byte_level_c_encoder_refuses_a_lone_surrogate_by_name(byte_level_variants) -> None:
    with pytest.raises(TokenizerError, match="lone surrogate"):
        byte_level_variants["gpt-2"].encode("a\ud800b")


def _spelled_outside_the_alphabet() -> dict[str, Any]:
    """A byte-level vocabulary with UTF-8 spellings: a plain one (respelled), a control and a
    user-defined one (kept, matched whole, decoded as their own bytes)."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<s>", "</s>", *alphabet, "âĤ", "€", "<€ tool>", "<|ñ|>"]
    types = [3, 3] + [1] * 256 + [1, 1, 4, 3]
    return {**_small_gpt2(), "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.merges": ["â Ĥ"]}


@needs_bytelevel
@pytest.mark.parametrize("change", ["merge of no token", "duplicate merge", "empty token", "respelling meets a token",
                                    "stored bytes not UTF-8", "no extension", "spelled outside the alphabet"])
def test_byte_level_fallback_and_edge_vocabularies(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the C encoder refuses goes to tokenizers (which names what is wrong); what it takes,
    it encodes and decodes as tokenizers does."""
    metadata = _small_gpt2()
    tokens = list(metadata["tokenizer.ggml.tokens"])
    native = True
    if change == "merge of no token":
        with pytest.raises(TokenizerError, match=r"merges\[3\].*'x' is not in"):
            ours({**metadata, "tokenizer.ggml.merges": [*metadata["tokenizer.ggml.merges"], "a x"]})
        return
    if change == "duplicate merge":  # the later listing's rank counts, as in tokenizers' merge map
        metadata["tokenizer.ggml.merges"] = ["ab c", "a b", "Ġ a", "ab c"]
    elif change == "empty token":
        metadata["tokenizer.ggml.tokens"], native = [*tokens, ""], False
        metadata["tokenizer.ggml.token_type"] = np.append(metadata["tokenizer.ggml.token_type"], 1)
    elif change == "respelling meets a token":
        tokens[6:8], native = ["€", "âĤ¬"], False
        metadata["tokenizer.ggml.tokens"] = tokens
        metadata["tokenizer.ggml.merges"] = []
    elif change == "stored bytes not UTF-8":
        raw = [t.encode() for t in tokens]
        raw[8], native = b"\xffa", False
        metadata["tokenizer.ggml.tokens"] = StringArray(b"".join(raw), np.cumsum([len(r) for r in raw]))
        metadata["tokenizer.ggml.merges"] = ["a b", "ab c"]
    elif change == "no extension":
        monkeypatch.setattr(gguf_bpe, "_bytelevel", None)
        native = False
    else:
        metadata = _spelled_outside_the_alphabet()
    tokenizer = ours(metadata)
    assert isinstance(tokenizer._native, gguf_bpe.ByteLevelBackend) == native
    for text in ["abc a", "abcabc ab c", "€ <€ tool><|ñ|> €e", "<s>a</s>", "\xe9\xff", ""]:
        assert_native_matches_tokenizers(tokenizer, text)
    ids = list(range(tokenizer.vocab_size))
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.backend.decode(ids, skip_special_tokens=False)


@needs_bytelevel
def test_a_stored_byte_level_vocabulary_gives_the_c_encoder_its_bytes() -> None:
    metadata = _spelled_outside_the_alphabet()
    stored = ours({**metadata, "tokenizer.ggml.tokens": _stored(metadata["tokenizer.ggml.tokens"]),
                   "tokenizer.ggml.merges": _stored(metadata["tokenizer.ggml.merges"])})
    assert isinstance(stored._native, gguf_bpe.ByteLevelBackend)
    listed = ours(metadata)
    for text in FIXED_TEXTS + ["€ <€ tool><|ñ|> €e"]:
        assert stored.encode(text) == listed.encode(text)
    assert stored.id_to_token(259) == listed.id_to_token(259) == "âĤ¬"  # "€", respelled
    assert stored.encode("€", add_special_tokens=False) == [258, 2 + sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()).index("¬")]


@pytest.mark.slow
@needs_bytelevel
def test_smollm2_gets_the_c_encoder_and_its_chat_turns(smollm2) -> None:
    tokenizer, reference, _ = smollm2
    assert isinstance(tokenizer._native, gguf_bpe.ByteLevelBackend)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?  Ünï 日本 😀\n\n"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "\tand 10**3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    for text in (prompt, _CHAT_TURNS, _TRAINING_TEXT):
        assert_native_matches_tokenizers(tokenizer, text)
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
@needs_bytelevel
@FUZZ
@given(text=st.one_of(TEXTS, st.sampled_from(FIXED_TEXTS)))
def test_smollm2_c_encoder_matches_tokenizers(smollm2, text: str) -> None:
    """SmolLM2 lacks 21 byte tokens: characters needing them are dropped alike."""
    tokenizer, _, _ = smollm2
    assert_native_matches_tokenizers(tokenizer, text)
