"""The attention context: what an architecture sees of the engine.

For each forward pass the engine builds an :class:`AttentionContext`
describing the batch: the new tokens of one or more sequences, flattened
into one ``[tokens, ...]`` axis, with their positions. An architecture
computes q, k, v for a layer and calls :meth:`AttentionContext.attention`;
the context stores k and v in the engine's cache and computes attention over
everything the sequence has cached, through the backend's attention op.
Which cache layout and which attention kernel run is the engine's choice
(docs/design.md, rule 3); architectures never see it.

Two paths, chosen per sequence when the context is built: a cache that can
``attend`` by itself (a :class:`PagedKVStore`, e.g. the paged cache) does so
when the backend implements ``paged_attention`` natively; every other cache,
and every cache on a backend without it, is ``read`` into contiguous keys and
values for the backend's ``attention`` op. Both give the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from infer.errors import CaptureError
from infer.ops import Array, Backend


class KVStore(Protocol):
    """What the context needs of a sequence's cache."""

    def write(self, layer: int, start: int, k: Array, v: Array) -> None: ...

    def read(self, layer: int, start: int, stop: int) -> tuple[Array, Array]: ...


@runtime_checkable
class PagedKVStore(KVStore, Protocol):
    """A cache that computes attention over its own layout, through the
    backend's native ``paged_attention`` (used only where the backend has it)."""

    def attend(
        self, layer: int, q: Array, start: int, stop: int, *, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> Array:
        """Causal attention of ``q`` (``[tq, q_heads, dk]``, the last ``tq``
        of positions ``..stop``) over the cached keys ``start..stop``."""
        ...


@dataclass
class SequenceSlice:
    """One sequence's share of a forward batch."""

    #: Where this sequence's keys and values live.
    cache: KVStore
    #: Position of the first new token (= tokens already cached).
    start: int
    #: Number of new tokens in this forward.
    length: int


class AttentionContext:
    """The engine's side of one forward pass, as seen by an architecture.

    Attributes an architecture may read:

    * ``ops`` — the backend.
    * ``positions`` — ``[tokens]`` int32 positions of the new tokens.
    * ``num_tokens`` — number of new tokens across the batch.
    * ``max_position`` — largest position in the batch + 1 (the sequence
      length, e.g. for dynamic rope scaling).

    Which rows get logits is not the context's business: the architecture
    returns the hidden states of every new token and the engine applies the
    head (:meth:`~infer.architecture.CausalLM.compute_logits`).
    """

    def __init__(self, ops: Backend, sequences: list[SequenceSlice]) -> None:
        self.ops = ops
        self.sequences = sequences
        self.num_tokens = sum(s.length for s in sequences)
        self.max_position = max(s.start + s.length for s in sequences)
        positions = [ops.arange(s.start, s.start + s.length, "int32") for s in sequences]
        self.positions = positions[0] if len(positions) == 1 else ops.concat(positions, 0)
        native = ops.supports("paged_attention")
        #: Per sequence: attend through the cache's ``attend`` (True) or
        #: ``read`` + the ``attention`` op (False).
        self.paged = [native and isinstance(s.cache, PagedKVStore) for s in sequences]

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
    ) -> Array:
        """Store this layer's new keys and values, and attend.

        q: ``[tokens, q_heads, dk]``; k: ``[tokens, kv_heads, dk]``;
        v: ``[tokens, kv_heads, dv]``, with tokens ordered as in the batch.
        Attention is causal over each sequence's cached and new positions,
        optionally limited to a sliding ``window`` of keys and with logit
        ``softcap``. Returns ``[tokens, q_heads, dv]``.
        """
        ops = self.ops
        outputs = []
        offset = 0
        for seq, paged in zip(self.sequences, self.paged):
            if len(self.sequences) == 1:
                qs, ks, vs = q, k, v
            else:
                stop = offset + seq.length
                qs, ks, vs = (ops.slice(x, 0, offset, stop) for x in (q, k, v))
                offset = stop
            seq.cache.write(layer, seq.start, ks, vs)
            end = seq.start + seq.length
            # Keys older than the window are invisible to every new query;
            # skipping them keeps sliding-window layers O(window).
            first = 0 if window is None else max(0, seq.start - window + 1)
            if paged:
                outputs.append(seq.cache.attend(layer, qs, first, end, scale=scale, window=window, softcap=softcap))
                continue
            keys, values = seq.cache.read(layer, first, end)
            outputs.append(ops.attention(qs, keys, values, scale=scale, window=window, softcap=softcap))
        return outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)


class DynamicContextError(CaptureError):
    """An architecture asked a static context for something that changes from
    step to step on the host (e.g. :attr:`AttentionContext.max_position`, which
    dynamic rope scaling reads): that forward cannot be one captured graph."""


class _StaticContext(AttentionContext):
    """What the static contexts share: the layers' buffers as the step's
    inputs (:attr:`keys`, :attr:`values`; new arrays after the forward on a
    functional backend such as MLX), positions as data, and no length on the host."""

    def __init__(self, ops: Backend, keys: list[Array], values: list[Array], positions: Array, tokens: int) -> None:
        self.ops = ops
        self.keys, self.values = list(keys), list(values)
        self.positions = positions
        self.num_tokens = tokens
        self.sequences = []
        self.paged = []

    @property  # type: ignore[override]
    def max_position(self) -> int:
        raise DynamicContextError("the architecture reads the sequence length on the host (max_position), "
                                  "which changes every step")


class StaticAttentionContext(_StaticContext):
    """One sequence's forward with static shapes, for a captured decode step
    (:mod:`infer.engine.capture`).

    The sequence's cache is one key and one value buffer per layer, each
    ``[capacity, kv_heads, dim]``; ``start`` (a device int32 ``[1]``) is the
    position of the first of ``tokens`` new tokens. Writes go through
    :meth:`~infer.ops.Backend.update_rows_at` and attention through
    :meth:`~infer.ops.Backend.cached_attention`, so nothing here depends on
    the position but data: the same graph serves every step. The buffers
    after the forward are :attr:`keys` and :attr:`values` (new arrays on a
    functional backend such as MLX).
    """

    def __init__(self, ops: Backend, keys: list[Array], values: list[Array], start: Array, tokens: int) -> None:
        super().__init__(ops, keys, values, ops.add(ops.arange(0, tokens, "int32"), start), tokens)
        self.start = start
        self._length = ops.add(start, tokens)

    def attention(
        self, layer: int, q: Array, k: Array, v: Array, *, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> Array:
        """Write this layer's new keys and values at :attr:`start`, then
        attend over the buffer's first ``start + tokens`` rows."""
        ops = self.ops
        self.keys[layer] = ops.update_rows_at(self.keys[layer], self.start, k)
        self.values[layer] = ops.update_rows_at(self.values[layer], self.start, v)
        return ops.cached_attention(q, self.keys[layer], self.values[layer], self._length, scale=scale,
                                    window=window, softcap=softcap)


class PagedStaticAttentionContext(_StaticContext):
    """Several sequences' decode forward with static shapes, on a paged pool,
    for a captured batched decode step (:mod:`infer.engine.capture`).

    Each of the ``batch`` sequences feeds ``tokens`` rows (one, decoding). The
    pool's layers are their flat ``[rows, kv_heads, dim]`` arrays
    (:meth:`~infer.kv.paged.PagedKVPool.layer_rows`); everything that changes
    from step to step is data: ``positions`` (int32 ``[batch * tokens]``),
    ``slots`` (the pool row each new position is written to, the same shape),
    ``tables`` (int32 ``[batch, width]``, each sequence's blocks) and
    ``lengths`` (int32 ``[batch]``, its keys after this step). Writes go
    through :meth:`~infer.ops.Backend.scatter_rows` and attention through
    :meth:`~infer.ops.Backend.batched_paged_attention`, so a batch and table
    width keep one graph for every step. The arrays after the forward are
    :attr:`keys` and :attr:`values`.
    """

    def __init__(self, ops: Backend, keys: list[Array], values: list[Array], positions: Array, slots: Array,
                 tables: Array, lengths: Array, *, block_size: int, tokens: int) -> None:
        super().__init__(ops, keys, values, positions, tokens)
        self._slots, self._tables, self._lengths, self._block = slots, tables, lengths, block_size

    def attention(
        self, layer: int, q: Array, k: Array, v: Array, *, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> Array:
        """Write this layer's new keys and values to their slots, then attend
        over each sequence's pages."""
        ops = self.ops
        self.keys[layer] = ops.scatter_rows(self.keys[layer], self._slots, k)
        self.values[layer] = ops.scatter_rows(self.values[layer], self._slots, v)
        pools = [ops.reshape(a, (-1, self._block) + tuple(ops.shape(a)[1:]))
                 for a in (self.keys[layer], self.values[layer])]
        return ops.batched_paged_attention(q, pools[0], pools[1], self._tables, self._lengths, scale=scale,
                                           window=window, softcap=softcap)
