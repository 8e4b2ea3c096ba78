"""Products with MXFP4 weights on their blocks (the numpy backend's kernel for GGML type 39).

GGML's ``block_mxfp4`` (``ggml-common.h``): per 32 values, one E8M0 exponent byte ``e``
then 16 bytes of E2M1 codes, value ``j`` in the low nibble of byte ``j`` and value
``16 + j`` in its high nibble (OCP "Microscaling Formats (MX) Specification" v1.0,
section 5.3). ggml computes ``kvalues_mxfp4[code] * 2 ** (e - 128)``: the E2M1 values
doubled (small integers) times half the block scale. gpt-oss's released GGUF files store
their experts so; :mod:`infer.formats.gguf_quants` dequantizes the same blocks bit for bit
with gguf-py.
"""

from __future__ import annotations

import numpy as np

#: ggml's ``kvalues_mxfp4``: the E2M1 values of codes 0..15, doubled.
VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
BLOCK, BLOCK_BYTES = 32, 17
_SLAB = 1 << 16  # weight rows x blocks per slab: its codes and partial sums stay small


def half_scale(e: np.ndarray) -> np.ndarray:
    """``2 ** (e - 128)`` in float32 from E8M0 bytes, built from bits as ggml's
    ``GGML_E8M0_TO_FP32_HALF`` (exponents 0 and 1 give subnormals)."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4_linear(x: np.ndarray, blocks: np.ndarray, cols: int) -> np.ndarray:
    """``x @ W.T`` for ``W`` the MXFP4 rows ``blocks`` (uint8 ``[rows, cols / 32 * 17]``).

    Each block's dot product with ``x`` is taken over its doubled E2M1 values (exact in
    float32), then scaled by the block's power of two (exact), and the blocks of a row are
    summed: the float32 weight matrix is never formed, only a slab of rows' codes. ``x``
    is float32 ``[..., cols]``; returns float32 ``[..., rows]``."""
    rows, groups = blocks.shape[0], cols // BLOCK
    lead = x.shape[:-1]
    xs = np.ascontiguousarray(x, np.float32).reshape(-1, groups, BLOCK).transpose(1, 0, 2)  # [G, T, 32]
    b = np.ascontiguousarray(blocks).reshape(rows, groups, BLOCK_BYTES)
    out = np.empty((xs.shape[1], rows), np.float32)
    step = max(1, _SLAB // groups)
    for r0 in range(0, rows, step):
        slab = b[r0:r0 + step]
        qs = slab[..., 1:]
        codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # [R, G, 32]
        partial = np.matmul(xs, VALUES[codes].transpose(1, 2, 0))  # [G, T, R]: one dot product per block
        partial *= half_scale(slab[..., 0]).T[:, None, :]
        out[:, r0:r0 + step] = partial.sum(axis=0)
    return out.reshape(*lead, rows)
