"""The state file container (infer.kv.state_file): round trips, atomic writes, and a fuzzed reader.

A state file is a safetensors file whose ``__metadata__`` carries infer's description and a
checksum over the header and every data byte. Every mutant of a valid file (truncated
anywhere, any byte flipped, header fields replaced) must raise
:class:`~infer.errors.StateFileError` and nothing else: a damaged state never loads.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.errors import StateFileError, StateMismatchError
from infer.kv.fingerprint import Fingerprint, file_hash, weights_hash
from infer.kv.state_file import STATE_VERSION, _canonical, Tensor, parse_state_file, read_state_file, write_state_file

FUZZ = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def tensors() -> dict[str, Tensor]:
    rng = np.random.default_rng(3)
    bf16 = (rng.standard_normal((8, 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return {
        "tokens": Tensor("I64", np.arange(11, dtype=np.int64)),
        "kv.0.keys": Tensor("F32", rng.standard_normal((8, 2, 4)).astype(np.float32)),
        "kv.0.values": Tensor("F16", rng.standard_normal((8, 2, 4)).astype(np.float16)),
        "state.11.1.ssm": Tensor("BF16", bf16),
    }


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("state") / "a.state"
    write_state_file(path, {"tokens": 11, "note": "x"}, tensors())
    return path.read_bytes()


def test_a_state_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.state"
    n = write_state_file(path, {"tokens": 11}, tensors())
    assert n == path.stat().st_size
    got = read_state_file(path)
    assert got.info["version"] == STATE_VERSION and got.info["format"] == "infer-state" and got.info["tokens"] == 11
    for name, t in tensors().items():
        assert got.tensors[name].dtype == t.dtype
        np.testing.assert_array_equal(got.tensors[name].data, t.data)
    assert [p.name for p in path.parent.iterdir()] == ["a.state"]  # no temporary file left


def test_any_safetensors_reader_opens_it(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    path = tmp_path / "a.state"
    write_state_file(path, {"tokens": 11}, {k: v for k, v in tensors().items() if v.dtype != "BF16"})
    loaded = load_file(str(path))
    np.testing.assert_array_equal(loaded["kv.0.keys"], tensors()["kv.0.keys"].data)
    np.testing.assert_array_equal(loaded["tokens"], np.arange(11))


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "a.state"
    write_state_file(path, {"tokens": 11}, tensors())
    before = path.read_bytes()
    with pytest.raises(StateFileError):
        write_state_file(path, {}, {"x": Tensor("U8", np.zeros(3, np.uint8))})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.state"]


def test_truncated_at_every_length_is_refused(valid: bytes) -> None:
    for n in range(len(valid)):
        with pytest.raises(StateFileError):
            parse_state_file(valid[:n])


def test_every_flipped_byte_is_refused(valid: bytes) -> None:
    for i in range(len(valid)):
        for bit in (0, 7):
            mutant = bytearray(valid)
            mutant[i] ^= 1 << bit
            with pytest.raises(StateFileError):
                parse_state_file(bytes(mutant))


def test_another_version_is_refused(tmp_path: Path, valid: bytes) -> None:
    (n,) = struct.unpack_from("<Q", valid)
    header = json.loads(valid[8:8 + n])
    info = json.loads(header["__metadata__"]["infer.state"])
    info["version"] = STATE_VERSION + 1
    header["__metadata__"]["infer.state"] = json.dumps(info, separators=(",", ":"), sort_keys=True)
    raw = _canonical(header)  # as a later infer would write it
    with pytest.raises(StateFileError, match="version"):
        parse_state_file(struct.pack("<Q", len(raw)) + raw + valid[8 + n:])


@FUZZ
@given(data=st.data())
def test_fuzzed_files_raise_only_state_file_errors(valid: bytes, data: st.DataObject) -> None:
    mutant = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "length"]))
        if not mutant:
            break
        if kind == "length" and len(mutant) >= 8:
            struct.pack_into("<Q", mutant, 0, data.draw(st.integers(0, 2**64 - 1)))
        elif kind in ("flip", "length"):
            mutant[data.draw(st.integers(0, len(mutant) - 1))] ^= data.draw(st.integers(1, 255))
        elif kind == "set":
            mutant[data.draw(st.integers(0, len(mutant) - 1))] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del mutant[data.draw(st.integers(0, len(mutant) - 1)):]
        else:
            i = data.draw(st.integers(0, len(mutant)))
            mutant[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    if bytes(mutant) == valid:
        return
    with pytest.raises(StateFileError):
        parse_state_file(bytes(mutant))


@FUZZ
@given(header=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3)),
       tail=st.binary(max_size=64))
def test_arbitrary_headers_raise_only_state_file_errors(header: object, tail: bytes) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(StateFileError):
        parse_state_file(struct.pack("<Q", len(raw)) + raw + tail)


def test_a_missing_file_is_a_state_file_error(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="no such state file"):
        read_state_file(tmp_path / "nope.state")


FP = Fingerprint(architecture="llama", weights="a" * 64, dtype="float32", kv_dtype="float32", block_size=16,
                 tokenizer="b" * 64)


@pytest.mark.parametrize("field, value", [("weights", "c" * 64), ("kv_dtype", "float16"), ("block_size", 8),
                                          ("tokenizer", "d" * 64), ("architecture", "qwen3"), ("dtype", "bfloat16")])
def test_a_fingerprint_mismatch_names_the_field(field: str, value: object) -> None:
    import dataclasses

    other = dataclasses.replace(FP, **{field: value})
    with pytest.raises(StateMismatchError, match=field) as info:
        FP.check(other, "x.state")
    assert info.value.field == field and info.value.found == value and info.value.expected == getattr(FP, field)
    FP.check(FP, "x.state")
    assert Fingerprint.from_json(FP.to_json(), "x") == FP
    with pytest.raises(StateFileError):
        Fingerprint.from_json({"architecture": "llama"}, "x")


def test_weights_hash_follows_the_bytes_not_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x01" * 1000)
    first = weights_hash(model)
    assert weights_hash(model) == first
    assert json.loads((tmp_path / "cache" / "weights-hashes.json").read_text())  # remembered on disk
    stat = weights.stat()
    weights.write_bytes(b"\x02" * 1000)  # re-quantized: same size, same name, same header
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights_hash(model) != first
    assert file_hash(weights) == __import__("hashlib").sha256(b"\x02" * 1000).hexdigest()
