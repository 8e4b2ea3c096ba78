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

The sandbox stops a template from reaching Python; it does not stop one from
looping for hours or building a gigabyte string. Rendering is therefore
bounded (:class:`TemplateLimits`, docs/security.md): a time budget checked at
every loop iteration, call and output piece; a cap on the characters produced
and on any one string; caps on repetition (``*``, ``**``), formatting widths
(``%``, ``str.format``, ``center``, ``indent``, ``tojson(indent=...)``) and
``lipsum``; and the source size. Loops and output are counted by rewriting the
compiled template: every ``for`` iterates through :func:`_loop`, every output
piece goes through :func:`_emit` and every ``~`` through :func:`_concat`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import logging
import os
import re
import string
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, NoReturn

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infer.errors import ChatTemplateError

logger = logging.getLogger(__name__)

__all__ = ["TemplateLimits", "compile_chat_template", "render_chat_template"]

#: Names a message's reasoning may come under; templates read the first (Qwen3,
#: DeepSeek-R1) or ``thinking`` (gpt-oss). transformers 5 fills both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """The bounds on rendering one chat template (docs/security.md).

    The defaults are far above what published templates need (they render in
    milliseconds, into prompts of at most a few hundred thousand characters)
    and low enough that a hostile template costs at most seconds and tens of
    MB. Each can be raised with the environment variable named beside it.
    """

    #: Seconds one render may take (``INFER_TEMPLATE_TIMEOUT``).
    timeout: float = 5.0
    #: Characters a render may produce in all, and the longest string it may
    #: build (``INFER_TEMPLATE_MAX_CHARS``).
    max_chars: int = 1 << 24
    #: The largest width, precision, padding or indent (``INFER_TEMPLATE_MAX_WIDTH``).
    max_width: int = 4096
    #: The longest template source, in characters (``INFER_TEMPLATE_MAX_SOURCE``).
    max_source: int = 1 << 20
    #: The largest integer a template may compute, in bits (``**``, ``*``).
    max_int_bits: int = 1 << 16

    @classmethod
    def from_env(cls) -> TemplateLimits:
        """The defaults, each replaced by its environment variable where set.

        Raises:
            ChatTemplateError: a variable is not a positive number.
        """
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = f"INFER_TEMPLATE_{field.name.upper()}"
            raw = os.environ.get(name)
            if raw is None or field.name == "max_int_bits":
                continue
            kind = float if field.name == "timeout" else int
            try:
                value = kind(raw)
            except ValueError:
                value = 0
            if not value > 0:
                raise ChatTemplateError(f"{name} must be a positive {kind.__name__}, got {raw!r}")
            values[field.name] = value
        return cls(**values)


class _Budget:
    """What one render has spent: steps (loop iterations, calls) and characters."""

    __slots__ = ("limits", "deadline", "chars", "steps")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout
        self.chars = 0
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise _LimitExceeded(f"rendering took longer than {self.limits.timeout:g} s "
                                 f"({self.steps:,} loop iterations and calls); raise INFER_TEMPLATE_TIMEOUT "
                                 "if the template is trusted")

    def produce(self, n: int) -> None:
        self.chars += n
        if self.chars > self.limits.max_chars:
            raise _LimitExceeded(f"rendering produced more than {self.limits.max_chars:,} characters; "
                                 "raise INFER_TEMPLATE_MAX_CHARS if the template is trusted")
        self.step()


class _LimitExceeded(ChatTemplateError):
    """A template went past one of its :class:`TemplateLimits`."""


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("infer_template_budget", default=None)


def _limits() -> TemplateLimits:
    budget = _BUDGET.get()
    return budget.limits if budget is not None else _DEFAULT_LIMITS


_DEFAULT_LIMITS = TemplateLimits()


def _check_size(n: int, what: str) -> None:
    limit = _limits().max_chars
    if n > limit:
        raise _LimitExceeded(f"{what} would be {n:,} long; the limit is {limit:,} "
                             "(INFER_TEMPLATE_MAX_CHARS)")


def _check_width(n: object, what: str) -> None:
    limit = _limits().max_width
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > limit:
        raise _LimitExceeded(f"{what} {n:,} is beyond the limit of {limit:,} (INFER_TEMPLATE_MAX_WIDTH)")


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _loop(iterable: Any) -> Any:
    """Every ``for`` of a template iterates through this: one step per item."""
    for item in iterable:
        _step()
        yield item


def _emit(value: Any) -> str:
    """Every output piece of a template goes through this: its characters count."""
    text = str(value)
    _check_size(len(text), "an output piece")
    budget = _BUDGET.get()
    if budget is not None:
        budget.produce(len(text))
    return text


def _concat(*values: Any) -> str:
    """``a ~ b``: the joined length is checked before joining."""
    parts = [str(v) for v in values]
    _check_size(sum(map(len, parts)), "a string joined with '~'")
    return "".join(parts)


# printf-style conversion specs: flags, width, precision (``*`` takes them from the arguments)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_NUMBERS = re.compile(r"\d+")


def _check_percent_format(fmt: str) -> None:
    for match in _PERCENT_SPEC.finditer(fmt):
        for group in match.groups():
            if group == "*":
                raise _LimitExceeded("a '%' format takes its width from an argument ('*'), which the "
                                     "sandbox does not allow")
            if group is not None:
                _check_width(int(group), "a '%' format width or precision")


def _check_format_string(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise _LimitExceeded("a str.format spec with a nested field ('{:{w}}') is not allowed in "
                                 "a chat template")
        for number in _FORMAT_NUMBERS.findall(spec or ""):
            _check_width(int(number), "a str.format width or precision")


def _int_bits(value: object) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


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
    limits = TemplateLimits.from_env()
    if len(template) > limits.max_source:
        raise ChatTemplateError(f"the chat template is {len(template):,} characters long; the limit is "
                                f"{limits.max_source:,} (INFER_TEMPLATE_MAX_SOURCE)")
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
    token = _BUDGET.set(_Budget(limits))
    try:
        return "".join(compiled.generate(**variables))
    except ChatTemplateError:
        raise
    except RecursionError as exc:
        raise ChatTemplateError(f"chat template{_where(exc.__traceback__)} recursed too deeply "
                                "(a macro or a recursive loop without end)") from exc
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
    finally:
        _BUDGET.reset(token)


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
    except RecursionError as exc:  # e.g. thousands of nested parentheses
        raise ChatTemplateError("chat template cannot be compiled: it nests too deeply") from exc
    except (MemoryError, ValueError, SyntaxError, OverflowError) as exc:  # what Python's compile() may raise
        raise ChatTemplateError(f"chat template cannot be compiled: {type(exc).__name__}: {exc}") from exc


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
    if isinstance(indent, int):
        _check_width(indent, "tojson indent")
    elif isinstance(indent, str):
        _check_width(len(indent), "tojson indent")
    result = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    _check_size(len(result), "tojson's output")
    return result


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


def _bounded_call(name: str, *args: Any) -> jinja2.nodes.Call:
    target = jinja2.nodes.ImportedName(f"{__name__}.{name}")
    return jinja2.nodes.Call(target, list(args), [], None, None)


class _CountLoopsAndOutput(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that its loops, output and ``~`` are counted
    (module docstring). An imported name cannot be shadowed by template code."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = _bounded_call("_loop", node.iter).set_lineno(node.lineno)
        return node

    def visit_Output(self, node: jinja2.nodes.Output) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.nodes = [_bounded_call("_emit", child).set_lineno(child.lineno) for child in node.nodes]
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return _bounded_call("_concat", *node.nodes).set_lineno(node.lineno)


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_Template(self, node: jinja2.nodes.Template, frame: Any = None) -> None:
        super().visit_Template(_CountLoopsAndOutput().visit(node), frame)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the operations that can cost time or memory out of
    proportion to the template's size checked before they run."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        sized = (str, list, tuple)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(times, int):
                    _check_size(len(seq) * max(times, 0), "a repeated string or list")
            if isinstance(left, int) and isinstance(right, int):
                self._check_bits(_int_bits(left) + _int_bits(right))
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                self._check_bits(_int_bits(left) * right)
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized):
                _check_size(len(left) + len(right), "a string or list joined with '+'")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def _check_bits(bits: int) -> None:
        limit = _limits().max_int_bits
        if bits > limit:
            raise _LimitExceeded(f"an integer of about {bits:,} bits; the limit is {limit:,}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's
        _step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        if isinstance(result, (str, list)):
            _check_size(len(result), f"the result of {getattr(__obj, '__name__', 'a call')}()")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format_string(value.__self__)
        return wrapped


def _check_str_method(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Bound the str methods whose result can be far longer than their inputs."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], f"str.{name} width")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_width(tabsize, "str.expandtabs tab size")
            _check_size(len(text) + text.count("\t") * max(tabsize, 0), "the result of str.expandtabs()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _check_size(len(text) + count * len(args[1]), "the result of str.replace()")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        _check_size(sum(len(x) for x in items if isinstance(x, str)) + len(text) * len(items),
                    "the result of str.join()")


def _center(value: Any, width: int = 80) -> str:
    _check_width(width, "center width")
    return jinja2.filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    if isinstance(width, str):
        _check_size(len(width) * (str(s).count("\n") + 1), "an indent")
    else:
        _check_width(width, "indent width")
        _check_size(len(str(s)) + max(width, 0) * (str(s).count("\n") + 1), "an indented text")
    return jinja2.filters.do_indent(s, width, first, blank)


@jinja2.pass_environment
def _wordwrap(environment: Any, s: Any, width: int = 79, *args: Any, **kwargs: Any) -> str:
    _check_width(width, "wordwrap width")
    return jinja2.filters.do_wordwrap(environment, s, width, *args, **kwargs)



def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    if isinstance(value, str):
        _check_percent_format(value)
    return jinja2.filters.do_format(value, *args, **kwargs)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    _check_width(slices, "slice count")
    return jinja2.filters.do_slice(value, slices, fill_with)


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value) if not isinstance(value, (list, tuple, str)) else value
    if attribute is None:
        _check_size(sum(len(x) for x in items if isinstance(x, str)) + len(str(d)) * len(items),
                    "a joined string")
    result = jinja2.filters.do_join(eval_ctx, items, d, attribute)
    _check_size(len(result), "a joined string")
    return result



def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - Jinja's names
    _check_width(n, "lipsum paragraph count")
    _check_width(max, "lipsum words per paragraph")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        undefined=_SandboxUndefined,
    )
    env.filters["tojson"] = _tojson
    env.filters.update(center=_center, indent=_indent, wordwrap=_wordwrap, format=_format, slice=_slice,
                       join=_join)
    env.globals["lipsum"] = _lipsum
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
