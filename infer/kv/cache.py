"""KV caches owned by the engine.

Architectures never see these: they call
:meth:`infer.kv.attention.AttentionContext.attention` with a layer's new keys
and values, and the engine's cache decides where they go.

Every sequence's cache, whatever its layout, is a :class:`SequenceCache`
with one lifecycle, which the engine drives the same way for all of them:

* :meth:`~SequenceCache.reserve` makes positions ``length..stop`` writable
  before a forward, all or nothing, so a forward never runs out of memory
  half way;
* the forward's description :meth:`~SequenceCache.locate`\\ s its new
  positions in the pool, and the attention context writes each layer's new
  keys and values there and attends over them;
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

import numpy as np

from infer.errors import CacheFullError
from infer.kv.attention import KVLayers
from infer.kv.state import SequenceStates
from infer.ops import KV_BLOCK_DTYPES, Array, Backend, kv_pool_width

#: A cache without blocks (contiguous) checkpoints recurrent state every this many positions.
CHECKPOINT_INTERVAL = 16


class SequenceCache(abc.ABC):
    """One sequence's keys and values, and the lifecycle every layout shares."""

    #: Most positions the sequence may hold.
    capacity: int
    #: The pool whose rows hold its keys and values (the attention context
    #: writes and reads them there; a contiguous cache is its own pool).
    store: KVLayers
    #: Its recurrent layers' state (None: the model has none).
    states: SequenceStates | None = None
    #: The logits after the last prompt token where the prefix cache kept them
    #: with every prompt position (a restored state; see
    #: :meth:`infer.kv.paged.PagedSequenceCache.reuse_prompt`): the first token
    #: is drawn from them and nothing is computed. None otherwise.
    kept_logits: np.ndarray | None = None

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Positions written and committed."""

    @abc.abstractmethod
    def locate(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        """The pool rows of positions ``start..stop`` (int32; made writable
        first, taking pages where needed) and the block table up to ``stop``:
        what the forward's description (:func:`infer.kv.attention.describe`)
        is built from."""

    def locate_groups(self, start: int, stop: int) -> list[tuple[np.ndarray, list[int]]]:
        """:meth:`locate` per state group of the store (one group by default)."""
        return [self.locate(start, stop)]

    def plan_checkpoints(self, token_ids: Sequence[int], verify: bool) -> list[tuple[int, int]]:
        """The recurrent state checkpoints the forward feeding ``token_ids``
        writes, ``(position, slot)`` (module :mod:`infer.kv.state`): block
        boundaries the prefix cache keys, the newest boundary the chunk
        reaches, the chunk's end when it has more than one token, and after
        every row when it ``verify``-ies drafts.

        An unkeyed boundary short of the chunk's newest is not written: the
        next forward lets go of every checkpoint but the newest at or before
        the sequence's length, so it could serve only a rollback in between,
        and each cost a slot of state (18 MiB at Qwen3.5's shape; a 128-token
        prompt wrote eight of them, 144 MB of peak memory: docs/kv-cache.md,
        "Recurrent state and checkpoints")."""
        if self.states is None:
            return []
        start, stop, every = self.length, self.length + len(token_ids), self.checkpoint_interval
        boundaries = range((start // every + 1) * every, stop + 1, every)
        keys = self._checkpoint_keys(token_ids)
        positions = {p for p in boundaries if p in keys}
        if boundaries:
            positions.add(boundaries[-1])
        if len(token_ids) > 1:
            positions.add(stop)
        if verify:
            positions.update(range(start + 1, stop + 1))
        return self.states.plan(start, sorted(positions), keys)

    @property
    def checkpoint_interval(self) -> int:
        return CHECKPOINT_INTERVAL

    def _checkpoint_keys(self, token_ids: Sequence[int]) -> dict[int, bytes]:
        """Prefix-cache keys of the block boundaries ``token_ids`` reach (none without a prefix cache)."""
        return {}

    @abc.abstractmethod
    def reserve(self, stop: int) -> None:
        """Make positions ``length..stop`` writable now, or raise
        :class:`~infer.errors.CacheFullError` having changed nothing."""

    @abc.abstractmethod
    def commit(self, token_ids: Sequence[int]) -> None:
        """The positions from ``length`` on, just written, hold ``token_ids``."""

    @abc.abstractmethod
    def truncate(self, length: int) -> int:
        """Forget positions from ``length`` on (e.g. rejected speculative
        tokens). Returns the positions kept: ``length``, or fewer when a
        state cannot be cut there (a recurrent layer's newest checkpoint at
        or before it; a sliding window's pages given back), and then the
        engine replays the tokens between (:meth:`infer.engine.Engine.truncate`)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Give the memory back now; the cache is empty afterwards."""

    @property
    @abc.abstractmethod
    def nbytes_per_position(self) -> int:
        """Bytes one position occupies across the layers written so far."""

    def read(self, layer: int, start: int, stop: int) -> tuple[Array, Array]:
        """Keys and values of positions ``start..stop`` of ``layer`` (for
        inspection and tests: the forward reads the pool through the attention op)."""
        ops = self.store.backend
        rows, _ = self._rows(start, stop)
        keys, values = self.store.stored(layer)
        ids = ops.from_numpy(rows)
        k, v = ops.take(keys, ids, axis=0), ops.take(values, ids, axis=0)
        if getattr(self.store, "dtype", None) in KV_BLOCK_DTYPES:  # q8_0 blocks: the values they hold
            from infer.oplib import dequantize_q8_0

            k, v = (ops.from_numpy(dequantize_q8_0(ops.to_numpy(x))) for x in (k, v))
        return k, v

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        return self.locate(start, stop)

    def _check_capacity(self, start: int, n: int) -> None:
        if start + n > self.capacity:
            raise CacheFullError(
                f"KV cache holds {self.capacity} positions; writing {n} at position {start} "
                f"needs {start + n}"
            )


class LayerStore:
    """Per layer one key and one value array of ``rows`` rows, created at
    the layer's first write from the shapes written, so layers with
    different key and value widths (multi-head latent attention) need no
    special case: the storage of a pool and of a contiguous cache. ``dtype``
    stores them narrower than they are computed (``"float16"``, or ``"q8_0"``
    blocks in ``uint8`` arrays: :func:`infer.ops.kv_pool_width`; default: as
    written)."""

    def __init__(self, backend: Backend, num_layers: int, rows: int, block_size: int,
                 layer_kv: Sequence[tuple[int, int, bool]] | None = None, dtype: str | None = None) -> None:
        self.backend = backend
        #: The dtype keys and values are stored in (the engine's ``kv_dtype``,
        #: e.g. ``"float16"``: written rows are rounded to it, the attention op
        #: reads them widened); None: the dtype of the keys written.
        self.dtype = dtype
        self.num_layers = num_layers
        self.rows = rows
        self.block_size = block_size
        #: Per layer (storage layer, state group, writes); None: its own, group 0
        #: (:func:`infer.kv.attention.state_groups`).
        self.layer_kv = None if layer_kv is None else list(layer_kv)
        self._keys: list[Array | None] = [None] * num_layers
        self._values: list[Array | None] = [None] * num_layers

    def layer_arrays(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        if self._keys[layer] is None:
            ops = self.backend
            for i, (x, arrays) in enumerate(((k, self._keys), (v, self._values))):
                *heads, width = ops.shape(x)[1:]
                width, dtype = kv_pool_width(self.dtype, width)  # q8_0: uint8 blocks
                arrays[layer] = ops.zeros((self.rows, *heads, width), dtype or ops.dtype(x))
            self._allocated(layer)
        return self._keys[layer], self._values[layer]  # type: ignore[return-value]

    def _allocated(self, layer: int) -> None:
        """Called when ``layer``'s arrays are created."""

    def set_layer_arrays(self, layer: int, keys: Array, values: Array) -> None:
        self._keys[layer], self._values[layer] = keys, values

    def allocated(self, layer: int) -> bool:
        """Whether ``layer``'s arrays exist (they are made at its first write)."""
        return self._keys[layer] is not None

    def stored(self, layer: int) -> tuple[Array, Array]:
        """``layer``'s arrays as they are (``IndexError`` before its first write)."""
        keys, values = self._keys[layer], self._values[layer]
        if keys is None or values is None:
            raise IndexError(f"KV layer {layer} has not been written yet")
        return keys, values

    def storage_layers(self, layers: int) -> list[int]:
        """The layers below ``layers`` that have arrays of their own (not a
        shared or recurrent layer, nor one whose pages another layer's arrays hold)."""
        kv = self.layer_kv
        return [i for i in range(layers) if kv is None or (kv[i][0] == i and kv[i][2])]

    def layer_rows(self, layers: int) -> tuple[list[Array], list[Array]] | None:
        """The key and value arrays of the storage layers below ``layers``
        (:meth:`storage_layers`), as a captured step takes them; None while
        one of them is not allocated yet (its shapes are not known before its
        first write)."""
        ids = self.storage_layers(layers)
        keys, values = [self._keys[i] for i in ids], [self._values[i] for i in ids]
        if any(a is None for a in (*keys, *values)):
            return None
        return keys, values  # type: ignore[return-value]

    def replace_layer_rows(self, keys: Sequence[Array], values: Sequence[Array]) -> None:
        """Adopt the arrays a captured step returned (new arrays on a
        functional backend; the same ones where writes are in place), in
        :meth:`layer_rows`' order."""
        for i, k, v in zip(self.storage_layers(self.num_layers), keys, values):
            self._keys[i], self._values[i] = k, v

    def clear(self) -> None:
        self._keys = [None] * self.num_layers
        self._values = [None] * self.num_layers

    @property
    def nbytes_per_position(self) -> int:
        """Bytes one position occupies across the layers allocated so far."""
        return sum(row_nbytes(self.backend, a) for a in (*self._keys, *self._values) if a is not None)


class ContiguousKVCache(SequenceCache, LayerStore):
    """One sequence's keys and values, ``[capacity, kv_heads, head_dim]`` per
    layer, preallocated to the sequence's capacity so that decoding allocates
    nothing per step. To the attention op it is a pool of one block of
    ``capacity`` positions: its block table is ``[0]`` and position ``p`` is row ``p``."""

    def __init__(self, backend: Backend, num_layers: int, capacity: int, *,
                 layer_kv: Sequence[tuple[int, int, bool]] | None = None,
                 states: SequenceStates | None = None, dtype: str | None = None) -> None:
        # One group: a contiguous buffer holds every position already, so windows give nothing back.
        layer_kv = None if layer_kv is None else [(src, 0, writes) for src, _, writes in layer_kv]
        LayerStore.__init__(self, backend, num_layers, capacity, capacity, layer_kv, dtype)
        self.capacity = capacity
        self.states = states
        self._length = 0

    @property  # type: ignore[override]
    def store(self) -> ContiguousKVCache:
        """Itself: a contiguous cache is its own store. A property, where an
        attribute would make every cache a reference cycle whose keys and
        values only Python's cycle collector frees (a 4,096-position
        sequence's 134 MB were still held while the next one prefilled)."""
        return self

    @property
    def length(self) -> int:
        return self._length

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        self._check_capacity(start, stop - start)
        return np.arange(start, stop, dtype=np.int32), [0]

    def reserve(self, stop: int) -> None:
        """The arrays hold the whole capacity already: only the bound is checked."""
        self._check_capacity(self._length, stop - self._length)

    def commit(self, token_ids: Sequence[int]) -> None:
        self._length += len(token_ids)
        if self.states is not None:
            self.states.commit()

    def truncate(self, length: int) -> int:
        """Only the length changes; the next write overwrites the rows (a
        recurrent state goes back to its newest checkpoint at or before ``length``)."""
        length = min(self._length, length)
        if self.states is not None:
            length = self.states.restore(length)
        self._length = length
        return length

    def free(self) -> None:
        self.clear()
        self._length = 0
        if self.states is not None:
            self.states.free()

    @property
    def nbytes_per_position(self) -> int:
        return LayerStore.nbytes_per_position.fget(self)  # type: ignore[attr-defined]

    def layer_rows(self, layers: int) -> tuple[list[Array], list[Array]] | None:
        """As the store's, but None where a layer has no arrays of its own
        (the captured contiguous step indexes every layer's buffers)."""
        if len(self.storage_layers(layers)) != layers:
            return None
        return LayerStore.layer_rows(self, layers)


def row_nbytes(ops: Backend, arr: Array) -> int:
    """Bytes of one row (one position) of a ``[rows, ...]`` array."""
    size = 1
    for d in ops.shape(arr)[1:]:
        size *= d
    return size * {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1}.get(ops.dtype(arr), 4)
