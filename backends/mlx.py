"""The MLX backend: Apple's array framework, on Metal or on the CPU.

Two backend/device pairs are registered:

* ``mlx/gpu`` — Metal on Apple silicon (or CUDA with an ``mlx[cuda]`` build).
* ``mlx/cpu`` — MLX's CPU backend; on Linux this is the ``mlx[cpu]`` build
  (plain ``mlx`` on Linux ships no compute library and does not import).

``mlx.core`` is imported only inside the probes and the factory, so listing
backends stays cheap and a missing or broken MLX is a reason, not an
ImportError.

Three things differ from the numpy reference:

* **Lazy evaluation.** MLX records a graph and computes it when a value is
  needed. Nothing here calls ``mx.eval`` except :meth:`MLXBackend.to_numpy`
  (and :meth:`~MLXBackend.synchronize`), so one engine step — a forward
  followed by ``to_numpy`` of the logits or of their argmax — is evaluated
  exactly once, KV cache writes included (every write is an input of the
  attention that reads it).
* **Functional updates.** MLX arrays are immutable values:
  :meth:`~MLXBackend.scatter_rows` returns a new array built with
  ``mx.put_along_axis`` and leaves ``dst`` unchanged. The KV cache keeps the
  returned array; MLX reuses the old buffer in place when nothing else holds
  it, so a decode step does not copy the cache.
* **Explicit device.** Each backend instance holds the default stream of its
  device and passes it to every op (``stream=``); indexing, which takes no
  stream argument, runs inside ``mx.stream(...)``. The process-wide default
  device is never changed.

``mx.fast`` kernels are used where their semantics are the contract's:

* ``rms_norm`` and ``layer_norm`` (float32 statistics, normalised value cast
  to the input dtype before the weight, as the contract says).
* ``scaled_dot_product_attention`` for grouped-query attention without
  soft-capping. Its ``mask="causal"`` is bottom-right aligned when there are
  fewer queries than keys (checked in tests/test_mlx_backend.py); a sliding
  window becomes a boolean mask. Soft-capping needs the scores before the
  softmax, which the fused kernel does not expose, so it takes an explicit
  float32 path.
* Not ``rope``: ``mx.fast.rope`` derives the angles itself from a start
  offset and a base (or frequency table), while the contract's rope receives
  per-token cos/sin tables (which already carry linear, dynamic-NTK or
  llama3 scaling and need not be consecutive positions). Rope is therefore
  written with elementwise ops, exactly as the contract states it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infer.errors import UnsupportedOpError
from infer.oplib import attention_mask, lora_segments, row_run, span_rows
from infer.ops import AdaptedWeight, Array, AttentionBatch, Backend, PackedWeight, QuantizedTensor
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe, gpu_driver_absent
from infer.quantize import SCHEME_BITS, AffineTensor, from_gguf, is_embedding, is_linear_weight, quantize_affine

from . import mlx_recurrent

#: Contract dtype names handled by this backend (MLX has no float64 on the GPU).
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int32", "int64", "bool", "uint8", "int8", "uint32")

#: Whether mlx/cpu keeps GGUF weights quantized by default. No: on the Linux CPU
#: build ``quantized_matmul`` decoded SmolLM2-135M Q4_1 slower than float32 weights
#: (docs/backends.md, "Quantized weights and speed"); ``quantize="q4"``/``"q8"``
#: keeps them (for memory). On the GPU (Metal) quantized weights are the native
#: way to run, and are kept by default.
KEEP_GGUF_ON_CPU = False
#: Probe scores (numpy/cpu is 10; torch registers cuda 100, mps 90, cpu 8).
#: On Apple silicon MLX on Metal is the native way to run a model, ranked above
#: torch/mps. Under CUDA (mlx[cuda]) torch/cuda is the mature choice, so MLX ranks
#: below it. On the CPU MLX ranks *below* numpy: the Linux ``mlx[cpu]`` wheel
#: bundles a reference (netlib) BLAS (``mlx_cpu.libs/libblas-*.so.3.10.0``), and
#: MLX runs each op of a step from one scheduler thread, so it decodes slower
#: than numpy (docs/backends.md, "Why these scores"). mlx/cpu is usable when
#: asked for, never the default while numpy is there.
SCORE_METAL = 95
SCORE_CUDA = 60
SCORE_CPU = 5


class MLXBackend(Backend):
    """Compute with MLX on one device (``"gpu"`` or ``"cpu"``)."""

    name = "mlx"
    float_dtypes = ("float32", "bfloat16", "float16")
    kv_dtypes = frozenset({"float16", "bfloat16"})  # KV pools stored narrower: attention reads them widened
    native_ops = frozenset({"fused_add_rms_norm", "prepare_weight", "synchronize", "quantized_linear", "compile",
                            "attention", "attention_spans", "clip", "causal_conv1d", "ssd", "gated_delta_rule",
                            "lora_linear"})
    quantize_schemes = frozenset(SCHEME_BITS)

    def __init__(self, dtype: str | None = None, device: str = "cpu") -> None:
        import mlx.core as mx

        if device not in ("cpu", "gpu"):
            raise UnsupportedOpError(f"mlx backend has no device {device!r}; it has cpu and gpu")
        self.device = device
        super().__init__(dtype)
        self._mx = mx
        self._device = mx.Device(mx.cpu if device == "cpu" else mx.gpu)
        #: Every op runs on this stream (the device's default stream).
        self._s = mx.default_stream(self._device)
        self._dtypes = {n: getattr(mx, n if n != "bool" else "bool_") for n in _DTYPE_NAMES}
        self._names = {v: k for k, v in self._dtypes.items()}
        self._floats = frozenset(self._dtypes[n] for n in ("float32", "float16", "bfloat16"))
        self._compute = self._dtypes[self.compute_dtype]

    def _mx_dtype(self, dtype: str) -> Any:
        try:
            return self._dtypes[dtype]
        except KeyError:
            raise UnsupportedOpError(f"mlx backend has no dtype {dtype!r}") from None

    # -- transfer, creation, casting -------------------------------------

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        array = np.asarray(array)
        if dtype is not None:
            target = self._mx_dtype(dtype)
        elif array.dtype.kind == "f":
            target = self._compute
        else:
            target = self._mx_dtype(self._numpy_name(array.dtype))
        # mx.array copies the data (never a view of the caller's buffer), and
        # converts float64/float16 to the target dtype on the way.
        return self._mx.array(array, dtype=target)

    @staticmethod
    def _numpy_name(dtype: np.dtype) -> str:
        name = "bool" if dtype == np.bool_ else dtype.name
        if name not in _DTYPE_NAMES:
            raise UnsupportedOpError(f"mlx backend cannot hold numpy dtype {dtype}")
        return name

    def to_numpy(self, x: Array) -> np.ndarray:
        mx = self._mx
        if x.dtype == mx.bfloat16:  # numpy has no bfloat16: widen (exact)
            x = x.astype(mx.float32, stream=self._s)
        # The one evaluation of an engine step happens here.
        mx.eval(x)
        return np.array(x, copy=True)

    def astype(self, x: Array, dtype: str) -> Array:
        target = self._mx_dtype(dtype)
        return x if x.dtype == target else x.astype(target, stream=self._s)

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(x.shape)

    def dtype(self, x: Array) -> str:
        try:
            return self._names[x.dtype]
        except KeyError:
            raise UnsupportedOpError(f"mlx backend has no name for dtype {x.dtype}") from None

    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        target = self._compute if dtype is None else self._mx_dtype(dtype)
        return self._mx.zeros(tuple(shape), dtype=target, stream=self._s)

    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        return self._mx.arange(start, stop, dtype=self._mx_dtype(dtype), stream=self._s)

    # -- linear algebra -----------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        return self._mx.matmul(a, b, stream=self._s)

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        if isinstance(weight, PackedWeight):
            return self.quantized_linear(x, weight, bias)
        if type(weight) is AdaptedWeight:
            return self.adapted_linear(x, weight, bias)
        mx = self._mx
        # weight.T is a strided view; the GEMM reads it without a copy.
        wt = mx.transpose(weight, stream=self._s)
        if bias is None:
            return mx.matmul(x, wt, stream=self._s)
        if x.dtype == mx.float32:  # (mlx 0.26's CPU addmm is float32-only)
            return mx.addmm(bias, x, wt, stream=self._s)
        return mx.add(mx.matmul(x, wt, stream=self._s), bias, stream=self._s)

    def lora_linear(self, x: Array, weight: Array, bias: Array | None, a: Array, b: Array, slots: Array,
                    scales: Array) -> Array:
        """By segments (Punica's SGMV): the base product, then per adapter
        slot one pair of small products over its rows, scattered in with
        ``.at[].add`` (MLX arrays are immutable). The segments are read on
        the host: slots and scales are inputs, not results, so this
        evaluates nothing pending."""
        mx, s = self._mx, self._s
        y = self.linear(x, weight, bias)
        host_scales = np.asarray(scales.astype(mx.float32))
        for rows, slot in lora_segments(np.asarray(slots), host_scales):
            index = mx.array(np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
            xs = mx.take(x, index, axis=0, stream=s)
            u = mx.matmul(xs, mx.transpose(a[slot], stream=s), stream=s)
            u = mx.multiply(u, mx.take(scales, index, stream=s)[:, None].astype(x.dtype), stream=s)
            y = y.at[index].add(mx.matmul(u, mx.transpose(b[slot], stream=s), stream=s).astype(y.dtype))
        return y

    # -- elementwise ---------------------------------------------------------

    def _same_float(self, a: Array, b: Array | float) -> Array | float:
        # The contract: a float op returns the dtype of its first float input.
        # MLX would promote bfloat16 * float32 to float32, so cast b down.
        if isinstance(b, self._mx.array) and b.dtype != a.dtype and a.dtype in self._floats \
                and b.dtype in self._floats:
            return b.astype(a.dtype, stream=self._s)
        return b

    def add(self, a: Array, b: Array | float) -> Array:
        if isinstance(a, self._mx.array):
            b = self._same_float(a, b)
        return self._mx.add(a, b, stream=self._s)

    def sub(self, a: Array, b: Array | float) -> Array:
        if isinstance(a, self._mx.array):
            b = self._same_float(a, b)
        return self._mx.subtract(a, b, stream=self._s)

    def mul(self, a: Array, b: Array | float) -> Array:
        if isinstance(a, self._mx.array):
            b = self._same_float(a, b)
        return self._mx.multiply(a, b, stream=self._s)

    def div(self, a: Array, b: Array | float) -> Array:
        if isinstance(a, self._mx.array):
            b = self._same_float(a, b)
        return self._mx.divide(a, b, stream=self._s)  # integer / integer gives float32

    def exp(self, x: Array) -> Array:
        return self._mx.exp(x, stream=self._s)

    def sqrt(self, x: Array) -> Array:
        return self._mx.sqrt(x, stream=self._s)

    def tanh(self, x: Array) -> Array:
        return self._mx.tanh(x, stream=self._s)

    def cos(self, x: Array) -> Array:
        return self._mx.cos(x, stream=self._s)

    def sin(self, x: Array) -> Array:
        return self._mx.sin(x, stream=self._s)

    def silu(self, x: Array) -> Array:
        mx, s = self._mx, self._s
        return mx.multiply(x, mx.sigmoid(x, stream=s), stream=s)

    def gelu(self, x: Array) -> Array:
        mx, s = self._mx, self._s
        erf = mx.erf(mx.multiply(x, 1.0 / math.sqrt(2.0), stream=s), stream=s)
        return mx.multiply(mx.multiply(x, 0.5, stream=s), mx.add(erf, 1.0, stream=s), stream=s)

    def gelu_tanh(self, x: Array) -> Array:
        mx, s = self._mx, self._s
        # x**3 overflows to +-inf for huge |x|; tanh(+-inf) = +-1 gives x or 0, as it should.
        cube = mx.multiply(mx.multiply(x, x, stream=s), x, stream=s)
        inner = mx.multiply(mx.add(x, mx.multiply(cube, 0.044715, stream=s), stream=s),
                            math.sqrt(2.0 / math.pi), stream=s)
        return mx.multiply(mx.multiply(x, 0.5, stream=s),
                           mx.add(mx.tanh(inner, stream=s), 1.0, stream=s), stream=s)

    # -- reductions ----------------------------------------------------------

    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return self._mx.sum(x, axis=axis, keepdims=keepdims, stream=self._s)

    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return self._mx.mean(x, axis=axis, keepdims=keepdims, stream=self._s)

    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return self._mx.max(x, axis=axis, keepdims=keepdims, stream=self._s)

    def argmax(self, x: Array, axis: int = -1) -> Array:
        # MLX returns uint32 (first index wins ties, as in numpy); the contract wants int32/int64.
        return self._mx.argmax(x, axis=axis, stream=self._s).astype(self._mx.int32, stream=self._s)

    def softmax(self, x: Array, axis: int = -1) -> Array:
        # precise=True: exponentials and sums in float32 for half-precision inputs.
        return self._mx.softmax(x, axis=axis, precise=True, stream=self._s)

    # -- normalisation, position, gather ---------------------------------------

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        return self._mx.fast.rms_norm(x, weight, eps, stream=self._s)

    def fused_add_rms_norm(
        self, x: Array, residual: Array | None, weight: Array | None, eps: float
    ) -> tuple[Array, Array]:
        mx = self._mx
        h = mx.add(x, residual, stream=self._s)
        return mx.fast.rms_norm(h, weight, eps, stream=self._s), h

    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        return self._mx.fast.layer_norm(x, weight, bias, eps, stream=self._s)

    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        # Elementwise, not mx.fast.rope: see the module docstring.
        mx, s = self._mx, self._s
        tokens, heads, dim = x.shape
        half = cos.shape[-1]
        rot = 2 * half
        cos = mx.expand_dims(cos, 1, stream=s)  # [tokens, 1, rot/2], broadcast over heads
        sin = mx.expand_dims(sin, 1, stream=s)
        with mx.stream(s):
            if interleaved:
                pairs = mx.reshape(x[..., :rot], (tokens, heads, half, 2))
                a, b = pairs[..., 0], pairs[..., 1]
            else:
                a, b = x[..., :half], x[..., half:rot]
            first = a * cos - b * sin
            second = a * sin + b * cos
            if interleaved:
                rotated = mx.reshape(mx.stack([first, second], axis=-1), (tokens, heads, rot))
            else:
                rotated = mx.concatenate([first, second], axis=-1)
            if rot < dim:
                rotated = mx.concatenate([rotated, x[..., rot:]], axis=-1)
            return rotated.astype(x.dtype)

    def embedding(self, table: Array, ids: Array) -> Array:
        # Ids come from the host (from_numpy), so this view costs no evaluation.
        # Inside mx.compile they are a trace that cannot be read: the engine
        # checks ids before they enter a captured step.
        try:
            host = np.asarray(ids)
        except ValueError:
            host = None
        if host is not None and host.size and (host.min() < 0 or host.max() >= table.shape[0]):
            raise IndexError(f"token id out of range [0, {table.shape[0]})")
        if isinstance(table, PackedWeight):
            # Rows of codes, scales and biases, dequantized natively (exact, like the matmul).
            mx, s = self._mx, self._s
            wq, scales, biases, bits = table.data
            rows = mx.dequantize(mx.take(wq, ids, axis=0, stream=s), mx.take(scales, ids, axis=0, stream=s),
                                 mx.take(biases, ids, axis=0, stream=s), group_size=32, bits=bits, stream=s)
            return rows.astype(self._compute, stream=s)
        return self._mx.take(table, ids, axis=0, stream=self._s)

    def clip(self, x: Array, lo: float | None, hi: float | None) -> Array:
        return x if lo is None and hi is None else self._mx.clip(x, lo, hi, stream=self._s)

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return self._mx.take(x, indices, axis=axis, stream=self._s)

    # -- recurrent layers' ops (backends/mlx_recurrent.py) -------------------------

    def causal_conv1d(self, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                      checkpoint_rows: Array | None = None, *,
                      activation: str | None = None) -> tuple[Array, Array, Array]:
        """One gather and one weighted sum over the whole ragged batch."""
        return mlx_recurrent.causal_conv1d(self._mx, self._s, x, window, weight, bias, query_start,
                                           checkpoint_rows, activation)

    def ssd(self, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
            state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
            dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
        """A decode step updates every state at once; longer runs take the chunked scan."""
        return mlx_recurrent.ssd(self._mx, self._s, x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows,
                                 dt_softplus, dt_min, dt_max)

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                         query_start: Array, checkpoint_rows: Array | None = None, *, scale: float | None = None,
                         l2norm_qk: bool = True) -> tuple[Array, Array, Array]:
        """A decode step updates every state at once; longer runs go row by row over all heads."""
        return mlx_recurrent.gated_delta_rule(self._mx, self._s, q, k, v, g, beta, state, query_start,
                                              checkpoint_rows, scale, l2norm_qk)

    # -- shapes ------------------------------------------------------------------

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return self._mx.reshape(x, tuple(shape), stream=self._s)

    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        return self._mx.transpose(x, tuple(axes), stream=self._s)

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        return self._mx.concatenate(list(xs), axis=axis, stream=self._s)

    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        with self._mx.stream(self._s):
            return x[tuple(index)]

    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        """Functional, at rows given as a device array: use the result. MLX
        would drop a row past ``dst``, wrap a negative one and may crash on
        others, so eagerly the rows are checked on the host first (one small
        evaluation); inside ``mx.compile`` they have no values to check."""
        mx, s = self._mx, self._s
        try:
            host = np.asarray(rows).reshape(-1)
        except (RuntimeError, ValueError):  # a placeholder being traced by mx.compile
            host = None
        if host is not None and host.size and (host.min() < 0 or host.max() >= dst.shape[0]):
            bad = int(host.min() if host.min() < 0 else host.max())
            raise IndexError(f"scatter_rows: row {bad} is outside the {dst.shape[0]} rows of dst")
        with mx.stream(s):
            if src.dtype != dst.dtype:
                src = src.astype(dst.dtype)
            index = mx.reshape(rows, (-1,) + (1,) * (dst.ndim - 1)).astype(mx.int32)
            return mx.put_along_axis(dst, mx.broadcast_to(index, src.shape), src, axis=0)

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
        """Eagerly, one sequence at a time over its visible keys (a slice of
        the pool where they are consecutive rows, as a contiguous cache's
        are, else taken row by row), through ``mx.fast``'s attention; in a
        captured step (no host copy of the description), every sequence's
        table of blocks is taken and one masked attention made on the device
        serves every token (:meth:`_static_attention`): one graph for every step."""
        if batch.host is None and not isinstance(batch.query_start, np.ndarray):
            return self._static_attention(q, k_pool, v_pool, batch, scale, causal, window, softcap, sinks)
        mx, s = self._mx, self._s
        host = batch.on_host(self)
        outputs = []
        for b, q0, q1, lo, hi in host.sequences(causal, window):
            n = q1 - q0
            spans = span_rows(host, q0, q1, causal)  # bidirectional spans: an explicit mask
            rows = host.key_rows(b, lo, hi, k_pool.shape[0])
            run = row_run(rows)
            if run:  # one run of pool rows: a view
                k, v = (self.slice(a, 0, *run) for a in (k_pool, v_pool))
            else:
                index = mx.array(rows)
                k, v = (mx.take(a, index, axis=0, stream=s) for a in (k_pool, v_pool))
            if k.dtype != q.dtype:  # a pool stored narrower (kv_dtype): its values, widened
                k, v = k.astype(q.dtype, stream=s), v.astype(q.dtype, stream=s)
            outputs.append(self._dense(self.slice(q, 0, q0, q1), k, v, hi - n, lo, scale, causal, window, softcap,
                                       sinks, spans))
        return outputs[0] if len(outputs) == 1 else self.concat(outputs, 0)

    def _dense(self, q: Array, k: Array, v: Array, first: int, lo: int, scale: float, causal: bool,
               window: int | None, softcap: float | None, sinks: Array | None,
               spans: np.ndarray | None = None) -> Array:
        """Queries at positions ``first..`` over keys at positions ``lo..``
        (``spans``: the rows' bidirectional spans, or None)."""
        mx, s = self._mx, self._s
        tq, hq, _ = q.shape
        tk, hkv, dv = v.shape
        mask: Any = None
        if spans is None and window is None and causal and tq > 1 and first + tq == lo + tk:
            mask = "causal"  # bottom-right aligned: the last query sees every key
        else:
            host = attention_mask(first - lo, tq, 0, tk, causal, window, None if spans is None else spans - lo)
            mask = None if host is None else mx.array(host == 0)
        if softcap is not None or sinks is not None:
            return self._softcap_attention(q, k, v, scale, softcap, mask, sinks)
        # [1, heads, tokens, dim]; grouped-query heads are not tiled (the kernel maps them).
        qt, kt, vt = (mx.expand_dims(mx.transpose(a, (1, 0, 2), stream=s), 0, stream=s) for a in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(qt, kt, vt, scale=scale, mask=mask, stream=s)
        return mx.transpose(mx.reshape(out, (hq, tq, dv), stream=s), (1, 0, 2), stream=s)

    def _static_attention(self, q: Array, k_pool: Array, v_pool: Array, batch: AttentionBatch, scale: float,
                          causal: bool, window: int | None, softcap: float | None, sinks: Array | None) -> Array:
        """Attention with the description as device data only: each token's
        query against its sequence's whole table of blocks, the visible keys
        a mask made on the device."""
        mx, s = self._mx, self._s
        tokens, hq, dk = q.shape
        seqs, width = batch.block_tables.shape
        bs = batch.block_size
        with mx.stream(s):
            starts = mx.reshape(batch.query_start, (-1,)).astype(mx.int32)
            lengths = mx.reshape(batch.seq_lens, (-1,)).astype(mx.int32)
            table = mx.reshape(batch.block_tables, (-1,)).astype(mx.int32)
            rows = mx.reshape(mx.expand_dims(table, 1) * bs + mx.arange(bs, dtype=mx.int32), (seqs, width * bs))
            t = mx.arange(tokens, dtype=mx.int32)
            seq = mx.minimum(mx.sum(mx.expand_dims(t, 1) >= mx.expand_dims(starts[1:], 0), axis=1), seqs - 1)
            first = mx.take(starts, seq)
            pos = mx.take(lengths, seq) - (mx.take(starts, seq + 1) - first) + (t - first)  # each token's position
            j = mx.expand_dims(mx.arange(width * bs, dtype=mx.int32), 0)
            mask = j < mx.expand_dims(mx.take(lengths, seq), 1)
            if causal:
                seen = j <= mx.expand_dims(pos, 1)
                if batch.spans is not None:  # a bidirectional span's keys ahead too
                    span = mx.reshape(batch.spans, (-1, 2)).astype(mx.int32)
                    seen = mx.logical_or(seen, mx.logical_and(j >= span[:, :1], j < span[:, 1:]))
                mask = mx.logical_and(mask, seen)
            if window is not None:
                ahead = mx.expand_dims(pos, 1) - j
                mask = mx.logical_and(mask, (ahead < window) if causal else (mx.abs(ahead) < window))
            index = mx.reshape(mx.take(rows, seq, axis=0), (-1,))
            k = mx.reshape(mx.take(k_pool, index, axis=0), (tokens, width * bs) + tuple(k_pool.shape[1:]))
            v = mx.reshape(mx.take(v_pool, index, axis=0), (tokens, width * bs) + tuple(v_pool.shape[1:]))
            if k.dtype != q.dtype:  # a pool stored narrower (kv_dtype): its values, widened
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            if softcap is not None or sinks is not None:
                return mx.concatenate([self._softcap_attention(q[i:i + 1], k[i], v[i], scale, softcap, mask[i:i + 1],
                                                               sinks) for i in range(tokens)], axis=0)
            out = mx.fast.scaled_dot_product_attention(mx.expand_dims(q, 2), mx.transpose(k, (0, 2, 1, 3)),
                                                       mx.transpose(v, (0, 2, 1, 3)), scale=scale,
                                                       mask=mx.expand_dims(mx.expand_dims(mask, 1), 1))
            return out[:, :, 0, :]  # [tokens, hq, dv]

    def _softcap_attention(self, q: Array, k: Array, v: Array, scale: float, cap: float | None, mask: Any,
                           sinks: Array | None = None) -> Array:
        # The fused kernel cannot cap scores before its softmax, nor add the
        # sinks to it: compute them in float32, cap, mask, softmax (Gemma 2's
        # order, as the contract says), the sinks' logits in its denominator.
        mx, s = self._mx, self._s
        tq, hq, dk = q.shape
        tk, hkv, dv = v.shape
        group = hq // hkv
        f32 = mx.float32
        with mx.stream(s):
            # [hkv, group*tq, dk] @ [hkv, dk, tk]: query head h reads kv head h // group.
            qg = q.astype(f32).reshape(tq, hkv, group, dk).transpose(1, 2, 0, 3).reshape(hkv, group * tq, dk)
            scores = (qg @ k.astype(f32).transpose(1, 2, 0)) * scale
            if cap is not None:
                scores = mx.tanh(scores / cap) * cap
            if isinstance(mask, str):  # "causal": build it explicitly
                dist = mx.expand_dims(mx.arange(tk - tq, tk), 1) - mx.arange(tk)
                mask = dist >= 0
            scores = scores.reshape(hkv, group, tq, tk)
            if mask is not None:
                scores = mx.where(mask, scores, -math.inf)
            if sinks is not None:
                sink = mx.broadcast_to(mx.reshape(sinks.astype(f32), (hkv, group, 1, 1)), (hkv, group, tq, 1))
                probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :tk]
            else:
                probs = mx.softmax(scores, axis=-1)
            probs = probs.reshape(hkv, group * tq, tk).astype(v.dtype)
            out = probs @ v.transpose(1, 0, 2)  # [hkv, group*tq, dv]
            return out.reshape(hkv, group, tq, dv).transpose(2, 0, 1, 3).reshape(tq, hq, dv)

    # -- optional ops ----------------------------------------------------------------

    def prepare_weight(self, tensor: np.ndarray | QuantizedTensor, *, name: str = "") -> Array:
        """Copy a weight to the device once, evaluated (not left as a lazy graph).

        On the CPU, float32 matrices are stored transposed (``[in, out]``
        row-major) and handed out as the transposed view, still shaped
        ``[out, in]``: :meth:`linear` then gives MLX's CPU GEMM a
        row-major right-hand side, which the Linux build's BLAS multiplies
        about twice as fast as a transposed one when decoding. The view is an
        ordinary array to every other op (``embedding`` included).
        """
        mx = self._mx
        if isinstance(tensor, QuantizedTensor):
            packed = self._pack_gguf(tensor) if self.keeps_gguf() else None
            if packed is not None:
                return packed
            tensor = tensor.dequantize()
            requantize = False  # a GGUF weight is never quantized a second time
        else:
            requantize = self.quantize in SCHEME_BITS
        host = np.asarray(tensor)
        if (requantize and host.dtype.kind == "f" and host.ndim == 2 and host.shape[1] % 32 == 0
                and (is_linear_weight(name, host.shape) or is_embedding(name))):
            # infer's min/max quantizer rather than mx.quantize: same layout, and at
            # 4 bits it agrees with float32 more often (docs/quantization.md, "Accuracy").
            return self._pack_affine(quantize_affine(host, self.quantize, name=name))
        if self.device == "cpu" and host.ndim == 2 and host.dtype.kind == "f" and self._compute == mx.float32:
            weight = mx.transpose(mx.array(np.ascontiguousarray(host.T), dtype=mx.float32), stream=self._s)
        else:
            weight = self.from_numpy(host)
        mx.eval(weight)
        return weight

    def compile(self, fn: Callable[..., Any], *, static: bool = False) -> Callable[..., Any]:
        """``mx.compile``: the graph of ``fn`` traced once per input shape and
        dtype, with elementwise chains fused into single kernels.

        ``mx.compile`` takes trees of arrays and constants only, so a
        :class:`~infer.ops.PackedWeight` argument travels as a dict of its
        arrays and layout constants and is rebuilt inside the trace (without
        its host ``rows``, which only ``embedding`` reads). Always shape-specialized
        (``static`` changes nothing)."""
        graphs = [0]

        def traced(*args: Any) -> Any:
            graphs[0] += 1  # the body runs only while mx.compile traces it
            return fn(*_unpack_tree(args))

        compiled = self._mx.compile(traced)

        def call(*args: Any) -> Any:
            return compiled(*_pack_tree(args))

        call.__wrapped__ = compiled  # type: ignore[attr-defined]
        call.graphs = lambda: graphs[0]  # type: ignore[attr-defined]
        return call

    def keeps_gguf(self) -> bool:
        """Whether GGUF weights of the types with an exact affine form stay
        quantized (unless ``quantize="off"``)."""
        return self.quantize != "off" and (self.device == "gpu" or self.quantize in SCHEME_BITS
                                            or KEEP_GGUF_ON_CPU)

    def _pack_gguf(self, tensor: QuantizedTensor) -> PackedWeight | None:
        """GGUF Q4_0/Q4_1/Q4_K (4 bits), Q5_0/Q5_1/Q5_K (5 bits) and Q8_0
        (8 bits) as MLX affine groups of 32 with float32 scales and biases:
        ``mx.dequantize`` and ``quantized_matmul`` compute ``scale * code +
        bias``, which is the GGUF value bit for bit (tested). None for other
        types."""
        affine = from_gguf(tensor)
        return None if affine is None else self._pack_affine(affine)

    def _pack_affine(self, affine: AffineTensor) -> PackedWeight:
        mx = self._mx
        wq = mx.array(pack_codes(affine.codes(), affine.bits))
        scales, biases = mx.array(affine.scales), mx.array(affine.biases)
        mx.eval(wq, scales, biases)
        return PackedWeight(affine.shape, affine.qtype, f"mlx affine {affine.bits}-bit g32 float32",
                            (wq, scales, biases, affine.bits))

    def quantized_linear(self, x: Array, weight: PackedWeight, bias: Array | None = None) -> Array:
        """``mx.quantized_matmul``; the result is cast to ``x``'s dtype (float32
        scales with bfloat16 activations give float32)."""
        mx, s = self._mx, self._s
        wq, scales, biases, bits = weight.data
        y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=bits, stream=s)
        if y.dtype != x.dtype:
            y = y.astype(x.dtype, stream=s)
        return y if bias is None else mx.add(y, bias, stream=s)

    def synchronize(self) -> None:
        """Wait for every op queued on this backend's stream."""
        self._mx.synchronize(self._s)


def _pack_tree(tree: Any) -> Any:
    """``tree`` with every PackedWeight as a dict ``mx.compile`` accepts."""
    if isinstance(tree, PackedWeight):
        *arrays, bits = tree.data
        return {"__packed_weight__": True, "arrays": tuple(arrays), "bits": bits, "shape": tree.shape,
                "qtype": tree.qtype, "scheme": tree.scheme}
    if isinstance(tree, dict):
        return {k: _pack_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_pack_tree(v) for v in tree)
    return tree


def _unpack_tree(tree: Any) -> Any:
    """The inverse of :func:`_pack_tree`, inside the trace."""
    if isinstance(tree, dict):
        if tree.get("__packed_weight__"):
            return PackedWeight(tuple(tree["shape"]), tree["qtype"], tree["scheme"], (*tree["arrays"], tree["bits"]))
        return {k: _unpack_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unpack_tree(v) for v in tree)
    return tree


# ----------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``[rows, cols]`` -> MLX's packed uint32 ``[rows, cols * bits / 32]``:
    a little-endian bit stream per row, code ``i`` at bit ``bits * i`` (the
    layout ``mx.quantize`` writes, for 4, 5 and 8 bits alike)."""
    rows, cols = codes.shape
    eight = codes.reshape(rows, cols // 8, 8).astype(np.uint64)
    word = np.zeros((rows, cols // 8), np.uint64)
    for j in range(8):
        word |= eight[:, :, j] << np.uint64(bits * j)
    packed = word.astype("<u8").view(np.uint8).reshape(rows, cols // 8, 8)[:, :, :bits]  # 8 codes fill `bits` bytes
    return np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)


def _import_mlx() -> tuple[Any, str | None]:
    """``(mlx.core, None)``, or ``(None, reason)`` when it cannot be used."""
    if importlib.util.find_spec("mlx") is None:
        return None, "mlx is not installed (pip install 'infer-engine[mlx]')"
    try:
        import mlx.core as mx
    except Exception as exc:  # e.g. plain `mlx` on Linux: no libmlx.so
        hint = " (on Linux install 'mlx[cpu]' or 'mlx[cuda]'; plain 'mlx' has no compute library)" \
            if sys.platform.startswith("linux") else ""
        return None, f"mlx is installed but mlx.core does not import: {type(exc).__name__}: {exc}{hint}"
    return mx, None


def _native() -> tuple[str, ...]:
    return tuple(sorted(MLXBackend.native_ops))


def _probe_gpu() -> Probe:
    if sys.platform.startswith("linux") and importlib.util.find_spec("mlx") is not None:
        absent = gpu_driver_absent()  # Metal is macOS only: on Linux the GPU is CUDA's
        if absent is not None:
            return Probe(0, f"Metal is not available (Linux), and {absent}")
    mx, reason = _import_mlx()
    if mx is None:
        return Probe(0, reason)
    try:
        if mx.metal.is_available():
            return Probe(SCORE_METAL, None, _native())
    except Exception:  # a broken Metal query means no Metal
        pass
    try:
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return Probe(SCORE_CUDA, None, _native())
    except Exception:
        pass
    build = " (Linux CPU build)" if sys.platform.startswith("linux") else ""
    return Probe(0, f"Metal is not available{build}, and this mlx has no CUDA device")


def _probe_cpu() -> Probe:
    mx, reason = _import_mlx()
    if mx is None:
        return Probe(0, reason)
    return Probe(SCORE_CPU, None, _native())


def _version() -> str:
    from infer.plugins.registry import distribution_version  # (not importlib.metadata: ~15 ms to import)

    version = distribution_version("mlx")
    return f"mlx {version} " if version else "mlx "


@hookimpl
def infer_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    """Register MLX on the GPU (Metal, or CUDA) and on the CPU."""
    register(BackendSpec(
        name="mlx", device="gpu",
        factory=lambda dtype: MLXBackend(dtype, device="gpu"),
        probe=_probe_gpu,
        score_ceiling=max(SCORE_METAL, SCORE_CUDA),
        description=f"{_version()}on the GPU (Metal on Apple silicon; CUDA with mlx[cuda]); "
                    "float32, bfloat16, float16",
    ))
    register(BackendSpec(
        name="mlx", device="cpu",
        factory=lambda dtype: MLXBackend(dtype, device="cpu"),
        probe=_probe_cpu,
        score_ceiling=SCORE_CPU,
        description=f"{_version()}on the CPU; float32, bfloat16, float16",
    ))
