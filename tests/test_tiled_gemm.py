"""The exact many-row product (backends/cpu/tiled.c): each panel of a quantized
weight decoded once and reused for every row of x, on every code path this CPU
runs, against the float64 product of the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest

from infer.backends import numpy as numpy_backend
from infer.backends.cpu import kernels
from infer.backends.numpy import kernel_args
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.ops import PackedWeight
from infer.quantize import AffineTensor, from_gguf, quantize_affine

_native = numpy_backend._affine
pytestmark = pytest.mark.skipif(_native is None or not hasattr(_native, "gemm"),
                                reason="the C kernels (with the tiled product) are not built here")
PATHS = _native.paths() if _native is not None else []


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    chosen = _native.simd()
    _native.use_simd(request.param)
    yield request.param
    _native.use_simd(chosen)


def weight(kind: int | str, n: int, k: int, seed: int) -> AffineTensor | GGUFQuantizedTensor:
    """4 or 8: on-load quantization (float32 scales); ``"Q4_K"`` etc.: the GGML
    blocks as stored; ``"Q4_1~"``: the affine form the backend converts the type to."""
    if isinstance(kind, int):
        return quantize_affine(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), f"q{kind}")
    qtype = kind.rstrip("~")
    t = GGUFQuantizedTensor(qtype, (n, k), gguf_quants.random_blocks(qtype, n, k, seed), f"random {qtype}")
    if kind.endswith("~"):
        a = from_gguf(t, groups=(16, 32))
        assert a is not None
        return a.half_scales()
    return t


def args(w: AffineTensor | GGUFQuantizedTensor) -> tuple:
    """The kernel's arguments for ``w``: GGML blocks as stored on every path,
    also where the path in use converts the type at load (STORED_TYPES), since
    the kernel takes all eight whichever path runs."""
    if isinstance(w, AffineTensor):
        return kernel_args(w)
    n, k = w.shape
    group = 256 if w.qtype.endswith("_K") else 32
    return kernels.BLOCK_FORMS[w.qtype], w.ggml_blocks()[1], np.empty(0, np.float32), None, k, n, group, False, 0.0


def gemm(w: AffineTensor | GGUFQuantizedTensor, x: np.ndarray) -> np.ndarray:
    bits, codes, scales, biases, k, n, group, half, factor = args(w)
    out = np.full((x.shape[0], n), np.nan, np.float32)  # poisoned: every element must be written
    _native.gemm(bits, x, codes, scales, biases, out, x.shape[0], k, n, group, half, factor)
    return out


def within(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> bool:
    """``got`` against the float64 product. Each output is one float32 chain of
    k fused multiply-adds (tiled.c), whose error bound is k u sum_c |x_c w_c|
    (u = 2^-24); its rounding errors are random in sign, so they sum to about
    u times that sum at any k (the partial sums grow as the products do), and
    17 u (1e-6) is far from both that and a wrong result."""
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-6 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30
    return got.shape == ref.shape and bool((np.abs(got - ref) <= bound).all())


#: Every form the kernel takes: GGML's eight block types as stored, their affine
#: forms (float16 scales; Q6_K's groups of 16), on-load 4- and 8-bit codes.
KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1~", "Q5_0~", "Q6_K~", 4, 8]


@pytest.mark.parametrize("kind", KINDS)
def test_the_tiled_product_matches_the_dequantized_product(path: str, kind: int | str) -> None:
    # Odd shapes: panels of 16 and 32 rows with a part-filled last one (n 37, 70),
    # rows of x past the micro-kernels' 6 and 12 (m 13, 29), k of one to nine chunks.
    k_types = isinstance(kind, str) and "_K" in kind
    for seed, (m, n, k) in enumerate([(1, 1, 256), (13, 37, 512), (29, 70, 2304 if k_types else 800),
                                      (17, 64, 256)]):
        w = weight(kind, n, k, seed)
        x = np.random.default_rng(100 + seed).standard_normal((m, k)).astype(np.float32)
        dense = w.dequantize()
        assert within(gemm(w, x), x, dense), (kind, m, n, k)


def test_avx2_and_avx512_give_the_same_bits() -> None:
    # One fused multiply-add a column in the same order on both (tiled.c's top comment).
    if "avx512" not in PATHS:
        pytest.skip("this CPU has no AVX-512")
    chosen = _native.simd()
    w = weight("Q4_K", 70, 768, 3)
    x = np.random.default_rng(3).standard_normal((29, 768)).astype(np.float32)
    try:
        got = {}
        for p in ("avx2+fma", "avx512"):
            _native.use_simd(p)
            got[p] = gemm(w, x)
    finally:
        _native.use_simd(chosen)
    assert np.array_equal(got["avx2+fma"].view(np.uint32), got["avx512"].view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(path: str, kind: str) -> None:
    # Each output is its own chain of sums: the same bits alone, in a micro-kernel
    # block of any height, and at any place in the call.
    w = weight(kind, 40, 512, 1)
    x = np.random.default_rng(1).standard_normal((31, 512)).astype(np.float32)
    whole = gemm(w, x)
    for rows in ([7], [0, 1], list(range(5, 18)), [30]):
        assert np.array_equal(gemm(w, np.ascontiguousarray(x[rows])).view(np.uint32), whole[rows].view(np.uint32))


def test_bad_arguments_are_value_errors() -> None:
    w = weight("Q4_K", 8, 256, 0)
    bits, codes, scales, biases, k, n, group, half, factor = args(w)
    x, out = np.zeros((3, 256), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="out"):
        _native.gemm(bits, x, codes, scales, biases, out[:2], 3, k, n, group, half, factor)
    with pytest.raises(ValueError, match="exact"):
        _native.gemm(bits | kernels.Q8_FLAG, x, codes, scales, biases, out, 3, k, n, group, half, factor)
    with pytest.raises(ValueError, match="m=0"):
        _native.gemm(bits, x, codes, scales, biases, out, 0, k, n, group, half, factor)


def test_the_backend_picks_the_tiled_product_past_the_decoding_rows(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ops = numpy_backend.NumpyBackend()
    w = weight("Q4_K", 48, 512, 2)
    packed = kernels.with_kernel_args(PackedWeight(w.shape, "Q4_K", "blocks", w, rows=w))
    calls = []
    real_gemm, real_dequantize = _native.gemm, _native.dequantize
    monkeypatch.setattr(_native, "gemm", lambda *a: calls.append("tiled") or real_gemm(*a))
    monkeypatch.setattr(_native, "dequantize", lambda *a: calls.append("blas") or real_dequantize(*a))
    x = np.random.default_rng(2).standard_normal((ops.KERNEL_ROWS + 1, 512)).astype(np.float32)
    results = {}
    for how in ("tiled", "blas"):
        monkeypatch.setattr(kernels, "EXACT_GEMM", how)
        calls.clear()
        results[how] = ops.linear(x, packed)
        assert set(calls) == {how}
    assert within(results["tiled"], x, w.dequantize()) and within(results["blas"], x, w.dequantize())
    calls.clear()
    ops.linear(x[:ops.KERNEL_ROWS], packed)  # decoding's rows stay on the decoding kernel
    assert calls == []


def test_the_default_is_tiled_on_simd_paths_and_blas_on_the_portable_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``INFER_EXACT_GEMM`` unset (``auto``): the tiled kernel where it measured
    faster than BLAS (AVX2, AVX-512), BLAS on the portable path (whose plain-C
    micro-kernel is slower); a named choice wins; anything else is refused."""
    chosen = _native.simd()
    try:
        for simd in PATHS:
            _native.use_simd(simd)
            monkeypatch.delenv(kernels.EXACT_GEMM_ENV, raising=False)
            assert kernels._exact_gemm_choice() == ("blas" if simd == "portable" else "tiled")
            for named in ("tiled", "blas"):
                monkeypatch.setenv(kernels.EXACT_GEMM_ENV, named)
                assert kernels._exact_gemm_choice() == named
    finally:
        _native.use_simd(chosen)
    monkeypatch.setenv(kernels.EXACT_GEMM_ENV, "fast")
    with pytest.raises(kernels.ConfigError, match="INFER_EXACT_GEMM='fast'"):
        kernels._exact_gemm_choice()


def test_a_long_prompts_rows_go_in_calls_of_tiled_rows_with_the_same_bits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """More rows than ``TILED_ROWS`` go to the kernel in calls of at most that
    many (its packed copy of x stays bounded); each row's result is the one
    it gets in a single call."""
    w = weight("Q4_K", 40, 512, 3)
    x = np.random.default_rng(4).standard_normal((23, 512)).astype(np.float32)
    whole = np.empty((23, 40), np.float32)
    kernels.affine_gemm(x, w, whole)
    monkeypatch.setattr(kernels, "TILED_ROWS", 10)
    calls = []
    real = _native.gemm
    monkeypatch.setattr(_native, "gemm", lambda *a: calls.append(a[6]) or real(*a))
    parts = np.empty((23, 40), np.float32)
    kernels.affine_gemm(x, w, parts)
    assert calls == [10, 10, 3] and np.array_equal(parts, whole)


def test_a_long_prompts_attention_chunks_on_threads_give_the_same_bits() -> None:
    """After products on the kernels' threads (tiled or q8), a long causal
    prompt's attention chunks run on a thread pool with BLAS on one thread:
    the result is the serial loop's, bit for bit (each chunk's arithmetic is
    its own), windowed and with sinks too."""
    ops = numpy_backend.NumpyBackend()
    rng = np.random.default_rng(5)
    tq, hq, hkv, d = 300, 4, 2, 32
    q = rng.standard_normal((tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((tq, hkv, d)).astype(np.float32)
    v = rng.standard_normal((tq, hkv, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    pool = ops._chunk_pool()
    if pool is None:
        pytest.skip("the kernels run on one thread here: no pool")
    for window, sink in ((None, None), (40, sinks)):
        serial = ops._dense_attention(q, k, v, 0, 0, 0.17, True, window, None, sink)
        spread = ops._dense_attention(q, k, v, 0, 0, 0.17, True, window, None, sink, pool)
        assert np.array_equal(serial, spread)


def test_the_attention_pool_is_made_again_in_a_forked_child() -> None:
    """A process forked after the pool exists has none of its threads: the
    child makes its own rather than queue work for threads that are not there."""
    import os
    ops = numpy_backend.NumpyBackend()
    pool = ops._chunk_pool()
    if pool is None:
        pytest.skip("the kernels run on one thread here: no pool")
    assert ops._chunk_pool() is pool
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            fresh = ops._chunk_pool()
            ok = fresh is not pool and fresh.submit(lambda: 7).result(timeout=10) == 7
        except BaseException:
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    import select
    ready, _, _ = select.select([read], [], [], 60)  # a child stuck after fork must fail the test, not hang it
    got = os.read(read, 1) if ready else b""
    if not ready:
        os.kill(child, 9)
    os.waitpid(child, 0)
    os.close(read)
    assert got == b"1"
