"""The CPU package's backend: float32 compute on numpy arrays, with the C kernels.

:class:`CpuBackend` is every op of the contract computed on any CPU through
numpy's BLAS and, where they are built, the C kernels beside this file
(:mod:`infer.backends.cpu.kernels`). The registered ``numpy`` backend is this
class under its name (:mod:`infer.backends.numpy`), and torch/cpu records its
captured step through it (:mod:`infer.backends.cpu.plan`). Weights given in
float16 or bfloat16 are widened to float32 at load (bfloat16 arrives already
widened, see :meth:`infer.package.TensorSource.get`). It is also the default
when nothing faster is installed, so the hot ops avoid needless copies.

Quantized weights (docs/quantization.md). With the package's C kernels
(:mod:`infer.backends.cpu.kernels`, built at install where a C compiler exists),
the GGUF matrices of :func:`~infer.backends.cpu.kernels.stored_types` (all eight block types the kernels
read on AVX-512, and on AVX2 with int8 activations; fewer otherwise) are computed on as the file stores
them, a view of the memory-mapped file, and the others whose type has an exact
affine form (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in groups of 32) are converted to it,
4 or 8 bits per value plus a scale and bias per group, float16 where the
type stores them so:
decoding reads a quarter to a third of float32's bytes, and the kernel
multiplies on the codes directly, which decodes faster than float32 BLAS
(docs/performance.md, "Where the time goes"). Products with more than
:attr:`CpuBackend.KERNEL_ROWS` rows (prefill) run in the tiled kernel, which
decodes each panel of the weight once for all the rows (backends/cpu/tiled.c), or,
on the portable path or with ``INFER_EXACT_GEMM=blas``, dequantize the weight in
slabs for numpy's BLAS (:data:`~infer.backends.cpu.kernels.EXACT_GEMM`). ``quantize="off"``
dequantizes everything to float32 instead.

The same extension computes few-row float32 products (decoding with float32
weights) on the same OpenMP threads, since alternating with OpenBLAS's own
thread pool on few cores makes each wait for the other's spinning workers,
and ``rms_norm``, ``fused_add_rms_norm``, ``rope`` and few-row (paged)
attention in one C pass each (a decode step is hundreds of small ops: their
numpy overhead showed beside the quantized products). ``rope`` is bit-identical to the numpy formula;
``rms_norm`` differs only in the order of its sum of squares.

Without the kernels, GGUF weights are dequantized to float32 at load while
memory allows: BLAS on float32 is then the fastest matmul. When the float32
copy of a weight would not fit in the memory still available (less 1 GiB of
headroom; or past :attr:`CpuBackend.float_budget` bytes when that is set),
the weight stays in its blocks (:class:`~infer.ops.PackedWeight`) and is
dequantized for each matmul instead, the first
:attr:`CpuBackend.cache_bytes` of them kept dequantized. On-load
quantization (``quantize="q8"``/``"q4"``) stores codes with a float32 scale
and bias per group of 32 (:class:`~infer.quantize.AffineTensor`), computed
on by the kernels where they exist.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.backends.cpu.mxfp4 import mxfp4_linear
from infer.errors import UnsupportedOpError
from infer.oplib import (attention_mask, check_causal_conv1d, check_gated_delta_rule, check_ssd, dequantize_q8_0,
                         lora_segments, q8_0_query, quantize_q8_0, row_run, rows_within, span_rows)
from infer.ops import (
    OPTIONAL_OPS,
    REQUIRED_OPS,
    AdaptedWeight,
    Array,
    AttentionBatch,
    Backend,
    LoadSettings,
    PackedWeight,
    QuantizedTensor,
)
from infer.quantize import SCHEME_BITS, AffineTensor, from_gguf, is_embedding, is_linear_weight, quantize_affine

from . import kernels, recurrent
from .kernels import GOVERNOR, Q8_FLAG, block_form, keeps_stored, with_kernel_args

if TYPE_CHECKING:  # imported where the pool is made: every load imports this module
    import concurrent.futures

#: The C kernels this backend computes on (None: pure numpy, GGUF weights
#: dequantized to float32): :data:`infer.backends.cpu.kernels.native`.
_native = kernels.native

_DTYPES = {
    "float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64,
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf through frompyfunc is exact but slow, so use
    # the vectorised float64 route and cast back (gelu is not on llama's path).
    return np.vectorize(math.erf, otypes=[np.float64])(x)


class CpuBackend(Backend):
    """Float32 compute on the CPU with numpy and the C kernels (registered as
    ``numpy``: :class:`infer.backends.numpy.NumpyBackend`)."""

    name = "cpu"
    device = "cpu"
    float_dtypes = ("float32",)
    #: KV pools stored narrower: attention reads float16 widened, and q8_0
    #: blocks (uint8 pools) with integer dot products (backends/cpu/attention.c).
    kv_dtypes = frozenset({"float16", "q8_0"})
    native_ops = frozenset({"fused_add_rms_norm", "swiglu", "attention", "attention_spans", "prepare_weight",
                            "quantized_linear", "topk", "clip", "ssd", "causal_conv1d", "gated_delta_rule",
                            "lora_linear"}
                           | ({"compile"} if hasattr(_native, "run_plan") else set()))
    quantize_schemes = frozenset(SCHEME_BITS)
    #: ``activations="q8"``: the products of two or more rows on quantized
    #: weights round x to int8 per 32 values for integer dot products on the
    #: codes (backends/cpu/q8.c; docs/quantization.md, "Quantized activations").
    #: Needs the C kernels (:data:`~infer.backends.cpu.kernels.ACTIVATION_SCHEMES`).
    activation_schemes = kernels.ACTIVATION_SCHEMES
    #: Bytes of float32 weights to hold in total before quantized weights stay
    #: quantized; None: decide per tensor from the memory available.
    float_budget: int | None = None
    #: Bytes of per-matmul dequantized weights kept between calls (the first
    #: ones that fit stay; decoding reads every weight in turn, so an LRU
    #: smaller than the model would never hit).
    cache_bytes: int = 64 << 20
    #: Headroom left free when deciding from the memory available.
    HEADROOM = 1 << 30
    #: Products with at most this many rows run in the C kernel on the codes;
    #: more rows (prefill) dequantize slabs of the weight for BLAS, which is
    #: faster once the weight's rows are reused that many times (where the two
    #: cross: docs/performance.md, "The numpy backend's constants").
    KERNEL_ROWS = kernels.KERNEL_ROWS
    #: Fewest query rows per chunk of a causal attention with many rows (see :meth:`attention`).
    ATTENTION_CHUNK = 64
    #: A prompt chunk's attention runs in the C kernel, one pass per query row and head as in
    #: decoding, while query rows x keys are at most this (and the kernels' threads are the ones
    #: running): one layer of the 1B shape (32 heads over 8, head size 64, two threads) took 0.60x
    #: the two GEMMs' time at 128 rows over 128 keys, 0.77x at 256 over 256, 0.83x at 128 over
    #: 1,024, but 1.08x at 128 over 2,048 and 1.14x at 256 over 1,024, where the GEMMs reuse each
    #: key row for many queries and the kernel reads it again per row (docs/performance.md,
    #: "SiLU and a prompt's attention in the kernels").
    KERNEL_ATTENTION_AREA = 1 << 17
    #: ... and where at least this many query heads share each key/value head: the kernel reads
    #: a key row once for its group, and with fewer heads a group's pass costs more than the
    #: GEMMs' share (128 rows over 128 keys: 2.0x the GEMMs' time with 1 or 2 heads a group,
    #: 0.92-1.01x with 3, as SmolLM2 has, 0.4-0.7x with 4 to 8).
    KERNEL_ATTENTION_GROUP = 3
    #: A long prompt's forwards of 128 tokens (:attr:`Backend.prefill_chunk`): the 1B shape's
    #: 4,096-token prefill ran fastest so (1.4x the whole prompt in one forward, exact) and held
    #: 720 MB less at its peak (docs/performance.md, "Long prompts in chunks").
    prefill_chunk = 128
    #: Float32 bytes of weight rows dequantized at a time for BLAS: the
    #: smallest scratch buffer (it counts in the peak memory) with which
    #: prefill still runs at full speed (docs/performance.md).
    SLAB_BYTES = kernels.SLAB_BYTES

    def __init__(self, dtype: str | None = None) -> None:
        super().__init__(dtype)
        self._float_bytes = 0
        self._cache: dict[int, tuple[PackedWeight, np.ndarray]] = {}
        self._cached_bytes = 0
        self._slab = np.empty(0, np.float32)
        #: Whether the last product ran on BLAS (whose threads then spin for a
        #: while) rather than on the C kernels' OpenMP threads: the attention
        #: after it then stays on one thread rather than wake the other pool,
        #: whose threads would fight BLAS's for the cores.
        self._after_blas = False
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # _chunk_pool's, and its process

    def configure(self, settings: LoadSettings) -> CpuBackend:
        """:meth:`Backend.configure`, and a copy gets a dequantization cache
        of its own: a shared dict filled against each copy's own byte count
        would hold up to :attr:`cache_bytes` per copy."""
        configured = super().configure(settings)
        if configured is not self:
            configured._cache, configured._cached_bytes = {}, 0
        return configured  # type: ignore[return-value]

    # -- weights -------------------------------------------------------------

    def prepare_weight(self, tensor: np.ndarray | QuantizedTensor, *, name: str = "") -> Array:
        """GGUF matrices of :func:`~infer.backends.cpu.kernels.stored_types` stay the file's blocks, and the
        others with an affine form are converted to it, when the C kernels are
        built (unless ``quantize="off"``); float32 copies otherwise, while
        memory allows; past that (or with on-load quantization) a
        :class:`~infer.ops.PackedWeight`."""
        if isinstance(tensor, QuantizedTensor):
            if self.quantize != "off" and len(tensor.shape) == 2:
                if tensor.qtype == "MXFP4" and tensor.ggml_blocks() is not None:  # gpt-oss's experts
                    return PackedWeight(tensor.shape, "MXFP4", "MXFP4 blocks as stored, numpy kernel", tensor,
                                        rows=tensor)
                if keeps_stored(tensor, self.activations):  # computed on where it lies: nothing converted
                    how = f"{tensor.qtype} blocks as stored, C kernel"
                    return with_kernel_args(PackedWeight(tensor.shape, tensor.qtype, how, tensor, rows=tensor))
                affine = from_gguf(tensor, groups=(16, 32), half=True) if _native is not None else None
                if affine is not None:
                    how = f"{affine.bits}-bit affine group {affine.group}, {affine.scales.dtype} scales, C kernel"
                    return with_kernel_args(PackedWeight(tensor.shape, tensor.qtype, how, affine, rows=affine))
                # Kept in its blocks when memory is short, and with on-load quantization
                # (asked for to save memory; a GGUF weight is never quantized twice).
                if self.quantize in SCHEME_BITS or not self._room_for(tensor):
                    return PackedWeight(tensor.shape, tensor.qtype, f"{tensor.qtype} blocks, dequantized per matmul",
                                        tensor, rows=tensor)
            tensor = tensor.dequantize()
        host = np.asarray(tensor)
        if (self.quantize in SCHEME_BITS and host.dtype.kind == "f" and host.ndim == 2
                and host.shape[1] % 32 == 0 and (is_linear_weight(name, host.shape) or is_embedding(name))):
            packed = quantize_affine(host, self.quantize, name=name)
            how = "C kernel" if _native is not None else "dequantized per matmul"
            weight = PackedWeight(host.shape, self.quantize, f"{self.quantize} group 32, {how}", packed, rows=packed)
            return with_kernel_args(weight) if _native is not None else weight
        weight = self.from_numpy(host)
        self._float_bytes += weight.nbytes
        return weight

    def _room_for(self, tensor: QuantizedTensor) -> bool:
        need = 4 * int(np.prod(tensor.shape))
        if self.float_budget is not None:
            return self._float_bytes + need <= self.float_budget
        available = available_memory()
        return available is None or need <= available - self.HEADROOM

    def quantized_linear(self, x: Array, weight: PackedWeight, bias: Array | None = None) -> Array:
        """Affine weights: the C kernel on the codes for up to
        :attr:`KERNEL_ROWS` rows, the tiled kernel beyond (or slabs dequantized
        for BLAS: :data:`~infer.backends.cpu.kernels.EXACT_GEMM`). Other
        blocks: dequantize (or find in the cache), then the float32 BLAS path."""
        data = weight.data
        if weight.qtype == "MXFP4" and isinstance(data, QuantizedTensor):  # on the blocks (cpu/mxfp4.py)
            y = mxfp4_linear(np.asarray(x, np.float32), data.ggml_blocks()[1], weight.shape[1])
            return y + bias if bias is not None else y
        if _native is not None and ((isinstance(data, AffineTensor) and (data.group == 32 or (
                data.group == 16 and data.bits > 4))) or block_form(data) is not None):
            y = self._affine_linear(np.asarray(x, np.float32), data)
            if bias is not None:
                y += bias
            return y
        hit = self._cache.get(id(weight))
        if hit is not None and hit[0] is weight:
            w = hit[1]
        else:
            w = weight.data.dequantize()
            if self._cached_bytes + w.nbytes <= self.cache_bytes:
                self._cache[id(weight)] = (weight, w)  # the weight kept alive: its id stays its own
                self._cached_bytes += w.nbytes
        return self.linear(x, w, bias)

    def _affine_linear(self, x: np.ndarray, w: AffineTensor | QuantizedTensor) -> np.ndarray:
        n, k = w.shape
        lead = x.shape[:-1]
        x2 = np.ascontiguousarray(x.reshape(-1, k))
        out = np.empty((x2.shape[0], n), np.float32)

        def product(r0: int, r1: int, slab: np.ndarray) -> None:
            np.matmul(x2, slab.T, out=out[:, r0:r1])

        self._after_blas = kernels.affine_product(x2, w, out, self.activations == "q8", self._slab_buffer, product,
                                                  self.KERNEL_ROWS, self.SLAB_BYTES)
        return out.reshape(*lead, n)

    def _slab_buffer(self, values: int) -> np.ndarray:
        """The float32 buffer the BLAS path dequantizes slabs into, kept between products."""
        if self._slab.size < values:
            self._slab = np.empty(values, np.float32)
        return self._slab

    @property
    def max_capture_tokens(self) -> int | None:  # type: ignore[override]
        """A recorded program's products are the C kernels', which take up to
        :attr:`KERNEL_ROWS` rows (more go to BLAS on dequantized slabs, which
        no program step calls): forwards of more tokens run as several
        programs of that many (measured faster than the eager forward:
        docs/performance.md, "Continuous batching")."""
        return self.KERNEL_ROWS

    @property
    def capture_by_default(self) -> bool:  # type: ignore[override]
        """The greedy decode step is recorded as one program of C kernel calls
        unless ``infer.load(..., compile=False)`` (:meth:`compile`): measured
        faster, and its products, norms, rope and attention are the eager ops' own."""
        return records_programs(type(self))

    def compile(self, fn: Any, *, static: bool = False) -> Any:
        """With ``static`` (a captured decode step, :mod:`infer.engine.capture`):
        ``fn`` recorded once per input signature as a program of the C
        kernels' calls, and run as one C call after that
        (:mod:`infer.backends.cpu.plan`). Otherwise ``fn`` itself: numpy
        has no compiler, and shapes that change from call to call would
        record a program per call. A subclass that overrides an op gets
        ``fn`` itself too: a program of numpy's kernels would bypass it."""
        if static and records_programs(type(self)):
            from infer.backends.cpu.plan import PlannedStep

            return PlannedStep(self, fn, kernels=_native, governor=GOVERNOR)
        return fn

    # -- transfer, creation, casting -------------------------------------

    def _np_dtype(self, dtype: str) -> np.dtype:
        if dtype == "bfloat16":
            dtype = "float32"  # numpy has no bfloat16: widened, which is exact
        try:
            return np.dtype(_DTYPES[dtype])
        except KeyError:
            raise UnsupportedOpError(f"numpy backend has no dtype {dtype!r}") from None

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        array = np.asarray(array)
        if dtype is None:
            target = np.dtype(np.float32) if array.dtype.kind == "f" else array.dtype
        else:
            target = self._np_dtype(dtype)
        # Always copy: a view of a memory-mapped file would keep the file open
        # and be read from disk on every use.
        return np.array(array, dtype=target, copy=True, order="C")

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.array(x, copy=True)

    def astype(self, x: Array, dtype: str) -> Array:
        if dtype == "bfloat16":  # a float32 array is not the bfloat16 array the contract asks for
            raise UnsupportedOpError("numpy backend has no bfloat16 arrays to cast to")
        return x.astype(self._np_dtype(dtype), copy=False)

    def shape(self, x: Array) -> tuple[int, ...]:
        return x.shape if type(x) is np.ndarray else tuple(int(d) for d in x.shape)  # ndarray's: Python ints

    def dtype(self, x: Array) -> str:
        try:
            return _NAMES[x.dtype]
        except KeyError:
            raise UnsupportedOpError(f"numpy backend has no name for dtype {x.dtype}") from None

    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        # On a cache line: the KV and state pools come from here (kernels.cache_line_array).
        return kernels.cache_line_array(tuple(shape), self._np_dtype(dtype or self.compute_dtype), zeroed=True)

    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        return np.arange(start, stop, dtype=self._np_dtype(dtype))

    # -- linear algebra -----------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        return np.matmul(a, b)

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        if type(weight) is AdaptedWeight:
            return self.adapted_linear(x, weight, bias)
        if type(weight) is PackedWeight:
            gemv = weight.kernel
            if gemv is not None and bias is None and type(x) is np.ndarray and x.dtype == np.float32:
                # Decoding's products, with what the kernel takes worked out once
                # per weight (with_kernel_args), which cuts the Python around each product
                # (docs/performance.md, "Figures behind the code").
                bits, codes, scales, biases, k, n = gemv[:6]
                m = x.size // k
                if 0 < m <= self.KERNEL_ROWS and x.shape[-1] == k:
                    if GOVERNOR is not None:
                        GOVERNOR.check()
                    self._after_blas = False
                    out = np.empty((m, n), np.float32)
                    if self.activations == "q8":
                        bits |= Q8_FLAG
                    kernels.gemv(bits, np.ascontiguousarray(x), codes, scales, biases, out, m, *gemv[4:])
                    return out if x.ndim == 2 else out.reshape(*x.shape[:-1], n)
            return self.quantized_linear(x, weight, bias)
        if isinstance(weight, PackedWeight):
            return self.quantized_linear(x, weight, bias)
        rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        self._after_blas = True
        if (_native is not None and 0 < rows <= self.KERNEL_ROWS and weight.ndim == 2
                and weight.dtype == np.float32 and weight.flags.c_contiguous):
            self._after_blas = False
            # Few rows (decoding): the C kernel, on the same OpenMP threads as the
            # quantized products. Alternating with BLAS's own thread pool on few
            # cores makes each product wait for the other pool's spinning threads,
            # and BLAS's GEMM path for 2-8 rows is slower than its matrix-vector one.
            x2 = np.ascontiguousarray(x.reshape(rows, -1), np.float32)
            y = np.empty((rows, weight.shape[0]), np.float32)
            kernels.gemv_f32(x2, weight, y, rows, weight.shape[1], weight.shape[0])
            y = y.reshape(*x.shape[:-1], weight.shape[0])
        elif x.ndim == 2 and x.shape[0] == 1:
            # One row (decoding): numpy sends [1, k] @ [k, n] (an F-ordered
            # view) through a GEMM path several times slower than the
            # matrix-vector product on the row-major weight.
            y = (weight @ x[0])[None, :]
        else:
            y = x @ weight.T  # BLAS reads the transposed view without a copy
        if bias is not None:
            y += bias
        return y

    def lora_linear(self, x: Array, weight: Array, bias: Array | None, a: Array, b: Array, slots: Array,
                    scales: Array) -> Array:
        """By segments (Punica's SGMV): the base product once, then per adapter
        slot one pair of small products over its rows, added in place."""
        y = np.require(self.linear(x, weight, bias), np.float32, ["C", "W"])
        sc = np.asarray(scales, np.float32)
        for rows, slot in lora_segments(slots, sc):
            u = self._thin_product(x[rows], a[slot])  # [n, rank]
            u *= sc[rows, None]
            y[rows] += self._thin_product(u, b[slot])
        return y

    def _thin_product(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x @ w.T`` for an adapter's factor: few rows on the C kernel that a
        recorded step's adapter product calls too (backends/cpu/plan.c,
        OP_LORA), so the captured step and the eager one agree bit for bit."""
        rows = x.shape[0]
        if (_native is None or not 0 < rows <= self.KERNEL_ROWS or x.dtype != np.float32
                or w.dtype != np.float32 or not w.flags.c_contiguous):
            return x @ w.T
        out = np.empty((rows, w.shape[0]), np.float32)
        kernels.gemv_f32(np.ascontiguousarray(x), w, out, rows, w.shape[1], w.shape[0])
        return out

    # -- elementwise ---------------------------------------------------------

    def add(self, a: Array, b: Array | float) -> Array:
        return np.add(a, b, dtype=_result_dtype(a, b))

    def sub(self, a: Array, b: Array | float) -> Array:
        return np.subtract(a, b, dtype=_result_dtype(a, b))

    def mul(self, a: Array, b: Array | float) -> Array:
        return np.multiply(a, b, dtype=_result_dtype(a, b))

    def div(self, a: Array, b: Array | float) -> Array:
        dtype = _result_dtype(a, b)
        if dtype is None or np.dtype(dtype).kind != "f":
            dtype = np.float32
        return np.divide(a, b, dtype=dtype)

    def exp(self, x: Array) -> Array:
        return np.exp(x)

    def sqrt(self, x: Array) -> Array:
        with np.errstate(invalid="ignore"):
            return np.sqrt(x)

    def tanh(self, x: Array) -> Array:
        return np.tanh(x)

    def cos(self, x: Array) -> Array:
        return np.cos(x)

    def sin(self, x: Array) -> Array:
        return np.sin(x)

    def silu(self, x: Array) -> Array:
        if _unary_rows(x):  # one pass in vectors on the kernels' threads, as the captured step's (unary.c)
            return _by_rows(x, lambda rows, out: kernels.silu(rows, None, out))
        # x * sigmoid(x) = x / (1 + exp(-x)); exp overflow to inf gives 0, as it should.
        # One buffer, each step in place: the same roundings as the plain
        # expression without its three temporaries (allocating and filling
        # them cost most of the op's time).
        t = np.negative(x)
        with np.errstate(over="ignore"):
            np.exp(t, out=t)
        t += x.dtype.type(1)
        return np.divide(x, t, out=t)

    def gelu(self, x: Array) -> Array:
        return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)

    def gelu_tanh(self, x: Array) -> Array:
        if _unary_rows(x):  # as silu: one pass in vectors, the captured step's (unary.c)
            return _by_rows(x, kernels.gelu_tanh)
        c = np.asarray(math.sqrt(2.0 / math.pi), dtype=x.dtype)
        # x**3 overflows to +-inf for |x| > ~7e12; tanh(+-inf) = +-1 gives x or 0, as it should.
        with np.errstate(over="ignore"):
            return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x * x * x)))

    # -- reductions ----------------------------------------------------------

    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.sum(x, axis=axis, keepdims=keepdims)

    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.mean(x, axis=axis, keepdims=keepdims)

    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return np.max(x, axis=axis, keepdims=keepdims)

    def argmax(self, x: Array, axis: int = -1) -> Array:
        return np.argmax(x, axis=axis)

    # -- the recurrent layers' ops: the C kernels (backends/cpu/recurrent.c), else numpy --------

    def causal_conv1d(self, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                      checkpoint_rows: Array | None = None, *,
                      activation: str | None = None) -> tuple[Array, Array, Array]:
        """The C kernel, its sums in the reference's order; without the
        kernels, the contract's default (:func:`infer.oplib.conv1d_reference`)."""
        qs, rows = check_causal_conv1d(x, window, weight, query_start, checkpoint_rows, activation)
        if not kernels.has_recurrent():
            return super().causal_conv1d(x, window, weight, bias, query_start, checkpoint_rows,
                                         activation=activation)
        return kernels.causal_conv1d(x, window, weight, bias, qs, rows, activation == "silu",
                                     self._recurrent_threads(x.shape[0]))

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                         query_start: Array, checkpoint_rows: Array | None = None, *, scale: float | None = None,
                         l2norm_qk: bool = True) -> tuple[Array, Array, Array]:
        """The C kernel (the recurrence with each state block in L1, the
        chunked form past :data:`~infer.backends.cpu.kernels.GDR_CHUNKED_ROWS`);
        without the kernels, or for key heads wider than they take, the
        contract's default (the reference, row by row)."""
        qs, rows = check_gated_delta_rule(q, k, v, g, beta, state, query_start, checkpoint_rows)
        if not kernels.has_recurrent() or q.shape[-1] > kernels.GDR_MAX_K:
            return super().gated_delta_rule(q, k, v, g, beta, state, query_start, checkpoint_rows, scale=scale,
                                            l2norm_qk=l2norm_qk)
        return kernels.gated_delta_rule(q, k, v, g, beta, state, qs, rows,
                                        q.shape[-1] ** -0.5 if scale is None else scale, l2norm_qk,
                                        parallel=self._recurrent_threads(q.shape[0]))

    def ssd(self, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
            state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
            dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
        """The C kernel (the recurrence, each head's state in L1 a block of
        rows at a time); without the kernels, or for states larger than they
        take, the chunked scan in numpy (backends/cpu/recurrent.py)."""
        qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows)
        if not kernels.has_recurrent() or B.shape[-1] > kernels.SSD_MAX_N:
            return recurrent.ssd(x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows,
                                 dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max)
        return kernels.ssd(x, dt, A, B, C, D, dt_bias, state, qs, rows, dt_softplus, dt_min, dt_max,
                           self._recurrent_threads(x.shape[0]))

    def _recurrent_threads(self, rows: int) -> bool:
        """Whether a recurrent op may use the kernels' threads: for a decode
        step's few rows, and for a prompt's whenever the product before it
        ran on them (tiled or q8), not on BLAS, whose spinning threads they
        would fight for the cores (docs/performance.md, "Recurrent layers in
        C": the reason a prompt's ran on one thread while its products were BLAS's)."""
        return rows <= self.KERNEL_ROWS or not self._after_blas

    def topk(self, x: Array, k: int) -> tuple[Array, Array]:
        order = np.argsort(-x, axis=-1, kind="stable")[..., :k]  # stable: lower index first among ties
        return np.take_along_axis(x, order, axis=-1), order.astype(np.int32)

    def softmax(self, x: Array, axis: int = -1) -> Array:
        with np.errstate(invalid="ignore"):
            e = np.exp(x - np.max(x, axis=axis, keepdims=True))
            return e / np.sum(e, axis=axis, keepdims=True)

    # -- normalisation, position, gather ---------------------------------------

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        if _rowwise(x, weight):  # one C pass instead of five numpy ones (decode is per-op overhead)
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            kernels.rms_norm(x, weight, out, x.size // x.shape[-1], x.shape[-1], eps)
            return out
        x32 = x.astype(np.float32, copy=False)
        scale = 1.0 / np.sqrt(np.mean(np.square(x32), axis=-1, keepdims=True) + np.float32(eps))
        y = (x32 * scale).astype(x.dtype, copy=False)
        return y if weight is None else y * weight

    def fused_add_rms_norm(
        self, x: Array, residual: Array, weight: Array | None, eps: float
    ) -> tuple[Array, Array]:
        if _rowwise(x, weight) and residual.shape == x.shape and residual.dtype == np.float32:
            if not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
            if not residual.flags.c_contiguous:
                residual = np.ascontiguousarray(residual)
            h, out = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
            kernels.rms_norm(x, weight, out, x.size // x.shape[-1], x.shape[-1], eps, residual, h)
            return out, h
        h = x + residual
        return self.rms_norm(h, weight, eps), h

    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        if _rowwise(x, weight) and _rowwise(x, bias) and hasattr(_native, "layer_norm"):  # one C pass, not seven
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            kernels.layer_norm(x, weight, bias, out, x.size // x.shape[-1], x.shape[-1], eps)
            return out
        x32 = x.astype(np.float32, copy=False)
        mu = np.mean(x32, axis=-1, keepdims=True)
        var = np.mean(np.square(x32 - mu), axis=-1, keepdims=True)
        y = ((x32 - mu) / np.sqrt(var + np.float32(eps))).astype(x.dtype, copy=False)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        if (_native is not None and not interleaved and x.ndim == 3 and x.dtype == np.float32
                and cos.dtype == np.float32 and sin.dtype == np.float32 and x.size
                and cos.shape == sin.shape == (x.shape[0], cos.shape[-1])):
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            kernels.rope(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out, *x.shape, cos.shape[-1])
            return out  # bit-identical to the numpy formula below
        half = cos.shape[-1]
        rot = 2 * half
        cos = cos[:, None, :]  # [tokens, 1, rot/2], broadcast over heads
        sin = sin[:, None, :]
        out = np.empty_like(x)
        if interleaved:
            a, b = x[..., 0:rot:2], x[..., 1:rot:2]
            out[..., 0:rot:2] = a * cos - b * sin
            out[..., 1:rot:2] = a * sin + b * cos
        else:
            a, b = x[..., :half], x[..., half:rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:rot] = a * sin + b * cos
        out[..., rot:] = x[..., rot:]
        return out

    def embedding(self, table: Array, ids: Array) -> Array:
        if isinstance(table, PackedWeight):
            return self.packed_rows(table, ids)
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise IndexError(f"token id out of range [0, {table.shape[0]})")
        return table[ids]

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return np.take(x, indices, axis=axis)

    def clip(self, x: Array, lo: float | None, hi: float | None) -> Array:
        return x if lo is None and hi is None else np.clip(x, lo, hi)

    def swiglu(self, gate: Array, up: Array) -> Array:
        if _unary_rows(gate) and _unary_rows(up) and up.shape == gate.shape:
            # gate and up may be the two halves of one fused product's rows: read in place
            out = np.empty(gate.shape, np.float32)
            g, u = _as_rows(gate), _as_rows(up)
            kernels.silu(g, u, out.reshape(g.shape))
            return out
        out = self.silu(gate)
        out *= up
        return out

    # -- shapes ------------------------------------------------------------------

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return x.reshape(shape) if type(x) is np.ndarray else np.reshape(x, tuple(shape))

    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        return np.transpose(x, tuple(axes))

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        return np.concatenate(list(xs), axis=axis)

    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        if axis == -1 or axis == x.ndim - 1:
            return x[..., start:stop]
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return x[tuple(index)]

    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        """In place: ``dst[rows] = src``, the rows checked first; float rows
        into a pool of q8_0 blocks (uint8) quantized first."""
        at = rows_within(rows, dst.shape[0])
        if dst.dtype == np.uint8 and src.dtype.kind == "f":
            src = _quantize_q8_0(src)
        dst[at] = src
        return dst

    # -- attention -----------------------------------------------------------------

    def attention(
        self,
        q: Array,
        k_pool: Array,
        v_pool: Array,
        batch: AttentionBatch,
        *,
        scale: float,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
    ) -> Array:
        """Each sequence by the faster of two exact paths: up to
        :attr:`KERNEL_ROWS` query rows (decoding, verification), or a prompt
        chunk of up to :attr:`KERNEL_ATTENTION_AREA` rows x keys, in one C pass
        per row and head that reads the keys in place through the block
        table; more (a long prompt's chunk) over its visible keys gathered (a
        view when they are consecutive rows) with two batched GEMMs around a
        masked softmax. :func:`reference_attention` is the plain definition both are
        tested against."""
        host = batch.on_host(self)
        if v_pool.dtype == np.uint8:  # q8_0 blocks: 32 float32 values in 34 bytes
            dv, stored = v_pool.shape[-1] // 34 * 32, np.float32
        else:
            dv, stored = v_pool.shape[-1], v_pool.dtype
        out = np.empty((q.shape[0], q.shape[1], dv), np.result_type(q.dtype, stored))
        sink = None if sinks is None else np.ascontiguousarray(sinks, np.float32)
        for b, q0, q1, lo, hi in host.sequences(causal, window):
            n = q1 - q0
            qb = q[q0:q1]
            table = np.asarray(host.block_tables[b])[:-(-hi // host.block_size)]
            spans = span_rows(host, q0, q1, causal)  # bidirectional spans: the masked GEMM path
            if spans is None and self._kernel_attention(qb, k_pool, v_pool, hi, scale, causal, window, softcap, sink,
                                                        table, host.block_size, out[q0:q1]):
                continue
            rows = host.key_rows(b, lo, hi, k_pool.shape[0])
            run = row_run(rows)  # one run of pool rows: a view
            k = k_pool[run[0]:run[1]] if run else np.take(k_pool, rows, axis=0)
            v = v_pool[run[0]:run[1]] if run else np.take(v_pool, rows, axis=0)
            if k.dtype == np.uint8:  # q8_0 blocks: their values, and the queries as the kernel rounds them
                k, v, qb = dequantize_q8_0(k), dequantize_q8_0(v), q8_0_query(qb)
            elif k.dtype != qb.dtype:  # a float16 pool (kv_dtype): its values, widened, into the GEMMs
                k, v = k.astype(qb.dtype), v.astype(qb.dtype)
            with self._blas_beside_kernels() as limited:
                if spans is None:
                    out[q0:q1] = self._dense_attention(qb, k, v, hi - n, lo, scale, causal, window, softcap, sink,
                                                       self._chunk_pool() if limited is not None else None)
                else:
                    out[q0:q1] = _attention_rows(qb, k, v, hi - n, lo, scale, causal, window, softcap, sink, spans)
        return out

    def _blas_beside_kernels(self) -> contextlib.AbstractContextManager[Any]:
        """Where a prompt's products run on the kernels' OpenMP threads, not
        BLAS's (``activations="q8"``, or exact products in the tiled kernel),
        BLAS threads woken by the attention's GEMMs between them spin on the
        cores those products need (a 1B model's 128-token prefill took 2.2x as
        long in q8 mode, docs/quantization.md, "Quantized activations"; the
        tiled kernel lost to BLAS at two threads until this, docs/performance.md,
        "The exact prefill kernel"): so the GEMMs run on one BLAS thread,
        through threadpoolctl, whenever the last product ran on the kernels'
        threads. Otherwise (slabs or float32 weights for BLAS) nothing changes."""
        if self._after_blas or _blas_threads() is None:  # the last product: BLAS's, or the kernels'?
            return contextlib.nullcontext()  # entered as None: the caller then knows BLAS is not limited
        return _blas_threads().limit(limits=1)  # type: ignore[union-attr]

    def _chunk_pool(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """Threads for a long prompt's attention chunks while BLAS runs on one
        thread (:meth:`_blas_beside_kernels`), one per kernel thread; None on one."""
        threads = _native.threads() if _native is not None else 1
        if threads < 2:
            return None
        if self._pool is None or self._pool[0] != os.getpid():  # a forked child has none of the parent's threads
            from concurrent.futures import ThreadPoolExecutor
            self._pool = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="infer-attention"))
        return self._pool[1]

    def _dense_attention(self, q: Array, k: Array, v: Array, first: int, lo: int, scale: float, causal: bool,
                         window: int | None, softcap: float | None, sinks: np.ndarray | None,
                         pool: concurrent.futures.ThreadPoolExecutor | None = None) -> Array:
        """Queries at positions ``first..`` over keys at positions ``lo..``: in
        up to 8 chunks of query rows for a long causal prompt, each over the
        keys it can see, so a causal prefill scores a little over half of the
        square, not all of it (not where most keys are a cached prefix that
        every row sees: there the chunks only add calls). With ``pool`` the
        chunks run on its threads, the longest first: BLAS then runs on one
        thread each (numpy's GEMMs and ufuncs release the GIL), the softmax's
        numpy calls run in parallel too, and no BLAS thread is left spinning
        on the kernels' cores (docs/performance.md, "The exact prefill kernel").
        A chunk of a long prompt after a cached prefix (``Engine.prefill_chunk``)
        goes to the threads as one chunk of rows each."""
        tq, tk = q.shape[0], k.shape[0]
        chunk = max(self.ATTENTION_CHUNK, -(-tq // 8))
        if not (causal and tq > chunk and 2 * tq >= tk):
            if not (causal and pool is not None and tq >= 2 * self.ATTENTION_CHUNK):
                return _attention_rows(q, k, v, first, lo, scale, causal, window, softcap, sinks)
            chunk = -(-tq // _native.threads())  # type: ignore[union-attr]
        out = np.empty((tq, q.shape[1], v.shape[2]), np.result_type(q.dtype, v.dtype))

        def rows(i0: int) -> None:
            i1 = min(tq, i0 + chunk)
            hi = first + i1  # the chunk's last row sits at position hi - 1
            start = lo if window is None else max(lo, first + i0 - window + 1)
            out[i0:i1] = _attention_rows(q[i0:i1], k[start - lo:hi - lo], v[start - lo:hi - lo], first + i0, start,
                                         scale, causal, window, softcap, sinks)

        starts = range(0, tq, chunk)
        if pool is None:
            for i0 in starts:
                rows(i0)
        else:
            for done in [pool.submit(rows, i0) for i0 in reversed(starts)]:
                done.result()
        return out

    def _kernel_attention(self, q: Array, k: Array, v: Array, tk: int, scale: float, causal: bool,
                          window: int | None, softcap: float | None, sinks: np.ndarray | None, table: np.ndarray,
                          block: int, out: Array) -> bool:
        """Attention of up to :attr:`KERNEL_ROWS` query rows (decoding), or of a
        prompt chunk of up to :attr:`KERNEL_ATTENTION_AREA` query rows x keys on
        the kernels' threads, in one C pass per row and head into ``out``,
        instead of two GEMMs, a mask and a softmax of numpy calls, reading the
        pool rows ``k``/``v`` (``[rows, hkv, d]``) through ``table``; False
        where the kernel does not apply."""
        tq, hq, dk = q.shape
        rows_ok = tq <= self.KERNEL_ROWS or (not self._after_blas and tq * tk <= self.KERNEL_ATTENTION_AREA
                                             and hq >= self.KERNEL_ATTENTION_GROUP * k.shape[-2])
        if not (_native is not None and rows_ok and tq <= tk  # tq <= tk: every row sees a key
                and q.dtype == np.float32 and k.dtype == v.dtype and k.dtype in (np.float32, np.float16, np.uint8)
                and k.flags.c_contiguous and v.flags.c_contiguous
                and out.flags.c_contiguous and (softcap is None or softcap > 0) and (window is None or window > 0)):
            return False
        hkv, dv = k.shape[-2], v.shape[-1]
        if k.dtype == np.uint8:  # q8_0 blocks: 34 bytes hold 32 values
            dv = dv // 34 * 32
        kernels.attention(np.ascontiguousarray(q), k, v, out, tq, tk, hq, hkv, dk, dv, scale, causal,
                          window or 0, softcap or 0.0, np.ascontiguousarray(table, np.int64), block,
                          not self._after_blas, sinks)
        return True


def _quantize_q8_0(src: np.ndarray) -> np.ndarray:
    """Float rows as q8_0 blocks (a ``kv_dtype="q8_0"`` pool's write): the C
    kernels' quantizer where built, else :func:`infer.oplib.quantize_q8_0`
    (the same codes and scales)."""
    if _native is None or src.shape[-1] % 32:
        return quantize_q8_0(src)
    x = np.ascontiguousarray(src, np.float32)
    out = np.empty((*x.shape[:-1], x.shape[-1] // 32 * 34), np.uint8)
    kernels.quantize_q8_0(x, out)
    return out


@functools.cache
def _blas_threads() -> Any:
    """threadpoolctl's handle on numpy's BLAS, or None (not installed)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController().select(user_api="blas")


def _attention_rows(q: Array, k: Array, v: Array, first: int, lo: int, scale: float, causal: bool,
                    window: int | None, softcap: float | None, sinks: np.ndarray | None,
                    spans: np.ndarray | None = None) -> Array:
    """Attention of queries at positions ``first..`` over keys at positions
    ``lo..``: two batched GEMMs around a masked softmax, one per kv head,
    without materialising repeated keys for grouped-query attention."""
    tq, hq, dk = q.shape
    tk, hkv, dv = v.shape
    group = hq // hkv
    qg = q.reshape(tq, hkv, group, dk).transpose(1, 2, 0, 3).reshape(hkv, group * tq, dk)
    scores = np.matmul(qg, k.transpose(1, 2, 0)).astype(np.float32, copy=False)  # [hkv, group * tq, tk]
    scores *= np.float32(scale)
    if softcap is not None:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    scores = scores.reshape(hkv, group, tq, tk)
    mask = attention_mask(first, tq, lo, lo + tk, causal, window, spans)
    if mask is not None:
        scores += mask
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.broadcast_to(sinks.reshape(hkv, group, 1, 1), top.shape)
        top = np.maximum(top, sink)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    scores /= total
    out = np.matmul(scores.reshape(hkv, group * tq, tk).astype(v.dtype, copy=False), v.transpose(1, 0, 2))
    return out.reshape(hkv, group, tq, dv).transpose(2, 0, 1, 3).reshape(tq, hq, dv)


def reference_attention(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, batch: AttentionBatch, *,
                        scale: float, causal: bool = True, window: int | None = None, softcap: float | None = None,
                        sinks: np.ndarray | None = None) -> np.ndarray:
    """:meth:`~infer.ops.Backend.attention` as its docstring defines it, one
    query row and head at a time in float64: the plain definition the fast
    paths (the C kernel, the chunked GEMMs, the recorded program) are tested
    against (tests/test_numpy_backend.py)."""
    tokens, hq, _ = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[2]
    out = np.zeros((tokens, hq, dv))
    for b in range(batch.num_seqs):
        q0, q1 = int(batch.query_start[b]), int(batch.query_start[b + 1])
        length = int(batch.seq_lens[b])
        rows = batch.key_rows(b, 0, length)
        for i in range(q1 - q0):
            p = length - (q1 - q0) + i  # the query's position
            for h in range(hq):
                kvh = h // (hq // hkv)
                logits = []
                for j in range(length):
                    if (causal and j > p) or (window is not None and abs(p - j) >= window):
                        continue
                    s = float(np.dot(q[q0 + i, h].astype(np.float64), k_pool[rows[j], kvh])) * scale
                    logits.append((softcap * math.tanh(s / softcap) if softcap is not None else s, j))
                extra = [float(sinks[h])] if sinks is not None else []
                top = max([s for s, _ in logits] + extra)
                weights = [(math.exp(s - top), j) for s, j in logits]
                total = sum(w for w, _ in weights) + sum(math.exp(e - top) for e in extra)
                out[q0 + i, h] = sum(w / total * v_pool[rows[j], kvh].astype(np.float64) for w, j in weights)
    return out.astype(np.float32)


def records_programs(cls: type, base: type | None = None) -> bool:
    """Whether the C extension runs recorded programs and ``cls`` computes
    every op of the contract as ``base`` (default :class:`CpuBackend`)
    does, the ops a program of numpy's kernels stands for."""
    base = CpuBackend if base is None else base
    key = (cls, base)
    if key not in _OWN_OPS:
        _OWN_OPS[key] = all(getattr(cls, n, None) is getattr(base, n, None)
                            for n in (*REQUIRED_OPS, *OPTIONAL_OPS) if n != "compile")
    return hasattr(_native, "run_plan") and _OWN_OPS[key]


_OWN_OPS: dict[tuple[type, type], bool] = {}


def _rowwise(x: Array, weight: Array | None) -> bool:
    """Whether the C row kernels take this float32 input (and its weight over the last axis)."""
    return (_native is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim >= 1
            and x.size > 0 and (weight is None or (type(weight) is np.ndarray and weight.dtype == np.float32
                                                  and weight.shape == x.shape[-1:] and weight.flags.c_contiguous)))


def _unary_rows(x: Array) -> bool:
    """Whether the C SiLU and GELU's tanh form compute on this array (float32: any layout, :func:`_as_rows`
    copies where it must, so the bits do not depend on the layout)."""
    return _native is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim >= 1 and x.size > 0


def _by_rows(x: np.ndarray, fill: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray:
    """A new float32 array of ``x``'s shape, written by ``fill(rows, out)`` on ``x`` as
    ``[rows, last axis]`` (:func:`_as_rows`) and the result viewed the same way."""
    out = np.empty(x.shape, np.float32)
    rows = _as_rows(x)
    fill(rows, out.reshape(rows.shape))
    return out


def _as_rows(x: np.ndarray) -> np.ndarray:
    """``x`` as ``[rows, last axis]``: a view where its rows lie evenly apart, else a copy."""
    rows = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    n, stride = rows.shape[1], rows.strides[0]
    if rows.strides[-1] != 4 or (rows.shape[0] > 1 and (stride < 4 * n or stride % 4)):  # overlapping or reversed
        return np.ascontiguousarray(rows)
    return rows


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``,
    else psutil when installed), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _result_dtype(a: Array, b: Array | float) -> np.dtype | None:
    # Python scalars must not promote float32 arrays to float64.
    if isinstance(b, (int, float)) and isinstance(a, np.ndarray):
        return a.dtype if a.dtype.kind == "f" else None
    return None
