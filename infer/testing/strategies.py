"""Hypothesis strategies that draw the conformance kit's op calls.

Each strategy draws a :class:`~infer.testing.calls.Call`: shapes,
axes, flags and dtypes come from hypothesis, the values from numpy seeded
with a drawn seed (fast, and a failing call prints small). Value ranges keep
float16 clear of overflow and underflow where a correct implementation would
not hit them (e.g. ``exp`` inputs stay in [-10, 10]); ``rms_norm`` squares
values past float16's range on purpose, which the contract's "mean in at
least float32" makes harmless.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from infer.testing import missing_hypothesis

try:
    from hypothesis import strategies as st
except ImportError as exc:  # not a dependency of infer
    raise missing_hypothesis(exc) from exc

from infer.testing.calls import Call, In

seeds = st.integers(0, 2**32 - 1)


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale + offset).astype(np.float32)


def shapes(min_dims: int = 1, max_dims: int = 3, max_side: int = 8) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def float_array(draw: Any, scale: Any = st.sampled_from([0.1, 1.0, 3.0]), min_dims: int = 1,
                max_dims: int = 3, clip: float | None = None) -> In:
    x = normal(draw(seeds), draw(shapes(min_dims, max_dims)), draw(scale))
    return In(np.clip(x, -clip, clip) if clip is not None else x)


def unary(clip: float | None = None, scale: Any = st.sampled_from([0.1, 1.0, 3.0])) -> Any:
    return float_array(scale=scale, clip=clip).map(lambda x: Call((x,)))


# -- transfer, creation, casting -----------------------------------------------------------


@st.composite
def from_numpy_calls(draw: Any, kind: str) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    if kind == "float":
        host = normal(seed, shape, 3.0)
        dtype = draw(st.sampled_from([None, "float32"]))
    else:
        host = np.random.default_rng(seed).integers(-1000, 1000, shape).astype(kind)
        dtype = draw(st.sampled_from([None, kind]))
    return Call(info={"host": host, "dtype": dtype})


@st.composite
def astype_calls(draw: Any, target: str) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    if target in ("int32", "int64"):  # truncation toward zero, negatives included
        x = In(np.random.default_rng(seed).uniform(-100, 100, shape).astype(np.float32))
    elif draw(st.booleans()):
        x = In(normal(seed, shape, 3.0))
    else:
        x = In(np.random.default_rng(seed).integers(-500, 500, shape).astype(np.int32), "int32")
    return Call((x, target))


@st.composite
def array_of_kind(draw: Any) -> In:
    shape, seed = draw(shapes()), draw(seeds)
    kind = draw(st.sampled_from(["float", "int32", "int64"]))
    if kind == "float":
        return In(normal(seed, shape))
    return In(np.random.default_rng(seed).integers(-100, 100, shape).astype(kind), kind)


@st.composite
def zeros_calls(draw: Any) -> Call:
    return Call(info={"shape": draw(shapes(0, 3)), "dtype": draw(st.sampled_from([None, "float32", "int32", "int64"]))})


@st.composite
def arange_calls(draw: Any) -> Call:
    start = draw(st.integers(-20, 40))
    stop = start + draw(st.integers(0, 40))
    return Call(info={"start": start, "stop": stop, "dtype": draw(st.sampled_from([None, "int32", "int64"]))})


# -- linear algebra --------------------------------------------------------------------------


@st.composite
def matmul_calls(draw: Any) -> Call:
    m, k, n, b = (draw(st.integers(1, 12)) for _ in range(4))
    form = draw(st.sampled_from(["2d", "batched", "broadcast", "vec-mat", "mat-vec"]))
    a_shape, b_shape = {
        "2d": ((m, k), (k, n)), "batched": ((b, m, k), (b, k, n)), "broadcast": ((b, m, k), (k, n)),
        "vec-mat": ((k,), (k, n)), "mat-vec": ((m, k), (k,)),
    }[form]
    seed = draw(seeds)
    return Call((In(normal(seed, a_shape)), In(normal(seed + 1, b_shape))), info={"form": form})


@st.composite
def linear_calls(draw: Any, bias: bool) -> Call:
    lead = draw(st.sampled_from([(1,), (draw(st.integers(2, 9)),), (2, 3), ()]))
    # At least 4 outputs: NMSE of one output that cancels to ~0 measures only luck.
    d_in, d_out, seed = draw(st.integers(1, 48)), draw(st.integers(4, 48)), draw(seeds)
    x = In(normal(seed, lead + (d_in,)))
    w = In(normal(seed + 1, (d_out, d_in), 1 / math.sqrt(d_in)), weight=True)
    bias_arg = In(normal(seed + 2, (d_out,), 0.1), weight=True) if bias else None
    return Call((x, w, bias_arg))


@st.composite
def lora_linear_calls(draw: Any, bias: bool, qtype: str | None = None) -> Call:
    """``lora_linear``'s calls: rows of several adapter slots, in runs and
    interleaved, some at scale 0 (the base model's rows). ``qtype``: the base
    weight is a random GGUF matrix of that type (``info`` says which), not an
    argument."""
    t, rank, n_slots, seed = draw(st.integers(1, 9)), draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(seeds)
    d_in = draw(st.sampled_from([32, 64])) if qtype else draw(st.integers(1, 40))
    d_out = draw(st.integers(4, 40))
    rng = np.random.default_rng(seed)
    x = In(normal(seed, (t, d_in)))
    w = None if qtype else In(normal(seed + 1, (d_out, d_in), 1 / math.sqrt(d_in)), weight=True)
    b = In(normal(seed + 2, (d_out,), 0.1), weight=True) if bias else None
    a_pool = In(normal(seed + 3, (n_slots, rank, d_in), 1 / math.sqrt(d_in)))
    b_pool = In(normal(seed + 4, (n_slots, d_out, rank), 1 / math.sqrt(rank)))
    slots = np.sort(rng.integers(0, n_slots, t)) if draw(st.booleans()) else rng.integers(0, n_slots, t)
    scales = rng.choice([0.0, 0.5, 1.0, 2.0], t).astype(np.float32)
    args = (x, w, b, a_pool, b_pool, In(slots.astype(np.int32), "int32"), In(scales))
    info = {"qtype": qtype, "shape": (d_out, d_in), "seed": seed} if qtype else {}
    return Call(args, info=info)


@st.composite
def expert_linear_calls(draw: Any) -> Call:
    """``expert_linear``'s calls: rows routed to a few experts, in runs,
    interleaved, or all to one; some experts get no row."""
    t, experts, seed = draw(st.integers(1, 12)), draw(st.integers(1, 5)), draw(seeds)
    d_in, d_out = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, t)
    ids = draw(st.sampled_from([ids, np.sort(ids), np.full(t, experts - 1)]))
    weights = [In(normal(seed + 1 + e, (d_out, d_in), 1 / math.sqrt(d_in)), weight=True) for e in range(experts)]
    return Call((In(normal(seed, (t, d_in))), weights, In(ids.astype(np.int32), "int32")))


# -- elementwise -------------------------------------------------------------------------------


@st.composite
def binary_calls(draw: Any, op: str, ints: bool = False) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    rng = np.random.default_rng(seed)
    form = draw(st.sampled_from(["same", "broadcast", "scalar"]))
    if form == "broadcast":  # b drops leading axes and/or has size-1 axes
        b_shape = tuple(1 if draw(st.booleans()) else s for s in shape)[draw(st.integers(0, len(shape) - 1)):]
    else:
        b_shape = shape

    def values(shape: tuple[int, ...]) -> np.ndarray:
        if ints:
            return rng.integers(1 if op == "div" else -50, 50, shape).astype(np.int32)
        if op == "div":  # keep denominators away from zero
            return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape)).astype(np.float32)
        return rng.standard_normal(shape).astype(np.float32)

    kind = "int32" if ints else "float"
    a = In(values(shape), kind)
    if form == "scalar":
        b: Any = int(rng.integers(1, 5)) if ints else float(values(()))
    else:
        b = In(values(b_shape), kind)
    return Call((a, b), info={"form": form})


@st.composite
def sqrt_calls(draw: Any) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    x = np.abs(normal(seed, shape, draw(st.sampled_from([1e-2, 1.0, 100.0]))))
    if draw(st.booleans()):
        x[np.random.default_rng(seed).random(shape) < 0.2] *= -1  # NaN for negative inputs
    return Call((In(x),))



# -- reductions -------------------------------------------------------------------------------


@st.composite
def reduce_calls(draw: Any, keepdims: bool = True, ties: bool = False) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    if ties and draw(st.booleans()):  # few distinct values: the first maximum must win
        x = np.random.default_rng(seed).integers(-3, 3, shape).astype(np.float32)
    else:
        x = normal(seed, shape, draw(st.sampled_from([0.1, 1.0, 10.0])))
    kwargs: dict[str, Any] = {"axis": draw(st.integers(-len(shape), len(shape) - 1))}
    if keepdims:
        kwargs["keepdims"] = draw(st.booleans())
    return Call((In(x),), kwargs)


@st.composite
def topk_calls(draw: Any) -> Call:
    shape, seed = draw(shapes(1, 3)), draw(seeds)
    if draw(st.booleans()):  # few distinct values: the lower index must come first among ties
        x = np.random.default_rng(seed).integers(-3, 3, shape).astype(np.float32)
    else:
        x = normal(seed, shape, draw(st.sampled_from([0.1, 1.0, 10.0])))
    if draw(st.booleans()):  # masked entries (group-limited routing) sort last
        x = np.where(np.random.default_rng(seed + 1).random(shape) < 0.3, np.float32(-np.inf), x)
    return Call((In(x), draw(st.integers(1, shape[-1]))))


@st.composite
def softmax_calls(draw: Any, masked_row: bool = False) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    rng = np.random.default_rng(seed)
    x = normal(seed, shape, draw(st.sampled_from([1.0, 5.0, 20.0])))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    if draw(st.booleans()):  # masked entries, as attention masks produce
        x[rng.random(shape) < 0.3] = -np.inf
        first = [slice(None)] * len(shape)
        first[axis] = slice(0, 1)
        x[tuple(first)] = rng.standard_normal(x[tuple(first)].shape)  # every row keeps one finite entry
    if masked_row:  # a row entirely -inf gives NaN (contract)
        row = [slice(None)] * len(shape)
        for d in range(len(shape)):
            if d != axis % len(shape):
                row[d] = 0
        x[tuple(row)] = -np.inf
    return Call((In(x),), {"axis": axis})


# -- norms, rope, gathers -----------------------------------------------------------------------


@st.composite
def rms_norm_calls(draw: Any) -> Call:
    shape, seed = draw(shapes(1, 3, 64)), draw(seeds)
    d = shape[-1]
    x = In(normal(seed, shape, draw(st.sampled_from([1e-2, 1.0, 100.0]))))
    w = In(normal(seed + 1, (d,), 0.1, 1.0), weight=True) if draw(st.booleans()) else None
    return Call((x, w, draw(st.sampled_from([1e-6, 1e-5]))))


@st.composite
def fused_add_rms_norm_calls(draw: Any) -> Call:
    rows, d, seed = draw(st.integers(1, 6)), draw(st.integers(1, 64)), draw(seeds)
    x, residual = In(normal(seed, (rows, d))), In(normal(seed + 1, (rows, d), 3.0))
    w = In(normal(seed + 2, (d,), 0.1, 1.0), weight=True) if draw(st.booleans()) else None
    return Call((x, residual, w, 1e-6))


@st.composite
def layer_norm_calls(draw: Any) -> Call:
    shape, seed = draw(shapes(1, 3, 64)), draw(seeds)
    d = shape[-1]
    x = In(normal(seed, shape, 1.0, draw(st.sampled_from([0.0, 3.0, -50.0]))))
    w = In(normal(seed + 1, (d,), 0.1, 1.0), weight=True) if draw(st.booleans()) else None
    b = In(normal(seed + 2, (d,), 0.1), weight=True) if draw(st.booleans()) else None
    return Call((x, w, b, draw(st.sampled_from([1e-6, 1e-5]))))


@st.composite
def rope_calls(draw: Any, partial: bool) -> Call:
    tokens, heads, seed = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(seeds)
    head_dim = 2 * draw(st.integers(1, 16))
    rot = 2 * draw(st.integers(1, head_dim // 2)) if partial else head_dim
    positions = np.random.default_rng(seed).integers(0, 4096, tokens)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)
    angles = (positions[:, None] * inv_freq[None, :]).astype(np.float32)
    x = In(normal(seed, (tokens, heads, head_dim)))
    return Call((x, In(np.cos(angles)), In(np.sin(angles))), {"interleaved": draw(st.booleans())})


@st.composite
def embedding_calls(draw: Any, out_of_range: bool = False) -> Call:
    vocab, d, n, seed = draw(st.integers(1, 50)), draw(st.integers(1, 32)), draw(st.integers(1, 8)), draw(seeds)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, n)
    if out_of_range:
        ids[rng.integers(0, n)] = draw(st.sampled_from([vocab, vocab + 7, -1]))
    kind = draw(st.sampled_from(["int32", "int64"]))
    return Call((In(normal(seed, (vocab, d)), weight=True), In(ids.astype(kind), kind)))


@st.composite
def take_calls(draw: Any) -> Call:
    x = draw(array_of_kind())
    ndim = x.value.ndim
    axis = draw(st.integers(-ndim, ndim - 1))
    n = x.value.shape[axis]
    kind = draw(st.sampled_from(["int32", "int64"]))
    idx = np.random.default_rng(draw(seeds)).integers(0, n, draw(st.integers(1, 6))).astype(kind)
    return Call((x, In(idx, kind)), {"axis": axis})


# -- shapes ----------------------------------------------------------------------------------------


@st.composite
def reshape_calls(draw: Any) -> Call:
    x = draw(array_of_kind())
    factors = [p for s in x.value.shape for p in _primes(s)]
    rank = draw(st.integers(1, 4))
    bins = [1] * rank
    for p in factors:
        bins[draw(st.integers(0, rank - 1))] *= p
    if draw(st.booleans()):
        bins[draw(st.integers(0, rank - 1))] = -1
    return Call((x, tuple(bins)))


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def transpose_calls(draw: Any) -> Call:
    x = draw(array_of_kind())
    return Call((x, tuple(draw(st.permutations(range(x.value.ndim))))))


@st.composite
def concat_calls(draw: Any) -> Call:
    shape, seed, kind = draw(shapes()), draw(seeds), draw(st.sampled_from(["float", "int32"]))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    parts = []
    for i in range(draw(st.integers(1, 3))):
        s = list(shape)
        s[axis] = draw(st.integers(1, 4))
        v = normal(seed + i, tuple(s)) if kind == "float" else np.arange(math.prod(s), dtype=np.int32).reshape(s) + i
        parts.append(In(v, kind))
    return Call((parts,), {"axis": axis})


@st.composite
def slice_calls(draw: Any) -> Call:
    x = draw(array_of_kind())
    ndim = x.value.ndim
    axis = draw(st.integers(-ndim, ndim - 1))
    n = x.value.shape[axis]
    return Call((x, axis, draw(st.integers(-n - 2, n + 2)), draw(st.integers(-n - 2, n + 2))))


@st.composite
def scatter_rows_calls(draw: Any) -> Call:
    """dst ``[rows, ...]``, distinct int32 row indices in any order, and their new rows."""
    rows, seed = draw(st.integers(1, 10)), draw(seeds)
    tail = draw(shapes(0, 2, 5))
    count = draw(st.integers(1, rows))
    at = np.random.default_rng(seed).permutation(rows)[:count].astype(np.int32)
    src_kind = draw(st.sampled_from(["float", "float32"]))  # src is cast to dst's dtype
    return Call((In(normal(seed, (rows,) + tail)), In(at, "int32"), In(normal(seed + 1, (count,) + tail), src_kind)))


@st.composite
def q8_0_write_calls(draw: Any) -> Call:
    """Float rows ``[count, heads, 32 * n]`` for distinct int32 rows of a
    q8_0 pool of ``rows`` (``info``: its shape in values), at scales from
    1e-3 to 1e3 per row, some blocks all zero."""
    rows, heads, width, seed = draw(st.integers(1, 10)), draw(st.integers(1, 3)), 32 * draw(st.integers(1, 3)), draw(seeds)
    count = draw(st.integers(1, rows))
    rng = np.random.default_rng(seed)
    at = rng.permutation(rows)[:count].astype(np.int32)
    src = normal(seed + 1, (count, heads, width)) * (10.0 ** rng.uniform(-3, 3, (count, 1, 1))).astype(np.float32)
    if draw(st.booleans()):
        src[0, 0, :32] = 0.0
    return Call((In(at, "int32"), In(src)), info={"shape": (rows, heads, width)})


# -- attention ------------------------------------------------------------------------------------


@st.composite
def attention_calls(draw: Any, queries: Any = st.integers(1, 6), past: Any = st.integers(0, 8),
                    seqs: Any = st.integers(1, 3), group: Any = st.integers(1, 4), causal: Any = st.booleans(),
                    window: Any = st.none() | st.integers(1, 12), softcap: Any = st.none() | st.floats(5.0, 50.0),
                    sinks: Any = st.just(False), block: Any = st.sampled_from([1, 2, 4, 8, None]),
                    pool_dtype: str = "float", spans: bool = False) -> Call:
    """A forward's attention over a pool: ``seqs`` sequences, each with its
    own number of query rows (the last of its positions) and of cached keys,
    their keys in pool rows that their block tables locate, the tables padded
    to one width with blocks they never read and the pool full of noise
    elsewhere. ``block`` None lays them out as contiguous caches (each one
    block of its capacity). ``queries`` of 0 makes padding sequences.
    ``pool_dtype``: the key and value pools' dtype ("float": the one under
    test; ``"float16"``: a narrower ``kv_dtype``; ``"q8_0"``: float pools
    whose ``run`` hook writes them into q8_0 blocks, heads of 32 or 64).
    ``spans``: each sequence may hold a bidirectional span (Gemma 3's image
    tokens) that ends at or before its last position and covers some of its
    query rows, possibly starting among its cached keys (``info["spans"]``,
    ``[tokens, 2]``)."""
    n, group_, hkv = draw(seqs), draw(group), draw(st.integers(1, 3))
    if pool_dtype == "q8_0":  # whole blocks of 32 per head
        dk = draw(st.sampled_from([32, 64]))
        dv = draw(st.sampled_from([dk, 32]))
    else:
        dk = draw(st.sampled_from([4, 8, 16, 32]))
        dv = draw(st.sampled_from([dk, dk, 8]))
    seed = draw(seeds)
    counts = [draw(queries) for _ in range(n)]
    if not any(counts):
        counts[0] = 1
    lengths = [c + draw(past) for c in counts]
    lengths = [max(1, x) for x in lengths]
    bs = draw(block)
    rng = np.random.default_rng(seed)
    if bs is None:  # contiguous caches: block b is sequence b's buffer
        bs = max(lengths) + draw(st.integers(0, 3))
        tables = rng.permutation(n + draw(st.integers(0, 1)))[:n].reshape(n, 1).astype(np.int32)
    else:
        width = max(-(-x // bs) for x in lengths) + draw(st.integers(0, 1))
        blocks = n * width + draw(st.integers(0, 3))
        tables = rng.permutation(blocks)[:n * width].reshape(n, width).astype(np.int32)
    rows = (int(tables.max()) + 1 + draw(st.integers(0, 1))) * bs
    kwargs: dict[str, Any] = {
        "scale": draw(st.floats(0.5, 1.5)) / math.sqrt(dk), "causal": draw(causal),
        "window": draw(window), "softcap": draw(softcap),
    }
    if draw(sinks):
        kwargs["sinks"] = In(normal(seed + 3, (hkv * group_,)) * 2)
    query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    stored = "float" if pool_dtype == "q8_0" else pool_dtype
    host = {"query_start": query_start, "seq_lens": np.asarray(lengths, np.int32), "block_tables": tables}
    span_rows = None
    if spans:
        span_rows = np.zeros((int(query_start[-1]), 2), np.int32)
        for b, (c, length) in enumerate(zip(counts, lengths)):
            if c == 0 or not draw(st.booleans()):
                continue
            first = length - c  # the first query row's position
            hi = draw(st.integers(first + 1, length))
            lo = draw(st.integers(0, hi - 1))
            for i in range(c):
                if lo <= first + i < hi:
                    span_rows[query_start[b] + i] = (lo, hi)
    return Call((In(normal(seed, (int(query_start[-1]), hkv * group_, dk))),
                 In(normal(seed + 1, (rows, hkv, dk)), stored), In(normal(seed + 2, (rows, hkv, dv)), stored),
                 In(host["query_start"], "int32"), In(host["seq_lens"], "int32"),
                 In(host["block_tables"], "int32")), kwargs,
                info={"block_size": bs, "max_query": max(counts), "host": host, "spans": span_rows})


# -- optional ops ---------------------------------------------------------------------------------


@st.composite
def quantized_weight_calls(draw: Any) -> Call:
    rows, d_in, d_out, seed = draw(st.integers(1, 5)), draw(st.integers(1, 32)), draw(st.integers(4, 32)), draw(seeds)
    return Call((In(normal(seed, (rows, d_in))),), info={"weight": normal(seed + 1, (d_out, d_in))})


#: The format, by registry name, whose ``random_tensor`` makes quantized_linear's weights.
QUANTIZED_FORMAT = "gguf"
#: GGUF types drawn for quantized_linear: every type with an exact group-of-32
#: affine form (what native kernels take), and Q6_K (which has none: dequantized).
GGUF_LINEAR_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K")


@st.composite
def gguf_linear_calls(draw: Any, qtype: str | None = None, rows: tuple[int, int] = (1, 5)) -> Call:
    """x ``[rows, in]`` and, in ``info``, a random GGUF matrix ``[out, in]`` of
    ``qtype`` (``out`` a multiple of 16, ``in`` of 256: every block type fits);
    ``rows`` between the two bounds given."""
    qtype = qtype or draw(st.sampled_from(GGUF_LINEAR_TYPES))
    rows, d_out, d_in, seed = (draw(st.integers(*rows)), 16 * draw(st.integers(1, 3)),
                               256 * draw(st.integers(1, 2)), draw(seeds))
    bias = draw(st.booleans())
    x = In(normal(seed, (rows, d_in)))
    b = In(normal(seed + 2, (d_out,), 0.1), weight=True) if bias else None
    return Call((x, b), info={"qtype": qtype, "shape": (d_out, d_in), "seed": seed % 2**31})


@st.composite
def compile_calls(draw: Any) -> Call:
    """x ``[t, 16]``, a ``[16, 16]`` weight and a norm weight, with t of 1 or 5
    (a decode step and a prefill): few shapes, so compiling backends
    compile few graphs."""
    t, seed = draw(st.sampled_from([1, 5])), draw(seeds)
    return Call((In(normal(seed, (t, 16))), In(normal(seed + 1, (16, 16), 0.25), weight=True),
                 In(normal(seed + 2, (16,), 0.1) + 1.0)))


@st.composite
def swiglu_calls(draw: Any) -> Call:
    shape, seed = draw(shapes()), draw(seeds)
    return Call((In(normal(seed, shape, 3.0)), In(normal(seed + 1, shape))))


@st.composite
def softcap_calls(draw: Any) -> Call:
    return Call((draw(float_array(scale=st.sampled_from([1.0, 30.0, 100.0]))), draw(st.floats(5.0, 50.0))))


@st.composite
def clip_calls(draw: Any) -> Call:
    """Values around the bounds; either bound may be open (gpt-oss clamps its gate from above only)."""
    lo = draw(st.one_of(st.none(), st.floats(-3.0, -0.25)))
    hi = draw(st.one_of(st.none(), st.floats(0.25, 3.0))) if lo is not None else draw(st.floats(0.25, 3.0))
    return Call((draw(float_array(scale=st.sampled_from([1.0, 5.0]))), lo, hi))


# -- recurrent layers' ops -------------------------------------------------------------------


@st.composite
def ragged_batch(draw: Any, max_seqs: int = 4, max_len: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """A ragged batch's ``query_start`` (odd lengths, single rows, an empty
    sequence now and then) and checkpoint rows drawn among its rows."""
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs))
    if sum(lengths) == 0:
        lengths[0] = 1
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(query_start[-1])
    rows = draw(st.lists(st.integers(0, total - 1), max_size=4, unique=True).map(sorted))
    return query_start, np.asarray(rows, np.int32)


@st.composite
def causal_conv1d_calls(draw: Any) -> Call:
    """A convolution of width 1 to 4 over a ragged batch, each sequence with a
    carried window, with or without a bias and the silu."""
    query_start, rows = draw(ragged_batch())
    seed, channels, width = draw(seeds), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    total, seqs = int(query_start[-1]), len(query_start) - 1
    bias = normal(seed + 3, (channels,)) if draw(st.booleans()) else None
    return Call((In(normal(seed, (total, channels))), In(normal(seed + 1, (seqs, width - 1, channels))),
                 In(normal(seed + 2, (channels, width), 0.5)), None if bias is None else In(bias),
                 In(query_start, "int32"), In(rows, "int32")),
                {"activation": draw(st.sampled_from([None, "silu"]))})


@st.composite
def ssd_calls(draw: Any) -> Call:
    """Mamba2's scan over a ragged batch with carried states: 1 to 4 heads in
    1 or 2 groups, with or without the D skip and dt bias, softplus on or off,
    and now and then a clamp on dt."""
    query_start, rows = draw(ragged_batch())
    seed = draw(seeds)
    groups = draw(st.integers(1, 2))
    heads, head_dim, size = groups * draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    total, seqs = int(query_start[-1]), len(query_start) - 1
    skip = In(normal(seed + 6, (heads,))) if draw(st.booleans()) else None
    bias = In(normal(seed + 7, (heads,), 0.5)) if draw(st.booleans()) else None
    softplus = draw(st.booleans())
    dt = normal(seed + 1, (total, heads), 0.5)
    dt_min, dt_max = draw(st.sampled_from([(0.0, float("inf")), (0.1, 0.8)]))
    if not softplus:
        dt = np.abs(dt)  # a step size as the caller would pass it: not negative
    return Call((In(normal(seed, (total, heads, head_dim))), In(dt),
                 In(-np.exp(normal(seed + 2, (heads,), 0.5))), In(normal(seed + 3, (total, groups, size))),
                 In(normal(seed + 4, (total, groups, size))), skip, bias,
                 In(normal(seed + 5, (seqs, heads, head_dim, size))), In(query_start, "int32"), In(rows, "int32")),
                {"dt_softplus": softplus, "dt_min": dt_min, "dt_max": dt_max})


@st.composite
def gated_delta_rule_calls(draw: Any) -> Call:
    """The gated delta rule over a ragged batch, each sequence with a carried
    state, value heads a multiple (1 to 3) of the key heads, with or without
    the q/k L2 norm and an explicit scale."""
    query_start, rows = draw(ragged_batch())
    seed, key_heads, group = draw(seeds), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    dk, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    total, seqs, heads = int(query_start[-1]), len(query_start) - 1, key_heads * group
    l2norm = draw(st.booleans())
    qk_scale = 1.0 if l2norm else 0.5  # unnormalised keys: keep the rule's state bounded
    g = -np.exp(normal(seed + 3, (total, heads), 0.5)) * 0.5  # log-decays <= 0
    beta = 1 / (1 + np.exp(-normal(seed + 4, (total, heads))))
    kwargs: dict[str, Any] = {"l2norm_qk": l2norm}
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.1, 1.0))
    return Call((In(normal(seed, (total, key_heads, dk), qk_scale)), In(normal(seed + 1, (total, key_heads, dk),
                                                                               qk_scale)),
                 In(normal(seed + 2, (total, heads, dv))), In(g.astype(np.float32)), In(beta.astype(np.float32)),
                 In(normal(seed + 5, (seqs, heads, dk, dv), 0.5)), In(query_start, "int32"), In(rows, "int32")),
                kwargs)
