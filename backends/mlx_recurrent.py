"""The recurrent layers' ops in MLX, for :class:`~infer.backends.mlx.MLXBackend`.

The same computations as :mod:`infer.oplib`'s numpy references (``conv1d_reference``,
``ssd_reference``, ``gated_delta_rule_reference``), with their argument checks, on the backend's device
in float32 and in the forms :mod:`.torch_recurrent` explains:

* ``causal_conv1d``: one gather of every output row's ``K`` taps (row indices
  worked out on the host from ``query_start``) and one weighted sum;
* ``ssd``: a decode step (one row per sequence) updates all states at once;
  longer runs go through the chunked scan, 64 rows a chunk;
* ``gated_delta_rule``: a decode step updates all states at once; longer runs
  go row by row (every head at once), the graph evaluated every 64 rows so it
  stays small.

Every function runs under ``mx.stream(stream)``: the backend's device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infer.oplib import check_causal_conv1d, check_gated_delta_rule, check_ssd

from .torch_recurrent import CHUNK, _source_index

#: Rows of a delta-rule run between evaluations of the lazily built graph.
EVAL_EVERY = 64


def _host(mx: Any, a: Any) -> np.ndarray | None:
    return None if a is None else np.array(a)


def causal_conv1d(mx: Any, stream: Any, x: Any, window: Any, weight: Any, bias: Any, query_start: Any,
                  checkpoint_rows: Any, activation: str | None) -> tuple[Any, Any, Any]:
    """:meth:`~infer.ops.Backend.causal_conv1d` (module docstring)."""
    qs, rows = check_causal_conv1d(x, window, weight, _host(mx, query_start), _host(mx, checkpoint_rows), activation)
    total, channels = x.shape
    k = weight.shape[-1]
    nseq, width = len(qs) - 1, k - 1
    with mx.stream(stream):
        dtype, f = x.dtype, mx.float32
        source = mx.concatenate([window.reshape(nseq * width, channels), x]).astype(f)
        seq_of_row = np.repeat(np.arange(nseq), np.diff(qs))
        local = np.arange(total) - qs[seq_of_row]
        taps = _source_index(qs, seq_of_row[:, None], local[:, None] + np.arange(k)[None, :], width)  # [T, K]
        y = (mx.take(source, mx.array(taps.reshape(-1).astype(np.int32)), axis=0).reshape(total, k, channels)
             * weight.astype(f).T[None]).sum(axis=1)
        if bias is not None:
            y = y + bias.astype(f)
        if activation == "silu":
            y = y * mx.sigmoid(y)
        lengths = np.diff(qs)
        last = _source_index(qs, np.arange(nseq)[:, None], lengths[:, None] + np.arange(width)[None, :], width)
        ck_seq = seq_of_row[rows]
        ck = _source_index(qs, ck_seq[:, None], (rows - qs[ck_seq])[:, None] + 1 + np.arange(width)[None, :],
                           width)

        def gather(index: np.ndarray, n: int) -> Any:
            flat = mx.array(index.reshape(-1).astype(np.int32))
            return mx.take(source, flat, axis=0).reshape(n, width, channels).astype(dtype)

        return y.astype(dtype), gather(last, nseq), gather(ck, len(rows))


def ssd(mx: Any, stream: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any, state: Any,
        query_start: Any, checkpoint_rows: Any, dt_softplus: bool, dt_min: float,
        dt_max: float) -> tuple[Any, Any, Any]:
    """:meth:`~infer.ops.Backend.ssd` (module docstring)."""
    qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, _host(mx, query_start), _host(mx, checkpoint_rows))
    total, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    nseq = len(qs) - 1
    with mx.stream(stream):
        dtype, f = x.dtype, mx.float32
        step = dt.astype(f) + (0.0 if dt_bias is None else dt_bias.astype(f))
        if dt_softplus:  # PyTorch's softplus: x itself above 20
            step = mx.where(step > 20.0, step, mx.log1p(mx.exp(mx.minimum(step, 20.0))))
        step = mx.clip(step, dt_min, None if dt_max == float("inf") else dt_max)
        per = heads // groups
        Bh, Ch = (mx.repeat(m.astype(f), per, axis=1) for m in (B, C))  # [T, H, N]
        xs, a = x.astype(f), step * A.astype(f)
        S0 = state.astype(f)
        lengths = np.diff(qs)
        if total and (lengths == 1).all():  # a decode step: every state at once
            S = mx.exp(a)[:, :, None, None] * S0 + (step[:, :, None] * xs)[..., None] * Bh[:, :, None, :]
            y = mx.einsum("bhpn,bhn->bhp", S, Ch)
            ckpt = mx.take(S, mx.array(rows.astype(np.int32)), axis=0) if len(rows) else \
                mx.zeros((0, heads, head_dim, size), f)
            last = S
        else:
            outs, states, at_rows = [], [], {}
            for b in range(nseq):
                start, stop = int(qs[b]), int(qs[b + 1])
                S = S0[b]
                for c0 in range(start, stop, CHUNK):
                    c1 = min(c0 + CHUNK, stop)
                    out, S = _chunk(mx, S, xs[c0:c1], step[c0:c1], a[c0:c1], Bh[c0:c1], Ch[c0:c1], c0, rows,
                                    at_rows)
                    outs.append(out)
                states.append(S)
            y = mx.concatenate(outs) if outs else mx.zeros((0, heads, head_dim), f)
            last = mx.stack(states)
            ckpt = mx.stack([at_rows[i] for i in range(len(rows))]) if len(rows) else \
                mx.zeros((0, heads, head_dim, size), f)
        if D is not None:
            y = y + D.astype(f)[:, None] * xs
        return y.astype(dtype), last.astype(dtype), ckpt.astype(dtype)


def _chunk(mx: Any, S: Any, x: Any, dt: Any, a: Any, B: Any, C: Any, first: int, rows: np.ndarray,
           at_rows: dict[int, Any]) -> tuple[Any, Any]:
    """One chunk of the scan (as :func:`.torch_recurrent._chunk`): its outputs and the state after it;
    the states after its checkpoint rows go into ``at_rows`` (checkpoint index -> state)."""
    n = x.shape[0]
    acum = mx.cumsum(a, axis=0)  # [l, H]
    diff = acum[:, None, :] - acum[None, :, :]
    causal = mx.array(np.tril(np.ones((n, n), bool)))[:, :, None]
    decay = mx.exp(mx.where(causal, diff, -float("inf")))  # [l, l, H]
    scores = mx.einsum("ihn,jhn->ijh", C, B) * decay * dt[None]
    out = mx.einsum("ijh,jhp->ihp", scores, x) + mx.exp(acum)[:, :, None] * mx.einsum("hpn,ihn->ihp", S, C)
    dx = dt[:, :, None] * x

    def state_after(i: int) -> Any:
        w = mx.exp(acum[i][None] - acum[:i + 1])
        return mx.exp(acum[i])[:, None, None] * S + mx.einsum("jh,jhp,jhn->hpn", w, dx[:i + 1], B[:i + 1])

    for r in np.flatnonzero((rows >= first) & (rows < first + n)):
        at_rows[int(r)] = state_after(int(rows[r]) - first)
    return out, state_after(n - 1)


def gated_delta_rule(mx: Any, stream: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, query_start: Any,
                     checkpoint_rows: Any, scale: float | None, l2norm_qk: bool) -> tuple[Any, Any, Any]:
    """:meth:`~infer.ops.Backend.gated_delta_rule` (module docstring)."""
    qs, rows = check_gated_delta_rule(q, k, v, g, beta, state, _host(mx, query_start), _host(mx, checkpoint_rows))
    total, key_heads, dk = q.shape
    heads, dv = v.shape[1:]
    nseq = len(qs) - 1
    with mx.stream(stream):
        f = mx.float32
        qf, kf = (mx.repeat(m.astype(f), heads // key_heads, axis=1) for m in (q, k))  # [T, H, K]
        if l2norm_qk:
            qf, kf = (m * mx.rsqrt((m * m).sum(axis=-1, keepdims=True) + 1e-6) for m in (qf, kf))
        qf = qf * (dk ** -0.5 if scale is None else scale)
        vf, decay, bf = v.astype(f), mx.exp(g.astype(f)), beta.astype(f)
        S0 = state.astype(f)

        def step(S: Any, qt: Any, kt: Any, vt: Any, dt: Any, bt: Any) -> tuple[Any, Any]:
            # S [..., H, K, V]; the rest [..., H, K] / [..., H, V] / [..., H]
            S = S * dt[..., None, None]
            memory = (S * kt[..., :, None]).sum(axis=-2)  # [..., H, V]
            delta = (vt - memory) * bt[..., None]
            S = S + kt[..., :, None] * delta[..., None, :]
            return S, (S * qt[..., :, None]).sum(axis=-2)

        lengths = np.diff(qs)
        if total and (lengths == 1).all():  # a decode step: every sequence at once
            S, o = step(S0, qf, kf, vf, decay, bf)
            ckpt = mx.take(S, mx.array(rows.astype(np.int32)), axis=0) if len(rows) else mx.zeros((0, heads, dk, dv), f)
            return o.astype(v.dtype), S.astype(state.dtype), ckpt.astype(state.dtype)
        outs, states, at_rows = [], [], {}
        where: dict[int, list[int]] = {}
        for i, r in enumerate(rows.tolist()):
            where.setdefault(int(r), []).append(i)
        for b in range(nseq):
            S = S0[b]
            for t in range(int(qs[b]), int(qs[b + 1])):
                S, o = step(S, qf[t], kf[t], vf[t], decay[t], bf[t])
                outs.append(o)
                for i in where.get(t, ()):
                    at_rows[i] = S
                if (t - int(qs[b])) % EVAL_EVERY == EVAL_EVERY - 1:
                    mx.eval(S, *outs[-EVAL_EVERY:])
            states.append(S)
        o = mx.stack(outs) if outs else mx.zeros((0, heads, dv), f)
        ckpt = mx.stack([at_rows[i] for i in range(len(rows))]) if len(rows) else mx.zeros((0, heads, dk, dv), f)
        return o.astype(v.dtype), mx.stack(states).astype(state.dtype), ckpt.astype(state.dtype)
