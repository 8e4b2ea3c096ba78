"""Forwards with static shapes, run as captured graphs where the backend can.

An eager forward is hundreds of ops dispatched from Python, each with shapes
that grow with the sequence (the keys attended over), so a compiler would see
a new graph every step. The engine's one forward description
(:class:`~infer.kv.attention.AttentionContext`) is what makes a step
capturable: positions, the pool rows new keys go to, each sequence's query
rows, length and block table are all *data*, and the keys are attended over
in the pool's fixed-size arrays, so only the counts of tokens and sequences
shape the graph. The engine captures the step per shape bucket; an
architecture's ``forward`` and ``compute_logits`` run unchanged inside it.

Two steps are captured:

* :class:`CapturedDecode`: greedy decoding of one sequence on a contiguous
  cache (one block of its capacity), the device choosing the token so that
  only its id is read back. One graph per cache capacity, capacities rounded
  up to a power of two (:func:`capacity_bucket`) so that requests share them.
  A hybrid's state slot is an input as in the batched step below, and its
  arrays go in and come back; a step that writes a state checkpoint (every
  :data:`~infer.kv.cache.CHECKPOINT_INTERVAL` positions) takes the
  checkpoint's row and slot too, so such models have two graphs per capacity.
* :class:`CapturedBatchDecode`: every forward of sequences of one paged pool
  that needs no hidden states: decode rows, prompt chunks, speculative
  verification rows, any mix of them. It returns the logits of the rows the
  forward asks for, so the engine's samplers, logits processors and grammars
  run on them as on the eager forward's. Tokens, sequences, logit rows and
  block-table widths are rounded up to buckets (:func:`token_bucket`,
  :func:`batch_bucket`, :func:`capacity_bucket`); padding rows belong to one
  padding sequence on the pool's scratch block. Forwards with more tokens
  than the backend's :attr:`~infer.ops.Backend.max_capture_tokens` (numpy's
  programs: its kernel rows) run eagerly, as do forwards that need the hidden
  states (multi-token prediction). Recurrent layers' state is data too: each
  sequence's state slot and the forward's checkpoint rows and slots are
  inputs, the state arrays go in and come back (docs/kv-cache.md,
  "Recurrent state"), so hybrids capture one graph per bucket as well where
  the compiled step holds the recurrent ops (numpy's and torch/cpu's
  programs; torch.compile and mx.compile run those forwards eagerly).

The backend captures a step with :meth:`~infer.ops.Backend.compile`
(``torch.compile``, ``mx.compile``, numpy's recorded program of its C
kernels). Where a step cannot be captured it runs eagerly and ``reason``
(or ``refused``, per shape) says why: an architecture that reads the
sequence length on the host (dynamic rope scaling), an op that reads back to
the host inside the step, a compile error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.errors import BackendOutputError, CaptureError
from infer.kv.attention import AttentionContext, LayerArrays
from infer.kv.cache import ContiguousKVCache, LayerStore
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.ops import Array, AttentionBatch, Backend

log = logging.getLogger(__name__)

#: Smallest cache capacity a captured step is traced for.
MIN_CAPACITY = 256


def capacity_bucket(capacity: int, max_context: int) -> int:
    """``capacity`` rounded up to a power of two (at least
    :data:`MIN_CAPACITY`), never past ``max_context``: requests of similar
    lengths then share one traced graph."""
    bucket = MIN_CAPACITY
    while bucket < capacity:
        bucket *= 2
    return min(bucket, max_context)


def _why(exc: Exception) -> str:
    """A refused capture's reason: the error's type and first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def batch_bucket(batch: int) -> int:
    """``batch`` rounded up to a power of two: the batch sizes one graph serves."""
    bucket = 1
    while bucket < batch:
        bucket *= 2
    return bucket


def token_bucket(tokens: int, block_size: int) -> int:
    """A step's token count rounded up: to a power of two up to
    ``block_size``, then to a multiple of it, so that the padding rows (one
    padding sequence on the pool's one scratch block) never outnumber its rows."""
    if tokens > block_size:
        return -(-tokens // block_size) * block_size
    return min(batch_bucket(tokens), block_size)


class CapturedDecode:
    """Greedy decode steps of one sequence at a time with static shapes,
    compiled by the backend (``compile=True``) or run as they are
    (``compile=False``: the same static ops eagerly, which tests use to check
    the static path itself on every backend)."""

    def __init__(self, model: Any, ops: Backend, *, compile: bool = True) -> None:
        self.model, self.ops = model, ops
        self.compiled = compile and ops.supports("compile")
        #: Why steps run eagerly instead (None while the captured step works).
        self.reason: str | None = None
        #: Steps run by the captured path.
        self.steps = 0
        #: Steps whose row used a LoRA adapter, and why such steps run eagerly (None while they do not).
        self.adapter_steps = 0
        self.adapter_reason: str | None = None
        self._adapters: Any = None
        self._fn = ops.compile(self._step, static=True) if self.compiled else self._step
        #: Recurrent state: the (layer, name) order of the step's state arrays, the
        #: attention layers' storage (as the batched step's), and the (capacity,
        #: checkpoint) signatures that have run (traced already: see :meth:`_recurrent`).
        self._state_layout: list[tuple[int, str]] = []
        self._layer_kv: tuple[tuple[int, int, bool], ...] | None = None
        self._index: dict[int, int] | None = None
        self._ran: set[tuple[int, bool]] = set()

    @property
    def graphs(self) -> int | None:
        """Graphs the backend has built for the step (one per cache capacity
        and dtype, and for a model with recurrent layers per whether the step
        writes a state checkpoint; not one per token); None when not compiled."""
        count = getattr(self._fn, "graphs", None)
        return count() if count is not None else None

    def _step(self, ids: Array, start: Array, keys: list[Array], values: list[Array],
              offset: Array | None = None, recurrent: list[Array | None] | None = None,
              adapter: list[Array] | None = None) -> tuple[Any, ...]:
        if adapter is not None:  # the row's adapter slot and scale, then the pools: the adapted weights read them
            own = self._adapters.swap_in(adapter[0], adapter[1], adapter[2:])
            try:
                return self._step(ids, start, keys, values, offset, recurrent)
            finally:
                self._adapters.swap_out(own)
        ops = self.ops
        # Without attention layers (Mamba2) there are no buffers to tell the capacity: any will do.
        ctx = AttentionContext.contiguous(ops, keys, values, start, tokens=1, offset=offset, layer_kv=self._layer_kv,
                                          index=self._index, capacity=None if keys else 1)
        states = None
        if recurrent is not None:  # the state slot, the checkpoint row and slot (or None, None), then every state array
            states = _StateArrays(self._state_layout, recurrent[3:])  # type: ignore[arg-type]
            ctx.with_states(states, recurrent[0], recurrent[1], recurrent[2])
        hidden = self.model.forward(ids, ctx)
        logits = self.model.compute_logits(hidden)
        # The row maximum rides along: an argmax over NaNs is an index, never a token.
        if states is None:
            return ops.argmax(logits, -1), ops.max(logits, -1), ctx.keys, ctx.values
        return ops.argmax(logits, -1), ops.max(logits, -1), ctx.keys, ctx.values, states.flat()

    def __call__(self, cache: ContiguousKVCache, token: int, offset: int = 0,
                 adapter: tuple[Any, tuple[int, float]] | None = None) -> int | None:
        """Feed ``token`` at ``cache``'s next position; the greedy token after
        it, or None where this step cannot run (the caller runs the eager
        forward instead, which writes this position's keys and values again:
        a refused capture may have written some of them). ``offset``: the
        token's rope position less its index (an input of the step like the
        position, so every offset shares the graph). ``adapter``: the
        model's :class:`~infer.adapters.slots.Adapters` and the row's
        ``(slot, scale)``, which are the step's inputs with the pools."""
        if self.reason is not None or (adapter is not None and self.adapter_reason is not None):
            return None
        if cache.states is not None:
            return self._recurrent(cache, token, offset, adapter)
        buffers = cache.layer_rows(self.model.num_layers)
        if buffers is None:  # a layer not written yet (no prefill): its shapes are unknown
            return None
        ops, position = self.ops, cache.length
        if position + 1 > cache.capacity:
            return None  # full: the eager forward says so with its typed error
        cache.reserve(position + 1)
        self._layer_kv = self._index = None
        try:
            token_out, nan, keys, values = self._run(token, position, buffers, offset, None, adapter)
        except _Refused:
            return None
        if nan:
            raise BackendOutputError(f"backend {ops.name}/{ops.device} returned NaN logits in the captured decode "
                                     "step; the model's weights or the backend's kernels produce NaN: try another "
                                     "backend or dtype")
        cache.replace_layer_rows(keys, values)
        cache.commit([token])
        self.steps += 1
        return token_out

    def _run(self, token: int, position: int, buffers: tuple[list[Array], list[Array]], offset: int,
             recurrent: list[Any] | None = None, adapter: tuple[Any, tuple[int, float]] | None = None,
             ) -> tuple[int, bool, list[Array], list[Array], list[Array]]:
        """The step on the host's ``token`` at ``position`` (its rope position
        moved by ``offset``; ``recurrent`` and ``adapter``: the step's state and
        adapter inputs, as :meth:`_recurrent` and :meth:`__call__` make them):
        the greedy token, whether the logits had a NaN, and the arrays it
        returns. Raises :class:`_Refused` (the reason kept) where the capture
        is refused."""
        ops = self.ops
        ids = ops.from_numpy(np.array([token], dtype=np.int32))
        start = ops.from_numpy(np.array([position], dtype=np.int32))
        shift = ops.from_numpy(np.array([offset], dtype=np.int32))
        first = self.steps == 0
        extra: list[Any] = [] if recurrent is None else [recurrent]
        rows = None
        if adapter is not None and adapter[0].pools():
            self._adapters = adapter[0]
            slot, scale = adapter[1]
            rows = [ops.from_numpy(np.array([slot], np.int32)), ops.from_numpy(np.array([scale], np.float32)),
                    *adapter[0].pools()]
            extra = [recurrent, rows]  # the recurrent inputs' place kept (None without them)
        try:
            next_id, top, *arrays = self._fn(ids, start, *buffers, shift, *extra)
            token_out = int(ops.to_numpy(next_id).reshape(-1)[0])
            nan = bool(np.isnan(ops.to_numpy(top)).any())
        except Exception as exc:  # noqa: BLE001 - the first step decides; later errors are real
            # ...except a capture refused later, for a new capacity (another input
            # signature): the eager forward serves from then on, as after a first refusal.
            if rows is not None and self.adapter_steps == 0:  # adapter rows refused: base-only steps keep capture
                self.adapter_reason = _why(exc)
                log.info("decode steps with adapter rows not captured on %s/%s (%s)", ops.name, ops.device,
                         self.adapter_reason)
                raise _Refused from exc
            if not first and not isinstance(exc, CaptureError):
                raise
            self.reason = _why(exc)
            log.info("decode step not captured on %s/%s (%s); decoding eagerly", ops.name, ops.device, self.reason)
            raise _Refused from exc
        self.adapter_steps += rows is not None
        return (token_out, nan, *arrays)  # type: ignore[return-value]

    def _recurrent(self, cache: ContiguousKVCache, token: int, offset: int,
                   adapter: tuple[Any, tuple[int, float]] | None) -> int | None:
        """:meth:`__call__` for a model with recurrent layers: the sequence's
        state slot and, at a checkpoint position, the checkpoint's row and slot
        are inputs, and the state arrays go in and come back (as
        :class:`CapturedBatchDecode`'s; a step without a checkpoint has none,
        so it writes no padding state: two programs per capacity)."""
        states = cache.states
        assert states is not None
        store, ops = states.store, self.ops
        if self.compiled and not getattr(self._fn, "captures_recurrent", False):
            return None  # torch.compile's and mx.compile's steps would read the batch on the host
        layers = self.model.num_layers
        if cache.layer_kv is None:
            return None
        buffers = LayerStore.layer_rows(cache, layers)  # the attention layers' own arrays only
        if buffers is None:  # a layer not written yet (no prefill): its shapes are unknown
            return None
        position = cache.length
        if position + 1 > cache.capacity:
            return None
        cache.reserve(position + 1)
        marks = cache.plan_checkpoints([token], verify=False)  # at most one: after this token
        self._layer_kv = tuple(cache.layer_kv)
        self._index = {layer: i for i, layer in enumerate(cache.storage_layers(layers))}
        self._state_layout = [(layer, name) for layer in sorted(store.arrays) for name in sorted(store.arrays[layer])]
        i32 = lambda xs: ops.from_numpy(np.asarray(xs, np.int32))  # noqa: E731
        ck_rows, ck_slots = (i32([0]), i32([marks[0][1]])) if marks else (None, None)
        extra = [i32([states.slot]), ck_rows, ck_slots,
                 *(store.arrays[layer][name] for layer, name in self._state_layout)]
        signature = (cache.capacity, bool(marks))
        before = None
        if signature not in self._ran:
            # A new program is traced by running it: a refused trace may have advanced some layers'
            # live state already, which (unlike keys and values) the eager forward cannot write again.
            live = i32([states.slot])
            before = {key: ops.take(store.arrays[key[0]][key[1]], live, axis=0) for key in self._state_layout}
        try:
            token_out, nan, keys, values, flat = self._run(token, position, buffers, offset, extra, adapter)
        except _Refused:
            if before is not None:
                for (layer, name), rows in before.items():
                    store.arrays[layer][name] = ops.scatter_rows(store.arrays[layer][name], live, rows)
            states.cancel()  # the eager forward plans its checkpoints again
            return None
        self._ran.add(signature)
        if nan:
            states.cancel()
            raise BackendOutputError(f"backend {ops.name}/{ops.device} returned NaN logits in the captured decode "
                                     "step; the model's weights or the backend's kernels produce NaN: try another "
                                     "backend or dtype")
        for (layer, name), array in zip(self._state_layout, flat):
            store.arrays[layer][name] = array
        cache.replace_layer_rows(keys, values)  # the store's: the storage layers' arrays
        cache.commit([token])
        self.steps += 1
        return token_out

    def describe(self) -> str:
        """One line for ``infer doctor`` and logs: captured or not, and why."""
        if self.reason is not None:
            return f"decode step eager: {self.reason}"
        if not self.compiled:
            return f"decode step with static shapes, not compiled ({self.steps} steps)"
        return f"decode step captured: {self.graphs} graph(s) for {self.steps} steps"


class _Refused(Exception):
    """A captured decode step was refused (:attr:`CapturedDecode.reason` says why)."""


@dataclass
class StepInputs:
    """A captured forward's host arrays, padded to its buckets."""

    ids: np.ndarray          # int32 [tokens]
    positions: np.ndarray    # int32 [tokens]
    slots: np.ndarray        # int32 [tokens]: the pool row of each new key
    query_start: np.ndarray  # int32 [sequences + 1]
    tables: np.ndarray       # int32 [sequences, width]
    lengths: np.ndarray      # int32 [sequences]
    logit_rows: np.ndarray   # int32 [rows]: the token rows whose logits come back
    max_query: int
    #: The pool's further state groups (sliding windows): per group its slots and tables, as above.
    groups: list[tuple[np.ndarray, np.ndarray]]
    #: Recurrent layers' description (None without them): int32 each sequence's state slot
    #: ``[sequences]`` (padding ones on the scratch slot), the checkpoint rows and their
    #: slots ``[checkpoints]`` (padded to a bucket with row 0 into the scratch slot).
    recurrent: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    #: LoRA adapters' rows (None: no row uses one): int32 each token's adapter slot and float32
    #: its scale ``[tokens]`` (the base model's rows and the padding: slot 0, scale 0).
    adapter: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The bucket: (tokens, sequences, table width, logit rows, most query rows[, checkpoints])."""
        base = (len(self.ids), len(self.lengths), self.tables.shape[1], len(self.logit_rows), self.max_query)
        return base if self.recurrent is None else (*base, len(self.recurrent[1]))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.ids, self.positions, self.slots, self.query_start, self.tables, self.lengths, self.logit_rows)

    def group_arrays(self) -> list[np.ndarray]:
        return [a for pair in self.groups for a in pair]


class _StateArrays:
    """A captured step's recurrent state arrays as a
    :class:`~infer.kv.state.StateStore` shows them (``arrays[layer][name]``),
    ``layout`` naming the flat list's entries."""

    def __init__(self, layout: list[tuple[int, str]], flat: list[Array]) -> None:
        self.layout = layout
        self.arrays: dict[int, dict[str, Array]] = {}
        for (layer, name), a in zip(layout, flat):
            self.arrays.setdefault(layer, {})[name] = a

    def flat(self) -> list[Array]:
        """The arrays after the step, in ``layout``'s order."""
        return [self.arrays[layer][name] for layer, name in self.layout]


class CapturedBatchDecode:
    """Forwards of sequences of one paged pool with static shapes: decode
    rows, prompt chunks and verification rows alike (see the module
    docstring), compiled by the backend (``compile=True``) or run as they are
    (``compile=False``). Returns the logits of the rows each forward asks for."""

    def __init__(self, model: Any, ops: Backend, max_context: int, *, compile: bool = True) -> None:
        self.model, self.ops, self.max_context = model, ops, max_context
        self.compiled = compile and ops.supports("compile")
        #: Why steps run eagerly instead (None while the captured step works).
        self.reason: str | None = None
        #: Forwards run by the captured path, the sequences they served, and
        #: how many of them mixed prompt chunks or verification rows with decode rows.
        self.steps = self.rows = self.mixed = 0
        #: Bucket shapes the backend refused after the first step, and why:
        #: their forwards run eagerly, the others' not.
        self.refused: dict[tuple[int, ...], str] = {}
        self._fn = ops.compile(self._step, static=True) if self.compiled else self._step
        self._layer_kv: tuple[tuple[int, int, bool], ...] | None = None
        self._index: dict[int, int] | None = None
        #: Recurrent state: the (layer, name) order of the step's state arrays, and each store's scratch slot.
        self._state_layout: list[tuple[int, str]] = []
        self._scratch_slots: dict[int, int] = {}
        #: Bucket shapes that have run (traced already): a new one's live states are kept until it has.
        self._ran: set[tuple[int, ...]] = set()
        #: The model's adapters while a step with adapter rows runs (its function binds their inputs).
        self._adapters: Any = None
        #: Forwards whose rows used LoRA adapters, run by the captured path.
        self.adapter_steps = 0

    @property
    def graphs(self) -> int | None:
        """Graphs the backend has built (one per bucket and dtype; not one per
        step); None when not compiled."""
        count = getattr(self._fn, "graphs", None)
        return count() if count is not None else None

    def _step(self, ids: Array, positions: Array, slots: Array, query_start: Array, tables: Array, lengths: Array,
              logit_rows: Array, keys: list[Array], values: list[Array], block_size: int, max_query: int,
              groups: list[Array] | None = None,
              recurrent: list[Array] | None = None,
              adapter: list[Array] | None = None) -> tuple[Array, list, list] | tuple[Array, list, list, list]:
        if adapter is not None:  # each row's slot and scale, then the pools: the adapted weights read them
            own = self._adapters.swap_in(adapter[0], adapter[1], adapter[2:])
            try:
                return self._step(ids, positions, slots, query_start, tables, lengths, logit_rows, keys, values,
                                  block_size, max_query, groups, recurrent)
            finally:
                self._adapters.swap_out(own)
        groups = groups or []
        ops = self.ops
        store = LayerArrays(keys, values, block_size, self._layer_kv, self._index)
        batch = AttentionBatch(query_start, lengths, tables, block_size, max_query)
        more = [(groups[i], AttentionBatch(query_start, lengths, groups[i + 1], block_size, max_query))
                for i in range(0, len(groups), 2)]
        ctx = AttentionContext.static(ops, store, positions, slots, batch, tokens=ops.shape(ids)[0], groups=more)
        states = None
        if recurrent is not None:  # the state slots, checkpoint rows and slots, then every state array
            states = _StateArrays(self._state_layout, recurrent[3:])
            ctx.with_states(states, recurrent[0], recurrent[1], recurrent[2])
        hidden = self.model.forward(ids, ctx)
        logits = self.model.compute_logits(ops.take(hidden, logit_rows, axis=0))
        if states is None:
            return logits, store.keys, store.values
        return logits, store.keys, store.values, states.flat()

    def inputs(self, caches: list[PagedSequenceCache], token_ids: list[list[int]],
               logit_tokens: list[int] | None, checkpoints: list[list[tuple[int, int]]] | None = None,
               scratch_slot: int = -1, offsets: list[int] | None = None,
               adapter_rows: list[tuple[int, float]] | None = None) -> StepInputs:
        """The step's host arrays for feeding ``token_ids[i]`` at ``caches[i]``'s
        next positions (reserved), padded to the buckets: padding tokens form
        one more sequence, on the scratch block; padding sequences have no rows.
        ``offsets[i]``: sequence ``i``'s rope positions less its token indices
        (None: all 0), which only the positions input carries."""
        pool = caches[0].pool
        bs, scratch = pool.block_size, pool.scratch_block
        counts = [len(t) for t in token_ids]
        total = sum(counts)
        tokens = token_bucket(total, bs)
        pad = tokens - total
        seqs = batch_bucket(len(caches) + (1 if pad else 0))
        longest = max(c.length + n for c, n in zip(caches, counts))
        width = -(-capacity_bucket(longest, self.max_context) // bs)
        wanted = list(range(total)) if logit_tokens is None else logit_tokens
        rows = batch_bucket(len(wanted))
        ids = np.zeros(tokens, np.int32)
        positions = np.zeros(tokens, np.int32)
        slots = np.full(tokens, scratch * bs, np.int32)
        query_start = np.full(seqs + 1, tokens, np.int32)
        tables = np.full((seqs, width), scratch, np.int32)
        lengths = np.ones(seqs, np.int32)
        groups = [(slots.copy(), tables.copy()) for _ in pool.windows[1:]]
        at = 0
        for i, (cache, chunk) in enumerate(zip(caches, token_ids)):
            p, n = cache.length, len(chunk)
            located = cache.locate_groups(p, p + n)
            slot, blocks = located[0]
            query_start[i] = at
            shift = 0 if offsets is None else offsets[i]
            ids[at:at + n], positions[at:at + n], slots[at:at + n] = chunk, np.arange(p + shift, p + n + shift), slot
            tables[i, :len(blocks)] = blocks
            for (g_slots, g_tables), (g_slot, g_blocks) in zip(groups, located[1:]):
                g_slots[at:at + n], g_tables[i, :len(g_blocks)] = g_slot, g_blocks
            lengths[i] = p + n
            at += n
        if pad:  # one padding sequence of `pad` rows, its keys in the scratch block's first rows
            query_start[len(caches)] = at
            positions[at:] = np.arange(pad)
            slots[at:] = scratch * bs + np.arange(pad)
            for g_slots, _ in groups:
                g_slots[at:] = scratch * bs + np.arange(pad)
            lengths[len(caches)] = pad
        logit_rows = np.zeros(rows, np.int32)
        logit_rows[:len(wanted)] = wanted
        recurrent = None
        if checkpoints is not None:  # recurrent layers: state slots, checkpoint rows and slots
            state_slots = np.full(seqs, scratch_slot, np.int32)
            state_slots[:len(caches)] = [c.states.slot for c in caches]  # type: ignore[union-attr]
            found = [(int(query_start[i]) + p - c.length - 1, slot)
                     for i, (c, marks) in enumerate(zip(caches, checkpoints)) for p, slot in marks]
            ck_rows = np.zeros(batch_bucket(max(1, len(found))), np.int32)  # padding: row 0 into the scratch slot
            ck_slots = np.full(len(ck_rows), scratch_slot, np.int32)
            for j, (row, slot) in enumerate(found):
                ck_rows[j], ck_slots[j] = row, slot
            recurrent = (state_slots, ck_rows, ck_slots)
        adapter = None
        if adapter_rows is not None:  # each sequence's adapter slot and scale on its rows
            adapter = (np.zeros(tokens, np.int32), np.zeros(tokens, np.float32))
            for i, (slot, scale) in enumerate(adapter_rows):
                adapter[0][query_start[i]:query_start[i] + counts[i]] = slot
                adapter[1][query_start[i]:query_start[i] + counts[i]] = scale
        return StepInputs(ids, positions, slots, query_start, tables, lengths, logit_rows,
                          batch_bucket(max(counts)), groups, recurrent, adapter)

    def __call__(self, caches: list[PagedSequenceCache], token_ids: list[list[int]],
                 logit_tokens: list[int] | None = None,
                 checkpoints: list[list[tuple[int, int]]] | None = None,
                 offsets: list[int] | None = None,
                 adapters: tuple[Any, list[tuple[int, float]]] | None = None) -> Array | None:
        """Feed ``token_ids[i]`` at the next positions of ``caches[i]`` (all of
        one pool, the positions reserved); the logits of the token rows
        ``logit_tokens`` (None: every row), or None where this step cannot run
        (the caller runs the eager forward, which writes these positions
        again). Nothing is committed. Sequences with recurrent state need
        ``checkpoints``, each one's ``(position, slot)`` checkpoints to write
        (:attr:`~infer.kv.attention.SequenceSlice.checkpoints`): their states
        are the step's data too, one more scratch slot taking the padding's.
        ``offsets[i]``: how far sequence ``i``'s rope positions sit from its
        token indices (an M-RoPE sequence after its prompt; None: none do),
        data of the positions input, so no offset makes a graph of its own.
        ``adapters``: the model's :class:`~infer.adapters.slots.Adapters`
        and each sequence's ``(slot, scale)``
        (:meth:`~infer.adapters.slots.Adapters.slot_rows`): the rows' slots
        and scales and the stacked pools are the step's inputs, so a step
        mixing adapters and the base model runs one graph per bucket
        whichever adapters it mixes."""
        if self.reason is not None or not caches:
            return None
        pool: PagedKVPool = caches[0].pool
        if any(c.pool is not pool for c in caches):
            return None
        states = [c.states for c in caches]
        # Recurrent state in a compiled step only where the compiled step holds the recurrent ops
        # reading their batch as data (numpy's and torch/cpu's programs); torch.compile's and
        # mx.compile's steps would read it on the host, so those forwards stay eager.
        if any(st is not None for st in states) and (
                (self.compiled and not getattr(self._fn, "captures_recurrent", False)) or checkpoints is None
                or any(st is None or st.store is not states[0].store for st in states)
                or self._scratch(states[0].store) is None):
            return None
        self._layer_kv = None if pool.layer_kv is None else tuple(pool.layer_kv)
        self._index = {layer: i for i, layer in enumerate(pool.storage_layers(self.model.num_layers))}
        if pool.layer_rows(self.model.num_layers) is None:  # a layer not written yet: its shapes are unknown
            return None
        parts = self._parts([len(t) for t in token_ids])
        if parts is None:
            return None
        wanted = list(range(sum(len(t) for t in token_ids))) if logit_tokens is None else logit_tokens
        outputs, first = [], 0
        for lo, hi in parts:
            stop = first + sum(len(t) for t in token_ids[lo:hi])
            mine = [t - first for t in wanted if first <= t < stop]
            first = stop
            if not mine:
                continue
            rows = None if adapters is None else adapters[1][lo:hi]
            logits = self._run(pool, caches[lo:hi], token_ids[lo:hi], mine,
                               None if states[0] is None else checkpoints[lo:hi],  # type: ignore[index]
                               None if offsets is None else offsets[lo:hi],
                               None if rows is None or not any(scale for _, scale in rows) else
                               (adapters[0], rows))  # type: ignore[index]
            if logits is None:
                return None
            outputs.append(logits)
        self.steps += 1
        self.rows += len(caches)
        self.mixed += any(len(t) > 1 for t in token_ids)
        self.adapter_steps += adapters is not None
        return outputs[0] if len(outputs) == 1 else self.ops.concat(outputs, 0)

    def _parts(self, counts: list[int]) -> list[tuple[int, int]] | None:
        """Consecutive groups of sequences, each of at most the backend's
        :attr:`~infer.ops.Backend.max_capture_tokens` tokens (numpy's programs:
        its kernel rows), run as one captured step each (every sequence's rows
        are its own); None when one sequence alone has more."""
        limit = self.ops.max_capture_tokens
        if limit is None:
            return [(0, len(counts))]
        if max(counts) > limit:
            return None
        parts, lo, used = [], 0, 0
        for i, n in enumerate(counts):
            if used + n > limit:
                parts.append((lo, i))
                lo, used = i, 0
            used += n
        parts.append((lo, len(counts)))
        return parts

    def _scratch(self, store: Any) -> int | None:
        """The state slot the padding sequences of ``store``'s steps read and
        write (taken from it once and held), or None where none is free."""
        slot = self._scratch_slots.get(id(store))
        if slot is None:
            slot = store.take_slot()
            if slot is None:
                return None
            self._scratch_slots[id(store)] = slot
        return slot

    def _run(self, pool: PagedKVPool, caches: list[PagedSequenceCache], token_ids: list[list[int]],
             logit_tokens: list[int] | None, checkpoints: list[list[tuple[int, int]]] | None = None,
             offsets: list[int] | None = None,
             adapters: tuple[Any, list[tuple[int, float]]] | None = None) -> Array | None:
        ops = self.ops
        store = None if checkpoints is None else caches[0].states.store  # type: ignore[union-attr]
        host = self.inputs(caches, token_ids, logit_tokens, checkpoints,
                           -1 if store is None else self._scratch(store), offsets,  # type: ignore[arg-type]
                           None if adapters is None else adapters[1])
        pools = None if adapters is None else adapters[0].pools() or None
        # With adapter rows: one more bucket dimension, the pools' slots (their shapes are the program's).
        shape = host.shape if pools is None else (*host.shape, int(ops.shape(pools[0])[0]))
        if shape in self.refused:
            return None
        buffers = pool.layer_rows(self.model.num_layers)
        assert buffers is not None
        extra: list[Any] = []
        saved: tuple[Array, dict[tuple[int, str], Array]] | None = None
        if store is not None and host.recurrent is not None:
            self._state_layout = [(layer, name) for layer in sorted(store.arrays) for name in sorted(store.arrays[layer])]
            extra = [[*(ops.from_numpy(a) for a in host.recurrent),
                      *(store.arrays[layer][name] for layer, name in self._state_layout)]]
            if shape not in self._ran:
                # A new bucket is traced by running it: a refused trace may have advanced some
                # layers' live states already, and unlike keys and values (written again by the
                # eager forward) a state cannot be written twice. So they are kept until it ran.
                live = ops.from_numpy(np.asarray(sorted({c.states.slot for c in caches}), np.int32))  # type: ignore[union-attr]
                saved = (live, {key: ops.take(store.arrays[key[0]][key[1]], live, axis=0) for key in self._state_layout})
        if pools is not None:  # after the recurrent inputs (None without them): the rows, then the pools
            self._adapters = adapters[0]  # type: ignore[index]
            extra = [extra[0] if extra else None,
                     [*(ops.from_numpy(a) for a in host.adapter), *pools]]  # type: ignore[union-attr]
        try:
            out = self._fn(*(ops.from_numpy(a) for a in host.arrays()), *buffers, pool.block_size,
                           host.max_query, [ops.from_numpy(a) for a in host.group_arrays()], *extra)
            logits, keys, values = out[:3]
        except Exception as exc:  # noqa: BLE001 - the first step decides; later errors are real
            if saved is not None:  # the live states as they were before the refused trace
                live, rows = saved
                for (layer, name), before in rows.items():
                    store.arrays[layer][name] = ops.scatter_rows(store.arrays[layer][name], live, before)  # type: ignore[union-attr]
            reason = _why(exc)
            if pools is not None and shape not in self._ran:  # adapter rows refused: base-only steps keep capture
                self.refused[shape] = reason
            elif self.steps == 0 and not self.refused:
                self.reason = reason
            elif isinstance(exc, CaptureError):  # refused for this shape only: its forwards run eagerly
                self.refused[shape] = reason
            else:
                raise
            log.info("captured step of %d tokens, %d sequences, %d blocks wide not captured on %s/%s (%s); "
                     "those steps run eagerly", shape[0], shape[1], shape[2], ops.name, ops.device, reason)
            return None
        pool.replace_layer_rows(keys, values)
        self._ran.add(shape)
        if store is not None:
            for (layer, name), array in zip(self._state_layout, out[3]):
                store.arrays[layer][name] = array
        wanted = len(logit_tokens) if logit_tokens is not None else sum(len(t) for t in token_ids)
        return logits if wanted == len(host.logit_rows) else ops.slice(logits, 0, 0, wanted)

    def describe(self) -> str:
        """One line for ``infer doctor`` and logs: captured or not, and why."""
        if self.reason is not None:
            return f"batched step eager: {self.reason}"
        if not self.compiled:
            return f"batched step with static shapes, not compiled ({self.steps} steps)"
        refused = "".join(f"; {s[0]} tokens x {s[1]} sequences x {s[2]} blocks eager ({why})"
                          for s, why in self.refused.items())
        lora = f", {self.adapter_steps} with adapter rows" if self.adapter_steps else ""
        return (f"batched step captured: {self.graphs} graph(s) for {self.steps} steps of {self.rows} rows "
                f"({self.mixed} mixed{lora}){refused}")
