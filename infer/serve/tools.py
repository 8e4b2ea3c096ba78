"""Tool calls in a model's reply, parsed back into OpenAI's ``tool_calls``.

The form parsed is the Hermes one that Qwen 2.5 / Qwen 3, Hermes 2/3 and
their fine-tunes are trained to write, and their chat templates document::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, possibly after some text. A block whose JSON does not
parse, or lacks a ``name``, stays in the reply's text: never a made-up call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The last block may be cut short by the end of generation (its EOS came instead of CLOSE).
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass
class ParsedReply:
    """A reply split into its text (None when nothing but calls) and its tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_tool_calls(text: str) -> ParsedReply:
    """Split ``text`` into content and OpenAI-shaped tool calls
    (``{"id", "type": "function", "function": {"name", "arguments"}}``,
    ``arguments`` as JSON text). Never raises."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content=content or None, tool_calls=calls)


def _call(body: str) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    try:
        encoded = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": encoded}}


def held_back(text: str, marker: str = OPEN) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker``: text a
    stream must hold back until it knows whether a tool call starts there."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
