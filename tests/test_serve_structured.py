"""``infer serve``'s structured outputs, forced tool calls and reasoning, through the official openai client.

The tiny random model writes nonsense, but under a constraint its nonsense
has the schema's shape, at temperature 1 too; a copy of it with a Qwen3-like
template (``<think>`` opened by the generation prompt, closed at once with
``enable_thinking: false``) is a reasoning model for the server's purposes.
What the server answers is compared with :meth:`infer.Model.chat` on a
separate instance of the same model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from reference import load_tiny, tiny_model_dir
from test_serve import MESSAGES, NAME, merged_tool_calls, running

import infer
from infer.serve import create_app

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}},
]

#: A Qwen3-like template: the generation prompt opens <think>, or writes an empty one without thinking.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_tiny("smollm2_like")


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    with running(create_app(model, model_name=NAME)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir("smollm2_like"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def thinker(thinking_dir: Path) -> Iterator[tuple[openai.OpenAI, Any]]:
    with running(create_app(infer.load(thinking_dir, backend="numpy"), model_name=NAME)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0), infer.load(thinking_dir,
                                                                                               backend="numpy")


# -- structured outputs ------------------------------------------------------------------------


def test_json_schema_outputs_validate_at_temperature_1_streamed_and_not(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         temperature=1.0, seed=3, n=3, max_tokens=120)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                            temperature=1.0, seed=4, max_tokens=120, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), SCHEMA)
    whole = client.completions.create(model=NAME, prompt="A person:", temperature=1.0, seed=5, max_tokens=120,
                                      extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(whole.choices[0].text), SCHEMA)
    anything = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                              temperature=1.0, seed=6, max_tokens=200,
                                              extra_body={"top_k": 20})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_greedy_json_schema_output_equals_model_chat(client: openai.OpenAI, reference: Any) -> None:
    want = reference.chat(MESSAGES, json_schema=SCHEMA, max_tokens=120, temperature=0)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         temperature=0, max_tokens=120)
    assert out.choices[0].message.content == want


def test_an_invalid_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, response_format=bad)
    assert info.value.body["param"] == "response_format"
    assert "no-such-type" in info.value.body["message"] or "type" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert info.value.body["param"] == "response_format" and "schema" in info.value.body["message"]


# -- forced tool calls ------------------------------------------------------------------------


def test_tool_choice_required_and_named_are_enforced(client: openai.OpenAI) -> None:
    for seed in range(2):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             temperature=1.0, seed=seed, max_tokens=300)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                         temperature=1.0, seed=1, max_tokens=300)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_time"]
    stream = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                                 temperature=1.0, seed=1, max_tokens=300, stream=True))
    assert [name for name, _ in merged_tool_calls(stream)] == ["get_time"]
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice" and "nope" in info.value.body["message"]


# -- reasoning ---------------------------------------------------------------------------------


def test_thinking_goes_to_reasoning_content_as_model_chat_splits_it(thinker: tuple[openai.OpenAI, Any]) -> None:
    client, model = thinker
    want = model.chat(MESSAGES, max_tokens=24, temperature=0)
    assert want.reasoning_content  # the template opened the thinking, and 24 tokens do not close it
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    message = out.choices[0].message
    assert message.reasoning_content == want.reasoning_content and message.content == str(want)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want.reasoning_content
    assert "".join(d.content or "" for d in deltas) == str(want)


def test_thinking_off_and_a_budget(thinker: tuple[openai.OpenAI, Any]) -> None:
    client, model = thinker
    off = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.choices[0].message.content == str(model.chat(MESSAGES, max_tokens=8, temperature=0,
                                                            enable_thinking=False))
    # The budget forces "</think>" after 6 tokens; the schema applies to the answer after it.
    budget = 6
    forced = len(model.tokenizer.encode("</think>", add_special_tokens=False))
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=2,
                                         response_format=RESPONSE_FORMAT, logprobs=True,
                                         extra_body={"thinking_budget": budget})
    message = out.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    tokens = [t.token for t in out.choices[0].logprobs.content]
    assert "".join(tokens[budget:budget + forced]) == "</think>", tokens  # forced right after the budget
    assert "".join(tokens[:budget]).strip() == message.reasoning_content
    local = model.chat(MESSAGES, max_tokens=200, temperature=0, thinking_budget=budget, json_schema=SCHEMA)
    served = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                            response_format=RESPONSE_FORMAT, extra_body={"thinking_budget": budget})
    assert served.choices[0].message.content == str(local)
    assert served.choices[0].message.reasoning_content == local.reasoning_content


# -- every tool-call format through the server ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3",
                                 "harmony"])
def test_each_tool_call_format_reaches_the_client_streamed_and_not(fmt: str) -> None:
    """A scripted model writes the format's fixture (tests/test_reply_parsers.py); with
    --tool-parser FMT the client gets the same calls and content, streamed or not."""
    from test_reply_parsers import TOOL_FIXTURES
    from test_serve import ScriptedBatch

    text, content, calls = TOOL_FIXTURES[fmt]
    if fmt == "deepseek_v3":  # its markers are dozens of byte tokens each here: one call fits the tiny context
        text, calls = text[:text.index("<｜tool▁call▁end｜>")] + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", calls[:1]
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    with running(create_app(model, model_name=NAME, batch_engine=ScriptedBatch(model, text), tool_parser=fmt)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=400)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
        assert (message.content or "") == content
        chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=400,
                                                     stream=True))
        assert merged_tool_calls(chunks) == calls
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
        ids = [t.id for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or []) if t.id]
        assert len(ids) == len(set(ids)) == len(calls)
