"""GGML tensor types: their block layouts, and vectorized numpy dequantization.

A GGML type stores a row of ``n`` values as ``n / block_size`` blocks of
``type_size`` bytes each. Plain types (F32, F16, BF16) have blocks of one
value. Quantized blocks hold one or two float16 scales plus packed integers;
the layouts are those of llama.cpp's ``ggml-common.h`` (``block_q4_0``,
``block_q4_K``...) and the arithmetic that of ``ggml-quants.c``
(``dequantize_row_*``). Every dequantizer here is bit-exact with the
``gguf`` package's reference ``gguf.quants.dequantize``: the float operations
happen in the same order (``(d * scale) * q - (dmin * min)``), and integer
unpacking uses small lookup tables, which is exact.

The work is done in chunks of blocks so that the temporaries stay in cache,
and chunks run on a few threads (numpy releases the GIL in its kernels).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from infer.errors import UnsupportedDtypeError

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

QK_K = 256  # values per super-block of the k-quants


@dataclass(frozen=True)
class GGMLType:
    """One GGML tensor type: ``block_size`` values are stored in ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def quantized(self) -> bool:
        """True for block-quantized types (everything but F32/F16/BF16 and integers)."""
        return self.block_size > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` values (``n`` must be a multiple of ``block_size``)."""
        return n // self.block_size * self.type_size


# ggml.h's enum ggml_type with ggml.c's type_traits sizes. Every type is listed so
# that a file's byte layout can be validated even where its values cannot be read.
_TABLE = [
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2),
    (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8), (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17),
]
GGML_TYPES: dict[int, GGMLType] = {t[0]: GGMLType(*t) for t in _TABLE}
TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}

# -- helpers ---------------------------------------------------------------------------

_LO4 = (np.arange(256) & 0xF).astype(np.uint8)     # low nibble of a byte
_HI4 = (np.arange(256) >> 4).astype(np.uint8)      # high nibble
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_SHIFT2 = np.array([0, 2, 4, 6], np.uint8)
_SHIFT8 = np.arange(8, dtype=np.uint8)
_M4 = np.uint8(0xF)

# Integer codes are built in uint8/int8 and cast once into the float32 output (exact), then
# scaled in place: numpy's casting copy and in-place ufuncs are far faster than table lookups.


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, widened: shape [n, 1]."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _put_nibbles(out: np.ndarray, qs: np.ndarray) -> None:
    """``out[..., 2b]`` = the b low nibbles of ``qs[..., b]``, then its b high nibbles."""
    b = qs.shape[-1]
    np.copyto(out[..., :b], qs & _M4, casting="unsafe")
    np.copyto(out[..., b:], qs >> 4, casting="unsafe")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., b] packed bytes -> [..., 2b] uint8 codes: the b low nibbles, then the b high ones."""
    return np.concatenate([qs & _M4, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, shifts: np.ndarray, mask: int) -> np.ndarray:
    """[n, b] bytes -> [n, len(shifts), b]: field ``(byte >> s) & mask`` for each shift s."""
    return (packed[:, None, :] >> shifts[None, :, None]) & np.uint8(mask)


def _signed(codes: np.ndarray, offset: int) -> np.ndarray:
    """uint8 codes (< 128 + offset) minus ``offset``, as int8 (exact)."""
    return codes.view(np.int8) - np.int8(offset)


# -- the dequantizers: blocks [n, type_size] uint8 -> out [n, block_size] float32 ---


def _q4_0(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, _signed(_nibbles(b[:, 2:]), 8), casting="unsafe")
    out *= _f16(b, 0)


def _q4_1(b: np.ndarray, out: np.ndarray) -> None:
    _put_nibbles(out, b[:, 4:])
    out *= _f16(b, 0)
    out += _f16(b, 2)


def _q5_codes(b: np.ndarray, qh_at: int) -> np.ndarray:
    # Bit j of the little-endian u32 qh is the fifth bit of value j.
    high = np.unpackbits(b[:, qh_at:qh_at + 4], axis=1, bitorder="little")
    return _nibbles(b[:, qh_at + 4:]) | (high << np.uint8(4))


def _q5_0(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, _signed(_q5_codes(b, 2), 16), casting="unsafe")
    out *= _f16(b, 0)


def _q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, _q5_codes(b, 4), casting="unsafe")
    out *= _f16(b, 0)
    out += _f16(b, 2)


def _q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, b[:, 2:].view(np.int8), casting="unsafe")
    out *= _f16(b, 0)


def _q2_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    scales = b[:, :16]
    dl = _f16(b, 80) * (scales & _M4).astype(np.float32)              # [n, 16]
    ml = _f16(b, 82) * (scales >> 4).astype(np.float32)
    # qs: two halves of 32 bytes; each byte holds 4 values (shifts 0, 2, 4, 6), one per group of 32.
    o = out.reshape(n, 16, 16)
    np.copyto(o, _bits(b[:, 16:80].reshape(n * 2, 32), _SHIFT2, 3).reshape(n, 16, 16), casting="unsafe")
    o *= dl[:, :, None]
    o -= ml[:, :, None]


def _q3_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    sc = b[:, 96:108]
    # 16 six-bit scales: low 4 bits from bytes 0..7 (low then high nibbles), high 2 bits from bytes 8..11.
    high = _bits(sc[:, 8:12], _SHIFT2, 3).reshape(n, 16)
    scales = (_nibbles(sc[:, :8]) | (high << np.uint8(4))).astype(np.float32) - 32
    dl = _f16(b, 108) * scales                                         # [n, 16]
    ql = _bits(b[:, 32:96].reshape(n * 2, 32), _SHIFT2, 3).reshape(n, 16, 16)
    hm = _bits(b[:, :32], _SHIFT8, 1).reshape(n, 16, 16)
    # A clear hmask bit subtracts 4: q = ql + 4 * hbit - 4, in -4..3.
    o = out.reshape(n, 16, 16)
    np.copyto(o, _signed(ql | (hm << np.uint8(2)), 4), casting="unsafe")
    o *= dl[:, :, None]


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * scale, dmin * min) of the 8 sub-blocks of Q4_K/Q5_K blocks, [n, 8, 1] each,
    from the six-bit pairs packed in bytes 4..15."""
    s = b[:, 4:16]
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & _M4) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return (_f16(b, 0) * sc.astype(np.float32))[:, :, None], (_f16(b, 2) * mn.astype(np.float32))[:, :, None]


def _q4_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    ds, dm = _k_scales(b)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1.
    _put_nibbles(out.reshape(n, 4, 64), b[:, 16:144].reshape(n, 4, 32))
    o = out.reshape(n, 8, 32)
    o *= ds
    o -= dm


def _q5_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    ds, dm = _k_scales(b)
    high = _bits(b[:, 16:48], _SHIFT8, 1)                              # [n, 8, 32]: bit i -> sub-block i
    codes = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (high << np.uint8(4))
    o = out.reshape(n, 8, 32)
    np.copyto(o, codes, casting="unsafe")
    o *= ds
    o -= dm


def _q6_k_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's unsigned 6-bit codes ``[n, 256]`` and its ``d * sc`` per 16 values ``[n, 16]``
    (exact in float32): value = (code - 32) * scale."""
    n = b.shape[0]
    # Two halves of 128 values; in each, ql holds 64 bytes (low nibbles: groups 0, 1; high: 2, 3)
    # and qh 32 bytes (shifts 0, 2, 4, 6: groups 0..3 of 32 values).
    low = _nibbles(b[:, :128].reshape(n * 2, 64)).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].reshape(n * 2, 32), _SHIFT2, 3).reshape(n, 8, 32)
    scales = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (low | (high << np.uint8(4))).reshape(n, 256), scales


def _q6_k(b: np.ndarray, out: np.ndarray) -> None:
    codes, scales = _q6_k_parts(b)
    o = out.reshape(-1, 16, 16)
    np.copyto(o, _signed(codes, 32).reshape(-1, 16, 16), casting="unsafe")
    o *= scales[:, :, None]


def _iq4_nl(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, _IQ4NL[_nibbles(b[:, 2:])], casting="unsafe")
    out *= _f16(b, 0)


def _iq4_xs(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    # 8 six-bit sub-block scales: low 4 bits from bytes 4..7 (low nibble, then high, per byte),
    # high 2 bits from the little-endian u16 at bytes 2..3, two bits per sub-block.
    low = np.stack([b[:, 4:8] & _M4, b[:, 4:8] >> 4], axis=2).reshape(n, 8)
    h = b[:, 2:4].copy().view("<u2").astype(np.uint16)                 # [n, 1]
    high = ((h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    scales = (low | (high << np.uint8(4))).astype(np.float32) - 32
    o = out.reshape(n, 8, 32)
    np.copyto(o, _IQ4NL[_nibbles(b[:, 8:136].reshape(n, 8, 16))], casting="unsafe")
    o *= (_f16(b, 0) * scales)[:, :, None]


#: MXFP4's E2M1 values of codes 0..15, doubled (ggml's ``kvalues_mxfp4``): integers, exact in int8.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """``2 ** (e - 128)`` as float32 for E8M0 exponents ``e`` (uint8): half the block
    scale, as ggml's ``GGML_E8M0_TO_FP32_HALF`` builds it from bits (0 and 1 are subnormal),
    paired with the doubled :data:`MXFP4_VALUES`."""
    e = np.asarray(e, np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(
        np.uint32).view(np.float32)


def _mxfp4(b: np.ndarray, out: np.ndarray) -> None:
    # block_mxfp4 (ggml-common.h): one E8M0 exponent byte, then 16 bytes whose low nibbles are
    # values 0..15 and high nibbles 16..31 (OCP MX v1.0: E2M1 codes sharing one scale).
    np.copyto(out, MXFP4_VALUES[_nibbles(b[:, 1:17])], casting="unsafe")
    out *= e8m0_half(b[:, :1])


def _bf16(b: np.ndarray, out: np.ndarray) -> None:
    # bfloat16 is the top half of a float32: shift the bits into place (exact).
    out.view(np.uint32)[...] = b.view("<u2").astype(np.uint32) << 16


def _f16_values(b: np.ndarray, out: np.ndarray) -> None:
    out[...] = b.view("<f2")


def _f32_values(b: np.ndarray, out: np.ndarray) -> None:
    out[...] = b.view("<f4")


_DEQUANTIZE: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "F32": _f32_values, "F16": _f16_values, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}
#: Names of the types :func:`dequantize` reads.
SUPPORTED: tuple[str, ...] = tuple(_DEQUANTIZE)

_CHUNK_VALUES = 1 << 18  # values per chunk: temporaries of about a MiB stay in cache
_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None


def ggml_type(name: str, tensor: str = "a tensor") -> GGMLType:
    """The :class:`GGMLType` called ``name``, checking that it can be dequantized."""
    if name not in _DEQUANTIZE:
        raise UnsupportedDtypeError(
            f"tensor {tensor!r} is stored as GGML type {name}, which infer cannot read; "
            f"supported: {', '.join(SUPPORTED)}")
    return TYPES_BY_NAME[name]


def dequantize(raw: np.ndarray, qtype: str, tensor: str = "a tensor") -> np.ndarray:
    """Dequantize GGML ``qtype`` data to a new flat float32 array.

    ``raw`` is the tensor's bytes as uint8 (any shape, C-contiguous rows of
    whole blocks); the result has ``raw.size / type_size * block_size``
    values. Raises :class:`~infer.errors.UnsupportedDtypeError` naming
    ``tensor`` for a type infer cannot read, and :class:`ValueError` if
    ``raw`` is not a whole number of blocks.
    """
    t = ggml_type(qtype, tensor)
    if raw.dtype != np.uint8:
        raise ValueError(f"dequantize: raw bytes must be uint8, found {raw.dtype}")
    if raw.size % t.type_size:
        raise ValueError(f"dequantize: {raw.size} bytes is not a whole number of {qtype} blocks "
                         f"of {t.type_size} bytes")
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    n = blocks.shape[0]
    out = np.empty((n, t.block_size), np.float32)
    fn = _DEQUANTIZE[qtype]
    step = max(1, _CHUNK_VALUES // t.block_size)
    chunks = [(i, min(i + step, n)) for i in range(0, n, step)]
    with np.errstate(all="ignore"):  # inf/nan scales give inf/nan values, as in ggml
        if len(chunks) <= 2 or _THREADS == 1:
            for i, j in chunks:
                fn(blocks[i:j], out[i:j])
        else:
            global _pool
            if _pool is None:
                from concurrent.futures import ThreadPoolExecutor  # here: most loads never need it

                _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="infer-dequantize")
            list(_pool.map(lambda ij: _run(fn, blocks[ij[0]:ij[1]], out[ij[0]:ij[1]]), chunks))
    return out.reshape(-1)


def _run(fn: Callable[[np.ndarray, np.ndarray], None], blocks: np.ndarray, out: np.ndarray) -> None:
    with np.errstate(all="ignore"):  # error state is per thread
        fn(blocks, out)


# Byte offsets of each type's float16 scale fields (d, dmin, ...) inside a block.
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but finite ``qtype`` data for a ``[rows, cols]`` tensor, as uint8
    ``[rows, bytes_per_row]`` (for tests): random codes and sub-block scales,
    with float16 scales drawn like real ones (small, positive or negative,
    with full 11-bit mantissas)."""
    t = TYPES_BY_NAME[qtype]
    if cols % t.block_size:
        raise ValueError(f"random_blocks: {cols} columns is not a whole number of {qtype} blocks")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, t.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, t.type_size)
    # Scales of magnitudes like real weights' (1e-4 .. 0.1); a block's second field (a min)
    # of either sign and within a factor of 2 of its first, as quantizers produce them.
    mag = np.exp(rng.uniform(np.log(1e-4), np.log(0.1), blocks.shape[0]))
    for i, at in enumerate(_F16_FIELDS.get(qtype, ())):
        sign = 1.0 if i == 0 and qtype not in ("Q3_K", "Q6_K") else rng.choice([-1.0, 1.0], blocks.shape[0])
        factor = 1.0 if i == 0 else rng.uniform(0.5, 2.0, blocks.shape[0])
        blocks[:, at:at + 2] = (mag * factor * sign).astype("<f2").view(np.uint8).reshape(-1, 2)
    if qtype == "MXFP4":  # exponents of real weights' block scales (2**-14 .. 2**-4)
        blocks[:, 0] = rng.integers(127 - 14, 127 - 4, blocks.shape[0], dtype=np.uint8)
    return raw



# -- exact affine form: value = scale * code + bias, per group of 32 (or 16) ---------------
#
# Native kernels (torch's int4pack, MLX's affine quantized_matmul) store unsigned codes
# with one scale and one bias (or zero point) per group of consecutive values in a row.
# These GGML types are such groups of 32 already, and Q6_K one of 16. For each,
# ``scale * code`` is exact in float32 (an 11-bit float16 scale, Q4_K/Q5_K's ``d * sc``
# of 17 bits or Q6_K's of 18, times a code of at most 8 bits), so
# ``scale * code + bias`` rounds once, exactly as the dequantizers above do (Q4_1:
# ``d * q + m``; Q4_K: ``(d * sc) * q - dmin * m``; Q6_K: ``bias = -32 * d * sc``, also
# exact, so the sum is the exact value; Q4_0/Q5_0/Q8_0: ``d * (q - 8)`` etc., whose
# exact product needs no rounding at all).

def _affine_q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, d * np.float32(-8)


def _affine_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _affine_q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _q5_codes(b, 2), d, d * np.float32(-16)


def _affine_q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _q5_codes(b, 4), _f16(b, 0), _f16(b, 2)


def _affine_q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return b[:, 2:] ^ np.uint8(0x80), d, d * np.float32(-128)  # int8 q -> q + 128


def _affine_q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = b.shape[0]
    ds, dm = _k_scales(b)
    codes = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 256)
    return codes, ds.reshape(n, 8), -dm.reshape(n, 8)


def _affine_q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = b.shape[0]
    ds, dm = _k_scales(b)
    high = _bits(b[:, 16:48], _SHIFT8, 1)
    codes = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (high << np.uint8(4))
    return codes.reshape(n, 256), ds.reshape(n, 8), -dm.reshape(n, 8)


def _affine_q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes, scales = _q6_k_parts(b)
    return codes, scales, scales * np.float32(-32)


_AFFINE: dict[str, tuple[int, int, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]]] = {
    "Q4_0": (4, 32, _affine_q4_0), "Q4_1": (4, 32, _affine_q4_1), "Q4_K": (4, 32, _affine_q4_k),
    "Q5_0": (5, 32, _affine_q5_0), "Q5_1": (5, 32, _affine_q5_1), "Q5_K": (5, 32, _affine_q5_k),
    "Q6_K": (6, 16, _affine_q6_k), "Q8_0": (8, 32, _affine_q8_0),
}
#: Types with an exact affine form, and their code width in bits.
AFFINE_BITS: dict[str, int] = {name: bits for name, (bits, _, _) in _AFFINE.items()}
#: ... and the values per group (scale and bias) of that form.
AFFINE_GROUP: dict[str, int] = {name: group for name, (_, group, _) in _AFFINE.items()}


def _halves_from_chunks(qs: np.ndarray) -> np.ndarray:
    """Q4_K's nibble order -> GGML's per-group order (:func:`infer.quantize.pack4`).

    ``qs`` [..., 32] holds a 64-value chunk: byte j's low nibble is code j, its
    high nibble code 32 + j. Returned, [..., 32]: the chunk's two groups of 32,
    each as 16 bytes whose byte i holds codes i (low) and i + 16 (high) of the
    group."""
    first, second = qs[..., :16], qs[..., 16:]
    return np.concatenate([(first & _M4) | (second << np.uint8(4)), (first >> np.uint8(4)) | (second & np.uint8(0xF0))],
                          axis=-1)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float16: shape [n, 1]."""
    return blocks[:, start:start + 2].copy().view("<f2")


def _half_bias(d: np.ndarray, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """``(d, factor * d)`` in float16 when the product is one (``factor`` is a
    power of two, so only overflow can stop it), else both widened to float32."""
    wide = d.astype(np.float32)
    bias = wide * np.float32(factor)
    narrow = bias.astype(np.float16)
    if np.isfinite(narrow).all() or not np.isfinite(bias).all():
        return d, narrow
    return wide, bias


def _compact_q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (b[:, 2:], *_half_bias(_half(b, 0), -8))


def _compact_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return b[:, 4:], _half(b, 0), _half(b, 2)


def _compact_q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (b[:, 2:] ^ np.uint8(0x80), *_half_bias(_half(b, 0), -128))


def _compact_q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = b.shape[0]
    ds, dm = _k_scales(b)
    return _halves_from_chunks(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 128), ds.reshape(n, 8), -dm.reshape(n, 8)


#: Types whose compact form (4-bit codes packed, float16 scales where exact) is built directly.
_COMPACT = {"Q4_0": _compact_q4_0, "Q4_1": _compact_q4_1, "Q8_0": _compact_q8_0, "Q4_K": _compact_q4_k}


def affine_groups(raw: np.ndarray, qtype: str, cols: int, *,
                  compact: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact affine form of ``qtype`` rows: ``(codes, scales, biases)``.

    ``raw`` is uint8 ``[rows, bytes_per_row]`` for rows of ``cols`` values;
    ``codes`` is uint8 ``[rows, cols]`` (unsigned, below ``2**AFFINE_BITS[qtype]``),
    ``scales`` and ``biases`` float32 ``[rows, cols / AFFINE_GROUP[qtype]]``, such that
    ``scales * codes + biases`` (per group of 32, or Q6_K's 16, consecutive values of a
    row, in float32, fused or not) equals :func:`dequantize` bit for bit.

    ``compact``: 4-bit codes come packed two to a byte (``[rows, cols / 2]``, in
    GGML's order, :func:`infer.quantize.pack4`: Q4_0's and Q4_1's stored bytes,
    copied), and Q4_0, Q4_1 and Q8_0 keep their stored float16 scales (and
    float16 biases, exact): the form :func:`~infer.quantize.from_gguf` keeps, built
    without unpacking (a third of SmolLM2's load time went to unpacking and
    repacking; then a quarter to turning GGML's nibble order into column order).
    """
    if qtype not in _AFFINE:
        raise UnsupportedDtypeError(f"GGML type {qtype} has no exact affine form; "
                                    f"types that have one: {', '.join(_AFFINE)}")
    t = TYPES_BY_NAME[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    group = AFFINE_GROUP[qtype]
    if compact and qtype in _COMPACT:
        with np.errstate(all="ignore"):
            codes, scales, biases = _COMPACT[qtype](blocks)
        width = cols // 2 if AFFINE_BITS[qtype] == 4 else cols
        return (np.ascontiguousarray(codes).reshape(rows, width),
                np.ascontiguousarray(scales).reshape(rows, cols // group),
                np.ascontiguousarray(biases).reshape(rows, cols // group))
    with np.errstate(all="ignore"):
        codes, scales, biases = _AFFINE[qtype][2](blocks)
    return (np.ascontiguousarray(codes).reshape(rows, cols),
            np.ascontiguousarray(scales, np.float32).reshape(rows, cols // group),
            np.ascontiguousarray(biases, np.float32).reshape(rows, cols // group))

