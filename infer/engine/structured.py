"""Constrained decoding: only tokens a JSON schema, regex or grammar allows.

A :class:`Grammar` is a constraint compiled for one tokenizer; each request
gets its own :class:`Matcher` from it (:meth:`Grammar.matcher`), which a
:class:`~infer.engine.sampling.Sampler` asks, before every token, for the
mask of allowed tokens (disallowed logits become ``-inf`` before the sampling
rules run, greedy or sampled) and tells, after, which token was chosen. Since
every loop samples through a Sampler on the host, the constraint works on
every backend, in single requests and in the batch engine alike. The
end-of-sequence tokens are allowed exactly where the constraint is complete.

The matching is llguidance's (Microsoft's guidance project): an Earley parser
over the token trie that computes a mask in tens of microseconds. It was
chosen by measurement against xgrammar and outlines-core (docs/structured.md
has the figures and the command); it compiles JSON schemas, regexes and
Lark or GBNF grammars, and needs no other package.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from infer.errors import MissingDependencyError, StructuredOutputError
from infer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: How JSON is written unless the schema's own ``"x-guidance"`` says otherwise:
#: no free whitespace (which a sampling model could spend every token on), and
#: the separators of ``json.dumps``.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise MissingDependencyError(
            "constrained decoding (json_schema=, regex=, grammar=) needs llguidance: "
            "pip install 'infer-engine[structured]' (or pip install llguidance)") from exc
    return llguidance


class GrammarTokenizer:
    """A tokenizer as the matcher sees it (built once per model: it indexes
    every token's bytes, about a second for 262k tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        if not eos_token_ids:
            raise StructuredOutputError(
                "constrained decoding needs an end-of-sequence token to end the output where the constraint "
                "is complete, and this model has none (no eos_token_id in its generation config or tokenizer)")
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # The model's logits may be wider than the tokenizer's vocabulary (padding rows): never allowed.
        self.llg = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


class Grammar:
    """A constraint compiled for one :class:`GrammarTokenizer`; checked here,
    so a bad one fails before any token is generated."""

    def __init__(self, tokenizer: GrammarTokenizer, *, json_schema: dict[str, Any] | str | None = None,
                 regex: str | None = None, grammar: str | None = None) -> None:
        given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
                 if v is not None]
        if len(given) != 1:
            raise StructuredOutputError(f"give one of json_schema=, regex=, grammar=; got {given or 'none'}")
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.kind = given[0]
        try:
            if json_schema is not None:
                if isinstance(json_schema, str):
                    json_schema = json.loads(json_schema)
                if not isinstance(json_schema, (dict, bool)):
                    raise StructuredOutputError(
                        f"json_schema must be a JSON schema (a dict), got {type(json_schema).__name__}")
                source = llg.LLMatcher.grammar_from_json_schema(json.dumps(json_schema), defaults=JSON_DEFAULTS)
            elif regex is not None:
                if not isinstance(regex, str):
                    raise StructuredOutputError(f"regex must be a string, got {type(regex).__name__}")
                source = llg.LLMatcher.grammar_from_regex(regex)
            else:
                if not isinstance(grammar, str):
                    raise StructuredOutputError(f"grammar must be a string, got {type(grammar).__name__}")
                source = llg.grammar_from("grammar", grammar)  # Lark, or GBNF (llama.cpp's) converted to Lark
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise StructuredOutputError(f"invalid {self.kind}: {exc}") from exc
        error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, tokenizer.llg)
        if error:
            raise StructuredOutputError(f"invalid {self.kind}: {messages[0] if messages else 'rejected'}")
        for message in messages:
            log.warning("%s: %s", self.kind, message)
        self.source = source

    def matcher(self) -> Matcher:
        """A fresh matcher for one request."""
        return Matcher(self)


class Matcher:
    """One request's place in its :class:`Grammar`."""

    def __init__(self, grammar: Grammar) -> None:
        llg = _llguidance()
        self.grammar = grammar
        self._matcher = llg.LLMatcher(grammar.tokenizer.llg, grammar.source, log_level=0)
        self._check()
        vocab = grammar.tokenizer.vocab_size
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """``[vocab]`` bool: the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.grammar.tokenizer.vocab_size]
        return mask.astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (float64 ``[vocab]``) with every token the constraint forbids at ``-inf``."""
        allowed = self.allowed()
        if not allowed.any():
            raise StructuredOutputError(f"the {self.grammar.kind} allows no token here (a grammar that cannot "
                                        "end?); the output so far cannot be completed")
        return np.where(allowed[: logits.shape[-1]], logits, -np.inf)

    def advance(self, token: int) -> None:
        """``token`` was chosen."""
        if not self._matcher.consume_token(int(token)):
            self._check()
            raise StructuredOutputError(f"token {token} is not allowed by the {self.grammar.kind} here")

    @property
    def complete(self) -> bool:
        """Whether what was generated so far is a complete match."""
        return bool(self._matcher.is_accepting() or self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise StructuredOutputError(f"{self.grammar.kind}: {self._matcher.get_error()}")
