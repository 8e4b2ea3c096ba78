"""The numpy backend, op by op, against independent references.

References: torch's functional ops (computed in float64 from the same float32
inputs, so the reference's own rounding is negligible), transformers' rotary
embedding code, and Meta's complex-number form of interleaved rope. Tolerances
are float32 rounding bounds (eps = 2**-23 ~ 1.2e-7) with the reason next to each.
"""

from __future__ import annotations

import warnings
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from infer.backends.numpy import NumpyBackend
from infer.ops import AttentionBatch
from infer.errors import InferError

EPS32 = float(np.finfo(np.float32).eps)

ops = NumpyBackend()


def t64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def normal(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# -- attention ----------------------------------------------------------------------------


def visible(tq: int, tk: int, causal: bool, window: int | None) -> torch.Tensor:
    """Bottom-right aligned mask written out: query i sits at position tk - tq + i;
    a window is symmetric where the attention is not causal."""
    mask = torch.ones(tq, tk, dtype=torch.bool)
    for i in range(tq):
        p = tk - tq + i
        for j in range(tk):
            if causal and j > p:
                mask[i, j] = False
            if window is not None and abs(p - j) >= window:
                mask[i, j] = False
    return mask


def reference_attention(q, k, v, scale, causal, window, softcap, sinks=None):
    """One sequence's queries over its keys (contiguous, position j in row j)."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    # Grouped-query attention: query head h reads kv head h // group.
    qt = t64(q).transpose(0, 1)  # [hq, tq, dk]
    kt = t64(k).repeat_interleave(group, dim=1).transpose(0, 1)  # [hq, tk, dk]
    vt = t64(v).repeat_interleave(group, dim=1).transpose(0, 1)
    mask = visible(tq, tk, causal, window)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    else:  # SDPA has neither: the same computation written out (Gemma 2's order)
        scores = qt @ kt.transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more logit per head in the softmax, with no value (gpt-oss)
            sink = t64(sinks)[:, None, None].expand(hq, tq, 1)
            out = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :tk] @ vt
        else:
            out = torch.softmax(scores, dim=-1) @ vt
    return out.transpose(0, 1).numpy()  # [tq, hq, dv]


def one_sequence(tq: int, tk: int, capacity: int | None = None) -> AttentionBatch:
    """One sequence's tq queries at the end of its tk keys, in a contiguous cache
    of ``capacity`` rows (one block of that size)."""
    return AttentionBatch(np.array([0, tq], np.int32), np.array([tk], np.int32), np.zeros((1, 1), np.int32),
                          capacity or tk, tq)


def in_pool(rows: np.ndarray, capacity: int, seed: int) -> np.ndarray:
    """``rows`` at the start of a pool of ``capacity`` rows; the rest other values."""
    pool = normal(seed, capacity, *rows.shape[1:], scale=3.0)
    pool[:len(rows)] = rows
    return pool


def ragged_batch(lengths: list[tuple[int, int]], block: int | None, seed: int) -> tuple[AttentionBatch, int]:
    """(query rows, keys) per sequence: their pages scattered over a pool (its
    rows returned too) in blocks of ``block`` rows, or, with None, each
    sequence's keys in a contiguous cache of its own (one block)."""
    size = block or max(tk for _, tk in lengths) + 2
    need = [-(-tk // size) for _, tk in lengths]
    pages = np.random.default_rng(seed).permutation(sum(need) + 2)  # two blocks nobody uses
    tables = np.zeros((len(lengths), max(need)), np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = pages[sum(need[:b]):sum(need[:b]) + n]
    starts = np.cumsum([0] + [tq for tq, _ in lengths]).astype(np.int32)
    batch = AttentionBatch(starts, np.array([tk for _, tk in lengths], np.int32), tables, size,
                           max(tq for tq, _ in lengths))
    return batch, (sum(need) + 2) * size


attention_case = st.fixed_dictionaries({
    # (tq, tk - tq) per sequence: tk - tq keys already in its cache
    "seqs": st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=3),
    "block": st.sampled_from([None, 1, 3, 4, 16]),  # None: contiguous caches
    "hkv": st.integers(1, 3),
    "group": st.integers(1, 4),
    "dk": st.integers(1, 16),
    "dv": st.integers(1, 16),
    "causal": st.booleans(),
    "window": st.none() | st.integers(1, 14),
    "softcap": st.none() | st.floats(0.5, 30.0),
    "sinks": st.booleans(),
    "scale": st.floats(0.05, 2.0),
    "seed": st.integers(0, 2**32 - 1),
})


@settings(max_examples=200, deadline=None)
@given(case=attention_case)
def test_attention_matches_torch_sdpa(case):
    hkv, group, dk, dv = case["hkv"], case["group"], case["dk"], case["dv"]
    lengths = [(tq, tq + past) for tq, past in case["seqs"]]
    rng = case["seed"]
    batch, rows = ragged_batch(lengths, case["block"], rng)
    tokens = int(batch.query_start[-1])
    q, k, v = normal(rng, tokens, hkv * group, dk), normal(rng + 1, rows, hkv, dk), normal(rng + 2, rows, hkv, dv)
    sinks = normal(rng + 3, hkv * group, scale=2.0) if case["sinks"] else None
    kwargs = dict(scale=case["scale"], causal=case["causal"], window=case["window"], softcap=case["softcap"])
    out = ops.attention(q, k, v, batch, sinks=sinks, **kwargs)
    assert out.shape == (tokens, hkv * group, dv) and out.dtype == np.float32
    for b, (tq, tk) in enumerate(lengths):
        keys = batch.key_rows(b, 0, tk)  # the sequence's keys gathered: one contiguous sequence
        ref = reference_attention(q[batch.query_start[b]:batch.query_start[b + 1]], k[keys], v[keys], sinks=sinks,
                                  **kwargs)
        # Scores reach ~|q||k|scale <~ 60; float32 rounding of a score is ~60 eps ~ 7e-6
        # relative in its softmax weight, and the output is a convex mix of v (|v| <~ 5;
        # a sink only takes weight away from it).
        np.testing.assert_allclose(out[batch.query_start[b]:batch.query_start[b + 1]], ref, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("tq, past, window, softcap, sinks", [
    (150, 0, None, None, False),  # a prefill: 64-row chunks and a short last one
    (520, 0, None, None, False),  # ceil(520 / 8) = 65-row chunks
    (150, 90, None, None, False),  # after a cached prefix (2 tq >= tk still)
    (150, 0, 37, None, False),  # sliding window: each chunk also starts late
    (150, 20, 100, 30.0, False),  # window and softcap
    (150, 40, 50, None, True),  # attention sinks in every chunk's softmax
])
def test_chunked_prefill_attention_matches_torch_sdpa(tq, past, window, softcap, sinks):
    """Causal attention over many query rows runs in chunks of rows, each over
    only the keys it can see; same tolerance as the small cases above."""
    assert tq > NumpyBackend.ATTENTION_CHUNK
    tk, hkv, group, d = tq + past, 2, 3, 16
    q, k, v = normal(tq, tq, hkv * group, d), normal(tk, tk, hkv, d), normal(tk + 1, tk, hkv, d)
    kwargs = dict(scale=0.3, causal=True, window=window, softcap=softcap,
                  sinks=normal(tq + 2, hkv * group, scale=2.0) if sinks else None)
    out = ops.attention(q, in_pool(k, tk + 16, 1), in_pool(v, tk + 16, 2), one_sequence(tq, tk, tk + 16), **kwargs)
    np.testing.assert_allclose(out, reference_attention(q, k, v, **kwargs), rtol=1e-4, atol=5e-5)


def test_attention_decode_step_sees_all_past_keys():
    # tq = 1 at the end of tk = 5: causal must not hide the cache (bottom-right).
    q, k, v = normal(0, 1, 2, 4), in_pool(normal(1, 5, 2, 4), 8, 3), in_pool(normal(2, 5, 2, 4), 8, 4)
    batch = one_sequence(1, 5, 8)
    causal = ops.attention(q, k, v, batch, scale=0.5, causal=True)
    full = ops.attention(q, k, v, batch, scale=0.5, causal=False)
    # One query row at the last position: the causal mask hides nothing, so both
    # sum the same terms; only the masking path may round differently (~8 u).
    np.testing.assert_allclose(causal, full, rtol=1e-6, atol=1e-7)
    # A window of 1 sees only the query's own position: the output is that v row.
    np.testing.assert_allclose(ops.attention(q, k, v, batch, scale=0.5, window=1)[0], v[4], rtol=1e-6)  # exp(0)/1


def test_attention_does_not_modify_its_inputs():
    q, k, v = normal(0, 3, 4, 8), normal(1, 5, 2, 8), normal(2, 5, 2, 8)
    sinks = normal(3, 4)
    batch = one_sequence(3, 5)
    before = [a.copy() for a in (q, k, v, sinks, batch.query_start, batch.seq_lens, batch.block_tables)]
    ops.attention(q, k, v, batch, scale=0.3, window=2, softcap=5.0, sinks=sinks)
    for a, b in zip((q, k, v, sinks, batch.query_start, batch.seq_lens, batch.block_tables), before):
        np.testing.assert_array_equal(a, b)


# -- norms --------------------------------------------------------------------------------


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), d=st.integers(1, 64),
       scale=st.sampled_from([1e-3, 1.0, 100.0]), eps=st.sampled_from([1e-6, 1e-5]),
       with_weight=st.booleans())
def test_rms_norm_matches_torch(seed, rows, d, scale, eps, with_weight):
    x = normal(seed, rows, d, scale=scale)
    w = normal(seed + 1, d) if with_weight else None
    ref = F.rms_norm(t64(x), (d,), None if w is None else t64(w), eps).numpy()
    # A mean of squares, an rsqrt and two products, each rounded once in float32.
    np.testing.assert_allclose(ops.rms_norm(x, w, eps), ref, rtol=2e-6, atol=1e-6)


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), d=st.integers(1, 64),
       offset=st.sampled_from([0.0, 3.0, -50.0]), eps=st.sampled_from([1e-6, 1e-5]),
       with_weight=st.booleans(), with_bias=st.booleans())
def test_layer_norm_matches_torch(seed, rows, d, offset, eps, with_weight, with_bias):
    x = normal(seed, rows, d) + np.float32(offset)
    w = normal(seed + 1, d) if with_weight else None
    b = normal(seed + 2, d) if with_bias else None
    ref = F.layer_norm(t64(x), (d,), None if w is None else t64(w), None if b is None else t64(b), eps)
    # x - mean is formed in float32: the mean's and the difference's rounding leave an
    # absolute error of a few |x| eps (|x| <~ 55), divided by the row's spread and
    # scaled by the weight; plus a few eps relative for the final products.
    x64 = x.astype(np.float64)
    spread = np.sqrt(x64.var(axis=-1, keepdims=True) + eps)
    scale = np.abs(w) if w is not None else 1.0
    bound = 8 * EPS32 * np.abs(x64).max(axis=-1, keepdims=True) / spread * scale
    bound = bound + 1e-6 + 1e-5 * np.abs(ref.numpy())
    err = np.abs(ops.layer_norm(x, w, b, eps) - ref.numpy())
    assert np.all(err <= bound), np.max(err - bound)


def test_fused_add_rms_norm_equals_add_then_norm():
    x, r, w = normal(0, 3, 16), normal(1, 3, 16), normal(2, 16)
    normed, h = ops.fused_add_rms_norm(x, r, w, 1e-6)
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(normed, ops.rms_norm(x + r, w, 1e-6))


# -- rope ---------------------------------------------------------------------------------


def rope_tables(seed: int, tokens: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of arbitrary angles (positions times frequencies, as large as real ones)."""
    theta = np.random.default_rng(seed).uniform(-1e4, 1e4, size=(tokens, half))
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


rope_case = st.fixed_dictionaries({
    "tokens": st.integers(1, 6), "heads": st.integers(1, 4), "half": st.integers(1, 8),
    "extra": st.integers(0, 6),  # head_dim - rot: partial rotary passes these through
    "seed": st.integers(0, 2**32 - 1),
})


@settings(deadline=None)
@given(case=rope_case)
def test_rope_half_split_matches_transformers(case):
    tokens, heads, half, extra = case["tokens"], case["heads"], case["half"], case["extra"]
    rot = 2 * half
    x = normal(case["seed"], tokens, heads, rot + extra)
    cos, sin = rope_tables(case["seed"] + 1, tokens, half)
    out = ops.rope(x, cos, sin, interleaved=False)
    # transformers: q [batch, heads, seq, rot], cos/sin [batch, seq, rot] (frequencies
    # repeated for both halves); partial rotary rotates x[..., :rot] and passes the rest.
    xt = t64(x[..., :rot]).permute(1, 0, 2)[None]
    cos_full, sin_full = (torch.cat([t64(c), t64(c)], dim=-1)[None] for c in (cos, sin))
    q_embed, _ = apply_rotary_pos_emb(xt, xt, cos_full, sin_full)
    ref = np.concatenate([q_embed[0].permute(1, 0, 2).numpy(), x[..., rot:]], axis=-1)
    # Each output is a*cos - b*sin: two products and a sum rounded in float32, with
    # |a|, |b| <~ 5: error <~ 3 * 5 * eps ~ 2e-6.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=3e-6)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])  # passed through untouched


@settings(deadline=None)
@given(case=rope_case)
def test_rope_interleaved_matches_the_complex_formula(case):
    tokens, heads, half, extra = case["tokens"], case["heads"], case["half"], case["extra"]
    rot = 2 * half
    x = normal(case["seed"], tokens, heads, rot + extra)
    cos, sin = rope_tables(case["seed"] + 1, tokens, half)
    out = ops.rope(x, cos, sin, interleaved=True)
    # Meta's llama reference: pairs (x[2i], x[2i+1]) as complex numbers times e^{i theta}.
    pairs = torch.view_as_complex(t64(x[..., :rot]).reshape(tokens, heads, half, 2).contiguous())
    freqs = torch.complex(t64(cos), t64(sin))[:, None, :]  # [tokens, 1, half]
    ref = torch.view_as_real(pairs * freqs).reshape(tokens, heads, rot).numpy()
    np.testing.assert_allclose(out[..., :rot], ref, rtol=1e-5, atol=3e-6)  # as above
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])


@given(case=rope_case, interleaved=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_rope_preserves_the_norm_of_each_pair(case, interleaved, scale):
    tokens, heads, half = case["tokens"], case["heads"], case["half"]
    rot = 2 * half
    x = normal(case["seed"], tokens, heads, rot + case["extra"], scale=scale)
    cos, sin = rope_tables(case["seed"] + 1, tokens, half)
    out = ops.rope(x, cos, sin, interleaved=interleaved)

    def pair_norms(a):
        a = a[..., :rot].astype(np.float64)
        first, second = (a[..., 0::2], a[..., 1::2]) if interleaved else (a[..., :half], a[..., half:])
        return np.hypot(first, second)

    # A rotation: |(a cos - b sin, a sin + b cos)| = |(a, b)|, up to float32 rounding
    # of cos/sin (cos^2 + sin^2 = 1 +- 2 eps) and of the products and sums (~3 eps).
    np.testing.assert_allclose(pair_norms(out), pair_norms(x), rtol=8 * EPS32, atol=1e-30)


def test_rope_does_not_modify_its_input():
    x = normal(0, 2, 2, 8)
    before = x.copy()
    cos, sin = rope_tables(1, 2, 3)
    ops.rope(x, cos, sin)
    np.testing.assert_array_equal(x, before)


# -- activations --------------------------------------------------------------------------


activation_inputs = arrays(np.float32, array_shapes(max_dims=2, max_side=16),
                           elements=st.floats(-60.0, 60.0, width=32))


def assert_activation_close(ours: np.ndarray, ref: torch.Tensor, x: np.ndarray) -> None:
    # Rounding of the float32 input to erf/tanh moves the result by ~|x| eps, plus
    # a few eps of the result itself; 1+erf and 1+tanh cancel for negative x, hence
    # the absolute term.
    ref = ref.numpy()
    bound = 1e-6 + 4 * EPS32 * (np.abs(ref) + np.abs(x))
    assert ours.dtype == np.float32 and ours.shape == x.shape
    assert np.all(np.abs(ours - ref) <= bound), np.max(np.abs(ours - ref) - bound)


@given(x=activation_inputs)
def test_gelu_matches_torch(x):
    assert_activation_close(ops.gelu(x), F.gelu(t64(x), approximate="none"), x)


@given(x=activation_inputs)
def test_gelu_tanh_matches_torch(x):
    assert_activation_close(ops.gelu_tanh(x), F.gelu(t64(x), approximate="tanh"), x)


@given(x=activation_inputs)
def test_silu_and_swiglu_match_torch(x):
    assert_activation_close(ops.silu(x), F.silu(t64(x)), x)
    up = np.flip(x).copy()
    ref = F.silu(t64(x)) * t64(up)
    ours = ops.swiglu(x, up)
    assert np.all(np.abs(ours - ref.numpy()) <= 1e-6 + 8 * EPS32 * np.abs(x * up) + 8 * EPS32 * abs(ref.numpy()))


def test_activations_survive_extreme_inputs():
    x = np.array([-3e38, -1e20, -100.0, 0.0, 100.0, 1e20, 3e38], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning leaks out to the user either
        for name in ("silu", "gelu", "gelu_tanh"):
            out = getattr(ops, name)(x)
            assert np.all(np.isfinite(out)), (name, out)
            np.testing.assert_allclose(out[[0, 1, 3]], 0.0, atol=0.0)
            np.testing.assert_array_equal(out[[5, 6]], x[[5, 6]])


# -- softmax, reductions --------------------------------------------------------------------


softmax_inputs = arrays(
    np.float32, array_shapes(min_dims=1, max_dims=3, max_side=32),
    elements=st.one_of(st.floats(-10.0, 10.0, width=32),
                       st.floats(width=32, allow_nan=False, allow_infinity=False)),
)


@given(x=softmax_inputs)
def test_softmax_rows_sum_to_one(x):
    p = ops.softmax(x, axis=-1)
    assert p.shape == x.shape and p.dtype == np.float32
    assert np.all((p >= 0) & (p <= 1))
    # A float32 sum of n <= 32 terms in [0, 1]: error <= n eps ~ 4e-6.
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, atol=x.shape[-1] * EPS32 + EPS32)
    # The largest logit gets the largest probability.
    top = np.argmax(x, axis=-1)[..., None]
    np.testing.assert_array_equal(np.take_along_axis(p, top, -1)[..., 0], p.max(axis=-1))


@given(x=softmax_inputs)
def test_softmax_matches_torch(x):
    # Absolute: exp(x - max) of float32 inputs; x - max can be ~1e38, exp of it 0.
    ref = torch.softmax(t64(x), dim=-1).numpy()
    np.testing.assert_allclose(ops.softmax(x, axis=-1), ref, rtol=1e-5, atol=1e-6)


@given(x=softmax_inputs)
def test_softmax_over_another_axis(x):
    p = ops.softmax(x, axis=0)
    np.testing.assert_allclose(p.sum(axis=0), 1.0, atol=x.shape[0] * EPS32 + EPS32)


# -- linear, gather, in-place update ---------------------------------------------------------


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), din=st.integers(1, 32),
       dout=st.integers(1, 32), bias=st.booleans())
def test_linear_matches_torch(seed, n, din, dout, bias):
    x, w = normal(seed, n, din), normal(seed + 1, dout, din)
    b = normal(seed + 2, dout) if bias else None
    ref = F.linear(t64(x), t64(w), None if b is None else t64(b)).numpy()
    # A dot product of din terms ~ N(0, 1): error ~ din eps sqrt(din) <~ 2e-5.
    np.testing.assert_allclose(ops.linear(x, w, b), ref, rtol=1e-5, atol=2e-5)


def test_scatter_rows_writes_in_place_and_returns_the_array():
    cache = np.zeros((6, 2, 3), dtype=np.float32)
    rows = np.arange(12, dtype=np.float64).reshape(2, 2, 3)  # cast to the cache's dtype
    out = ops.scatter_rows(cache, np.array([4, 1], np.int32), rows)
    assert out is cache and out.dtype == np.float32
    np.testing.assert_array_equal(cache[[4, 1]], rows)
    assert not cache[[0, 2, 3, 5]].any()
    out = ops.scatter_rows(out, np.array([5], np.int32), rows[:1] + 100)
    np.testing.assert_array_equal(cache[5], rows[0] + 100)
    before = cache.copy()
    for bad in ([6], [0, -1]):  # never written somewhere else (a negative row would wrap)
        with pytest.raises(IndexError, match="outside the 6 rows"):
            ops.scatter_rows(cache, np.array(bad, np.int32), rows[:len(bad)])
        np.testing.assert_array_equal(cache, before)


def test_embedding_gathers_rows():
    table = normal(0, 10, 4)
    ids = np.array([3, 0, 9, 3], dtype=np.int32)
    np.testing.assert_array_equal(ops.embedding(table, ids), table[[3, 0, 9, 3]])


@pytest.mark.parametrize("ids", [[10], [0, 11], [-1], [3, -10], [2**31 - 1]])
def test_embedding_out_of_range_ids_raise_never_wrap(ids):
    table = normal(0, 10, 4)
    with pytest.raises((IndexError, InferError), match="out of range"):
        ops.embedding(table, np.array(ids, dtype=np.int64))


def test_dtype_names_and_from_numpy_copies():
    src = np.ones((2, 3), dtype=np.float64)
    arr = ops.from_numpy(src)
    assert ops.dtype(arr) == "float32"
    src[0, 0] = 5.0
    assert arr[0, 0] == 1.0  # the backend's copy does not follow the caller's array
    assert ops.dtype(ops.arange(0, 4)) == "int32"
    assert ops.shape(arr) == (2, 3) and all(type(d) is int for d in ops.shape(arr))

