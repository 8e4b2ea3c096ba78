"""GGUF ``gpt2`` (byte-level BPE) vocabularies encoded in C from the stored merges.

Building ``tokenizers``' BPE model from a GGUF's vocabulary and merges
(:mod:`infer.formats.gguf_tokenizer`) turns each of SmolLM2's 49k tokens and
48k merges into a Python string and then a Rust one: about 0.1 s of every
load, most of a small model's. The C encoder (formats/bytelevel.c, the
optional extension ``infer.formats._bytelevel``) reads the stored bytes into
two hash tables instead (spellings, and pairs of ids to their rank) in a few
milliseconds, and merges as ``tokenizers`` merges, so the ids are the same.

Text is split at the added tokens in C; each piece between them goes through
the ``tokenizers`` pre-tokenizer the build would use (a Python object made in
microseconds), so the regexes and their Unicode classes are ``tokenizers``'
own, and the words it gives through BPE in C. Decoding is the byte-level
decoder's. The tests compare the two builds id for id and text for text.

:class:`ByteLevelBackend` is used where its ids are the build's by
construction: every spelling UTF-8, non-empty and distinct once respelled in
the byte alphabet, every merge joining two tokens into a token, and the
extension built. Elsewhere the ``tokenizers`` build stays the path (and names
what is wrong with the file). It builds the ``tokenizers.Tokenizer`` it
stands for only when something asks for it
(:attr:`infer.tokenizer.Tokenizer.backend`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers

from infer.formats.gguf_file import StringArray
from infer.formats.gguf_native import VocabBackend

try:
    import infer.formats._bytelevel as _bytelevel
except ImportError:  # the extension did not compile: tokenizers serves every vocabulary
    _bytelevel = None

__all__ = ["ByteLevelBackend", "available"]


def available() -> bool:
    """Whether the C encoder was built."""
    return _bytelevel is not None


class ByteLevelBackend(VocabBackend):
    """A byte-level BPE vocabulary and its merges, in C.

    Args:
        tokens: the spellings as stored (a file's
            :class:`~infer.formats.gguf_file.StringArray` or a list).
        keep: bool [n], the tokens that keep their spelling when it leaves
            the byte alphabet (control and user-defined ones).
        merges: ``tokenizer.ggml.merges`` (a StringArray or a list).
        pre_tokenizer: the ``tokenizers`` pre-tokenizer the build uses; it
            must end in a ``ByteLevel`` step, so that the words it gives are
            spelled in the byte alphabet.
        ignore_merges: a word that is a token stays one (``llama3``...).
        special: ids of the special tokens (matched whole, skipped by
            ``decode(skip_special_tokens=True)``); ``added``: the other
            tokens matched whole.
        bos_id, eos_id: added around a text by ``encode(add_special_tokens=True)``.
        build: makes the ``tokenizers.Tokenizer`` this stands for.

    Raises:
        ValueError: the vocabulary is outside what the C encoder does (an
            empty spelling, two alike, a merge of no tokens...); use ``tokenizers``.
    """

    def __init__(self, tokens: Sequence[str], keep: np.ndarray, merges: Sequence[str], pre_tokenizer: Any,
                 ignore_merges: bool, special: Iterable[int], added: Iterable[int], bos_id: int | None,
                 eos_id: int | None, build: Callable[[], tokenizers.Tokenizer]) -> None:
        if _bytelevel is None:
            raise ValueError("the C encoder (infer.formats._bytelevel) is not built")
        super().__init__(special, bos_id, eos_id, build)
        self._vocab = _bytelevel.Vocab(*_stored(tokens), np.ascontiguousarray(keep, np.uint8), *_stored(merges),
                                       self.whole(added), ignore_merges)
        self._pre_tokenize = pre_tokenizer.pre_tokenize_str

    def encode_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for piece in self._vocab.split(text):
            if isinstance(piece, int):  # an added token
                ids.append(piece)
            else:
                ids += self._vocab.encode_words([word for word, _ in self._pre_tokenize(piece)])
        return self.around(ids, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._vocab.decode(self.kept(ids, skip_special_tokens))


def _stored(strings: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """The strings as one UTF-8 buffer and the int64 offset where each ends."""
    if isinstance(strings, StringArray):  # as stored; the C side checks that each is UTF-8
        data, ends = strings.stored()
        return data, np.asarray(ends, np.int64)
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    return b"".join(encoded), np.cumsum([len(e) for e in encoded], dtype=np.int64)
