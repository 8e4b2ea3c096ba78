"""The recurrent layers' ops in torch, for :class:`~infer.backends.torch.TorchBackend`.

Each computes what the contract's numpy reference computes (:mod:`infer.oplib`:
``conv1d_reference``, ``ssd_reference``), after the same argument checks, vectorized so that a step costs a
few kernels instead of a Python loop per token:

* ``causal_conv1d``: every output row is a ``K``-tap window over its sequence's
  carried inputs and rows; the windows' row indices are computed on the host
  from ``query_start`` (a few integers) and the convolution is one gather and
  one weighted sum over the whole ragged batch.
* ``ssd``: a decode step (one row per sequence) updates all states at once;
  longer runs go chunk by chunk (64 rows) through the chunked form of the
  scan (Dao & Gu 2024, "Transformers are SSMs", section 6: within a chunk the
  outputs are a masked, decay-weighted attention-like product, across chunks
  the state carries), in float32. Checkpoint states are the same sums cut at
  their row.

The ragged batch's description is read on the host (``query_start``,
``checkpoint_rows``), so these ops run eagerly; the engine runs recurrent
layers outside captured steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infer.oplib import check_causal_conv1d, check_ssd

#: Rows per chunk of the chunked scan: the intra-chunk product is ``[Q, Q, heads]``.
CHUNK = 64


def _host(rows: Any) -> np.ndarray | None:
    return None if rows is None else rows.cpu().numpy()


def _source_index(qs: np.ndarray, seqs: np.ndarray, padded: np.ndarray, width: int) -> np.ndarray:
    """Index into ``cat(windows.reshape(B * width, C), x)`` of sequence ``seqs``'s
    padded positions ``padded`` (same shape, broadcast): window rows below
    ``width``, input rows from it on."""
    nseq = len(qs) - 1
    window_row = seqs * width + padded
    input_row = nseq * width + qs[seqs] + padded - width
    return np.where(padded < width, window_row, input_row)


def causal_conv1d(torch: Any, x: Any, window: Any, weight: Any, bias: Any, query_start: Any,
                  checkpoint_rows: Any, activation: str | None) -> tuple[Any, Any, Any]:
    """:meth:`~infer.ops.Backend.causal_conv1d` (module docstring)."""
    qs, rows = check_causal_conv1d(x, window, weight, query_start.cpu().numpy(), _host(checkpoint_rows), activation)
    total, channels = x.shape
    k = weight.shape[-1]
    nseq, width = len(qs) - 1, k - 1
    dtype, dev = x.dtype, x.device
    source = torch.cat([window.reshape(nseq * width, channels), x]).float()
    seq_of_row = np.repeat(np.arange(nseq), np.diff(qs))  # [T]
    local = np.arange(total) - qs[seq_of_row]  # each row's index in its sequence
    # Output row t reads padded positions local .. local + K - 1 of its sequence.
    taps = _source_index(qs, seq_of_row[:, None], local[:, None] + np.arange(k)[None, :], width)  # [T, K]
    y = (source[torch.from_numpy(taps).to(dev)] * weight.float().t()[None]).sum(1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    # The window after padded position q (q = local + K - 1): positions q - K + 2 .. q.
    lengths = np.diff(qs)
    last = _source_index(qs, np.arange(nseq)[:, None], lengths[:, None] + np.arange(width)[None, :], width)
    ck_seq = seq_of_row[rows]
    ck = _source_index(qs, ck_seq[:, None], (rows - qs[ck_seq])[:, None] + 1 + np.arange(width)[None, :], width)

    def gather(index: np.ndarray, n: int) -> Any:
        return source[torch.from_numpy(index.reshape(-1)).to(dev)].reshape(n, width, channels).to(dtype)

    return y.to(dtype), gather(last, nseq), gather(ck, len(rows))


def ssd(torch: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any, state: Any, query_start: Any,
        checkpoint_rows: Any, dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[Any, Any, Any]:
    """:meth:`~infer.ops.Backend.ssd` (module docstring)."""
    qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, query_start.cpu().numpy(), _host(checkpoint_rows))
    total, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    nseq = len(qs) - 1
    dtype = x.dtype
    f = torch.float32
    step = dt.to(f) + (0.0 if dt_bias is None else dt_bias.to(f))
    if dt_softplus:
        step = torch.nn.functional.softplus(step)  # PyTorch's threshold 20, as the reference
    step = torch.clamp(step, min=dt_min, max=dt_max)  # [T, H]
    per = heads // groups
    Bh = B.to(f).repeat_interleave(per, dim=1)  # [T, H, N]
    Ch = C.to(f).repeat_interleave(per, dim=1)
    xs, a = x.to(f), step * A.to(f)  # [T, H, P], [T, H] (log decay)
    S0 = state.to(f)
    lengths = np.diff(qs)
    ckpt = torch.empty((len(rows), heads, head_dim, size), dtype=f, device=x.device)
    if total and (lengths == 1).all():  # a decode step: every state at once
        S = torch.exp(a)[:, :, None, None] * S0 + (step[:, :, None] * xs)[..., None] * Bh[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", S, Ch)
        if len(rows):
            ckpt = S[torch.from_numpy(rows).to(x.device)]
        last = S
    else:
        y = torch.empty((total, heads, head_dim), dtype=f, device=x.device)
        states = []
        for b in range(nseq):
            start, stop = int(qs[b]), int(qs[b + 1])
            S = S0[b]
            for c0 in range(start, stop, CHUNK):
                c1 = min(c0 + CHUNK, stop)
                S = _chunk(torch, S, xs[c0:c1], step[c0:c1], a[c0:c1], Bh[c0:c1], Ch[c0:c1], y, c0,
                           rows, ckpt)
            states.append(S)
        last = torch.stack(states) if states else S0
    if D is not None:
        y = y + D.to(f)[:, None] * xs
    return y.to(dtype), last.to(dtype), ckpt.to(dtype)


def _chunk(torch: Any, S: Any, x: Any, dt: Any, a: Any, B: Any, C: Any, y: Any, first: int, rows: np.ndarray,
           ckpt: Any) -> Any:
    """One chunk's outputs into ``y[first:first + len]`` and the checkpoint states
    of its rows into ``ckpt``; returns the state after it. ``S`` ``[H, P, N]``,
    ``x`` ``[l, H, P]``, ``dt``/``a`` ``[l, H]``, ``B``/``C`` ``[l, H, N]``."""
    n = x.shape[0]
    acum = torch.cumsum(a, 0)  # [l, H]: log decay from the chunk's start through each row
    # decay[i, j] = exp(acum[i] - acum[j]) for j <= i: row j's contribution as row i reads it.
    diff = acum[:, None, :] - acum[None, :, :]
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))  # [l, l, H]
    scores = torch.einsum("ihn,jhn->ijh", C, B) * decay * dt[None]  # [l, l, H]
    out = torch.einsum("ijh,jhp->ihp", scores, x)
    out = out + torch.exp(acum)[:, :, None] * torch.einsum("hpn,ihn->ihp", S, C)
    y[first:first + n] = out
    dx = dt[:, :, None] * x  # [l, H, P]

    def state_after(i: int) -> Any:
        w = torch.exp(acum[i][None] - acum[:i + 1])  # [i + 1, H]
        return torch.exp(acum[i])[:, None, None] * S + torch.einsum("jh,jhp,jhn->hpn", w, dx[:i + 1], B[:i + 1])

    for r in np.flatnonzero((rows >= first) & (rows < first + n)):
        ckpt[int(r)] = state_after(int(rows[r]) - first)
    return state_after(n - 1)
