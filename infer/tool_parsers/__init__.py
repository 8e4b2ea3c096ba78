"""Tool calls in a model's reply, in the format its family was trained on.

The parser machinery, its registry and OpenAI's call shape are in
:mod:`infer.tool_parsers.base`; the built-in formats (``hermes``,
``llama3_json``, ``mistral``, ``qwen3_coder``, ``pythonic``,
``deepseek_v3``, ``harmony``) in :mod:`infer.tool_parsers.formats`,
registered on import of this package.
"""

from __future__ import annotations

from infer.tool_parsers import formats
from infer.tool_parsers.base import (
    Call,
    Parsed,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    new_call_id,
    openai_call,
    register_tool_parser,
    tool_parser_for,
    tool_parsers,
    unregister_tool_parser,
)

__all__ = ["Call", "Parsed", "ToolCallStream", "ToolParser", "formats", "get_tool_parser", "new_call_id",
           "openai_call", "register_tool_parser", "tool_parser_for", "tool_parsers", "unregister_tool_parser"]
