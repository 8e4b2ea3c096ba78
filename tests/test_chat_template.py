"""infer.chat_template: templates render as in transformers, failures are
ChatTemplateErrors, and the sandbox holds."""

from __future__ import annotations

import datetime
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from infer.chat_template import compile_chat_template, render_chat_template
from infer.errors import ChatTemplateError
from infer.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# In the style of Llama 3.1's template: bos_token, namespace, loop controls,
# tools rendered with tojson(indent=4), strftime_now, raise_exception.
LLAMA3_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if tools is not none %}
    {{- 'Tools:\\n' }}
    {%- for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n' }}{% endfor %}
{%- endif %}
{{- 'System: ' + ns.system + ' Date: ' + strftime_now('%Y') }}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi ☃ <b>"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "  What's 2+2?  "},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add ☃ <x>",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def test_chatml_renders_with_and_without_generation_prompt() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    turns = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    assert render_chat_template(CHATML, messages, add_generation_prompt=False) == turns
    assert render_chat_template(CHATML, messages) == turns + "<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [CHATML, LLAMA3_STYLE], ids=["chatml", "llama3_style"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(template: str, tools: list | None, add_generation_prompt: bool) -> None:
    transformers = pytest.importorskip("transformers")
    backend = Backend(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    expected = reference.apply_chat_template(
        CONVERSATION, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = render_chat_template(
        template, CONVERSATION, tools=tools, bos_token="<s>", eos_token="</s>",
        add_generation_prompt=add_generation_prompt,
    )
    assert rendered == expected


def test_raise_exception_surfaces_the_templates_message() -> None:
    with pytest.raises(ChatTemplateError, match="chat template raised an exception: Unknown role: robot"):
        render_chat_template(LLAMA3_STYLE, [{"role": "robot", "content": "beep"}], bos_token="<s>")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{{ messages[0].update(role='x') }}",
        "{% set ns = namespace() %}{% set ns._private = 1 %}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_sandbox_blocks_unsafe_access(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="sandbox forbids|undefined value"):
        render_chat_template(source, [{"role": "user", "content": "x"}])


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat_template("ok\n{% if %}", [])


def test_runtime_error_names_the_line_and_cause() -> None:
    with pytest.raises(ChatTemplateError, match=r"\(line 3\) failed while rendering: ZeroDivisionError"):
        render_chat_template("a\nb\n{{ 1 // 0 }}", [])
    with pytest.raises(ChatTemplateError, match="undefined value"):
        render_chat_template("{{ messages[0].content.missing.deeper }}", [{"role": "user", "content": "x"}])


def test_tojson_keeps_unicode_and_supports_indent() -> None:
    value = {"name": "☃ <b>&", "n": [1, 2]}
    assert render_chat_template("{{ v | tojson }}", [], v=value) == json.dumps(value, ensure_ascii=False)
    assert render_chat_template("{{ v | tojson(indent=2) }}", [], v=value) == json.dumps(
        value, ensure_ascii=False, indent=2
    )
    assert render_chat_template("{{ v | tojson(sort_keys=true, separators=(',', ':')) }}", [], v=value) == (
        '{"n":[1,2],"name":"☃ <b>&"}'
    )


def test_globals_and_variables() -> None:
    year = str(datetime.datetime.now().year)
    assert render_chat_template("{{ strftime_now('%Y') }}", []) == year
    # An unset bos_token renders as nothing, not "None".
    assert render_chat_template("[{{ bos_token }}]", []) == "[]"
    assert render_chat_template("{{ bos_token }}{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s></s>"
    assert render_chat_template("{{ enable_thinking }}", [], enable_thinking=False) == "False"
    assert render_chat_template("{{ tools is none }}", []) == "True"
    assert render_chat_template("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}",
                                []) == "01"
    assert render_chat_template("{% generation %}kept{% endgeneration %}", []) == "kept"
    assert render_chat_template("{{ dict(a=1)['a'] }}", []) == "1"


def test_messages_are_plain_copies_with_reasoning_aliases() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "think"}]
    source = "{{ messages[0].content is defined }} {{ messages[0].reasoning_content }} {{ messages[0].thinking }}"
    assert render_chat_template(source, messages) == "False think think"
    assert messages == [{"role": "assistant", "content": None, "reasoning": "think"}]


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "must be a list"),
        ([["user", "hi"]], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] needs a str 'role'"),
        ([{"role": "user"}, {"role": 3}], r"messages\[1\] needs a str 'role'"),
    ],
)
def test_bad_messages_are_rejected(messages: object, problem: str) -> None:
    with pytest.raises(ChatTemplateError, match=problem):
        render_chat_template(CHATML, messages)  # type: ignore[arg-type]


def test_bad_tools_are_rejected() -> None:
    with pytest.raises(ChatTemplateError, match=r"tools\[0\] must be a JSON schema"):
        render_chat_template(CHATML, [], tools=["add"])  # type: ignore[list-item]


def test_compiled_templates_are_cached() -> None:
    assert compile_chat_template(CHATML) is compile_chat_template(CHATML)


def test_tokenizer_without_template_says_how_to_pass_one() -> None:
    tok = Tokenizer(Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template; pass one with template="):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], template=CHATML).startswith("<|im_start|>")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(messages=st.one_of(json_values, st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values))))
def test_any_input_renders_or_raises_chat_template_error(messages: object) -> None:
    for template in (CHATML, LLAMA3_STYLE):
        try:
            assert isinstance(render_chat_template(template, messages, bos_token="<s>"), str)  # type: ignore[arg-type]
        except ChatTemplateError:
            pass
