"""The gated delta rule on a torch device: :meth:`~infer.ops.Backend.gated_delta_rule` for :mod:`.torch`.

The same recurrence as :func:`infer.oplib.gated_delta_rule_reference`, in float32
on the tensors' device, in two forms:

* **step by step** over rows, every sequence of the batch at once while each
  has a row left (a decode step is one such step for all of them);
* **chunked** for the long runs of a prefill (Yang et al. 2024, "Gated Delta
  Networks", section 3.3; transformers' ``torch_chunk_gated_delta_rule``):
  within a chunk of 64 rows the delta rule's updates are one triangular solve
  (the UT transform), and only the chunks run in sequence. A sequence is cut
  at its checkpoint rows, so the state after each is a chunk boundary's.

Imported by the torch backend when the op is first called (torch is imported by then).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

CHUNK = 64
#: Runs shorter than this go step by step (the chunked form pays a solve per chunk).
MIN_CHUNKED = 16


def gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, qs: np.ndarray, rows: np.ndarray, *,
                     scale: float | None, l2norm_qk: bool) -> tuple[Any, Any, Any]:
    """``(o [T, H, V], states [B, H, K, V], checkpoint states [N, H, K, V])``
    in float32; ``qs`` and ``rows`` are host int64 arrays (checked)."""
    heads, dk = v.shape[1], q.shape[2]
    q, k = (x.float().repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))  # [T, H, K]
    if l2norm_qk:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (dk ** -0.5 if scale is None else scale)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    states = state.float().clone()
    ckpt = torch.empty((len(rows), *states.shape[1:]), dtype=torch.float32, device=v.device)
    keep = {int(r): [int(i) for i in np.flatnonzero(rows == r)] for r in set(rows.tolist())}
    stepped: dict[int, list[int]] = {}  # sequences with short runs only: their rows, walked together
    for b in range(len(qs) - 1):
        start, stop = int(qs[b]), int(qs[b + 1])
        # The sequence's runs end at its checkpoint rows and at its last row.
        ends = sorted({r + 1 for r in keep if start <= r < stop} | {stop})
        bounds = list(zip([start, *ends[:-1]], ends))
        if all(e - s < MIN_CHUNKED for s, e in bounds):
            if stop > start:
                stepped[b] = list(range(start, stop))
            continue
        for s0, e in bounds:  # in order, each run from the state the one before left
            if e - s0 >= MIN_CHUNKED:
                out[s0:e], states[b] = _chunked(q[s0:e], k[s0:e], v[s0:e], g[s0:e], beta[s0:e], states[b])
            else:
                for r in range(s0, e):
                    states[b:b + 1] = _step(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1],
                                            states[b:b + 1], out, [r])
            for i in keep.get(e - 1, ()):
                ckpt[i] = states[b]
    # One row of every such sequence per step (a decode step: all of them at once).
    for i in range(max((len(r) for r in stepped.values()), default=0)):
        seqs = [b for b in stepped if i < len(stepped[b])]
        at = [stepped[b][i] for b in seqs]
        idx, sel = torch.as_tensor(at, device=q.device), torch.as_tensor(seqs, device=q.device)
        new = _step(q[idx], k[idx], v[idx], g[idx], beta[idx], states[sel], out, at)
        states[sel] = new
        for j, r in enumerate(at):
            for c in keep.get(r, ()):
                ckpt[c] = new[j]
    return out, states, ckpt


def _step(q: Any, k: Any, v: Any, g: Any, beta: Any, s: Any, out: Any, at: list[int]) -> Any:
    """One row per sequence: ``q``, ``k`` ``[n, H, K]``, ``v`` ``[n, H, V]``, ``g``, ``beta``
    ``[n, H]``, ``s`` ``[n, H, K, V]``; writes ``out[at]`` and returns the new states."""
    s = s * g.exp()[..., None, None]
    memory = (s * k[..., None]).sum(-2)  # [n, H, V]: what the state recalls for k
    delta = (v - memory) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    out[torch.as_tensor(at, device=q.device)] = (s * q[..., None]).sum(-2)
    return s


def _chunked(q: Any, k: Any, v: Any, g: Any, beta: Any, s: Any) -> tuple[Any, Any]:
    """One run of ``L`` rows from state ``s`` ``[H, K, V]``: (o ``[L, H, V]``, the state after it)."""
    length = q.shape[0]
    pad = (-length) % CHUNK
    q, k, v = (torch.nn.functional.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', .]
    beta, g = (torch.nn.functional.pad(x.transpose(0, 1), (0, pad)) for x in (beta, g))  # [H, L']
    h, n = q.shape[0], q.shape[1] // CHUNK
    q, k, v = (x.reshape(h, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(h, n, CHUNK), g.reshape(h, n, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each row
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # The chunk's updates as one unit lower-triangular system (the UT transform): I + strictly_lower(.).
    system = torch.eye(CHUNK, device=q.device) + ((k_beta @ k.transpose(-1, -2)) * pairwise).tril(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pairwise  # causal within the chunk (pairwise is 0 above it)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(n):
        v_new = values[:, i] - k_decayed[:, i] @ s  # the part of the values the state does not predict
        out[:, i] = q[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, n * CHUNK, -1)[:, :length].transpose(0, 1), s
