"""The tokenizer a GGUF file describes, rebuilt with plain ``tokenizers``.

A GGUF has no ``tokenizer.json``: llama.cpp's converter stores the vocabulary
as metadata (``tokenizer.ggml.*``). :func:`tokenizer_from_gguf` turns that
metadata back into a ``tokenizers.Tokenizer`` and wraps it in
:class:`infer.tokenizer.Tokenizer`. What it builds is what transformers builds
from the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, its
``integrations/gguf/gguf_tokenizer_mapping.py``), the reference the tests
compare against id for id, except where llama.cpp, which wrote the metadata,
says otherwise (listed under "Differences" below).

``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE from ``tokens`` + ``merges``. Text is split before
  BPE by the regexes llama.cpp uses for ``tokenizer.ggml.pre``
  (``llama-vocab.cpp``, ``llm_tokenizer_bpe``); an unknown name falls back to
  GPT-2's regex with a warning.
- ``llama``: SentencePiece-style BPE with byte fallback (``<0xXX>`` tokens) and
  ``▁`` for spaces. SentencePiece merges the adjacent pair whose result scores
  best; a GGUF stores no merges, so they are derived from the vocabulary:
  every split of a token into two tokens, ranked by the token's score
  (``tokenizer.ggml.scores``). Gemma files rank by position in the file
  instead (their scores do not follow the merge order) and store multi-space
  tokens with real spaces, respelled ``▁▁`` here, both as transformers does.

Either way the tokens marked control (``token_type`` 3) become special added
tokens and the user-defined ones (4) plain added tokens, so text never splits
them; BOS/EOS are added by the post-processor per ``add_bos_token`` /
``add_eos_token``; ``eot_token_id`` and ``eom_token_id`` end generation too.

A ``gpt2`` vocabulary is encoded by the C encoder of
:mod:`infer.formats.gguf_bpe` (the stored merges read into a hash table, the
text pre-tokenized by the ``tokenizers`` pre-tokenizer below), and a ``llama``
vocabulary whose merges come from its scores by that of
:mod:`infer.formats.gguf_spm` (no merge table at all), where they apply: same
ids, same text. The ``tokenizers`` build below is then made only when
``Tokenizer.backend`` is asked for.

The tokenizer is built from the metadata on every load, straight into
``tokenizers``' model objects (a vocabulary dict and a list of merge pairs):
for Gemma 3's 262k tokens that takes about half the time that parsing the
same tokenizer as ``tokenizer.json`` does. Only merges derived from scores
(seconds of Python for 262k tokens) are cached, as token id pairs in a
``.npy`` file named by a hash of the metadata they came from (see
:func:`default_cache_dir`).

Differences from transformers (each only where the file asks for it):

- ``pre`` ``smollm``/``starcoder``/``refact``/``command-r``/...: numerals are
  split off one by one first (llama.cpp's ``\\p{N}`` rule, and the models' own
  ``tokenizer.json``: ``Digits(individual_digits=True)``); transformers applies
  plain GPT-2 splitting. The ids differ where whitespace precedes a digit
  (``"\\n\\t8"``: ``Ċĉ`` + ``8`` here, ``Ċ`` + ``ĉ`` + ``8`` there) or a
  non-ASCII numeral follows a space (``" ½"``).
- ``pre`` ``llama3``/``tekken``: BPE ``ignore_merges`` (a whole word in the
  vocabulary is one token), as llama.cpp and the models' ``tokenizer.json`` do.
- ``llama`` with ``add_space_prefix`` false and a non-Gemma architecture: no
  ``▁`` is prepended (llama.cpp); transformers ignores the flag. Where a
  prefix is added, it is transformers' ``Metaspace`` one, which adds no ``▁``
  to a text that starts with a space and none after a special token;
  llama.cpp and SentencePiece add it there too.
- ``gpt2`` control/user-defined tokens spelled outside the byte alphabet keep
  their spelling and are matched whole; transformers respells and drops them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from infer.errors import TokenizerError
from infer.formats import gguf_bpe, gguf_spm
from infer.formats.gguf_bpe import ByteLevelBackend
from infer.formats.gguf_file import StringArray
from infer.formats.gguf_spm import SentencePieceBackend
from infer.paths import cache_dir
from infer.tokenizer import NativeBackend, Tokenizer, tokenizer_errors

log = logging.getLogger(__name__)

__all__ = ["default_cache_dir", "tokenizer_from_gguf"]

#: Bump when the builders change what they produce: cached files are keyed by it.
BUILD_VERSION = "2"

#: llama.cpp's token types (``gguf.TokenType``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

# -- pre-tokenizer regexes (llama-vocab.cpp, spelled as in the models' tokenizer.json) --

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r"\p{N}"  # each digit alone, then GPT-2 splitting


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]  # applied in turn, each splitting the previous pieces ("isolated")
    ignore_merges: bool = False  # a word that is a whole token stays one token
    add_bos: bool = False  # llama.cpp's default where the file has no add_bos_token


_PRE_TOKENIZERS: dict[str, _Pre] = {}
for _names, _pre in [
    (("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
      "a.x-4.0", "gigachat", "mellum", "modern-bert", "roberta-bpe", "jina-es", "jina-de", "jina-v1-en",
      "jina-v2-es", "jina-v2-de", "jina-v2-code"), _Pre((_GPT2,))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), _Pre((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     _Pre((_QWEN2,))),
    (("qwen35",), _Pre((_QWEN35,))),
    (("tekken",), _Pre((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _Pre((_GPT4O,))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm"), _Pre(_DEEPSEEK3)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     _Pre((_DIGITS, _GPT2))),
]:
    _PRE_TOKENIZERS.update(dict.fromkeys(_names, _pre))

#: Architectures whose SentencePiece vocabulary transformers builds its own way.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3n")
_PHI3_ARCHITECTURES = ("phi3",)


# -- public entry point ----------------------------------------------------------


def default_cache_dir() -> Path:
    """Where derived merges are cached: ``tokenizers/`` in infer's cache
    (:func:`infer.paths.cache_dir`)."""
    return cache_dir() / "tokenizers"


def tokenizer_from_gguf(metadata: Mapping[str, Any], *, cache_dir: Path | None = None, source: str = "") -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata.

    Args:
        metadata: the file's key/value pairs, keys as stored
            (``tokenizer.ggml.tokens``...); string arrays as lists of str,
            numeric arrays as lists or numpy arrays.
        cache_dir: folder for merges derived from scores (``.merges.npy``
            files, named by the SHA-256 of the metadata they came from); default
            :func:`default_cache_dir`. An unwritable folder only costs deriving
            them again.
        source: the file name, for messages.

    Raises:
        TokenizerError: a key is missing, of the wrong type or inconsistent
            with another (the message names it), or the model type is not
            one of ``gpt2``, ``llama``.
    """
    vocab = _Vocab.read(metadata, source or "GGUF metadata")
    folder = default_cache_dir() if cache_dir is None else Path(cache_dir)
    with tokenizer_errors(f"{vocab.where}: building the tokenizer"):
        backend = vocab.native(folder) or vocab.build(folder)
    return Tokenizer(
        backend,
        bos_token=vocab.token_name(backend, vocab.bos_id, "tokenizer.ggml.bos_token_id"),
        eos_token=vocab.token_name(backend, vocab.eos_id, "tokenizer.ggml.eos_token_id"),
        pad_token=vocab.token_name(backend, vocab.pad_id, "tokenizer.ggml.padding_token_id"),
        add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos,
        chat_template=_chat_templates(metadata, vocab.where),
        extra_eos_tokens=[vocab.token_name(backend, i, key) for i, key in vocab.extra_eos],
    )


# -- reading and checking the metadata ---------------------------------------------------


@dataclass
class _Vocab:
    where: str
    model: str
    pre: str | None
    architecture: str | None
    tokens: Sequence[str]  # a file's StringArray, or a list
    scores: np.ndarray | None  # float32 [n], or None
    types: np.ndarray  # int32 [n]; NORMAL where the file has none
    merges: Sequence[str] | None
    add_space_prefix: bool | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    extra_eos: list[tuple[int, str]]  # (id, the key it came from): eot, eom
    add_bos: bool
    add_eos: bool

    @classmethod
    def read(cls, metadata: Mapping[str, Any], where: str) -> _Vocab:
        if not isinstance(metadata, Mapping):
            raise TokenizerError(f"{where}: metadata must be a mapping, got {type(metadata).__name__}")
        model = _get_str(metadata, "tokenizer.ggml.model", where, required=True)
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"{where}: tokenizer.ggml.model is {model!r}; infer builds tokenizers for "
                                 f"{', '.join(SUPPORTED_MODELS)}")
        tokens = _get_strings(metadata, "tokenizer.ggml.tokens", where, required=True)
        if not tokens:
            raise TokenizerError(f"{where}: tokenizer.ggml.tokens is empty")
        n = len(tokens)
        scores = _get_array(metadata, "tokenizer.ggml.scores", np.float32, n, where)
        types = _get_array(metadata, "tokenizer.ggml.token_type", np.int32, n, where)
        merges = _get_strings(metadata, "tokenizer.ggml.merges", where)
        if model == "gpt2" and merges is None:
            raise TokenizerError(f"{where}: tokenizer.ggml.merges is missing; a gpt2 (byte-level BPE) "
                                 "tokenizer needs its merges")
        architecture = _get_str(metadata, "general.architecture", where)
        if model == "llama" and merges is None and scores is None and architecture not in _GEMMA_ARCHITECTURES:
            raise TokenizerError(f"{where}: tokenizer.ggml.scores is missing; a llama (SentencePiece) "
                                 "tokenizer without merges needs the token scores to derive them")
        pre = _get_str(metadata, "tokenizer.ggml.pre", where)
        if model == "gpt2" and pre not in _PRE_TOKENIZERS:
            found = "is missing" if pre is None else f"is {pre!r}, which infer does not know"
            log.warning("%s: tokenizer.ggml.pre %s; splitting text with GPT-2's regex, so some token ids "
                        "may differ from llama.cpp's (known: %s)", where, found, ", ".join(sorted(_PRE_TOKENIZERS)))

        ids = {name: _get_id(metadata, f"tokenizer.ggml.{name}_token_id", n, where)
               for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
        # Without the flag llama.cpp adds BOS for SentencePiece vocabularies and for the
        # llama3/tekken pre-tokenizers; transformers for SentencePiece only.
        add_bos = _get_bool(metadata, "tokenizer.ggml.add_bos_token", where)
        if add_bos is None:
            add_bos = model == "llama" or (model == "gpt2" and _PRE_TOKENIZERS.get(pre or "", _Pre(())).add_bos)
        add_eos = bool(_get_bool(metadata, "tokenizer.ggml.add_eos_token", where))
        for flag, value, key in ((add_bos, ids["bos"], "bos"), (add_eos, ids["eos"], "eos")):
            if flag and value is None:
                raise TokenizerError(f"{where}: tokenizer.ggml.add_{key}_token is true but "
                                     f"tokenizer.ggml.{key}_token_id is missing")
        extra = [(ids[k], f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")
                 if ids[k] is not None and ids[k] != ids["eos"]]
        return cls(
            where=where, model=model, pre=pre, architecture=architecture, tokens=tokens, scores=scores,
            types=types if types is not None else np.full(n, NORMAL, np.int32), merges=merges,
            add_space_prefix=_get_bool(metadata, "tokenizer.ggml.add_space_prefix", where),
            bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"], pad_id=ids["padding"],
            extra_eos=extra, add_bos=add_bos, add_eos=add_eos,
        )

    def fingerprint(self) -> str:
        """SHA-256 of everything the built tokenizer depends on, naming the
        cached merges. A file's string arrays are hashed as their stored bytes."""
        digest = hashlib.sha256()
        header = [BUILD_VERSION, self.model, self.pre, self.architecture, self.add_space_prefix, self.bos_id,
                  self.eos_id, self.unk_id, self.pad_id, self.add_bos, self.add_eos, len(self.tokens)]
        digest.update(json.dumps(header).encode())
        for strings in (self.tokens, self.merges):
            if isinstance(strings, StringArray):
                data, ends = strings.stored()
                digest.update(b"stored" + np.asarray(ends, "<u8").tobytes() + data)
            else:
                digest.update(json.dumps(strings, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        digest.update(b"scores" + (b"" if self.scores is None else self.scores.astype("<f4").tobytes()))
        digest.update(b"types" + self.types.astype("<i4").tobytes())
        return digest.hexdigest()

    def token_name(self, backend: tokenizers.Tokenizer, token_id: int | None, key: str) -> str | None:
        """The backend's spelling of a token id from the metadata key `key`."""
        if token_id is None:
            return None
        name = backend.id_to_token(token_id)
        if name is None or backend.token_to_id(name) != token_id:  # two spellings became one
            raise TokenizerError(f"{self.where}: {key} = {token_id} names token {self.tokens[token_id]!r}, "
                                 "which another token of tokenizer.ggml.tokens shadows")
        return name

    # -- building --------------------------------------------------------------

    def native(self, cache: Path) -> NativeBackend | None:
        """The C encoder for a byte-level BPE vocabulary (:mod:`infer.formats.gguf_bpe`)
        or a SentencePiece one whose merges come from the scores
        (:mod:`infer.formats.gguf_spm`), or None where it does not apply."""
        if self.model == "gpt2":
            return self._native_byte_level(cache)
        if self.model != "llama" or self.merges is not None or not gguf_spm.available():
            return None
        gemma = self.architecture in _GEMMA_ARCHITECTURES
        try:
            respell = gguf_spm.whitespace_respellings(self.tokens) if gemma else {}
            # Gemma ranks by position (see _derived_merges); others by score.
            group = np.arange(len(self.tokens), dtype=np.uint32) if gemma else gguf_spm.score_groups(self.scores)
            # A respelled token's stored spelling is no spelling of the vocabulary: not added.
            lengths = _lengths(self.tokens)
            special, user = self._added_ids(lambda i: i not in respell and lengths[i] > 0)
            if gemma or self.architecture in _PHI3_ARCHITECTURES:
                prefix = bool(self.add_space_prefix) if gemma else self.add_space_prefix is not False
                mode = gguf_spm.NORMALIZE_PREFIX if prefix else gguf_spm.NORMALIZE
            else:
                prefix = self.add_space_prefix is not False
                mode = gguf_spm.METASPACE_FIRST if prefix else gguf_spm.METASPACE_NEVER
            spelled = lambda i: None if i is None else respell.get(i) or self.tokens[i]  # noqa: E731
            bos, eos = self._template_ends(spelled)
            return SentencePieceBackend(
                self.tokens, respell, group, special, user, mode, strip=prefix,
                bos_id=self.bos_id if bos else None, eos_id=self.eos_id if eos else None,
                build=lambda: self.build(cache))
        except ValueError as exc:  # outside what the C encoder does: tokenizers builds it
            log.debug("%s: the SentencePiece vocabulary is built with tokenizers (%s)", self.where, exc)
            return None

    def _native_byte_level(self, cache: Path) -> ByteLevelBackend | None:
        """The C encoder standing for :meth:`_byte_level_bpe`'s build, or None where it does not apply."""
        if not gguf_bpe.available() or self.merges is None:
            return None
        keep = (self.types == CONTROL) | (self.types == USER_DEFINED)

        def spelled(i: int | None) -> str | None:  # as the build's vocabulary spells token i
            if i is None:
                return None
            token = self.tokens[i]
            return token if keep[i] or _ALPHABET.issuperset(token) else _respelled(token)

        lengths = _lengths(self.tokens)
        # A token respelled in the byte alphabet is not added (its stored spelling is no token).
        special, user = self._added_ids(lambda i: lengths[i] > 0 and spelled(i) == self.tokens[i])
        pre = _PRE_TOKENIZERS.get(self.pre or "", _PRE_TOKENIZERS["gpt-2"])
        bos, eos = self._template_ends(spelled)
        try:
            return ByteLevelBackend(
                self.tokens, keep, self.merges, _byte_level_pre_tokenizer(pre), pre.ignore_merges, special, user,
                bos_id=self.bos_id if bos else None, eos_id=self.eos_id if eos else None,
                build=lambda: self.build(cache))
        except ValueError as exc:  # outside what the C encoder does: tokenizers builds it (and names the fault)
            log.debug("%s: the byte-level vocabulary is built with tokenizers (%s)", self.where, exc)
            return None

    def _template_ends(self, spelling: Callable[[int | None], str | None]) -> tuple[bool, bool]:
        """Whether the post-processor adds BOS, and EOS (:meth:`_post_processor`'s rule)."""
        return (self.add_bos and _spellable(spelling(self.bos_id)) is not None,
                self.add_eos and _spellable(spelling(self.eos_id)) is not None)

    def _added_ids(self, kept: Callable[[int], bool]) -> tuple[list[int], list[int]]:
        """Ids of the special tokens (control and named) and of the other added ones
        (user-defined) among those ``kept``: what :meth:`_add_special_tokens` adds, by id."""
        control = np.flatnonzero(self.types == CONTROL).tolist()
        named = [i for i in (self.bos_id, self.eos_id, self.unk_id, self.pad_id) if i is not None]
        special = [i for i in dict.fromkeys(control + named) if kept(i)]
        taken = set(special)
        user = [i for i in np.flatnonzero(self.types == USER_DEFINED).tolist() if i not in taken and kept(i)]
        return special, user

    def check_unique(self, tokens: list[str]) -> None:
        """llama.cpp refuses a vocabulary listing a token twice (a token must name one id); so does infer."""
        if len(set(tokens)) != len(tokens):
            first: dict[str, int] = {}
            for index, token in enumerate(tokens):
                if first.setdefault(token, index) != index:
                    raise TokenizerError(f"{self.where}: tokenizer.ggml.tokens lists {token!r} twice "
                                         f"(ids {first[token]} and {index})")

    def build(self, cache: Path) -> tokenizers.Tokenizer:
        """The tokenizer; merges derived from scores are read from (or written to) the folder ``cache``."""
        tokens = self.tokens.tolist() if isinstance(self.tokens, StringArray) else list(self.tokens)
        self.check_unique(tokens)
        try:
            if self.model == "gpt2":
                backend, vocab = self._byte_level_bpe(tokens)
            else:
                backend, vocab = self._sentencepiece_bpe(tokens, cache)
            self._add_special_tokens(backend, vocab, tokens)
        except TokenizerError:
            raise
        except BaseException as exc:  # the Rust side raises plain Exception, or panics
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise  # KeyboardInterrupt and the like
            keys = "tokenizer.ggml.tokens/merges" if self.merges is not None else "tokenizer.ggml.tokens/scores"
            raise TokenizerError(f"{self.where}: cannot build a {self.model} tokenizer from {keys}: {exc}") from exc
        backend.post_processor = self._post_processor(backend)
        return backend

    def _byte_level_bpe(self, tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
        vocab = self._byte_level_vocab(tokens)
        pre = _PRE_TOKENIZERS.get(self.pre or "", _PRE_TOKENIZERS["gpt-2"])
        backend = tokenizers.Tokenizer(_bpe_with_file_merges(
            vocab, _as_list(self.merges or []), self.where, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False, ignore_merges=pre.ignore_merges))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        return backend, vocab

    def _byte_level_vocab(self, tokens: list[str]) -> dict[str, int]:
        """Spelling -> id, a plain token spelled in UTF-8 rather than the byte alphabet
        respelled in it (transformers respells it too); the spellings are unique (check_unique)."""
        # The few tokens outside the alphabet are found in one regex pass over all of them.
        ends = np.cumsum(np.fromiter(map(len, tokens), np.int64, len(tokens)))
        outside = np.unique(np.searchsorted(ends, [m.start() for m in _outside_byte_alphabet().finditer(
            "".join(tokens))], side="right")).tolist()
        types = self.types
        respelled = {i: _respelled(tokens[i]) for i in outside if types[i] not in (CONTROL, USER_DEFINED)}
        vocab = dict(zip(tokens, range(len(tokens))))
        for i in respelled:
            del vocab[tokens[i]]
        if any(spelling in vocab for spelling in respelled.values()) or len(set(respelled.values())) < len(respelled):
            # A respelling meets another token: the later id keeps the spelling, as a dict built in order does.
            vocab = {}
            for index, token in enumerate(tokens):
                vocab[respelled.get(index, token)] = index
            return vocab
        vocab.update((spelling, i) for i, spelling in respelled.items())
        return vocab

    def _sentencepiece_bpe(self, tokens: list[str], cache: Path) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
        gemma = self.architecture in _GEMMA_ARCHITECTURES
        if gemma:
            # Gemma files store the multi-space tokens with real spaces; the text they match has ▁.
            tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = dict(zip(tokens, range(len(tokens))))
        unk = tokens[self.unk_id] if self.unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
        options = dict(dropout=None, unk_token=unk, fuse_unk=True, byte_fallback=True)
        if self.merges is not None:
            model = _bpe_with_file_merges(vocab, _as_list(self.merges), self.where, **options)
        else:
            merges = self._derived_merges(tokens, vocab, gemma, cache / f"{self.fingerprint()}.merges.npy")
            model = models.BPE(vocab=vocab, merges=merges, **options)
        backend = tokenizers.Tokenizer(model)
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gemma:
            # transformers' GemmaTokenizer: spaces become ▁ in the normalizer, and no prefix.
            prefix = bool(self.add_space_prefix)
            backend.normalizer = _space_normalizer(prefix)
            backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        else:
            prefix = self.add_space_prefix is not False  # llama.cpp's default for SentencePiece
            if self.architecture in _PHI3_ARCHITECTURES:
                # transformers: "  hi" must give ▁▁▁hi, which Metaspace does not.
                backend.normalizer = _space_normalizer(prefix)
            else:
                backend.pre_tokenizer = pre_tokenizers.Metaspace(
                    replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            decode.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(decode)
        return backend, vocab

    def _derived_merges(self, tokens: list[str], vocab: dict[str, int], gemma: bool,
                        cached: Path) -> list[tuple[str, str]]:
        """SentencePiece merges from the scores (Gemma: from the file order, as its
        scores do not follow its merge order), read from ``cached`` when it holds them."""
        pairs = _load_pairs(cached, len(tokens))
        if pairs is None:
            if gemma:
                merges = _derive_merges(vocab, {token: -index for index, token in enumerate(tokens)})
            else:
                merges = _derive_merges(vocab, dict(zip(tokens, self.scores.tolist())))
            _store_pairs(cached, np.array([(vocab[a], vocab[b]) for a, b in merges], np.int32).reshape(-1, 2))
            return merges
        get = tokens.__getitem__
        return list(zip(map(get, pairs[:, 0].tolist()), map(get, pairs[:, 1].tolist())))

    def _add_special_tokens(self, backend: tokenizers.Tokenizer, vocab: dict[str, int], tokens: list[str]) -> None:
        """Control tokens as special added tokens, user-defined ones as plain added tokens,
        so that text never splits them; the named special tokens are special too."""
        def of_type(kind: int) -> list[str]:  # in id order; indices first, as 10^5 tokens are mostly NORMAL
            return [tokens[i] for i in np.flatnonzero(self.types == kind).tolist()]

        control = [t for t in of_type(CONTROL) if t and t in vocab]
        named = [tokens[i] for i in (self.bos_id, self.eos_id, self.unk_id, self.pad_id) if i is not None]
        special = list(dict.fromkeys(control + [t for t in named if t and t in vocab]))
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        taken = set(special)
        user = [t for t in of_type(USER_DEFINED) if t and t in vocab and t not in taken]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def _post_processor(self, backend: tokenizers.Tokenizer) -> processors.TemplateProcessing:
        """BOS/EOS around a text, written the way transformers writes them.

        A token the template syntax cannot spell (``$...``, a ``:`` or a space in
        it) is left out; :class:`~infer.tokenizer.Tokenizer` then adds it itself.
        """
        bos = _spellable(backend.id_to_token(self.bos_id)) if self.add_bos else None
        eos = _spellable(backend.id_to_token(self.eos_id)) if self.add_eos else None
        single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
        pair = " ".join([single] + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
        specials = ([(bos, self.bos_id)] if bos else []) + ([(eos, self.eos_id)] if eos else [])
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_level_pre_tokenizer(pre: _Pre) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level vocabulary: ``pre``'s splits, then the text
    spelled in the byte alphabet."""
    if pre.regexes == (_GPT2,):  # what transformers builds for GPT-2 (the same split)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre.regexes == (_DIGITS, _GPT2):  # as in SmolLM2's and StarCoder's own tokenizer.json
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _respelled(token: str) -> str:
    """A token's UTF-8 bytes spelled in GPT-2's byte alphabet."""
    return "".join(_BYTE_TO_UNICODE[b] for b in token.encode("utf-8", "surrogatepass"))


def _spellable(token: str | None) -> str | None:
    """``token`` where the post-processor's template syntax can spell it, else None."""
    ok = token and not token.startswith("$") and ":" not in token and not any(c.isspace() for c in token)
    return token if ok else None


def _space_normalizer(prefix: bool) -> normalizers.Normalizer:
    """Spaces to ``▁``, with one ``▁`` prepended when ``prefix``."""
    replace = normalizers.Replace(" ", "▁")
    return normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace


def _derive_merges(vocab: dict[str, int], ranking: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges recovered from a vocabulary.

    Every way of cutting a token into two tokens is a merge; the better the
    token ranks (higher score), the earlier its merges apply. Ties: the longer
    left piece first, then the longer right piece (transformers'
    ``generate_merges``, kept exactly so that ids match it).
    """
    candidates: list[tuple[float, int, int, int, str, str]] = []
    for token, score in ranking.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                local.append((left_id, right_id, left, right))
        local.sort(key=lambda item: (item[0], item[1]))
        for _, _, left, right in local:
            candidates.append((-score, -len(left), -len(right), len(candidates), left, right))
    # Best first; the position keeps ties in order, as a stable sorted(..., reverse=True) does.
    candidates.sort()
    return [(c[4], c[5]) for c in candidates]


def _bpe_with_file_merges(vocab: dict[str, int], merges: list[str], where: str, **options: Any) -> models.BPE:
    """The BPE model of ``tokenizer.ggml.merges``: split as llama.cpp splits them and left
    to ``tokenizers`` to check (in Rust, a third of the time checking them here takes);
    where it refuses them, :func:`_file_merges` names the bad merge."""
    # Split at the first space: llama.cpp's rule (the first space after the first character)
    # wherever no merge starts with a space, which would split to ("", ...) here: refused
    # below unless "" is a token. A merge without a space gives a 1-tuple: refused too.
    if "" not in vocab:
        try:
            return models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], **options)
        except BaseException as exc:  # the Rust side raises plain Exception, or panics
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise  # KeyboardInterrupt and the like
    return models.BPE(vocab=vocab, merges=_file_merges(merges, vocab, where), **options)


def _file_merges(merges: list[str], vocab: Mapping[str, int], where: str) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, each of tokens whose join is a token too.

    Checked here because ``tokenizers`` reports a bad merge with a panic at best.
    """
    pairs = []
    for index, merge in enumerate(merges):
        cut = merge.find(" ", 1)  # llama.cpp's rule: the first space after the first character
        if cut < 0:
            raise TokenizerError(f"{where}: tokenizer.ggml.merges[{index}] is {merge!r}, expected 'left right'")
        left, right = merge[:cut], merge[cut + 1:]
        if left not in vocab or right not in vocab or left + right not in vocab:
            missing = next(t for t in (left, right, left + right) if t not in vocab)
            raise TokenizerError(f"{where}: tokenizer.ggml.merges[{index}] is {merge!r}, but {missing!r} "
                                 "is not in tokenizer.ggml.tokens")
        pairs.append((left, right))
    return pairs


def _lengths(strings: Sequence[str]) -> np.ndarray:
    """Each string's length in bytes as stored (a StringArray) or characters: zero for the empty ones."""
    if isinstance(strings, StringArray):
        return np.diff(np.asarray(strings.stored()[1], np.int64), prepend=0)
    return np.fromiter(map(len, strings), np.int64, len(strings))


def _as_list(strings: Sequence[str]) -> list[str]:
    return strings.tolist() if isinstance(strings, StringArray) else list(strings)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map past U+00FF."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_UNICODE = _bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_TO_UNICODE.values())


@functools.cache
def _outside_byte_alphabet() -> re.Pattern[str]:
    """Any character outside GPT-2's byte alphabet (compiled when first needed: the C encoder
    does without, and the compile is half a millisecond of a load)."""
    return re.compile("[^" + "".join(map(re.escape, sorted(_BYTE_TO_UNICODE.values()))) + "]")


# -- metadata accessors --------------------------------------------------------------


def _get_str(metadata: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = metadata.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"{where}: {key} is missing; it is needed to build the tokenizer")
        return None
    if not isinstance(value, str):
        raise TokenizerError(f"{where}: {key} must be a string, got {type(value).__name__}")
    return value


def _get_strings(metadata: Mapping[str, Any], key: str, where: str, required: bool = False) -> Sequence[str] | None:
    value = metadata.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"{where}: {key} is missing; it is needed to build the tokenizer")
        return None
    if isinstance(value, StringArray):
        return value  # strings by construction, decoded when read
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TokenizerError(f"{where}: {key} must be an array of strings, got {type(value).__name__}")
    strings = list(value)
    bad = next((i for i, s in enumerate(strings) if not isinstance(s, str)), None)
    if bad is not None:
        raise TokenizerError(f"{where}: {key}[{bad}] must be a string, got {type(strings[bad]).__name__}")
    return strings


def _get_array(metadata: Mapping[str, Any], key: str, dtype: type, length: int, where: str) -> np.ndarray | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise TokenizerError(f"{where}: {key} must be a numeric array, got a string")
    try:
        array = np.asarray(value)
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.number) or array.size == 0):
            raise ValueError
        with np.errstate(over="ignore", invalid="ignore"):  # a score past float32's range becomes inf
            array = array.astype(dtype)
    except (TypeError, ValueError):
        raise TokenizerError(f"{where}: {key} must be a 1-D numeric array, got {type(value).__name__}") from None
    if len(array) != length:
        raise TokenizerError(f"{where}: {key} has {len(array)} entries but tokenizer.ggml.tokens has {length}")
    return array


def _get_id(metadata: Mapping[str, Any], key: str, n_tokens: int, where: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        token_id = operator.index(value)
    except TypeError:
        raise TokenizerError(f"{where}: {key} must be an integer token id, got {value!r}") from None
    if not 0 <= token_id < n_tokens:
        # llama.cpp warns and ignores such an id; so does infer.
        log.warning("%s: %s = %d is outside the vocabulary of %d tokens; ignored", where, key, token_id, n_tokens)
        return None
    return token_id


def _get_bool(metadata: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TokenizerError(f"{where}: {key} must be true or false, got {value!r}")


def _chat_templates(metadata: Mapping[str, Any], where: str) -> str | dict[str, str] | None:
    """``tokenizer.chat_template``, plus the named ones (``tokenizer.chat_template.tool_use``)."""
    default = _get_str(metadata, "tokenizer.chat_template", where)
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix):]: _get_str(metadata, key, where) for key in metadata
             if isinstance(key, str) and key.startswith(prefix)}
    if not named:
        return default
    return ({"default": default} if default is not None else {}) | named


# -- the cache ------------------------------------------------------------------------


def _load_pairs(path: Path, n_tokens: int) -> np.ndarray | None:
    """Cached merges as ``[m, 2]`` token ids, or None where there are none or they are unreadable."""
    if not path.is_file():
        return None
    try:
        pairs = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        log.warning("cached merges %s are unreadable (%s); deriving them again", path, exc)
        return None
    if pairs.dtype != np.int32 or pairs.ndim != 2 or pairs.shape[1] != 2 or (
            pairs.size and not (pairs.min() >= 0 and pairs.max() < n_tokens)):
        log.warning("cached merges %s are not token id pairs below %d; deriving them again", path, n_tokens)
        return None
    return pairs


def _store_pairs(path: Path, pairs: np.ndarray) -> None:
    """Write the ``.npy`` to a temporary sibling, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the merges in %s (%s); they will be derived again next time", path, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
