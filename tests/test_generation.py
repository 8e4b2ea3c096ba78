"""Text generation behaviour a user relies on: stopping, streaming, seeds, chat."""

from __future__ import annotations

import pytest
from reference import EOS_ID, tiny_model_dir

import infer
from infer.engine.generate import StopConditions, generate
from infer.errors import ChatTemplateError, ContextLengthError, GenerationError, SamplingParameterError

PROMPT = "The capital of France is Paris. Once upon a time"


@pytest.fixture(scope="module")
def model() -> infer.Model:
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


def test_generate_returns_the_decoded_new_tokens(model: infer.Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    tokens = list(model.generate_tokens(ids, max_tokens=12, ignore_eos=True))
    assert len(tokens) == 12
    assert model.generate(PROMPT, max_tokens=12, ignore_eos=True) == model.tokenizer.decode(tokens)


def test_stream_yields_the_same_text_in_pieces(model: infer.Model) -> None:
    chunks = list(model.generate(PROMPT, max_tokens=20, ignore_eos=True, stream=True))
    assert len(chunks) > 1
    assert "".join(chunks) == model.generate(PROMPT, max_tokens=20, ignore_eos=True)


def test_stop_string_ends_generation_and_is_not_included(model: infer.Model) -> None:
    full = model.generate(PROMPT, max_tokens=24, ignore_eos=True)
    # Pick a stop string from the middle of what greedy decoding produces.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = model.generate(PROMPT, max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut == full[: full.index(stop)]
    streamed = "".join(model.generate(PROMPT, max_tokens=24, ignore_eos=True, stop=stop, stream=True))
    assert streamed == cut


def test_eos_stops_unless_ignored(model: infer.Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    # Make EOS the greedy choice by asking for whatever token comes first: use a
    # model whose eos set is patched to the first greedy token.
    first = next(iter(model.generate_tokens(ids, max_tokens=1)))
    gen = generate(model.engine, ids, infer.SamplingParams(), _stop(max_tokens=10, eos={first}))
    assert list(gen) == [first] and gen.finish_reason == "stop"
    gen = generate(model.engine, ids, infer.SamplingParams(), _stop(max_tokens=10, eos={first}, ignore=True))
    assert len(list(gen)) == 10 and gen.finish_reason == "length"


def _stop(max_tokens: int, eos: set[int], ignore: bool = False):  # type: ignore[no-untyped-def]
    return StopConditions(max_tokens=max_tokens, eos_token_ids=frozenset(eos), ignore_eos=ignore)


def test_model_eos_comes_from_generation_config(model: infer.Model) -> None:
    assert EOS_ID in model.eos_token_ids


def test_seed_repeats_a_sampled_run(model: infer.Model) -> None:
    a = model.generate(PROMPT, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    b = model.generate(PROMPT, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    c = model.generate(PROMPT, max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    assert a == b
    assert a != c


def test_list_of_prompts_returns_a_list(model: infer.Model) -> None:
    out = model.generate([PROMPT, "Hello"], max_tokens=5, ignore_eos=True)
    assert out == [model.generate(PROMPT, max_tokens=5, ignore_eos=True),
                   model.generate("Hello", max_tokens=5, ignore_eos=True)]


def test_chat_renders_the_template_and_generates(model: infer.Model) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    text = model.tokenizer.apply_chat_template(messages)
    assert text.endswith("<|im_start|>assistant\n")
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    want = model.tokenizer.decode(list(model.generate_tokens(ids, max_tokens=8)))
    assert model.chat(messages, max_tokens=8) == want


def test_chat_template_exception_is_surfaced(model: infer.Model) -> None:
    bad = "{{ raise_exception('only user messages allowed') }}"
    with pytest.raises(ChatTemplateError, match="only user messages allowed"):
        model.chat([{"role": "user", "content": "hi"}], template=bad)


def test_generation_stops_at_the_context_length(model: infer.Model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    room = model.context_length - len(ids)
    gen = model.generate_tokens(ids, max_tokens=room + 50, ignore_eos=True)
    assert len(list(gen)) == room + 1  # the last prompt position predicts one more token
    assert gen.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.0),
     dict(repetition_penalty=0.0), dict(max_tokens=-1), dict(max_tokens=1.5), dict(seed=-3),
     dict(stop=3), dict(stop=[""]), dict(temperature="hot")],
)
def test_invalid_sampling_parameters_raise_typed_errors(model: infer.Model, kwargs: dict) -> None:
    with pytest.raises(SamplingParameterError):
        model.generate(PROMPT, **kwargs)


def test_prompt_past_the_context_is_a_typed_error(model: infer.Model) -> None:
    ids = [5] * model.context_length
    with pytest.raises(ContextLengthError, match=f"{model.context_length} positions"):
        model.generate_tokens(ids)
    with pytest.raises(ContextLengthError):
        model.generate(PROMPT * 200)


@pytest.mark.parametrize("ids", [[], [-1], [10**6], [True], ["a"]])
def test_bad_token_ids_are_typed_errors(model: infer.Model, ids: list) -> None:
    with pytest.raises(GenerationError):
        model.generate_tokens(ids)


def test_prompt_must_be_text(model: infer.Model) -> None:
    with pytest.raises(GenerationError):
        model.generate(123)  # type: ignore[arg-type]
