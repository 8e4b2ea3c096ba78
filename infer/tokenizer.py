"""Text to token ids and back, special tokens, streaming and chat templates.

:class:`Tokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` (the Rust
library behind transformers' fast tokenizers) built from ``tokenizer.json``, so
normalization, pre-tokenization, the model (BPE, Unigram, ...), the
post-processor (BOS/EOS) and the decoder are exactly those the model shipped
with. ``tokenizer_config.json`` adds the named special tokens and the chat
template. :class:`StreamDecoder` turns generated ids into text one token at a
time without ever emitting half a character.

A format may hand :class:`Tokenizer` a :class:`NativeBackend` instead: an
encoder and decoder of its own for the vocabularies it covers, giving the ids
and text of the ``tokenizers.Tokenizer`` it stands for, which is then built
only when :attr:`Tokenizer.backend` is asked for (GGUF SentencePiece
vocabularies: :mod:`infer.formats.gguf_spm`; GGUF byte-level BPE vocabularies:
:mod:`infer.formats.gguf_bpe`).
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from infer.errors import ChatTemplateError, TokenizerError

logger = logging.getLogger(__name__)

__all__ = ["NativeBackend", "StreamDecoder", "Tokenizer", "tokenizer_errors"]

#: transformers' named special tokens, in the order it adds missing ones.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@contextlib.contextmanager
def tokenizer_errors(what: str) -> Iterator[None]:
    """Turn whatever the ``tokenizers`` library raises inside the block into a
    :class:`~infer.errors.TokenizerError` that starts with ``what``.

    The Rust side raises plain ``Exception``s for bad files and input, and,
    where a file makes it panic, pyo3's ``PanicException``, which derives
    from ``BaseException`` so that ``except Exception`` misses it. A panic
    leaves no state behind in the Rust object, so it is reported like any
    other error; ``KeyboardInterrupt`` and ``SystemExit`` pass through.
    """
    try:
        yield
    except TokenizerError:
        raise
    except Exception as exc:
        raise TokenizerError(f"{what}: {type(exc).__name__}: {exc}") from exc
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":  # pyo3_runtime's, created on the first panic
            raise
        raise TokenizerError(f"{what}: the tokenizers library panicked: {exc}") from exc


class NativeBackend(abc.ABC):
    """An encoder and decoder that stand for a ``tokenizers.Tokenizer``:
    same ids, same text, for the vocabularies a format builds it for.

    Ids given to :meth:`decode` and :meth:`id_to_token` are checked to be in
    ``[0, vocab_size)`` by :class:`Tokenizer`.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids."""

    @property
    @abc.abstractmethod
    def special_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out."""

    @abc.abstractmethod
    def encode_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with what the post-processor adds around it when
        ``add_special_tokens``. May raise ``UnicodeEncodeError`` for a lone surrogate."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a spelling, or None."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The spelling of an id."""

    @abc.abstractmethod
    def tokenizers_backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` this stands for, built now."""


class Tokenizer:
    """A model's tokenizer: encoding, decoding, special tokens, chat template.

    Args:
        backend: the ``tokenizers.Tokenizer`` (from ``tokenizer.json``). Its
            truncation and padding are switched off: a prompt is never cut.
            Or a :class:`NativeBackend`, which encodes and decodes instead.
        bos_token, eos_token, pad_token: the named special tokens; each must
            be in the vocabulary.
        add_bos_token: True makes :meth:`encode` start with BOS (prepended
            when the post-processor does not add it, never doubled). None or
            False leave it to the post-processor, as transformers 5 does.
        add_eos_token: the same for EOS at the end.
        chat_template: the default template source, or a dict of named ones
            (``"default"``, ``"tool_use"``...), or None.
        extra_eos_tokens: further tokens that end generation (``<|im_end|>``,
            ``<|eot_id|>``...), after ``eos_token`` in :attr:`eos_token_ids`.

    Raises:
        TokenizerError: a named token is not in the vocabulary.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | NativeBackend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = False,
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_tokens: Iterable[str] = (),
    ) -> None:
        if not isinstance(backend, (tokenizers.Tokenizer, NativeBackend)):
            raise TokenizerError(f"backend must be a tokenizers.Tokenizer or a NativeBackend, "
                                 f"got {type(backend).__name__}")
        with tokenizer_errors("tokenizer"):
            self._setup(backend, bos_token, eos_token, pad_token, add_bos_token, add_eos_token, extra_eos_tokens)
        self._templates = _check_templates(chat_template)

    def _setup(self, backend: tokenizers.Tokenizer | NativeBackend, bos_token: str | None, eos_token: str | None,
               pad_token: str | None, add_bos_token: bool | None, add_eos_token: bool | None,
               extra_eos_tokens: Iterable[str]) -> None:
        self._native = backend if isinstance(backend, NativeBackend) else None
        self._backend = None if self._native else backend
        if self._backend is not None:
            self._backend.no_truncation()
            self._backend.no_padding()
        self._lookup = self._backend if self._native is None else self._native  # token_to_id, id_to_token
        self._bos_token, self._eos_token, self._pad_token = bos_token, eos_token, pad_token
        self._bos_id = self._named_id("bos_token", bos_token)
        self._eos_id = self._named_id("eos_token", eos_token)
        self._named_id("pad_token", pad_token)
        eos_ids = [] if self._eos_id is None else [self._eos_id]
        for token in extra_eos_tokens:
            token_id = self._named_id("extra_eos_tokens", token)
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        self._eos_ids = tuple(eos_ids)

        if self._native is not None:
            self._special_ids = self._native.special_ids
            self._vocab_size = self._native.vocab_size
        else:
            added = backend.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, t in added.items() if t.special)
            self._vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)

        # What the post-processor adds around a text is what it adds around "".
        around_empty = self._encode_ids("", True)
        self._prepend_bos = bool(add_bos_token) and self._bos_id is not None and around_empty[:1] != [self._bos_id]
        self._append_eos = bool(add_eos_token) and self._eos_id is not None and around_empty[-1:] != [self._eos_id]
        if self._prepend_bos:
            logger.info("add_bos_token is set and the post-processor adds no BOS: prepending %r", bos_token)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special
        tokens, ``add_bos_token``/``add_eos_token``, chat template),
        ``special_tokens_map.json`` (which, as in transformers, overrides an
        old config without ``added_tokens_decoder`` and is ignored otherwise) and
        ``chat_template.jinja`` plus ``chat_templates/*.jinja``, which take
        precedence over the config's template as in transformers 5. Named
        special tokens missing from ``tokenizer.json`` are added as special
        tokens, as transformers does. ``add_bos_token: true`` is honoured when
        the post-processor adds no BOS (transformers 4's Llama tokenizers did;
        transformers 5 ignores the flag once ``tokenizer.json`` exists).

        Raises:
            TokenizerError: ``tokenizer.json`` is missing or malformed, or a
                config file is not valid JSON or has a wrong-typed entry.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {folder}; infer needs the fast-tokenizer file "
                "(a folder with only tokenizer.model can be converted with transformers: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
            )
        with tokenizer_errors(f"{tokenizer_file} is not a valid tokenizers file"):
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))

        config = _read_json(folder / "tokenizer_config.json")
        settings = config
        if "added_tokens_decoder" not in config:  # saved before transformers 4.34
            settings = {**config, **_read_json(folder / "special_tokens_map.json")}
        where = f"{folder}: tokenizer_config.json or special_tokens_map.json"
        names = {key: _token_content(settings.get(key), f"{where}: {key}") for key in _NAMED_TOKENS}
        with tokenizer_errors(f"{folder}: adding the special tokens of tokenizer_config.json"):
            _add_missing_tokens(backend, folder, settings, names)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        flags = {key: _optional_bool(config, key, folder) for key in ("add_bos_token", "add_eos_token")}
        return cls(backend, bos_token=names["bos_token"], eos_token=names["eos_token"], pad_token=names["pad_token"],
                   chat_template=_read_templates(folder, config), **flags)

    # -- encoding and decoding ---------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens`` the post-processor adds what the model
        expects around a text (usually BOS); pass False for text that already
        carries its special tokens, such as a rendered chat template.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        try:
            with tokenizer_errors("encoding the text"):
                ids = self._encode_ids(text, add_special_tokens)
        except TokenizerError:
            _check_utf8(text)  # the likelier cause, named precisely
            raise
        if add_special_tokens:
            if self._prepend_bos:
                ids.insert(0, self._bos_id)
            if self._append_eos:
                ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens are left out unless asked for.

        Raises:
            TokenizerError: an id is not an integer or not in ``[0, vocab_size)``.
        """
        checked = [self._check_id(i) for i in ids]
        with tokenizer_errors("decoding token ids"):
            return self._decode_ids(checked, skip_special_tokens)

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._native is not None:
            return self._native.encode_ids(text, add_special_tokens)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _decode_ids(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of checked ids."""
        if self._native is not None:
            return self._native.decode(ids, skip_special_tokens)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A :class:`StreamDecoder` for text generated one token at a time."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- vocabulary ----------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (for a :class:`NativeBackend`, the
        one it stands for, built on first use)."""
        if self._backend is None:
            with tokenizer_errors("building the tokenizers backend"):
                backend = self._native.tokenizers_backend()
                backend.no_truncation()
                backend.no_padding()
            self._backend = backend
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (one past the largest id)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (``"<s>"``, ``"▁the"``...), or None."""
        return self._lookup.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The token string of an id (not its decoded text).

        Raises:
            TokenizerError: the id is out of range or unused.
        """
        token = self._lookup.id_to_token(self._check_id(token_id))
        if token is None:
            raise TokenizerError(f"token id {token_id} is not used by this tokenizer")
        return token

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode(..., skip_special_tokens=True)`` leaves this id out."""
        return token_id in self._special_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those skipped when decoding)."""
        return self._special_ids

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token, or None."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token, or None."""
        return self._eos_token

    @property
    def pad_token(self) -> str | None:
        """The padding token, or None (templates may print it)."""
        return self._pad_token

    @property
    def bos_token_id(self) -> int | None:
        """Id of :attr:`bos_token`, or None."""
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of :attr:`eos_token`, or None."""
        return self._eos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: :attr:`eos_token_id`, then the extra ones."""
        return self._eos_ids

    # -- chat -----------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return None if self._templates is None else self._templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every chat template by name (``"default"``, ``"tool_use"``...); empty if none."""
        return dict(self._templates or {})

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation as prompt text with the model's chat template.

        ``template`` overrides the model's: either Jinja source or the name of
        one of the model's templates (``"tool_use"``). With ``tools`` and no
        ``template``, a ``"tool_use"`` template is preferred, as in
        transformers. Encode the result with ``add_special_tokens=False``: the
        template writes the special tokens itself. See
        :func:`infer.chat_template.render_chat_template` for the arguments.

        Raises:
            ChatTemplateError: there is no template, or rendering failed.
        """
        from infer.chat_template import render_chat_template  # jinja2 only once a template is rendered

        source = self._select_template(template, tools)
        if self._pad_token is not None:
            kwargs.setdefault("pad_token", self._pad_token)
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self._bos_token, eos_token=self._eos_token, tools=tools, **kwargs)

    def _select_template(self, template: str | None, tools: object) -> str:
        named = self._templates or {}
        if template is not None:
            return named.get(template, template)
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        if named:
            raise ChatTemplateError(f"the model's chat templates {sorted(named)} include no 'default'; "
                                    "choose one with template=NAME")
        raise ChatTemplateError("the model has no chat template; pass one with template= (Jinja source)")

    # -- helpers ----------------------------------------------------------------

    def _check_id(self, token_id: object) -> int:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            value = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token ids must be integers, got {type(token_id).__name__} {token_id!r}") from None
        if not 0 <= value < self._vocab_size:
            raise TokenizerError(f"token id {value} is out of range [0, {self._vocab_size})")
        return value

    def _named_id(self, key: str, token: str | None) -> int | None:
        if token is None:
            return None
        if not isinstance(token, str):
            raise TokenizerError(f"{key} must be a str, got {type(token).__name__}")
        token_id = self._lookup.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{key} {token!r} is not in the tokenizer's vocabulary")
        return token_id


class StreamDecoder:
    """Incremental detokenization: text as soon as it is complete.

    ``"".join(push(i) for i in ids) + flush()`` equals ``decode(ids)``, and no
    piece ends in half a character. The prefix-offset/read-offset technique:
    decode a short window (the tokens of the last emitted piece, then the new
    ones) and emit what it adds to the decoded last piece, holding it back
    while it ends in U+FFFD (an unfinished UTF-8 sequence of byte tokens).
    Both decodes start at the same token, so a decoder that drops the first
    leading space (SentencePiece's ``▁``) drops it from both and the
    difference is exact. Emitted tokens leave the window: O(1) per token.
    Skipped special tokens never enter it: ``tokenizers`` drops them before
    its decoder runs, so leaving them out changes nothing.

    Two differences remain, both for byte-fallback tokens (``<0xE6>``) that a
    sampling model strings together: where they spell invalid UTF-8,
    ``decode`` turns the whole run of byte tokens into U+FFFD, characters the
    stream already showed included; and where they spell SentencePiece's own
    space marker ``▁`` (U+2581), the Metaspace decoder makes it a space or
    drops it depending on the tokens before it in what it decodes, which the
    window and the whole sequence need not share.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._decode = tokenizer._decode_ids  # (ids, skip_special_tokens) -> text
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the window: last emitted piece's tokens, then new ones
        self._read_offset = 0  # where the new tokens start in the window
        self._prefix_text = ""  # decode of the window's first _read_offset tokens

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (maybe "").

        Raises:
            TokenizerError: the id is not an integer in range.
        """
        token_id = self._tokenizer._check_id(token_id)
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        with tokenizer_errors("decoding generated tokens"):
            return self._emit(final=False)

    def flush(self) -> str:
        """Return what is held back (an unfinished character, as U+FFFD)."""
        with tokenizer_errors("decoding generated tokens"):
            return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self._decode(self._ids, self._skip_special_tokens)
        if len(text) <= len(self._prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        piece = text[len(self._prefix_text):]
        # The tokens just emitted become the prefix of the next window.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids, self._skip_special_tokens)
        return piece


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizerError(
            f"the text holds {text[exc.start]!r} at index {exc.start}, a lone surrogate, which no "
            "UTF-8 text contains (was it decoded with errors='surrogateescape'?)"
        ) from None


# -- reading a folder -------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: also the int digit limit
        raise TokenizerError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} must hold a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: object, where: str) -> str | None:
    """A special token given as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where} must be a string or a dict with a 'content' string, got {value!r}")


def _optional_bool(config: Mapping[str, Any], key: str, folder: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise TokenizerError(f"{folder / 'tokenizer_config.json'}: {key} must be true or false, got {value!r}")
    return value


def _add_missing_tokens(backend: tokenizers.Tokenizer, folder: Path, config: Mapping[str, Any],
                        names: Mapping[str, str | None]) -> None:
    """Add the tokens the config declares but tokenizer.json lacks, in
    transformers 5's order: ``added_tokens_decoder``, the named special
    tokens, model-specific ``*_token`` entries, the extra special tokens."""
    where = folder / "tokenizer_config.json"
    new: list[tokenizers.AddedToken] = []
    declared = config.get("added_tokens_decoder") or {}
    try:
        entries = sorted(declared.items(), key=lambda item: int(item[0]))
    except (AttributeError, ValueError) as exc:
        raise TokenizerError(f"{where}: added_tokens_decoder must map ids to tokens") from exc
    for key, entry in entries:
        content = _token_content(entry, f"{where}: added_tokens_decoder[{key}]")
        flags = ("lstrip", "rstrip", "single_word", "normalized", "special")
        options = {k: bool(entry[k]) for k in flags if isinstance(entry, Mapping) and k in entry}
        if content is not None:
            new.append(tokenizers.AddedToken(content, **options))
    specials: list[object] = list(names.values())
    specials += [v for k, v in config.items() if k.endswith("_token") and k not in names and isinstance(v, str)]
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):  # named: {"image_token": "<image>"}
        specials += extra.values()
        extra = None
    extra = extra or config.get("additional_special_tokens")  # the name before transformers 5
    specials += extra if isinstance(extra, list) else []
    for value in specials:
        content = _token_content(value, f"{where}: special token")
        if content is not None:
            new.append(tokenizers.AddedToken(content, special=True, normalized=False))
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token in new:
        if token.content not in present:
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
            present.add(token.content)
            logger.info("%s: added token %r, which tokenizer.json lacks", folder, token.content)


def _read_templates(folder: Path, config: Mapping[str, Any]) -> object:
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = _read_template(folder / "chat_template.jinja")
    if (folder / "chat_templates").is_dir():
        for file in sorted((folder / "chat_templates").glob("*.jinja")):
            templates[file.stem] = _read_template(file)
    if templates:  # files win over the config, as in transformers 5
        return templates
    value = config.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, ...]
        try:
            return {entry["name"]: entry["template"] for entry in value}
        except (KeyError, TypeError) as exc:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: chat_template entries need "
                                 "'name' and 'template'") from exc
    return value


def _read_template(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{file} is not UTF-8 text (byte {exc.start}); a chat template "
                                "must be saved as UTF-8") from exc
    except OSError as exc:
        raise ChatTemplateError(f"cannot read the chat template {file}: {exc}") from exc


def _check_templates(chat_template: object) -> dict[str, str] | None:
    if chat_template is None or isinstance(chat_template, str):
        return None if chat_template is None else {"default": chat_template}
    if isinstance(chat_template, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in chat_template.items()):
        return dict(chat_template)
    raise TokenizerError(f"chat_template must be a str, a dict of named str templates or None, "
                         f"got {type(chat_template).__name__}")
