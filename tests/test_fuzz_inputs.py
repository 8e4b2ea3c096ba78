"""Fuzzing the layers above the parsers with hostile values (docs/security.md).

Hypothesis draws, and mutation applies, replacement values for GGUF metadata,
``config.json`` fields, ``tokenizer.json`` components, ``tokenizer_config.json``
entries, chat templates and sampling parameters. The property is the same
everywhere: the operation succeeds or raises an :class:`~infer.errors.InferError`
subclass (nothing else: no ``ZeroDivisionError`` from a config, no
``PanicException`` from Rust, no NaN turned into a token id), within a time
limit (hypothesis' deadline) and a memory limit (the peak traced by tracemalloc,
relative to the input's size).

The default run is bounded for CI (1,580 cases, about a minute). ``INFER_FUZZ_LONG=1``
is the long mode: 102,000 cases, weighted towards the cheap targets (most of an
hour on one core; run it with ``nice``), with random seeds in place of the fixed
ones. ``pytest --hypothesis-show-statistics`` prints the cases each target ran.
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from infer.architecture import WeightLoader
from infer.chat_template import render_chat_template
from infer.engine import Engine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import Sampler, SamplingParams
from infer.errors import InferError
from infer.formats.gguf import open_gguf
from infer.plugins import get_registry
from infer.plugins.selection import select_backend
from infer.testing.tiny_model import ArrayTensorSource
from infer.tokenizer import Tokenizer
from reference import tiny_model_dir
from test_format_gguf import write_model

LONG = os.environ.get("INFER_FUZZ_LONG", "") not in ("", "0")


def fuzz(examples: int, long: int, deadline_ms: int = 5000) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Settings for one target: ``examples`` cases in CI (fixed seed), ``long`` in the long mode."""
    return settings(max_examples=long if LONG else examples, deadline=deadline_ms, derandomize=not LONG,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def within_limits(action: Callable[[], Any], input_bytes: int, slack: int = 64 << 20) -> None:
    """Run ``action``: it may only return or raise an InferError, and may trace at
    most ``slack`` bytes beyond 4 times the input's size."""
    tracemalloc.start()
    try:
        try:
            action()
        except InferError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * input_bytes + slack, f"peak {peak:,} bytes for an input of {input_bytes:,}"


# -- values ---------------------------------------------------------------------------------

EXTREME_NUMBERS = [0, 1, -1, 2, 3, 7, 2**31 - 1, 2**32, 2**63, -(2**63), 10**400, 1e-320, 5e-324, 1e308,
                   -1e308, float("inf"), float("-inf"), float("nan"), 0.5, 1.5, 1e-6, 64, 4096, 10**9]
numbers = st.one_of(st.sampled_from(EXTREME_NUMBERS), st.integers(-(2**70), 2**70), st.floats())
scalars = st.one_of(numbers, st.none(), st.booleans(), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)

ROPE_KEYS = ["factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
             "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "rope_theta", "partial_rotary_factor",
             "truncate", "rope_type", "type"]
rope_dicts = st.dictionaries(
    st.sampled_from(ROPE_KEYS),
    st.one_of(numbers, st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn", "longrope", ""]),
              st.none()), max_size=6)


# -- config.json fields ---------------------------------------------------------------------

CONFIG_VARIANTS = ["llama3", "llama_dynamic", "mistral", "qwen2", "gemma3", "deepseek_v3"]
CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "hidden_act", "hidden_activation", "sliding_window", "use_sliding_window",
               "max_window_layers", "layer_types", "rope_theta", "rope_scaling", "rope_parameters",
               "partial_rotary_factor", "rope_local_base_freq", "query_pre_attn_scalar", "sliding_window_pattern",
               "final_logit_softcapping", "attn_logit_softcapping", "kv_lora_rank", "q_lora_rank",
               "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
               "n_group", "topk_group", "first_k_dense_replace", "moe_intermediate_size", "routed_scaling_factor",
               "num_nextn_predict_layers", "model_type"]

#: A build and two decoded tokens take up to ~2 s (DeepSeek-V3's tiny MoE under
#: tracemalloc, on a shared machine; 6 s was seen once): the limit is for a case
#: that runs away, not for the machine's load.
DECODE_DEADLINE_MS = 20_000

_MODELS: dict[str, tuple[dict, dict]] = {}


def tiny_model(variant: str) -> tuple[dict, dict]:
    if variant not in _MODELS:
        folder = tiny_model_dir(variant)
        config = json.loads((folder / "config.json").read_text())
        _MODELS[variant] = config, load_file(folder / "model.safetensors")
    return _MODELS[variant]


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """Build the reference folders and load the plugins before any timed case."""
    for variant in CONFIG_VARIANTS:
        build_and_decode(*tiny_model(variant))
    render_chat_template("{{ 1 }}", [])


def build_and_decode(config: dict, arrays: dict) -> None:
    """What infer.load does after the format has read the folder, then two greedy tokens."""
    ops = select_backend("numpy")
    arch = get_registry().architecture_for(config.get("model_type"))  # type: ignore[arg-type]
    network = arch.build(config, WeightLoader(ArrayTensorSource(arrays), ops), ops)
    engine = Engine(network, ops)
    list(generate(engine, [1, 2, 3], SamplingParams(), StopConditions(max_tokens=2)))


@fuzz(150, 6000, deadline_ms=DECODE_DEADLINE_MS)
@given(variant=st.sampled_from(CONFIG_VARIANTS),
       changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), st.one_of(json_values, rope_dicts), min_size=1,
                               max_size=3))
def test_config_fields(variant: str, changes: dict) -> None:
    config, arrays = tiny_model(variant)
    mutated = {**config, **changes}
    within_limits(lambda: build_and_decode(mutated, arrays), len(json.dumps(mutated, default=str)) + (1 << 20))


@fuzz(100, 3000, deadline_ms=DECODE_DEADLINE_MS)
@given(variant=st.sampled_from(CONFIG_VARIANTS), rope=rope_dicts, where=st.sampled_from(["rope_parameters",
                                                                                          "rope_scaling"]))
def test_rope_settings(variant: str, rope: dict, where: str) -> None:
    config, arrays = tiny_model(variant)
    mutated = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    mutated[where] = rope
    within_limits(lambda: build_and_decode(mutated, arrays), 1 << 20)


# -- GGUF metadata values --------------------------------------------------------------------

GGUF_HPARAMS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
                "rope.dimension_count", "attention.key_length", "attention.value_length", "attention.sliding_window",
                "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                "vocab_size", "expert_count"]
gguf_values = st.one_of(
    st.tuples(st.just("uint32"), st.one_of(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1]), st.integers(0, 2**32 - 1))),
    st.tuples(st.just("int32"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("uint64"), st.one_of(st.sampled_from([0, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))),
    st.tuples(st.just("float32"), st.floats(width=32)),
    st.tuples(st.just("float64"), st.floats()),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("string"), st.text(max_size=16)),
)


@fuzz(80, 2000, deadline_ms=10000)
@given(changes=st.dictionaries(st.sampled_from(GGUF_HPARAMS), gguf_values, min_size=1, max_size=3))
def test_gguf_metadata_values(tmp_path_factory: pytest.TempPathFactory, changes: dict) -> None:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_model(path, layers=1, types=("F32",), skip_hparams=tuple(changes),
                extra={f"llama.{key}": value for key, value in changes.items()})

    def load_and_decode() -> None:
        package = open_gguf(path, tokenizer=False)
        arrays = {name: np.asarray(package.tensors.get(name)) for name in package.tensors.names()}
        build_and_decode(dict(package.config, model_type=package.model_type), arrays)

    within_limits(load_and_decode, path.stat().st_size)
    shutil.rmtree(path.parent)


# -- tokenizer.json and tokenizer_config.json ---------------------------------------------

COMPONENT_TYPES = {
    "normalizer": ["Replace", "NFC", "NFKD", "Lowercase", "Strip", "Prepend", "Sequence", "Precompiled",
                   "BertNormalizer", "ByteLevel"],
    "pre_tokenizer": ["ByteLevel", "Split", "Metaspace", "Whitespace", "Sequence", "Digits", "Punctuation"],
    "post_processor": ["TemplateProcessing", "ByteLevel", "RobertaProcessing", "BertProcessing", "Sequence"],
    "decoder": ["ByteLevel", "Metaspace", "Replace", "Strip", "Fuse", "ByteFallback", "Sequence", "WordPiece"],
}
COMPONENT_FIELDS = ["pattern", "content", "prepend", "add_prefix_space", "trim_offsets", "use_regex", "behavior",
                    "invert", "replacement", "prepend_scheme", "split", "single", "pair", "special_tokens",
                    "normalizers", "pretokenizers", "processors", "decoders", "start", "stop", "left", "right",
                    "sep", "cls", "individual_digits", "prefix", "cleanup", "strip_left", "strip_right"]
components = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    st.sampled_from(sorted({t for ts in COMPONENT_TYPES.values() for t in ts})),
    st.dictionaries(st.sampled_from(COMPONENT_FIELDS),
                    st.one_of(json_values, st.fixed_dictionaries({"String": st.text(max_size=3)}),
                              st.fixed_dictionaries({"Regex": st.text(max_size=6)})), max_size=4))
TOKENIZER_PATHS = [("normalizer",), ("pre_tokenizer",), ("post_processor",), ("decoder",), ("model", "type"),
                   ("model", "unk_token"), ("model", "byte_fallback"), ("model", "dropout"), ("model", "merges"),
                   ("model", "vocab"), ("added_tokens",), ("truncation",), ("padding",), ("version",)]
TEXTS = st.text(max_size=40) | st.sampled_from(["hello world", "<|im_start|>user\nhi<|im_end|>", "", " \t\n",
                                                "ﬁ café 😀 \u0301", "a" * 500])


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok") / "model"
    src = tiny_model_dir("llama3")
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return folder


def use_tokenizer(folder: Path, text: str, ids: list[int]) -> None:
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer.decode(tokenizer.encode(text))
    tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder()
    for i in ids:
        decoder.push(i)
    decoder.flush()
    if tokenizer.chat_template is not None:
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


@fuzz(250, 10000)
@given(path=st.sampled_from(TOKENIZER_PATHS), value=st.one_of(components, json_values), text=TEXTS,
       ids=st.lists(st.integers(-5, 500), max_size=6))
def test_tokenizer_json_components(tokenizer_folder: Path, path: tuple, value: Any, text: str,
                                   ids: list[int]) -> None:
    original = json.loads((tiny_model_dir("llama3") / "tokenizer.json").read_text())
    _set(original, path, value)
    data = json.dumps(original)
    (tokenizer_folder / "tokenizer.json").write_text(data)
    within_limits(lambda: use_tokenizer(tokenizer_folder, text, ids), len(data))


CONFIG_ENTRIES = ["bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token",
                  "chat_template", "added_tokens_decoder", "extra_special_tokens", "additional_special_tokens",
                  "split_special_tokens", "model_max_length", "image_token"]


@fuzz(150, 6000)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_ENTRIES), st.one_of(json_values, TEXTS), min_size=1,
                               max_size=3), text=TEXTS)
def test_tokenizer_config_entries(tokenizer_folder: Path, changes: dict, text: str) -> None:
    shutil.copy(tiny_model_dir("llama3") / "tokenizer.json", tokenizer_folder / "tokenizer.json")
    config = json.loads((tiny_model_dir("llama3") / "tokenizer_config.json").read_text())
    data = json.dumps({**config, **changes})
    (tokenizer_folder / "tokenizer_config.json").write_text(data)
    within_limits(lambda: use_tokenizer(tokenizer_folder, text, [1, 2, 3]), len(data))


# -- chat templates -----------------------------------------------------------------------------

FRAGMENTS = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ bos_token }}",
    "{% for i in range({n}) %}{% for j in range({n}) %}{{ j }}{% endfor %}{% endfor %}",
    "{{ 'ab' * {n} }}", "{{ {n} ** {n} }}", "{{ ({n} ** {n}) * ({n} ** {n}) }}", "{{ '{{:{n}}}'.format(1) }}",
    "{{ '%{n}d' % 1 }}", "{{ 'x'.center({n}) }}", "{{ 'x'|center({n}) }}", "{{ 'x\\ny'|indent({n}) }}",
    "{{ messages|tojson(indent={n}) }}", "{{ lipsum(n={n}) }}", "{{ range({n})|join(',') }}",
    "{{ ('a' * {n}).replace('a', 'bb') }}", "{{ 'a\\tb'.expandtabs({n}) }}", "{{ range({n})|slice({n})|list }}",
    "{% set ns = namespace(s='ab') %}{% for i in range({n}) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f({n}) }}",
    "{{ raise_exception('no') }}", "{{ messages.__class__ }}", "{{ ''.__class__.__mro__ }}", "{{ cycler }}",
    "{% if", "{{ (", "{% endfor %}", "{{ 'x'|wordwrap({n}) }}", "{{ 'a'.zfill({n}) }}", "{{ [1] + [2] * {n} }}",
    "{{ '%s' % ('x' * {n}) }}", "{{ dict(a={n})|tojson }}", "{{ strftime_now('%Y') }}", "{{ '{{}}'.format }}",
    "{% for c in 'x' * {n} %}{% endfor %}", "{{ messages|map(attribute='role')|join }}",
]
template_sources = st.lists(
    st.builds(lambda fragment, n: fragment.replace("{n}", str(n)), st.sampled_from(FRAGMENTS),
              st.sampled_from([0, 1, 3, 40, 1000, 100_000, 10**9, 2**63, -5])),
    min_size=1, max_size=4).map("".join)


@fuzz(250, 25000)
@given(source=st.one_of(template_sources, st.text(max_size=60)),
       content=st.one_of(TEXTS, json_values), tools=st.one_of(st.none(), json_values))
def test_chat_templates(source: str, content: Any, tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_TEMPLATE_TIMEOUT", "0.5")
    messages = [{"role": "user", "content": content}]
    within_limits(lambda: render_chat_template(source, messages, tools=tools, bos_token="<s>"), len(source))


# -- sampling parameters -------------------------------------------------------------------------

logit_rows = st.lists(st.one_of(st.floats(-1e308, 1e308), st.sampled_from([float("-inf"), 0.0, 1e300, -1e300])),
                      min_size=1, max_size=12)


@fuzz(600, 50000, deadline_ms=2000)
@given(temperature=numbers, top_k=numbers, top_p=numbers, min_p=numbers, repetition_penalty=numbers,
       seed=st.one_of(st.none(), numbers), logits=logit_rows, history=st.lists(st.integers(0, 11), max_size=6))
def test_sampling_parameters(temperature: Any, top_k: Any, top_p: Any, min_p: Any, repetition_penalty: Any,
                             seed: Any, logits: list[float], history: list[int]) -> None:
    row = np.asarray(logits, dtype=np.float64)
    assume(np.isfinite(row).any())  # the engine refuses rows without a finite logit (NaN) before sampling
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repetition_penalty, seed=seed)
    except InferError:
        return
    history = [h for h in history if h < row.size]
    sampler = Sampler(params)
    token = sampler.sample(row, history)
    assert 0 <= token < row.size
    probs = sampler.distribution(row, history)
    assert np.isfinite(probs).all() and abs(probs.sum() - 1.0) < 1e-9 and probs[token] > 0
