"""The op library: what every backend may import beside the contract.

:mod:`infer.ops` declares the contract (the ops' signatures, their docstrings
and a one-line default for each optional op); this module holds the code those
defaults call and the helpers backends share:

* **batch helpers**, for a backend that reads an
  :class:`~infer.ops.AttentionBatch` or a ragged batch on the host:
  :func:`row_run`, :func:`attention_mask`, :func:`span_rows`, :func:`visible_keys`,
  :func:`key_rows`, :func:`rows_within`, :func:`ragged_rows`;
* **the recurrent ops' argument checks**, one per op, which every backend's
  version runs so that each names a bad shape or batch the same way:
  :func:`check_causal_conv1d`, :func:`check_ssd`,
  :func:`check_gated_delta_rule`;
* **the recurrent references** in plain numpy, which the conformance kit and
  the tests compare native versions against: :func:`conv1d_reference`,
  :func:`ssd_reference`, :func:`gated_delta_rule_reference`;
* **the optional ops' defaults**, built from required ops: each is named after
  its op and takes the backend first (``oplib.attention(ops, q, ...)``). A
  backend that overrides an op may still call the default for the cases it
  does not handle.

The functions that take the backend type it as :data:`Ops` (``Any``): this
module cannot import :mod:`infer.ops`, whose defaults call it, without an
import cycle (tests/test_layering.py forbids one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

Ops = Any
"""An :class:`infer.ops.Backend` (see the module docstring for why ``Any``)."""

Array = Any
"""A backend-native array, as :data:`infer.ops.Array`."""

Batch = Any
"""An :class:`infer.ops.AttentionBatch`."""


# -- batch helpers ---------------------------------------------------------------------------------


def row_run(rows: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` where pool ``rows`` are one run of consecutive rows
    (a contiguous cache's always are), so a backend can read them as a slice
    of the pool instead of gathering them; None otherwise."""
    if rows.size and bool(np.all(np.diff(rows) == 1)):
        return int(rows[0]), int(rows[-1]) + 1
    return None


def attention_mask(first: int, queries: int, lo: int, hi: int, causal: bool,
                   window: int | None, spans: np.ndarray | None = None) -> np.ndarray | None:
    """Additive float32 mask ``[queries, hi - lo]`` (0 or -inf) of queries at
    positions ``first..first + queries`` over keys ``lo..hi``, as
    :meth:`~infer.ops.Backend.attention` defines visibility (``spans``: the
    queries' rows of :attr:`~infer.ops.AttentionBatch.spans`); None where every
    key is seen."""
    p = np.arange(first, first + queries)[:, None]
    j = np.arange(lo, hi)[None, :]
    seen = np.ones((queries, hi - lo), bool)
    if causal:
        both = False if spans is None else (j >= spans[:, :1]) & (j < spans[:, 1:])
        seen &= (j <= p) | both
    if window is not None:  # causal: the window bounds the keys behind (a span's keys ahead stay seen)
        seen &= (p - j < window) if causal else (np.abs(p - j) < window)
    if seen.all():
        return None
    return np.where(seen, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def span_rows(host: Batch, q0: int, q1: int, causal: bool) -> np.ndarray | None:
    """Rows ``q0..q1`` of a host batch's bidirectional spans
    (:attr:`~infer.ops.AttentionBatch.spans`, ``[n, 2]``), or None where they
    change nothing (no spans, none among these rows, or a non-causal call)."""
    spans = getattr(host, "spans", None)
    if spans is None or not causal:
        return None
    rows = np.asarray(spans[q0:q1])
    return rows if (rows[:, 1] > rows[:, 0]).any() else None


def visible_keys(b: int, length: int, queries: int, causal: bool, window: int | None) -> tuple[int, int]:
    """``(lo, hi)``: the key positions any of sequence ``b``'s ``queries``
    last positions (of its ``length``) sees, ``ValueError`` where it has fewer
    positions than query rows (:meth:`~infer.ops.AttentionBatch.visible`)."""
    if length < queries or queries < 1:
        raise ValueError(f"attention: sequence {b} has {length} positions for its {queries} query rows")
    if window is None:
        return 0, length
    lo = max(0, length - queries - window + 1)
    return lo, length if causal else min(length, length + window - 1)


def key_rows(table: np.ndarray, block_size: int, b: int, lo: int, hi: int,
             pool_rows: int | None = None) -> np.ndarray:
    """int32 pool rows of key positions ``lo..hi`` of sequence ``b``, whose
    block table is ``table`` (:meth:`~infer.ops.AttentionBatch.key_rows`);
    ``IndexError`` when the table lists too few blocks, or (given the pool's
    ``pool_rows``) a block outside the pool."""
    bs = block_size
    if hi > 0 and (hi - 1) // bs >= table.shape[0]:
        raise IndexError(f"attention: {hi} keys need {-(-hi // bs)} blocks; sequence {b}'s table has "
                         f"{table.shape[0]}")
    j = np.arange(lo, hi)
    rows = table[j // bs].astype(np.int64) * bs + j % bs
    if pool_rows is not None and rows.size and (rows.min() < 0 or rows.max() >= pool_rows):
        bad = int(table[j[np.argmax((rows < 0) | (rows >= pool_rows))] // bs])
        raise IndexError(f"attention: block table entry {bad} of sequence {b} is outside the pool of "
                         f"{pool_rows // bs} blocks")
    return rows.astype(np.int32)


def rows_within(rows: Any, limit: int) -> np.ndarray:
    """``rows`` (host row indices, any shape) flattened, ``IndexError`` where
    one is outside ``0..limit``: :meth:`~infer.ops.Backend.scatter_rows`' check."""
    host = np.asarray(rows).reshape(-1)
    if host.size and (host.min() < 0 or host.max() >= limit):
        bad = host.min() if host.min() < 0 else host.max()
        raise IndexError(f"scatter_rows: row {int(bad)} is outside the {limit} rows of dst")
    return host


def ragged_rows(query_start: Any, rows: Any, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Check a ragged batch's ``query_start`` (host, ``[B + 1]``, rising from 0
    to ``total``) and ``rows`` (host row indices or None) and return both as
    int64 arrays, ``ValueError`` naming what is wrong: the recurrent ops' check."""
    qs = np.asarray(query_start, np.int64).reshape(-1)
    if qs.size < 1 or qs[0] != 0 or qs[-1] != total or np.any(np.diff(qs) < 0):
        raise ValueError(f"query_start {qs.tolist()} must rise from 0 to the {total} rows")
    r = np.zeros(0, np.int64) if rows is None else np.asarray(rows, np.int64).reshape(-1)
    if r.size and (r.min() < 0 or r.max() >= total):
        raise ValueError(f"checkpoint row {int(r.min() if r.min() < 0 else r.max())} is outside the {total} rows")
    return qs, r


# -- the recurrent ops' argument checks --------------------------------------------------------------
#
# Each takes the op's arrays in any framework (only their shapes are read) and its batch on the host
# (numpy ``query_start`` and ``checkpoint_rows``), raises ValueError naming what does not fit, and
# returns the batch as :func:`ragged_rows` does.


def _dims(a: Any) -> tuple[int, ...] | None:
    return None if a is None else tuple(int(d) for d in a.shape)


def check_causal_conv1d(x: Any, window: Any, weight: Any, query_start: Any, checkpoint_rows: Any,
                        activation: str | None) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.causal_conv1d`'s arguments: x ``[T, C]``,
    window ``[B, K - 1, C]``, weight ``[C, K]``, activation None or ``"silu"``."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not None or 'silu'")
    xs, ws, wins = _dims(x), _dims(weight), _dims(window)
    total, channels = xs
    k = ws[-1]
    if ws != (channels, k) or wins[1:] != (k - 1, channels):
        raise ValueError(f"causal_conv1d: weight {ws} and window {wins} do not fit x {xs} "
                         "(want [C, K] and [B, K - 1, C])")
    qs, rows = ragged_rows(query_start, checkpoint_rows, total)
    if len(qs) - 1 != wins[0]:
        raise ValueError(f"causal_conv1d: {len(qs) - 1} sequences in query_start, {wins[0]} windows")
    return qs, rows


def check_ssd(x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any, state: Any, query_start: Any,
              checkpoint_rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.ssd`'s arguments: x ``[T, H, P]``, dt
    ``[T, H]``, A, D and dt_bias ``[H]`` (D and dt_bias may be None), B and
    C ``[T, G, N]`` with ``H % G == 0``, state ``[B, H, P, N]``."""
    xs, ss = _dims(x), _dims(state)
    total, heads, head_dim = xs
    bs = _dims(B)
    groups, size = bs[1], bs[2]
    if (_dims(dt) != (total, heads) or _dims(A) != (heads,) or bs != (total, groups, size)
            or _dims(C) != bs or groups == 0 or heads % groups or ss[1:] != (heads, head_dim, size)
            or (D is not None and _dims(D) != (heads,)) or (dt_bias is not None and _dims(dt_bias) != (heads,))):
        raise ValueError(f"ssd: shapes do not fit x {xs} (want dt [T, H], A, D, dt_bias [H], B and C "
                         f"[T, G, N] with H % G == 0, state [B, H, P, N]): dt {_dims(dt)}, A {_dims(A)}, "
                         f"B {bs}, C {_dims(C)}, D {_dims(D)}, dt_bias {_dims(dt_bias)}, state {ss}")
    qs, rows = ragged_rows(query_start, checkpoint_rows, total)
    if len(qs) - 1 != ss[0]:
        raise ValueError(f"ssd: {len(qs) - 1} sequences in query_start, {ss[0]} states")
    return qs, rows


def check_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, query_start: Any,
                           checkpoint_rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.gated_delta_rule`'s arguments: q and k
    ``[T, Hk, K]``, v ``[T, H, V]`` with ``H`` a multiple of ``Hk``, g and
    beta ``[T, H]``, state ``[B, H, K, V]``."""
    qd, kd, vd = _dims(q), _dims(k), _dims(v)
    total, key_heads, dk = qd
    heads, dv = vd[1:]
    if kd != qd or vd[0] != total or key_heads == 0 or heads % key_heads:
        raise ValueError(f"gated_delta_rule: q {qd}, k {kd} and v {vd} do not fit "
                         "(want [T, Hk, K], [T, Hk, K], [T, H, V] with H a multiple of Hk)")
    if _dims(g) != (total, heads) or _dims(beta) != (total, heads):
        raise ValueError(f"gated_delta_rule: g {_dims(g)} and beta {_dims(beta)} must be [T, H] = "
                         f"{(total, heads)}")
    qs, rows = ragged_rows(query_start, checkpoint_rows, total)
    if _dims(state) != (len(qs) - 1, heads, dk, dv):
        raise ValueError(f"gated_delta_rule: state {_dims(state)} must be [B, H, K, V] = "
                         f"{(len(qs) - 1, heads, dk, dv)}")
    return qs, rows


# -- the recurrent references ------------------------------------------------------------------------


def conv1d_reference(x: np.ndarray, window: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                     query_start: Any, checkpoint_rows: Any = None,
                     activation: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.causal_conv1d` in numpy, as plainly as it
    reads: each sequence's inputs after its carried window, and every output
    row the weighted sum of the ``K`` rows ending at it."""
    qs, rows = check_causal_conv1d(x, window, weight, query_start, checkpoint_rows, activation)
    total, channels = x.shape
    k = weight.shape[-1]
    y = np.empty((total, channels), np.float32)
    last = np.empty_like(window, dtype=np.float32)
    ckpt = np.empty((len(rows), k - 1, channels), np.float32)
    for b in range(len(qs) - 1):
        start, stop = int(qs[b]), int(qs[b + 1])
        padded = np.concatenate([window[b], x[start:stop]]).astype(np.float32)  # [K - 1 + L, C]
        for t in range(stop - start):
            y[start + t] = np.sum(padded[t:t + k] * weight.T, axis=0)
        last[b] = padded[len(padded) - (k - 1):]
        for i in np.flatnonzero((rows >= start) & (rows < stop)):
            t = int(rows[i]) - start
            ckpt[i] = padded[t + 1:t + k]
    if bias is not None:
        y += bias
    if activation == "silu":
        y = y / (1.0 + np.exp(-y))
    return y, last, ckpt


def ssd_reference(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                  D: np.ndarray | None, dt_bias: np.ndarray | None, state: np.ndarray, query_start: Any,
                  checkpoint_rows: Any = None, *, dt_softplus: bool = True, dt_min: float = 0.0,
                  dt_max: float = float("inf")) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.ssd` in numpy, as the recurrence reads (in
    float64, returned as float32): one state update and one read-out per row."""
    qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows)
    total, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    f64 = np.float64
    step = dt.astype(f64) + (0.0 if dt_bias is None else dt_bias.astype(f64))
    if dt_softplus:  # PyTorch's softplus: linear above the threshold 20
        step = np.where(step > 20.0, step, np.log1p(np.exp(np.minimum(step, 20.0))))
    step = np.clip(step, dt_min, dt_max)  # [T, H]
    per_group = heads // groups
    Bh = np.repeat(B.astype(f64), per_group, axis=1)  # [T, H, N]
    Ch = np.repeat(C.astype(f64), per_group, axis=1)
    xs, decay = x.astype(f64), np.exp(step * A.astype(f64))  # [T, H, P], [T, H]
    y = np.empty((total, heads, head_dim), f64)
    last = np.empty(state.shape, np.float32)
    ckpt = np.empty((len(rows), heads, head_dim, size), np.float32)
    for b in range(len(qs) - 1):
        s = state[b].astype(f64)  # [H, P, N]
        for t in range(int(qs[b]), int(qs[b + 1])):
            s = decay[t][:, None, None] * s + (step[t][:, None] * xs[t])[:, :, None] * Bh[t][:, None, :]
            y[t] = np.einsum("hpn,hn->hp", s, Ch[t])
            ckpt[rows == t] = s
        last[b] = s
    if D is not None:
        y += D.astype(f64)[:, None] * xs
    return y.astype(np.float32), last, ckpt


def gated_delta_rule_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                               state: np.ndarray, query_start: Any, checkpoint_rows: Any = None, *,
                               scale: float | None = None,
                               l2norm_qk: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.gated_delta_rule` in numpy, one row at a
    time, as transformers' ``torch_recurrent_gated_delta_rule`` computes it
    (float32)."""
    qs, rows = check_gated_delta_rule(q, k, v, g, beta, state, query_start, checkpoint_rows)
    total, key_heads, dk = q.shape
    heads, dv = v.shape[1:]
    q, k = (np.repeat(x.astype(np.float32), heads // key_heads, axis=1) for x in (q, k))  # [T, H, K]
    if l2norm_qk:
        q, k = (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6)) for x in (q, k))
    q = q * np.float32(dk ** -0.5 if scale is None else scale)
    decay = np.exp(g.astype(np.float32))
    o = np.empty((total, heads, dv), np.float32)
    last = np.empty(state.shape, np.float32)
    ckpt = np.empty((len(rows), heads, dk, dv), np.float32)
    for b in range(len(qs) - 1):
        s = state[b].astype(np.float32)  # [H, K, V]
        for t in range(int(qs[b]), int(qs[b + 1])):
            s = s * decay[t, :, None, None]
            memory = np.einsum("hkv,hk->hv", s, k[t])  # what the state recalls for key k_t
            delta = (v[t] - memory) * beta[t, :, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", s, q[t])
            ckpt[rows == t] = s
        last[b] = s
    return o, last, ckpt


# -- the optional ops' defaults (each takes the backend first) -------------------------------------


def clip(ops: Ops, x: Array, lo: float | None, hi: float | None) -> Array:
    """:meth:`~infer.ops.Backend.clip`'s default: each bound as the larger of
    ``x`` and a constant array, from ``concat`` and ``max`` over a new last
    axis (exact: it only selects values)."""
    shape, dtype = ops.shape(x), ops.dtype(x)

    def at_least(a: Array, bound: float) -> Array:
        limit = ops.add(ops.zeros(shape, dtype), bound)
        pair = ops.concat([ops.reshape(a, (*shape, 1)), ops.reshape(limit, (*shape, 1))], -1)
        return ops.max(pair, axis=-1)

    if lo is not None:
        x = at_least(x, lo)
    if hi is not None:  # min(x, hi) = -max(-x, -hi)
        x = ops.mul(at_least(ops.mul(x, -1.0), -hi), -1.0)
    return x


def quantized_linear(ops: Ops, x: Array, weight: Any, bias: Array | None = None) -> Array:
    """:meth:`~infer.ops.Backend.quantized_linear`'s default: ``weight.rows``
    dequantized on the host, then ``linear``."""
    from infer.errors import UnsupportedOpError

    if weight.rows is None:
        raise UnsupportedOpError(f"backend {ops.name}/{ops.device}: {weight!r} has no host form to dequantize")
    return ops.linear(x, ops.from_numpy(weight.rows.dequantize()), bias)


def packed_rows(ops: Ops, table: Any, ids: Array) -> Array:
    """:meth:`~infer.ops.Backend.packed_rows`: the rows of a
    :class:`~infer.ops.PackedWeight` at ``ids``, dequantized on the host from
    ``table.rows`` (only those rows), then copied to the backend."""
    from infer.errors import UnsupportedOpError

    if table.rows is None:
        raise UnsupportedOpError(f"backend {ops.name}/{ops.device}: {table!r} has no rows for embedding")
    host = np.asarray(ops.to_numpy(ids)).reshape(-1)
    vocab = table.shape[0]
    if host.size and (host.min() < 0 or host.max() >= vocab):
        raise IndexError(f"token id out of range [0, {vocab}): found {host.min() if host.min() < 0 else host.max()}")
    return ops.from_numpy(table.rows.dequantize_rows(host.astype(np.int64)))


def _q8_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each 32 values of ``x`` (float32, last axis a multiple of 32) as int8
    codes ``rint(x * (127 / max|x|))`` and their float32 scale ``max|x| /
    127``: ggml's q8_0 rounding, in float32 as the kernels compute it."""
    blocks = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    safe = np.where(amax > 0, amax, np.float32(1))
    inverse = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(blocks * inverse[:, None]), -127, 127).astype(np.int8)
    return codes, (amax / np.float32(127)).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Float rows ``[..., d]`` (``d`` a multiple of 32) as q8_0 blocks
    ``uint8 [..., d // 32 * 34]``: per 32 values the float16 scale, then the
    32 codes (:data:`infer.ops.KV_BLOCK_DTYPES`): what
    :meth:`~infer.ops.Backend.scatter_rows` writes into a ``kv_dtype="q8_0"`` pool."""
    x = np.asarray(x, np.float32)
    codes, scale = _q8_codes(x)
    out = np.empty((codes.shape[0], 34), np.uint8)
    out[:, :2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes.view(np.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """q8_0 blocks ``uint8 [..., n * 34]`` as the float32 values ``[..., n *
    32]`` they hold: each code times its block's float16 scale, one float32 product."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    flat = blocks.reshape(-1, 34)
    scale = flat[:, :2].copy().view("<f2").astype(np.float32)
    values = flat[:, 2:].view(np.int8).astype(np.float32) * scale
    return values.reshape(*blocks.shape[:-1], blocks.shape[-1] // 34 * 32)


def q8_0_query(q: np.ndarray) -> np.ndarray:
    """Query rows ``[..., dk]`` as attention over a q8_0 pool reads them: each
    32 values rounded to int8 codes with a float32 scale (not float16:
    queries are never stored), given back as the float32 values ``scale * code``."""
    q = np.asarray(q, np.float32)
    codes, scale = _q8_codes(q)
    return (codes.astype(np.float32) * scale[:, None]).reshape(q.shape)


def attention(ops: Ops, q: Array, k_pool: Array, v_pool: Array, batch: Batch, *, scale: float, causal: bool,
              window: int | None, softcap: float | None, sinks: Array | None) -> Array:
    """:meth:`~infer.ops.Backend.attention`'s default, and the contract's
    plainly readable reference: built from required ops, one sequence at a
    time (:func:`attend_one`), reading the batch description back to the
    host (:meth:`~infer.ops.AttentionBatch.on_host`)."""
    host = batch.on_host(ops)
    outputs = [attend_one(ops, ops.slice(q, 0, q0, q1), k_pool, v_pool, host, b, lo, hi, scale=scale,
                          causal=causal, window=window, softcap=softcap, sinks=sinks)
               for b, q0, q1, lo, hi in host.sequences(causal, window)]
    return outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)


def attend_one(ops: Ops, q: Array, k_pool: Array, v_pool: Array, host: Batch, b: int, lo: int, hi: int, *,
               scale: float, causal: bool, window: int | None, softcap: float | None,
               sinks: Array | None) -> Array:
    """:func:`attention` for sequence ``b`` of a host batch: its visible keys
    gathered from the pool, two batched products around a masked float32
    softmax, grouped-query heads without repeating keys. Over a pool of q8_0
    blocks (``uint8``) this is the contract's definition of the op: the keys
    and values dequantized (:func:`dequantize_q8_0`), the queries quantized
    and given back as their rounded values (:func:`q8_0_query`), which a
    backend's integer dot products per block equal up to float rounding."""
    n, hq, dk = ops.shape(q)
    hkv, dv = ops.shape(k_pool)[1], ops.shape(v_pool)[2]
    group = hq // hkv
    length = int(host.seq_lens[b])
    rows = ops.from_numpy(host.key_rows(b, lo, hi, ops.shape(k_pool)[0]))
    k = ops.take(k_pool, rows, axis=0)  # [tk, hkv, dk]
    v = ops.take(v_pool, rows, axis=0)
    if ops.dtype(k) == "uint8":  # q8_0 blocks (kv_dtype="q8_0"): their values, against the quantized queries
        k, v = (ops.from_numpy(dequantize_q8_0(ops.to_numpy(x)), ops.dtype(q)) for x in (k, v))
        q = ops.from_numpy(q8_0_query(ops.to_numpy(ops.astype(q, "float32"))), ops.dtype(q))
        dv = ops.shape(v)[2]
    elif ops.dtype(k) != ops.dtype(q):  # a pool stored narrower (kv_dtype): its values, widened
        k, v = ops.astype(k, ops.dtype(q)), ops.astype(v, ops.dtype(q))
    qg = ops.reshape(ops.transpose(ops.reshape(q, (n, hkv, group, dk)), (1, 2, 0, 3)), (hkv, group * n, dk))
    scores = ops.astype(ops.matmul(qg, ops.transpose(k, (1, 2, 0))), "float32")  # [hkv, group * n, tk]
    scores = ops.mul(scores, float(scale))
    if softcap is not None:
        scores = ops.softcap(scores, softcap)
    scores = ops.reshape(scores, (hkv, group, n, hi - lo))
    q0 = int(host.query_start[b])
    mask = attention_mask(length - n, n, lo, hi, causal, window, span_rows(host, q0, q0 + n, causal))
    if mask is not None:
        scores = ops.add(scores, ops.from_numpy(mask, "float32"))
    if sinks is not None:
        sink = ops.add(ops.zeros((hkv, group, n, 1), "float32"),
                       ops.reshape(ops.astype(sinks, "float32"), (hkv, group, 1, 1)))
        probs = ops.slice(ops.softmax(ops.concat([scores, sink], -1), -1), -1, 0, hi - lo)
    else:
        probs = ops.softmax(scores, -1)
    probs = ops.astype(ops.reshape(probs, (hkv, group * n, hi - lo)), ops.dtype(v))
    out = ops.matmul(probs, ops.transpose(v, (1, 0, 2)))  # [hkv, group * n, dv]
    return ops.reshape(ops.transpose(ops.reshape(out, (hkv, group, n, dv)), (2, 0, 1, 3)), (n, hq, dv))


def join_group(ops: Ops, world_size: int) -> None:
    """:meth:`~infer.ops.Backend.join_group`'s default: only a group of one
    (no collectives needed) is possible."""
    from infer.errors import UnsupportedOpError

    if world_size != 1:
        raise UnsupportedOpError(
            f"backend {ops.name}/{ops.device} has no collectives (all_reduce), so it cannot join a "
            f"process group of {world_size} ranks; use a backend that has them (torch:cpu, torch:cuda)")


def sharded_linear(ops: Ops, x: Array, weight: Any, bias: Array | None = None) -> Array:
    """:meth:`~infer.ops.Backend.sharded_linear`: the local product, then
    ``all_reduce`` (``"sum"``, the bias added after it, once) or
    ``all_gather`` cut to the whole output (``"concat"``)."""
    y = ops.linear(x, weight.local)
    if weight.combine == "sum":
        y = ops.all_reduce(y)
    else:
        y = ops.all_gather(y, axis=-1)
        if ops.shape(y)[-1] != weight.shape[0]:
            y = ops.slice(y, -1, 0, weight.shape[0])
    return y if bias is None else ops.add(y, bias)


def lora_segments(slots: np.ndarray, scales: np.ndarray) -> list[tuple[slice | np.ndarray, int]]:
    """The rows of a forward that use each adapter slot (scale not 0), as
    ``(rows, slot)``: a slice where they are contiguous (a sequence's rows:
    Punica's segments), else their indices. What the native
    :meth:`~infer.ops.Backend.lora_linear` bodies loop over."""
    slots, active = np.asarray(slots).reshape(-1), np.asarray(scales).reshape(-1) != 0
    out: list[tuple[slice | np.ndarray, int]] = []
    for slot in np.unique(slots[active]):
        idx = np.flatnonzero(active & (slots == slot))
        out.append((slice(int(idx[0]), int(idx[-1]) + 1) if idx[-1] - idx[0] + 1 == len(idx) else idx, int(slot)))
    return out


def lora_linear(ops: Ops, x: Array, weight: Any, bias: Array | None, a: Array, b: Array, slots: Array,
                scales: Array) -> Array:
    """:meth:`~infer.ops.Backend.lora_linear`'s default: every row's factors
    gathered (``take``), then two batched products, Punica's BGMV form."""
    t, d_in = ops.shape(x)
    d_out = ops.shape(b)[1]
    y = ops.linear(x, weight, bias)
    u = ops.matmul(ops.take(a, slots, axis=0), ops.reshape(x, (t, d_in, 1)))  # [t, rank, 1]
    d = ops.reshape(ops.matmul(ops.take(b, slots, axis=0), u), (t, d_out))  # [t, out]
    return ops.add(y, ops.mul(d, ops.reshape(ops.astype(scales, ops.dtype(d)), (t, 1))))


def expert_linear(ops: Ops, x: Array, weights: Sequence[Array], ids: Array) -> Array:
    """:meth:`~infer.ops.Backend.expert_linear`'s default: the ids on the
    host, one :meth:`linear` per expert over its rows (in order), experts in
    increasing order, the products taken back into row order."""
    chosen = ops.to_numpy(ids).reshape(-1).astype(np.int64)
    bad = chosen[(chosen < 0) | (chosen >= len(weights))]
    if bad.size:
        raise IndexError(f"expert_linear: expert id {int(bad[0])} outside [0, {len(weights)})")
    order = np.argsort(chosen, kind="stable")  # each expert's rows, in row order
    experts, starts = np.unique(chosen[order], return_index=True)
    bounds = [*starts.tolist(), len(order)]
    outputs = []
    for j, e in enumerate(experts.tolist()):
        rows = order[bounds[j]:bounds[j + 1]]
        outputs.append(ops.linear(ops.take(x, ops.from_numpy(rows.astype(np.int32)), axis=0), weights[e]))
    y = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)
    if len(outputs) == 1 and np.array_equal(order, np.arange(len(order))):
        return y
    where = np.empty(len(order), np.int32)
    where[order] = np.arange(len(order), dtype=np.int32)  # row i's product is row where[i] of y
    return ops.take(y, ops.from_numpy(where), axis=0)


def topk(ops: Ops, x: Array, k: int) -> tuple[Array, Array]:
    """:meth:`~infer.ops.Backend.topk`'s default: sorted on the host
    (``to_numpy``, a stable sort, ``from_numpy``), one round trip per call."""
    host = ops.to_numpy(x)
    order = np.argsort(-host, axis=-1, kind="stable")[..., :k]
    values = np.take_along_axis(host, order, axis=-1)
    return ops.from_numpy(values, ops.dtype(x)), ops.from_numpy(order.astype(np.int32))


def softplus(ops: Ops, x: Array) -> Array:
    """:meth:`~infer.ops.Backend.softplus`'s default: on the host in float32
    (``numpy.logaddexp(0, x)``), in ``x``'s dtype."""
    host = ops.to_numpy(ops.astype(x, "float32"))
    return ops.from_numpy(np.logaddexp(np.float32(0), host).astype(np.float32), ops.dtype(x))


def _host32(ops: Ops, arrays: Iterable[Array | None]) -> list[np.ndarray | None]:
    """Each array on the host in float32 (None stays None)."""
    return [None if a is None else ops.to_numpy(ops.astype(a, "float32")) for a in arrays]


def _host_rows(ops: Ops, query_start: Array, checkpoint_rows: Array | None) -> tuple[np.ndarray, Any]:
    return ops.to_numpy(query_start), None if checkpoint_rows is None else ops.to_numpy(checkpoint_rows)


def causal_conv1d(ops: Ops, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                  checkpoint_rows: Array | None = None, *,
                  activation: str | None = None) -> tuple[Array, Array, Array]:
    """:meth:`~infer.ops.Backend.causal_conv1d`'s default: on the host in
    float32, :func:`conv1d_reference`, in ``x``'s dtype."""
    dtype = ops.dtype(x)
    y, last, ckpt = conv1d_reference(*_host32(ops, (x, window, weight, bias)),
                                     *_host_rows(ops, query_start, checkpoint_rows), activation)
    return ops.from_numpy(y, dtype), ops.from_numpy(last, dtype), ops.from_numpy(ckpt, dtype)


def ssd(ops: Ops, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
        state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
        dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
    """:meth:`~infer.ops.Backend.ssd`'s default: on the host,
    :func:`ssd_reference`, in ``x``'s dtype."""
    dtype = ops.dtype(x)
    y, last, ckpt = ssd_reference(*_host32(ops, (x, dt, A, B, C, D, dt_bias, state)),
                                  *_host_rows(ops, query_start, checkpoint_rows), dt_softplus=dt_softplus,
                                  dt_min=dt_min, dt_max=dt_max)
    return ops.from_numpy(y, dtype), ops.from_numpy(last, dtype), ops.from_numpy(ckpt, dtype)


def gated_delta_rule(ops: Ops, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                     query_start: Array, checkpoint_rows: Array | None = None, *, scale: float | None = None,
                     l2norm_qk: bool = True) -> tuple[Array, Array, Array]:
    """:meth:`~infer.ops.Backend.gated_delta_rule`'s default: on the host in
    float32, :func:`gated_delta_rule_reference`; ``o`` in ``v``'s dtype,
    the states in ``state``'s."""
    o, last, ckpt = gated_delta_rule_reference(*_host32(ops, (q, k, v, g, beta, state)),
                                               *_host_rows(ops, query_start, checkpoint_rows), scale=scale,
                                               l2norm_qk=l2norm_qk)
    dtype, state_dtype = ops.dtype(v), ops.dtype(state)
    return ops.from_numpy(o, dtype), ops.from_numpy(last, state_dtype), ops.from_numpy(ckpt, state_dtype)
