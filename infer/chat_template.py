"""Rendering Hugging Face chat templates.

A chat template is Jinja code shipped with a model (``chat_template.jinja`` or
``tokenizer_config.json``) that turns a list of messages into the prompt text
the model was trained on. Templates come from the Hub, so they are untrusted:
they run in jinja2's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`
with the same globals and filters transformers gives them (``raise_exception``,
``strftime_now``, ``tojson``, ``namespace``, ``dict`` and the
``{% generation %}`` tag), so a template renders here exactly as it does in
transformers.

Every failure becomes a :class:`~infer.errors.ChatTemplateError`: a syntax
error, an exception the template raises on purpose (``raise_exception``), an
access the sandbox forbids, or any other error while rendering. There is no
fallback template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infer.errors import ChatTemplateError

logger = logging.getLogger(__name__)

__all__ = ["compile_chat_template", "render_chat_template"]

#: Names a message's reasoning may come under; templates read the first (Qwen3,
#: DeepSeek-R1) or ``thinking`` (gpt-oss). transformers 5 fills both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``template`` for ``messages`` and return the prompt text.

    Args:
        template: the Jinja source of a Hugging Face chat template.
        messages: the conversation, each a dict with a string ``"role"``
            (``"system"``, ``"user"``, ``"assistant"``, ``"tool"``...) and
            usually ``"content"``. Keys whose value is None are dropped, and
            reasoning given as ``reasoning_content``, ``thinking`` or
            ``reasoning`` is visible under the first two, as in transformers 5.
        add_generation_prompt: end with the header that starts the
            assistant's turn, so the model answers rather than continues.
        bos_token, eos_token: the model's special tokens, which many templates
            write out. None leaves the variable undefined (it renders as ""),
            not the text ``"None"``.
        tools: JSON schemas of the functions the model may call, or None.
        **kwargs: further template variables (``documents``,
            ``enable_thinking``, ...).

    Raises:
        ChatTemplateError: bad messages, a template syntax error, an exception
            the template raised, or a forbidden or failing operation.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a str, got {type(template).__name__}")
    compiled = compile_chat_template(template)
    variables: dict[str, Any] = {
        "messages": _prepare_messages(messages),
        "tools": _prepare_tools(tools),
        "documents": None,
        "add_generation_prompt": bool(add_generation_prompt),
    }
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(_plain(kwargs))
    try:
        return compiled.render(**variables)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(
            f"chat template{_where(exc.__traceback__)} tried an operation the sandbox forbids: {exc}"
        ) from exc
    except UndefinedError as exc:
        raise ChatTemplateError(
            f"chat template{_where(exc.__traceback__)} used an undefined value: {exc}"
        ) from exc
    except Exception as exc:  # any other failure inside template code
        raise ChatTemplateError(
            f"chat template{_where(exc.__traceback__)} failed while rendering: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same source reuse it.

    Raises:
        ChatTemplateError: the template has a syntax error (with its line).
    """
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template has a syntax error at line {exc.lineno}: {exc.message}"
        ) from exc
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template cannot be compiled: {exc}") from exc


# -- what templates see -------------------------------------------------------


def _raise_exception(message: object) -> NoReturn:
    """``raise_exception(msg)`` in a template: the template rejects its input."""
    raise ChatTemplateError(f"chat template raised an exception: {message}")


def _strftime_now(fmt: str) -> str:
    """``strftime_now(fmt)`` in a template: the local time (Llama 3.1 dates)."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike Jinja's own, no HTML escaping, Unicode kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """``dict(...)`` in a template, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for
    training masks in transformers; rendering it here just emits the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _SandboxUndefined(jinja2.Undefined):
    """Lenient like Jinja's default (templates test missing keys), except for an
    attribute the sandbox refused: printing or testing that raises, where the
    default would silently render ``""``."""

    __slots__ = ()

    def _fail_if_forbidden(self) -> None:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()

    def __str__(self) -> str:
        self._fail_if_forbidden()
        return super().__str__()

    def __bool__(self) -> bool:
        self._fail_if_forbidden()
        return super().__bool__()

    def __iter__(self) -> Any:
        self._fail_if_forbidden()
        return super().__iter__()

    def __len__(self) -> int:
        self._fail_if_forbidden()
        return super().__len__()


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        undefined=_SandboxUndefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# -- input checks ---------------------------------------------------------------


def _prepare_messages(messages: object) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of dicts with a 'role', got {type(messages).__name__}"
        )
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{index}] must be a dict with a 'role', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(
                f"messages[{index}] needs a str 'role' (e.g. 'user'), got {role!r}"
            )
        # Many templates render a None content as "None" or crash on it, while
        # they handle a missing key; transformers 5 drops such keys too.
        plain = {key: _plain(value) for key, value in message.items() if value is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


def _prepare_tools(tools: object) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError(
            f"tools must be a list of JSON schemas (dicts), got {type(tools).__name__}"
        )
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(
                f"tools[{index}] must be a JSON schema (dict), got {type(tool).__name__}"
            )
    return [_plain(tool) for tool in tools]


def _plain(value: Any) -> Any:
    """A copy built from JSON types only: the sandbox knows which methods of
    ``str``/``list``/``dict`` are safe, not those of arbitrary user objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _where(tb: TracebackType | None) -> str:
    """`` at line N`` for the innermost template frame of a traceback."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line is not None else ""
