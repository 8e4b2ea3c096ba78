"""The attention context: what an architecture sees of the engine.

For each forward pass the engine describes the batch once: the new tokens of
one or more sequences, flattened into one ``[tokens, ...]`` axis, with their
positions, the pool rows (*slots*) their keys and values go to, and for the
attention op each sequence's query rows, length and block table (an
:class:`~infer.ops.AttentionBatch`). An architecture computes q, k, v for a
layer and calls :meth:`AttentionContext.attention`; the context writes k and
v to their slots (:meth:`~infer.ops.Backend.scatter_rows`) and attends over
the pool (:meth:`~infer.ops.Backend.attention`). Prompt chunks, decode rows,
speculative verification rows, any mix of them, a contiguous cache (one block
of its capacity) or pages of a shared pool: one description, one path
(docs/design.md, rule 3; docs/kv-cache.md).

The description holds backend arrays, so a captured step builds the same
context from its inputs (:meth:`AttentionContext.static`): positions, slots,
lengths and tables are data, and one graph serves every step of a shape
bucket. Eagerly it also keeps the host's copy, which kernels use to choose
their path per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from infer.errors import CaptureError
from infer.ops import Array, AttentionBatch, Backend


class KVLayers(Protocol):
    """Where a run of sequences keeps its keys and values: per layer one key
    and one value array of pool rows (``[rows, kv_heads, dim]``)."""

    #: Positions per block of the rows' block tables.
    block_size: int

    def layer_arrays(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        """``layer``'s key and value rows, created (from ``k``'s and ``v``'s
        shapes and dtypes) at its first write."""
        ...

    def set_layer_arrays(self, layer: int, keys: Array, values: Array) -> None:
        """The arrays to use from now on (new ones on a functional backend)."""
        ...


class SequenceKV(Protocol):
    """What building a forward's description needs of a sequence's cache."""

    #: Its pool (a contiguous cache is its own pool of one block).
    store: KVLayers

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        """The pool rows of positions ``start..stop`` (int32, made writable
        first) and the sequence's block table up to ``stop``."""
        ...


@dataclass
class SequenceSlice:
    """One sequence's share of a forward batch."""

    #: Where this sequence's keys and values live.
    cache: SequenceKV
    #: Position of the first new token (= tokens already cached).
    start: int
    #: Number of new tokens in this forward.
    length: int


@dataclass
class StoreRun:
    """Consecutive sequences of a forward whose keys live in one store: one
    write and one attention call per layer."""

    store: KVLayers
    #: Their rows on the forward's flattened token axis.
    first: int
    stop: int
    #: int32 ``[stop - first]``: the pool row each new token's key goes to.
    slots: Array
    batch: AttentionBatch


class DynamicContextError(CaptureError):
    """An architecture asked a static context for something that changes from
    step to step on the host (e.g. :attr:`AttentionContext.max_position`, which
    dynamic rope scaling reads): that forward cannot be one captured graph."""


class AttentionContext:
    """The engine's side of one forward pass, as seen by an architecture.

    Attributes an architecture may read:

    * ``ops`` — the backend.
    * ``positions`` — ``[tokens]`` int32 positions of the new tokens.
    * ``num_tokens`` — number of new tokens across the batch.
    * ``max_position`` — largest position in the batch + 1 (the sequence
      length, e.g. for dynamic rope scaling); a captured step has none on the
      host and raises :class:`DynamicContextError`.

    Which rows get logits is not the context's business: the architecture
    returns the hidden states of every new token and the engine applies the
    head (:meth:`~infer.architecture.CausalLM.compute_logits`).

    ``AttentionContext(ops, slices)`` describes an eager forward of
    ``slices`` (built on the host); :meth:`static` one whose description
    is given as arrays (a captured step).
    """

    def __init__(self, ops: Backend, sequences: Sequence[SequenceSlice]) -> None:
        if not sequences:
            raise ValueError("a forward needs at least one sequence")
        runs: list[StoreRun] = []
        group: list[SequenceSlice] = []
        first = 0

        def close() -> None:
            nonlocal first
            run = describe(ops, group, first)
            runs.append(run)
            first = run.stop

        for s in sequences:
            if group and s.cache.store is not group[0].cache.store:
                close()
                group = []
            group.append(s)
        close()
        positions = np.concatenate([np.arange(s.start, s.start + s.length, dtype=np.int32) for s in sequences])
        self._setup(ops, ops.from_numpy(positions), int(positions.shape[0]), runs,
                    max(s.start + s.length for s in sequences))
        self.sequences = list(sequences)

    @classmethod
    def static(cls, ops: Backend, store: KVLayers, positions: Array, slots: Array, batch: AttentionBatch,
               tokens: int) -> AttentionContext:
        """A forward of ``tokens`` rows whose description is data: the
        positions, slots and ``batch`` are backend arrays (a captured step's
        inputs) over one ``store``; nothing about the step's lengths is on the host."""
        ctx = cls.__new__(cls)
        ctx._setup(ops, positions, tokens, [StoreRun(store, 0, tokens, slots, batch)], None)
        ctx.sequences = []
        return ctx

    @classmethod
    def contiguous(cls, ops: Backend, keys: Sequence[Array], values: Sequence[Array], start: Array,
                   tokens: int = 1) -> AttentionContext:
        """A captured step's forward of ``tokens`` new positions of one sequence
        whose cache is one key and one value buffer per layer (``[capacity,
        kv_heads, dim]``: one block of its capacity), from position ``start``
        (a device int32 ``[1]``) on: everything but the shapes is data, so the
        same graph serves every position. The buffers after the forward are
        :attr:`keys` and :attr:`values`."""
        capacity = ops.shape(keys[0])[0]
        positions = ops.add(ops.arange(0, tokens, "int32"), start)
        batch = AttentionBatch(ops.mul(ops.arange(0, 2, "int32"), tokens), ops.add(start, tokens),
                               ops.zeros((1, 1), "int32"), capacity, tokens)
        return cls.static(ops, LayerArrays(keys, values, capacity), positions, positions, batch, tokens)

    @property
    def keys(self) -> list[Array]:
        """A static context's layer key arrays after the forward (see :class:`LayerArrays`)."""
        return self._arrays().keys

    @property
    def values(self) -> list[Array]:
        """A static context's layer value arrays after the forward."""
        return self._arrays().values

    def _arrays(self) -> LayerArrays:
        store = self.runs[0].store
        if len(self.runs) != 1 or not isinstance(store, LayerArrays):
            raise AttributeError("only a static context over given arrays has keys and values to hand back")
        return store

    def _setup(self, ops: Backend, positions: Array, tokens: int, runs: list[StoreRun],
               max_position: int | None) -> None:
        self.ops = ops
        self.positions = positions
        self.num_tokens = tokens
        self.runs = runs
        self._max_position = max_position

    @property
    def max_position(self) -> int:
        if self._max_position is None:
            raise DynamicContextError("the architecture reads the sequence length on the host (max_position), "
                                      "which changes every step")
        return self._max_position

    def attention(
        self,
        layer: int,
        q: Array,
        k: Array,
        v: Array,
        *,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
        causal: bool = True,
    ) -> Array:
        """Store this layer's new keys and values, and attend.

        q: ``[tokens, q_heads, dk]``; k: ``[tokens, kv_heads, dk]``;
        v: ``[tokens, kv_heads, dv]``, with tokens ordered as in the batch.
        Attention is over each sequence's cached and new positions, causal
        unless ``causal`` is False, optionally limited to a sliding ``window``
        of keys, with logit ``softcap`` and per-head ``sinks``
        (:meth:`~infer.ops.Backend.attention`). Returns ``[tokens, q_heads, dv]``.
        """
        ops = self.ops
        outputs = []
        for run in self.runs:
            part = len(self.runs) > 1
            qs, ks, vs = (ops.slice(x, 0, run.first, run.stop) if part else x for x in (q, k, v))
            keys, values = run.store.layer_arrays(layer, ks, vs)
            keys = ops.scatter_rows(keys, run.slots, ks)
            values = ops.scatter_rows(values, run.slots, vs)
            run.store.set_layer_arrays(layer, keys, values)
            outputs.append(ops.attention(qs, keys, values, run.batch, scale=scale, causal=causal, window=window,
                                         softcap=softcap, sinks=sinks))
        return outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)


def describe(ops: Backend, sequences: Sequence[SequenceSlice], first: int = 0) -> StoreRun:
    """The description of ``sequences`` (all of one store) starting at row
    ``first`` of the forward: their slots, and the attention batch with the
    host's copy beside the backend's arrays."""
    store = sequences[0].cache.store
    slots, tables = [], []
    query_start = [0]
    lengths = []
    for s in sequences:
        rows, table = s.cache.locate(s.start, s.start + s.length)
        slots.append(rows)
        tables.append(table)
        query_start.append(query_start[-1] + s.length)
        lengths.append(s.start + s.length)
    width = max(len(t) for t in tables)
    table_array = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        table_array[i, :len(t)] = t
    host = AttentionBatch(np.asarray(query_start, np.int32), np.asarray(lengths, np.int32), table_array,
                          store.block_size, max(s.length for s in sequences))
    slot_array = np.concatenate(slots).astype(np.int32, copy=False)
    batch = AttentionBatch(*(ops.from_numpy(a) for a in (host.query_start, host.seq_lens, host.block_tables)),
                           host.block_size, host.max_query, host)
    return StoreRun(store, first, first + query_start[-1], ops.from_numpy(slot_array), batch)


class LayerArrays:
    """A captured step's view of a store: the layers' arrays given as the
    step's inputs (:attr:`keys`, :attr:`values`; after the forward the arrays
    to adopt, new ones on a functional backend such as MLX)."""

    def __init__(self, keys: Sequence[Array], values: Sequence[Array], block_size: int) -> None:
        self.keys, self.values, self.block_size = list(keys), list(values), block_size

    def layer_arrays(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        return self.keys[layer], self.values[layer]

    def set_layer_arrays(self, layer: int, keys: Array, values: Array) -> None:
        self.keys[layer], self.values[layer] = keys, values
