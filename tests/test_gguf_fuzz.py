"""Fuzzing the GGUF parser: bad files end in infer's typed errors, never anything else.

A small valid file is mutated (truncated anywhere, bits flipped, every count, length,
type, dim and offset field replaced by absurd values, alignments that do not match the
padding). Each mutant must either raise :class:`~infer.errors.FormatError` (or
:class:`~infer.errors.UnsupportedArchitectureError`) or open, after which every tensor
must read and dequantize. Opening must allocate no more than the file's size plus a
small constant (checked with tracemalloc), and finish quickly (hypothesis deadline).
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.errors import FormatError, UnsupportedArchitectureError
from infer.formats import gguf_file
from infer.formats.gguf import GGUFQuantizedTensor, open_gguf

EXPECTED = (FormatError, UnsupportedArchitectureError)
SLACK = 1 << 20  # bytes an open may allocate beyond the file's size (Python objects, messages)
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def write_base(path: Path, alignment: int | None = None, arch: str = "llama") -> bytes:
    """A valid tiny file: strings, arrays, scalars of several types; F32/F16/Q8_0/Q4_0 tensors.
    The gemma3 variant adds its optional keys (a per-layer pattern array, rope scaling)."""
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": 32, "feed_forward_length": 32,
                       "attention.head_count": 2, "attention.head_count_kv": 1, "context_length": 64}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float64(f"{arch}.rope.freq_base", 10000.0)
    if arch == "gemma3":
        w.add_uint32("gemma3.attention.key_length", 16)
        w.add_uint32("gemma3.attention.sliding_window", 8)
        w.add_array("gemma3.attention.sliding_window_pattern", [True])
        w.add_string("gemma3.rope.scaling.type", "linear")
        w.add_float32("gemma3.rope.scaling.factor", 2.0)
        w.add_float32("gemma3.final_logit_softcapping", 30.0)
    w.add_array("general.tags", ["a", "bc", "déf"])
    w.add_array("general.numbers", [1, 2, 3])
    w.add_bool("general.flag", True)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((8, 32)).astype(np.float32),
                                                           gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
    w.add_tensor("blk.0.attn_k.weight", gguf.quants.quantize(rng.standard_normal((16, 32)).astype(np.float32),
                                                             gguf.GGMLQuantizationType.Q4_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def integer_fields(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, role) of every integer field of a valid file, found by walking it."""
    out: list[tuple[int, int, str]] = [(4, 4, "version")]
    pos = 8

    def take(n: int, role: str) -> int:
        nonlocal pos
        out.append((pos, n, role))
        value = int.from_bytes(data[pos:pos + n], "little")
        pos += n
        return value

    def skip_string() -> None:
        nonlocal pos
        n = take(8, "length")
        pos += n

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            skip_string()
        elif vtype == 9:
            etype, count = take(4, "type"), take(8, "count")
            for _ in range(count):
                skip_value(etype)
        else:
            take(SCALAR_SIZES[vtype], "scalar")

    n_tensors, n_kv = take(8, "count"), take(8, "count")
    for _ in range(n_kv):
        skip_string()
        skip_value(take(4, "type"))
    for _ in range(n_tensors):
        skip_string()
        for _ in range(take(4, "n_dims")):
            take(8, "dim")
        take(4, "type")
        take(8, "offset")
    return out


def check(path: Path) -> None:
    """The invariant: a typed error or a usable package, within the memory bound."""
    size = path.stat().st_size
    tracemalloc.start()
    try:
        package = open_gguf(path)
    except EXPECTED:
        package = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < size + SLACK, f"opening a {size}-byte file allocated {peak} bytes"
    if package is None:
        return
    try:
        for name in package.tensors.names():
            value = package.tensors.get(name)
            if isinstance(value, GGUFQuantizedTensor):
                value = value.dequantize()
            assert value.shape == package.tensors.shape(name)
    finally:
        package.tensors.close()


class Base(tuple):
    """(path, bytes) of the valid file; short repr, for hypothesis' failure reports."""

    def __repr__(self) -> str:
        return f"<base GGUF file {self[0].parent.name}, {len(self[1])} bytes>"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def base(tmp_path_factory, request) -> Base:
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    data = write_base(path, arch=request.param)
    assert open_gguf(path).config["hidden_size"] == 32  # the base itself is valid
    return Base((path, data))


def mutant(base: Base, data: bytes) -> Path:
    path = base[0].with_name("mutant.gguf")
    path.write_bytes(data)
    return path


def test_every_truncation(base):
    path, data = base
    for end in range(len(data)):
        try:
            package = open_gguf(mutant(base, data[:end]))
        except EXPECTED:
            continue
        package.tensors.close()  # only possible when just trailing padding was cut
        assert end >= len(data) - 32, f"a file truncated to {end} of {len(data)} bytes opened"


@FUZZ
@given(st.data())
def test_bit_flips(base, data):
    raw = bytearray(base[1])
    for bit in data.draw(st.lists(st.integers(0, len(raw) * 8 - 1), min_size=1, max_size=8)):
        raw[bit // 8] ^= 1 << (bit % 8)
    check(mutant(base, bytes(raw)))


INTERESTING = [0, 1, 2, 3, 4, 5, 31, 32, 33, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
               2**63 - 1, 2**63, 2**64 - 1]


@FUZZ
@given(st.data())
def test_absurd_fields(base, data):
    raw = bytearray(base[1])
    fields = integer_fields(base[1])
    for _ in range(data.draw(st.integers(1, 3))):
        offset, width, _role = data.draw(st.sampled_from(fields))
        value = data.draw(st.one_of(st.sampled_from(INTERESTING + [len(raw) - 1, len(raw), len(raw) + 1]),
                                    st.integers(0, 2**64 - 1)))
        raw[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    check(mutant(base, bytes(raw)))


@pytest.fixture(params=["C walk", "Python walk"])
def string_walk(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """A string array walked by the C extension, or by the Python loop it stands in for."""
    if request.param == "Python walk":
        monkeypatch.setattr(gguf_file, "_gguf_strings", None)
    elif gguf_file._gguf_strings is None:
        pytest.skip("the C walk (infer.formats._gguf_strings) is not built")
    return request.param


def test_the_c_walk_reads_what_the_python_walk_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if gguf_file._gguf_strings is None:
        pytest.skip("the C walk (infer.formats._gguf_strings) is not built")
    strings = ["", "a", "déf", "日本語", "\x00x", "▁" * 40] * 50 + [chr(i) for i in range(0x20, 0x3000, 7)]
    writer = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", strings)
    writer.add_array("general.tags", [])
    writer.add_string("general.name", "after the arrays")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    by_c = gguf_file.GGUFFile(tmp_path / "s.gguf").metadata
    monkeypatch.setattr(gguf_file, "_gguf_strings", None)
    by_python = gguf_file.GGUFFile(tmp_path / "s.gguf").metadata
    assert by_c["tokenizer.ggml.tokens"].stored()[0] == by_python["tokenizer.ggml.tokens"].stored()[0]
    assert np.array_equal(by_c["tokenizer.ggml.tokens"].stored()[1], by_python["tokenizer.ggml.tokens"].stored()[1])
    assert by_c["tokenizer.ggml.tokens"] == strings and by_c == by_python


def test_every_length_prefix_set_absurd(base, string_walk):
    """Each string's length (keys, values, vocabulary entries) set past any offset: a typed
    error, not an OverflowError from walking the rest of an array beyond the file."""
    for offset, width, role in integer_fields(base[1]):
        if role != "length":
            continue
        for value in (2**62, 2**63 - 1, 2**64 - 1):
            raw = bytearray(base[1])
            raw[offset:offset + width] = value.to_bytes(width, "little")
            check(mutant(base, bytes(raw)))


def test_walker_sees_every_structure(base):
    roles = {role for _, _, role in integer_fields(base[1])}
    assert roles == {"version", "count", "length", "type", "scalar", "n_dims", "dim", "offset"}


@FUZZ
@given(alignment=st.one_of(st.sampled_from([0, 1, 2, 3, 8, 16, 31, 32, 48, 64, 4096, 2**31]),
                           st.integers(0, 2**32 - 1)))
def test_alignment_that_does_not_match_the_padding(tmp_path_factory, alignment):
    path = tmp_path_factory.mktemp("align") / "a.gguf"
    write_base(path, alignment)
    check(path)


@FUZZ
@given(st.data())
def test_random_garbage_after_the_magic(base, data):
    tail = data.draw(st.binary(min_size=0, max_size=512))
    check(mutant(base, b"GGUF" + base[1][4:data.draw(st.integers(4, 64))] + tail))


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0, 1))
def test_real_file_truncated_in_its_metadata(tmp_path_factory, fraction):
    from reference import smollm2_gguf_path

    source = smollm2_gguf_path()
    with open(source, "rb") as f:
        head = f.read(1_800_000)  # the metadata (vocabulary, merges) and tensor infos end before this
    end = 24 + int(fraction * (len(head) - 25))  # past the fixed-size header
    path = tmp_path_factory.mktemp("real") / "cut.gguf"
    path.write_bytes(head[:end])
    with pytest.raises(FormatError, match=r"cut\.gguf: .*at byte \d+"):
        open_gguf(path, tokenizer=False)
