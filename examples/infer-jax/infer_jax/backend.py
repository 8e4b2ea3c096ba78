"""The JAX backend: infer's op contract on ``jax.numpy``, ``jax.nn`` and ``jax.lax``.

Arrays are ``jax.Array`` committed to the backend's device. Four things
differ from infer's numpy reference:

* **Compiled kernels.** Norms, rope, swiglu, soft-capping, softmax, linear
  and attention are ``jax.jit`` functions (:mod:`infer_jax.kernels`); XLA
  fuses each into one pass. The remaining ops are single ``jax.numpy`` calls,
  which JAX compiles and caches per shape on first use.
* **Shapes that stay put.** JAX compiles once per input shape. Attention
  gathers each sequence's keys from the pool padded to a bucket length and
  masks by the true length (traced), so decoding does not compile a new
  attention program for every token.
* **Functional cache writes.** :meth:`JaxBackend.scatter_rows` returns a new
  array, as the contract allows for functional frameworks; it donates
  ``dst``'s buffer, so the write happens in place and the old ``dst`` is
  deleted.
* **64-bit integers without a global switch.** JAX truncates int64 to int32
  unless the ``jax_enable_x64`` flag is on. Flipping it process-wide would
  change every other JAX program in the process (``jnp.zeros(3)`` would
  become float64), so each op runs inside the thread-local
  ``jax.enable_x64(True)`` context instead (about 1 µs per op). Floats are
  never float64 here: every float result has a contract dtype.

Compute dtypes: float32 (default on the CPU) and bfloat16, which XLA runs
natively on the CPU (default on a GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from infer.errors import UnsupportedOpError
from infer.ops import OPTIONAL_OPS, REQUIRED_OPS, AdaptedWeight, Array, AttentionBatch, Backend

from infer_jax import NATIVE_OPS, kernels

#: Contract dtype names and the JAX (numpy) dtypes that hold them.
DTYPES: dict[str, Any] = {
    "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
    "int32": jnp.int32, "int64": jnp.int64, "int8": jnp.int8, "uint8": jnp.uint8, "bool": jnp.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def _in_x64(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with jax.enable_x64(True):
            return method(*args, **kwargs)

    return wrapper


def _ops_in_x64(cls: type) -> type:
    """Run every op of the contract that ``cls`` defines inside ``enable_x64``."""
    for op in REQUIRED_OPS + OPTIONAL_OPS:
        if op in vars(cls):
            setattr(cls, op, _in_x64(vars(cls)[op]))
    return cls


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def _like(a: Array, b: Any) -> Any:
    """``b`` in ``a``'s dtype when both are float arrays: the contract's float
    ops return their first float input's dtype (JAX would promote)."""
    if _is_float(a) and _is_float(b) and b.dtype != a.dtype:
        return b.astype(a.dtype)
    return b


def _no_float64(x: Array) -> Array:
    # Inside enable_x64 an integer array combined with a Python float gives
    # float64, which is no contract dtype.
    return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def key_bucket(length: int) -> int:
    """The key-axis length attention is compiled for: a power of two from 16
    up to 1024, then a multiple of 1024, so at most ~2x (short) or ~1.1x
    (long contexts) of padded keys, and a handful of compiled programs."""
    if length > 1024:
        return -(-length // 1024) * 1024
    return max(16, 1 << (length - 1).bit_length())


@_ops_in_x64
class JaxBackend(Backend):
    """JAX on one device (``"cpu"`` or ``"gpu"``)."""

    name = "jax"
    float_dtypes = ("float32", "bfloat16")
    native_ops = frozenset(NATIVE_OPS)
    # KV pools it takes besides the compute dtype (infer.load(kv_dtype=...)): the
    # attention kernel widens their keys and values to the scores' dtype, and
    # scatter_rows rounds what it writes to the pool's.
    kv_dtypes = frozenset({"float16"})

    def __init__(self, device: str = "cpu", dtype: str | None = None) -> None:
        if device not in ("cpu", "gpu"):
            raise UnsupportedOpError(f"jax backend has no device {device!r}; it has cpu and gpu")
        self.device = device
        if device == "gpu":
            self.float_dtypes = ("bfloat16", "float32")  # decoding is bound by the bytes of weights read
        super().__init__(dtype)
        #: The one JAX device every array of this backend lives on.
        self.jax_device = jax.devices(device)[0]

    def _jax_dtype(self, dtype: str) -> Any:
        try:
            return DTYPES[dtype]
        except KeyError:
            raise UnsupportedOpError(f"jax backend has no dtype {dtype!r}") from None

    # -- transfer, creation, casting -------------------------------------

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        """Copies and casts on the host (numpy and ml_dtypes round to nearest
        even, as XLA does), then hands the private copy to the device.

        The host copy is needed: on the CPU ``jax.device_put`` may keep using
        the numpy buffer it was given, even with ``may_alias=False`` (jax
        0.10.2; the conformance kit's from_numpy case caught it). It is also
        cheaper than ``jnp.array(..., copy=True)``, which compiles a convert
        and an identity program for every new shape (a fifth of the kit's run
        time). JAX may alias the private copy: nothing else holds it.
        """
        array = np.asarray(array)
        if dtype is not None:
            target = np.dtype(self._jax_dtype(dtype))
        elif array.dtype.kind == "f":
            target = np.dtype(DTYPES[self.compute_dtype])
        elif array.dtype in _NAMES:
            target = array.dtype
        else:
            raise UnsupportedOpError(f"jax backend cannot hold numpy dtype {array.dtype}")
        return jax.device_put(np.array(array, dtype=target, copy=True, order="C"), self.jax_device)

    def to_numpy(self, x: Array) -> np.ndarray:
        """A new, writable numpy array; bfloat16 becomes float32 (exact),
        widened on the host so that no convert program is compiled."""
        if x.dtype == jnp.bfloat16:
            return np.asarray(x).astype(np.float32)
        return np.array(x, copy=True)

    def astype(self, x: Array, dtype: str) -> Array:
        """Float to int truncates toward zero (XLA's convert)."""
        return x.astype(self._jax_dtype(dtype))

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(int(d) for d in x.shape)

    def dtype(self, x: Array) -> str:
        try:
            return _NAMES[np.dtype(x.dtype)]
        except KeyError:
            raise UnsupportedOpError(f"jax backend has no name for dtype {x.dtype}") from None

    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        return jnp.zeros(tuple(shape), self._jax_dtype(dtype or self.compute_dtype), device=self.jax_device)

    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        return jnp.arange(start, stop, dtype=self._jax_dtype(dtype), device=self.jax_device)

    # -- linear algebra -----------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        return kernels.matmul(a, b)

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        if type(weight) is AdaptedWeight:  # LoRA adapters beside the weight: the contract's lora_linear
            return self.adapted_linear(x, weight, bias)
        return kernels.linear(x, weight, bias)

    # -- elementwise ---------------------------------------------------------

    def add(self, a: Array, b: Array | float) -> Array:
        return _no_float64(jnp.add(a, _like(a, b)))

    def sub(self, a: Array, b: Array | float) -> Array:
        return _no_float64(jnp.subtract(a, _like(a, b)))

    def mul(self, a: Array, b: Array | float) -> Array:
        return _no_float64(jnp.multiply(a, _like(a, b)))

    def div(self, a: Array, b: Array | float) -> Array:
        """True division; integer operands give float32, as in the numpy backend."""
        return _no_float64(jnp.true_divide(a, _like(a, b)))

    def exp(self, x: Array) -> Array:
        return jnp.exp(x)

    def sqrt(self, x: Array) -> Array:
        return jnp.sqrt(x)

    def tanh(self, x: Array) -> Array:
        return jnp.tanh(x)

    def cos(self, x: Array) -> Array:
        return jnp.cos(x)

    def sin(self, x: Array) -> Array:
        return jnp.sin(x)

    def silu(self, x: Array) -> Array:
        return jax.nn.silu(x)

    def gelu(self, x: Array) -> Array:
        return jax.nn.gelu(x, approximate=False)

    def gelu_tanh(self, x: Array) -> Array:
        return jax.nn.gelu(x, approximate=True)

    # -- reductions ----------------------------------------------------------

    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return jnp.sum(x, axis=axis, keepdims=keepdims)

    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return jnp.mean(x, axis=axis, keepdims=keepdims)

    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return jnp.max(x, axis=axis, keepdims=keepdims)

    def argmax(self, x: Array, axis: int = -1) -> Array:
        """int64 (inside ``enable_x64``); the first maximal index wins."""
        return jnp.argmax(x, axis=axis)

    def softmax(self, x: Array, axis: int = -1) -> Array:
        return kernels.softmax(x, axis=axis)

    # -- normalisation, position, gather ---------------------------------------

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        return kernels.rms_norm(x, weight, eps)

    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        return kernels.layer_norm(x, weight, bias, eps)

    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        return kernels.rope(x, cos, sin, interleaved=bool(interleaved))

    def embedding(self, table: Array, ids: Array) -> Array:
        """Checks the range on the host first: JAX never raises for an
        out-of-range index (a gather clamps or fills)."""
        host = np.asarray(ids)
        if host.size and (host.min() < 0 or host.max() >= table.shape[0]):
            bad = int(host.min()) if host.min() < 0 else int(host.max())
            raise IndexError(f"token id out of range [0, {table.shape[0]}): found {bad}")
        return jnp.take(table, ids, axis=0)

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return jnp.take(x, indices, axis=axis)

    # -- shapes ------------------------------------------------------------------

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return jnp.reshape(x, tuple(shape))

    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        return jnp.transpose(x, tuple(axes))

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        return jnp.concatenate(list(xs), axis=axis)

    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        axis %= x.ndim
        begin, end, _ = slice(start, stop).indices(x.shape[axis])  # Python's clamping rules
        return kernels.slice_axis(x, jnp.int32(begin), size=max(0, end - begin), axis=axis)

    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        """Functional, in place: returns the updated array and deletes ``dst``
        (its buffer is donated to the result). JAX would drop rows outside
        ``dst`` silently: they are checked first."""
        host = np.asarray(rows).reshape(-1)
        if host.size and (host.min() < 0 or host.max() >= dst.shape[0]):
            bad = host.min() if host.min() < 0 else host.max()
            raise IndexError(f"scatter_rows: row {int(bad)} is outside the {dst.shape[0]} rows of dst")
        return kernels.scatter_rows(dst, jnp.asarray(host, jnp.int32), src)

    # -- optional ops ---------------------------------------------------------------

    def fused_add_rms_norm(
        self, x: Array, residual: Array, weight: Array | None, eps: float
    ) -> tuple[Array, Array]:
        return kernels.fused_add_rms_norm(x, residual, weight, eps)

    def swiglu(self, gate: Array, up: Array) -> Array:
        return kernels.swiglu(gate, up)

    def softcap(self, x: Array, cap: float) -> Array:
        return kernels.softcap(x, cap)

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
        """Per sequence, one compiled kernel: its keys gathered from the pool,
        grouped-query scores in float32, soft-cap, mask, sinks, softmax,
        weighted sum.

        JAX compiles per input shape, and while decoding the key length grows
        by one each step. Each sequence's keys are therefore gathered padded to
        a bucket length (:func:`key_bucket`) and the kernel masks the padding
        with the true length, which it takes traced: one attention program
        serves every length in a bucket (measured on the kit's tiny llama:
        32 decode steps compiled 32 attention programs, 8.6 s on 2 cores,
        without buckets; 3 with them).
        """
        host = batch.on_host(self)
        outputs = []
        for b, q0, q1, _, length in host.sequences(causal, window):  # length: every key of the sequence
            rows = host.key_rows(b, 0, length, k_pool.shape[0])
            rows = jnp.asarray(np.pad(rows, (0, key_bucket(length) - length)))  # padding reads row 0, masked
            outputs.append(kernels.attention(q[q0:q1], k_pool, v_pool, rows, length, scale, bool(causal), window,
                                             softcap, sinks))
        return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=0)
