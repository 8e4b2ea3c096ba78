"""GGUF ``llama`` vocabularies encoded in C, merged by score.

A GGUF ``llama`` (SentencePiece BPE) vocabulary has no merges: the tokenizer
``tokenizers`` builds from it (:mod:`infer.formats.gguf_tokenizer`) needs
merges derived from the scores, about 400k pairs for Gemma 3's 262k tokens,
and building its BPE model from them takes most of a second of every load.
The C encoder (formats/sentencepiece.c, the optional extension
``infer.formats._sentencepiece``) merges the way llama.cpp does instead: a
pair of adjacent pieces merges when their concatenation is a token, found in
a hash map of the vocabulary built in milliseconds. It ranks the merges as
the derived ones are ranked and picks them as ``tokenizers`` does, so the ids
are the same; the tests compare the two id for id on every catalog model's
corpus and on generated text.

:class:`SentencePieceBackend` is used where it gives those ids by
construction: merges derived from scores (no ``tokenizer.ggml.merges``), all
256 ``<0xXX>`` byte tokens present (so no text is unknown), every spelling
distinct, finite scores, and the extension built. Elsewhere the
``tokenizers`` build stays the path. It builds the ``tokenizers.Tokenizer``
it stands for only when something asks for it
(:attr:`infer.tokenizer.Tokenizer.backend`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import tokenizers

from infer.formats.gguf_file import StringArray
from infer.formats.gguf_native import VocabBackend

log = logging.getLogger(__name__)

try:
    import infer.formats._sentencepiece as _sentencepiece
except ImportError:  # the extension did not compile: tokenizers serves every vocabulary
    _sentencepiece = None

__all__ = ["SentencePieceBackend", "available"]

#: The prefix modes of formats/sentencepiece.c.
METASPACE_NEVER, METASPACE_FIRST, NORMALIZE, NORMALIZE_PREFIX = 0, 1, 2, 3


def available() -> bool:
    """Whether the C encoder was built."""
    return _sentencepiece is not None


class SentencePieceBackend(VocabBackend):
    """A SentencePiece BPE vocabulary merged by score, in C.

    Args:
        tokens: the spellings, as the ``tokenizers`` build spells them
            (a file's :class:`~infer.formats.gguf_file.StringArray` or a list).
        respell: spellings replacing some of ``tokens`` (id -> spelling).
        group: uint32 [n], each token's rank by score (0 best, equal
            scores equal): the order its merges apply in.
        special: ids of the special tokens (matched whole, skipped by
            ``decode(skip_special_tokens=True)``); ``added``: the other
            tokens matched whole.
        mode: how spaces are spelled (the ``METASPACE_*``/``NORMALIZE*``
            constants); ``strip``: whether decoding drops one leading space.
        bos_id, eos_id: added around a text by ``encode(add_special_tokens=True)``.
        build: makes the ``tokenizers.Tokenizer`` this stands for.

    Raises:
        ValueError: the vocabulary is outside what the C encoder does (a
            spelling twice, a byte token missing...); use ``tokenizers``.
    """

    def __init__(self, tokens: Sequence[str], respell: dict[int, str], group: np.ndarray, special: Iterable[int],
                 added: Iterable[int], mode: int, strip: bool, bos_id: int | None, eos_id: int | None,
                 build: Callable[[], tokenizers.Tokenizer]) -> None:
        if _sentencepiece is None:
            raise ValueError("the C encoder (infer.formats._sentencepiece) is not built")
        super().__init__(special, bos_id, eos_id, build)
        whole = self.whole(added)
        group = np.ascontiguousarray(group, np.uint32)
        try:
            self._vocab = _sentencepiece.Vocab(*_spellings(tokens, respell), group, whole, mode)
        except UnicodeError:  # stored bytes that are not UTF-8: spelled as a StringArray decodes them
            self._vocab = _sentencepiece.Vocab(*_spellings(list(tokens), respell), group, whole, mode)
        self._strip = strip

    def encode_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.around(self._vocab.encode(text), add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._vocab.decode(self.kept(ids, skip_special_tokens), self._strip)


def score_groups(scores: np.ndarray) -> np.ndarray:
    """Each score's rank, best (highest) first, equal scores sharing one: the order
    in which ``_derive_merges`` applies the merges making each token.

    Raises:
        ValueError: a score is NaN (Python's sort leaves such an order undefined).
    """
    if np.isnan(scores).any():
        raise ValueError("a token score is NaN")
    _, group = np.unique(-scores.astype(np.float64), return_inverse=True)
    return group.astype(np.uint32)


def whitespace_respellings(tokens: Sequence[str]) -> dict[int, str]:
    """Gemma's multi-space tokens, stored with real spaces: ``▁`` once per character
    for each token holding a space and nothing but whitespace (transformers' rule)."""
    if isinstance(tokens, StringArray):
        data, ends = tokens.stored()
        spaces = np.flatnonzero(np.frombuffer(data, np.uint8) == 0x20)
        candidates = np.unique(np.searchsorted(np.asarray(ends), spaces, side="right")).tolist()
    else:
        candidates = [i for i, t in enumerate(tokens) if " " in t]
    return {i: "▁" * len(tokens[i]) for i in candidates if not tokens[i].strip()}


def _spellings(tokens: Sequence[str], respell: dict[int, str]) -> tuple[bytes, np.ndarray]:
    """The spellings as one UTF-8 buffer and the int64 offset where each ends."""
    if isinstance(tokens, StringArray):  # as stored; the C side checks that each is UTF-8
        data, ends = tokens.stored()
        ends = np.asarray(ends, np.int64)
        if not respell:
            return data, ends
        starts = np.concatenate(([0], ends[:-1]))
        pieces, lengths, done = [], np.diff(ends, prepend=0), 0
        for i in sorted(respell):
            new = respell[i].encode("utf-8")
            pieces += [data[done:starts[i]], new]
            lengths[i] = len(new)
            done = int(ends[i])
        pieces.append(data[done:])
        return b"".join(pieces), np.cumsum(lengths)
    encoded = [respell.get(i, t).encode("utf-8", "surrogatepass") for i, t in enumerate(tokens)]
    return b"".join(encoded), np.cumsum([len(e) for e in encoded], dtype=np.int64)

