"""Reasoning parsers and tool-call formats: fixtures of each, and the streaming property.

Every parser reads a whole reply (``parse``) and a streamed one (pieces fed
one by one); the property tested is that, for every way of cutting a reply
into pieces — inside markers included — the streamed deltas join into
exactly what the whole reply parses to, and nothing but the parser's types
ever comes out (never an exception).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.chat import ReplyParser
from infer.errors import SamplingParameterError
from infer.reasoning import ReasoningStream, get_reasoning_parser, reasoning_parser_for
from infer.tool_parsers import ToolCallStream, get_tool_parser, tool_parser_for, tool_parsers

#: format -> (a reply as the family writes it, its content, its calls as (name, arguments)).
TOOL_FIXTURES: dict[str, tuple[str, str, list[tuple[str, Any]]]] = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
               "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": 1}}',
                    "", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": 1}}]',
                "", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "qwen3_coder": ("Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call><tool_call>\n<function=get_time>\n<parameter=zone>\n1\n</parameter>\n</function>\n"
                    "</tool_call>",
                    "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "pythonic": ('[get_weather(city="Paris"), get_time(zone=1)]',
                 "", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                    '```json\n{"zone": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]),
    "harmony": ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}<|call|>', "", [("get_weather", {"city": "Paris"})]),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}}}}]


def calls_of(parsed_calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


def streamed(parser: Any, pieces: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    stream = ToolCallStream(parser)
    content, calls = [], []
    for piece in pieces:
        said, new = stream.feed(piece)
        content.append(said)
        calls.extend(new)
    said, new = stream.finish()
    content.append(said)
    calls.extend(new)
    assert [i for i, _, _ in calls] == list(range(len(calls)))  # indexes in order, each once
    assert len({cid for _, cid, _ in calls}) == len(calls)
    return "".join(content), calls_of([c for _, _, c in calls])


@pytest.mark.parametrize("fmt", sorted(TOOL_FIXTURES))
def test_each_format_reads_its_fixture_whole_and_at_every_split(fmt: str) -> None:
    text, content, calls = TOOL_FIXTURES[fmt]
    parser = get_tool_parser(fmt, TOOLS)
    parsed = parser.parse(text)
    assert parsed.content == content and calls_of(parsed.calls) == calls
    for cut in range(len(text) + 1):  # every split point, inside markers too
        assert streamed(parser, [text[:cut], text[cut:]]) == (content, calls), cut
    assert streamed(parser, list(text)) == (content, calls)  # a character at a time


def test_whitespace_around_calls_goes_and_text_on_both_sides_stays_apart() -> None:
    hermes = get_tool_parser("hermes", TOOLS)
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    for text, content in ((f"A \n{call}\n\n B", "A\nB"), (f"\n{call} \n{call}\n", ""), (f"A{call}", "A"),
                          (f"{call}B", "B"), ("no call \n", "no call \n")):
        assert hermes.parse(text).content == content, text
        for cut in range(len(text) + 1):
            assert streamed(hermes, [text[:cut], text[cut:]])[0] == content, (text, cut)


def test_every_registered_format_has_a_fixture() -> None:
    assert sorted(TOOL_FIXTURES) == tool_parsers()


#: format -> a change to its fixture that makes its first call unreadable.
BREAKS = {"hermes": ('"Paris"}', '"Paris"'), "llama3_json": ('"Paris"}', '"Paris"'), "mistral": ('"Paris"}', '"Paris"'),
          "qwen3_coder": ("<function=get_weather>", "<function get_weather>"), "pythonic": ('"Paris"', "Paris()"),
          "deepseek_v3": ('"Paris"}', '"Paris"'), "harmony": ('"Paris"}', '"Paris"')}


@pytest.mark.parametrize("fmt", sorted(TOOL_FIXTURES))
def test_a_broken_call_is_never_a_made_up_call(fmt: str) -> None:
    text, _, calls = TOOL_FIXTURES[fmt]
    broken = text.replace(*BREAKS[fmt])
    assert broken != text
    parsed = get_tool_parser(fmt, TOOLS).parse(broken)
    assert ("get_weather", {"city": "Paris"}) not in calls_of(parsed.calls)
    assert "Paris" in parsed.content or fmt == "qwen3_coder"  # what did not read as a call stays text


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(TOOL_FIXTURES)), data=st.data())
def test_streamed_deltas_join_into_the_whole_parse(fmt: str, data: st.DataObject) -> None:
    """Fixture pieces, garbage and partial markers shuffled into a reply, cut anywhere."""
    text, _, _ = TOOL_FIXTURES[fmt]
    parser = get_tool_parser(fmt, TOOLS)
    noise = st.sampled_from([text, text[: len(text) // 2], "hello ", "\n", "<", "<tool", "[", "{", "}", "<|", "]"] +
                            list(parser.markers))
    reply = "".join(data.draw(st.lists(st.one_of(noise, st.text(max_size=8)), max_size=6)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=8)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    whole = parser.parse(reply)
    assert streamed(parser, pieces) == (whole.content, calls_of(whole.calls))


#: Tools whose required arguments are bounded, so a forced call is short.
BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tiny() -> Any:
    pytest.importorskip("llguidance")
    from reference import load_tiny

    return load_tiny("smollm2_like")


@pytest.mark.parametrize("fmt", sorted(set(TOOL_FIXTURES) - {"harmony"}))
def test_a_forced_calls_grammar_writes_what_its_parser_reads(fmt: str, tiny: Any) -> None:
    """Sampled at temperature 1 under the format's grammar, the reply is calls that
    validate against their tools' schemas."""
    import jsonschema

    parser = get_tool_parser(fmt, BOUNDED)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    # DeepSeek's markers are dozens of byte tokens each in the tiny vocabulary: two calls outgrow its context.
    for seed, most in ((0, 1 if fmt == "deepseek_v3" else 2), (1, 1)):
        out = tiny.complete("Call:", grammar=parser.grammar(BOUNDED, most), max_tokens=240, temperature=1.0,
                            seed=seed)
        assert out.valid, (fmt, out.text)
        parsed = parser.parse(out.text)
        assert parsed.calls and not parsed.content.strip(), (fmt, out.text)
        assert 1 <= len(parsed.calls) <= most
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_harmony_refuses_a_forced_call_by_name() -> None:
    with pytest.raises(SamplingParameterError, match="harmony"):
        get_tool_parser("harmony", BOUNDED).grammar(BOUNDED)


def test_formats_are_chosen_from_the_template_and_unknown_names_are_typed_errors() -> None:
    assert tool_parser_for("qwen2", "{{ '<tool_call>' }}") == "hermes"
    assert tool_parser_for("qwen3", "<tool_call><function=x>") == "qwen3_coder"
    assert tool_parser_for("mistral", "[TOOL_CALLS]") == "mistral"
    assert tool_parser_for("llama", "<|python_tag|>") == "llama3_json"
    assert tool_parser_for("deepseek_v3", "<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert tool_parser_for("gpt_oss", None) == "harmony"
    with pytest.raises(SamplingParameterError, match="hermes"):
        get_tool_parser("nope")


# -- reasoning -------------------------------------------------------------------------------------

#: parser -> (reply, the prompt opened the reasoning, reasoning, content).
REASONING_FIXTURES = [
    ("think", "\nLet me think.\nOK.\n</think>\n\nThe answer is 4.", True, "Let me think.\nOK.", "The answer is 4."),
    ("think", "<think>hmm</think>Four.", False, "hmm", "Four."),
    ("think", "No thinking here.", False, "", "No thinking here."),
    ("think", "Cut short by max_tokens", True, "Cut short by max_tokens", ""),
    ("granite", "Here is my thought process: two and two. Here is my response: Four.", False,
     "two and two.", "Four."),
    ("harmony", "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Four.<|return|>", False, "Two and two.", "Four."),
]


def reasoned(parser: Any, in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser, in_reasoning)
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("name,text,opened,reasoning,content", REASONING_FIXTURES)
def test_reasoning_parsers_split_their_fixtures(name: str, text: str, opened: bool, reasoning: str,
                                                content: str) -> None:
    parser = get_reasoning_parser(name)
    split = parser.parse(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert reasoned(parser, opened, [text[:cut], text[cut:]]) == (reasoning, content), cut


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(REASONING_FIXTURES), opened=st.booleans(), data=st.data())
def test_streamed_reasoning_joins_into_the_whole_split(case: tuple[Any, ...], opened: bool,
                                                       data: st.DataObject) -> None:
    name, text = case[0], case[1]
    parser = get_reasoning_parser(name)
    words = st.sampled_from([text, " ", "<think>", "</think>", "</th", "<|end|>", "<|channel|>", "x"] +
                            list(parser.starts) + list(parser.ends))
    reply = "".join(data.draw(st.lists(st.one_of(words, st.text(max_size=5)), max_size=5)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    whole = parser.parse(reply, opened)
    assert reasoned(parser, opened, pieces) == (whole.reasoning, whole.content)


def test_reasoning_then_tool_calls_in_one_reply() -> None:
    """gpt-oss: the analysis is reasoning, the commentary message to a function a call."""
    text = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    for cut in range(0, len(text) + 1, 7):
        reader = ReplyParser(get_reasoning_parser("harmony"), False, get_tool_parser("harmony", TOOLS))
        reader.feed(text[:cut])
        reader.feed(text[cut:])
        reader.finish()
        assert reader.reasoning == "Need the weather." and reader.content == ""
        assert calls_of([c for _, _, c in reader.calls]) == [("get_weather", {"city": "Paris"})]


def test_reasoning_parsers_are_chosen_from_the_template() -> None:
    assert reasoning_parser_for("qwen3", "{{ '<think>' }}").name == "think"
    assert reasoning_parser_for("gpt_oss", "").name == "harmony"
    assert reasoning_parser_for("granite", "Here is my thought process:").name == "granite"
    assert reasoning_parser_for("llama", "<|im_start|>") is None
    with pytest.raises(SamplingParameterError, match="think"):
        get_reasoning_parser("nope")
