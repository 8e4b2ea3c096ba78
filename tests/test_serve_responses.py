"""``infer serve``'s Responses API, driven by the official openai client (``client.responses``).

Greedy output must be :meth:`infer.Model.chat`'s for the same conversation;
function calls run on the scripted batch engine of tests/test_serve.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from reference import load_tiny, tiny_model_dir
from test_serve import KEY, NAME, ScriptedBatch, running
from test_serve_structured import SCHEMA, thinking_dir  # noqa: F401  (a fixture)

import infer
from infer.serve import create_app

INSTRUCTIONS = "You are terse."
QUESTION = "Hello! How are you today?"


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_tiny("smollm2_like")


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    with running(create_app(model, model_name=NAME, api_key=KEY)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def test_greedy_responses_equal_model_chat_streamed_and_not(client: openai.OpenAI, reference: Any) -> None:
    want = reference.chat([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                          max_tokens=16, temperature=0)
    reply = client.responses.create(model=NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16,
                                    temperature=0)
    assert reply.output_text == str(want) and reply.status in ("completed", "incomplete")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.usage.output_tokens <= 16 and reply.usage.input_tokens > 0
    items = [{"role": "system", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    assert client.responses.create(model=NAME, input=items, max_output_tokens=16, temperature=0).output_text == \
        str(want)
    events = list(client.responses.create(model=NAME, input=QUESTION, instructions=INSTRUCTIONS,
                                          max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == str(want)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == str(want)
    with client.responses.stream(model=NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16,
                                 temperature=0) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == str(want)


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=1, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 1
    # Nothing said (max_output_tokens 0): an empty message still, streamed as any other.
    events = list(client.responses.create(model=NAME, input=QUESTION, max_output_tokens=0, temperature=0, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.status == "incomplete" and [(item.type, item.content[0].text) for item in final.output] == [
        ("message", "")]


def test_text_format_json_schema_validates_at_temperature_1(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    for stream in (False, True):
        if stream:
            events = list(client.responses.create(model=NAME, input=QUESTION, text={"format": fmt}, temperature=1.0,
                                                  max_output_tokens=150, stream=True))
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        else:
            text = client.responses.create(model=NAME, input=QUESTION, text={"format": fmt}, temperature=1.0,
                                           max_output_tokens=150).output_text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_unsupported_things_are_400s_naming_them(client: openai.OpenAI) -> None:
    cases = [
        (dict(previous_response_id="resp_1"), "previous_response_id"),
        (dict(store=True), "store"),
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
         "input[0].content[0]"),
        (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
        (dict(temperature=7), "temperature"),
    ]
    for kwargs, param in cases:
        args = {"model": NAME, "input": QUESTION, "max_output_tokens": 2, **kwargs}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**args)
        assert info.value.body["param"] == param, (kwargs, info.value.body)


def test_function_calls_and_their_outputs() -> None:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    batch = ScriptedBatch(model, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    tools = [{"type": "function", "name": "get_weather", "description": "The weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with running(create_app(model, model_name=NAME, batch_engine=batch)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        reply = client.responses.create(model=NAME, input=QUESTION, tools=tools)
        (call,) = [item for item in reply.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        events = list(client.responses.create(model=NAME, input=QUESTION, tools=tools, stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert [(d.name, json.loads(d.arguments)) for d in done] == [("get_weather", {"city": "Paris"})]
        follow = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
        assert client.responses.create(model=NAME, input=follow, tools=tools).output


def test_reasoning_is_a_reasoning_item(thinking_dir: Any) -> None:  # noqa: F811
    model = infer.load(thinking_dir, backend="numpy")
    want = model.chat([{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0)
    with running(create_app(infer.load(thinking_dir, backend="numpy"), model_name=NAME)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        reply = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=12, temperature=0)
        assert reply.output[0].type == "reasoning"
        assert reply.output[0].content[0].text == want.reasoning_content
        events = list(client.responses.create(model=NAME, input=QUESTION, max_output_tokens=12, temperature=0,
                                              stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want.reasoning_content


def test_llama_cpp_samplers_are_extra_fields_checked_by_name(client: openai.OpenAI) -> None:
    # (the Responses API has no seed: sampled replies differ, so this checks they are taken and bounded)
    extra = dict(top_k=40, dry_multiplier=0.8, xtc_probability=0.5, top_n_sigma=1.5, mirostat=1)
    reply = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=6, temperature=0.9, extra_body=extra)
    assert reply.usage.output_tokens <= 6
    for field, value in (("dry_base", -1), ("xtc_probability", 2), ("samplers", ["nope"])):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=NAME, input=QUESTION, max_output_tokens=4, extra_body={field: value})
        assert info.value.body["param"] == field, info.value.body
