"""Quantizing float32 rows into GGML blocks, in vectorized numpy.

For the types the ``gguf`` package quantizes (``gguf.quants.quantize``: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, BF16) its reference implementation is used, which is
llama.cpp's. The K types (Q4_K, Q5_K, Q6_K) it can only dequantize; they are
written here after llama.cpp's reference quantizers (``ggml-quants.c``:
``quantize_row_q4_K_ref`` and its siblings, the ones ``llama-quantize`` runs
without an importance matrix):

- Q4_K / Q5_K: each 256-value super-block has eight sub-blocks of 32; each
  sub-block gets a scale and a min from a weighted least-squares search over 21
  (Q4_K) or 16 (Q5_K) candidate grids (``make_qkx2_quants``: weights
  ``rms(sub-block) + |x|``); the scales and mins are then stored as 6-bit
  fractions of their super-block maxima, and every value is rounded again
  against the stored (float16) scale.
- Q6_K: sixteen sub-blocks of 16 values, each scaled by a search over 19
  candidate scales around ``-32 / max`` weighted by ``x^2``
  (``make_qx_quants``), the scales stored as int8 fractions of the largest.

Everything is float32, with sums accumulated left to right
(``np.add.accumulate``) as the C loops do and ties rounded to even as
``nearest_int`` does, so the blocks are bit-for-bit those of llama.cpp's
reference code (checked against it by the tests).

:func:`quantize_rows` works through a matrix a slab of rows at a time, a few
slabs side by side on threads, so the temporaries stay bounded whatever the
tensor's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from infer.errors import FormatError, UnsupportedDtypeError

from .gguf_quants import QK_K, TYPES_BY_NAME

GROUP_MAX_EPS = np.float32(1e-15)
#: Values quantized per slab: bounds the temporaries (a few dozen float32 copies of a slab).
SLAB_VALUES = 1 << 18
#: Slabs quantized at once, each on its own thread.
THREADS = max(1, min(8, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None

_F32 = np.float32


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis left to right in float32 (as the C loops add), not pairwise."""
    return np.add.accumulate(a, axis=-1, dtype=np.float32)[..., -1]


def _nearest(a: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even (its float trick), as int32."""
    return np.rint(a).astype(np.int32)


def _fp16(a: np.ndarray) -> np.ndarray:
    """Round to float16 (as ``GGML_FP32_TO_FP16``) and back to float32 (exact)."""
    return a.astype(np.float16).astype(np.float32)


# -- the sub-block searches --------------------------------------------------------------


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants`` for every row of ``x`` [groups, n] with weights ``w``:
    (scale [groups], min [groups] (stored as ``-min`` >= 0), codes uint8 [groups, n])."""
    lo = np.minimum(x.min(axis=1), _F32(0))[:, None]
    hi = x.max(axis=1)[:, None]
    sum_w = _seqsum(w)[:, None]
    sum_x = _seqsum(w * x)[:, None]
    span = hi - lo
    flat = (span == 0)[:, 0]
    span = np.where(span == 0, _F32(1), span)  # flat groups are zeroed at the end
    iscale = _F32(nmax) / span
    scale = _F32(1) / iscale
    codes = np.clip(_nearest(iscale * (x - lo)), 0, nmax).astype(_F32)
    diff = scale * codes + lo - x
    best = _seqsum(w * (diff * diff))[:, None]
    mins = lo.copy()
    for step in range(nstep + 1):
        # The C loop reuses ``min``: once a candidate wins, later grids start from its min.
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / np.where(flat[:, None], _F32(1), hi - mins)
        cand = np.clip(_nearest(iscale * (x - mins)), 0, nmax).astype(_F32)
        wl = w * cand
        sum_l, sum_l2, sum_xl = _seqsum(wl)[:, None], _seqsum(wl * cand)[:, None], _seqsum(wl * x)[:, None]
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamp = this_min > 0
        this_min = np.where(clamp, _F32(0), this_min)
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        diff = this_scale * cand + this_min - x
        err = _seqsum(w * (diff * diff))[:, None]
        better = ok & (err < best)
        codes = np.where(better, cand, codes)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mins = np.where(better, this_min, mins)
    scale, mins = scale[:, 0], -mins[:, 0]
    scale[flat], mins[flat] = 0, -lo[flat, 0]
    codes[flat] = 0
    return scale, mins, codes.astype(np.uint8)


def _qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` for every row of ``x``:
    (scale [groups], codes uint8 [groups, n] offset by ``nmax``)."""
    index = np.abs(x).argmax(axis=1)  # the first largest |x|, as the strict '>' of the C loop
    peak = np.take_along_axis(x, index[:, None], axis=1)
    zero = (np.abs(peak) < GROUP_MAX_EPS)[:, 0]
    peak = np.where(zero[:, None], _F32(1), peak)
    w = x * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(_nearest(iscale * x), -nmax, nmax - 1).astype(_F32)
        wl = w * x
        return levels, _seqsum(wl * levels)[:, None], _seqsum(w * levels * levels)[:, None]

    levels, sumlx, suml2 = trial(_F32(-nmax) / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        cand, sumlx, suml2 = trial(-(_F32(nmax) + _F32(0.1) * _F32(step)) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = sumlx / suml2
        levels = np.where(better, cand, levels)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, scale * sumlx, best)
    scale = scale[:, 0]
    scale[zero] = 0
    codes = (levels + nmax).astype(np.uint8)
    codes[zero] = 0
    return scale, codes


# -- the K types -----------------------------------------------------------------------


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12 bytes holding eight 6-bit scales and mins ([blocks, 8] each)."""
    out = np.zeros((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The shared part of Q4_K and Q5_K for super-blocks ``x`` [blocks, 256]: the two float16
    super scales, the packed 6-bit scales, and the final codes [blocks, 256]."""
    blocks = len(x)
    sub = x.reshape(-1, 32)
    av = np.sqrt(_seqsum(sub * sub) / _F32(32))[:, None]
    scales, mins, codes = _qkx2(sub, av + np.abs(sub), nmax, rmin, 0.1, nstep)
    scales, mins, codes = scales.reshape(blocks, 8), mins.reshape(blocks, 8), codes.reshape(blocks, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))[:, None]
    max_min = np.maximum(mins.max(axis=1), _F32(0))[:, None]
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.minimum(_nearest(inv_scale * scales).astype(np.uint8), 63)
    lm = np.minimum(_nearest(inv_min * mins).astype(np.uint8), 63)
    d16 = (max_scale / _F32(63)).astype(np.float16)
    dmin16 = (max_min / _F32(63)).astype(np.float16)
    d = d16.astype(_F32) * ls.astype(_F32)  # [blocks, 8]
    dm = dmin16.astype(_F32) * lm.astype(_F32)
    live = d != 0  # a sub-block whose stored scale is 0 keeps the search's codes
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_nearest((x.reshape(blocks, 8, 32) + dm[..., None]) / d[..., None]), 0, nmax)
    codes = np.where(live[..., None], again, codes).astype(np.uint8).reshape(blocks, 256)
    return d16, dmin16, _pack_k_scales(ls, lm), codes


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks (144 bytes) of ``x`` [blocks, 256] float32, as ``quantize_row_q4_K_ref``."""
    d16, dmin16, scales, codes = _q45_k(x, 15, -1.0, 20)
    q = codes.reshape(-1, 4, 2, 32)  # 64-value chunks: low nibbles the first 32, high the next
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), scales, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K blocks (176 bytes) of ``x`` [blocks, 256] float32, as ``quantize_row_q5_K_ref``."""
    d16, dmin16, scales, codes = _q45_k(x, 31, -0.5, 15)
    q = codes.reshape(-1, 4, 2, 32)
    low = q & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).astype(np.uint8)  # [blocks, chunk, half, 32]: bit 2*chunk + half of qh
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = np.bitwise_or.reduce(high << shifts[None, :, :, None], axis=(1, 2)).astype(np.uint8)
    return np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), scales, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes) of ``x`` [blocks, 256] float32, as ``quantize_row_q6_K_ref``."""
    blocks = len(x)
    scales, codes = _qx(x.reshape(-1, 16), 32)
    scales, codes = scales.reshape(blocks, 16), codes.reshape(blocks, 16, 16)
    index = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, index[:, None], axis=1)
    zero = (np.abs(max_scale) < GROUP_MAX_EPS)[:, 0]
    max_scale = np.where(zero[:, None], _F32(1), max_scale)
    iscale = _F32(-128) / max_scale
    d16 = (_F32(1) / iscale).astype(np.float16)
    sc = np.minimum(_nearest(iscale * scales), 127).astype(np.int8)
    d = d16.astype(_F32) * sc.astype(_F32)
    live = d != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_nearest(x.reshape(blocks, 16, 16) / d[..., None]), -32, 31) + 32
    codes = np.where(live[..., None], again, codes).astype(np.uint8).reshape(blocks, 2, 4, 32)
    low, high = codes & 0xF, codes >> 4  # [blocks, 128-half, quarter, 32]
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(blocks, 128), qh.reshape(blocks, 64), sc.view(np.uint8),
                          d16.view(np.uint8)], axis=1)
    out[zero] = 0
    return out


_K_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
#: Types ``gguf.quants.quantize`` implements (gguf 0.19); the K types are done here. MXFP4 only
#: re-stores values that are MXFP4 already (gpt-oss's experts), where it is exact.
GGUF_QUANTIZED = ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
#: Every type :func:`quantize_rows` writes.
QUANTIZABLE = ("F32", "F16", *GGUF_QUANTIZED, *_K_QUANTIZERS)


def _quantize_slab(rows: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "F32":
        return rows.astype("<f4").view(np.uint8)
    if qtype == "F16":
        return rows.astype("<f2").view(np.uint8)
    if qtype in _K_QUANTIZERS:
        blocks = _K_QUANTIZERS[qtype](rows.reshape(-1, QK_K))
        return blocks.reshape(len(rows), -1)
    import gguf  # the reference quantizers

    blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    return _mxfp4_negative_zeros(rows, blocks) if qtype == "MXFP4" else blocks


def _mxfp4_negative_zeros(rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """gguf-py's MXFP4 quantizer codes -0.0 as +0 (code 0); a checkpoint's MXFP4 may hold
    code 8 (-0), which convert_hf_to_gguf.py's repack keeps: so code them 8 too, and MXFP4
    values re-stored come back byte for byte."""
    negative = (rows == 0) & np.signbit(rows)
    if not negative.any():
        return blocks
    b = blocks.reshape(-1, 17).copy()
    n = negative.reshape(-1, 32)
    b[:, 1:17] |= n[:, :16].astype(np.uint8) << np.uint8(3)  # code 0 -> 8: only its sign bit differs
    b[:, 1:17] |= n[:, 16:].astype(np.uint8) << np.uint8(7)
    return b.reshape(blocks.shape)


def quantize_rows(matrix: np.ndarray, qtype: str, *, name: str = "a tensor",
                  advance: Callable[[int], object] | None = None) -> np.ndarray:
    """``matrix`` [rows, cols] (any float dtype) as ``qtype`` blocks: uint8 [rows, row bytes].

    Works a slab of rows at a time (about :data:`SLAB_VALUES` values; up to
    :data:`THREADS` slabs at once), converting each slab to float32 only when it is
    quantized; ``advance(n)`` is called with the values done after each slab, in
    order, from the calling thread (a progress bar's ``update``).

    Raises:
        UnsupportedDtypeError: ``qtype`` is not one of :data:`QUANTIZABLE`, or the
            row length is not a multiple of its block size.
        FormatError: the tensor holds a NaN or an infinity (no GGML type can
            store it faithfully).
    """
    if qtype not in QUANTIZABLE:
        raise UnsupportedDtypeError(f"cannot quantize {name} to {qtype}; supported: {', '.join(QUANTIZABLE)}")
    t = TYPES_BY_NAME[qtype]
    rows, cols = matrix.shape
    if cols % t.block_size:
        raise UnsupportedDtypeError(f"{name}: rows of {cols} values are not a multiple of {qtype}'s "
                                    f"block of {t.block_size}")
    out = np.empty((rows, t.row_bytes(cols)), np.uint8)
    step = max(1, SLAB_VALUES // max(cols, 1))

    def one(start: int) -> int:
        slab = np.asarray(matrix[start:start + step], dtype=np.float32)
        if not np.isfinite(slab).all():
            bad = int(np.argwhere(~np.isfinite(slab))[0][0]) + start
            raise FormatError(f"{name}: row {bad} holds a NaN or infinity; refusing to quantize it")
        out[start:start + step] = _quantize_slab(slab, qtype)
        return slab.size

    starts = range(0, rows, step)
    if len(starts) <= 2 or THREADS == 1:
        done = map(one, starts)
    else:  # numpy releases the GIL in its loops: slabs quantize side by side
        global _pool
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="infer-quantize")
        done = _pool.map(one, starts)
    for size in done:
        if advance is not None:
            advance(size)
    return out
