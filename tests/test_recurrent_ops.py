"""The recurrent layers' ops against PyTorch's own layers, over ragged batches.

``causal_conv1d`` against ``torch.nn.functional.conv1d`` (depthwise, left
padding ``K - 1``, the layer Mamba2, LFM2 and gated DeltaNet hold): the whole
sequence in one call equals any split into chunks carrying the window, and the
checkpoint windows are the inputs a fresh call would carry from there.
Tolerance 1e-5 relative: float32 sums of at most 4 products on both sides.

``gated_delta_rule`` (numpy's reference and torch's own) against transformers'
``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule``, with
states carried across splits and restarted from checkpoints; ``softplus``
against torch's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from infer.backends.numpy import NumpyBackend
from infer.oplib import conv1d_reference, gated_delta_rule_reference, ssd_reference

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
    from infer.oplib import ssd_reference

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
# -- gated_delta_rule ------------------------------------------------------------------------
#
# Against transformers' own torch_recurrent_gated_delta_rule (token by token) and
# torch_chunk_gated_delta_rule (chunks of 64 solved with a triangular system), both with the
# q/k L2 normalisation Qwen3-Next and Qwen3.5 turn on. Tolerance 1e-4: the chunked form sums in
# another order (through a triangular solve) and the states grow to O(10) over 40 rows.

GDR_RTOL = 1e-4


def _gdr_inputs(rng: np.random.Generator, n: int, key_heads: int, heads: int, dk: int,
                dv: int) -> tuple[np.ndarray, ...]:
    q = rng.standard_normal((n, key_heads, dk)).astype(np.float32)
    k = rng.standard_normal((n, key_heads, dk)).astype(np.float32)
    v = rng.standard_normal((n, heads, dv)).astype(np.float32)
    g = -np.exp(rng.standard_normal((n, heads))).astype(np.float32) * 0.3  # log-decays <= 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, heads))))).astype(np.float32)
    return q, k, v, g, beta


def torch_gdr(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
              state: np.ndarray | None, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
    """One sequence through transformers' function: (o [n, H, V], final state [H, K, V])."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    fn = ref.torch_chunk_gated_delta_rule if chunked else ref.torch_recurrent_gated_delta_rule
    args = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
    init = None if state is None else torch.from_numpy(state)[None]
    o, last = fn(*args, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].numpy(), last[0].numpy()


class _Host:
    """A backend's gated_delta_rule taking and returning numpy arrays."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def gated_delta_rule(self, *args: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        ops = self.ops
        arrays = [ops.from_numpy(np.asarray(a)) if a is not None else None for a in args]
        return tuple(ops.to_numpy(r) for r in ops.gated_delta_rule(*arrays, **kwargs))


def _gdr_backend(name: str) -> Any:
    if name == "numpy":
        return NumpyBackend()
    from infer.backends.torch import TorchBackend

    return _Host(TorchBackend("cpu", "float32"))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(("key_heads", "heads"), [(2, 2), (1, 3), (2, 4)])
def test_gated_delta_rule_in_splits_equals_transformers(chunked: bool, key_heads: int, heads: int,
                                                        backend: str) -> None:
    # torch's own op runs the 40-row sequence chunked and the rest step by step: both forms are checked.
    rng = np.random.default_rng(10 * key_heads + heads)
    lengths, dk, dv = [40, 1, 9], 8, 6
    seqs = [_gdr_inputs(rng, n, key_heads, heads, dk, dv) for n in lengths]
    # The second sequence continues from a given state; the others start empty.
    given = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    starts = [None, given, None]
    want = [torch_gdr(*s, st, chunked) for s, st in zip(seqs, starts)]
    ops = _gdr_backend(backend)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    state = np.stack([np.zeros_like(given), given, np.zeros_like(given)])
    flat = [np.concatenate([s[i] for s in seqs]) for i in range(5)]
    rows = np.asarray([4, 39, 40, 45], np.int32)
    o, last, ckpt = ops.gated_delta_rule(*flat, state, qs, rows)
    o_whole, _, _ = ops.gated_delta_rule(*flat, state, qs)  # no checkpoint: sequence 0 in one run
    np.testing.assert_allclose(o, np.concatenate([w[0] for w in want]), rtol=GDR_RTOL, atol=GDR_RTOL)
    np.testing.assert_allclose(o_whole, o, rtol=GDR_RTOL, atol=GDR_RTOL)
    for b in range(3):
        np.testing.assert_allclose(last[b], want[b][1], rtol=GDR_RTOL, atol=GDR_RTOL)
    np.testing.assert_allclose(ckpt[1], want[0][1], rtol=GDR_RTOL, atol=GDR_RTOL)  # row 39: sequence 0's end
    np.testing.assert_allclose(ckpt[2], want[1][1], rtol=GDR_RTOL, atol=GDR_RTOL)  # row 40: sequence 1's only row
    # The first sequence in chunks of 5, 1, 20, 14 carrying the state; resuming from the checkpoint
    # after row 4 gives the rest exactly as the whole run does.
    got, carried, at = [], state[:1], 0
    for n in (5, 1, 20, 14):
        part, carried, _ = ops.gated_delta_rule(*(a[at:at + n] for a in seqs[0]), carried, np.asarray([0, n], np.int32))
        got.append(part)
        at += n
    np.testing.assert_allclose(np.concatenate(got), want[0][0], rtol=GDR_RTOL, atol=GDR_RTOL)
    np.testing.assert_allclose(carried[0], want[0][1], rtol=GDR_RTOL, atol=GDR_RTOL)
    resumed, _, _ = ops.gated_delta_rule(*(a[5:] for a in seqs[0]), ckpt[:1], np.asarray([0, 35], np.int32))
    np.testing.assert_allclose(resumed, want[0][0][5:], rtol=GDR_RTOL, atol=GDR_RTOL)


def test_gated_delta_rule_scale_and_no_l2norm() -> None:
    rng = np.random.default_rng(3)
    q, k, v, g, beta = _gdr_inputs(rng, 6, 2, 2, 4, 3)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # unit keys: the rule stays bounded without the norm
    ops, zero, qs = NumpyBackend(), np.zeros((1, 2, 4, 3), np.float32), np.asarray([0, 6], np.int32)
    plain, _, _ = ops.gated_delta_rule(q, k, v, g, beta, zero, qs, l2norm_qk=False, scale=1.0)
    halved, _, _ = ops.gated_delta_rule(q, k, v, g, beta, zero, qs, l2norm_qk=False, scale=0.5)
    np.testing.assert_allclose(halved, plain * 0.5, rtol=1e-6, atol=1e-6)
    normed, _, _ = ops.gated_delta_rule(q, k, v, g, beta, zero, qs)
    assert not np.allclose(normed, plain * 0.5)


def test_gated_delta_rule_names_a_bad_call() -> None:
    q, v, g = np.zeros((5, 2, 4), np.float32), np.zeros((5, 3, 4), np.float32), np.zeros((5, 3), np.float32)
    state = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_rule_reference(q, q, v, g, g, state, [0, 3, 5])
    v, g = np.zeros((5, 4, 4), np.float32), np.zeros((5, 4), np.float32)
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_reference(q, q, v, g, g, state, [0, 3, 5])
    with pytest.raises(ValueError, match="query_start"):
        gated_delta_rule_reference(q, q, v, g, g, np.zeros((2, 4, 4, 4), np.float32), [0, 3, 4])


def test_softplus_is_torchs() -> None:
    x = np.asarray([-100.0, -3.0, -0.5, 0.0, 0.5, 3.0, 19.0, 25.0, 100.0], np.float32)
    want = torch.nn.functional.softplus(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(NumpyBackend().softplus(x), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_mlx_native_recurrent_ops_equal_the_references(seed: int) -> None:
    """MLX's causal_conv1d, chunked ssd and row-by-row gated_delta_rule (backends/mlx_recurrent.py)
    against the numpy references, on the same kind of ragged batches as torch's above (gated delta
    rule at 1e-4: float32 on both sides, sums in another order)."""
    pytest.importorskip("mlx.core")
    from infer.backends.mlx import MLXBackend
    from infer.oplib import ssd_reference

    ops, rng = MLXBackend(), np.random.default_rng(100 + seed)
    lengths = np.ones(3, int) if seed % 2 == 0 else rng.integers(0, 150, 3)
    lengths[0] = max(int(lengths[0]), 1)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, seqs = int(qs[-1]), len(lengths)
    rows = np.sort(rng.choice(total, min(total, 5), replace=False)).astype(np.int32)

    def check(got: Any, want: Any, tol: float) -> None:
        for g, w in zip(got, want):
            np.testing.assert_allclose(ops.to_numpy(g), w, rtol=tol, atol=tol)

    width = 1 + seed % 4
    conv = [rng.standard_normal(s).astype(np.float32) for s in ((total, 6), (seqs, width - 1, 6), (6, width), (6,))]
    check(ops.causal_conv1d(*(ops.from_numpy(a) for a in (*conv, qs, rows)), activation="silu"),
          conv1d_reference(*conv, qs, rows, "silu"), RTOL)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((total, 4, 3), (total, 4), (4,), (total, 2, 5), (total, 2, 5), (4,), (4,), (seqs, 4, 3, 5))]
    arrays[2] = -np.exp(arrays[2])
    check(ops.ssd(*(ops.from_numpy(a) for a in (*arrays, qs, rows))), ssd_reference(*arrays, qs, rows), 2e-4)
    q, k = (rng.standard_normal((total, 2, 4)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((total, 4, 3)).astype(np.float32)
    g = (-np.exp(rng.standard_normal((total, 4))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((total, 4))))).astype(np.float32)
    state = rng.standard_normal((seqs, 4, 4, 3)).astype(np.float32)
    check(ops.gated_delta_rule(*(ops.from_numpy(a) for a in (q, k, v, g, beta, state, qs, rows))),
          gated_delta_rule_reference(q, k, v, g, beta, state, qs, rows), 1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_numpy_chunked_ssd_equals_the_reference(seed: int) -> None:
    """The numpy backend's native ssd (backends/cpu/recurrent.py: the chunked scan in float32,
    one update for a decode step) against the float64 row-by-row reference, past a 64-row chunk
    (2e-4: float32 chunk sums over up to 150 rows)."""
    from infer.oplib import ssd_reference

    rng = np.random.default_rng(200 + seed)
    lengths = np.ones(3, int) if seed % 2 == 0 else rng.integers(0, 150, 3)
    lengths[0] = max(int(lengths[0]), 1)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, seqs = int(qs[-1]), len(lengths)
    rows = np.sort(rng.choice(total, min(total, 5), replace=False)).astype(np.int32)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((total, 4, 3), (total, 4), (4,), (total, 2, 5), (total, 2, 5), (4,), (4,), (seqs, 4, 3, 5))]
    arrays[2] = -np.exp(arrays[2])
    for got, want in zip(NumpyBackend().ssd(*arrays, qs, rows), ssd_reference(*arrays, qs, rows)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
