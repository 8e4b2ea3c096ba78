"""A reasoning model's thinking, told apart from its answer.

Reasoning models write their thinking before the answer, in a format of
their own: DeepSeek-R1, Qwen3 and SmolLM3 between ``<think>`` and
``</think>`` (the template often writes the ``<think>`` into the prompt, so
the output starts inside it); gpt-oss in the *analysis* channel of OpenAI's
harmony format, the answer in the *final* one; Granite 3.2 after "Here is my
thought process:" and before "Here is my response:". A
:class:`ReasoningParser` splits an output into ``reasoning`` and
``content``, as a whole (:meth:`ReasoningParser.parse` with ``final=True``)
or as it streams (:class:`ReasoningStream`, which only ever sends text that
no later token can move to the other side).

Parsers are registered by name (:func:`register_reasoning_parser`);
:func:`reasoning_parser_for` chooses one from the model's chat template and
architecture, and a request or ``infer serve --reasoning-parser`` may name
another. :class:`ReasoningConstraint` is the token-level side: it forces the
end of thinking once a budget of tokens is spent, and applies a constraint
(JSON schema, a forced tool call) to the answer only, after the reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infer.engine.sampling import Constraint
from infer.errors import SamplingParameterError
from infer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Split:
    """An output (or the settled part of one) split in two; ``answering``:
    whether the reasoning is over (its end seen, or the output never began
    with any)."""

    reasoning: str
    content: str
    answering: bool


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that begins one of
    ``markers`` (but is not all of it): text a stream must hold back until
    it knows whether a marker starts there."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningParser:
    """How one family of models writes its thinking (the base class is the
    ``<think>`` ... ``</think>`` form, with other markers for other families).

    Attributes:
        name: the registry's key.
        starts: texts that open the reasoning when the output begins with
            one (after whitespace).
        ends: texts that close it; ``ends[0]`` is what a thinking budget forces.
        needs_special_tokens: whether the markers are special tokens, so
            the output must be decoded with them.
    """

    def __init__(self, name: str, starts: Sequence[str], ends: Sequence[str], *,
                 needs_special_tokens: bool = False) -> None:
        self.name = name
        self.starts = tuple(starts)
        self.ends = tuple(ends)
        self.needs_special_tokens = needs_special_tokens

    def __repr__(self) -> str:
        return f"<ReasoningParser {self.name!r}>"

    @property
    def forced_end(self) -> str:
        """What a thinking budget appends to end the reasoning."""
        return self.ends[0]

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether a generation after ``prompt`` begins inside the reasoning
        (the template opened it, as Qwen3's and DeepSeek-R1's do)."""
        tail = prompt.rstrip()
        return any(tail.endswith(s) for s in self.starts)

    def parse(self, text: str, in_reasoning: bool, final: bool = True) -> Split:
        """Split ``text``; ``in_reasoning``: the output begins inside the
        reasoning. With ``final=False`` only what is settled: each part is
        then a prefix of that part of any longer text's split."""
        if not in_reasoning:
            stripped = text.lstrip()
            opened = next((s for s in self.starts if stripped.startswith(s)), None)
            if opened is None:
                if not final and any(s.startswith(stripped) for s in self.starts):
                    return Split("", "", False)  # whitespace, or the start of an opening marker
                return Split("", text, True)
            text = stripped[len(opened):]
        # The whitespace around the markers is neither reasoning nor answer; a stream holds a
        # reasoning's trailing whitespace back, since the end marker may follow it.
        found = [(i, e) for e in self.ends if (i := text.find(e)) >= 0]
        if found:
            i, end = min(found)
            return Split(text[:i].strip(), text[i + len(end):].lstrip(), True)
        keep = 0 if final else held_back(text, self.ends)
        return Split(text[:len(text) - keep].strip(), "", False)


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony format: messages ``<|channel|>NAME<|message|>BODY``
    ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``, each after the
    first opened by ``<|start|>assistant``. The *analysis* channel is the
    reasoning; the *final* channel's bodies are the content; a *commentary*
    message addressed to a function (``to=functions.NAME``) is a tool call,
    kept in the content in its raw form for the harmony tool parser."""

    _MARK = re.compile(r"<\|(start|channel|message|end|return|call|constrain)\|>")
    _ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def __init__(self) -> None:
        super().__init__("harmony", ("<|channel|>",), ("<|end|>",), needs_special_tokens=True)

    @property
    def forced_end(self) -> str:
        return "<|end|><|start|>assistant<|channel|>final<|message|>"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.rstrip().endswith("<|channel|>analysis<|message|>")

    def parse(self, text: str, in_reasoning: bool, final: bool = True) -> Split:
        if in_reasoning:
            text = "<|channel|>analysis<|message|>" + text
        if not text.lstrip().startswith("<|") and not (not final and "<|channel|>".startswith(text.lstrip())):
            return Split("", text, True)
        reasoning, content = [], []
        answering = seen = False
        pos = 0
        while pos < len(text):
            head = text.find("<|channel|>", pos)
            if head < 0:
                break
            body = text.find("<|message|>", head)
            if body < 0:
                break  # a header still coming
            header = text[head + len("<|channel|>"):body]
            start = body + len("<|message|>")
            ends = [(i, e) for e in self._ENDS if (i := text.find(e, start)) >= 0]
            i, end = min(ends) if ends else (len(text), "")
            closed = bool(ends)
            piece = text[start:i]
            if not closed and not final:
                piece = piece[:len(piece) - held_back(piece, self._ENDS)]
            channel = header.split()[0] if header.split() else ""
            seen = True
            if channel == "analysis":
                reasoning.append(piece)
            elif "to=" in text[pos:body]:  # a tool call: the raw message, once whole
                if closed or final:
                    content.append(text[pos:i + len(end)])
                    answering = True
                else:
                    break
            else:
                content.append(piece)
                answering = True
            if not closed:
                break
            pos = i + len(end)
        if final and not seen:  # special tokens, but no message: text as it is
            return Split("", text, True)
        return Split("".join(reasoning), "".join(content), answering or final)


#: The parsers by name.
_PARSERS: dict[str, ReasoningParser] = {}


def register_reasoning_parser(parser: ReasoningParser) -> None:
    """Make ``parser`` available under its name (replacing one of the same name)."""
    _PARSERS[parser.name] = parser


def unregister_reasoning_parser(name: str) -> None:
    """Forget the parser registered as ``name`` (nothing if there is none)."""
    _PARSERS.pop(name, None)


def reasoning_parsers() -> list[str]:
    """The registered parsers' names."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; an unknown name is a
    :class:`~infer.errors.SamplingParameterError` listing the known ones."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise SamplingParameterError(
            f"no reasoning parser is named {name!r}; the parsers are {', '.join(reasoning_parsers())}") from None


def reasoning_parser_for(model_type: str, template: str | None) -> ReasoningParser | None:
    """The parser for a model, from its chat template (which writes the
    markers the model was trained on) and its architecture; None for a model
    that does not reason."""
    source = template or ""
    if model_type == "gpt_oss" or "<|channel|>" in source:
        return _PARSERS["harmony"]
    if "</think>" in source or "<think>" in source:
        return _PARSERS["think"]
    if "thought process" in source:
        return _PARSERS["granite"]
    return None


register_reasoning_parser(ReasoningParser("think", ("<think>",), ("</think>",)))
register_reasoning_parser(ReasoningParser(
    "granite", ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:")))
register_reasoning_parser(HarmonyParser())


class ReasoningStream:
    """An output's text pieces in, reasoning and content out as they settle.

    ``feed(piece)`` and then ``finish()`` return ``(reasoning, content)``
    deltas; joined, they are what :meth:`ReasoningParser.parse` gives the
    whole text.
    """

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.text = ""
        self._sent = Split("", "", False)

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._delta(self.parser.parse(self.text, self.in_reasoning, final=False))

    def finish(self) -> tuple[str, str]:
        return self._delta(self.parser.parse(self.text, self.in_reasoning, final=True))

    def _delta(self, now: Split) -> tuple[str, str]:
        before, self._sent = self._sent, now
        return now.reasoning[len(before.reasoning):], now.content[len(before.content):]


class ReasoningConstraint:
    """A request's tokens through its reasoning, then its answer's
    constraint (a :class:`~infer.engine.sampling.Constraint`).

    While the model reasons, nothing is masked, except that after
    ``budget`` reasoning tokens the tokens of the parser's end marker are
    forced, one by one. Once the reasoning is over (its end marker written,
    or the output never began with reasoning), ``inner`` (a matcher of the
    answer's JSON schema or tool-call grammar) masks every token; a token
    that ended the reasoning and carries text past the marker is not shown
    to ``inner``. Where the prompt does not open the reasoning, the first
    token may be what ``inner`` allows or the first of the parser's opening
    marker (whose other tokens then follow, forced).
    """

    def __init__(self, tokenizer: Tokenizer, parser: ReasoningParser, in_reasoning: bool, *,
                 budget: int | None = None, inner: Constraint | None = None) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.budget = budget
        self.inner = inner
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=not parser.needs_special_tokens)
        self._forced = tokenizer.encode(parser.forced_end, add_special_tokens=False)
        self._opening = tokenizer.encode(parser.starts[0], add_special_tokens=False)
        self._opened = 0
        #: Whether the output is still before its first token, or inside the opening marker.
        self._undecided = not in_reasoning and inner is not None and bool(self._opening)
        self._forcing: list[int] | None = None
        self._text = ""
        self.reasoning_tokens = 0
        self.answering = False

    @property
    def complete(self) -> bool | None:
        """Whether the answer matches ``inner`` in full (None without one)."""
        if self.inner is None:
            return None
        return self.answering and bool(self.inner.complete)  # type: ignore[attr-defined]

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.answering:
            return logits if self.inner is None else self.inner.mask(logits)
        if self._undecided:
            nxt = self._opening[self._opened]
            out = np.full_like(logits, -np.inf) if self._opened else self.inner.mask(logits)  # type: ignore[union-attr]
            out[nxt] = logits[nxt]
            return out
        if self._forcing is None and self.budget is not None and self.reasoning_tokens >= self.budget:
            self._forcing = list(self._forced)
        if self._forcing:
            out = np.full_like(logits, -np.inf)
            out[self._forcing[0]] = logits[self._forcing[0]] if np.isfinite(logits[self._forcing[0]]) else 0.0
            return out
        return logits

    def advance(self, token: int) -> None:
        if self.answering:
            if self.inner is not None:
                self.inner.advance(token)
            return
        if self._undecided:
            if token != self._opening[self._opened]:  # the answer began at once
                self.answering = True
                self.inner.advance(token)  # type: ignore[union-attr]
                return
            self._opened += 1
            self._undecided = self._opened < len(self._opening)
        self.reasoning_tokens += 1
        self._text += self._decoder.push(token)
        if self._forcing:
            self._forcing.pop(0)
            if not self._forcing:  # the whole end marker is written
                self.answering = True
                return
        self.answering = self.parser.parse(self._text, self.in_reasoning, final=False).answering
