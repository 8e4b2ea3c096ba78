"""Mamba2's scan on the numpy backend in its chunked form (``ssd`` for :mod:`.numpy`).

The contract's default (``infer.oplib.ssd_reference``) walks the rows one by one in
float64: plain to read, and a Python step per row and head group. Here a decode
step (one row per sequence) updates every sequence's state at once, and longer runs
go 64 rows a chunk through the chunked form of the scan (Dao & Gu 2024, "Transformers
are SSMs", section 6), as :mod:`.torch_recurrent` computes it, in float32: within a
chunk the outputs are one masked, decay-weighted product, across chunks the state
carries; checkpoint states are the same sums cut at their row. The conformance kit
and tests/test_recurrent_ops.py check it against the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infer.oplib import check_ssd

#: Rows per chunk: the intra-chunk product is ``[Q, Q, heads]``.
CHUNK = 64


def ssd(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray, D: np.ndarray | None,
        dt_bias: np.ndarray | None, state: np.ndarray, query_start: Any, checkpoint_rows: Any, *,
        dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.ssd` (module docstring); float32 arrays in and out."""
    qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows)
    total, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    nseq = len(qs) - 1
    f = np.float32
    step = dt.astype(f) + (f(0) if dt_bias is None else dt_bias.astype(f))
    if dt_softplus:  # PyTorch's softplus: x itself above 20
        step = np.where(step > 20, step, np.log1p(np.exp(np.minimum(step, 20)))).astype(f)
    step = np.clip(step, dt_min, dt_max).astype(f)
    per = heads // groups
    Bh, Ch = np.repeat(B.astype(f), per, axis=1), np.repeat(C.astype(f), per, axis=1)  # [T, H, N]
    xs, a = x.astype(f), step * A.astype(f)
    S0 = state.astype(f)
    lengths = np.diff(qs)
    ckpt = np.empty((len(rows), heads, head_dim, size), f)
    if total and (lengths == 1).all():  # a decode step: every state at once
        S = np.exp(a)[:, :, None, None] * S0 + (step[:, :, None] * xs)[..., None] * Bh[:, :, None, :]
        y = np.einsum("bhpn,bhn->bhp", S, Ch)
        ckpt[:] = S[rows]
        last = S
    else:
        y = np.empty((total, heads, head_dim), f)
        last = S0.copy()
        for b in range(nseq):
            S = S0[b]
            for c0 in range(int(qs[b]), int(qs[b + 1]), CHUNK):
                c1 = min(c0 + CHUNK, int(qs[b + 1]))
                S = _chunk(S, xs[c0:c1], step[c0:c1], a[c0:c1], Bh[c0:c1], Ch[c0:c1], y, c0, rows, ckpt)
            last[b] = S
    if D is not None:
        y = y + D.astype(f)[:, None] * xs
    return y, last, ckpt


def _chunk(S: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, B: np.ndarray, C: np.ndarray,
           y: np.ndarray, first: int, rows: np.ndarray, ckpt: np.ndarray) -> np.ndarray:
    """One chunk's outputs into ``y[first:first + len]`` and its checkpoint rows' states into
    ``ckpt``; returns the state after it (as :func:`.torch_recurrent._chunk`, written as
    per-head matrix products so numpy's BLAS does the work). ``S`` ``[H, P, N]``, ``x``
    ``[l, H, P]``, ``dt``/``a`` ``[l, H]``, ``B``/``C`` ``[l, H, N]``."""
    n = x.shape[0]
    acum = np.cumsum(a, axis=0).T  # [H, l]: log decay from the chunk's start through each row
    xh, Bh, Ch = x.transpose(1, 0, 2), B.transpose(1, 0, 2), C.transpose(1, 0, 2)  # [H, l, .]
    causal = np.tril(np.ones((n, n), bool))
    with np.errstate(over="ignore"):  # masked entries: exp(-inf) = 0
        decay = np.exp(np.where(causal, acum[:, :, None] - acum[:, None, :], -np.inf)).astype(np.float32)
    scores = (Ch @ Bh.transpose(0, 2, 1)) * decay * dt.T[:, None, :]  # [H, i, j]
    out = scores @ xh + np.exp(acum)[:, :, None] * (Ch @ S.transpose(0, 2, 1))  # [H, l, P]
    y[first:first + n] = out.transpose(1, 0, 2)
    dx = (dt.T[:, :, None] * xh).transpose(0, 2, 1)  # [H, P, l]

    def state_after(i: int) -> np.ndarray:
        w = np.exp(acum[:, i:i + 1] - acum[:, :i + 1])  # [H, i + 1]
        return np.exp(acum[:, i])[:, None, None] * S + (dx[:, :, :i + 1] * w[:, None, :]) @ Bh[:, :i + 1]

    for r in np.flatnonzero((rows >= first) & (rows < first + n)):
        ckpt[r] = state_after(int(rows[r]) - first)
    return state_after(n - 1)
