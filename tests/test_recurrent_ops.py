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

from infer.ops import conv1d_reference, gated_delta_rule_reference
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
