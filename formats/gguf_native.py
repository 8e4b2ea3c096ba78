"""What the GGUF vocabularies encoded in C share (:mod:`infer.formats.gguf_bpe`,
:mod:`infer.formats.gguf_spm`): a :class:`~infer.tokenizer.NativeBackend` over
a C ``Vocab`` object, whose spelling lookups and length are formats/bpe.h's,
with the special tokens, the ids put around a text and the deferred
``tokenizers`` build it stands for. Each subclass makes its ``Vocab`` and
encodes and decodes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers

from infer.tokenizer import NativeBackend

__all__ = ["VocabBackend"]


class VocabBackend(NativeBackend):
    """A :class:`~infer.tokenizer.NativeBackend` over a C ``Vocab``.

    Args:
        special: ids of the special tokens (skipped by
            ``decode(skip_special_tokens=True)``).
        bos_id, eos_id: added around a text by ``encode(add_special_tokens=True)``.
        build: makes the ``tokenizers.Tokenizer`` this stands for.
    """

    def __init__(self, special: Iterable[int], bos_id: int | None, eos_id: int | None,
                 build: Callable[[], tokenizers.Tokenizer]) -> None:
        self._special = frozenset(special)
        self._before = [bos_id] if bos_id is not None else []
        self._after = [eos_id] if eos_id is not None else []
        self._build = build
        self._vocab: Any = None  # the subclass's C Vocab

    def whole(self, added: Iterable[int]) -> np.ndarray:
        """The ids the C ``Vocab`` matches whole in text: the special tokens and ``added``."""
        return np.array(sorted(self._special | set(added)), np.int32)

    def around(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        """``ids`` with BOS and EOS around them when ``add_special_tokens``."""
        return self._before + ids + self._after if add_special_tokens else ids

    def kept(self, ids: Sequence[int], skip_special_tokens: bool) -> Sequence[int]:
        """``ids`` less the special tokens when ``skip_special_tokens``."""
        if skip_special_tokens and self._special:
            return [i for i in ids if i not in self._special]
        return ids

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._vocab.id_to_token(token_id)

    def tokenizers_backend(self) -> tokenizers.Tokenizer:
        return self._build()
