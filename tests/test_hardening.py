"""Regression tests for untrusted input (docs/security.md, issue 20): each found
case is reproduced here, and each must end in an InferError subclass that names
what is wrong, without running for long or allocating far beyond the input.

The property-based side (hypothesis and mutation over the same inputs) is
``test_fuzz_inputs.py``.
"""

from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import infer
from infer.architecture import WeightLoader
from infer.chat_template import render_chat_template
from infer.engine import Engine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import Sampler, SamplingParams
from infer.errors import (
    BackendOutputError,
    ChatTemplateError,
    ConfigError,
    FormatError,
    GenerationError,
    TokenizerError,
    UnsafeFormatError,
)
from infer.formats.gguf import open_gguf
from infer.plugins import get_registry
from infer.plugins.selection import select_backend
from infer.tokenizer import Tokenizer
from reference import tiny_model_dir
from test_format_gguf import write_model

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama3"), dst)
    return dst


@pytest.fixture(scope="module")
def model() -> infer.Model:
    return infer.load(tiny_model_dir("llama3"), backend="numpy")


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# -- 1. hyperparameters are checked before anything is sized from them --------------------

DYNAMIC = {"rope_type": "dynamic"}


@pytest.mark.parametrize("changes, match", [
    (dict(head_dim=0), r"'head_dim' = 0 is out of range; allowed: \[1, 8192\]"),
    (dict(num_key_value_heads=0), "'num_key_value_heads' = 0"),
    (dict(head_dim=10**9), "'head_dim' = 1000000000"),
    (dict(rope_parameters=DYNAMIC), "rope type 'dynamic' needs 'factor'"),
    (dict(rope_parameters={**DYNAMIC, "factor": 0}), "'rope factor' = 0"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 1e308}), "'rope factor' = 1e"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
     "'rope original_max_position_embeddings' = 0"),
    (dict(rope_parameters=None, rope_theta=10**400), "'rope_theta' = an integer of 1329 bits"),
    (dict(sliding_window=-1), "'sliding_window' = -1"),
    (dict(sliding_window=2**63), "'sliding_window' = an integer of 64 bits"),
    (dict(partial_rotary_factor="x"), "partial_rotary_factor' must be a number"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor' = 1.5 is out of range; allowed: \[1e-06, 1\]"),
    (dict(rms_norm_eps=10**400), "'rms_norm_eps' is too large for a float"),
    (dict(rope_parameters={"a": {}}), "need a number rope_theta"),  # found by test_fuzz_inputs
])
def test_out_of_range_hyperparameters_name_file_key_value_and_range(folder: Path, changes: dict,
                                                                   match: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match) as caught:
        infer.load(folder, backend="numpy")
    assert str(folder) in str(caught.value)  # the file


def test_a_null_partial_rotary_factor_means_the_default(folder: Path) -> None:
    edit_json(folder / "config.json", partial_rotary_factor=None)
    assert infer.load(folder, backend="numpy").generate("Hi", max_tokens=2, ignore_eos=True)


@pytest.mark.parametrize("dims", [2**31 - 1, 128])
def test_gguf_rope_dimensions_beyond_head_dim_are_refused_before_a_table_is_built(tmp_path: Path,
                                                                                  dims: int) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, extra={"llama.rope.dimension_count": ("uint32", dims)})  # head_dim is 64
    package = open_gguf(path, tokenizer=False)
    ops = select_backend("numpy")
    arch = get_registry().architecture_for(package.model_type)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        arch.build(package.config, WeightLoader(package.tensors, ops), ops)


# -- 2. JSON: the int digit limit and deep nesting ------------------------------------------

HUGE_INT = "1" * 5000
DEEP = "[" * 100_000


@pytest.mark.parametrize("text", [f'{{"vocab_size": {HUGE_INT}}}', DEEP])
def test_unreadable_config_json_is_a_config_error(folder: Path, text: str) -> None:
    (folder / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="config.json"):
        infer.load(folder, backend="numpy")


@pytest.mark.parametrize("text", [f'{{"model_max_length": {HUGE_INT}}}', DEEP])
def test_unreadable_tokenizer_config_is_a_tokenizer_error(folder: Path, text: str) -> None:
    (folder / "tokenizer_config.json").write_text(text)
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_a_huge_integer_in_a_safetensors_header_is_a_format_error(folder: Path) -> None:
    text = f'{{"w": {{"dtype": "F32", "shape": [{HUGE_INT}], "data_offsets": [0, 4]}}}}'.encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    with pytest.raises(FormatError, match="model.safetensors"):
        infer.load(folder, backend="numpy")


# -- 3, 4. tokenizer panics, lone surrogates, templates that are not UTF-8 --------------------


def edit_tokenizer(folder: Path, **changes: object) -> None:
    edit_json(folder / "tokenizer.json", **changes)


def test_a_post_processor_naming_a_missing_token_is_a_tokenizer_error(folder: Path) -> None:
    edit_tokenizer(folder, post_processor={
        "type": "TemplateProcessing", "special_tokens": {},
        "single": [{"SpecialToken": {"id": "[X]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}]})
    with pytest.raises(TokenizerError, match="panicked"):  # a pyo3 PanicException (a BaseException) inside
        Tokenizer.from_folder(folder)


def test_a_normalizer_that_panics_at_encode_is_a_tokenizer_error(folder: Path) -> None:
    edit_tokenizer(folder, normalizer={"type": "Replace", "pattern": {"String": ""}, "content": "x"})
    tokenizer = Tokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="encoding the text: the tokenizers library panicked"):
        tokenizer.encode("hello")


def test_a_lone_surrogate_is_named(model: infer.Model) -> None:
    with pytest.raises(TokenizerError, match="at index 1, a lone surrogate"):
        model.generate("a\ud800b", max_tokens=1)


def test_a_template_file_that_is_not_utf8_is_a_chat_template_error(folder: Path) -> None:
    (folder / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja is not UTF-8 text \(byte 14\)"):
        Tokenizer.from_folder(folder)


# -- 5. rendering is bounded ---------------------------------------------------------------

BOUNDED = {
    "a huge power": ("{{ 9 ** (9 ** 9) }}", "bits"),
    "a huge repetition": ("{{ 'a' * 10**9 }}", "INFER_TEMPLATE_MAX_CHARS"),
    "a huge list repetition": ("{{ ([1] * 10**9)|length }}", "INFER_TEMPLATE_MAX_CHARS"),
    "a format width": ("{{ '{:1000000000}'.format(1) }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "a nested format width": ("{{ '{:{}}'.format(1, 10**9) }}", "nested field"),
    "a percent width": ("{{ '%1000000000d' % 1 }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "a percent star width": ("{{ '%*d'|format(10**9, 1) }}", r"'\*'"),
    "str.center": ("{{ 'x'.center(10**9) }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "the center filter": ("{{ 'x'|center(10**9) }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "tojson's indent": ("{{ messages|tojson(indent=10**8) }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "lipsum": ("{{ lipsum(n=10**6) }}", "INFER_TEMPLATE_MAX_WIDTH"),
    "str.replace": ("{{ ('a' * 1000).replace('a', 'a' * 1000).replace('a', 'a' * 1000) }}", "str.replace"),
    "join": ("{{ (['a' * 1000000] * 100)|join }}", "INFER_TEMPLATE_MAX_CHARS"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}", "'~'"),
    "the slice filter": ("{{ range(10)|slice(10**9)|list|length }}", "slice count"),
    "5,000 nested parentheses": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nests too deeply"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
}


@pytest.mark.parametrize("source, match", BOUNDED.values(), ids=BOUNDED.keys())
def test_costly_template_operations_are_refused_before_they_run(source: str, match: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match=match):
            render_chat_template(source, MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Refused before the allocation: the largest string allowed is 16 MiB of text.
    assert peak < 200 << 20


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
], ids=["nested loops", "exponential macro"])
def test_long_renders_end_at_the_time_budget(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_TEMPLATE_TIMEOUT", "0.3")
    with pytest.raises(ChatTemplateError, match="longer than 0.3 s.*INFER_TEMPLATE_TIMEOUT"):
        render_chat_template(source, MESSAGES)


def test_output_beyond_the_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_TEMPLATE_MAX_CHARS", "1000")
    source = "{% for i in range(2000) %}x{% endfor %}"
    with pytest.raises(ChatTemplateError, match="more than 1,000 characters"):
        render_chat_template(source, MESSAGES)
    monkeypatch.setenv("INFER_TEMPLATE_MAX_CHARS", "3000")  # raised: the same template renders
    assert render_chat_template(source, MESSAGES) == "x" * 2000


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_limit_variable_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_TEMPLATE_TIMEOUT", value)
    with pytest.raises(ChatTemplateError, match="INFER_TEMPLATE_TIMEOUT must be a positive float"):
        render_chat_template("{{ 1 }}", MESSAGES)


# -- 6. sampling never turns NaN into token ids --------------------------------------------


@pytest.mark.parametrize("params, history", [
    (SamplingParams(temperature=1e-320), ()),
    (SamplingParams(temperature=1.0, repetition_penalty=1e-308), (0, 2)),
    (SamplingParams(temperature=5e-324, repetition_penalty=1e-308, top_p=0.5), (0, 2)),
])
def test_extreme_temperature_and_penalty_give_a_distribution(params: SamplingParams, history: tuple) -> None:
    logits = np.array([1.0, 3.0, 2.0, -1.0])
    probs = Sampler(params).distribution(logits, history)
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    # Penalised by 1e-308, tokens 0 and 2 overflow past token 1; 2 stays above 0.
    want = 2 if history else 1
    assert Sampler(params).sample(logits, history) == want and probs[want] == 1.0


def test_nan_logits_are_an_error_naming_the_backend(model: infer.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = model.engine.backend

    def nan_head(hidden):  # type: ignore[no-untyped-def]
        out = type(model.network).compute_logits(model.network, hidden)
        return ops.mul(out, float("nan"))

    monkeypatch.setattr(model.network, "compute_logits", nan_head)
    for sampling in ({}, {"temperature": 0.7}):  # the device argmax and the host sampler
        with pytest.raises(BackendOutputError, match="backend numpy/cpu returned NaN logits"):
            model.generate("Hello", max_tokens=2, **sampling)
    calls = []

    def nan_after_prefill(hidden):  # type: ignore[no-untyped-def]
        calls.append(1)
        out = type(model.network).compute_logits(model.network, hidden)
        return out if len(calls) == 1 else ops.mul(out, float("nan"))

    monkeypatch.setattr(model.network, "compute_logits", nan_after_prefill)
    engine = Engine(model.network, ops)
    step = engine.capture_decode(compile=False)  # the static decode step that compile=True captures
    with pytest.raises(BackendOutputError, match="NaN logits in the captured decode step"):
        list(generate(engine, [1, 2, 3], SamplingParams(), StopConditions(max_tokens=3)))
    assert step.reason is None  # the static step ran, and its check caught the NaNs


def test_none_prompts_are_typed_errors(model: infer.Model) -> None:
    with pytest.raises(GenerationError, match="prompt_ids must be a list"):
        list(model.generate_tokens(None))  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        model.chat(None)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="prompt must be a string"):
        model.generate(None)  # type: ignore[arg-type]


# -- 10. sizes in headers are bounded by the file ---------------------------------------------


def gguf_with_string(length: int, body: int) -> bytes:
    """A GGUF header with one string value claiming ``length`` bytes, then ``body`` bytes."""
    key = b"general.name"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
    return head + struct.pack("<Q", length) + b"a" * body


@pytest.mark.parametrize("length", [8 << 20, 1 << 40])
def test_a_gguf_string_spanning_the_file_is_refused_before_decoding(tmp_path: Path, length: int) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_with_string(length, 8 << 20))  # the string is the whole rest: no room for the tensor
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="general.name"):
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing of the 8 MiB was copied


def test_overlapping_safetensors_tensors_are_refused(folder: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    (folder / "model.safetensors").write_bytes(safetensors_bytes(header, b"\0" * 12))
    with pytest.raises(FormatError, match="tensors 'a' and 'b' overlap"):
        infer.load(folder, backend="numpy")


# -- 11. infer diff never unpickles -------------------------------------------------------------


def test_diff_refuses_a_folder_of_pickled_weights(folder: Path) -> None:
    pytest.importorskip("transformers")
    from infer.tools.diff import trace_transformers

    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(UnsafeFormatError, match="never pickled"):
        trace_transformers(folder, [1, 2], 1)



# -- 7. one limit on max_tokens, for one prompt and for a list -----------------------------------


def test_a_list_of_prompts_takes_the_max_tokens_one_prompt_takes(folder: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    edit_json(folder / "config.json", max_position_embeddings=48)
    model = infer.load(folder, backend="numpy")
    # A KV memory for 24 positions (and the pool's scratch block of 8), less than the context
    # (48): a request that may run to the context's end cannot be batched, and runs alone, as
    # generate(prompt) runs it.
    per_position = model.engine.kv_bytes_per_position()
    with caplog.at_level("INFO", logger="infer"):
        model.configure_batching(kv_memory=32 * per_position, block_size=8)
    assert "holds 24 positions, fewer than the model's context of 48" in caplog.text
    prompts = ["Hello there", "Hi"]
    alone = [model.generate(p, max_tokens=10**12, ignore_eos=True) for p in prompts]
    assert model.generate(prompts, max_tokens=10**12, ignore_eos=True) == alone
    assert model.generate(prompts, max_tokens=5, ignore_eos=True) == [
        model.generate(p, max_tokens=5, ignore_eos=True) for p in prompts]
