"""The CPU kernels (backends/cpu/*.c) the numpy backend computes on: products on affine-quantized
codes and few-row float32 products, on both code paths (AVX2+FMA and portable).

Tolerance: the kernels sum in float32 in another order than float64, so each
output may differ from the float64 product by a few float32 roundings of the
sum of absolute terms: 1e-6 * sum|x * w| bounds it for k <= 2048 (about
sqrt(k) * 2^-24 per row in practice; a wrong code, scale or nibble order is
off by the size of the terms themselves).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import infer
from infer.backends import numpy as numpy_backend
from infer.backends.cpu import backend as cpu_backend
from infer.backends.cpu import kernels as kernels_module
from infer.backends.numpy import kernel_args
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.ops import AttentionBatch, LoadSettings, PackedWeight
from infer.quantize import AffineTensor, from_gguf, quantize_affine

_affine = numpy_backend._affine
needs_kernels = pytest.mark.skipif(_affine is None, reason="the C kernels are not built here")
LINEAR = "model.layers.0.mlp.up_proj.weight"
#: Every code path this CPU can run (portable, avx2+fma, avx512): each test below runs on each.
PATHS = _affine.paths() if _affine is not None else []
#: Where ``_affine.attention``'s ``parallel`` argument sits: (q, k, v, out, tq, tk,
#: hq, hkv, dk, dv, scale, causal, window, softcap, table, block, parallel, sinks).
PARALLEL = 16


def one_sequence(tq: int, tk: int, capacity: int) -> AttentionBatch:
    """One sequence's ``tq`` queries at the end of its ``tk`` keys in a
    contiguous cache of ``capacity`` rows: one block of that size."""
    return AttentionBatch(np.array([0, tq], np.int32), np.array([tk], np.int32), np.zeros((1, 1), np.int32),
                          capacity, tq)


def in_pool(rows: np.ndarray, capacity: int) -> np.ndarray:
    """``rows`` at the start of a pool of ``capacity`` rows whose other rows are
    NaN: a key past the sequence's that were read would poison the output."""
    pool = np.full((capacity,) + rows.shape[1:], np.nan, np.float32)
    pool[:len(rows)] = rows
    return pool


def test_kernels_are_built_on_linux_x86() -> None:
    # CI runs here: a build that silently failed would put every GGUF model on
    # the slow float32 path, so it must fail a test instead.
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip("the build is only required on Linux x86-64")
    from infer.backends.cpu import _kernels as built  # built, whatever INFER_NUMPY_KERNELS chose

    assert built.simd() in ("avx512", "avx2+fma", "portable") and built.threads() >= 1


def _cpu_paths() -> list[str] | None:
    """The code paths /proc/cpuinfo says this CPU can run (None where there is nothing to read)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None
    avx2 = {"avx2", "fma", "f16c"} <= flags and platform.machine() == "x86_64"  # x86 paths on x86 only
    return ["portable"] + (["avx2+fma"] if avx2 else []) + (["avx512"] if avx2 and "avx512f" in flags else [])


def test_the_kernels_offer_exactly_the_paths_the_cpu_has() -> None:
    if _affine is None:
        pytest.skip("the C kernels are not built here")
    want = _cpu_paths()
    assert _affine.paths() == want if want is not None else _affine.paths()[0] == "portable"


@pytest.mark.parametrize("choice", ["auto", "avx2", "portable", "off", "bogus"])
def test_the_kernel_path_can_be_forced(choice: str) -> None:
    # INFER_NUMPY_KERNELS runs every path on one machine (the suite runs under each,
    # tests/README.md); it is read at import, so each choice in a fresh process.
    try:
        from infer.backends.cpu import _kernels as built  # noqa: F401
    except ImportError:
        pytest.skip("the C kernels are not built here")
    probe = "from infer.backends import numpy as n; k = n._affine; print(k.simd() if k else None)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, numpy_backend.KERNELS_ENV: choice})
    if choice == "bogus":
        assert out.returncode != 0
        assert "INFER_NUMPY_KERNELS='bogus' is not one of auto, avx512, avx2, portable, off" in out.stderr
        return
    cpu = _cpu_paths()
    if choice == "avx2" and cpu is not None and "avx2+fma" not in cpu:  # a path this CPU lacks is refused
        assert out.returncode != 0 and "this CPU runs only portable" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    got = out.stdout.strip()
    if choice != "auto":
        assert got == {"avx2": "avx2+fma", "portable": "portable", "off": "None"}[choice]
        return
    if cpu is None:  # nothing tells what the CPU has: any path may be the best one
        assert got in ("avx512", "avx2+fma", "portable")
    else:
        assert got == cpu[-1]  # the best it has


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    chosen = _affine.simd()
    _affine.use_simd(request.param)
    yield request.param
    _affine.use_simd(chosen)


def within_float32(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> bool:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-6 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30
    return got.shape == ref.shape and bool((np.abs(got - ref) <= bound).all())


def affine(kind: int | str, n: int, k: int, seed: int) -> AffineTensor:
    """4 or 8: on-load quantization (float32 scales); a GGML type: its affine
    form as the backend holds it (float16 scales where exact; Q6_K: groups of 16)."""
    if isinstance(kind, int):
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        return quantize_affine(w, f"q{kind}")
    raw = gguf_quants.random_blocks(kind, n, k, seed)
    a = from_gguf(GGUFQuantizedTensor(kind, (n, k), raw, f"random {kind}"), groups=(16, 32))
    assert a is not None
    return a.half_scales()


# Every form the kernel takes: 4- and 8-bit codes with float32 scales (q4, q8, Q4_K),
# float16 ones (Q4_1, Q8_0), 5-bit codes one per byte (Q5_0 and Q5_1 with float16
# scales, Q5_K with float32 ones), and Q6_K's 6-bit codes in groups of 16.
KINDS = [4, 8, "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]


def gemv(a: AffineTensor, x: np.ndarray, out: np.ndarray) -> None:
    """The kernel as the backend calls it (symmetric types with no biases held)."""
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(a)
    _affine.gemv(bits, x, codes, scales, biases, out, x.shape[0], k, n, group, half, factor)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0", "Q6_K"])
def test_symmetric_types_hold_no_biases_and_compute_the_same_bits(path: str, kind: str) -> None:
    # Their biases are -2^(bits-1) times their scales, exactly: the kernel makes
    # them from the scales, and gives what it gives with the biases read from memory.
    a = affine(kind, 37, 512, 5)
    assert a.stored_biases is None and a.bias_factor == -float(2 ** (a.bits - 1))
    assert a.nbytes == a.packed.nbytes + a.scales.nbytes
    held = AffineTensor(a.qtype, a.shape, a.bits, a.packed, a.scales, a.biases, a.group)
    assert np.array_equal(held.biases.view(np.uint8), (a.scales * a.scales.dtype.type(a.bias_factor)).view(np.uint8))
    for m in (1, 3):
        x = np.random.default_rng(m).standard_normal((m, 512)).astype(np.float32)
        made, read = np.empty((m, 37), np.float32), np.empty((m, 37), np.float32)
        gemv(a, x, made)
        gemv(held, x, read)
        assert np.array_equal(made.view(np.uint32), read.view(np.uint32))
    assert np.array_equal(a.dequantize().view(np.uint32), held.dequantize().view(np.uint32))
    rows = np.array([3, 0, 36])
    assert np.array_equal(a.dequantize_rows(rows), held.dequantize_rows(rows))
    slab = np.empty((37, 512), np.float32)
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(a)
    _affine.dequantize(bits, codes, scales, biases, slab, n, k, True, group, half, factor)
    assert np.array_equal(slab.view(np.uint32), held.dequantize().view(np.uint32))
    # Asymmetric types keep theirs.
    assert affine("Q4_1", 4, 256, 0).stored_biases is not None and affine("Q4_K", 4, 256, 0).stored_biases is not None


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_gemv_on_codes_matches_the_dequantized_product(path: str, kind: int | str, m: int) -> None:
    shapes = [(1, 32), (5, 96), (64, 576), (33, 2048)] if isinstance(kind, int) or not kind.endswith("_K") else \
        [(1, 256), (5, 768), (33, 2048)]  # K types come in blocks of 256
    for seed, (n, k) in enumerate(shapes):
        a = affine(kind, n, k, seed)
        x = np.random.default_rng(100 + seed).standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)  # poisoned: every element must be written
        gemv(a, x, out)
        assert within_float32(out, x, a.dequantize()), (kind, m, n, k)


@needs_kernels
def test_float16_scales_are_the_ggml_types_own() -> None:
    # Exactly the types that store float16 scales and biases keep them so (half the
    # bytes per group); K types' d * sc products need float32.
    for kind in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]:
        assert affine(kind, 4, 256, 0).scales.dtype == np.float16, kind
    for kind in ["Q4_K", "Q5_K", "Q6_K", 4, 8]:
        assert affine(kind, 4, 256, 0).scales.dtype == np.float32, kind
    assert affine("Q6_K", 4, 256, 0).group == 16


@needs_kernels
def test_float16_scales_widen_exactly(path: str) -> None:
    # Every float16 value as a scale (code 1, bias -0): the kernel's widening
    # (F16C, or the portable bit manipulation) must be exact, subnormals,
    # infinities and signed zeros included.
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(-1, 1)
    n = halves.shape[0]
    codes = np.full((n, 16), 0x11, np.uint8)
    biases = np.full((n, 1), -0.0, np.float16)
    out = np.empty((n, 32), np.float32)
    _affine.dequantize(4, codes, halves, biases, out, n, 32, True, 32, True)
    want = halves.astype(np.float32)[:, 0]
    finite = ~np.isnan(want)
    assert np.array_equal(out[finite, 0].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(out[~finite]).all() and (out == out[:, :1]).sum() == 32 * finite.sum()


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 8, 11])
def test_gemv_f32_matches_the_float64_product(path: str, m: int) -> None:
    for seed, (n, k) in enumerate([(1, 1), (7, 33), (64, 576), (9, 2051)]):
        rng = np.random.default_rng(seed)
        w, x = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        _affine.gemv_f32(x, w, out, m, k, n)
        assert within_float32(out, x, w), (m, n, k)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("parallel", [True, False])
def test_dequantize_is_bit_exact(path: str, kind: int | str, parallel: bool) -> None:
    # quantize_affine's scales make scale * code inexact: a fused multiply-add would differ.
    a = affine(kind, 24, 512, 3)
    out = np.full(a.shape, np.nan, np.float32)
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(a)
    _affine.dequantize(bits, codes, scales, biases, out, n, k, parallel, group, half, factor)
    assert np.array_equal(out.view(np.uint32), a.dequantize().view(np.uint32))
    if isinstance(kind, str):  # and that is GGML's own dequantization (but for the sign of zeros, see
        raw = gguf_quants.random_blocks(kind, 24, 512, 3)  # test_quantization.same_values)
        want = gguf_quants.dequantize(raw, kind).reshape(24, 512) + np.float32(0)
        assert np.array_equal((out + np.float32(0)).view(np.uint32), want.view(np.uint32))


@needs_kernels
def test_bad_buffers_are_value_errors() -> None:
    a = affine(4, 8, 64, 0)
    x, out = np.zeros((1, 64), np.float32), np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError, match="codes"):
        _affine.gemv(4, x, a.packed[:4], a.scales, a.biases, out, 1, 64, 8)
    with pytest.raises(ValueError, match="out"):
        _affine.gemv(4, x, a.packed, a.scales, a.biases, out[:, :4], 1, 64, 8)
    with pytest.raises(ValueError, match="bits"):
        _affine.gemv(3, x, a.packed, a.scales, a.biases, out, 1, 64, 8)
    with pytest.raises(ValueError, match="k=48"):
        _affine.gemv(4, x[:, :48], a.packed, a.scales, a.biases, out, 1, 48, 8)
    with pytest.raises(ValueError, match="group=16"):  # groups of 16 only for 8-bit codes
        _affine.gemv(4, x, a.packed, a.scales, a.biases, out, 1, 64, 8, 16)
    with pytest.raises(ValueError, match="scales"):  # float32 scales passed as float16
        _affine.gemv(4, x, a.packed, a.scales, a.biases, out, 1, 64, 8, 32, True)
    with pytest.raises(ValueError, match="scales"):
        _affine.dequantize(8, np.zeros((8, 64), np.uint8), a.scales, a.biases, np.zeros((8, 64), np.float32), 8, 64,
                           True, 16)
    with pytest.raises(ValueError, match="unknown code path"):
        _affine.use_simd("sse9")


# -- through the backend --------------------------------------------------------------------


def gguf_tensor(qtype: str, rows: int, cols: int, seed: int) -> GGUFQuantizedTensor:
    return GGUFQuantizedTensor(qtype, (rows, cols), gguf_quants.random_blocks(qtype, rows, cols, seed), "random")


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"])
def test_gguf_affine_types_stay_quantized_by_default(qtype: str) -> None:
    ops = numpy_backend.NumpyBackend()
    t = gguf_tensor(qtype, 48, 512, 1)
    w = ops.prepare_weight(t, name=LINEAR)
    group = 16 if qtype == "Q6_K" else 32
    if qtype in numpy_backend.STORED_TYPES:  # computed on as stored: the weight is the file's blocks
        assert isinstance(w, PackedWeight) and w.scheme == f"{qtype} blocks as stored, C kernel" and w.data is t
        assert w.kernel[1].base is not None and np.shares_memory(w.kernel[1], t.raw)
    else:
        assert isinstance(w, PackedWeight) and f"affine group {group}, " in w.scheme and w.scheme.endswith("C kernel")
    assert w.data.nbytes < t.dequantize().nbytes / 2.5  # what decoding reads per token
    dense = t.dequantize()
    for m in (1, 4, 12, ops.KERNEL_ROWS + 1, 40):  # the kernel (12: two chunks of rows), then slabs for BLAS
        x = np.random.default_rng(m).standard_normal((m, 512)).astype(np.float32)
        assert within_float32(ops.linear(x, w), x, dense), m
    ops.SLAB_BYTES = 512 * 4 * 5  # five rows a slab: the last slab is partial
    x = np.random.default_rng(0).standard_normal((20, 512)).astype(np.float32)
    assert within_float32(ops.linear(x, w), x, dense)
    ids = np.array([47, 0, 5])
    assert np.array_equal(ops.embedding(w, ids), dense[ids])


@needs_kernels
def test_off_and_unmapped_types_are_float32() -> None:
    ops = numpy_backend.NumpyBackend()
    assert not isinstance(ops.prepare_weight(gguf_tensor("Q3_K", 16, 256, 0), name=LINEAR), PackedWeight)
    off = ops.configure(LoadSettings(quantize="off"))
    assert not isinstance(off.prepare_weight(gguf_tensor("Q4_1", 16, 256, 0), name=LINEAR), PackedWeight)


@needs_kernels
def test_few_row_float_products_use_the_kernel(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    calls = []
    real = _affine.gemv_f32
    monkeypatch.setattr(_affine, "gemv_f32", lambda *a: calls.append(a[3]) or real(*a))
    for lead in [(1,), (3,), (2, 4), (ops.KERNEL_ROWS + 1,)]:
        x = rng.standard_normal((*lead, 96)).astype(np.float32)
        y = ops.linear(x, w, bias=np.ones(40, np.float32))
        assert y.shape == (*lead, 40)
        assert within_float32(y.reshape(-1, 40) - 1, x.reshape(-1, 96), w)
    assert calls == [1, 3, 8]  # 9 rows go to BLAS


@needs_kernels
def test_attention_after_a_blas_product_stays_on_one_thread(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # OpenMP's threads woken right after BLAS's would fight its spinning ones for
    # the cores (batched decoding of 64 rows ran at half speed): the attention
    # after a BLAS product runs on the calling thread, after a kernel product on all.
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q, k, v = (rng.standard_normal((t, 2, 64)).astype(np.float32) for t in (1, 40, 40))
    parallel = []
    real = _affine.attention
    monkeypatch.setattr(_affine, "attention", lambda *a: parallel.append(a[PARALLEL]) or real(*a))
    for rows in (1, ops.KERNEL_ROWS + 1, 3):
        ops.linear(rng.standard_normal((rows, 64)).astype(np.float32), w)
        ops.attention(q, k, v, one_sequence(1, 40, 40), scale=0.125, causal=True)
    assert parallel == [True, False, True]


@needs_kernels
def test_on_load_quantization_runs_on_the_kernel() -> None:
    ops = numpy_backend.NumpyBackend().configure(LoadSettings(quantize="q4"))
    w = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    p = ops.prepare_weight(w, name=LINEAR)
    assert isinstance(p, PackedWeight) and p.scheme == "q4 group 32, C kernel"
    x = np.random.default_rng(1).standard_normal((2, 128)).astype(np.float32)
    assert within_float32(ops.linear(x, p), x, p.data.dequantize())


@pytest.mark.slow
@needs_kernels
def test_real_model_default_is_quantized_and_off_is_float() -> None:
    # Greedy tokens of the default against transformers float32: tests/test_real_gguf.py.
    quantized = infer.load("smollm2-135m", backend="numpy")
    dense = infer.load("smollm2-135m", backend="numpy", quantize="off")
    layer = quantized.network.layers[0]
    assert isinstance(layer.weights["gate_up_proj"], PackedWeight)
    assert not isinstance(dense.network.layers[0].weights["gate_up_proj"], PackedWeight)
    prompt = quantized.tokenizer.encode("The capital of France is")
    assert list(quantized.generate_tokens(prompt, max_tokens=24, ignore_eos=True)) == \
        list(dense.generate_tokens(prompt, max_tokens=24, ignore_eos=True))


# -- the same row, whatever the batch -------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8, 32, "Q4_1", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("m,k", [(2, 576), (5, 544), (8, 576)])  # 544: an odd number of blocks of 32
def test_a_rows_result_does_not_depend_on_the_batch(path: str, bits: int | str, m: int, k: int) -> None:
    # Batched decoding gives each request exactly what it would get alone (up to
    # KERNEL_ROWS rows): the multi-row kernels keep the one-row order of sums.
    n = 40
    rng = np.random.default_rng(7)
    x = rng.standard_normal((m, k)).astype(np.float32)
    together, alone = np.empty((m, n), np.float32), np.empty((1, n), np.float32)
    if bits == 32:
        w = rng.standard_normal((n, k)).astype(np.float32)
        _affine.gemv_f32(x, w, together, m, k, n)
    else:
        a = affine(bits, n, k if isinstance(bits, int) else 512, 7)
        x = x[:, :a.shape[1]].copy()
        gemv(a, x, together)
    for i in range(m):
        if bits == 32:
            _affine.gemv_f32(x[i:i + 1], w, alone, 1, k, n)
        else:
            gemv(a, x[i:i + 1], alone)
        assert np.array_equal(alone[0].view(np.uint32), together[i].view(np.uint32)), i


@needs_kernels
@pytest.mark.parametrize("kind", [4, "Q4_1", "Q4_K", "Q5_0", 8, "Q6_K"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 9, 37])
def test_a_weight_rows_result_does_not_depend_on_its_neighbours(path: str, kind: int | str, n: int) -> None:
    # Decoding takes several weight rows at a time (AVX-512: four 4-bit rows per
    # step, the rest one to three): a row's output is bit for bit what it is
    # when that row is the whole matrix, so splitting a weight's rows (tensor
    # parallel shards, tiles across threads) changes no result.
    k = 544 if isinstance(kind, int) else 512  # 544: an odd number of blocks of 32
    a = affine(kind, n, k, 11)
    x = np.random.default_rng(12).standard_normal((1, k)).astype(np.float32)
    together, alone = np.empty((1, n), np.float32), np.empty((1, 1), np.float32)
    gemv(a, x, together)
    for r in range(n):
        one = AffineTensor(a.qtype, (1, k), a.bits, a.packed[r:r + 1], a.scales[r:r + 1], a.biases[r:r + 1], a.group)
        gemv(one, x, alone)
        assert np.array_equal(alone[0].view(np.uint32), together[0, r:r + 1].view(np.uint32)), (n, r)
    assert within_float32(together, x, a.dequantize())


# -- rms_norm and rope ------------------------------------------------------------------------


@pytest.fixture
def pure_numpy(monkeypatch):  # type: ignore[no-untyped-def]
    """The numpy backend's formulas without the C kernels (the reference here)."""
    ops = numpy_backend.NumpyBackend()

    def call(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        with monkeypatch.context() as m:
            m.setattr(cpu_backend, "_native", None)  # where the numpy backend's ops look the kernels up
            return getattr(ops, name)(*args, **kwargs)
    return call


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (2, 4, 256), (5, 7)])
def test_rms_norm_matches_the_numpy_formula(pure_numpy, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(len(shape))
    x, res = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(shape[-1:]).astype(np.float32)
    # Only the sum of squares is ordered differently (8 running sums against
    # numpy's pairwise sum): for n <= 576 positive terms at most about
    # (n / 8) * 2^-24 = 4.3e-6 relative, halved by the square root.
    for weight in (w, None):
        assert np.allclose(ops.rms_norm(x, weight, 1e-6), pure_numpy("rms_norm", x, weight, 1e-6), rtol=3e-6, atol=0)
    y, h = ops.fused_add_rms_norm(x, res, w, 1e-5)
    want_y, want_h = pure_numpy("fused_add_rms_norm", x, res, w, 1e-5)
    assert np.array_equal(h, want_h) and np.allclose(y, want_y, rtol=3e-6, atol=0)
    assert np.array_equal(ops.rms_norm(np.zeros(shape, np.float32), w, 1e-6), np.zeros(shape, np.float32))
    # A strided view and a weight of another shape go through the same formula.
    view = x[..., ::2]
    assert np.allclose(ops.rms_norm(view, None, 1e-6), pure_numpy("rms_norm", view, None, 1e-6), rtol=3e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 768), (3, 64), (2, 4, 256), (5, 7)])
def test_layer_norm_matches_the_numpy_formula(pure_numpy, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(np.float32) * 3 + 0.5
    w, b = (rng.standard_normal(shape[-1:]).astype(np.float32) for _ in range(2))
    # The formula's steps are numpy's; only its two sums (the mean, then the
    # mean square of x - mean) go in 8 running sums against numpy's pairwise
    # ones. For n <= 768 terms of |x| <= ~15 each sum is within about
    # (n / 8) * 2^-24 of its terms' magnitude: the mean within ~1e-5 absolute
    # (x's scale is 3), so y = (x - mean) / std (std ~3) within ~4e-6, times w.
    for weight, bias in ((w, b), (w, None), (None, b), (None, None)):
        got, want = ops.layer_norm(x, weight, bias, 1e-5), pure_numpy("layer_norm", x, weight, bias, 1e-5)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (weight is None, bias is None)
    # A constant row normalizes to zero (then the bias), not to NaN.
    flat = np.full(shape, 2.5, np.float32)
    assert np.array_equal(ops.layer_norm(flat, w, b, 1e-5), np.broadcast_to(b, shape))
    # A strided view goes through the same formula.
    view = x[..., ::2]
    assert np.allclose(ops.layer_norm(view, None, None, 1e-5), pure_numpy("layer_norm", view, None, None, 1e-5),
                       rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("d,half", [(64, 32), (64, 16), (24, 12)])
def test_rope_is_bit_identical_to_the_numpy_formula(pure_numpy, d: int, half: int) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(d + half)
    x = rng.standard_normal((5, 3, d)).astype(np.float32)
    angles = rng.uniform(0, 100, (5, half)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    got, want = ops.rope(x, cos, sin), pure_numpy("rope", x, cos, sin)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(ops.rope(x, cos, sin, interleaved=True), pure_numpy("rope", x, cos, sin, interleaved=True))


def silu_grid() -> np.ndarray:
    """Inputs over float32's whole range: every region of exp's range reduction,
    near its overflow (|x| ~ 88.7) and clamps (89, 104), tiny and huge values,
    signed zeros, infinities and NaN."""
    rng = np.random.default_rng(0)
    return np.concatenate([
        np.linspace(-120, 120, 240_001, dtype=np.float32), rng.standard_normal(50_000).astype(np.float32) * 6,
        np.float32(10.0) ** rng.uniform(-38, 38, 20_000).astype(np.float32) * rng.choice([-1, 1], 20_000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.72, -88.72, 88.73, -88.73, 89.0, -89.0, 104.0, -104.0,
                  -87.3, 1e-45, -1e-45, 3e38, -3e38], np.float32)]).astype(np.float32)


@needs_kernels
def test_silu_is_within_two_ulp_of_exact(path: str) -> None:
    # The result's errors: exp16's (its polynomial 4e-9 relative, the reduction and
    # the last product), 1 + e rounded, then the division rounded, 0.5 ulp each: 2.27
    # ulp at most on this grid (numpy's float32 formula reaches 3.06 on it).
    x = silu_grid()
    got = np.empty_like(x)
    kernels_module.silu(x, None, got)
    with np.errstate(all="ignore"):
        exact = x.astype(np.float64) / (1.0 + np.exp(-x.astype(np.float64)))
        formula = x / (np.float32(1) + np.exp(-x))
    # Where exp(-x) overflows float32 (x < -88.723), the formula's x / inf is -0 and so is the kernel's;
    # a few values above that the float64 exp is within an ulp of float32's largest and either may be.
    normal = np.isfinite(exact) & (np.abs(exact) >= np.finfo(np.float32).tiny)
    finite, edge, over = normal & (x > -88.7), (x >= -88.73) & (x <= -88.7), ~np.isfinite(exact) | (x < -88.73)
    ulp = np.abs(got[finite] - exact[finite]) / np.spacing(np.abs(exact[finite]).astype(np.float32))
    assert ulp.max() <= 2.5, x[finite][np.argmax(ulp)]
    same = (got[over] == formula[over]) | (np.isnan(got[over]) & np.isnan(formula[over]))
    assert same.all() and np.array_equal(np.signbit(got[over]), np.signbit(formula[over])), x[over][~same]
    assert (np.abs(got[edge] - exact[edge]) <= np.abs(exact[edge])).all()
    tiny = ~normal & np.isfinite(exact) & (np.abs(x) < 1)  # x / 2, subnormal: within the subnormals' spacing
    assert tiny.any() and np.abs(got[tiny] - exact[tiny]).max() <= 2.0 ** -149


@needs_kernels
def test_silu_has_the_same_bits_on_every_path_and_any_split() -> None:
    x = silu_grid()[:100_003]  # not a multiple of 16: each thread's run and the last vector end mid-row
    up = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    chosen, threads = _affine.simd(), _affine.threads()
    results = []
    try:
        for name in PATHS:
            _affine.use_simd(name)
            for t in (1, 2):  # one thread, and the elements split between two (past SILU_PARALLEL)
                _affine.set_threads(t)
                for rows, n in ((1, x.size), (7, x.size // 7)):
                    out = np.empty((rows, n), np.float32)
                    kernels_module.silu(x[:rows * n].reshape(rows, n), up[:rows * n].reshape(rows, n), out)
                    results.append(out.reshape(-1).view(np.uint32))
    finally:
        _affine.use_simd(chosen)
        _affine.set_threads(threads)
    m = min(r.size for r in results)  # 7 rows of x.size // 7 leave the last 4 values out
    assert all(np.array_equal(r[:m], results[0][:m]) for r in results)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 8192), (3, 17), (2, 5, 48), (5,), (4, 1)])
def test_silu_and_swiglu_take_the_halves_of_a_fused_product_in_place(shape: tuple[int, ...]) -> None:
    # A fused gate/up product's output is [..., 2n]: its halves are column slices, read where they lie; the
    # bits are those of the same values contiguous, and every tail length (n mod 16) goes through the lanes.
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(shape[-1])
    fused = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(np.float32) * 4
    gate, up = fused[..., :shape[-1]], fused[..., shape[-1]:]
    got = ops.swiglu(gate, up)
    assert got.shape == shape and got.flags.c_contiguous
    want = ops.swiglu(np.ascontiguousarray(gate), np.ascontiguousarray(up))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    silu = ops.silu(gate)
    assert np.array_equal(silu.view(np.uint32), ops.silu(np.ascontiguousarray(gate)).view(np.uint32))
    # SwiGLU is SiLU, then the product rounded once: as the captured step's two steps compute it
    assert np.array_equal((silu * up).view(np.uint32), got.view(np.uint32))
    exact = gate.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64))) * up
    assert np.allclose(got, exact, rtol=4 * 2 ** -24, atol=0)
    # Rows that are not evenly apart, or overlap (a broadcast), are copied first: the same values.
    for odd in (gate[..., ::-1], np.broadcast_to(gate[..., :1], gate.shape), gate[..., ::2]):
        assert np.array_equal(ops.silu(odd), ops.silu(np.ascontiguousarray(odd)))


@needs_kernels
def test_silu_refuses_what_it_cannot_read() -> None:
    x = np.ones((3, 8), np.float32)
    out = np.empty((3, 8), np.float32)
    with pytest.raises(ValueError, match="float32 rows"):
        _affine.silu(x.astype(np.float64), None, out, 3, 8)
    with pytest.raises(ValueError, match="float32 rows"):
        _affine.silu(x[:, ::2], None, out, 3, 4)
    with pytest.raises(ValueError, match="up: not float32 rows"):
        _affine.silu(x, np.ones((3, 7), np.float32), out, 3, 8)
    with pytest.raises(ValueError, match="out"):
        _affine.silu(x, None, np.empty((3, 7), np.float32), 3, 8)
    with pytest.raises(ValueError, match="bad shape"):
        _affine.silu(x, None, out, 0, 8)
    with pytest.raises(ValueError, match="unknown activation 7"):
        _affine.silu(x, None, out, 3, 8, 7)


def gelu_u(x: np.ndarray) -> np.ndarray:
    """GELU's tanh argument sqrt(2/pi) (x + 0.044715 x^3), rounded in float32 step by step as the numpy
    formula (and torch's gelu_pytorch_tanh) round it."""
    f = np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        return (f(0.7978845608028654) * (x + ((f(0.044715) * x) * x) * x)).astype(np.float32)


@needs_kernels
def test_gelu_tanh_is_within_two_ulp_of_its_formula(path: str) -> None:
    # 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): SiLU's arithmetic on -2u. Against the float64 value for u as
    # float32 rounds it (its roundings are the formula's own, and move the result by up to |2u| ulp there too):
    # 2.05 ulp at most on this grid. The numpy formula's 1 + tanh(u) cancels for negative x (320 ulp at x > -3,
    # and 0 where the value is 1e-10 and below); this form keeps the relative precision down to x / inf = -0.
    x = silu_grid()
    got = np.empty_like(x)
    kernels_module.gelu_tanh(x, got)
    u, xd = gelu_u(x), x.astype(np.float64)
    with np.errstate(all="ignore"):
        exact = xd / (1.0 + np.exp(-2.0 * u.astype(np.float64)))
        formula = (np.float32(0.5) * x) * (np.float32(1) + np.tanh(u))
    normal = np.isfinite(exact) & (np.abs(exact) >= np.finfo(np.float32).tiny) & (-2.0 * u.astype(np.float64) < 88.7)
    ulp = np.abs(got[normal] - exact[normal]) / np.spacing(np.abs(exact[normal]).astype(np.float32))
    assert ulp.max() <= 2.3, x[normal][np.argmax(ulp)]
    moderate = normal & (np.abs(x) < 3) & (np.abs(x) > 1e-3)
    theirs = np.abs(formula[moderate] - exact[moderate]) / np.spacing(np.abs(exact[moderate]).astype(np.float32))
    assert theirs.max() > 100 * ulp.max()
    # Past exp's overflow (x below about -10) the value is below 3e-38: -0; above 10 it is x; infinities and
    # NaN as the formula (-inf: -inf * 0, NaN); zeros keep their sign.
    small, big = np.isfinite(x) & (x < -11), np.isfinite(x) & (x > 10)
    assert (got[small] == 0).all() and np.signbit(got[small]).all() and np.array_equal(got[big], x[big])
    assert np.array_equal(got[np.isinf(x)], formula[np.isinf(x)], equal_nan=True)
    assert np.isnan(got[np.isnan(x)]).all() and np.array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]))


@needs_kernels
def test_gelu_tanh_has_the_same_bits_on_every_path_split_and_step() -> None:
    # Every SIMD path, one thread or two, and the captured decode step's gelu_tanh (plan.c calls unary.c),
    # give the eager op's bits: a prompt and the steps after it compute Gemma's GELU alike.
    x = silu_grid()[:100_003]
    chosen, threads = _affine.simd(), _affine.threads()
    results = []
    try:
        for name in PATHS:
            _affine.use_simd(name)
            for t in (1, 2):
                _affine.set_threads(t)
                out = np.empty_like(x)
                kernels_module.gelu_tanh(x, out)
                results.append(out.view(np.uint32))
    finally:
        _affine.use_simd(chosen)
        _affine.set_threads(threads)
    assert all(np.array_equal(r, results[0]) for r in results)
    ops = numpy_backend.NumpyBackend()
    rows = x[:96_000].reshape(30, 3200)
    step = ops.compile(lambda a: ops.gelu_tanh(a), static=True)
    step(rows)  # recorded (and checked against the eager op)
    assert np.array_equal(step(rows * 1).view(np.uint32), ops.gelu_tanh(rows).view(np.uint32))
    assert step.graphs() == 1  # the second call ran the recorded program
    assert np.array_equal(ops.gelu_tanh(rows).reshape(-1).view(np.uint32), results[0][:96_000])


@needs_kernels
@pytest.mark.parametrize("tq,tk", [(1, 1), (1, 37), (3, 20), (8, 8), (5, 300)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 1), (10, 2)])  # query heads per KV head: 1, 3, 8 (two fours), 5
@pytest.mark.parametrize("causal,window,softcap,sinks", [
    (True, None, None, False), (True, 7, None, False), (False, None, None, False), (True, None, 20.0, False),
    (False, 5, 30.0, False), (True, None, None, True), (False, 5, 20.0, True)])
def test_few_row_attention_matches_the_numpy_formula(pure_numpy, tq, tk, hq, hkv, causal, window, softcap, sinks):  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(tq * 1000 + tk)
    q = rng.standard_normal((tq, hq, 16)).astype(np.float32) * 2
    k = in_pool(rng.standard_normal((tk, hkv, 16)).astype(np.float32), tk + 5)
    v = in_pool(rng.standard_normal((tk, hkv, 24)).astype(np.float32), tk + 5)
    kw = dict(scale=0.25, causal=causal, window=window, softcap=softcap,
              sinks=rng.standard_normal(hq).astype(np.float32) * 2 if sinks else None)
    batch = one_sequence(tq, tk, tk + 5)
    got, want = ops.attention(q, k, v, batch, **kw), pure_numpy("attention", q, k, v, batch, **kw)
    # Sums in another order (dot products, softmax total, weighted values) and
    # C's expf/tanhf against numpy's: a few float32 roundings of values <= max|v|.
    assert got.shape == want.shape == (tq, hq, 24) and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2e-6 * np.nanmax(np.abs(v)), np.abs(got - want).max()


@needs_kernels
# Scores sum sixteen lanes of columns and values go sixteen columns at a time: 24
# and 40 leave eight columns over, 80 none; keys go sixteen at a time (300 leaves
# twelve in the last tile); heads four at a time (a group of 5 leaves one).
@pytest.mark.parametrize("d", [24, 40, 64, 80, 256])
@pytest.mark.parametrize("tq,tk", [(1, 1), (1, 300), (4, 40)])
@pytest.mark.parametrize("hq", [4, 10])
@pytest.mark.parametrize("pool", ["float32", "float16"])
def test_attention_head_sizes_and_code_paths_agree(pure_numpy, d: int, tq: int, tk: int, hq: int, pool: str) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(d + tk)
    q = rng.standard_normal((tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((tk, 2, d)).astype(pool)
    v = rng.standard_normal((tk, 2, d)).astype(pool)
    batch = one_sequence(tq, tk, tk)
    kw = dict(scale=d ** -0.5, causal=True, window=None, softcap=None)
    want = pure_numpy("attention", q, k.astype(np.float32), v.astype(np.float32), batch, **kw)
    chosen, outputs = _affine.simd(), []
    try:
        for name in PATHS:  # the same operations in the same order on each path: the same bits
            _affine.use_simd(name)
            outputs.append(ops.attention(q, k, v, batch, **kw))
    finally:
        _affine.use_simd(chosen)
    assert all(np.array_equal(o.view(np.uint32), outputs[0].view(np.uint32)) for o in outputs)
    assert np.abs(outputs[0] - want).max() <= 2e-6 * np.abs(v).max()


@needs_kernels
@pytest.mark.parametrize("d", [16, 64, 80])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 2), (16, 2), (8, 1)])
def test_grouped_query_heads_give_the_bits_of_each_head_alone(d: int, hq: int, hkv: int) -> None:
    # Query heads that share a KV head (GQA) each get the bits they get with the
    # KV head repeated for them alone (MHA): a head's sums do not depend on the others.
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(hq * 100 + d)
    tq, tk = 2, 70
    q = rng.standard_normal((tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((tk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((tk, hkv, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    batch = one_sequence(tq, tk, tk)
    kw = dict(scale=d ** -0.5, causal=True, window=None, softcap=30.0, sinks=sinks)
    grouped = ops.attention(q, k, v, batch, **kw)
    alone = ops.attention(q, np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1), batch, **kw)
    assert np.array_equal(grouped.view(np.uint32), alone.view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("pool", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("tq,hq,hkv", [(1, 32, 8), (5, 32, 8), (3, 8, 1), (2, 64, 32)])
def test_attention_has_the_same_bits_on_any_number_of_threads(pool: str, tq: int, hq: int, hkv: int) -> None:
    # A thread takes its tasks (a query row's key/value heads) tile by tile together,
    # up to 16 at a time: each task's sums are its own whichever tasks share a thread,
    # with several key tiles (300 keys), a window and sinks, more tasks than go
    # together (5 x 8, 2 x 32) and one group split over the threads (hkv 1).
    rng = np.random.default_rng(tq * 100 + hkv)
    tk, d = 300, 64
    q = rng.standard_normal((tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((tk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((tk, hkv, d)).astype(np.float32)
    if pool == "float16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    elif pool == "q8_0":
        def blocks(x: np.ndarray) -> np.ndarray:
            out = np.empty(x.size // 32 * 34, np.uint8)
            kernels_module.quantize_q8_0(np.ascontiguousarray(x.reshape(-1)), out)
            return out.reshape(tk, hkv, d // 32 * 34)
        k, v = blocks(k), blocks(v)
    sinks = rng.standard_normal(hq).astype(np.float32)
    outputs = []
    for parallel in (False, True):
        out = np.full((tq, hq, d), np.nan, np.float32)
        kernels_module.attention(q, k, v, out, tq, tk, hq, hkv, d, d, 0.125, True, 200, 0.0, parallel=parallel,
                                 sinks=sinks)
        outputs.append(out)
    assert np.isfinite(outputs[0]).all()
    assert np.array_equal(outputs[0].view(np.uint32), outputs[1].view(np.uint32))


def paged(table: list[int], context: int, tq: int, block: int) -> AttentionBatch:
    """One sequence of ``context`` keys in the pool's blocks ``table``."""
    return AttentionBatch(np.array([0, tq], np.int32), np.array([context], np.int32),
                          np.array([table], np.int32), block, tq)


@needs_kernels
@pytest.mark.parametrize("tq,context", [(1, 1), (1, 37), (3, 20), (2, 48)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 25.0)])
def test_paged_attention_reads_pages_in_place_like_the_gather(pure_numpy, tq, context, window, softcap):  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(context * 10 + tq)
    block, hq, hkv = 16, 6, 2
    k_pool = rng.standard_normal((9 * block, hkv, 16)).astype(np.float32)
    v_pool = rng.standard_normal((9 * block, hkv, 8)).astype(np.float32)
    batch = paged([7, 2, 5, 0], context, tq, block)  # out of order, more blocks than the context needs
    q = rng.standard_normal((tq, hq, 16)).astype(np.float32)
    kw = dict(scale=0.3, causal=True, window=window, softcap=softcap)
    got = ops.attention(q, k_pool, v_pool, batch, **kw)
    want = pure_numpy("attention", q, k_pool, v_pool, batch, **kw)  # the gathered rows, two GEMMs
    assert np.abs(got - want).max() <= 2e-6 * np.abs(v_pool).max()


#: A ragged batch: (query rows, keys) per sequence: decoding, verification rows,
#: a prompt chunk after a cached prefix and a whole prompt, the last two past
#: KERNEL_ROWS (the GEMM path) in the same call as the kernel's rows.
RAGGED = [(1, 37), (4, 9), (20, 50), (1, 1), (17, 17)]


@needs_kernels
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (6, 25.0, False), (None, None, True),
                                                  (5, None, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_a_ragged_batch_gives_each_sequence_what_it_gets_alone(pure_numpy, causal, window, softcap, sinks):  # type: ignore[no-untyped-def]
    # Each sequence runs on its own path (kernel or GEMMs) over its own pages:
    # batching changes no bit of any row, and every path agrees with the plain
    # definition (float64, reference_attention) within the tolerance above.
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(len(RAGGED) + (window or 0))
    block, hq, hkv = 8, 6, 3
    blocks = np.random.default_rng(1).permutation(40)  # every sequence's pages scattered over the pool
    width = max(-(-tk // block) for _, tk in RAGGED) + 1
    tables = np.zeros((len(RAGGED), width), np.int32)
    used = 0
    for b, (_, tk) in enumerate(RAGGED):
        n = -(-tk // block)
        tables[b, :n] = blocks[used:used + n]
        used += n
    starts = np.cumsum([0] + [tq for tq, _ in RAGGED]).astype(np.int32)
    batch = AttentionBatch(starts, np.array([tk for _, tk in RAGGED], np.int32), tables, block,
                           max(tq for tq, _ in RAGGED))
    k_pool = rng.standard_normal((40 * block, hkv, 16)).astype(np.float32)
    v_pool = rng.standard_normal((40 * block, hkv, 12)).astype(np.float32)
    q = rng.standard_normal((int(starts[-1]), hq, 16)).astype(np.float32)
    kw = dict(scale=0.3, causal=causal, window=window, softcap=softcap,
              sinks=rng.standard_normal(hq).astype(np.float32) if sinks else None)
    got = ops.attention(q, k_pool, v_pool, batch, **kw)
    assert got.shape == (int(starts[-1]), hq, 12)
    for b, (tq, tk) in enumerate(RAGGED):
        alone = AttentionBatch(np.array([0, tq], np.int32), batch.seq_lens[b:b + 1], tables[b:b + 1], block, tq)
        mine = ops.attention(q[starts[b]:starts[b + 1]], k_pool, v_pool, alone, **kw)
        assert np.array_equal(got[starts[b]:starts[b + 1]].view(np.uint32), mine.view(np.uint32)), b
    bound = 2e-6 * np.abs(v_pool).max()
    assert np.abs(got - pure_numpy("attention", q, k_pool, v_pool, batch, **kw)).max() <= bound
    assert np.abs(got - numpy_backend.reference_attention(q, k_pool, v_pool, batch, **kw)).max() <= bound


@needs_kernels
@pytest.mark.parametrize("tq,context", [(1, 1), (1, 37), (3, 20), (2, 48), (20, 48)])  # the last: the GEMM path
@pytest.mark.parametrize("d,dv", [(64, 64), (20, 72), (8, 136)])  # 8 columns at a time, 64 at a time, and tails
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (6, 25.0, True)])
def test_a_float16_pool_gives_the_bits_of_the_same_pool_widened(path, tq, context, d, dv, window, softcap, sinks):  # type: ignore[no-untyped-def]
    # kv_dtype="float16": keys and values are rounded once, when written; reading
    # them widens each exactly (every float16 is a float32), so on every path the
    # attention over the float16 pool is, bit for bit, the attention over the pool
    # widened to float32 first: no rounding but the one at the write.
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(context * 10 + tq + d)
    block, hq, hkv = 16, 6, 2
    k16 = (rng.standard_normal((9 * block, hkv, d)) * 3).astype(np.float16)
    v16 = rng.standard_normal((9 * block, hkv, dv)).astype(np.float16)
    batch = paged([7, 2, 5, 0], context, tq, block)
    q = rng.standard_normal((tq, hq, d)).astype(np.float32)
    kw = dict(scale=d ** -0.5, causal=True, window=window, softcap=softcap,
              sinks=rng.standard_normal(hq).astype(np.float32) if sinks else None)
    got = ops.attention(q, k16, v16, batch, **kw)
    want = ops.attention(q, k16.astype(np.float32), v16.astype(np.float32), batch, **kw)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_captured_steps_float16_rounding_is_numpys() -> None:
    # A captured step writes float32 keys into a float16 pool in C (_plan.c's
    # SCATTER_ROWS): it must round as numpy's assignment does, on every value:
    # ties to even, subnormals, overflow to infinity, NaN kept a NaN.
    if _affine is None:
        pytest.skip("the C kernels are not built")
    rng = np.random.default_rng(0)
    scaled = [rng.standard_normal(20000).astype(np.float32) * s for s in (1e-8, 1e-6, 1e-4, 1.0, 1e3, 7e4)]
    any_bits = rng.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, 65504, 65519.996, 65520, 1e6, np.inf, -np.inf, 2 ** -24, 2 ** -25, 2 ** -25 * 1.0000001,
                      3 * 2 ** -26, 2 ** -14, 2 ** -14 * (1 - 2 ** -12), 1 + 2 ** -11, 1 + 3 * 2 ** -11, np.nan],
                     np.float32)
    x = np.concatenate([*scaled, any_bits, edges, -edges])
    got = np.empty(x.size, np.uint16)
    _affine.to_half(x, got, x.size)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


@needs_kernels
def test_paged_attention_rejects_a_table_outside_the_pool() -> None:
    ops = numpy_backend.NumpyBackend()
    k_pool = np.zeros((2 * 4, 1, 8), np.float32)
    q = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(IndexError, match="block table entry 5 is outside the pool of 2 blocks"):
        ops.attention(q, k_pool, k_pool, paged([0, 5], 6, 1, 4), scale=1.0)


@pytest.mark.parametrize("table", [[0, 5, 9, 1, 2], [4, 5, 6, 7, 8]], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("tq", [1, numpy_backend.NumpyBackend.KERNEL_ROWS + 1], ids=["kernel", "gemm"])
def test_every_attention_path_rejects_a_table_outside_the_pool(table: list[int], tq: int) -> None:
    # A pool of 8 blocks of 4 rows; 20 keys in 5 blocks, one of which (9, or 8:
    # rows 32..35 of a run of rows 16..35) the pool does not hold. Reading the
    # keys that are there would be a wrong answer, not an error.
    ops = numpy_backend.NumpyBackend()
    k_pool = np.ones((8 * 4, 1, 8), np.float32)
    q = np.ones((tq, 1, 8), np.float32)
    with pytest.raises(IndexError):
        ops.attention(q, k_pool, k_pool, paged(table, 20, tq, 4), scale=1.0)


# -- threads on a busy machine ---------------------------------------------------------------------


class _FakeKernels:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def threads(self) -> int:
        return 2

    def set_threads(self, n: int) -> None:
        self.calls.append(n)


def test_the_governor_gives_the_kernels_the_cores_other_work_leaves(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two cores; between checks the machine is busy for as many CPU seconds as
    written below, of which this process spent ``mine``: the rest is other work."""
    stat = tmp_path / "stat"
    clock, mine = [100.0], [0.0]
    monkeypatch.setattr(kernels_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(kernels_module.os, "times", lambda: os.times_result((mine[0], 0.0, 0.0, 0.0, 0.0)))
    monkeypatch.setattr(kernels_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernels_module.os, "sysconf", lambda name: 100)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def machine(busy_ticks: int, idle_ticks: int) -> None:  # cumulative, as /proc/stat counts
        stat.write_text(f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\ncpu0 0 0 0 0\n")

    kernels = _FakeKernels()
    machine(0, 0)
    governor = numpy_backend.ThreadGovernor(kernels, interval=0.5, stat=str(stat))
    assert governor.enabled and governor.check() == 2  # the first sample only
    clock[0] += 1.0
    mine[0] += 1.0
    machine(300, 100)  # 3 busy CPU seconds in 1 s, 1 of them ours: 2 cores of other work
    assert governor.check() == 1 and kernels.calls == [1]
    clock[0] += 0.1
    assert governor.check() == 1 and kernels.calls == [1]  # not re-read within the interval
    clock[0] += 1.0
    mine[0] += 1.2
    machine(300 + 130, 100 + 70)  # since the last reading 1.1 s: 1.3 busy seconds, 1.2 ours: free again
    assert governor.check() == 2 and kernels.calls == [1, 2]


def test_the_governor_leaves_threads_the_user_set_alone(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not numpy_backend.ThreadGovernor(_FakeKernels()).enabled
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not numpy_backend.ThreadGovernor(_FakeKernels(), stat="/nonexistent/stat").enabled


@needs_kernels
def test_set_threads_changes_the_threads_a_product_may_use() -> None:
    before = _affine.threads()
    try:
        _affine.set_threads(1)
        assert _affine.threads() == 1
        with pytest.raises(ValueError, match="at least 1"):
            _affine.set_threads(0)
    finally:
        _affine.set_threads(before)
    assert _affine.threads() == before


# -- GGML's blocks as the file stores them -------------------------------------------------

#: Every block type the kernels read as stored (the backend keeps STORED_TYPES so).
BLOCK_TYPES = sorted(numpy_backend.BLOCK_FORMS)
#: Shapes with odd row counts, one-block rows and widths that are no power of two; the
#: short rows (up to 768 columns) decode 4 at a time, so 6 and 7 rows leave 2 and 3.
K_SHAPES = [(1, 256), (5, 768), (37, 2048), (3, 8192)]
SMALL_SHAPES = [(1, 32), (5, 96), (37, 640), (3, 2080), (6, 256), (7, 768)]


def block_args(qtype: str, n: int, k: int, seed: int) -> tuple[tuple, AffineTensor, np.ndarray]:
    """The kernel's arguments for random ``qtype`` blocks as stored, the same
    blocks converted (the affine form), and the blocks."""
    raw = gguf_quants.random_blocks(qtype, n, k, seed)
    converted = from_gguf(GGUFQuantizedTensor(qtype, (n, k), raw, "random"), groups=(16, 32), half=True)
    assert converted is not None
    group = 256 if qtype.endswith("_K") else 32
    return (numpy_backend.BLOCK_FORMS[qtype], raw, np.empty(0, np.float32), None, k, n, group, False, 0.0), \
        converted, raw


@needs_kernels
def test_the_kernels_read_every_type_the_backend_keeps_as_stored() -> None:
    from infer.backends.cpu import kernels

    # Which types stay as stored follows the kernel path in use (INFER_NUMPY_KERNELS).
    assert numpy_backend.STORED_TYPES == kernels.STORED_BY_PATH[kernels.native.simd()]
    assert set(kernels.native.paths()) <= set(kernels.STORED_BY_PATH)
    for types in kernels.STORED_BY_PATH.values():
        assert {"Q4_K", "Q5_K", "Q6_K"} <= types <= set(numpy_backend.BLOCK_FORMS)
    assert set(numpy_backend.BLOCK_FORMS) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11, 16])
def test_blocks_as_stored_give_the_converted_weights_bits(path: str, qtype: str, m: int) -> None:
    # The blocks are decoded (in registers for one row on AVX-512, a tile of rows
    # into a buffer otherwise) into the very codes and scales the conversion
    # makes, and summed in the converted kernels' order: the same bits, on every
    # path, for every row count (11 and 16: two chunks of rows).
    for seed, (n, k) in enumerate(K_SHAPES if qtype.endswith("_K") else SMALL_SHAPES):
        args, converted, _ = block_args(qtype, n, k, seed)
        x = np.random.default_rng(200 + seed).standard_normal((m, k)).astype(np.float32)
        got, want = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
        _affine.gemv(args[0], x, args[1], args[2], args[3], got, m, *args[4:])
        gemv(converted, x, want)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype, m, n, k)
        assert within_float32(got, x, converted.dequantize()), (qtype, m, n, k)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("parallel", [True, False])
def test_blocks_as_stored_dequantize_to_ggmls_values(path: str, qtype: str, parallel: bool) -> None:
    # Prefill's slabs and the recorded program's embedding rows: ggml's values bit
    # for bit, but for the sign of zeros (test_quantization.same_values), which
    # adding +0 makes equal.
    n, k = 37, 512
    args, _, raw = block_args(qtype, n, k, 9)
    out = np.full((n, k), np.nan, np.float32)
    _affine.dequantize(args[0], args[1], args[2], args[3], out, n, k, parallel, *args[6:])
    want = gguf_quants.dequantize(raw, qtype).reshape(n, k)
    assert np.array_equal((out + np.float32(0)).view(np.uint32), (want + np.float32(0)).view(np.uint32))


@needs_kernels
def test_bad_blocks_are_value_errors() -> None:
    args, _, raw = block_args("Q4_K", 4, 512, 0)
    x, out = np.zeros((1, 512), np.float32), np.zeros((1, 4), np.float32)
    form, _, scales = args[:3]
    with pytest.raises(ValueError, match="blocks"):  # a row short
        _affine.gemv(form, x, raw[:3], scales, None, out, 1, 512, 4, 256)
    with pytest.raises(ValueError, match="k=320"):  # not whole super-blocks
        _affine.gemv(form, x[:, :320], raw, scales, None, out, 1, 320, 4, 256)
    with pytest.raises(ValueError, match="bits=267"):  # Q3_K (11) has no form
        _affine.gemv(form - 1, x, raw, scales, None, out, 1, 512, 4, 256)
    with pytest.raises(ValueError, match="k=65536"):  # a row's decoded codes past the tile buffer
        _affine.dequantize(numpy_backend.BLOCK_FORMS["Q6_K"], np.zeros((1, 54 * 1024), np.uint8), scales, None,
                           np.zeros((1, 65536), np.float32), 1, 65536, True, 256)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_a_stored_weights_rows_do_not_depend_on_the_tile(path: str, qtype: str) -> None:
    # Tiles of rows go to different threads (and, decoded, to a buffer sized by
    # the row's width): each row of a weight gives what it gives alone.
    k = 2048 if qtype.endswith("_K") else 640
    args, _, raw = block_args(qtype, 41, k, 4)
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    for m in (1, 3):
        together, alone = np.empty((m, 41), np.float32), np.empty((m, 1), np.float32)
        _affine.gemv(args[0], x[:m], raw, args[2], None, together, m, k, 41, args[6])
        for r in (0, 17, 40):
            _affine.gemv(args[0], x[:m], raw[r:r + 1], args[2], None, alone, m, k, 1, args[6])
            assert np.array_equal(alone[:, 0].view(np.uint32), together[:, r].view(np.uint32)), (m, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int32])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (64, 8, 64), (2, 16, 128, 128)])
def test_cache_line_arrays_start_a_line_and_behave_as_numpys(dtype: type, shape: tuple[int, ...]) -> None:
    """The kernels' 512-bit loads read one line, not two, only from memory on a 64-byte boundary
    (docs/performance.md, "Operands on cache lines"): pools and step buffers are made so."""
    for zeroed in (False, True):
        a = kernels_module.cache_line_array(shape, dtype, zeroed=zeroed)
        assert a.ctypes.data % 64 == 0
        assert a.shape == shape and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and a.flags.writeable
        if zeroed:
            assert not a.any()
        a[...] = 1
        assert (a == 1).all()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
def test_a_zeroed_pool_costs_no_memory_whatever_the_heap_holds() -> None:
    """KV and state pools are made whole and filled as sequences come: their zeros must
    not be resident before they are written. ``np.zeros`` (calloc) clears a block cut
    from the heap byte by byte, which glibc does once the process has freed large
    arrays; a pool from ``cache_line_array`` is a mapping of its own and stays lazy.
    glibc's perturb setting makes calloc clear every block, the heap's worst case."""
    probe = """
import os
import numpy as np
from infer.backends.cpu import kernels
from infer.plugins.selection import select_backend
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
r = rss(); heap = np.zeros(32 << 20, np.uint8); plain = rss() - r
r = rss(); pool = kernels.cache_line_array((8, 16, 128, 128), np.float32, zeroed=True); ours = rss() - r
ops = select_backend("numpy")
r = rss(); backend = ops.zeros((2048, 8, 64), "float16"); theirs = rss() - r
assert not pool.any() and not backend.any()
r = rss(); pool[3] = 1; row = rss() - r
print(plain, ours, theirs, row, pool[3].all() and not pool[2].any())
"""
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.perturb=165", MALLOC_PERTURB_="165")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    plain, ours, theirs, row, right = out.stdout.split()
    if int(plain) < 16 << 20:
        pytest.skip("this C library does not clear calloc'd blocks under perturb: nothing to show")
    assert int(ours) < 1 << 20 and int(theirs) < 1 << 20, out.stdout  # 32 MiB and 2 MiB pools
    assert int(row) <= 4 << 20 and right == "True", out.stdout  # a 1 MiB row: at most two huge pages


def test_pools_and_captured_buffers_start_on_cache_lines() -> None:
    from infer.backends.cpu.record import Recorder
    from infer.plugins.selection import select_backend

    ops = select_backend("numpy")
    for shape, dtype in [((4096, 8, 64), "float16"), ((64, 16, 128, 128), "float32"), ((7, 3), "float32")]:
        assert ops.zeros(shape, dtype).ctypes.data % 64 == 0
    recorder = Recorder(ops, [np.ones(4, np.float32)], kernels_module.native)
    for shape in [(1, 2048), (3, 5), (1, 8192)]:
        assert recorder.buffer(shape, np.float32).ctypes.data % 64 == 0
