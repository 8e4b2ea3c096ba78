"""KV caches owned by the engine.

Architectures never see these: they call
:meth:`infer.attention.AttentionContext.attention` with a layer's new keys
and values, and the engine's cache decides where they go.

:class:`ContiguousKVCache` holds one sequence's keys and values per layer in
arrays preallocated to the sequence's capacity, so decoding allocates
nothing per step. Each layer's arrays are created at its first write, from
the shapes written, so layers with different key and value widths (e.g.
multi-head latent attention) need no special case.
"""

from __future__ import annotations

from infer.errors import CacheFullError
from infer.ops import Array, Backend


class ContiguousKVCache:
    """One sequence's keys and values, ``[capacity, kv_heads, head_dim]`` per layer."""

    def __init__(self, backend: Backend, num_layers: int, capacity: int) -> None:
        self.backend = backend
        self.num_layers = num_layers
        self.capacity = capacity
        #: Number of positions written and valid.
        self.length = 0
        self._keys: list[Array | None] = [None] * num_layers
        self._values: list[Array | None] = [None] * num_layers

    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        """Store ``k``, ``v`` (``[n, kv_heads, dim]``) at positions ``start..start+n``."""
        ops = self.backend
        n = ops.shape(k)[0]
        if start + n > self.capacity:
            raise CacheFullError(
                f"KV cache holds {self.capacity} positions; writing {n} at position {start} "
                f"needs {start + n}"
            )
        if self._keys[layer] is None:
            self._keys[layer] = ops.zeros((self.capacity,) + ops.shape(k)[1:], ops.dtype(k))
            self._values[layer] = ops.zeros((self.capacity,) + ops.shape(v)[1:], ops.dtype(v))
        self._keys[layer] = ops.update_rows(self._keys[layer], start, k)
        self._values[layer] = ops.update_rows(self._values[layer], start, v)

    def read(self, layer: int, start: int, stop: int) -> tuple[Array, Array]:
        """Keys and values of positions ``start..stop`` (views where the
        backend allows)."""
        ops = self.backend
        k, v = self._keys[layer], self._values[layer]
        return ops.slice(k, 0, start, stop), ops.slice(v, 0, start, stop)

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (e.g. rejected speculative tokens)."""
        self.length = min(self.length, length)

    @property
    def nbytes_per_position(self) -> int:
        """Bytes one position occupies across all allocated layers."""
        total = 0
        for arr in (*self._keys, *self._values):
            if arr is not None:
                shape = self.backend.shape(arr)
                size = 1
                for d in shape[1:]:
                    size *= d
                total += size * _itemsize(self.backend.dtype(arr))
        return total


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}.get(dtype, 4)
