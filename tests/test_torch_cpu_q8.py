"""torch/cpu on int8 activations (``activations="q8"``): the quantized products
are the C kernels' (backends/cpu/kernels.py, the one door numpy uses too), run
on the tensors' memory.

What is exact, and so asserted bit for bit: a product on torch/cpu is the
numpy backend's product (the same kernel on the same float32 input); the
recorded decode step quantizes as the eager one does. What is approximate: a
whole model's logits on torch/cpu and on numpy differ by the float rounding of
the ops around the products (torch's own norms, attention, elementwise ops),
and in q8 mode such a difference can move an activation across an int8
rounding boundary, a step of max|x| / 127 in one value of a 32-value block.
So the models' logits are held to a bound well below what the int8 rounding
itself moves them (asserted beside it), and to the same greedy tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import infer
from infer.backends.cpu import kernels
from infer.errors import InvalidQuantizationError
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.backends.numpy import NumpyBackend
from infer.ops import LoadSettings, PackedWeight
from infer.quantize import quantize_affine
from reference import tiny_model_dir

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not kernels.ACTIVATION_SCHEMES, reason="the C kernels are not built here")

from infer.backends import torch_cpu  # noqa: E402 - after torch is known to import
from infer.backends.torch import TorchBackend  # noqa: E402

@pytest.fixture(autouse=True, scope="module")
def _torch_bound() -> None:
    TorchBackend("cpu")  # binds torch into torch_cpu and registers infer::affine_linear


#: The GGUF types the issue names (Q4_K_M files hold Q4_K and Q6_K), and the legacy two.
QTYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0"]


def test_torch_cpu_lists_the_kernels_schemes_and_other_devices_none() -> None:
    assert TorchBackend("cpu").activation_schemes == kernels.ACTIVATION_SCHEMES == frozenset({"q8"})
    # Not a CPU tensor's memory: no C kernels, so no int8 activations (torch/cuda, torch/mps).
    assert TorchBackend.activation_schemes == frozenset()
    bf16 = TorchBackend("cpu", dtype="bfloat16")  # the kernels widen x to float32 first: still theirs
    assert bf16.activation_schemes == frozenset({"q8"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_cuda_refuses_q8_activations_by_name() -> None:
    with pytest.raises(InvalidQuantizationError, match="torch/cuda has no activation quantization 'q8'"):
        TorchBackend("cuda").configure(LoadSettings(activations="q8"))


def test_a_backend_without_the_kernels_refuses_q8_activations() -> None:
    ops = TorchBackend("cpu")
    ops.activation_schemes = frozenset()  # as torch/cuda, or a CPU where the kernels are not built
    with pytest.raises(InvalidQuantizationError, match="torch/cpu has no activation quantization 'q8'"):
        ops.configure(LoadSettings(activations="q8"))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 40])  # 1: the one-row kernels; 40: past the 16 rows of the exact kernel
def test_a_product_is_the_numpy_backends_bit_for_bit(qtype: str, m: int) -> None:
    n, k = 48, 512
    blocks = GGUFQuantizedTensor(qtype, (n, k), gguf_quants.random_blocks(qtype, n, k, 3), "w")
    kept = torch_cpu.kept_for_kernels(blocks)
    assert kept is not None
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    _, w, views = kept.data
    got = torch_cpu.affine_linear(torch.from_numpy(x), w, views, False, q8=True).numpy()
    want = np.empty((m, n), np.float32)
    kernels.affine_gemv(x, w, want, q8=True)
    np.testing.assert_array_equal(got, want)
    exact = np.empty((m, n), np.float32)
    kernels.affine_gemv(x[:1], w, exact[:1])
    assert not np.array_equal(got[:1], exact[:1])  # int8 activations from one row on (decoding too)


def test_the_compiled_op_carries_q8_in_its_bits() -> None:
    # Under torch.compile the product is the custom op infer::affine_linear: q8 rides in its bits.
    n, k, m = 32, 256, 6
    blocks = GGUFQuantizedTensor("Q4_K", (n, k), gguf_quants.random_blocks("Q4_K", n, k, 5), "w")
    kept = torch_cpu.kept_for_kernels(blocks)
    _, w, views = kept.data
    x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    form, group = kernels.kernel_args(w)[0], kernels.kernel_args(w)[6]
    got = torch.ops.infer.affine_linear(torch.from_numpy(x), *views, form | kernels.Q8_FLAG, group, 0.0).numpy()
    want = np.empty((m, n), np.float32)
    kernels.affine_gemv(x, w, want, q8=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scheme", ["q4", "q8"])
def test_on_load_quantized_weights_take_the_kernels_affine_form(scheme: str) -> None:
    # With q8 activations, on-load q4/q8 is the numpy backend's affine form (not
    # int4pack/int8pack, which the kernels do not read), so the products match numpy's.
    model = infer.load(tiny_model_dir("llama3"), backend="torch:cpu", quantize=scheme, activations="q8",
                       compile=False)
    w = model.backend  # the configured backend
    assert w.activations == "q8"
    host = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    kept = w.prepare_weight(host, name="model.layers.0.mlp.up_proj.weight")
    assert kept.data[0] == "affine"
    want = quantize_affine(host, scheme, name="model.layers.0.mlp.up_proj.weight")
    np.testing.assert_array_equal(kept.data[1].packed, want.packed)


def _tiny_gguf(tmp: Path, family: str, kind: str) -> Path:
    """A tiny model with rows of 256 (K-quant super-blocks) written as ``kind``."""
    heads = dict(num_attention_heads=4) if family == "smollm2_like" else {}  # 256 / 6 heads is no head size
    src = tiny_model_dir(family, hidden_size=256, intermediate_size=512, **heads)
    return infer.convert(src, tmp / f"{family}-{kind}.gguf", type=kind, progress=False)


def _logits(model: infer.Model, ids: list[int]) -> np.ndarray:
    seq = model.engine.new_sequence()
    rows = model.backend.to_numpy(model.engine.forward(seq, ids, all_logits=True)).astype(np.float64)
    model.engine.release(seq)
    rows -= rows.max(-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(-1, keepdims=True))  # log-probabilities


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float((np.exp(p) * (p - q)).sum(-1).mean())


#: A Q4_K_M file holds Q4_K and Q6_K (and Q5_0/Q8_0 where rows are not 256-blocks); the legacy two apart.
MODELS = [("smollm2_like", "q4_k_m"), ("smollm2_like", "q8_0"), ("smollm2_like", "q4_0"), ("gemma3", "q4_k_m")]


@pytest.mark.parametrize("family,kind", MODELS)
def test_torch_cpu_q8_runs_numpys_products(family: str, kind: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_gguf(tmp_path, family, kind)
    ids = list(range(3, 60))
    products: list[tuple[np.ndarray, object, np.ndarray, bool]] = []
    real = kernels.affine_gemv

    def spy(x2: np.ndarray, w: object, out: np.ndarray, q8: bool = False) -> None:
        real(x2, w, out, q8)
        products.append((x2.copy(), w, out.copy(), q8))

    monkeypatch.setattr(kernels, "affine_gemv", spy)  # torch/cpu's door to the products
    torch_q8 = _logits(infer.load(path, backend="torch:cpu", activations="q8", compile=False), ids)
    monkeypatch.undo()
    # Each product of the torch/cpu forward is, bit for bit, what the numpy backend in
    # q8 mode computes for the same rows and weight (its own code path to the kernel).
    numpy_ops = NumpyBackend().configure(LoadSettings(activations="q8"))
    qtypes = set()
    assert len(products) >= 7  # every projection of the first layer at least
    for x, w, out, q8 in products:
        assert q8, "a quantized product on torch/cpu ran with exact activations"
        weight = kernels.with_kernel_args(PackedWeight(w.shape, w.qtype, "", w, rows=w))
        np.testing.assert_array_equal(out, numpy_ops.linear(x, weight))
        qtypes.add(w.qtype)
    assert {"Q4_K", "Q6_K"} <= qtypes if kind == "q4_k_m" else kind.upper() in qtypes
    # The whole model: torch's own float ops around the products (norms, attention,
    # elementwise) round differently from numpy's, and in q8 mode that can move a value
    # across an int8 rounding step, so the logits are not bit-equal; measured on these
    # files (2026-12-05), KL(numpy q8 || torch q8) is 0.0-0.31x KL(exact || q8), and the
    # top tokens agree at every position. Products left exact on torch would make the
    # two KLs about equal.
    numpy_q8 = _logits(infer.load(path, backend="numpy", activations="q8", compile=False), ids)
    exact = _logits(infer.load(path, backend="numpy", compile=False), ids)
    assert _kl(numpy_q8, torch_q8) < 0.75 * _kl(exact, numpy_q8)
    assert (torch_q8.argmax(-1) == numpy_q8.argmax(-1)).mean() >= 0.95


def test_batched_decoding_on_torch_cpu_records_the_quantized_products() -> None:
    # Several sequences decode through the recorded step (two or more rows: quantized);
    # the eager forward quantizes the same rows, so both give the same tokens.
    from infer.engine.batch import BatchEngine
    from infer.engine.generate import StopConditions
    from infer.engine.sampling import SamplingParams

    prompts = [list(range(3, 30)), [9, 8, 7, 6], list(range(50, 63))]
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    results = []
    for compile_ in (False, None):  # eager; the recorded step (torch/cpu's default in float32)
        model = infer.load(tiny_model_dir("llama3"), backend="torch:cpu", quantize="q8", activations="q8",
                           compile=compile_)
        batch = BatchEngine(model.engine)
        handles = [batch.submit(p, SamplingParams(), stop) for p in prompts]
        batch.run_until_done()
        results.append([h.tokens for h in handles])
    assert results[0] == results[1]
    # The program records the numpy backend's ops configured as this load: q8 included.
    step = model.backend.compile(lambda x: x, static=True)
    assert step.ops.activations == "q8"
