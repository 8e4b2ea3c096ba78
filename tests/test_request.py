"""One request object: ``GenerationRequest`` checks its options once, and every entry point runs through it.

``Model.generate`` / ``complete`` / ``chat`` with keyword arguments and with
``request=`` give the same tokens; ``Model.prepare`` fills in the model's
defaults in one place; a bad option is a typed error before any token.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from reference import load_tiny

from infer import ChatReply, GenerationRequest, Model, SamplingParams
from infer.errors import GenerationError, SamplingParameterError, StructuredOutputError
from infer.request import GenerateOptions, GenerationOptions, SamplingOptions

MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_tiny("smollm2_like")


@pytest.mark.parametrize("options,match", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(logit_bias={1: 500}), "logit_bias"),
    (dict(thinking_budget=-1), "thinking_budget"),
    (dict(reasoning_effort="extreme"), "reasoning_effort"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice="f", tools=[{"type": "function", "function": {"name": "g"}}]), "'f'"),
    (dict(tools="nope"), "tools"),
    (dict(enable_thinking="yes"), "enable_thinking"),
])
def test_bad_options_are_typed_errors_naming_the_option(options: dict[str, Any], match: str) -> None:
    with pytest.raises(SamplingParameterError, match=match):
        GenerationRequest(**options)


def test_two_constraints_and_unknown_options_are_refused(model: Any) -> None:
    with pytest.raises(StructuredOutputError):
        GenerationRequest(json_schema={"type": "object"}, regex="a+")
    # (mirostat was the unknown option here until llama.cpp's samplers came; tail-free sampling is not one)
    with pytest.raises(SamplingParameterError, match="tfs_z"):
        GenerationRequest.from_options(tfs_z=0.9)
    with pytest.raises(SamplingParameterError, match="tfs_z"):
        model.chat(MESSAGES, tfs_z=0.9)
    with pytest.raises(GenerationError, match="not both"):
        model.generate("Hi", request=GenerationRequest(max_tokens=2), temperature=1.0)
    with pytest.raises(GenerationError, match="stop"):
        model.generate_tokens([1, 2], stop="x")  # token ids cannot be cut by a stop string: refused, not ignored


def test_keywords_and_a_request_give_the_same_tokens(model: Any) -> None:
    kwargs = dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=3, stop=["zz"], presence_penalty=0.5)
    request = GenerationRequest.from_options(**kwargs)
    assert model.generate("Once", request=request) == model.generate("Once", **kwargs)
    assert model.complete("Once", request=request).token_ids == model.complete("Once", **kwargs).token_ids
    assert model.chat(MESSAGES, request=request) == model.chat(MESSAGES, **kwargs)
    assert list(model.generate_tokens([1, 5, 7], request=request.replace(stop=()))) == \
        list(model.generate_tokens([1, 5, 7], **{k: v for k, v in kwargs.items() if k != "stop"}))


def test_prepare_fills_in_the_models_defaults_once(model: Any) -> None:
    prepared = model.prepare(GenerationRequest())
    assert prepared.max_tokens == model.default_max_tokens
    assert prepared.params == model.sampling_params()
    assert prepared.sampler(2).params.seed is None
    seeded = model.prepare(GenerationRequest(seed=5, max_tokens=4))
    assert [seeded.sampler(i).params.seed for i in range(3)] == [5, 6, 7]  # choice i samples with seed + i
    assert seeded.stop_conditions().max_tokens == 4
    assert seeded.stop_conditions(model.context_length - 2).max_tokens == 2  # capped to the context left
    with pytest.raises(Exception, match="context"):
        seeded.stop_conditions(model.context_length)


def test_chat_returns_a_str_with_the_reasoning_and_calls_beside_it(model: Any) -> None:
    reply = model.chat(MESSAGES, max_tokens=6, temperature=0)
    assert isinstance(reply, ChatReply) and isinstance(reply, str)
    assert reply.reasoning_content is None and reply.tool_calls == []
    assert reply.finish_reason in ("eos", "length")
    assert "".join(model.chat(MESSAGES, max_tokens=6, temperature=0, stream=True)) == reply
    # A budget on a reply that never opens its reasoning changes nothing.
    budgeted = model.chat(MESSAGES, max_tokens=6, temperature=0, reasoning_parser="think", thinking_budget=2)
    assert budgeted == reply and budgeted.reasoning_content is None
    with pytest.raises(SamplingParameterError, match="thinking_budget"):
        model.chat(MESSAGES, thinking_budget=3)  # ChatML: no reasoning parser for this template


def test_markers_that_are_special_tokens_are_decoded(model: Any) -> None:
    """A reasoning format whose markers are special tokens of the model (here the tiny
    model's ChatML tokens stand in for them) is read from a reply decoded with them."""
    from infer.reasoning import (
        ReasoningParser,
        reasoning_parsers,
        register_reasoning_parser,
        unregister_reasoning_parser,
    )

    assert model.plan_chat(MESSAGES, GenerationRequest()).skip_special_tokens
    assert model.plan_chat(MESSAGES, GenerationRequest(reasoning_parser="think")).skip_special_tokens
    register_reasoning_parser(ReasoningParser("chatml-test", ("<|im_start|>",), ("<|im_end|>",)))
    try:
        plan = model.plan_chat(MESSAGES, GenerationRequest(reasoning_parser="chatml-test"))
        assert not plan.skip_special_tokens
        assert plan.in_reasoning is False
    finally:
        unregister_reasoning_parser("chatml-test")
    assert "chatml-test" not in reasoning_parsers()


def test_the_keyword_options_are_the_requests_fields() -> None:
    """The options are typed once (``infer.request``'s TypedDicts); a field
    added to GenerationRequest without its option, or the reverse, fails here."""
    fields = [f.name for f in dataclasses.fields(GenerationRequest)]
    assert sorted(GenerationOptions.__annotations__) == sorted(fields)
    assert set(SamplingOptions.__annotations__) < set(GenerateOptions.__annotations__) < set(fields)
    assert list(SamplingOptions.__annotations__) == [f.name for f in dataclasses.fields(SamplingParams)]
    # What is not an option of generate() is what only completions and chats take.
    assert set(fields) - set(GenerateOptions.__annotations__) == {
        "logprobs", "tools", "tool_choice", "parallel_tool_calls", "enable_thinking", "reasoning_effort",
        "thinking_budget", "reasoning_parser", "tool_parser"}


def test_generate_documents_its_options_and_refuses_others(model: Any) -> None:
    doc = inspect.getdoc(Model.generate) or ""
    table = Path(__file__).resolve().parents[1].joinpath("docs", "api.md").read_text(encoding="utf-8")
    for name in GenerateOptions.__annotations__:
        assert re.search(rf"\b{name}\b", doc), f"Model.generate's docstring does not document {name}"
        assert f"| `{name}` |" in table, f"docs/api.md's table of generate's arguments lacks {name}"
    # The options are not spelled out in the signature, so a stray keyword is Python's own error.
    with pytest.raises(TypeError, match="'logprobs'"):
        model.generate("Hi", logprobs=2)
    with pytest.raises(TypeError, match="'tfs_z'"):
        model.sampling_params(tfs_z=0.9)
    with pytest.raises(TypeError, match="'max_tokens'"):
        model.sampling_params(max_tokens=2)
