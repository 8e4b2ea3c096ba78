"""KV caches owned by the engine.

Architectures never see these: they call
:meth:`infer.kv.attention.AttentionContext.attention` with a layer's new keys
and values, and the engine's cache decides where they go.

Every sequence's cache, whatever its layout, is a :class:`SequenceCache`
with one lifecycle, which the engine drives the same way for all of them:

* :meth:`~SequenceCache.reserve` makes positions ``length..stop`` writable
  before a forward, all or nothing, so a forward never runs out of memory
  half way;
* the forward :meth:`~SequenceCache.write`\\ s each layer's new keys and
  values (and the attention context :meth:`~SequenceCache.read`\\ s them);
* :meth:`~SequenceCache.commit` records the token ids those positions now
  hold, and ``length`` grows;
* :meth:`~SequenceCache.truncate` forgets positions (rejected drafts);
* :meth:`~SequenceCache.free` gives the memory back.

:class:`ContiguousKVCache` holds one sequence's keys and values per layer in
arrays preallocated to the sequence's capacity, so decoding allocates
nothing per step. Each layer's arrays are created at its first write, from
the shapes written, so layers with different key and value widths (e.g.
multi-head latent attention) need no special case. The paged cache is
:class:`infer.kv.paged.PagedSequenceCache`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from infer.errors import CacheFullError
from infer.ops import Array, Backend


class SequenceCache(abc.ABC):
    """One sequence's keys and values, and the lifecycle every layout shares."""

    #: Most positions the sequence may hold.
    capacity: int

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Positions written and committed."""

    @abc.abstractmethod
    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        """Store ``k``, ``v`` (``[n, kv_heads, dim]``) at positions ``start..start+n``."""

    @abc.abstractmethod
    def read(self, layer: int, start: int, stop: int) -> tuple[Array, Array]:
        """Keys and values of positions ``start..stop``."""

    @abc.abstractmethod
    def reserve(self, stop: int) -> None:
        """Make positions ``length..stop`` writable now, or raise
        :class:`~infer.errors.CacheFullError` having changed nothing."""

    @abc.abstractmethod
    def commit(self, token_ids: Sequence[int]) -> None:
        """The positions from ``length`` on, just written, hold ``token_ids``."""

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (e.g. rejected speculative tokens)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Give the memory back now; the cache is empty afterwards."""

    @property
    @abc.abstractmethod
    def nbytes_per_position(self) -> int:
        """Bytes one position occupies across the layers written so far."""

    def _check_capacity(self, start: int, n: int) -> None:
        if start + n > self.capacity:
            raise CacheFullError(
                f"KV cache holds {self.capacity} positions; writing {n} at position {start} "
                f"needs {start + n}"
            )


class ContiguousKVCache(SequenceCache):
    """One sequence's keys and values, ``[capacity, kv_heads, head_dim]`` per layer."""

    def __init__(self, backend: Backend, num_layers: int, capacity: int) -> None:
        self.backend = backend
        self.num_layers = num_layers
        self.capacity = capacity
        self._length = 0
        self._keys: list[Array | None] = [None] * num_layers
        self._values: list[Array | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return self._length

    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        ops = self.backend
        self._check_capacity(start, ops.shape(k)[0])
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

    def reserve(self, stop: int) -> None:
        """The arrays hold the whole capacity already: only the bound is checked."""
        self._check_capacity(self._length, stop - self._length)

    def commit(self, token_ids: Sequence[int]) -> None:
        self._length += len(token_ids)

    def truncate(self, length: int) -> None:
        """Only the length changes; the next write overwrites the rows."""
        self._length = min(self._length, length)

    def layer_buffers(self, layers: int) -> tuple[list[Array], list[Array]] | None:
        """The key and value buffers (``[capacity, ...]`` each) of layers
        ``0..layers``, for a captured decode step to write and read in
        place of :meth:`write` and :meth:`read`; None while one of them has
        not been written yet (its shapes are not known before)."""
        keys, values = self._keys[:layers], self._values[:layers]
        if any(k is None for k in keys):
            return None
        return list(keys), list(values)  # type: ignore[arg-type]

    def replace_layer_buffers(self, keys: Sequence[Array], values: Sequence[Array]) -> None:
        """Adopt the buffers a captured step returned (new arrays on a
        functional backend; the same ones where writes are in place)."""
        self._keys[:len(keys)] = list(keys)
        self._values[:len(values)] = list(values)

    def free(self) -> None:
        self._keys = [None] * self.num_layers
        self._values = [None] * self.num_layers
        self._length = 0

    @property
    def nbytes_per_position(self) -> int:
        return sum(row_nbytes(self.backend, a) for a in (*self._keys, *self._values) if a is not None)


def row_nbytes(ops: Backend, arr: Array) -> int:
    """Bytes of one row (one position) of a ``[rows, ...]`` array."""
    size = 1
    for d in ops.shape(arr)[1:]:
        size *= d
    return size * {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}.get(ops.dtype(arr), 4)
