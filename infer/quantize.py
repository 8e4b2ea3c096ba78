"""Group-wise affine quantization on the host: the form backends pack from.

Every quantized weight a backend computes on is, per group of ``group``
consecutive values of a row, ``value = scale * code + bias`` with unsigned
integer codes. :class:`AffineTensor` holds that form on the host:

* from a quantized tensor whose storage is such groups already (:func:`from_gguf`):
  a format says so through :meth:`~infer.ops.QuantizedTensor.affine_layout`
  and hands out the groups through :meth:`~infer.ops.QuantizedTensor.affine_rows`
  (GGUF's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q8_0 are groups of 32,
  exactly, and Q6_K groups of 16);
* from float weights (:func:`quantize_affine`): on-load quantization
  (``infer.load(path, quantize="q8" | "q4")``), min/max per group of 32,
  codes rounded to nearest.

A backend turns it into its native layout (torch's int4pack, MLX's packed
uint32 codes) or computes on it directly (numpy: dequantize per matmul).
"""

from __future__ import annotations

import numpy as np

from infer.errors import InvalidQuantizationError, UnsupportedDtypeError
from infer.ops import QuantizedTensor

#: On-load quantization schemes and their code width.
SCHEME_BITS = {"q8": 8, "q4": 4}
GROUP = 32


class AffineTensor(QuantizedTensor):
    """``scales * codes + biases`` per group of :attr:`group` values of a row.

    codes: uint8 ``[rows, cols]``, or with :attr:`bits` 4 packed two to a
    byte in GGML's order (:func:`pack4`); scales, biases:
    float32 ``[rows, cols / group]``, or float16 after :meth:`half_scales`.
    :meth:`dequantize` computes in float32 (``scale * code`` is exact for the
    codes and scales produced here, so fused and unfused evaluation agree).

    A symmetric tensor (GGUF's Q4_0, Q5_0, Q8_0 and Q6_K, whose values are
    ``scale * (q - 2**(bits - 1))``) may hold no biases: ``bias_factor`` is
    then ``-2**(bits - 1)`` and every bias is ``bias_factor * scale``, exactly
    (a power of two). :attr:`biases` makes them when asked; the numpy
    backend's kernels make them per tile from the scales, so their bytes are
    neither held nor read (:func:`symmetric`).
    """

    def __init__(self, qtype: str, shape: tuple[int, int], bits: int, codes: np.ndarray,
                 scales: np.ndarray, biases: np.ndarray | None, group: int = GROUP,
                 bias_factor: float | None = None) -> None:
        self.qtype, self.shape, self.bits, self.group = qtype, (int(shape[0]), int(shape[1])), bits, group
        if bits == 4 and codes.shape[1] == shape[1]:
            codes = pack4(codes)
        if biases is None and bias_factor is None:
            raise ValueError("an AffineTensor needs biases or a bias_factor")
        self.packed, self.scales, self.bias_factor = codes, scales, bias_factor
        self._biases = biases if bias_factor is None else None

    @property
    def biases(self) -> np.ndarray:
        """The biases, ``[rows, cols / group]`` in the scales' dtype (made from
        the scales, exactly, when :attr:`bias_factor` is set)."""
        return self._biases if self._biases is not None else _made(self.scales, self.bias_factor)

    @property
    def stored_biases(self) -> np.ndarray | None:
        """The biases held, or None where they are :attr:`bias_factor` times the scales."""
        return self._biases

    def codes(self, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Unpacked uint8 codes ``[rows, cols]``."""
        p = self.packed[rows]
        if self.bits != 4:
            return p
        n = p.shape[0]
        halves = p.reshape(n, -1, 1, GROUP // 2)
        out = np.empty((n, halves.shape[1], 2, GROUP // 2), np.uint8)
        np.bitwise_and(halves, np.uint8(15), out=out[:, :, :1])
        np.right_shift(halves, np.uint8(4), out=out[:, :, 1:])
        return out.reshape(n, -1)

    def _values(self, rows: np.ndarray | slice) -> np.ndarray:
        codes = self.codes(rows)
        n = codes.shape[0]
        out = codes.astype(np.float32).reshape(n, -1, self.group)
        scales = self.scales[rows]
        out *= scales[:, :, None]
        out += (_made(scales, self.bias_factor) if self._biases is None else self._biases[rows])[:, :, None]
        return out.reshape(n, -1)

    def dequantize(self) -> np.ndarray:
        return self._values(slice(None))

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        return self._values(np.asarray(rows))

    def half_scales(self) -> AffineTensor:
        """The same values with float16 scales and biases, when every scale and
        bias is a float16 value (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store
        them so); otherwise ``self``. Widening them back to float32 is exact,
        so a kernel computes exactly what it would with the float32 ones and
        reads 4 bytes per group instead of 8."""
        if self.scales.dtype == np.float16:
            return self
        held = self._biases
        with np.errstate(over="ignore"):
            scales = self.scales.astype(np.float16)
            biases = None if held is None else held.astype(np.float16)
        # Compared as bits: equal values, and NaN payloads, must survive the round trip.
        if not (_round_trips(scales, self.scales) and (biases is None or _round_trips(biases, held))):
            return self
        if biases is None and not np.isfinite(_made(scales, self.bias_factor)).all():
            return self  # factor * a float16 scale past float16's range: keep float32
        return AffineTensor(self.qtype, self.shape, self.bits, self.packed, scales, biases, self.group,
                            self.bias_factor)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales, biases where held)."""
        return self.packed.nbytes + self.scales.nbytes + (0 if self._biases is None else self._biases.nbytes)

    def __repr__(self) -> str:
        return f"AffineTensor({self.qtype}, {self.bits} bits, group {self.group}, shape={self.shape})"


def from_gguf(tensor: QuantizedTensor, *, groups: tuple[int, ...] = (GROUP,),
              half: bool = False) -> AffineTensor | None:
    """The exact affine form of a quantized matrix (GGUF blocks, in practice),
    or None when its storage has none with a group size in ``groups`` (by
    default 32, what torch's and MLX's kernels take; Q6_K's form has groups of
    16; Q2_K, Q3_K and the IQ types have none). The tensor's format provides
    the form (:meth:`~infer.ops.QuantizedTensor.affine_layout`,
    :meth:`~infer.ops.QuantizedTensor.affine_rows`).

    Scales and biases come back float32, or with ``half`` float16 wherever
    that is exact (:meth:`AffineTensor.half_scales`: a kernel that widens them
    reads half the bytes)."""
    layout = tensor.affine_layout()
    if layout is None or len(tensor.shape) != 2 or layout[1] not in groups:
        return None
    bits, group = layout
    rows, cols = tensor.shape
    # In slabs of rows, each slab's file pages released once converted: a large
    # matrix (Gemma 3's 262k-row head) then never has its stored bytes, its
    # unpacking temporaries and its new codes all resident at once.
    step = max(1, CONVERT_BYTES // max(1, tensor.nbytes // max(1, rows)))
    if rows <= step:
        codes, scales, biases = tensor.affine_rows(0, rows)
        if bits == 4 and codes.shape[1] == cols:
            codes = pack4(codes)
    else:
        # The outputs first (one row read tells their form: packed codes? float16
        # scales?), then the slabs: freed slab temporaries allocated before them
        # would raise glibc's mmap threshold and stay resident in its heap.
        # The biases are allocated only once a slab's are not the symmetric
        # factor times its scales (then the earlier slabs' are made).
        c, s, b = tensor.affine_rows(0, 1)
        width = cols // 2 if bits == 4 else c.shape[1]
        codes = np.empty((rows, width), np.uint8)
        scales = np.empty((rows, cols // group), s.dtype if half else np.float32)  # widened as copied: exact
        bias_dtype, factor = (b.dtype if half else np.dtype(np.float32)), _factor(bits)
        held: np.ndarray | None = None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            c, s, b = tensor.affine_rows(r0, r1)
            codes[r0:r1] = pack4(c) if bits == 4 and c.shape[1] == cols else c
            scales[r0:r1] = s
            b = b.astype(bias_dtype, copy=False)
            if held is None and not _made_exactly(b, scales[r0:r1], factor):
                held = np.empty((rows, cols // group), bias_dtype)
                held[:r0] = _made(scales[:r0], factor)
            if held is not None:
                held[r0:r1] = b
            tensor.release_rows(r0, r1)
        if held is None:
            if not np.isfinite(scales).all():
                return None
            affine = AffineTensor(tensor.qtype, (rows, cols), bits, codes, scales, None, group, factor)
            return affine.half_scales() if half else affine
        biases = held
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        return None  # inf/nan scales: leave them to the float path, which reproduces them as ggml does
    if not half and scales.dtype != np.float32:
        scales, biases = scales.astype(np.float32), biases.astype(np.float32)
    affine = AffineTensor(tensor.qtype, (rows, cols), bits, codes, scales, biases, group)
    if rows <= step:  # (slabs were checked as they came)
        affine = symmetric(affine)
    return affine.half_scales() if half else affine


def _round_trips(narrow: np.ndarray, wide: np.ndarray) -> bool:
    """Whether float16 ``narrow`` widens back to float32 ``wide`` bit for bit."""
    return np.array_equal(narrow.astype(np.float32).view(np.uint32), wide.view(np.uint32))


def _factor(bits: int) -> float:
    """A symmetric type's bias per unit of scale: ``-2**(bits - 1)``."""
    return -float(2 ** (bits - 1))


def _made(scales: np.ndarray, factor: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return scales * scales.dtype.type(factor)


def _made_exactly(biases: np.ndarray, scales: np.ndarray, factor: float) -> bool:
    """Whether ``biases`` are ``factor * scales`` bit for bit (and finite)."""
    made = _made(scales, factor)
    return (made.dtype == biases.dtype and bool(np.isfinite(made).all())
            and np.array_equal(made.view(np.uint8), np.ascontiguousarray(biases).view(np.uint8)))


def symmetric(affine: AffineTensor) -> AffineTensor:
    """``affine`` without its biases where each is ``-2**(bits - 1)`` times its
    scale, bit for bit (symmetric types: Q4_0, Q5_0, Q8_0, Q6_K); otherwise
    ``affine``. The biases were 2 bytes in 36 of every Q8_0 group, and the
    same bytes less to read per token."""
    held, factor = affine.stored_biases, _factor(affine.bits)
    if held is None or not _made_exactly(held, affine.scales, factor):
        return affine
    return AffineTensor(affine.qtype, affine.shape, affine.bits, affine.packed, affine.scales, None, affine.group,
                        factor)


def pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``[n, cols]`` below 16 -> ``[n, cols / 2]``, two a byte in
    GGML's order (Q4_0's and Q4_1's blocks): in each group of 32 columns, byte
    ``j`` holds column ``j`` in its low nibble and column ``j + 16`` in its high
    one. GGUF's Q4_0 and Q4_1 codes are then a copy, not a repacking, and a
    kernel reads a group's codes against x in x's own order (columns 0..15,
    then 16..31)."""
    n = codes.shape[0]
    halves = codes.reshape(n, -1, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << np.uint8(4))).reshape(n, -1)


#: Stored bytes of a quantized matrix converted at a time by :func:`from_gguf`.
#: Small, because glibc keeps freed temporaries of about a slab's size in its
#: heap (its mmap threshold rises to the largest chunk freed), which larger
#: slabs showed in the peak memory and not in the load's time
#: (docs/performance.md, "Figures behind the code").
CONVERT_BYTES = 2 << 20


def quantize_affine(weight: np.ndarray, scheme: str, *, scale_dtype: str = "float32",
                    name: str = "a tensor") -> AffineTensor:
    """Quantize a float matrix ``[rows, cols]`` with ``scheme`` (``"q8"`` or
    ``"q4"``): per group of 32 values, ``scale = (max - min) / (2**bits - 1)``,
    ``bias = min``, ``code = round((w - bias) / scale)``.

    ``scale_dtype`` ``"bfloat16"`` rounds scales and biases to bfloat16 first
    (for kernels that take them so); codes are computed against the rounded
    values and clipped, so :meth:`AffineTensor.dequantize` is exactly what
    such a kernel computes. Raises :class:`UnsupportedDtypeError` when
    ``cols`` is not a multiple of 32.
    """
    bits = check_scheme(scheme)
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise UnsupportedDtypeError(f"cannot quantize {name!r} with {scheme}: shape {list(w.shape)} "
                                    f"is not [rows, cols] with cols a multiple of {GROUP}")
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=2), g.max(axis=2)
    levels = np.float32(2 ** bits - 1)
    scales = (hi - lo) / levels
    biases = lo
    if scale_dtype == "bfloat16":
        scales, biases = _round_bf16(scales), _round_bf16(biases)
    elif scale_dtype != "float32":
        raise ValueError(f"quantize_affine: scale_dtype must be float32 or bfloat16, not {scale_dtype!r}")
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.rint((g - biases[:, :, None]) / safe[:, :, None])
    codes = np.clip(codes, 0, levels).astype(np.uint8).reshape(rows, cols)
    return AffineTensor(scheme, (rows, cols), bits, codes, scales.astype(np.float32), biases.astype(np.float32))


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def check_scheme(scheme: str) -> int:
    """The code width of an on-load scheme; :class:`InvalidQuantizationError` otherwise."""
    try:
        return SCHEME_BITS[scheme]
    except (KeyError, TypeError):
        raise InvalidQuantizationError(
            f"quantize={scheme!r}: expected one of {', '.join(repr(s) for s in SCHEME_BITS)}, "
            "'off' or None") from None


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """True for the matrices on-load quantization applies to: 2-D ``*.weight``
    tensors that are not embeddings or norms (projections, MLP, ``lm_head``)."""
    return (len(shape) == 2 and name.endswith(".weight") and "embed" not in name and "norm" not in name)


def is_embedding(name: str) -> bool:
    """True for the token embedding table (the output head too when tied)."""
    return "embed_tokens" in name


# -- int8 activations (activations="q8"): how far a product may move ----------------------------

#: Values of an activation row that share one int8 scale under ``activations="q8"``.
Q8_ACTIVATION_GROUP = 32


def q8_weight_sums(weight: np.ndarray) -> np.ndarray:
    """``sum |W[r, c]|`` over each group of :data:`Q8_ACTIVATION_GROUP`
    columns of a ``[out, in]`` weight (``in`` a multiple of it): ``[out, groups]``,
    what :func:`q8_error_bound` needs of the weight."""
    w = np.abs(np.asarray(weight, np.float64))
    return w.reshape(w.shape[0], -1, Q8_ACTIVATION_GROUP).sum(axis=-1)


def q8_error_bound(x: np.ndarray, weight_sums: np.ndarray) -> np.ndarray:
    """How far ``x @ W.T`` computed on int8 activations may be from the exact
    product, per element ``[rows, out]`` (docs/conformance.md, "Approximate modes").

    Group ``g`` of a row of ``x`` is stored as ``q = rint(x / d_g)`` with
    ``d_g = max|x_g| / 127``, so each value moves by at most ``d_g / 2`` and
    the product by at most ``sum_g (d_g / 2) * sum_{c in g} |W[r, c]|``.
    The float32 sums on both sides (the exact one's too) add at most
    ``2 k u sum_c |x_c W[r, c]|`` (``u = 2**-24``, a dot product of length
    ``k``), and since ``|x_c| <= 127 d_g`` that is at most ``4 * 127 * k * u``
    times the first term: a factor ``1 + 508 k u`` on it."""
    x = np.abs(np.asarray(x, np.float64))
    k = x.shape[-1]
    half_step = x.reshape(-1, k // Q8_ACTIVATION_GROUP, Q8_ACTIVATION_GROUP).max(axis=-1) / (2 * 127)
    bound = (1 + 4 * 127 * k * 2.0 ** -24) * (half_step @ weight_sums.T)
    return bound.reshape(*x.shape[:-1], weight_sums.shape[0])
