"""The Hugging Face folder format: config, safetensors parsing, safety, generation defaults."""

from __future__ import annotations

import json
import logging
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from infer.errors import (
    ConfigError, FormatError, MissingTensorError, UnsafeFormatError, UnsupportedDtypeError,
)
from infer.formats.huggingface import SafetensorsSource, detect, open_folder


def make_folder(folder: Path, tensors: dict[str, torch.Tensor] | None = None, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_raw(path: Path, header: bytes | dict, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file with an arbitrary header (bytes or a JSON object)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# -- reading tensors ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_tensors_round_trip_exactly(tmp_path, dtype):
    values = torch.randn(5, 7) * 1000
    values[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    values[1, 0] = torch.finfo(dtype).tiny / 4  # subnormal
    t = values.to(dtype)
    scalar, empty = torch.tensor(3.5, dtype=dtype), torch.zeros(0, 3, dtype=dtype)
    make_folder(tmp_path, {"w": t, "scalar": scalar, "empty": empty})
    pkg = open_folder(tmp_path)
    src = pkg.tensors
    expected = t.float().numpy() if dtype == torch.bfloat16 else t.numpy()
    got = src.get("w")
    assert got.dtype == expected.dtype and got.shape == (5, 7)
    assert np.array_equal(bits(got), bits(expected))  # bit-exact, NaN included
    assert src.get("scalar").shape == () and float(src.get("scalar")) == 3.5
    assert src.get("empty").shape == (0, 3)
    assert src.storage_dtype("w") == str(dtype).removeprefix("torch.")
    assert src.shape("w") == (5, 7)
    assert src.location("w") == "model.safetensors"
    assert set(src.names()) == {"w", "scalar", "empty"} and "w" in src and "x" not in src
    src.close()


def test_integer_tensors_and_read_only_views(tmp_path):
    tensors = {"ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "b": torch.tensor([-3, 4], dtype=torch.int8), "f": torch.ones(4)}
    src = open_folder(make_folder(tmp_path, tensors)).tensors
    assert src.get("ids").tolist() == [[0, 1, 2], [3, 4, 5]] and src.storage_dtype("ids") == "int64"
    assert src.get("b").tolist() == [-3, 4]
    view = src.get("f")
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 2.0
    src.close()
    assert view.tolist() == [1.0] * 4  # a view outlives close()


def test_transformers_checkpoint_matches_state_dict(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=[2, 3])
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    pkg = open_folder(tmp_path)
    assert pkg.model_type == "llama" and pkg.format == "huggingface" and pkg.config["hidden_size"] == 16
    assert pkg.generation.eos_token_ids == (2, 3)
    state = model.state_dict()
    for name in pkg.tensors.names():
        assert pkg.tensors.storage_dtype(name) == "bfloat16"
        assert np.array_equal(pkg.tensors.get(name), state[name].float().numpy()), name
    assert set(pkg.tensors.names()) <= set(state)
    pkg.tensors.close()


def test_missing_tensor_names_tensor_and_place(tmp_path):
    src = open_folder(make_folder(tmp_path, {"a": torch.ones(2)})).tensors
    for call in (src.get, src.shape, src.storage_dtype):
        with pytest.raises(MissingTensorError, match=r"'lm_head.weight'.*" + tmp_path.name):
            call("lm_head.weight")


# -- finding the weights ----------------------------------------------------------------


def write_index(folder: Path, weight_map: dict) -> None:
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_index(tmp_path):
    make_folder(tmp_path)
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.full((2, 2), 7.0)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                           "c": "model-00002-of-00002.safetensors"})
    src = open_folder(tmp_path).tensors
    assert sorted(src.names()) == ["a", "b", "c"]
    assert src.location("c") == "model-00002-of-00002.safetensors"
    assert src.get("c").tolist() == [[7.0, 7.0], [7.0, 7.0]]


def test_sharded_index_missing_shard_or_tensor(tmp_path):
    make_folder(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(FormatError, match="s2.safetensors"):
        open_folder(tmp_path)
    write_index(tmp_path, {"a": "s1.safetensors", "b": "s1.safetensors"})
    with pytest.raises(MissingTensorError, match=r"'b'.*s1.safetensors"):
        open_folder(tmp_path)
    for bad in ({"a": "../s1.safetensors"}, {}, {"a": 1}):
        write_index(tmp_path, bad)
        with pytest.raises(FormatError, match="weight_map"):
            open_folder(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ConfigError, match="model.safetensors.index.json"):
        open_folder(tmp_path)


def test_any_safetensors_files_and_duplicates(tmp_path):
    make_folder(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    assert sorted(open_folder(tmp_path).tensors.names()) == ["a", "b"]
    save_file({"a": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(FormatError, match="'a'.*one.safetensors.*two.safetensors"):
        open_folder(tmp_path)


def test_pickle_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    make_folder(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle data was loaded")

    for target in (pickle, torch):
        monkeypatch.setattr(target, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    with pytest.raises(UnsafeFormatError) as info:
        open_folder(tmp_path)
    message = str(info.value)
    assert "pytorch_model.bin" in message and "execute" in message and "safe_serialization=True" in message
    assert not marker.exists()


def test_no_weights(tmp_path):
    make_folder(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(FormatError, match="no weights") as info:
        open_folder(tmp_path)
    assert not isinstance(info.value, UnsafeFormatError) and "model.gguf" in str(info.value)


def test_opening_is_lazy(tmp_path):
    size = 64 * 2**20  # a 64 MiB tensor, written sparsely so the test stays fast
    header = json.dumps({"big": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]},
                         "small": {"dtype": "BF16", "shape": [2], "data_offsets": [size, size + 4]}}).encode()
    make_folder(tmp_path)
    path = write_raw(tmp_path / "model.safetensors", header)
    with open(path, "r+b") as f:
        f.truncate(8 + len(header) + size + 4)
    tracemalloc.start()
    try:
        src = open_folder(tmp_path).tensors
        big = src.get("big")  # a view: still nothing read
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"opening allocated {peak} bytes"
    assert big.shape == (size // 4,) and src.get("small").tolist() == [0.0, 0.0]
    src.close()


# -- malformed safetensors ----------------------------------------------------------------

GOOD = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
MALFORMED = {
    "short file": lambda p: p.write_bytes(b"\x01\x00\x00"),
    "length past end": lambda p: write_raw(p, {"a": GOOD}, bytes(8), length=10_000),
    "not utf-8": lambda p: write_raw(p, b"{\"\xff\xfe\": 1}"),
    "not json": lambda p: write_raw(p, b"{\"a\": "),
    "not an object": lambda p: write_raw(p, b"[1, 2]"),
    "deep nesting": lambda p: write_raw(p, b"[" * 100_000),
    "entry not object": lambda p: write_raw(p, {"a": [1]}),
    "metadata not object": lambda p: write_raw(p, {"__metadata__": 3, "a": GOOD}, bytes(8)),
    "dtype missing": lambda p: write_raw(p, {"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "shape negative": lambda p: write_raw(p, {"a": {**GOOD, "shape": [-2]}}, bytes(8)),
    "shape float": lambda p: write_raw(p, {"a": {**GOOD, "shape": [2.0]}}, bytes(8)),
    "shape bool": lambda p: write_raw(p, {"a": {**GOOD, "shape": [True, 2]}}, bytes(8)),
    "shape not list": lambda p: write_raw(p, {"a": {**GOOD, "shape": 2}}, bytes(8)),
    "offsets past end": lambda p: write_raw(p, {"a": {**GOOD, "data_offsets": [4, 12]}}, bytes(8)),
    "offsets reversed": lambda p: write_raw(p, {"a": {**GOOD, "data_offsets": [8, 0]}}, bytes(8)),
    "offsets length": lambda p: write_raw(p, {"a": {**GOOD, "data_offsets": [0]}}, bytes(8)),
    "size mismatch": lambda p: write_raw(p, {"a": {**GOOD, "shape": [3]}}, bytes(8)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header(tmp_path, case):
    make_folder(tmp_path)
    MALFORMED[case](tmp_path / "model.safetensors")
    with pytest.raises(FormatError, match="model.safetensors"):
        open_folder(tmp_path)


def test_header_length_limit(tmp_path):
    path = write_raw(tmp_path / "model.safetensors", b"{}", length=200 * 2**20)
    with open(path, "r+b") as f:
        f.truncate(8 + 200 * 2**20)  # sparse: the length fits the file but passes the limit
    with pytest.raises(FormatError, match="header length"):
        SafetensorsSource([path])


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F64", "Q4"])
def test_unsupported_dtype_names_tensor(tmp_path, dtype):
    path = write_raw(tmp_path / "w.safetensors", {"layer.w": {**GOOD, "dtype": dtype}}, bytes(8))
    with pytest.raises(UnsupportedDtypeError, match=rf"w.safetensors.*'layer.w'.*{dtype}"):
        SafetensorsSource([path])


def valid_file_bytes() -> bytes:
    header = json.dumps({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [12, 16]},
        "c": {"dtype": "I64", "shape": [], "data_offsets": [16, 24]},
    }).encode()
    return struct.pack("<Q", len(header)) + header + bytes(range(24))


def open_and_read_all(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        src = SafetensorsSource([path])
    except FormatError:
        return
    for name in src.names():
        src.get(name)
        src.shape(name), src.storage_dtype(name)
    src.close()


@st.composite
def damaged(draw):
    data = bytearray(valid_file_bytes())
    kind = draw(st.sampled_from(["truncate", "flip", "random"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    return draw(st.binary(max_size=64))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**65) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["dtype", "shape", "data_offsets", "__metadata__", "x"]), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def fuzzed_headers(draw):
    entry = st.fixed_dictionaries({}, optional={
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I8", "F64", "bad"]) | json_values,
        "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-1, 40), min_size=2, max_size=2) | json_values})
    names = st.sampled_from(["a", "b", "__metadata__"])
    header = draw(st.dictionaries(names, entry | json_values, max_size=3))
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(draw(st.integers(0, 40)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=damaged() | fuzzed_headers())
def test_fuzzed_files_raise_only_format_errors(tmp_path, data):
    open_and_read_all(tmp_path / "fuzz.safetensors", data)


# -- config and generation defaults --------------------------------------------------------


def test_detect(tmp_path):
    assert not detect(tmp_path)
    make_folder(tmp_path)
    assert detect(tmp_path)
    assert not detect(tmp_path / "config.json") and not detect(tmp_path / "nope")


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "llama",\n "x": }', "line 2, column"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": 4}', "model_type"),
    ('{"model_type": 3}', "model_type"),
])
def test_bad_config(tmp_path, text, match):
    make_folder(tmp_path, {"a": torch.ones(1)})
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        open_folder(tmp_path)
    assert "config.json" in str(info.value)


def test_config_kept_as_is(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 1e6}
    make_folder(tmp_path, {"a": torch.ones(1)}, rope_parameters=rope, text_config={"x": 1})
    pkg = open_folder(tmp_path)
    assert pkg.config["rope_parameters"] == rope and pkg.config["text_config"] == {"x": 1}


def write_generation(folder: Path, **values) -> None:
    (folder / "generation_config.json").write_text(json.dumps(values))


def test_generation_config_eos_and_sampling(tmp_path):
    make_folder(tmp_path, {"a": torch.ones(1)}, eos_token_id=9, bos_token_id=8)
    assert open_folder(tmp_path).generation.eos_token_ids == (9,)  # from config.json
    write_generation(tmp_path, eos_token_id=[2, 7, 2], bos_token_id=1, do_sample=True, temperature=0.6,
                     top_k=20, top_p=0.95, min_p=0, repetition_penalty=1.1, max_new_tokens=64)
    gen = open_folder(tmp_path).generation
    assert gen.eos_token_ids == (2, 7) and gen.bos_token_id == 1
    assert gen.sampling_overrides() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                                        "repetition_penalty": 1.1}
    assert gen.max_new_tokens == 64
    write_generation(tmp_path, eos_token_id=5, temperature=0.6, top_p=0.9, repetition_penalty=1.2)
    gen = open_folder(tmp_path).generation  # no do_sample: greedy, so only the penalty applies
    assert gen.eos_token_ids == (5,) and gen.bos_token_id == 8
    assert gen.sampling_overrides() == {"repetition_penalty": 1.2}


@pytest.mark.parametrize("text, match", [
    ("{not json", "line 1"), ('{"eos_token_id": "</s>"}', "eos_token_id"),
    ('{"do_sample": true, "top_k": 2.5}', "top_k"),
    ('{"temperature": "hot", "do_sample": true}', "temperature"),
])
def test_bad_generation_config(tmp_path, text, match):
    make_folder(tmp_path, {"a": torch.ones(1)})
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        open_folder(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_without_tokenizer_warns(tmp_path, caplog):
    make_folder(tmp_path, {"a": torch.ones(1)})
    with caplog.at_level(logging.WARNING):
        assert open_folder(tmp_path).tokenizer is None
    assert "tokenizer.json" in caplog.text


def write_tokenizer(folder: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def test_tokenizer_eos_is_the_last_fallback(tmp_path):
    pytest.importorskip("infer.tokenizer")
    make_folder(tmp_path, {"a": torch.ones(1)})
    write_tokenizer(tmp_path)
    pkg = open_folder(tmp_path)
    assert pkg.tokenizer is not None and pkg.generation.eos_token_ids == (1,)  # "</s>"
    write_generation(tmp_path, eos_token_id=3)
    assert open_folder(tmp_path).generation.eos_token_ids == (3,)


def test_registered_through_entry_point(tmp_path):
    from infer.plugins import get_registry

    registry = get_registry()
    assert "huggingface" in registry.formats
    make_folder(tmp_path, {"a": torch.ones(1)})
    assert registry.format_for(tmp_path).name == "huggingface"
