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

from infer.ops import conv1d_reference
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
