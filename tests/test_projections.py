"""q/k/v and gate/up stacked into one weight at load (architectures/projections.py).

Stacking changes how many products run, not what they compute: every output
element is still its own row's dot product. So the stacked model must give the
separate model's logits (to float32 rounding of a different BLAS blocking), and
the loader must fall back to separate weights when the parts are stored
differently, as GGUF files do (v in Q6_K beside q and k in Q4_K).
"""

from __future__ import annotations

import numpy as np
import pytest

import infer
from infer.architecture import WeightLoader
from infer.backends.numpy import NumpyBackend
from infer.errors import ShapeMismatchError
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.ops import LoadSettings, QuantizedTensor
from infer.package import TensorSource
from reference import assert_logits_close, encode, tiny_model_dir
from test_parity import PROMPT


class DictSource(TensorSource):
    def __init__(self, tensors: dict[str, np.ndarray | QuantizedTensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def storage_dtype(self, name: str) -> str:
        t = self.tensors[name]
        return t.qtype if isinstance(t, QuantizedTensor) else str(t.dtype)

    def get(self, name: str) -> np.ndarray | QuantizedTensor:
        return self.tensors[name]


def q(qtype: str, rows: int, seed: int) -> GGUFQuantizedTensor:
    return GGUFQuantizedTensor(qtype, (rows, 256), gguf_quants.random_blocks(qtype, rows, 256, seed), f"t{seed}")


def test_stacks_alike_parts_and_refuses_mixed_ones() -> None:
    parts = [("a", (32, 256)), ("b", (16, 256))]
    ops = NumpyBackend().configure(LoadSettings(quantize="off"))
    floats = DictSource({"a": np.ones((32, 256), np.float32), "b": np.zeros((16, 256), np.float32)})
    stacked = WeightLoader(floats, ops).get_stacked("ab", parts)
    assert stacked.shape == (48, 256) and stacked[:32].all() and not stacked[32:].any()

    blocks = DictSource({"a": q("Q4_K", 32, 0), "b": q("Q4_K", 16, 1)})
    w = WeightLoader(blocks, ops).get_stacked("ab", parts)
    want = np.concatenate([blocks.tensors["a"].dequantize(), blocks.tensors["b"].dequantize()])
    assert np.array_equal(w, want)  # the rows are whole blocks: stacking the bytes stacks the values

    mixed = WeightLoader(DictSource({"a": q("Q4_K", 32, 0), "b": q("Q6_K", 16, 1)}), ops)
    assert mixed.get_stacked("ab", parts) is None and mixed.unused() == ["a", "b"]  # nothing read
    half = WeightLoader(DictSource({"a": q("Q4_K", 32, 0), "b": np.zeros((16, 256), np.float32)}), ops)
    assert half.get_stacked("ab", parts) is None

    loader = WeightLoader(floats, ops)
    with pytest.raises(ShapeMismatchError, match="'b'"):
        loader.get_stacked("ab", [("a", (32, 256)), ("b", (17, 256))])
    assert loader.get_stacked("ab", parts) is not None
    assert loader.unused() == [] and sum(loader.placements.values()) == 2


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "gemma3"])
def test_stacked_and_separate_projections_give_the_same_logits(variant: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir(variant)
    prompt = encode(path, PROMPT)
    stacked = infer.load(path, backend="numpy")
    layer = stacked.network.layers[0]
    assert "qkv_proj" in layer.weights and "gate_up_proj" in layer.weights
    monkeypatch.setattr(WeightLoader, "get_stacked", lambda self, name, parts: None)
    separate = infer.load(path, backend="numpy")
    assert "q_proj" in separate.network.layers[0].weights and "gate_proj" in separate.network.layers[0].weights
    a, b = (m.backend.to_numpy(m.engine.forward(m.engine.new_sequence(), prompt, all_logits=True))
            for m in (stacked, separate))
    assert_logits_close(a, b, "stacked vs separate projections")  # two BLAS shapes: other summation orders
    if variant == "qwen2":
        assert "qkv_proj.bias" in layer.weights


def test_parts_one_after_another_in_a_gguf_file_stack_as_a_view_of_it(tmp_path) -> None:
    """gate and up follow each other in llama.cpp's files: their stack is the file's bytes, not
    a copy, and the same bytes a copy would hold; parts apart in the file are copied."""
    import gguf

    from infer.formats.gguf_file import read_gguf

    blocks = {name: gguf_quants.random_blocks("Q8_0", rows, 256, seed)
              for seed, (name, rows) in enumerate([("gate", 32), ("up", 32), ("between", 8), ("other", 16)])}
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, raw in blocks.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    file = read_gguf(tmp_path / "t.gguf")
    parts = {name: GGUFQuantizedTensor("Q8_0", (rows, 256), file.raw(file.tensors[name]), name, file,
                                       file.tensors[name].begin)
             for name, rows in [("gate", 32), ("up", 32), ("other", 16)]}
    gate, up, other = parts["gate"], parts["up"], parts["other"]
    adjacent = gate.stacked([gate, up])
    assert adjacent.shape == (64, 256) and np.shares_memory(adjacent.raw, gate.raw)
    assert np.array_equal(adjacent.raw, np.concatenate([blocks["gate"], blocks["up"]]))
    assert np.array_equal(adjacent.dequantize(), np.concatenate([gate.dequantize(), up.dequantize()]))
    apart = gate.stacked([gate, other])  # "between" lies between them: copied
    assert not np.shares_memory(apart.raw, gate.raw)
    assert np.array_equal(apart.raw, np.concatenate([blocks["gate"], blocks["other"]]))
    assert not np.shares_memory(gate.stacked([up, gate]).raw, gate.raw)  # out of file order: copied
