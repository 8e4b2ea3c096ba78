"""infer.tokenizer: same ids as transformers, exact streaming, clear errors.

Four small tokenizers are trained here, one per family a user meets:

- ``llama``: SentencePiece BPE with byte fallback, as Llama 2 ships it
  (``▁`` normalizer, decoder that strips the first space, BOS from the
  post-processor);
- ``metaspace``: the same vocabulary with a Metaspace pre-tokenizer and no
  post-processor, but ``add_bos_token: true`` in tokenizer_config;
- ``qwen``: byte-level BPE with ChatML special tokens and no BOS;
- ``llama3``: byte-level BPE whose post-processor adds ``<|begin_of_text|>``.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from infer.errors import ChatTemplateError, TokenizerError
from infer.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def hello_world():\n    print('hi')  # greet\n    return 42\n",
    "Hello world! How are you today? I'm fine, thanks.",
    "naïve café résumé über straße",
    "日本語のテキストと中文文本",
    "emoji 😀 time and 👍 again",
    "    indented\tcode\n\n\nwith   runs   of   spaces",
] * 40

TEXTS = [
    "Hello world",
    "",
    " ",
    " leading space",
    "trailing spaces   ",
    "multiple   spaces\tand\ttabs\n\nnewlines\r\n",
    "naïve café résumé",
    "日本語のテキスト 中文",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "combining e\u0301 and A\u030a; nbsp\u00a0here",
    "∮ E⋅da = Q, n → ∞",
    "numbers 1234567890 and 3.14159",
    "literal ▁ metaspace char",
    "<s> literal </s> specials <|im_end|> and <|im_start|>user",
]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

GPT4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# -- building the tokenizers ------------------------------------------------------


@functools.cache
def _sentencepiece_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a SentencePiece BPE model with byte fallback,
    converted the way transformers' LlamaConverter does (merges by score)."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.99, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    normal = {
        sp.id_to_piece(i): (sp.get_score(i), i)
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    ranked = sorted(
        (-score, i, piece[:k], piece[k:])
        for piece, (score, i) in normal.items()
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    )
    return vocab, [(left, right) for _, _, left, right in ranked]


def _sentencepiece_backend(style: str) -> Backend:
    vocab, merges = _sentencepiece_vocab()
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if style == "llama":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return backend


@functools.cache
def _byte_level_json() -> str:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(GPT4_SPLIT), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend.to_str()


def _byte_level_backend(style: str) -> Backend:
    backend = Backend.from_str(_byte_level_json())
    if style == "qwen":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos = backend.token_to_id("<|begin_of_text|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    return backend


CONFIGS = {
    "llama": {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False},
        "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": False,
    },
    "metaspace": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                  "tokenizer_class": "PreTrainedTokenizerFast"},
    "qwen": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
             "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHATML},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>",
               "tokenizer_class": "PreTrainedTokenizerFast"},
}
STYLES = list(CONFIGS)


def write_folder(folder: Path, style: str, config: dict | None = None) -> Path:
    """A model folder with tokenizer.json and tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = _sentencepiece_backend(style) if style in ("llama", "metaspace") else _byte_level_backend(style)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(CONFIGS[style] if config is None else config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: write_folder(root / style, style) for style in STYLES}


@pytest.fixture(scope="module")
def toks(folders: dict[str, Path]) -> dict[str, Tokenizer]:
    return {style: Tokenizer.from_folder(folder) for style, folder in folders.items()}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict:
    """transformers' generic fast tokenizer, which runs tokenizer.json as is."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return {style: transformers.PreTrainedTokenizerFast.from_pretrained(str(f)) for style, f in folders.items()}


# -- same ids and text as transformers ------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_encode_matches_transformers(style: str, toks: dict, references: dict) -> None:
    tok, ref = toks[style], references[style]
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=True)
        if style == "metaspace":
            # add_bos_token is true but no post-processor adds BOS: infer
            # prepends it (as transformers 4's Llama tokenizers did);
            # transformers 5 ignores add_bos_token when tokenizer.json exists.
            expected = [tok.bos_token_id, *expected]
        assert tok.encode(text) == expected, text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("style", STYLES)
def test_decode_matches_transformers(style: str, toks: dict, references: dict) -> None:
    tok, ref = toks[style], references[style]
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("style", STYLES)
def test_vocabulary_and_special_tokens_match_transformers(style: str, toks: dict, references: dict) -> None:
    tok, ref = toks[style], references[style]
    assert tok.vocab_size == len(ref)
    assert tok.bos_token == ref.bos_token and tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token == ref.eos_token and tok.eos_token_id == ref.eos_token_id
    assert tok.eos_token_ids == (ref.eos_token_id,)
    assert tok.special_ids == {i for i, token in ref.added_tokens_decoder.items() if token.special}
    assert tok.special_ids >= set(ref.all_special_ids)
    for token_id in tok.special_ids:
        assert tok.is_special(token_id)
        assert tok.decode([token_id]) == ""
        assert tok.token_to_id(tok.id_to_token(token_id)) == token_id


def test_bos_is_not_doubled_when_post_processor_adds_it(toks: dict) -> None:
    ids = toks["llama"].encode("Hello")
    assert ids[0] == toks["llama"].bos_token_id and ids[1] != toks["llama"].bos_token_id


def test_add_bos_and_eos_tokens_from_constructor(folders: dict) -> None:
    backend = Backend.from_file(str(folders["qwen"] / "tokenizer.json"))
    plain = Tokenizer(backend).encode("Hi there")
    tok = Tokenizer(backend, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                    add_bos_token=True, add_eos_token=True)
    assert tok.encode("Hi there") == [tok.bos_token_id, *plain, tok.eos_token_id]
    assert tok.encode("Hi there", add_special_tokens=False) == plain


def test_extra_eos_tokens_end_generation_too(folders: dict) -> None:
    backend = Backend.from_file(str(folders["qwen"] / "tokenizer.json"))
    tok = Tokenizer(backend, eos_token="<|endoftext|>", extra_eos_tokens=["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token_ids == (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))


def test_round_trip_of_byte_level_text(toks: dict) -> None:
    tok = toks["qwen"]
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


# -- streaming ----------------------------------------------------------------------

PIECES = ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "日本", "語", "中文", "e\u0301", "\u0301", "Å", "ß", "  ", "\n", "\t",
          "▁", "▁▁", "\ufffd", "<s>", "</s>", "<|im_end|>", "<|im_start|>", " Hello", "world", "x = 1"]
stream_texts = st.lists(
    st.one_of(st.text(max_size=6), st.sampled_from(PIECES)), max_size=12
).map("".join)


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def _check_stream(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces = _stream(tok, ids, skip)
    assert "".join(pieces) == full
    emitted = ""
    for piece in pieces[:-1]:
        emitted += piece
        # Every piece continues the final text: nothing is retracted, and no
        # U+FFFD appears where the full text has a real character.
        assert full.startswith(emitted)


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("style", STYLES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=stream_texts)
def test_stream_equals_decode(style: str, skip: bool, text: str, toks: dict) -> None:
    tok = toks[style]
    _check_stream(tok, tok.encode(text), skip)


@pytest.mark.parametrize("style", STYLES)
def test_stream_equals_decode_on_fixed_texts(style: str, toks: dict) -> None:
    tok = toks[style]
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            _check_stream(tok, ids, skip)
    # Several sequences in a row, with special tokens between them.
    ids = [i for text in TEXTS for i in tok.encode(text) + [tok.eos_token_id]]
    _check_stream(tok, ids, True)
    _check_stream(tok, ids, False)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stream_of_arbitrary_byte_level_ids(data: st.DataObject, toks: dict) -> None:
    # A sampling model can emit any ids, including byte sequences that are
    # not UTF-8; byte-level decoding replaces those locally, so the stream
    # still equals decode.
    tok = toks["qwen"]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=20))
    _check_stream(tok, ids, True)
    _check_stream(tok, ids, False)


@pytest.mark.parametrize("style", ["llama", "metaspace"])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stream_of_arbitrary_byte_fallback_ids(style: str, data: st.DataObject, toks: dict) -> None:
    # Any ids, as long as each run of byte tokens spells valid UTF-8: a
    # SentencePiece decoder turns a whole run into U+FFFD once any byte in it
    # is invalid, which a stream that already showed the run's first
    # characters cannot match (documented on StreamDecoder, with the "▁" case).
    tok = toks[style]
    tokens = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    byte_id = {int(token[3:5], 16): i for i, token in enumerate(tokens) if token.startswith("<0x")}
    other = [i for i in range(tok.vocab_size) if i not in byte_id.values()]
    # No lone surrogates (no UTF-8), and not the space marker itself, which the
    # Metaspace decoder keeps or drops by what precedes it (documented there too).
    chars = st.characters(codec="utf-8").filter(lambda c: c != "\u2581")
    as_bytes = chars.map(lambda c: [byte_id[b] for b in c.encode()])
    chunks = data.draw(st.lists(st.one_of(st.sampled_from(other).map(lambda i: [i]), as_bytes), max_size=16))
    ids = [i for chunk in chunks for i in chunk]
    _check_stream(tok, ids, True)
    _check_stream(tok, ids, False)


def test_stream_holds_back_partial_characters(toks: dict) -> None:
    tok = toks["llama"]
    ids = tok.encode("😀", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert _stream(tok, ids, True)[-5:] == ["", "", "", "😀", ""]
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids[:-1]]
    assert "".join(pieces) == "" and decoder.flush() == tok.decode(ids[:-1])


def test_stream_work_per_token_is_bounded(toks: dict) -> None:
    tok = toks["llama"]
    windows: list[int] = []

    def counting_decode(ids: list[int], skip_special_tokens: bool) -> str:
        windows.append(len(ids))
        return tok.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    decoder = tok.stream_decoder()
    decoder._decode = counting_decode  # observe the windows it decodes
    ids = tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 2000
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == tok.decode(ids)
    assert max(windows) <= 16, max(windows)


def test_stream_rejects_bad_ids(toks: dict) -> None:
    decoder = toks["qwen"].stream_decoder()
    with pytest.raises(TokenizerError, match="out of range"):
        decoder.push(toks["qwen"].vocab_size)


# -- loading and errors ----------------------------------------------------------------


def test_missing_tokenizer_json_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_folder(tmp_path)


def test_malformed_files_raise_tokenizer_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json is not a valid tokenizers file"):
        Tokenizer.from_folder(tmp_path)
    write_folder(tmp_path, "qwen")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(TokenizerError, match="eos_token"):
        Tokenizer.from_folder(tmp_path)


def test_special_tokens_map_json(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    token_map = {"eos_token": "<|endoftext|>", "pad_token": {"content": "<|endoftext|>"}}
    # A config saved before transformers 4.34 (no added_tokens_decoder): the
    # map overrides it, as transformers does.
    write_folder(tmp_path, "qwen", config={"eos_token": "<|im_end|>"})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(token_map))
    tok, ref = Tokenizer.from_folder(tmp_path), transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (tok.eos_token, tok.pad_token) == (ref.eos_token, ref.pad_token) == ("<|endoftext|>", "<|endoftext|>")
    # A newer config is complete: the map is ignored.
    write_folder(tmp_path, "qwen", config={"eos_token": "<|im_end|>", "added_tokens_decoder": {}})
    tok, ref = Tokenizer.from_folder(tmp_path), transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (tok.eos_token, tok.pad_token) == (ref.eos_token, ref.pad_token) == ("<|im_end|>", None)


def test_special_token_missing_from_tokenizer_json_is_added(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = {
        "eos_token": "<|im_end|>", "additional_special_tokens": ["<tool>"],
        "extra_special_tokens": {"image_token": "<image>"},
        "added_tokens_decoder": {"900": {"content": "<think>", "special": False}, "901": {"content": "<|fim|>"}},
    }
    write_folder(tmp_path, "qwen", config=config)
    tok = Tokenizer.from_folder(tmp_path)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert tok.is_special(tok.token_to_id("<tool>")) and not tok.is_special(tok.token_to_id("<think>"))
    text = "a<tool>b <think>c<|fim|>d<image>"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert tok.vocab_size == len(ref)
    assert tok.special_ids == {i for i, token in ref.added_tokens_decoder.items() if token.special}


def test_decode_and_encode_reject_bad_input(toks: dict) -> None:
    tok = toks["llama"]
    for bad in ([tok.vocab_size], [-1], [1.5], ["3"], [True]):
        with pytest.raises(TokenizerError):
            tok.decode(bad)
    with pytest.raises(TokenizerError, match="encode expects a str, got bytes"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError):
        tok.id_to_token(10**9)


def test_unknown_named_token_is_an_error(folders: dict) -> None:
    backend = Backend.from_file(str(folders["qwen"] / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="'<nope>' is not in the tokenizer's vocabulary"):
        Tokenizer(backend, eos_token="<nope>")


# -- chat templates from the folder -------------------------------------------------------


def test_chat_template_from_config_renders_like_transformers(toks: dict, references: dict) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
    for add in (True, False):
        expected = references["qwen"].apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert toks["qwen"].apply_chat_template(messages, add_generation_prompt=add) == expected
    assert toks["qwen"].chat_template == CHATML


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    write_folder(tmp_path, "qwen")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_named_templates_from_config_list(tmp_path: Path) -> None:
    config = dict(CONFIGS["qwen"], chat_template=[
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"},
    ])
    tok = Tokenizer.from_folder(write_folder(tmp_path, "qwen", config=config))
    user = [{"role": "user", "content": "x"}]
    assert tok.chat_template == "plain"
    assert tok.apply_chat_template(user) == "plain"
    assert tok.apply_chat_template(user, tools=[{"name": "f"}]) == "tools: 1"
    assert tok.apply_chat_template(user, template="tool_use", tools=[]) == "tools: 0"


def test_missing_chat_template_says_how_to_pass_one(toks: dict) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template.*template="):
        toks["llama"].apply_chat_template([{"role": "user", "content": "hi"}])
    assert toks["llama"].apply_chat_template([{"role": "user", "content": "hi"}], template=CHATML).endswith(
        "<|im_start|>assistant\n"
    )
