"""Constrained decoding: json_schema=, regex=, grammar= always give output that matches.

The property tests draw JSON schemas (objects, arrays, enums, bounded integers
and numbers, nested) and regexes with hypothesis, and generate with the real
SmolLM2-135M at temperature 0 and 1, all requests of an example in one batch of
the batch engine, each with its own matcher; every output must parse and
validate (``jsonschema``) or match (``re.fullmatch``). By default two examples
of one constraint each (the simplest, then one random draw), from a fixed seed:
bounded and repeatable. ``INFER_TEST_STRUCTURED_EXAMPLES=N`` (N > 2) runs N
examples of four constraints each (N=3 took 2.5 minutes on a loaded 2-core
machine).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from reference import smollm2_hf_dir, tiny_model_dir

import infer
from infer.engine.generate import StopConditions
from infer.engine.sampling import Sampler
from infer.errors import IncompleteOutputError, StructuredOutputError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny() -> infer.Model:
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


# -- the API on the tiny model -------------------------------------------------------------


def test_generate_complete_and_chat_follow_a_json_schema(tiny: infer.Model) -> None:
    text = tiny.generate("A person:", json_schema=SCHEMA, max_tokens=80)
    jsonschema.validate(json.loads(text), SCHEMA)
    c = tiny.complete("A person:", json_schema=SCHEMA, max_tokens=80, temperature=1.0, seed=5, logprobs=1)
    assert c.valid is True and c.finish_reason == "eos"
    jsonschema.validate(json.loads(c.text), SCHEMA)
    reply = tiny.chat([{"role": "user", "content": "A person?"}], json_schema=json.dumps(SCHEMA), max_tokens=80)
    jsonschema.validate(json.loads(reply), SCHEMA)
    streamed = "".join(tiny.generate("A person:", json_schema=SCHEMA, max_tokens=80, stream=True))
    assert streamed == text


def test_regex_and_grammar(tiny: infer.Model) -> None:
    pattern = r"(red|green|blue) [0-9]{2}"
    for draw in range(3):
        assert re.fullmatch(pattern, tiny.generate("Color:", regex=pattern, temperature=1.0, seed=draw, max_tokens=40))
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'
    assert tiny.generate("Answer:", grammar=lark, max_tokens=10) in {"yes", "no"} | {f"maybe {d}" for d in range(10)}
    gbnf = 'root ::= "(" [a-c] [a-c]? ")"'  # llama.cpp's GBNF, converted
    assert re.fullmatch(r"\([a-c]{1,2}\)", tiny.generate("Letters:", grammar=gbnf, max_tokens=20))


def test_a_list_of_prompts_gets_one_matcher_each(tiny: infer.Model) -> None:
    prompts = ["A person:", "Another:"]
    texts = tiny.generate(prompts, json_schema=SCHEMA, max_tokens=80, temperature=1.0, seed=2)
    alone = [tiny.generate(p, json_schema=SCHEMA, max_tokens=80, temperature=1.0, seed=2) for p in prompts]
    assert texts == alone
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_output_cut_short_says_so_and_is_never_passed_off_as_valid(tiny: infer.Model) -> None:
    schema = {"type": "string", "minLength": 40}
    c = tiny.complete("Long:", json_schema=schema, max_tokens=6)
    assert c.finish_reason == "length" and c.valid is False and c.text.startswith('"')
    with pytest.raises(IncompleteOutputError, match="max_tokens") as err:
        tiny.generate("Long:", json_schema=schema, max_tokens=6)
    assert err.value.text == c.text
    with pytest.raises(IncompleteOutputError):
        "".join(tiny.generate("Long:", json_schema=schema, max_tokens=6, stream=True))
    with pytest.raises(IncompleteOutputError, match="prompt 0"):
        tiny.generate(["Long:", "Longer:"], json_schema=schema, max_tokens=6)
    # Unconstrained requests have nothing to say.
    assert tiny.complete("Long:", max_tokens=3).valid is None


@pytest.mark.parametrize("kwargs, match", [
    ({"json_schema": {"type": "nope"}}, "invalid json_schema"),
    ({"json_schema": "{not json"}, "invalid json_schema"),
    ({"json_schema": ["a"]}, "a dict"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"grammar": "start: undefined_rule"}, "invalid grammar"),
    ({"regex": "a", "grammar": 'start: "a"'}, "one of"),
    ({"regex": "a+", "speculative": "ngram"}, "speculative"),
    ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
])
def test_a_bad_constraint_is_a_typed_error_before_any_token(tiny: infer.Model, monkeypatch: pytest.MonkeyPatch,
                                                             kwargs: dict[str, Any], match: str) -> None:
    def no_forward(*args: Any, **kw: Any) -> None:
        raise AssertionError("a forward ran")

    monkeypatch.setattr(tiny.engine, "run", no_forward)
    for call in (lambda: tiny.generate("Hi", max_tokens=4, **kwargs),
                 lambda: tiny.complete("Hi", max_tokens=4, **kwargs),
                 lambda: tiny.generate(["Hi", "Ho"], max_tokens=4, **kwargs)):
        with pytest.raises(StructuredOutputError, match=match):
            call()


@pytest.mark.parametrize("backend", [b.key for b in infer.list_backends() if b.available
                                     and b.key in ("torch/cpu", "mlx/cpu")])
def test_every_backend_masks_the_same_way(tiny: infer.Model, backend: str) -> None:
    other = infer.load(tiny_model_dir("smollm2_like"), backend=backend.replace("/", ":"))
    for kwargs in ({}, {"temperature": 1.0, "seed": 4}):
        want = tiny.generate("A person:", json_schema=SCHEMA, max_tokens=80, **kwargs)
        got = other.generate("A person:", json_schema=SCHEMA, max_tokens=80, **kwargs)
        jsonschema.validate(json.loads(got), SCHEMA)
        if not kwargs:  # greedy: the same masked argmax (a sampled draw may differ by rounding)
            assert got == want


# -- the property on the real 135M model ------------------------------------------------------

_names = st.sampled_from(["id", "name", "size", "tags", "kind", "items", "score", "ok"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    number = st.tuples(st.integers(-10, 10), st.integers(1, 100)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    string = st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.sampled_from(["a", "b", "red", "blue", "yes", "no"]), min_size=1, max_size=4,
                    unique=True).map(lambda v: {"enum": v})
    return st.one_of(integer, number, string, enum, st.just({"type": "boolean"}))


def _array(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 1), st.integers(1, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": max(t[1], t[2])})


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(_names, values, min_size=1, max_size=3)
    return st.tuples(props, st.booleans()).map(lambda t: {
        "type": "object", "properties": t[0], "additionalProperties": False,
        "required": sorted(t[0]) if t[1] else sorted(t[0])[:1]})


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Objects, arrays, enums, bounded numbers, nested two deep."""
    inner = st.one_of(_leaf(), _array(_leaf()), _object(_leaf()))
    return st.one_of(_object(inner), _array(_object(_leaf())))


def regexes() -> st.SearchStrategy[str]:
    """Bounded regexes (every repetition has a maximum), so an output always fits."""
    atom = st.one_of(st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "-", " ", "\\.", "(cat|dog|bird)"]),
                     st.text("abc", min_size=1, max_size=3))
    piece = st.tuples(atom, st.sampled_from(["", "?", "{2}", "{1,3}"])).map(lambda t: t[0] + t[1])
    return st.lists(piece, min_size=1, max_size=5).map("".join)


# A fixed seed and no shrinking: the first example is the simplest one, the next ones
# random draws, the same ones on every run.
_EXAMPLES = int(os.environ.get("INFER_TEST_STRUCTURED_EXAMPLES", "2"))
_PER_EXAMPLE = 1 if _EXAMPLES <= 2 else 4  # constraints per example (one batch): the default stays short
_BOUNDED = dict(max_examples=_EXAMPLES, phases=[Phase.generate], database=None, deadline=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def smollm2() -> infer.Model:
    return infer.load(smollm2_hf_dir(), backend="numpy")


def _run_batch(model: infer.Model, prompt: str, constraints: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Every constraint at temperature 0 and 1, all in one batch; (text, finish reason) each."""
    ids = model.tokenizer.encode(prompt)
    handles = []
    for i, constraint in enumerate(constraints):
        grammar = model.grammar(**constraint)
        for temperature in (0.0, 1.0):
            sampler = Sampler(model.sampling_params(temperature=temperature, seed=i), constraint=grammar.matcher())
            stop = StopConditions(max_tokens=160, eos_token_ids=model.eos_token_ids)
            handles.append(model.batch_engine.submit(ids, sampler, stop))
    model.batch_engine.run_until_done()
    return [(model.tokenizer.decode(h.tokens), h.finish_reason) for h in handles]


@pytest.mark.slow
@seed(19)
@settings(**_BOUNDED)
@given(st.lists(schemas(), min_size=_PER_EXAMPLE, max_size=_PER_EXAMPLE))
def test_every_sample_validates_against_its_schema(smollm2: infer.Model, drawn: list[dict[str, Any]]) -> None:
    outputs = _run_batch(smollm2, "Here is a JSON object:\n", [{"json_schema": s} for s in drawn])
    for k, (text, reason) in enumerate(outputs):
        schema = drawn[k // 2]
        assert reason == "stop", f"{schema}: ended by {reason} after {text!r}"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
@seed(19)
@settings(**_BOUNDED)
@given(st.lists(regexes(), min_size=_PER_EXAMPLE, max_size=_PER_EXAMPLE))
def test_every_sample_matches_its_regex(smollm2: infer.Model, drawn: list[str]) -> None:
    outputs = _run_batch(smollm2, "Some text: ", [{"regex": r} for r in drawn])
    for k, (text, reason) in enumerate(outputs):
        assert reason == "stop", f"{drawn[k // 2]!r}: ended by {reason} after {text!r}"
        assert re.fullmatch(drawn[k // 2], text), (drawn[k // 2], text)
