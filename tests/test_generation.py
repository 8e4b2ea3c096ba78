"""Text generation behaviour a user relies on: stopping, streaming, seeds, chat."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

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


# -- long prompts in chunks (Engine.prefill_chunk) and freeing a finished generation -------------------


@pytest.mark.parametrize("variant", ["smollm2_like", "qwen3_5"])
def test_a_long_prompt_is_prefilled_in_chunks_with_the_whole_prompts_tokens(variant: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A forward's activations grow with its tokens, so generate feeds a prompt in chunks of at most
    # engine.prefill_chunk tokens, each attending to the cache the ones before it wrote (and, for a
    # hybrid, carrying its recurrent state on): the same tokens as one forward over the whole prompt.
    model = infer.load(tiny_model_dir(variant), backend="numpy", dtype="float32")
    prompt = [(7 * i + 3) % 90 + 5 for i in range(23)]
    model.engine.prefill_chunk = None
    whole = list(model.generate_tokens(prompt, max_tokens=6, ignore_eos=True))
    sizes: list[int] = []
    run = model.engine.run

    def counted(batch):  # type: ignore[no-untyped-def]
        sizes.append(len(batch.ids))
        return run(batch)

    monkeypatch.setattr(model.engine, "run", counted)
    model.engine.prefill_chunk = 5
    chunked = list(model.generate_tokens(prompt, max_tokens=6, ignore_eos=True))
    assert chunked == whole
    assert sizes[:5] == [5, 5, 5, 5, 3]  # then the decode steps (captured: not through run)
    for bad in (0, 2.5):
        model.engine.prefill_chunk = bad  # type: ignore[assignment]
        with pytest.raises(GenerationError, match=f"prefill_chunk must be a whole number of tokens, at least 1 .*{bad}"):
            list(model.generate_tokens(prompt, max_tokens=2))


@pytest.mark.parametrize("variant,backend,compile", [("smollm2_like", "numpy", True), ("smollm2_like", "numpy", False),
                                                     ("qwen3_5", "numpy", True), ("smollm2_like", "torch:cpu", True)])
def test_a_finished_generation_frees_its_cache_at_once(variant: str, backend: str, compile: bool) -> None:
    # Without a reference cycle: a server's or a benchmark's next request must not run beside the
    # last one's keys and values (a 4,096-token sequence's, on a 1B model, are 134 MB in float16)
    # until Python's cycle collector happens to run.
    if backend != "numpy":
        pytest.importorskip("torch")
    model = infer.load(tiny_model_dir(variant), backend=backend, dtype="float32", compile=compile)

    def held(seq):  # type: ignore[no-untyped-def]  # each finished sequence's cache and its layers' arrays
        layers = seq.cache.storage_layers(model.network.num_layers)
        return [a for layer in layers for a in (seq.cache, *seq.cache.stored(layer))]

    with _releases_without_collector(model, held) as released:
        list(model.generate_tokens([5, 6, 7, 8, 9], max_tokens=4, ignore_eos=True))
        model.generate("hello", max_tokens=3, temperature=0.8, seed=1)
        assert len(released) > 2 and all(ref() is None for ref in released)


@contextlib.contextmanager
def _releases_without_collector(model: infer.Model, held: Callable[[Any], list[object]]) -> Iterator[list[Any]]:
    """Weak references to ``held(seq)`` of each sequence ``model``'s engine
    releases from here on (its decode step recorded first), with Python's
    cycle collector off inside."""
    released: list[weakref.ref[object]] = []
    release = model.engine.release

    def spied(seq):  # type: ignore[no-untyped-def]
        released.extend(weakref.ref(a) for a in held(seq))
        return release(seq)

    model.engine.release = spied  # type: ignore[method-assign]
    list(model.generate_tokens([5, 6, 7, 8], max_tokens=4, ignore_eos=True))  # records the captured step
    gc.collect()
    released.clear()
    gc.disable()
    try:
        yield released
    finally:
        gc.enable()


def test_a_generation_dropped_part_way_ends_at_once() -> None:
    # A consumer that stops reading (a stream broken off, a client gone) must not leave the
    # request holding its keys and values until Python's cycle collector happens to run: the
    # token iterator holds its Generation weakly. Measured before: each abandoned request of
    # SmolLM2-135M kept its 11.8 MB cache, and the benchmark's warm-up request sat beside the
    # timed one (peak RSS 1.12x llama.cpp's instead of 1.0x).
    model = infer.load(tiny_model_dir("smollm2_like"), backend="numpy", dtype="float32")
    with _releases_without_collector(model, lambda seq: [seq.cache]) as released:
        gen = model.generate_tokens([5, 6, 7, 8], max_tokens=8, ignore_eos=True)
        for _ in gen:
            break
        assert released == []  # still held: its owner may read on
        assert len(list(gen)) == 7 and len(gen.tokens) == 8  # and reading on continues the same request
        assert len(released) == 1

        gen = model.generate_tokens([5, 6, 7, 8], max_tokens=8, ignore_eos=True)
        next(iter(gen))
        del gen  # dropped part way
        assert len(released) == 2 and released[-1]() is None

        for _ in model.generate("hello", max_tokens=8, ignore_eos=True, stream=True):
            break  # a stream broken off: the loop's iterator is dropped with it
        assert len(released) == 3 and released[-1]() is None

        gen = model.generate_tokens([5, 6, 7, 8], max_tokens=8, ignore_eos=True)
        first = next(iter(gen))
        gen.close()
        assert len(released) == 4 and list(gen) == [] and gen.tokens == [first]
