"""Quantized weights: native layouts dequantize bit-exactly to GGUF's values, and
on-load quantization (``quantize="q8" | "q4"``) is checked and bounded.

"Bit-exact" is checked through each backend's own kernels: ``linear`` of the
packed weight with the identity matrix gives the weight's transpose (each output
is one product ``1 * w`` plus exact zeros), and ``embedding`` gives its rows.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from infer.errors import InvalidQuantizationError
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.ops import LoadSettings, PackedWeight
from infer.quantize import AffineTensor, from_gguf, quantize_affine

LINEAR = "model.layers.0.mlp.up_proj.weight"
EMBED = "model.embed_tokens.weight"
UNMAPPED = ("Q6_K", "Q2_K", "Q3_K", "IQ4_XS")


def gguf_tensor(qtype: str, rows: int, cols: int, seed: int) -> GGUFQuantizedTensor:
    raw = gguf_quants.random_blocks(qtype, rows, cols, seed)
    return GGUFQuantizedTensor(qtype, (rows, cols), raw, f"random {qtype}")


def numpy_kernels_built() -> bool:
    from infer.backends import numpy as numpy_backend

    return numpy_backend._affine is not None


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32),
                                                 b.astype(np.float32).view(np.uint32))


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit but for the sign of zero: GGML's ``(q - 32) * d`` is -0.0
    where a negative scale meets the zero point, the affine ``scale * code +
    bias`` is +0.0 (adding 0 makes every -0.0 +0.0 and changes nothing else)."""
    zero = np.float32(0)
    return same_bits(a.astype(np.float32) + zero, b.astype(np.float32) + zero)


def weight_through_kernel(ops, weight) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The weight as the backend's matmul sees it: ``linear(I, w).T``."""
    cols = weight.shape[1]
    return ops.to_numpy(ops.linear(ops.from_numpy(np.eye(cols, dtype=np.float32)), weight)).T


@pytest.mark.parametrize("qtype", sorted(gguf_quants.AFFINE_BITS))
def test_affine_form_equals_dequantize_fused_and_unfused(qtype: str) -> None:
    for seed in range(3):
        t = gguf_tensor(qtype, 8, 512, seed)
        a = from_gguf(t, groups=(16, 32))
        assert a is not None and a.codes().max() < 2 ** a.bits
        want = t.dequantize()
        assert same_values(a.dequantize(), want)
        s, b = (np.repeat(v, a.group, axis=1).astype(np.float64) for v in (a.scales, a.biases))
        assert same_values((s * a.codes() + b).astype(np.float32), want)  # one rounding (fma)


@pytest.mark.parametrize("qtype", sorted(gguf_quants.AFFINE_BITS))
def test_the_compact_form_is_the_unpacked_form_packed(qtype: str) -> None:
    # What the GGUF reader hands out (4-bit codes packed in GGML's nibble order
    # turned to column order, stored float16 scales kept) is the unpacked form, exactly.
    for seed in range(3):
        t = gguf_tensor(qtype, 8, 512, seed)
        raw = t.raw.reshape(8, -1)
        codes, scales, biases = gguf_quants.affine_groups(raw, qtype, 512)
        c, s, b = gguf_quants.affine_groups(raw, qtype, 512, compact=True)
        want = AffineTensor(qtype, (8, 512), gguf_quants.AFFINE_BITS[qtype], codes, scales, biases,
                            gguf_quants.AFFINE_GROUP[qtype])
        assert np.array_equal(c, want.packed)
        assert same_bits(s, scales) and same_bits(b, biases)
        if qtype in ("Q4_0", "Q4_1", "Q8_0"):
            assert s.dtype == b.dtype == np.float16


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_bias_past_float16_keeps_float32_scales(qtype: str) -> None:
    # Q4_0's bias is -8 d: a d of 30000 (a float16) gives -240000, past float16's range.
    t = gguf_tensor(qtype, 2, 64, 0)
    raw = t.raw.reshape(2, -1).copy()
    raw[0, 0:2] = np.frombuffer(np.float16(30000).tobytes(), np.uint8)
    c, s, b = gguf_quants.affine_groups(raw, qtype, 64, compact=True)
    assert s.dtype == b.dtype == np.float32 and b[0, 0] == np.float32(30000) * (-8 if qtype == "Q4_0" else -128)
    a = from_gguf(GGUFQuantizedTensor(qtype, (2, 64), raw, "big"), half=True)
    assert a is not None and a.scales.dtype == np.float32
    assert same_values(a.dequantize(), GGUFQuantizedTensor(qtype, (2, 64), raw, "big").dequantize())


@pytest.mark.parametrize("qtype", sorted(gguf_quants.AFFINE_BITS))
def test_from_gguf_gives_float32_scales_unless_half_is_asked_for(qtype: str) -> None:
    t = gguf_tensor(qtype, 8, 512, 1)
    plain, half = from_gguf(t, groups=(16, 32)), from_gguf(t, groups=(16, 32), half=True)
    assert plain is not None and half is not None
    assert plain.scales.dtype == plain.biases.dtype == np.float32  # torch and MLX build from these
    assert np.array_equal(plain.packed, half.packed) and same_values(half.dequantize(), plain.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q8_0"])
def test_affine_scales_need_float32(qtype: str) -> None:
    # Why kernels get float32 scales: float16 d has 11 significant bits (bfloat16 holds 8),
    # and Q4_K's d * sc up to 17 (float16 holds 11), so 16-bit scales would change values.
    torch = pytest.importorskip("torch")

    a = from_gguf(gguf_tensor(qtype, 16, 512, 4))
    assert a is not None
    s = torch.from_numpy(a.scales)
    assert not torch.equal(s.to(torch.bfloat16).float(), s)
    if qtype == "Q4_K":
        assert not torch.equal(s.to(torch.float16).float(), s)
    else:
        assert torch.equal(s.to(torch.float16).float(), s)  # d itself is a float16


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q8_0"])
def test_large_matrices_convert_in_slabs_releasing_the_file_as_they_go(monkeypatch, qtype: str) -> None:  # type: ignore[no-untyped-def]
    """A matrix larger than ``CONVERT_BYTES`` converts a slab of rows at a
    time, each slab's stored rows released once read: the same arrays as in
    one piece, and every row released exactly once, in order."""
    import infer.quantize as quantize

    t = gguf_tensor(qtype, 50, 512, 7)
    whole = from_gguf(t, groups=(16, 32))
    released: list[tuple[int, int]] = []
    monkeypatch.setattr(t, "release_rows", lambda a, b: released.append((a, b)), raising=False)
    monkeypatch.setattr(quantize, "CONVERT_BYTES", 7 * t.raw.reshape(50, -1).shape[1])  # 7 rows a slab
    slabs = from_gguf(t, groups=(16, 32))
    assert whole is not None and slabs is not None
    for name in ("packed", "scales", "biases"):
        assert np.array_equal(getattr(slabs, name), getattr(whole, name)), name
    assert released == [(r, min(50, r + 7)) for r in range(0, 50, 7)]


def test_gguf_rows_are_the_rows_of_the_whole_tensor() -> None:
    t = gguf_tensor("Q4_K", 12, 256, 1)
    ids = np.array([11, 0, 5, 5])
    assert same_bits(t.dequantize_rows(ids), t.dequantize()[ids])


# -- torch: int4pack ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_q() -> object:
    pytest.importorskip("torch")
    from infer.backends.torch import TorchBackend

    # int4pack is used when quantized compute is asked for (see keeps_gguf)
    ops = TorchBackend("cpu").configure(LoadSettings(quantize="q4"))
    ops._kernels = None  # and numpy's C kernels are not built (with them, the affine form: below)
    return ops


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_torch_int4pack_is_bit_exact_with_gguf(torch_q, qtype: str) -> None:  # type: ignore[no-untyped-def]
    for seed, (rows, cols) in enumerate([(16, 256), (48, 512), (64, 1024)]):
        t = gguf_tensor(qtype, rows, cols, seed)
        w = torch_q.prepare_weight(t, name=EMBED)
        assert isinstance(w, PackedWeight) and w.scheme == "int4pack g32 f32"
        assert same_bits(weight_through_kernel(torch_q, w), t.dequantize())
        ids = np.array([rows - 1, 0, 3], np.int32)
        rows_got = torch_q.to_numpy(torch_q.embedding(w, torch_q.from_numpy(ids)))
        assert same_bits(rows_got, t.dequantize()[ids])


def test_torch_falls_back_to_exact_floats(torch_q) -> None:  # type: ignore[no-untyped-def]
    # 40 output rows: the CPU packing wants multiples of 16; Q8_0/Q5_0/Q6_K: no exact int4 form.
    for qtype, rows in [("Q4_0", 40), ("Q8_0", 32), ("Q5_0", 32), ("Q6_K", 32)]:
        t = gguf_tensor(qtype, rows, 256, 3)
        w = torch_q.prepare_weight(t, name=LINEAR)
        assert not isinstance(w, PackedWeight)
        assert same_bits(torch_q.to_numpy(w), t.dequantize())


def test_torch_keeps_gguf_float_by_default_without_the_c_kernels() -> None:
    pytest.importorskip("torch")
    from infer.backends.torch import TorchBackend

    ops = TorchBackend("cpu")
    ops._kernels = None
    assert not isinstance(ops.prepare_weight(gguf_tensor("Q4_0", 16, 256, 0), name=LINEAR), PackedWeight)


@pytest.mark.parametrize("qtype", sorted(gguf_quants.AFFINE_BITS))
def test_torch_cpu_computes_gguf_blocks_with_the_c_kernels_exactly(qtype: str) -> None:
    # By default torch/cpu keeps every GGUF type with an affine form in it and runs the
    # numpy backend's kernels on it: products and embedding rows equal the dequantized
    # float32 weights, for one row (decoding) and past the kernel's 16 (prefill's slabs).
    pytest.importorskip("torch")
    from infer.backends.torch import TorchBackend

    ops = TorchBackend("cpu")
    if ops._kernels is None:
        pytest.skip("numpy's C kernels are not built")
    rows, cols = (48, 512)
    t = gguf_tensor(qtype, rows, cols, 2)
    w = ops.prepare_weight(t, name=EMBED)
    assert isinstance(w, PackedWeight) and w.scheme.endswith("C kernel")
    want = t.dequantize()
    assert same_values(weight_through_kernel(ops, w), want)  # 512 rows of x: the slab path
    x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
    got = ops.to_numpy(ops.linear(ops.from_numpy(x), w))
    np.testing.assert_allclose(got, x @ want.T, rtol=2e-5, atol=2e-5)  # the kernel's own summation order
    ids = np.array([rows - 1, 0, 3], np.int32)
    assert same_values(ops.to_numpy(ops.embedding(w, ops.from_numpy(ids))), want[ids])
    off = TorchBackend("cpu").configure(LoadSettings(quantize="off"))
    assert not isinstance(off.prepare_weight(t, name=LINEAR), PackedWeight)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_torch_cpu_keeps_the_k_types_as_the_file_stores_them(qtype: str) -> None:
    # torch/cpu hands numpy's kernels a view of the blocks, converting nothing: the
    # numpy backend's bits for decoding's rows, eagerly and through the compiled
    # op (infer::affine_linear, which torch.compile calls), which takes the block
    # form as its bits.
    torch = pytest.importorskip("torch")
    from infer.backends.numpy import NumpyBackend, kernel_args
    from infer.backends.torch import TorchBackend

    ops = TorchBackend("cpu")
    if ops._kernels is None:
        pytest.skip("numpy's C kernels are not built")
    t = gguf_tensor(qtype, 40, 512, 3)
    w = ops.prepare_weight(t, name=LINEAR)
    assert w.scheme == f"{qtype} blocks as stored, C kernel" and w.data[1] is t
    blocks, empty, _ = w.data[2]
    assert np.shares_memory(blocks.numpy(), t.raw)
    numpy_ops = NumpyBackend()
    nw = numpy_ops.prepare_weight(t, name=LINEAR)
    form, group = kernel_args(t)[0], kernel_args(t)[6]
    for m in (1, 3):
        x = np.random.default_rng(m).standard_normal((m, 512)).astype(np.float32)
        want = numpy_ops.linear(x, nw)
        assert same_bits(ops.to_numpy(ops.linear(ops.from_numpy(x), w)), want)
        compiled = torch.ops.infer.affine_linear(torch.from_numpy(x), blocks, empty, empty, form, group, 0.0)
        assert same_bits(compiled.numpy(), want)


def test_torch_cuda_quantizes_only_where_the_kernel_probe_passes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # torch's CUDA int4 kernel is private and its packing has changed between
    # releases: it is used only where a probe on the device reproduces the
    # formula (the probe itself runs in the CUDA tests below).
    torch = pytest.importorskip("torch")
    from infer.backends import torch as torch_backend
    from infer.backends.torch import TorchBackend

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch_backend, "_cuda_int4_layout", lambda: None)
    ops = TorchBackend("cuda")  # no tensor is made on the device here
    ops.settings = LoadSettings(quantize="q4")  # asked for where it has no scheme, which configure() refuses
    assert ops.quantize_schemes == frozenset() and not ops.keeps_gguf()
    assert not ops.supports("quantized_linear")

    monkeypatch.setattr(torch_backend, "_cuda_int4_layout", lambda: "even-high")
    monkeypatch.setattr(torch_backend, "_cuda_int8_works", lambda: False)
    ops = TorchBackend("cuda")
    assert ops.quantize_schemes == frozenset({"q4"}) and ops.supports("quantized_linear")
    # tinygemm takes bfloat16 activations only: float32 compute keeps floats.
    assert TorchBackend("cuda", "float32").quantize_schemes == frozenset()


@pytest.mark.parametrize("layout", ["even-high", "even-low"])
def test_cuda_nibble_packing_round_trips(layout: str) -> None:
    pytest.importorskip("torch")
    from infer.backends.torch import _nibbles

    codes = np.random.default_rng(0).integers(0, 16, (8, 64), dtype=np.uint8)
    packed = _nibbles(codes, layout)
    first, second = packed >> 4, packed & 15
    even, odd = (first, second) if layout == "even-high" else (second, first)
    assert packed.shape == (8, 32) and np.array_equal(even, codes[:, 0::2]) and np.array_equal(odd, codes[:, 1::2])


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA = pytest.mark.skipif(not _cuda(), reason="no CUDA device")


@CUDA
def test_cuda_int4_probe_finds_the_packing() -> None:
    from infer.backends.torch import _cuda_int4_layout

    assert _cuda_int4_layout() in ("even-high", "even-low")


@CUDA
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_cuda_int4_matches_gguf_within_bfloat16_scales(qtype: str) -> None:
    from infer.backends.torch import TorchBackend

    ops = TorchBackend("cuda").configure(LoadSettings(quantize="q4"))
    block = gguf_quants.TYPES_BY_NAME[qtype].block_size
    for seed, (rows, cols) in enumerate([(64, 256), (48, 576), (128, 1536)]):
        cols = -(-cols // block) * block  # Q4_K's 256-wide blocks: 576 -> 768
        t = gguf_tensor(qtype, rows, cols, seed)
        w = ops.prepare_weight(t, name=LINEAR)
        assert isinstance(w, PackedWeight) and w.scheme == "int4 tinygemm g32 bf16"
        got = weight_through_kernel(ops, w).astype(np.float64)
        want = t.dequantize().astype(np.float64)
        # tinygemm computes (code - 8) * scale + zero with scale and zero rounded
        # to bfloat16 (relative 2^-9 each, times |code - 8| <= 8) and rounds the
        # output to bfloat16: at most about 2^-7 of the group's largest |w|.
        # A wrong packing or scale layout is off by the weights' own size.
        group_max = np.abs(want).reshape(rows, -1, 32).max(axis=-1, keepdims=True)
        err = np.abs(got - want).reshape(rows, -1, 32)
        assert (err <= group_max * 2.0**-6 + 1e-30).all(), f"{qtype}: worst {(err / group_max).max():.2e} of max|w|"
        x = np.random.default_rng(seed).standard_normal((3, cols)).astype(np.float32)
        y = ops.to_numpy(ops.linear(ops.from_numpy(x), w)).astype(np.float64)
        ref = x.astype(np.float64) @ want.T
        # The weights err by <= 2^-6 of their group's max (above) and bfloat16
        # activations by 2^-9: a product's relative rms error stays well under 1e-2.
        assert np.linalg.norm(y - ref) <= 1e-2 * np.linalg.norm(ref)


@CUDA
@pytest.mark.parametrize("scheme", ["q4", "q8"])
def test_cuda_on_load_quantization_stays_close_to_the_cpu_path(scheme: str) -> None:
    import infer
    from reference import encode, tiny_model_dir
    from test_parity import PROMPT

    path = tiny_model_dir("llama3")
    gpu = infer.load(path, backend="torch:cuda", dtype="bfloat16", quantize="q4") if scheme == "q4" else None
    if scheme == "q8":
        try:
            gpu = infer.load(path, backend="torch:cuda", dtype="bfloat16", quantize="q8")
        except InvalidQuantizationError:
            pytest.skip("this torch has no CUDA int8 kernel (the probe said so)")
    cpu = infer.load(path, backend="torch:cpu", quantize=scheme)
    assert isinstance(gpu.network.layers[0].weights["gate_up_proj"], PackedWeight)
    prompt = encode(path, PROMPT)
    got = gpu.backend.to_numpy(gpu.engine.forward(gpu.engine.new_sequence(), prompt, all_logits=True))
    want = cpu.backend.to_numpy(cpu.engine.forward(cpu.engine.new_sequence(), prompt, all_logits=True))
    # Same codes on both; the GPU computes in bfloat16 (activations and
    # scales), the CPU in float32: bfloat16-sized differences, not layout errors.
    rel = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert rel < 3e-2, rel


@pytest.mark.parametrize("scheme", ["q4", "q8"])
def test_torch_on_load_quantization(torch_q, scheme: str) -> None:  # type: ignore[no-untyped-def]
    from infer.backends.torch import TorchBackend

    ops = TorchBackend("cpu").configure(LoadSettings(quantize=scheme))
    w = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32) * 0.05
    packed = ops.prepare_weight(w, name=EMBED)
    assert isinstance(packed, PackedWeight)
    got = weight_through_kernel(ops, packed)
    bound = (np.abs(w).max(axis=1, keepdims=True) / 127) if scheme == "q8" else 0.6 * np.ptp(w) / 15
    assert np.all(np.abs(got - w) <= bound * 1.01)
    # embedding rows are the same values the matmul uses
    rows = ops.to_numpy(ops.embedding(packed, ops.from_numpy(np.array([3, 0], np.int32))))
    # Both dequantize the same codes (code * scale + bias, float32): one rounding
    # each, maybe in another order (<= 2 u relative, ~1e-7 absolute at |w| ~ 0.05).
    np.testing.assert_allclose(rows, got[[3, 0]], rtol=2e-6, atol=1e-7)
    norm = ops.prepare_weight(np.ones((64,), np.float32), name="model.norm.weight")
    assert not isinstance(norm, PackedWeight)


# -- MLX: affine quantized_matmul -----------------------------------------------------


@pytest.fixture(scope="module")
def mlx_ops() -> object:
    pytest.importorskip("mlx.core")
    from infer.backends.mlx import MLXBackend

    # mlx/cpu keeps GGUF weights quantized when quantized compute is asked for
    return MLXBackend("float32", "cpu").configure(LoadSettings(quantize="q4"))


def test_mlx_cpu_dequantizes_gguf_by_default() -> None:
    pytest.importorskip("mlx.core")
    from infer.backends.mlx import MLXBackend

    ops = MLXBackend("float32", "cpu")
    t = gguf_tensor("Q4_1", 16, 256, 0)
    w = ops.prepare_weight(t, name=LINEAR)
    assert not isinstance(w, PackedWeight) and same_bits(ops.to_numpy(w), t.dequantize())


@pytest.mark.parametrize("qtype", sorted(q for q, group in gguf_quants.AFFINE_GROUP.items() if group == 32))
def test_mlx_affine_is_bit_exact_with_gguf(mlx_ops, qtype: str) -> None:  # type: ignore[no-untyped-def]
    import mlx.core as mx

    for seed, (rows, cols) in enumerate([(8, 256), (24, 512)]):
        t = gguf_tensor(qtype, rows, cols, seed)
        w = mlx_ops.prepare_weight(t, name=EMBED)
        assert isinstance(w, PackedWeight) and w.scheme.startswith("mlx affine")
        want = t.dequantize()
        wq, scales, biases, bits = w.data
        own = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=bits, stream=mx.cpu))
        assert same_bits(own, want)
        assert same_bits(weight_through_kernel(mlx_ops, w), want)
        ids = np.array([rows - 1, 0, 2], np.int32)
        assert same_bits(mlx_ops.to_numpy(mlx_ops.embedding(w, mlx_ops.from_numpy(ids))), want[ids])


@pytest.mark.parametrize("scheme", ["q8", "q4"])
def test_mlx_on_load_quantization_is_infers_affine_scheme(scheme: str) -> None:
    pytest.importorskip("mlx.core")
    from infer.backends.mlx import MLXBackend

    ops = MLXBackend("float32", "cpu").configure(LoadSettings(quantize=scheme))
    w = np.random.default_rng(2).standard_normal((24, 128)).astype(np.float32) * 0.05
    packed = ops.prepare_weight(w, name=LINEAR)
    assert isinstance(packed, PackedWeight) and packed.qtype == scheme
    assert same_bits(weight_through_kernel(ops, packed), quantize_affine(w, scheme).dequantize())
    assert not isinstance(ops.prepare_weight(np.ones(128, np.float32), name="model.norm.weight"), PackedWeight)


@pytest.mark.parametrize("qtype", UNMAPPED)
def test_mlx_unmapped_types_become_exact_float32(mlx_ops, qtype: str) -> None:  # type: ignore[no-untyped-def]
    t = gguf_tensor(qtype, 4, 256, 0)
    w = mlx_ops.prepare_weight(t, name=LINEAR)
    assert not isinstance(w, PackedWeight)
    assert same_bits(mlx_ops.to_numpy(w), t.dequantize())


def test_mlx_bfloat16_compute_keeps_float32_scales() -> None:
    pytest.importorskip("mlx.core")
    from infer.backends.mlx import MLXBackend

    ops = MLXBackend("bfloat16", "cpu").configure(LoadSettings(quantize="q4"))
    t = gguf_tensor("Q4_1", 8, 256, 5)
    w = ops.prepare_weight(t, name=LINEAR)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    y = ops.linear(ops.from_numpy(x), w)
    assert ops.dtype(y) == "bfloat16"
    xb = ops.to_numpy(ops.from_numpy(x))  # x as bfloat16 holds it
    # x is compared as bfloat16 holds it and the float32 scales keep the weights
    # exact, so what is left is the bfloat16 output's rounding (2^-9 = 0.2% of |y|,
    # |y| <= 9 here): rtol 1e-2 is 5x that; atol 1e-2 covers outputs near zero.
    np.testing.assert_allclose(ops.to_numpy(y), xb @ t.dequantize().T, rtol=1e-2, atol=1e-2)


# -- numpy: blocks kept when memory is short (types the C kernels do not take) --------------


def test_numpy_keeps_blocks_when_over_budget_and_results_are_identical() -> None:
    from infer.backends.numpy import NumpyBackend

    eager, lazy = NumpyBackend(), NumpyBackend()
    lazy.float_budget = 0
    lazy.cache_bytes = 0
    t = gguf_tensor("Q3_K", 16, 256, 2)  # no affine form: the memory rule decides
    we, wl = eager.prepare_weight(t, name=LINEAR), lazy.prepare_weight(t, name=LINEAR)
    assert isinstance(wl, PackedWeight) and not isinstance(we, PackedWeight)
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    assert same_bits(lazy.linear(x, wl), eager.linear(x, we))
    assert same_bits(lazy.linear(x[:1], wl), eager.linear(x[:1], we))
    ids = np.array([15, 1])
    assert same_bits(lazy.embedding(wl, ids), eager.embedding(we, ids))


def test_numpy_decides_from_available_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from infer.backends import numpy as numpy_backend
    from infer.backends.cpu import backend as cpu_backend  # where the numpy backend's ops look it up

    ops = numpy_backend.NumpyBackend()
    t = gguf_tensor("Q3_K", 16, 256, 0)  # no affine form: the memory rule decides
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: ops.HEADROOM + 16 * 256 * 4)
    assert not isinstance(ops.prepare_weight(t, name=LINEAR), PackedWeight)  # just fits
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: ops.HEADROOM + 16 * 256 * 4 - 1)
    assert isinstance(ops.prepare_weight(t, name=LINEAR), PackedWeight)
    off = ops.configure(LoadSettings(quantize="off"))  # never keeps anything quantized
    assert not isinstance(off.prepare_weight(t, name=LINEAR), PackedWeight)
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: None)  # unknown: dequantize
    assert not isinstance(ops.prepare_weight(t, name=LINEAR), PackedWeight)


def test_numpy_cache_keeps_the_first_weights_that_fit() -> None:
    from infer.backends.numpy import NumpyBackend

    ops = NumpyBackend()
    ops.float_budget = 0
    ops.cache_bytes = 16 * 256 * 4  # one weight
    a, b = (ops.prepare_weight(gguf_tensor("Q3_K", 16, 256, s), name=LINEAR) for s in (0, 1))
    x = np.ones((1, 256), np.float32)
    ops.linear(x, a), ops.linear(x, b), ops.linear(x, a)
    assert [w for w, _ in ops._cache.values()] == [a]


# -- on-load quantization: the host scheme and the option ------------------------------------


@pytest.mark.parametrize("scheme,bits", [("q8", 8), ("q4", 4)])
def test_quantize_affine_error_is_at_most_half_a_step(scheme: str, bits: int) -> None:
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    w[0, :32] = 0.25  # a constant group: scale 0, exact
    a = quantize_affine(w, scheme)
    step = np.repeat(a.scales, 32, axis=1)
    assert np.all(np.abs(a.dequantize() - w) <= step / 2 + 1e-6)
    assert np.all(a.dequantize()[0, :32] == 0.25)
    assert a.codes().max() <= 2 ** bits - 1
    assert isinstance(a, AffineTensor) and a.nbytes < w.nbytes


def test_invalid_quantize_values_are_typed_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import infer
    from infer.ops import Backend

    for bad in ("q3", "int4", 4, True):
        with pytest.raises(InvalidQuantizationError, match="quantize="):
            infer.load(tmp_path, quantize=bad)  # checked before the path is read
    with pytest.raises(InvalidQuantizationError, match="expected one of"):
        quantize_affine(np.zeros((2, 32), np.float32), "q2")
    assert Backend.quantize_schemes == frozenset()  # a third-party backend has none until it says so


def test_backend_without_schemes_refuses_on_load_quantization(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import infer
    from infer.backends.numpy import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "quantize_schemes", frozenset())
    from reference import tiny_model_dir

    with pytest.raises(InvalidQuantizationError, match="numpy/cpu has no on-load quantization 'q8'"):
        infer.load(tiny_model_dir("smollm2_like"), backend="numpy", quantize="q8")


def test_load_logs_one_summary_line(caplog) -> None:  # type: ignore[no-untyped-def]
    import infer
    from reference import tiny_model_dir

    with caplog.at_level(logging.INFO, logger="infer.loading"):
        infer.load(tiny_model_dir("smollm2_like"), backend="numpy", quantize="q8")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights on")]
    assert len(lines) == 1
    how = "C kernel" if numpy_kernels_built() else "dequantized per matmul"
    assert f"-> q8 group 32, {how}" in lines[0] and "-> float32" in lines[0]
