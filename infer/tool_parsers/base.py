"""Tool-call parsers: the machinery every format shares, and their registry.

Each family writes a call its own way (Hermes/Qwen's ``<tool_call>`` JSON,
Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``, Qwen3-Coder's XML, Python
call syntax, DeepSeek V3's ``<｜tool▁calls▁begin｜>``, gpt-oss's harmony
messages); a :class:`ToolParser` knows one. It finds *blocks* in the text —
where a call may start (:meth:`ToolParser.find_start`), where it ends
(:meth:`ToolParser.block_end`, None while it is open) — and reads each
(:meth:`ToolParser.parse_block`); a block that does not read as calls stays
in the content, never a made-up call. :meth:`ToolParser.parse` splits a whole
reply; :class:`ToolCallStream` splits it as it streams, sending content as
soon as no call can start in it and each call once its block is whole, so
joining what it sends gives what :meth:`~ToolParser.parse` gives.

:meth:`ToolParser.grammar` writes the Lark grammar (llguidance's, with
``%json`` for the arguments' schemas) that makes a model write calls in its
format: what ``tool_choice`` ``"required"`` or a named function enforces.

Parsers are registered by name (:func:`register_tool_parser`);
:func:`tool_parser_for` chooses one from the chat template, and
``infer serve --tool-parser NAME`` overrides it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.engine.structured import JSON_DEFAULTS
from infer.errors import SamplingParameterError
from infer.reasoning import held_back


@dataclass(frozen=True)
class Call:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """A reply split into its content (as written, whitespace included) and its calls."""

    content: str
    calls: list[Call] = field(default_factory=list)


def new_call_id() -> str:
    """A fresh id for a call, in OpenAI's ``call_...`` form."""
    import uuid  # here, not at the top: a load imports this module and never calls this

    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_json(arguments: Any) -> str | None:
    """``arguments`` as JSON text (a string that is JSON stays as it is);
    None when they are not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None


def call_from_json(data: Any, arguments_key: str = "arguments") -> Call | None:
    """A call from ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get(arguments_key, data.get("parameters", data.get("arguments", {})))
    encoded = arguments_json(arguments)
    return None if encoded is None else Call(data["name"], encoded)


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function definition of an OpenAI tool (``{"type": "function", "function": {...}}``)."""
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else {}


def parameters_of(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema (an object of anything when it gives none)."""
    params = function_of(tool).get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object"}


class ToolParser:
    """One format of tool calls (see the module docs). Subclasses set
    :attr:`name` and :attr:`markers`, and implement :meth:`parse_block`;
    most override :meth:`block_end` too."""

    #: The registry's key (``--tool-parser``).
    name = ""
    #: Texts a call block starts with.
    markers: tuple[str, ...] = ()
    #: Whether the markers are special tokens, so the reply must be decoded with them.
    needs_special_tokens = False

    #: Markers that may be special tokens of a model's vocabulary (a grammar then names the token).
    special_markers: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), special: Mapping[str, int] | None = None) -> None:
        #: The request's tools (what a format that writes untyped values reads their types from).
        self.tools = list(tools)
        #: Which of :attr:`special_markers` are special tokens of the model, with their ids.
        self.special = dict(special or {})

    def literal(self, text: str) -> str:
        """``text`` in a grammar: the special token it is, or a string literal."""
        return f"<[{self.special[text]}]>" if text in self.special else lark_string(text)

    # -- what a format defines ---------------------------------------------------------

    def find_start(self, text: str, pos: int) -> int | None:
        """Where the first block at or after ``pos`` starts; None if none does."""
        found = [i for m in self.markers if (i := text.find(m, pos)) >= 0]
        return min(found) if found else None

    def hold(self, text: str, pos: int) -> int:
        """How many characters at the end of ``text`` (past ``pos``, where no
        block starts) may still begin one: the stream holds them back."""
        return held_back(text[pos:], self.markers)

    def block_end(self, text: str, start: int) -> int | None:
        """Where the block starting at ``start`` ends (past its last
        character); None while it is still open. The default: it runs to
        the end of the reply."""
        return None

    def parse_block(self, block: str) -> list[Call] | None:
        """The calls in one block; None when it does not read as calls."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        """A Lark grammar (llguidance's dialect) of replies that are nothing
        but calls to ``tools`` in this format: one to ``most`` of them.
        Raises :class:`~infer.errors.SamplingParameterError` for a format
        that has none."""
        raise SamplingParameterError(
            f"forcing a tool call (tool_choice 'required' or a function's name) is not supported with the "
            f"{self.name!r} tool-call format; use tool_choice 'auto', or --tool-parser hermes")

    # -- what every format shares ----------------------------------------------------------

    def parse(self, text: str) -> Parsed:
        """Split a whole reply into content and calls; never raises.

        The content is the text as written, less the whitespace around calls:
        what precedes a call loses its trailing whitespace, what follows one
        its leading whitespace (so text that is only whitespace between or
        after calls goes; text on both sides of a call is joined by a
        newline). A block that does not read as calls stays in the content
        as it was written."""
        out = Parsed("")
        pieces: list[str] = []
        pos, after_call = 0, False
        while True:
            start = self.find_start(text, pos)
            segment = text[pos:len(text) if start is None else start]
            if after_call:
                segment = segment.lstrip()
                if segment and any(pieces):  # text on both sides of a call stays apart
                    segment = "\n" + segment
            if start is None:
                pieces.append(segment)
                break
            end = self.block_end(text, start)
            end = len(text) if end is None else end
            calls = self._read(text[start:end])
            if calls is None:
                pieces.append(segment + text[start:end])
            else:
                pieces.append(segment.rstrip())
                out.calls.extend(calls)
            after_call = calls is not None
            pos = end
            if pos >= len(text):
                break
        out.content = "".join(pieces)
        return out

    def settled(self, text: str) -> int:
        """How much of ``text`` no later text can change the reading of:
        up to the first open block, or to a possible marker's start, less
        the whitespace a call that follows would take away."""
        pos = 0
        while True:
            start = self.find_start(text, pos)
            if start is None:
                stop = len(text) - self.hold(text, pos)
                return pos + len(text[pos:stop].rstrip())
            end = self.block_end(text, start)
            if end is None:
                return pos + len(text[pos:start].rstrip())
            pos = end

    def _read(self, block: str) -> list[Call] | None:
        try:
            calls = self.parse_block(block)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, SyntaxError, MemoryError):
            return None
        return calls or None

    # -- grammar helpers -------------------------------------------------------------------

    @staticmethod
    def guided(schema: Mapping[str, Any]) -> str:
        """``schema`` as a grammar's ``%json`` rule, written without free whitespace."""
        return "%json " + json.dumps({**schema, "x-guidance": JSON_DEFAULTS})

    @staticmethod
    def required_parameters(tool: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """A tool's required parameters with their schemas, in the order its schema lists them:
        what a forced call writes (optional ones are left out)."""
        schema = parameters_of(tool)
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        return [(k, dict(v) if isinstance(v, Mapping) else {}) for k, v in props.items() if k in required]

    def call_schema(self, tools: Sequence[Mapping[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
        """The JSON schema of one ``{"name", "arguments"}`` object calling one of ``tools``."""
        options = [{"type": "object", "properties": {"name": {"const": function_of(t).get("name")},
                                                     arguments_key: parameters_of(t)},
                    "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": JSON_DEFAULTS}


#: Most calls a forced parallel call may write (``tool_choice="required"``): a model that would
#: never stop calling cannot run to its max_tokens.
MAX_FORCED_CALLS = 8


def repeat(item: str, most: int) -> str:
    """``item`` repeated 0 to ``most - 1`` times in a grammar: what follows a first call."""
    return f"{item}{{0,{most - 1}}}" if most > 1 else ""


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


class ToolCallStream:
    """A reply's text pieces in; content and whole calls out as they settle.

    ``feed(piece)`` and then ``finish()`` return ``(content, calls)``; each
    call comes with its index among the reply's calls and a fresh id.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content = 0
        self._calls = 0
        #: Every call sent so far, as ``(index, id, call)``.
        self.calls: list[tuple[int, str, Call]] = []

    def feed(self, piece: str) -> tuple[str, list[tuple[int, str, Call]]]:
        self.text += piece
        return self._delta(self.parser.parse(self.text[:self.parser.settled(self.text)]))

    def finish(self) -> tuple[str, list[tuple[int, str, Call]]]:
        return self._delta(self.parser.parse(self.text))

    def _delta(self, now: Parsed) -> tuple[str, list[tuple[int, str, Call]]]:
        content = now.content[self._content:]
        self._content = len(now.content)
        new = [(i, new_call_id(), call) for i, call in enumerate(now.calls[self._calls:], start=self._calls)]
        self._calls = len(now.calls)
        self.calls.extend(new)
        return content, new


#: The parsers by name.
_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(parser: type[ToolParser]) -> type[ToolParser]:
    """Make ``parser`` (a class) available under its name; usable as a decorator."""
    _PARSERS[parser.name] = parser
    return parser


def unregister_tool_parser(name: str) -> None:
    """Forget the format registered as ``name`` (nothing if there is none)."""
    _PARSERS.pop(name, None)


def tool_parsers() -> list[str]:
    """The registered formats' names."""
    return sorted(_PARSERS)


def get_tool_parser(name: str, tools: Sequence[Mapping[str, Any]] = (),
                    special: Mapping[str, int] | None = None) -> ToolParser:
    """The parser of format ``name`` for a request with ``tools`` (``special``:
    which of its markers are special tokens of the model, with their ids); an
    unknown name is a :class:`~infer.errors.SamplingParameterError` listing the formats."""
    try:
        return _PARSERS[name](tools, special)
    except KeyError:
        raise SamplingParameterError(
            f"no tool-call format is named {name!r}; the formats are {', '.join(tool_parsers())}") from None


def tool_parser_for(model_type: str, template: str | None) -> str:
    """The format a model writes calls in, from its chat template (which
    shows the model the format) and architecture; Hermes when nothing says
    otherwise, the most common one."""
    source = template or ""
    if model_type == "gpt_oss" or "<|channel|>" in source:
        return "harmony"
    if "<function=" in source:
        return "qwen3_coder"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "tool▁calls▁begin" in source:
        return "deepseek_v3"
    if "func_name1(" in source:
        return "pythonic"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


def openai_call(index: int | None, call_id: str, call: Call) -> dict[str, Any]:
    """A call in OpenAI's ``tool_calls`` shape (with ``index`` in a streamed delta)."""
    out: dict[str, Any] = {"id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}

