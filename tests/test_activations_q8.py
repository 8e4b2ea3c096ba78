"""Quantized activations (``activations="q8"``, backends/cpu/q8.c): each row of x
rounded to int8 per 32 values, multiplied with the weights' codes in integer
dot products.

What is exact about it, and so asserted bit for bit: every code path (portable,
AVX2, AVX-512 VNNI) computes the same float32 sequence after exact integer sums,
so they agree to the bit; a row's result does not depend on the other rows of
the product, and one row alone (a decode step, which multiplies the blocks as
stored: x86/q8row_x86.c) gives the bits it gets among others. What is approximate, and so
bounded: against the float64 value of the formula the kernel states
(``q8_formula``), the float32 sums of 16 lanes and the per-group products
differ by a few roundings of the sum of absolute terms: 1e-6 * sum|x * w|, the
bound of the exact kernels' own tests (tests/test_numpy_kernels.py), holds for
k <= 8192. Against the exact product the int8 rounding of x moves each output
by about 2^-8 of the terms' size: the model-level tests bound that by what it
does to logits and greedy tokens, and docs/quantization.md reports perplexity
and KL on the real models.
"""
from __future__ import annotations

import numpy as np
import pytest

import infer
from infer.backends import numpy as numpy_backend
from infer.backends.cpu.kernels import Q8_FLAG
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor
from infer.quantize import AffineTensor, from_gguf, quantize_affine

_affine = numpy_backend._affine
pytestmark = pytest.mark.skipif(_affine is None, reason="the C kernels are not built here")
PATHS = _affine.paths() if _affine is not None else []
BLOCK_TYPES = sorted(numpy_backend.BLOCK_FORMS)
#: Widths: one group; 19 groups (a span of 16 and a padded one); whole spans; a 1B model's MLP width.
K_SMALL = [32, 608, 1024]
K_SUPER = [256, 768, 2048, 8192]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    chosen = _affine.simd()
    _affine.use_simd(request.param)
    yield request.param
    _affine.use_simd(chosen)


def stored(qtype: str, n: int, k: int, seed: int) -> tuple[tuple, AffineTensor]:
    """gemv's arguments for random ``qtype`` blocks as stored, and their affine form."""
    raw = gguf_quants.random_blocks(qtype, n, k, seed)
    conv = from_gguf(GGUFQuantizedTensor(qtype, (n, k), raw, "random"), groups=(16, 32), half=True)
    assert conv is not None
    group = 256 if qtype.endswith("_K") else 32
    return (numpy_backend.BLOCK_FORMS[qtype], raw, np.empty(0, np.float32), None, k, n, group, False, 0.0), conv


def run(args: tuple, x: np.ndarray, flag: int = Q8_FLAG) -> np.ndarray:
    bits, codes, scales, biases, k, n, group, half, factor = args
    y = np.full((x.shape[0], n), np.nan, np.float32)
    _affine.gemv(bits | flag, np.ascontiguousarray(x), codes, scales, biases, y, x.shape[0], k, n, group, half,
                 factor)
    return y


def q8_formula(conv: AffineTensor, x: np.ndarray) -> np.ndarray:
    """The kernel's stated result in float64: x rounded per 32 values (scale
    max|x| / 127, codes rint(x * 127 / max|x|)) times W, the biases' term
    included (they multiply the rounded group sums, as ggml's Q8_1 does)."""
    m, k = x.shape
    blocks = x.reshape(m, -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = (np.clip(np.rint(blocks * inv), -127, 127) * d).reshape(m, k).astype(np.float64)
    return xq @ conv.dequantize().astype(np.float64).T


def within(got: np.ndarray, want: np.ndarray, x: np.ndarray, w: np.ndarray) -> bool:
    bound = 1e-6 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30
    return bool((np.abs(got - want) <= bound).all())


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 130])  # 1: the one-row kernels; 130: past the 128 rows quantized at a time
def test_every_block_type_computes_the_stated_formula(path: str, qtype: str, m: int) -> None:
    for seed, k in enumerate(K_SUPER if qtype.endswith("_K") else K_SMALL):
        if m == 130 and k > 2048:
            continue
        n = 37 if k <= 2048 else 6  # tiles of 32 rows and a remainder; odd rows for the 4-row steps
        args, conv = stored(qtype, n, k, seed)
        x = np.random.default_rng(100 + seed).standard_normal((m, k)).astype(np.float32)
        got = run(args, x)
        assert not np.isnan(got).any(), (qtype, m, k)
        assert within(got, q8_formula(conv, x), x, conv.dequantize()), (qtype, m, k)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_every_path_gives_the_same_bits(qtype: str) -> None:
    chosen = _affine.simd()
    try:
        for seed, k in enumerate(K_SUPER[:3] if qtype.endswith("_K") else K_SMALL):
            args, _ = stored(qtype, 21, k, seed)
            x = np.random.default_rng(seed).standard_normal((7, k)).astype(np.float32) * 3
            x[1, :32] = 0.0  # an all-zero block: scale 0
            results = []
            for p in PATHS:  # a few rows (AVX2: each weight row decoded once for all of them) and the tiles
                _affine.use_simd(p)
                results.append(np.vstack([run(args, x[:3]), run(args, x)]))
            for p, r in zip(PATHS, results):
                assert np.array_equal(r.view(np.uint32), results[0].view(np.uint32)), (qtype, k, p)
    finally:
        _affine.use_simd(chosen)


#: Where each block type keeps its codes (bytes of one block), and the byte that puts every code at its
#: largest: 15 for the 4-bit types, 31 for the 5-bit ones (qh's fifth bits set), 63 for Q6_K; Q8_0's code
#: -128 (stored q + 128 = 0, which the AVX2 path takes as |code| 128).
CODE_BYTES = {"Q4_0": (18, 2, 18, 0xFF), "Q4_1": (20, 4, 20, 0xFF), "Q5_0": (22, 2, 22, 0xFF),
              "Q5_1": (24, 4, 24, 0xFF), "Q8_0": (34, 2, 34, 0x80), "Q4_K": (144, 16, 144, 0xFF),
              "Q5_K": (176, 16, 176, 0xFF), "Q6_K": (210, 0, 192, 0xFF)}


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_integer_sums_hold_at_the_largest_codes(qtype: str) -> None:
    # The AVX2 tile kernel sums up to eight vpmaddubsw results in 16-bit lanes before widening them
    # (4-bit codes: 8 x 2 x 15 x 127 = 30480 < 2^15; 5-bit four, Q6_K two): exact only while the codes stay
    # within their type's range. Random codes and activations stay far from the edge, so here every code
    # is at its largest and every activation at +-127 (rows of +1 and -1), where one chunk too many
    # overflows; every path must still give the portable loops' bits and the stated formula.
    size, lo, hi, byte = CODE_BYTES[qtype]
    n, k = 9, 512 if qtype.endswith("_K") else 96
    raw = gguf_quants.random_blocks(qtype, n, k, 5).copy()
    blocks = raw.reshape(n, -1, size)
    blocks[:, :, lo:hi] = byte
    conv = from_gguf(GGUFQuantizedTensor(qtype, (n, k), raw, "extreme"), groups=(16, 32), half=True)
    args = (numpy_backend.BLOCK_FORMS[qtype], raw, np.empty(0, np.float32), None, k, n,
            256 if qtype.endswith("_K") else 32, False, 0.0)
    x = np.ones((5, k), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] *= 1e-3
    chosen = _affine.simd()
    try:
        results = []
        for p in PATHS:
            _affine.use_simd(p)
            results.append(run(args, x))
            assert within(results[-1], q8_formula(conv, x), x, conv.dequantize()), (qtype, p)
        for p, r in zip(PATHS, results):
            assert np.array_equal(r.view(np.uint32), results[0].view(np.uint32)), (qtype, p)
    finally:
        _affine.use_simd(chosen)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_on_load_quantized_weights_take_it_too(path: str, kind: str) -> None:
    # AffineTensor with float32 scales and biases (codes up to 255 for q8: the
    # AVX2 path's signed form of them), as quantize="q8"/"q4" makes them.
    w = np.random.default_rng(3).standard_normal((29, 608)).astype(np.float32)
    a = quantize_affine(w, kind)
    args = numpy_backend.kernel_args(a)
    x = np.random.default_rng(4).standard_normal((6, 608)).astype(np.float32)
    got = run(args, x)
    assert within(got, q8_formula(a, x), x, a.dequantize())


#: Activation rows a product takes on the tile kernels at least (a prompt's); up to Q8_FEW (5) the AVX2 path
#: decodes each weight row once for all of them instead (q8_few_rows_avx2), and up to Q8_FEW_VNNI (4; 2 for the
#: K types) the AVX-512 VNNI path runs its one-row kernel for each (q8_few_rows_vnni).
TILE_M = 6


def rows_alone_as_together(args: tuple, x: np.ndarray, label: tuple) -> np.ndarray:
    """Each row of x alone (a decode step's one-row kernels) gets the bits it
    gets among the others (the tile kernels: x padded to TILE_M rows), and is
    not the exact product."""
    more = np.random.default_rng(7).standard_normal((max(TILE_M - x.shape[0], 0), x.shape[1])).astype(np.float32)
    together = run(args, np.vstack([x, more]))[: x.shape[0]]
    for i in range(x.shape[0]):
        alone = run(args, x[i:i + 1])
        assert np.array_equal(alone.view(np.uint32), together[i:i + 1].view(np.uint32)), (*label, i)
    assert not np.array_equal(run(args, x[:1]), run(args, x[:1], flag=0)), label  # int8 x, not exact
    return together


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_one_row_alone_has_the_bits_it_has_among_others(path: str, qtype: str) -> None:
    # A decode step's product (one row) runs the one-row kernels on the blocks as
    # stored; a prompt's runs the tile kernels on interleaved codes. The same
    # row gets the same bits from both, on every path: widths with a last span
    # of 16 groups that is full, nearly empty (608 = 19 groups; 768 = 3 super-
    # blocks, one of two in the last span) or a single block (32), and an odd
    # number of weight rows (the one-row kernels take two at a time).
    for seed, k in enumerate(K_SUPER if qtype.endswith("_K") else K_SMALL + [96, 544]):
        args, _ = stored(qtype, 23, k, seed)
        x = np.random.default_rng(50 + seed).standard_normal((4, k)).astype(np.float32) * 2
        x[2, : min(k, 64)] = 0.0  # all-zero blocks: scale 0
        rows_alone_as_together(args, x, (qtype, k))


@pytest.mark.parametrize("form", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "q4", "q8"])
def test_one_row_on_an_affine_form_has_the_bits_it_has_among_others(path: str, form: str) -> None:
    # The affine forms (codes a nibble or a byte, scales in their own arrays):
    # Q5_0 and Q5_1 take them at load where their blocks are not kept (AVX2),
    # quantize="q4"/"q8" gives them to Hugging Face weights. A decode step's
    # product on them reads the codes in place (x86/q8row_x86.c), a prompt's
    # packs them into tiles; the same bits from both, and the stated formula.
    # The converted GGUF forms have float16 scales and (symmetric types) no
    # biases, Q6_K's bytes groups of 16; quantize_affine's float32 scales and
    # biases. Widths with a last span that is full, has an odd number of
    # groups (608: 19; 544: 17; 96: 3) or is a single group.
    widths = K_SUPER[:3] if form == "Q6_K" else K_SMALL + [96, 544]
    for seed, k in enumerate(widths):
        if form in ("q4", "q8"):
            a = quantize_affine(np.random.default_rng(seed).standard_normal((23, k)).astype(np.float32), form)
        else:
            _, a = stored(form, 23, k, seed)
        args = numpy_backend.kernel_args(a)
        x = np.random.default_rng(70 + seed).standard_normal((4, k)).astype(np.float32) * 2
        x[2, : min(k, 64)] = 0.0  # all-zero groups: scale 0
        together = rows_alone_as_together(args, x, (form, k))
        assert within(together, q8_formula(a, x), x, a.dequantize()), (form, k)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_blocks_as_stored_give_the_converted_forms_bits(path: str, qtype: str) -> None:
    # Which types a load keeps as stored differs between the modes on AVX2
    # (kernels.stored_types: Q5_0 and Q5_1 too with q8): the choice is one of
    # speed only, because on every path the product on the file's blocks has,
    # bit for bit, the bits of the product on their converted form, for one
    # row (the one-row kernels), a few (the few-row kernels) and a
    # prompt's worth (the tiles).
    for seed, k in enumerate(K_SUPER[:3] if qtype.endswith("_K") else K_SMALL + [96]):
        args, conv = stored(qtype, 21, k, seed)
        x = np.random.default_rng(90 + seed).standard_normal((130, k)).astype(np.float32) * 2
        x[1, : min(k, 64)] = 0.0
        for m in (1, 3, 8, 130):
            got, want = run(args, x[:m]), run(numpy_backend.kernel_args(conv), x[:m])
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype, k, m)


def test_a_q8_load_keeps_the_types_its_kernels_read_faster_as_stored() -> None:
    # An exact load and a q8 load keep the types of their own sets as the file
    # stores them (no conversion, the file's bytes read per token); the rest
    # are converted to their affine form. On AVX2 the q8 set adds Q5_0 and
    # Q5_1, whose fifth bits the int8 kernels unpack for less than the bytes
    # they save.
    from infer.backends.cpu import kernels
    from infer.ops import LoadSettings, PackedWeight

    assert kernels.stored_types() == kernels.STORED_TYPES == kernels.STORED_BY_PATH[_affine.simd()]
    assert kernels.stored_types("q8") == kernels.STORED_TYPES_Q8 == kernels.STORED_BY_PATH_Q8[_affine.simd()]
    assert set(kernels.STORED_BY_PATH_Q8) == set(kernels.STORED_BY_PATH)
    for name, types in kernels.STORED_BY_PATH_Q8.items():
        assert kernels.STORED_BY_PATH[name] <= types <= set(BLOCK_TYPES)
    assert kernels.STORED_BY_PATH_Q8["avx2+fma"] == set(BLOCK_TYPES)
    for activations in (None, "q8"):
        ops = numpy_backend.NumpyBackend().configure(LoadSettings(activations=activations))
        for qtype in BLOCK_TYPES:
            t = GGUFQuantizedTensor(qtype, (8, 256), gguf_quants.random_blocks(qtype, 8, 256, 0), "random")
            w = ops.prepare_weight(t, name="blk.0.ffn_up.weight")
            assert isinstance(w, PackedWeight)
            if qtype in kernels.stored_types(activations):
                assert w.data is t and w.scheme == f"{qtype} blocks as stored, C kernel", (activations, qtype)
            else:
                assert isinstance(w.data, AffineTensor), (activations, qtype)
            x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
            assert np.array_equal(ops.quantized_linear(x, w), run(numpy_backend.kernel_args(t), x,
                                                                  Q8_FLAG if activations else 0)), (activations, qtype)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_a_few_rows_have_the_bits_they_have_among_many(path: str, qtype: str) -> None:
    # A small batch's decode step or a speculative verification multiplies a
    # few rows: on AVX2 up to 5 of them take each weight row's blocks decoded
    # once and applied to every activation row (q8_few_rows_avx2), on AVX-512
    # VNNI up to 4 (2 of a K type) the one-row kernel for each in turn
    # (q8_few_rows_vnni), more the tiles (their codes packed by
    # q8_pack_spans_avx2 on both paths). Each row keeps
    # the bits it gets among many, for every count up to 8: the widths above,
    # 8192 (rows longer than LONG_ROW, read with their spans prefetched
    # ahead), an all-zero block, and odd weight-row counts.
    widths = K_SUPER if qtype.endswith("_K") else K_SMALL + [96, 544, 8192]
    for seed, k in enumerate(widths):
        args, _ = stored(qtype, 37 if k <= 2048 else 9, k, seed)
        x = np.random.default_rng(80 + seed).standard_normal((12, k)).astype(np.float32) * 2
        x[3, : min(k, 64)] = 0.0
        many = run(args, x)
        for m in range(2, 9):
            assert np.array_equal(run(args, x[:m]).view(np.uint32), many[:m].view(np.uint32)), (qtype, k, m)


def test_rows_do_not_depend_on_each_other() -> None:
    args, _ = stored("Q4_K", 40, 2048, 0)
    x = np.random.default_rng(5).standard_normal((9, 2048)).astype(np.float32)
    together = run(args, x)
    for i in range(1, 9):  # each row, in products of other sizes with other neighbours
        assert np.array_equal(run(args, x[i - 1:i + 1])[1], together[i])
    for i in range(7):
        assert np.array_equal(run(args, x[i:i + 3])[0], together[i])


def test_the_rounding_error_is_that_of_int8() -> None:
    # Rounding x to steps of max|x| / 127 per 32 values errs by a uniform
    # +-step/2 per value: variance step^2 / 12, times each weight squared, summed
    # over k. The errors against the exact product have that spread (within 15%
    # over 4,096 outputs): no more (a wrong step or code) and no less (nothing
    # was rounded). 64 rows of x, not fewer: the random rows of W share a mean
    # (3.3 against an rms of 8.4), so one x row's rounding moves all of its 64
    # outputs together, and with 8 rows the estimate itself spread 0.97-1.17
    # over seeds (64 rows: 0.97-1.01).
    args, conv = stored("Q4_K", 64, 2048, 1)
    x = np.random.default_rng(6).standard_normal((64, 2048)).astype(np.float32)
    w = conv.dequantize().astype(np.float64)
    err = run(args, x) - x.astype(np.float64) @ w.T
    step = np.repeat(np.abs(x.reshape(64, -1, 32)).max(-1) / 127, 32, axis=1).astype(np.float64)
    predicted = (step ** 2 / 12) @ (w ** 2).T
    assert 0.85 < np.sqrt((err ** 2).mean() / predicted.mean()) < 1.15


def test_bad_flags_are_value_errors() -> None:
    args, _ = stored("Q4_K", 4, 256, 0)
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError):
        run((args[0] | 1 << 20,) + args[1:], x)


# -- the backend -----------------------------------------------------------------------------


def test_numpy_offers_q8_activations() -> None:
    assert "q8" in numpy_backend.NumpyBackend.activation_schemes


#: A prompt of plain prose (47 tokens on SmolLM2's tokenizer).
TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor "
        "in 27 BC, and in the West it ended in 476 AD when the last emperor was deposed. During this time")


def _prompt_logits(model: infer.Model, ids: list[int]) -> np.ndarray:
    engine = model.engine
    seq = engine.new_sequence()
    rows = model.backend.to_numpy(engine.forward(seq, ids, all_logits=True)).astype(np.float64)
    engine.release(seq)
    return rows


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_a_prompt_on_q8_activations_stays_near_the_exact_distribution(alias: str) -> None:
    # Measured on these two models and this prompt (2026-12-04): mean KL 0.0148 and
    # 0.0127 nats, top-1 agreement 0.98 and 1.0 (real activations are heavy-tailed:
    # a 32-value block's largest value sets the step for the rest). Bounds at 3x the
    # KL and 0.9 of the rows: a wrong scale, lane or code order gives KL of order 1
    # and top-1 agreement near chance.
    exact = infer.load(alias, backend="numpy", compile=False)
    q8 = infer.load(alias, backend="numpy", compile=False, activations="q8")
    assert q8.backend.activations == "q8" and exact.backend.activations is None
    ids = exact.tokenizer.encode(TEXT)
    a, b = _prompt_logits(exact, ids), _prompt_logits(q8, ids)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1).mean()
    assert 1e-5 < kl < 0.045, kl  # above 1e-5: the activations were quantized at all
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_batched_decoding_records_the_quantized_products() -> None:
    # Several sequences decode through the recorded step's products (two or more
    # rows: quantized); the eager forward quantizes the same rows, so both give
    # the same tokens, which they would not if either product ran exact.
    from reference import tiny_model_dir

    from infer.engine.batch import BatchEngine
    from infer.engine.generate import StopConditions
    from infer.engine.sampling import SamplingParams

    prompts = [list(range(3, 30)), [9, 8, 7, 6], list(range(50, 63))]
    stop = StopConditions(max_tokens=10, ignore_eos=True)
    results = []
    for compile_ in (False, None, True):  # eager; the recorded step by default; and asked for
        model = infer.load(tiny_model_dir("llama3"), backend="numpy", quantize="q8", activations="q8",
                           compile=compile_)
        batch = BatchEngine(model.engine)
        handles = [batch.submit(p, SamplingParams(), stop) for p in prompts]
        batch.run_until_done()
        results.append([h.tokens for h in handles])
    exact = infer.load(tiny_model_dir("llama3"), backend="numpy", quantize="q8", compile=False)
    batch = BatchEngine(exact.engine)
    handles = [batch.submit(p, SamplingParams(), stop) for p in prompts]
    batch.run_until_done()
    assert results[0] == results[1] == results[2]
    assert len({len(t) for t in results[0]}) == 1 and all(len(t) == 10 for t in results[0])


def test_float_weights_are_not_touched() -> None:
    # Only products on quantized codes quantize their activations: a float32
    # model's logits are the exact ones.
    from reference import tiny_model_dir

    exact = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False)
    q8 = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False, activations="q8")
    ids = list(range(3, 40))
    np.testing.assert_array_equal(_prompt_logits(q8, ids), _prompt_logits(exact, ids))


def test_the_peak_loops_count_their_multiply_adds() -> None:
    """benchmarks/q8_gemm.py divides the count by its own clock: the count must be
    the loop's (chains x lanes x iterations), and a kind the CPU lacks an error."""
    lanes = {"vnni512": 12 * 64, "maddubs256": 12 * 32, "fma512": 12 * 16, "fma256": 12 * 8}
    have = {"avx512": {"vnni512", "maddubs256", "fma512", "fma256"}, "avx2+fma": {"maddubs256", "fma256"}}
    runnable = set().union(*(have.get(p, set()) for p in PATHS))
    for kind, per in lanes.items():
        if kind not in runnable:
            with pytest.raises(ValueError):
                _affine.peak(kind, 1000)
            continue
        try:
            assert _affine.peak(kind, 1000) == per * 1000
        except ValueError:  # AVX-512 without VNNI
            assert kind == "vnni512"
    with pytest.raises(ValueError, match="no peak loop"):
        _affine.peak("sse", 10)
    with pytest.raises(ValueError, match="at least 0"):
        _affine.peak("fma256", -1)
