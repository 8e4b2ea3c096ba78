"""The reference backend: the op contract in plain numpy, what every other backend is checked against.

The conformance kit (:mod:`infer.testing`) and ``infer diff`` compare a backend
with this one. It is the contract (:mod:`infer.ops`) written out as plainly as
numpy allows: every required op a line or two of the math its docstring
states, and every optional op left to the contract's default, so that
``attention``, ``swiglu``, ``fused_add_rms_norm``, ``topk``, ``clip``, the
recurrent ops (``causal_conv1d``, ``ssd``, ``gated_delta_rule``) and the rest
run exactly as :class:`~infer.ops.Backend` defines them. A plugin author reads
:mod:`infer.ops` for the contract and this module for its plainest
implementation.

It computes in float32 only. numpy has no bfloat16, so a cast to it is
:class:`~infer.errors.UnsupportedOpError` (the conformance kit rounds to
bfloat16 on the host instead), and numpy's float16 products run without BLAS
in its own loops, which round as no accelerator does: a float16 reference
would check nothing. Key and value pools may be stored in float16
(``kv_dtype="float16"``): the default attention reads them widened. Quantized weights are dequantized to float32 at
load (the default :meth:`~infer.ops.Backend.prepare_weight`), so a quantized
product is a float32 product with the weight's exact values.

No C kernels, no thread pools, no recorded programs: it is slow, and it is
never chosen unless asked for by name (``infer.load(path,
backend="reference")``); the fast CPU backend is ``numpy``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from infer.errors import UnsupportedOpError
from infer.ops import AdaptedWeight, Array, Backend
from infer.oplib import quantize_q8_0, rows_within
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe

#: The contract's dtype names numpy has (not bfloat16), and the masks' and codes' types.
_DTYPES = {
    "float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64,
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

#: The score ``infer.load`` sees: usable, and below every other backend, so
#: it is chosen only by name.
SCORE = 1


class ReferenceBackend(Backend):
    """Float32 on the CPU in plain numpy: the op contract as its docstrings state it."""

    name = "reference"
    device = "cpu"
    float_dtypes = ("float32",)
    #: Pools stored narrower: the default attention widens float16, and
    #: dequantizes q8_0 blocks against quantized queries (infer.oplib.attend_one).
    kv_dtypes = frozenset({"float16", "q8_0"})
    native_ops: frozenset[str] = frozenset()  # every optional op is the contract's default

    # -- transfer, creation, casting -------------------------------------------------

    def _np_dtype(self, dtype: str) -> np.dtype:
        if dtype not in _DTYPES:
            raise UnsupportedOpError(f"reference backend has no dtype {dtype!r}")
        return np.dtype(_DTYPES[dtype])

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        array = np.asarray(array)
        if dtype is None:
            dtype = self.compute_dtype if array.dtype.kind == "f" else self.dtype(array)
        return np.array(array, dtype=self._np_dtype(dtype), copy=True)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.array(x, copy=True)

    def astype(self, x: Array, dtype: str) -> Array:
        return x.astype(self._np_dtype(dtype))  # float to int: numpy truncates toward zero

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(int(d) for d in x.shape)

    def dtype(self, x: Array) -> str:
        if x.dtype not in _NAMES:
            raise UnsupportedOpError(f"reference backend has no name for dtype {x.dtype}")
        return _NAMES[x.dtype]

    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        return np.zeros(tuple(shape), self._np_dtype(dtype or self.compute_dtype))

    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        return np.arange(start, stop, dtype=self._np_dtype(dtype))

    # -- linear algebra ----------------------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        return np.matmul(a, b)

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        if type(weight) is AdaptedWeight:
            return self.adapted_linear(x, weight, bias)
        y = x @ weight.T  # prepare_weight's default: every weight is a float32 array
        return y if bias is None else y + bias

    # -- elementwise (numpy 2 keeps float32 under Python scalars: NEP 50) ----------------

    def add(self, a: Array, b: Array | float) -> Array:
        return np.add(a, b)

    def sub(self, a: Array, b: Array | float) -> Array:
        return np.subtract(a, b)

    def mul(self, a: Array, b: Array | float) -> Array:
        return np.multiply(a, b)

    def div(self, a: Array, b: Array | float) -> Array:
        q = np.true_divide(a, b)
        return q.astype(np.float32) if q.dtype == np.float64 else q  # integers divide into float32

    def exp(self, x: Array) -> Array:
        with np.errstate(over="ignore"):
            return np.exp(x)

    def sqrt(self, x: Array) -> Array:
        with np.errstate(invalid="ignore"):  # NaN for negative inputs, as the contract says
            return np.sqrt(x)

    def tanh(self, x: Array) -> Array:
        return np.tanh(x)

    def cos(self, x: Array) -> Array:
        return np.cos(x)

    def sin(self, x: Array) -> Array:
        return np.sin(x)

    def silu(self, x: Array) -> Array:
        with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x gives 0, as it should
            return x / (1 + np.exp(-x))

    def gelu(self, x: Array) -> Array:
        # numpy has no erf: math.erf on float64, rounded once to x's dtype.
        erf = np.vectorize(math.erf, otypes=[np.float64])
        x64 = x.astype(np.float64)
        return (0.5 * x64 * (1 + erf(x64 / math.sqrt(2)))).astype(x.dtype)

    def gelu_tanh(self, x: Array) -> Array:
        x64 = x.astype(np.float64)
        return (0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))).astype(x.dtype)

    # -- reductions --------------------------------------------------------------------

    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.sum(x, axis=axis, keepdims=keepdims)

    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.mean(x, axis=axis, keepdims=keepdims)

    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.max(x, axis=axis, keepdims=keepdims)

    def argmax(self, x: Array, axis: int = -1) -> Array:
        return np.argmax(x, axis=axis)  # the first index wins ties

    def softmax(self, x: Array, axis: int = -1) -> Array:
        with np.errstate(invalid="ignore"):  # a row of -inf: inf - inf, NaN as the contract says
            e = np.exp(x - np.max(x, axis=axis, keepdims=True))
            return e / np.sum(e, axis=axis, keepdims=True)

    # -- normalisation and position encoding ---------------------------------------------

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        x32 = x.astype(np.float32)
        y = (x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))).astype(x.dtype)
        return y if weight is None else y * weight

    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        x32 = x.astype(np.float32)
        centred = x32 - np.mean(x32, axis=-1, keepdims=True)
        variance = np.mean(centred * centred, axis=-1, keepdims=True)  # biased
        y = (centred / np.sqrt(variance + np.float32(eps))).astype(x.dtype)
        y = y if weight is None else y * weight
        return y if bias is None else y + bias

    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        half = cos.shape[-1]
        rot = 2 * half
        cos, sin = cos[:, None, :], sin[:, None, :]  # [tokens, 1, rot/2]: the same angles for every head
        if interleaved:  # the pairs (x[2i], x[2i+1])
            a, b = np.s_[..., 0:rot:2], np.s_[..., 1:rot:2]
        else:  # the pairs (x[i], x[i + rot/2])
            a, b = np.s_[..., :half], np.s_[..., half:rot]
        out = x.copy()  # features past rot pass through
        out[a] = x[a] * cos - x[b] * sin
        out[b] = x[a] * sin + x[b] * cos
        return out

    def embedding(self, table: Array, ids: Array) -> Array:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise IndexError(f"token id out of range [0, {table.shape[0]}): found "
                             f"{ids.min() if ids.min() < 0 else ids.max()}")
        return table[ids]

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return np.take(x, indices, axis=axis)

    # -- shapes and the one write --------------------------------------------------------

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return np.reshape(x, tuple(shape))

    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        return np.transpose(x, tuple(axes))

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        return np.concatenate(list(xs), axis=axis)

    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return x[tuple(index)]

    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        at = rows_within(rows, dst.shape[0])
        if dst.dtype == np.uint8 and src.dtype.kind == "f":  # a pool of q8_0 blocks: the rows quantized
            src = quantize_q8_0(src)
        dst[at] = src  # in place, rounded into dst's dtype
        return dst


@hookimpl
def infer_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    """Register the reference on the CPU: always available, never chosen unless named."""
    register(
        BackendSpec(
            name="reference",
            device="cpu",
            factory=lambda dtype: ReferenceBackend(dtype),
            probe=lambda: Probe(SCORE, None, ()),
            description=f"numpy {np.__version__} float32, plain: what the conformance kit and infer diff "
                        "compare against (slow; by name only)",
            score_ceiling=SCORE,
        )
    )
