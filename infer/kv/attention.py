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

What each cache layer keeps is declared by the architecture
(:meth:`~infer.architecture.CausalLM.layer_states`: :class:`FullAttention`,
:class:`SlidingWindow`, :class:`SharedKV`, :class:`Recurrent`); a store lays
the attention layers out in *state groups* (:func:`state_groups`: one block
table per window size), and a forward's description carries every group's
slots and tables. A recurrent layer reads and writes its per-sequence state
through :meth:`AttentionContext.state` and :meth:`AttentionContext.set_state`
(:mod:`infer.kv.state`).

The description holds backend arrays, so a captured step builds the same
context from its inputs (:meth:`AttentionContext.static`): positions, slots,
lengths and tables are data, and one graph serves every step of a shape
bucket. Eagerly it also keeps the host's copy, which kernels use to choose
their path per sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import numpy as np

from infer import oplib
from infer.errors import CaptureError
from infer.ops import Array, AttentionBatch, Backend


# -- what each cache layer keeps per sequence ---------------------------------------


@dataclass(frozen=True)
class FullAttention:
    """Keys and values of every position (the default for every cache layer)."""


@dataclass(frozen=True)
class SlidingWindow:
    """Keys and values of the last ``window`` positions only: the layer attends
    with ``ctx.attention(..., window=window)``, so the engine gives back the
    pages that fall wholly out of the window (docs/kv-cache.md, "State groups")."""

    window: int


@dataclass(frozen=True)
class SharedKV:
    """No keys and values of its own: the layer attends over those of the
    earlier cache layer ``layer`` (its ``k`` and ``v`` are not stored)."""

    layer: int


@dataclass(frozen=True)
class Recurrent:
    """Fixed-size state per sequence, whatever its length: named arrays of
    ``arrays[name]`` shape each (e.g. ``{"conv": (width - 1, channels), "ssm":
    (heads, dk, dv)}``) in ``dtype``. The layer reads it with
    :meth:`AttentionContext.state` and writes it back with
    :meth:`AttentionContext.set_state`; the engine keeps it in per-sequence
    slots and checkpoints it for prefix hits and rollback."""

    arrays: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    dtype: str = "float32"

    def __hash__(self) -> int:
        return hash((tuple(sorted((k, tuple(v)) for k, v in self.arrays.items())), self.dtype))


#: What one cache layer keeps per sequence (:meth:`infer.architecture.CausalLM.layer_states`).
LayerState = Union[FullAttention, SlidingWindow, SharedKV, Recurrent]


def state_groups(specs: Sequence[LayerState]) -> tuple[list[tuple[int, int, bool]], list[int | None]]:
    """How a store lays out ``specs`` (one per cache layer): per layer
    ``(storage, group, writes)`` — the layer whose arrays hold its keys and
    values, its state group (-1: a recurrent layer, no keys and values), and
    whether it writes them (a :class:`SharedKV` layer only reads) — and per
    group its window (None: full attention). Group 0 is full attention when
    any layer is; each window size is a group with its own block tables
    (vLLM's KV-cache groups)."""
    sizes = sorted({s.window for s in specs if isinstance(s, SlidingWindow)})
    windows: list[int | None] = list(sizes)
    if any(isinstance(s, FullAttention) for s in specs) or not windows:
        windows.insert(0, None)
    layer_kv: list[tuple[int, int, bool]] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedKV):
            if not 0 <= spec.layer < i or isinstance(specs[spec.layer], (SharedKV, Recurrent)):
                raise ValueError(f"cache layer {i} shares the keys and values of layer {spec.layer}, which must "
                                 "be an earlier attention layer with its own")
            layer_kv.append((*layer_kv[spec.layer][:2], False))
        elif isinstance(spec, Recurrent):
            layer_kv.append((i, -1, False))
        else:
            layer_kv.append((i, windows.index(spec.window if isinstance(spec, SlidingWindow) else None), True))
    return layer_kv, windows


class KVLayers(Protocol):
    """Where a run of sequences keeps its keys and values: per layer one key
    and one value array of pool rows (``[rows, kv_heads, dim]``)."""

    #: Positions per block of the rows' block tables.
    block_size: int
    #: Per cache layer ``(storage, group, writes)`` (:func:`state_groups`);
    #: None: every layer its own arrays, group 0.
    layer_kv: Sequence[tuple[int, int, bool]] | None

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
    #: Its recurrent state (:class:`infer.kv.state.SequenceStates`), or None
    #: when the model has no recurrent layer.
    states: Any

    def locate_groups(self, start: int, stop: int) -> list[tuple[np.ndarray, list[int]]]:
        """Per state group of the store (docs/kv-cache.md, "State groups"):
        the pool rows of positions ``start..stop`` (int32, made writable
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
    #: Recurrent state checkpoints to write: ``(position, slot)``, the state
    #: after ``position`` tokens (``start < position <= start + length``).
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    #: The sequence's images (:class:`infer.multimodal.PromptMedia`), or None:
    #: what it says of positions ``start..start + length`` (rows to inject,
    #: bidirectional spans, rope positions) joins the forward's description.
    media: Any = None


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
    #: The same for the store's further state groups (sliding-window layers
    #: with their own block tables), group 1 first.
    groups: list[tuple[Array, AttentionBatch]] = field(default_factory=list)

    def group(self, g: int) -> tuple[Array, AttentionBatch]:
        return (self.slots, self.batch) if g == 0 else self.groups[g - 1]


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
        placed = [None if s.media is None else s.media.position_rows(s.start, s.start + s.length)
                  for s in sequences]
        streams = max((p.shape[0] for p in placed if p is not None), default=0)
        rows = [np.arange(s.start, s.start + s.length, dtype=np.int32) if p is None else p
                for s, p in zip(sequences, placed)]
        if streams:  # positions given per stream (M-RoPE): a plain sequence repeats its indices
            grid = np.concatenate([np.broadcast_to(r, (streams, r.shape[-1])) for r in rows], axis=1)
            positions = np.ascontiguousarray(grid[0])
        else:
            positions = np.concatenate(rows)
        self._setup(ops, ops.from_numpy(positions), int(positions.shape[0]), runs,
                    max(s.start + s.length for s in sequences))
        self.sequences = list(sequences)
        if streams > 1:
            self.position_ids = ops.from_numpy(np.ascontiguousarray(grid, dtype=np.int32))
        injected, first = [], 0
        for s in sequences:
            got = None if s.media is None else s.media.injected(ops, s.start, s.start + s.length)
            if got is not None:
                injected.append((got[0] + first, got[1]))
            first += s.length
        if injected:
            where = np.concatenate([r for r, _ in injected]).astype(np.int32)
            values = [v for _, v in injected]
            self.embedded = (ops.from_numpy(where), values[0] if len(values) == 1 else ops.concat(values, 0))
        states = [s.cache.states for s in sequences]
        if any(st is not None for st in states):
            if any(st is None or st.store is not states[0].store for st in states):
                raise ValueError("a forward's sequences keep their recurrent state in one store")
            query_start, rows, ckpt_slots = [0], [], []
            for s in sequences:
                rows.extend(query_start[-1] + p - s.start - 1 for p, _ in s.checkpoints)
                ckpt_slots.extend(slot for _, slot in s.checkpoints)
                query_start.append(query_start[-1] + s.length)
            i32 = lambda xs: ops.from_numpy(np.asarray(xs, np.int32))  # noqa: E731
            self._states = states[0].store
            self.query_start = i32(query_start)
            self.state_slots = i32([st.slot for st in states])
            self.checkpoint_rows = i32(rows)
            self._checkpoint_slots = i32(ckpt_slots)

    @classmethod
    def static(cls, ops: Backend, store: KVLayers, positions: Array, slots: Array, batch: AttentionBatch,
               tokens: int, groups: Sequence[tuple[Array, AttentionBatch]] = ()) -> AttentionContext:
        """A forward of ``tokens`` rows whose description is data: the
        positions, slots and ``batch`` (and those of the store's further
        state ``groups``) are backend arrays (a captured step's inputs) over
        one ``store``; nothing about the step's lengths is on the host."""
        ctx = cls.__new__(cls)
        ctx._setup(ops, positions, tokens, [StoreRun(store, 0, tokens, slots, batch, list(groups))], None)
        ctx.sequences = []
        return ctx

    def with_states(self, states: Any, state_slots: Array, checkpoint_rows: Array | None,
                    checkpoint_slots: Array | None) -> AttentionContext:
        """This static context carrying recurrent state as data too: ``states``
        has a :class:`~infer.kv.state.StateStore`'s ``arrays`` (layer -> name ->
        ``[slots, ...]``, a captured step's inputs), ``state_slots`` int32
        ``[sequences]`` (one per sequence of the batch, padding ones on a
        scratch slot), the checkpoint rows and their slots int32 ``[N]``
        (None, None: the forward writes no checkpoint); the ragged batch is
        the attention batch's ``query_start``."""
        self._states = states
        self.query_start = self.runs[0].batch.query_start
        self.state_slots, self.checkpoint_rows, self._checkpoint_slots = state_slots, checkpoint_rows, checkpoint_slots
        return self

    @classmethod
    def contiguous(cls, ops: Backend, keys: Sequence[Array], values: Sequence[Array], start: Array,
                   tokens: int = 1, offset: Array | None = None, *,
                   layer_kv: Sequence[tuple[int, int, bool]] | None = None,
                   index: dict[int, int] | None = None, capacity: int | None = None) -> AttentionContext:
        """A captured step's forward of ``tokens`` new positions of one sequence
        whose cache is one key and one value buffer per layer (``[capacity,
        kv_heads, dim]``: one block of its capacity), from position ``start``
        (a device int32 ``[1]``) on: everything but the shapes is data, so the
        same graph serves every position. The buffers after the forward are
        :attr:`keys` and :attr:`values`. ``offset`` (a device int32 ``[1]``)
        moves the rope positions away from the cache rows (an M-RoPE
        sequence's tokens after its prompt sit at index + its delta).
        ``layer_kv`` and ``index`` (as :class:`LayerArrays`') where the buffers
        are the storage layers' only (a hybrid's attention layers); ``capacity``
        where there are none."""
        capacity = ops.shape(keys[0])[0] if capacity is None else capacity
        slots = ops.add(ops.arange(0, tokens, "int32"), start)
        positions = slots if offset is None else ops.add(slots, offset)
        batch = AttentionBatch(ops.mul(ops.arange(0, 2, "int32"), tokens), ops.add(start, tokens),
                               ops.zeros((1, 1), "int32"), capacity, tokens)
        return cls.static(ops, LayerArrays(keys, values, capacity, layer_kv, index), positions, slots, batch,
                          tokens)

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
        self._states = None
        #: int32 ``[sequences + 1]`` over the whole forward (recurrent layers'
        #: ragged batch: sequence ``b``'s tokens are ``query_start[b]:query_start[b + 1]``).
        self.query_start: Array | None = None
        #: int32 ``[sequences]``: each sequence's state slot.
        self.state_slots: Array | None = None
        #: int32 ``[checkpoints]``: token rows after which a recurrent op
        #: returns the state (see :meth:`set_state`).
        self.checkpoint_rows: Array | None = None
        self._checkpoint_slots: Array | None = None
        #: int32 ``[streams, tokens]`` rope positions where a sequence's are
        #: several streams (Qwen's M-RoPE: time, height, width), else None:
        #: :attr:`positions` (stream 0, or the token indices) is all there is.
        self.position_ids: Array | None = None
        #: ``(rows, values)``: embedding rows that replace the token embeddings
        #: at those rows of the forward (an image's), or None (:meth:`inject`).
        self.embedded: tuple[Array, Array] | None = None

    def inject(self, h: Array) -> Array:
        """The token embeddings ``h`` ``[tokens, hidden]`` with the forward's
        image rows put in (:attr:`embedded`): what an architecture's
        embedding step returns (:meth:`~infer.architectures.decoder.Decoder.embed`)."""
        if self.embedded is None:
            return h
        rows, values = self.embedded
        return self.ops.scatter_rows(h, rows, values)

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
            storage, group, writes = (layer, 0, True) if run.store.layer_kv is None else run.store.layer_kv[layer]
            slots, batch = run.group(group)
            qs, ks, vs = (ops.slice(x, 0, run.first, run.stop) if part and x is not None else x for x in (q, k, v))
            keys, values = run.store.layer_arrays(storage, ks, vs)
            if writes:  # a SharedKV layer reads what its source wrote earlier in this forward
                keys = ops.scatter_rows(keys, slots, ks)
                values = ops.scatter_rows(values, slots, vs)
                run.store.set_layer_arrays(storage, keys, values)
            # A backend that does not read bidirectional spans gets the contract's default for such a batch.
            attend = ops.attention if batch.spans is None or not causal or ops.supports("attention_spans") else \
                functools.partial(oplib.attention, ops)
            outputs.append(attend(qs, keys, values, batch, scale=scale, causal=causal, window=window,
                                  softcap=softcap, sinks=sinks))
        return outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)

    def state(self, layer: int) -> dict[str, Array]:
        """Recurrent ``layer``'s state before this forward, per sequence in
        batch order: ``{name: [sequences, *shape]}``
        (:class:`Recurrent`; a new sequence's is zeros)."""
        if self._states is None or self.state_slots is None:
            raise DynamicContextError(f"layer {layer} reads recurrent state, which this forward does not carry "
                                      "(a captured step runs such models eagerly)")
        ops = self.ops
        return {name: ops.take(a, self.state_slots, axis=0) for name, a in self._states.arrays[layer].items()}

    def set_state(self, layer: int, state: dict[str, Array], checkpoints: dict[str, Array] | None = None) -> None:
        """Recurrent ``layer``'s state after this forward, ``{name:
        [sequences, *shape]}``, and, when the forward has
        :attr:`checkpoint_rows`, the state after each of those rows
        (``{name: [checkpoints, *shape]}``, in their order)."""
        if self._states is None or self.state_slots is None:
            raise DynamicContextError(f"layer {layer} writes recurrent state, which this forward does not carry")
        ops, arrays = self.ops, self._states.arrays[layer]
        for name, value in state.items():
            arrays[name] = ops.scatter_rows(arrays[name], self.state_slots, value)
        if checkpoints is not None and self._checkpoint_slots is not None and ops.shape(self._checkpoint_slots)[0]:
            for name, value in checkpoints.items():
                arrays[name] = ops.scatter_rows(arrays[name], self._checkpoint_slots, value)


def describe(ops: Backend, sequences: Sequence[SequenceSlice], first: int = 0) -> StoreRun:
    """The description of ``sequences`` (all of one store) starting at row
    ``first`` of the forward: their slots, and the attention batch with the
    host's copy beside the backend's arrays."""
    store = sequences[0].cache.store
    located = [s.cache.locate_groups(s.start, s.start + s.length) for s in sequences]
    query_start = [0]
    lengths = []
    for s in sequences:
        query_start.append(query_start[-1] + s.length)
        lengths.append(s.start + s.length)
    spans = [None if s.media is None else s.media.span_rows(s.start, s.start + s.length) for s in sequences]
    span_rows = None
    if any(sp is not None for sp in spans):  # bidirectional spans (ops.AttentionBatch.spans)
        span_rows = np.concatenate([np.zeros((s.length, 2), np.int32) if sp is None else sp
                                    for s, sp in zip(sequences, spans)])
    groups = []
    for g in range(len(located[0])):
        tables = [loc[g][1] for loc in located]
        width = max(len(t) for t in tables)
        table_array = np.zeros((len(tables), width), np.int32)
        for i, t in enumerate(tables):
            table_array[i, :len(t)] = t
        host = AttentionBatch(np.asarray(query_start, np.int32), np.asarray(lengths, np.int32), table_array,
                              store.block_size, max(s.length for s in sequences), spans=span_rows)
        slot_array = np.concatenate([loc[g][0] for loc in located]).astype(np.int32, copy=False)
        batch = AttentionBatch(*(ops.from_numpy(a) for a in (host.query_start, host.seq_lens, host.block_tables)),
                               host.block_size, host.max_query, host,
                               spans=None if span_rows is None else ops.from_numpy(span_rows))
        groups.append((ops.from_numpy(slot_array), batch))
    return StoreRun(store, first, first + query_start[-1], *groups[0], groups[1:])


class LayerArrays:
    """A captured step's view of a store: the layers' arrays given as the
    step's inputs (:attr:`keys`, :attr:`values`; after the forward the arrays
    to adopt, new ones on a functional backend such as MLX)."""

    def __init__(self, keys: Sequence[Array], values: Sequence[Array], block_size: int,
                 layer_kv: Sequence[tuple[int, int, bool]] | None = None, index: dict[int, int] | None = None) -> None:
        self.keys, self.values, self.block_size = list(keys), list(values), block_size
        self.layer_kv = layer_kv
        #: Storage layer -> position in :attr:`keys` (the store's storage
        #: layers only, :meth:`~infer.kv.cache.LayerStore.storage_layers`); None: the layer itself.
        self.index = index

    def layer_arrays(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        i = layer if self.index is None else self.index[layer]
        return self.keys[i], self.values[i]

    def set_layer_arrays(self, layer: int, keys: Array, values: Array) -> None:
        i = layer if self.index is None else self.index[layer]
        self.keys[i], self.values[i] = keys, values
