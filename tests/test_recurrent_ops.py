"""The recurrent layers' ops against PyTorch's own layers, over ragged batches.

``causal_conv1d`` against ``torch.nn.functional.conv1d`` (depthwise, left
padding ``K - 1``, the layer Mamba2, LFM2 and gated DeltaNet hold): the whole
sequence in one call equals any split into chunks carrying the window, and the
checkpoint windows are the inputs a fresh call would carry from there.
Tolerance 1e-5 relative: float32 sums of at most 4 products on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.ops import conv1d_reference, ssd_reference
from infer.backends.numpy import NumpyBackend

RTOL = 1e-5


def torch_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, silu: bool) -> np.ndarray:
    """One sequence from an empty window, as the PyTorch layer computes it."""
    k = weight.shape[1]
    xt = torch.from_numpy(x.T[None])  # [1, C, L]
    y = torch.nn.functional.conv1d(xt, torch.from_numpy(weight)[:, None], None if bias is None else
                                   torch.from_numpy(bias), padding=k - 1, groups=x.shape[1])[..., :len(x)]
    y = torch.nn.functional.silu(y) if silu else y
    return y[0].T.numpy()


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("silu", [False, True])
def test_causal_conv1d_in_chunks_equals_the_torch_layer(width: int, silu: bool) -> None:
    rng = np.random.default_rng(width)
    lengths, channels = [7, 1, 12], 5
    xs = [rng.standard_normal((n, channels)).astype(np.float32) for n in lengths]
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    act = "silu" if silu else None
    want = [torch_conv(x, weight, bias, silu) for x in xs]
    ops = NumpyBackend()
    # All three in one ragged call from empty windows; checkpoints after rows 2 and 19.
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    window = np.zeros((3, width - 1, channels), np.float32)
    y, last, ckpt = ops.causal_conv1d(np.concatenate(xs), window, weight, bias, qs, np.asarray([2, 19], np.int32),
                                      activation=act)
    np.testing.assert_allclose(y, np.concatenate(want), rtol=RTOL, atol=RTOL)
    for b, x in enumerate(xs):  # the window after the last row: its last K - 1 inputs
        np.testing.assert_array_equal(last[b], np.concatenate([window[b], x])[len(x):])
    # The first sequence in chunks of 3, 1, 3, carrying the window (and a checkpoint's window
    # restarts it exactly).
    got, carried, at = [], window[:1], 0
    for n in (3, 1, 3):
        part, carried, _ = ops.causal_conv1d(xs[0][at:at + n], carried, weight, bias, np.asarray([0, n], np.int32),
                                             activation=act)
        got.append(part)
        at += n
    np.testing.assert_allclose(np.concatenate(got), want[0], rtol=RTOL, atol=RTOL)
    resumed, _, _ = ops.causal_conv1d(xs[0][3:], ckpt[:1], weight, bias, np.asarray([0, 4], np.int32),
                                      activation=act)
    np.testing.assert_allclose(resumed, want[0][3:], rtol=RTOL, atol=RTOL)


def test_causal_conv1d_names_a_bad_batch() -> None:
    x, window, weight = np.zeros((5, 2), np.float32), np.zeros((2, 3, 2), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="query_start"):
        conv1d_reference(x, window, weight, None, [0, 3, 4])
    with pytest.raises(ValueError, match="checkpoint row 5"):
        conv1d_reference(x, window, weight, None, [0, 3, 5], [5])
    with pytest.raises(ValueError, match="weight"):
        conv1d_reference(x, window, np.zeros((2, 3), np.float32), None, [0, 3, 5])
    with pytest.raises(ValueError, match="activation"):
        conv1d_reference(x, window, weight, None, [0, 3, 5], activation="gelu")


# -- ssd: Mamba2's scan ----------------------------------------------------------------------
#
# Against transformers' own torch path (``mamba2_chunk_scan``, the chunked segment-sum form
# Mamba2Mixer runs on without the CUDA kernels): a different computation (block matrices of
# exp(segsum), chunk states passed between chunks) that equals the recurrence in exact
# arithmetic. Tolerance 1e-4 relative to the largest output: float32 on the torch side.

SSD_RTOL = 1e-4


def torch_chunk_scan(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray, D: np.ndarray,
                     dt_bias: np.ndarray, state: np.ndarray | None, chunk: int,
                     limit: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """One sequence through transformers' chunked scan: ``(y [L, H, P], final state [H, P, N])``."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    t = torch.from_numpy
    y, final = mamba2_chunk_scan(t(x)[None], t(dt)[None], t(A), t(B)[None], t(C)[None], chunk, D=t(D),
                                 dt_bias=t(dt_bias), initial_states=None if state is None else t(state)[None],
                                 dt_softplus=True, dt_limit=limit, return_final_states=True)
    return y[0].numpy(), final[0].numpy()


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=SSD_RTOL * max(1.0, float(np.abs(want).max())), err_msg=what)


@pytest.mark.parametrize(("heads", "groups"), [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.6)])
def test_ssd_equals_transformers_chunked_scan(heads: int, groups: int, limit: tuple[float, float]) -> None:
    rng = np.random.default_rng(heads * 10 + groups)
    head_dim, size, lengths = 3, 5, [11, 1, 6]

    def draw(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    total = sum(lengths)
    x, dt, B, C = draw(total, heads, head_dim), draw(total, heads), draw(total, groups, size), draw(total, groups, size)
    A, D, dt_bias = -np.exp(draw(heads, scale=0.5)), draw(heads), draw(heads, scale=0.5)
    initial = draw(3, heads, head_dim, size)
    initial[0] = 0.0  # a new sequence next to two carrying state
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ops = NumpyBackend()
    y, last, ckpt = ops.ssd(x, dt, A, B, C, D, dt_bias, initial, qs, np.asarray([4, 10, 17], np.int32),
                            dt_min=limit[0], dt_max=limit[1])
    for b in range(3):
        rows = slice(int(qs[b]), int(qs[b + 1]))
        want_y, want_state = torch_chunk_scan(x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, initial[b], 4, limit)
        _close(y[rows], want_y, f"sequence {b} outputs")
        _close(last[b], want_state, f"sequence {b} state")
    # The checkpoint states are the chunked scan's final states of the prefixes ending there.
    for i, (b, row) in enumerate([(0, 4), (0, 10), (2, 17)]):
        start = int(qs[b])
        _, want_state = torch_chunk_scan(x[start:row + 1], dt[start:row + 1], A, B[start:row + 1], C[start:row + 1],
                                         D, dt_bias, initial[b], 3, limit)
        _close(ckpt[i], want_state, f"checkpoint after row {row}")


def test_ssd_in_chunks_carries_the_state() -> None:
    # Sequence 0 of 11 rows split 5 + 1 + 5 (the state carried), and resumed from a checkpoint,
    # equals one call; the torch scan with chunks of 4 splits it elsewhere.
    rng = np.random.default_rng(7)
    heads, groups, head_dim, size, n = 4, 2, 2, 3, 11

    def draw(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x, dt, B, C = draw(n, heads, head_dim), draw(n, heads), draw(n, groups, size), draw(n, groups, size)
    A, D, dt_bias = -np.exp(draw(heads, scale=0.5)), draw(heads), draw(heads, scale=0.5)
    ops = NumpyBackend()
    state = np.zeros((1, heads, head_dim, size), np.float32)
    whole, final, ckpt = ops.ssd(x, dt, A, B, C, D, dt_bias, state, np.asarray([0, n], np.int32),
                                 np.asarray([4], np.int32))
    parts, carried, at = [], state, 0
    for length in (5, 1, 5):
        rows = slice(at, at + length)
        part, carried, _ = ops.ssd(x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, carried,
                                   np.asarray([0, length], np.int32))
        parts.append(part)
        at += length
    _close(np.concatenate(parts), whole, "chunked outputs")
    _close(carried, final, "chunked final state")
    resumed, _, _ = ops.ssd(x[5:], dt[5:], A, B[5:], C[5:], D, dt_bias, ckpt, np.asarray([0, n - 5], np.int32))
    _close(resumed, whole[5:], "resumed from the checkpoint")
    want_y, want_state = torch_chunk_scan(x, dt, A, B, C, D, dt_bias, None, 4, (0.0, float("inf")))
    _close(whole, want_y, "against the torch scan")
    _close(final[0], want_state, "final state against the torch scan")


def test_ssd_names_bad_shapes() -> None:
    x, dt, A = np.zeros((5, 4, 2), np.float32), np.zeros((5, 4), np.float32), np.zeros(4, np.float32)
    B, state = np.zeros((5, 3, 2), np.float32), np.zeros((2, 4, 2, 2), np.float32)
    with pytest.raises(ValueError, match="H % G"):
        ssd_reference(x, dt, A, B, B, None, None, state, [0, 3, 5])
    B = np.zeros((5, 2, 2), np.float32)
    with pytest.raises(ValueError, match="2 sequences in query_start, 1 states"):
        ssd_reference(x, dt, A, B, B, None, None, state[:1], [0, 3, 5])
    with pytest.raises(ValueError, match="checkpoint row 5"):
        ssd_reference(x, dt, A, B, B, None, None, state, [0, 3, 5], [5])


@pytest.mark.parametrize("seed", range(6))
def test_torch_native_recurrent_ops_equal_the_references_past_a_chunk(seed: int) -> None:
    """torch's vectorized causal_conv1d and chunked ssd (backends/torch_recurrent.py) against the
    numpy references, on ragged batches with sequences longer than one 64-row chunk, decode steps
    (one row per sequence) and empty sequences. ssd at 2e-4: float32 chunk sums against the
    reference's float64 recurrence over up to 150 rows."""
    from infer.backends import torch_recurrent
    from infer.ops import ssd_reference

    rng = np.random.default_rng(seed)
    lengths = np.ones(3, int) if seed % 3 == 0 else rng.integers(0, 150, 3)
    lengths[0] = max(int(lengths[0]), 1)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, seqs = int(qs[-1]), len(lengths)
    rows = np.sort(rng.choice(total, min(total, 5), replace=False)).astype(np.int32)
    channels, width = 6, 1 + seed % 4
    conv = [rng.standard_normal(s).astype(np.float32)
            for s in ((total, channels), (seqs, width - 1, channels), (channels, width), (channels,))]
    want = conv1d_reference(*conv, qs, rows, "silu")
    got = torch_recurrent.causal_conv1d(torch, *(torch.from_numpy(a) for a in (*conv, qs, rows)), "silu")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=RTOL, atol=RTOL)
    heads, dim, size, groups = 4, 3, 5, 2
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((total, heads, dim), (total, heads), (heads,), (total, groups, size), (total, groups, size), (heads,),
               (heads,), (seqs, heads, dim, size))]
    arrays[2] = -np.exp(arrays[2])  # A: negative decay rates
    want = ssd_reference(*arrays, qs, rows)
    got = torch_recurrent.ssd(torch, *(torch.from_numpy(a) for a in (*arrays, qs, rows)), True, 0.0, float("inf"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=2e-4, atol=2e-4)
