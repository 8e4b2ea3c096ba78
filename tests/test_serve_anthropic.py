"""``infer serve``'s Anthropic Messages API, driven by the official ``anthropic`` client.

The tiny model's greedy reply through ``/v1/messages`` must be
:meth:`infer.Model.chat`'s for the same conversation; tool use runs on the
scripted batch engine of tests/test_serve.py (a model that writes a Hermes
call), reasoning on the thinking copy of tests/test_serve_structured.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from reference import load_tiny, tiny_model_dir
from test_serve import KEY, NAME, ScriptedBatch, running
from test_serve_structured import THINKING_TEMPLATE, thinking_dir  # noqa: F401  (a fixture)

import infer
from infer.serve import create_app

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]
SYSTEM = "You are terse."
#: The anthropic client has no temperature argument any more; the server takes one (older clients send it).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_tiny("smollm2_like")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(infer.load(tiny_model_dir("smollm2_like"), backend="numpy"), model_name=NAME,
                            api_key=KEY)) as base:
        yield base


@pytest.fixture
def client(url: str) -> Any:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def test_greedy_messages_equal_model_chat_streamed_and_not(client: Any, reference: Any) -> None:
    want = reference.chat([{"role": "system", "content": SYSTEM}, *MESSAGES], max_tokens=16, temperature=0)
    reply = client.messages.create(model=NAME, system=SYSTEM, messages=MESSAGES, max_tokens=16, extra_body=GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == str(want)
    assert reply.role == "assistant" and reply.type == "message" and reply.model == NAME
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens <= 16
    count = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=MESSAGES)
    assert reply.usage.input_tokens == count.input_tokens > 0
    with client.messages.stream(model=NAME, system=SYSTEM, messages=MESSAGES, max_tokens=16,
                                extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == str(want) and final.content[0].text == text
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == reply.usage.output_tokens
    # The raw event sequence, as the client reads it.
    kinds = [e.type for e in client.messages.create(model=NAME, messages=MESSAGES, max_tokens=4, extra_body=GREEDY,
                                                    stream=True)]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # max_tokens 0: Anthropic's API requires at least 1, so it is a 400 with an error body, streamed or not.
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=NAME, messages=MESSAGES, max_tokens=0, extra_body=GREEDY, stream=stream)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in info.value.body["error"]["message"]


def test_llama_cpp_samplers_are_extra_fields_checked_by_name(client: Any) -> None:
    # (the Messages API has no seed: sampled replies differ, so this checks they are taken and bounded)
    extra = dict(top_k=40, dry_multiplier=0.8, xtc_probability=0.5, typical_p=0.9, mirostat=2,
                 samplers=["penalties", "dry", "top_k", "temperature"])
    reply = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=6, extra_body={"temperature": 0.9, **extra})
    assert reply.usage.output_tokens <= 6
    for field, value in (("dry_base", -1), ("xtc_probability", 2), ("samplers", ["top_k", "nope"])):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=NAME, messages=MESSAGES, max_tokens=4, extra_body={field: value})
        assert info.value.body["error"]["message"].startswith(field), info.value.body


def test_models_are_listed_in_anthropics_shape(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).type == "model"


def test_stop_sequences_and_stop_reason(client: Any, reference: Any) -> None:
    full = str(reference.chat(MESSAGES, max_tokens=24, temperature=0))
    assert len(full) >= 6
    stop = full[len(full) // 2:len(full) // 2 + 3]
    reply = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=24, extra_body=GREEDY,
                                   stop_sequences=["never in it \u2603", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[:full.find(stop)]
    short = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=1, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


def test_errors_have_anthropics_shape_and_the_key_goes_in_x_api_key(url: str, client: Any) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, messages=MESSAGES, max_tokens=4)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", messages=MESSAGES, max_tokens=4)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}],
            max_tokens=4)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in info.value.body["error"]["message"]
    missing = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY},
                         json={"model": NAME, "messages": MESSAGES})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    bad = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, content=b"{nope")
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_tool_use_and_tool_result_round_trip() -> None:
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    batch = ScriptedBatch(model, "Checking. " + call)
    tools = [{"name": "get_weather", "description": "The weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with running(create_app(model, model_name=NAME, batch_engine=batch)) as base:
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        reply = client.messages.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=200)
        assert reply.stop_reason == "tool_use"
        assert [b.type for b in reply.content] == ["text", "tool_use"]
        assert reply.content[0].text == "Checking."
        use = reply.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
        with client.messages.stream(model=NAME, messages=MESSAGES, tools=tools, max_tokens=200) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather",
                                                                                      {"city": "Paris"})]
        follow = [*MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        assert client.messages.create(model=NAME, messages=follow, tools=tools, max_tokens=8).content


def test_thinking_blocks_and_budget(thinking_dir: Any) -> None:  # noqa: F811
    model = infer.load(thinking_dir, backend="numpy")
    want = model.chat(MESSAGES, max_tokens=12, temperature=0)
    with running(create_app(infer.load(thinking_dir, backend="numpy"), model_name=NAME)) as base:
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        reply = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=12, extra_body=GREEDY)
        assert reply.content[0].type == "thinking" and reply.content[0].thinking == want.reasoning_content
        with client.messages.stream(model=NAME, messages=MESSAGES, max_tokens=12, extra_body=GREEDY) as s:
            final = s.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking == want.reasoning_content
        off = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=6, extra_body=GREEDY,
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
        budget = client.messages.create(model=NAME, messages=MESSAGES, max_tokens=40, extra_body=GREEDY,
                                        thinking={"type": "enabled", "budget_tokens": 3})
        local = model.chat(MESSAGES, max_tokens=40, temperature=0, thinking_budget=3)
        assert budget.content[0].thinking == local.reasoning_content
        assert json.dumps([b.model_dump() for b in budget.content])
