"""The tool-call formats infer reads, one class each, as their models write them.

Each class says where a block starts and ends and how to read it
(:class:`~infer.tool_parsers.base.ToolParser`), and all but harmony write
the grammar that forces a call (a forced call writes a tool's required
parameters; Qwen3-Coder's string values are then one line each). Formats documented by the model
families' chat templates and model cards.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from infer.tool_parsers.base import (
    Call,
    ToolParser,
    arguments_json,
    call_from_json,
    function_of,
    lark_string,
    parameters_of,
    register_tool_parser,
    repeat,
)

_DECODER = json.JSONDecoder()


def _json_values(text: str, separators: str = " \t\r\n;,") -> list[Any] | None:
    """Every JSON value in ``text``, one after another, separated by
    ``separators``; None when anything else is there."""
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos == len(text):
            return values
        value, pos = _DECODER.raw_decode(text, pos)
        values.append(value)


def _closing(marker: str, close: str) -> Any:
    """A ``block_end`` for blocks from ``marker`` to the first ``close`` after it."""
    def block_end(self: ToolParser, text: str, start: int) -> int | None:
        i = text.find(close, start + len(marker))
        return None if i < 0 else i + len(close)
    return block_end


@register_tool_parser
class Hermes(ToolParser):
    """Hermes 2/3, Qwen 2.5 and Qwen 3: one block per call::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    The last block may lack its closing tag (the end of generation came first)."""

    name = "hermes"
    markers = ("<tool_call>",)
    block_end = _closing("<tool_call>", "</tool_call>")

    def parse_block(self, block: str) -> list[Call] | None:
        body = block[len("<tool_call>"):]
        body = body[:-len("</tool_call>")] if body.endswith("</tool_call>") else body
        call = call_from_json(json.loads(body.strip()))
        return None if call is None else [call]

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        more = repeat(' ("\\n" block)', most)
        return (f"start: block{more}\n"
                f'block: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: %json {json.dumps(self.call_schema(tools))}\n")


@register_tool_parser
class Llama3Json(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 with JSON tool calling: the whole reply is the
    call, ``{"name": "get_weather", "parameters": {"city": "Paris"}}``, maybe
    after ``<|python_tag|>``, several separated by ``;``."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    _TAG = "<|python_tag|>"

    def find_start(self, text: str, pos: int) -> int | None:
        if pos:
            return None
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.markers) else None

    def hold(self, text: str, pos: int) -> int:
        stripped = text[pos:].lstrip()
        return len(text) - pos if self._TAG.startswith(stripped) else 0

    def parse_block(self, block: str) -> list[Call] | None:
        body = block.strip()
        body = body[len(self._TAG):] if body.startswith(self._TAG) else body
        values = _json_values(body)
        calls = [call_from_json(v, "parameters") for v in values or ()]
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        more = repeat(' ("; " call)', most)
        return f"start: call{more}\ncall: %json {json.dumps(self.call_schema(tools, 'parameters'))}\n"


@register_tool_parser
class Mistral(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` (a special token) then a JSON list of
    ``{"name", "arguments"}`` (v3 tokenizers), or ``NAME[ARGS]{...}`` after
    each ``[TOOL_CALLS]`` (v11 and later). The calls run to the end of the reply."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        more = repeat(' (", " call)', most)
        return (f'start: {self.literal("[TOOL_CALLS]")} "[" call{more} "]"\n'
                f"call: %json {json.dumps(self.call_schema(tools))}\n")

    def parse_block(self, block: str) -> list[Call] | None:
        calls: list[Call] = []
        for part in block.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if part.startswith("["):
                values = _json_values(part)
                if not values or not all(isinstance(v, list) for v in values):
                    return None
                for value in values:
                    for item in value:
                        call = call_from_json(item)
                        if call is None:
                            return None
                        calls.append(call)
            else:
                name, sep, args = part.partition("[ARGS]")
                encoded = arguments_json(args.strip()) if sep else None
                if not name.strip() or encoded is None:
                    return None
                calls.append(Call(name.strip(), encoded))
        return calls


@register_tool_parser
class Qwen3Coder(ToolParser):
    """Qwen3-Coder's XML calls::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value is text; where the tool's schema says the parameter is not a
    string, it is read as JSON (numbers, booleans, objects)."""

    name = "qwen3_coder"
    markers = ("<tool_call>",)
    block_end = _closing("<tool_call>", "</tool_call>")
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)

    def parse_block(self, block: str) -> list[Call] | None:
        calls = []
        for name, body in self._FUNCTION.findall(block):
            arguments = {key.strip(): self._value(name.strip(), key.strip(), value)
                         for key, value in self._PARAMETER.findall(body)}
            calls.append(Call(name.strip(), json.dumps(arguments, ensure_ascii=False)))
        return calls or None

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        rules = []
        for i, tool in enumerate(tools):
            params = []
            for j, (key, schema) in enumerate(self.required_parameters(tool)):
                if schema.get("type") == "string" and "enum" not in schema:
                    value = "/[^<\\n]+/"  # one line of text, up to the closing tag
                elif schema.get("type") == "string":
                    value = " | ".join(lark_string(str(v)) for v in schema["enum"])
                else:
                    value = f"v{i}_{j}"
                    rules.append(f"v{i}_{j}: {self.guided(schema)}")
                params.append(f'{lark_string(f"<parameter={key}>" + chr(10))} ({value}) "\\n</parameter>\\n"')
            name = function_of(tool).get("name", "")
            body = " ".join(params) or '""'
            rules.append(f'call{i}: {lark_string(f"<tool_call>{chr(10)}<function={name}>{chr(10)}")} {body} '
                         f'"</function>\\n</tool_call>"')
        more = repeat(' ("\\n" call)', most)
        names = " | ".join(f"call{i}" for i in range(len(tools)))
        return f"start: call{more}\ncall: {names}\n" + "\n".join(rules) + "\n"

    def _value(self, function: str, key: str, raw: str) -> Any:
        text = raw.strip("\n")
        kind = self._kind(function, key)
        if kind in (None, "string"):
            return text
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text

    def _kind(self, function: str, key: str) -> str | None:
        for tool in self.tools:
            if function_of(tool).get("name") == function:
                prop = parameters_of(tool).get("properties", {}).get(key, {})
                kind = prop.get("type") if isinstance(prop, Mapping) else None
                return kind if isinstance(kind, str) else "json"
        return "json"


@register_tool_parser
class Pythonic(ToolParser):
    """Calls as a Python list of calls, the whole reply (Llama 3.2 and 4's
    pythonic templates, ToolACE): ``[get_weather(city="Paris"), get_time()]``.
    Arguments must be literals; read with :mod:`ast`, never evaluated."""

    name = "pythonic"
    markers = ("[",)

    def find_start(self, text: str, pos: int) -> int | None:
        if pos:
            return None
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def hold(self, text: str, pos: int) -> int:
        return len(text) - pos if not text[pos:].strip() else 0

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        rules = []
        for i, tool in enumerate(tools):
            args = []
            for j, (key, schema) in enumerate(self.required_parameters(tool)):
                if schema.get("type") == "boolean":
                    value = '("True" | "False")'  # Python's spelling, not JSON's
                else:
                    value = f"v{i}_{j}"
                    rules.append(f"v{i}_{j}: {self.guided(schema)}")
                args.append(f'{lark_string(key + "=")} {value}')
            name = function_of(tool).get("name", "")
            joined = ' ", " '.join(args) or '""'
            rules.append(f'call{i}: {lark_string(name + "(")} {joined} ")"')
        more = repeat(' (", " call)', most)
        names = " | ".join(f"call{i}" for i in range(len(tools)))
        return f'start: "[" call{more} "]"\ncall: {names}\n' + "\n".join(rules) + "\n"

    def parse_block(self, block: str) -> list[Call] | None:
        if len(block) > 100_000:
            return None
        tree = ast.parse(block.strip(), mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            encoded = arguments_json(arguments)
            if encoded is None:
                return None
            calls.append(Call(node.func.id, encoded))
        return calls


@register_tool_parser
class DeepSeekV3(ToolParser):
    """DeepSeek V3 / R1's calls::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    and V3.1's ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (BEGIN,)
    needs_special_tokens = True
    block_end = _closing(BEGIN, END)
    _FENCED = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)

    def parse_block(self, block: str) -> list[Call] | None:
        calls = []
        for part in block.split(self.CALL)[1:]:
            body = part.split(self.CALL_END)[0]
            head, sep, rest = body.partition(self.SEP)
            if not sep:
                return None
            if head.strip() == "function" and "\n" in rest:  # V3: the type, then the name on the line
                name, _, rest = rest.partition("\n")
            else:
                name = head
            fenced = self._FENCED.match(rest)
            encoded = arguments_json((fenced.group(1) if fenced else rest).strip())
            if not name.strip() or encoded is None:
                return None
            calls.append(Call(name.strip(), encoded))
        return calls

    def grammar(self, tools: Sequence[Mapping[str, Any]], most: int = 1) -> str:
        alternatives = []
        for i, tool in enumerate(tools):
            name = function_of(tool).get("name", "")
            schema = {**parameters_of(tool), "x-guidance": self.call_schema(tools)["x-guidance"]}
            alternatives.append(f"call{i}: {lark_string(self.CALL + 'function' + self.SEP + name)} "
                                f'"\\n```json\\n" args{i} "\\n```" {lark_string(self.CALL_END)}\n'
                                f"args{i}: %json {json.dumps(schema)}\n")
        names = " | ".join(f"call{i}" for i in range(len(tools)))
        return (f"start: {lark_string(self.BEGIN)} call{repeat(' call', most)} {lark_string(self.END)}\n"
                f"call: {names}\n" + "".join(alternatives))


@register_tool_parser
class Harmony(ToolParser):
    """gpt-oss's harmony calls: a *commentary* message to a function,
    ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``,
    which the harmony reasoning parser (:class:`infer.reasoning.HarmonyParser`)
    passes on in the content as it came; ``<|call|>`` ends the reply, so it
    may be missing."""

    name = "harmony"
    markers = ("<|start|>", "<|channel|>")
    needs_special_tokens = True
    _HEAD = re.compile(r"to=functions\.([^\s<]+)")

    def find_start(self, text: str, pos: int) -> int | None:
        while True:
            start = super().find_start(text, pos)
            if start is None:
                return None
            body = text.find("<|message|>", start)
            if body < 0 or self._HEAD.search(text, start, body):
                return start  # a header still coming, or a call's
            pos = start + 1

    def block_end(self, text: str, start: int) -> int | None:
        i = text.find("<|call|>", start)
        return None if i < 0 else i + len("<|call|>")

    def parse_block(self, block: str) -> list[Call] | None:
        head, sep, body = block.partition("<|message|>")
        found = self._HEAD.search(head)
        if not sep or found is None:
            return None
        encoded = arguments_json(body.removesuffix("<|call|>").strip())
        return None if encoded is None else [Call(found.group(1), encoded)]
