"""The model runner: runs the network over sequences.

It owns the KV cache (docs/design.md, rule 3; docs/kv-cache.md): a sequence is its tokens and its
cache, which :meth:`Engine.new_sequence` makes, :meth:`Engine.truncate` rolls
back and :meth:`Engine.release` frees, whatever the cache's layout. One
forward is two steps. :meth:`Engine.prepare` turns any mix of sequences and
token chunks (prompts, single decode tokens, pending tokens with drafts) into
a :class:`Batch`: the flattened token ids, each sequence's place in its cache
(reserved before anything runs) and the rows of logits to return.
:meth:`Engine.run` runs the network over it, commits the new tokens and
returns a :class:`ForwardOutput`, whose greedy choices are computed on the
device so that only the sampled ids leave it. The architecture sees only an
:class:`~infer.kv.attention.AttentionContext` per forward.

The loops that call the runner are elsewhere: :mod:`infer.engine.generate` (one
request: prefill, decode, speculative decoding) and :mod:`infer.engine.batch`
(many requests, one forward per step).

A sequence's cache is contiguous (:class:`~infer.kv.cache.ContiguousKVCache`,
the default) or a page table into a shared pool
(:class:`~infer.kv.paged.PagedSequenceCache`) when the engine is given a
:class:`~infer.kv.paged.PagedKVPool` (``Engine(..., kv_pool=pool)``, or
per sequence ``new_sequence(kv_pool=pool)``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.adapters.slots import Adapters, AdapterUse
from infer.architecture import CausalLM
from infer.engine.capture import CapturedBatchDecode, CapturedDecode, capacity_bucket
from infer.errors import (AdapterNotFoundError, BackendOutputError, CacheConfigError, CacheFullError, ContextLengthError,
                          GenerationError)
from infer.kv.attention import AttentionContext, Recurrent, SequenceSlice, state_groups
from infer.kv.cache import ContiguousKVCache, SequenceCache
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.kv.state import StateStore
from infer.ops import Array, Backend, LoadSettings


#: Recurrent state slots an engine keeps (live states and checkpoints) by default.
DEFAULT_STATE_SLOTS = 64


@dataclass
class SequenceState:
    """One sequence being generated: its tokens and its cache."""

    tokens: list[int]
    cache: SequenceCache
    #: Its prompt's images (:class:`infer.multimodal.PromptMedia`), or None:
    #: every forward over it carries what they say of its positions.
    media: Any = None
    #: The LoRA adapter the sequence runs with (None: the base model);
    #: every forward of the sequence uses it (docs/adapters.md).
    adapter: AdapterUse | None = None

    def __post_init__(self) -> None:
        if self.adapter is not None:  # held again (a preempted request readmitted)
            self.adapter.done = False

    @property
    def cached(self) -> int:
        """Positions already in the KV cache."""
        return self.cache.length


@dataclass
class Batch:
    """One forward's work, prepared on the host before it runs: the new
    tokens of each sequence, flattened into one batch, where they go in each
    cache, and which rows of logits come back."""

    seqs: list[SequenceState]
    token_ids: list[list[int]]
    #: ``[tokens]`` int32: every sequence's new tokens, in batch order.
    ids: np.ndarray
    #: Per sequence: its cache, first new position and number of new tokens.
    slices: list[SequenceSlice]
    #: Per sequence: logits of every new token (True) or of its last one only.
    all_logits: list[bool]
    #: Whether the hidden states of every new token come back too (for
    #: multi-token prediction).
    capture_hidden: bool = False

    def __post_init__(self) -> None:
        self._rows: list[tuple[int, int]] = []
        self._tokens: list[int] = []
        wanted: list[int] = []
        row = token = 0
        for ids, every in zip(self.token_ids, self.all_logits):
            count = len(ids) if every else 1
            self._rows.append((row, count))
            self._tokens.append(token)
            wanted.extend(range(token + len(ids) - count, token + len(ids)))
            row += count
            token += len(ids)
        #: How many rows of logits come back.
        self.num_rows = row
        #: Positions on the flattened token axis whose logits come back, in
        #: order (None: every one), so the head projects only those.
        self.logit_tokens: list[int] | None = None if len(wanted) == token else wanted

    def rows(self, i: int) -> tuple[int, int]:
        """``(first, count)``: sequence ``i``'s rows of the returned logits."""
        return self._rows[i]

    def first_token(self, i: int) -> int:
        """Sequence ``i``'s first row on the flattened token axis."""
        return self._tokens[i]


class ForwardOutput:
    """What one forward returns: logits of the rows its batch asked for,
    the hidden states of every new token when they were asked for, and the
    host's view of the logits, each copied at most once."""

    def __init__(self, backend: Backend, batch: Batch, logits: Array, hidden: Array | None) -> None:
        self.backend = backend
        self.batch = batch
        #: ``[rows, vocab]`` on the device.
        self.logits = logits
        #: ``[tokens, hidden_size]`` on the device, or None.
        self.hidden = hidden
        self._argmax: np.ndarray | None = None
        self._host: np.ndarray | None = None

    def argmax(self) -> np.ndarray:
        """Every row's argmax, computed on the device: all greedy decoding
        reads back (one integer per row)."""
        if self._argmax is None:
            ops = self.backend
            # The row maxima ride along (one more reduction, one more small copy):
            # an argmax over NaNs is an index, and must not become a token.
            ids = ops.to_numpy(ops.argmax(self.logits, axis=-1)).reshape(-1)
            self._check(ops.to_numpy(ops.max(self.logits, axis=-1)).reshape(-1, 1), ids)
            self._argmax = ids
        return self._argmax

    def host_logits(self) -> np.ndarray:
        """The logits on the host, where the sampling rules run.

        Raises:
            BackendOutputError: the backend returned logits of the wrong shape
                or with NaNs (it is named).
        """
        if self._host is None:
            host = self.backend.to_numpy(self.logits)
            self._check(host, None)
            self._host = host
        return self._host

    def _check(self, host: np.ndarray, ids: np.ndarray | None) -> None:
        ops, rows = self.backend, self.batch.num_rows
        where = f"backend {ops.name}/{ops.device}"
        if host.ndim != 2 or host.shape[0] != rows or (ids is not None and ids.shape != (rows,)):
            shape = list(host.shape) if ids is None else f"argmax {list(ids.shape)}"
            raise BackendOutputError(f"{where} returned logits of shape {shape} for {rows} rows; expected "
                                     f"[{rows}, vocab]: the backend or the architecture is broken")
        if np.isnan(host).any():
            bad = sorted({int(r) for r in np.flatnonzero(np.isnan(host).any(axis=1))})
            raise BackendOutputError(f"{where} returned NaN logits (rows {bad} of {rows}); the model's "
                                     "weights or the backend's kernels produce NaN: try another backend or dtype")

    def hidden_of(self, i: int) -> Array:
        """Sequence ``i``'s rows of :attr:`hidden` (``[new tokens, hidden_size]``)."""
        first = self.batch.first_token(i)
        return self.backend.slice(self.hidden, 0, first, first + self.batch.slices[i].length)


def _rope_offset(s: SequenceSlice) -> int | None:
    """A slice's rope positions less its token indices where that one number
    is all it needs beyond its token ids (a captured step's inputs), else None
    (:meth:`infer.multimodal.PromptMedia.rope_offset`)."""
    return 0 if s.media is None else s.media.rope_offset(s.start, s.start + s.length)


def _rows(ops: Backend, hidden: Array, rows: list[int] | None) -> Array:
    """``rows`` of ``hidden`` (None: all of them), so the head projects only those."""
    return hidden if rows is None else ops.take(hidden, ops.from_numpy(np.asarray(rows, dtype=np.int32)), axis=0)


def check_kv_dtype(backend: Backend, kv_dtype: str | None) -> str | None:
    """``kv_dtype`` if ``backend`` stores KV pools in it, None for the compute
    dtype: :meth:`~infer.ops.LoadSettings.kv_pool_dtype`, the one place it is
    checked.

    Raises:
        CacheConfigError: the backend has no such KV dtype.
    """
    return LoadSettings(kv_dtype=kv_dtype).kv_pool_dtype(backend)


class Engine:
    """Runs a :class:`~infer.architecture.CausalLM` on a backend."""

    def __init__(self, model: CausalLM, backend: Backend, kv_pool: PagedKVPool | None = None, *,
                 state_slots: int = DEFAULT_STATE_SLOTS, kv_dtype: str | None = None) -> None:
        self.model = model
        self.backend = backend
        #: The dtype the caches this engine makes store keys and values in
        #: (:func:`check_kv_dtype`); None: the dtype they are computed in (exact).
        self.kv_dtype = check_kv_dtype(backend, kv_dtype)
        self.max_context = model.max_context
        #: What each cache layer keeps (:meth:`~infer.architecture.CausalLM.layer_states`).
        self.layer_states = list(model.layer_states())
        self._layer_kv, _ = state_groups(self.layer_states)
        recurrent = {i: s for i, s in enumerate(self.layer_states) if isinstance(s, Recurrent)}
        if recurrent and state_slots < 2:
            raise CacheConfigError(f"state_slots must be at least 2 (a sequence's live state and a checkpoint), "
                                   f"got {state_slots}")
        #: The recurrent layers' per-sequence states and checkpoints (None: none).
        self.state_store = StateStore(backend, recurrent, state_slots) if recurrent else None
        if kv_pool is not None and self.state_store is not None and kv_pool.state_store is None:
            kv_pool.state_store = self.state_store
        #: Where new sequences keep their keys and values: pages of this pool,
        #: or (None) a contiguous cache each.
        self.kv_pool = kv_pool
        self._kv_bytes_per_position: int | None = None
        #: The captured greedy decode step (:mod:`infer.engine.capture`), when on.
        self.decode_step: CapturedDecode | None = None
        #: The captured decode forward of paged sequences, one token each, when on.
        self.batch_step: CapturedBatchDecode | None = None
        #: The model's LoRA adapters (None until one is loaded: ``Model.load_adapter``).
        self.adapters: Adapters | None = None
        #: Most prompt tokens one forward of :func:`infer.engine.generate.prefill`
        #: takes (None: the whole prompt at once; default: the backend's
        #: :attr:`~infer.ops.Backend.prefill_chunk`). A forward's activations
        #: grow with its tokens (a 1B model's MLP holds 2 x 8,192 floats a
        #: token), so a long prompt goes in chunks, each attending to the cache
        #: the ones before it wrote, as the batch engine's ``max_batch_tokens`` does.
        self.prefill_chunk: int | None = backend.prefill_chunk
        #: The KV pools sized by a memory budget (:meth:`new_kv_pool`): the
        #: loaded adapters' bytes come out of each one's pages, whenever
        #: they load (``Adapters.budgets``).
        self.budget_pools: weakref.WeakSet[PagedKVPool] = weakref.WeakSet()

    def capture_decode(self, *, compile: bool = True) -> CapturedDecode:
        """Run decode steps through captured graphs from now on
        (``infer.load(..., compile=True)`` does this where the backend can
        compile): greedy steps of contiguous sequences (:attr:`decode_step`)
        and every forward of paged sequences feeding one token each
        (:attr:`batch_step`: the batch engine's decode steps).
        ``compile=False`` runs the same static-shape steps uncompiled. New
        contiguous sequences' capacities are rounded up to a power of two so
        that requests share graphs."""
        self.decode_step = CapturedDecode(self.model, self.backend, compile=compile)
        self.batch_step = CapturedBatchDecode(self.model, self.backend, self.max_context, compile=compile)
        return self.decode_step

    # -- sequences ----------------------------------------------------------

    def new_sequence(self, capacity: int | None = None, *, kv_pool: PagedKVPool | None = None,
                     adapter: str | AdapterUse | None = None, adapter_scale: float = 1.0) -> SequenceState:
        """A fresh sequence whose cache holds ``capacity`` positions (default:
        the model's context): pages of ``kv_pool`` (default: the engine's
        :attr:`kv_pool`), or a contiguous cache when there is no pool.
        ``adapter``: the name of a loaded LoRA adapter (or a hold on one,
        :meth:`adapter_use`) every forward of the sequence runs with, its term
        times ``adapter_scale``; its prefix-cache keys are the adapter's own."""
        use = self.adapter_use(adapter, adapter_scale)
        capacity = self.max_context if capacity is None else min(capacity, self.max_context)
        pool = kv_pool if kv_pool is not None else self.kv_pool
        if pool is not None:
            cache = pool.new_sequence(capacity, extra_key=b"" if use is None else use.extra_key)
            return SequenceState(tokens=[], cache=cache, adapter=use)
        if self.decode_step is not None:
            capacity = capacity_bucket(capacity, self.max_context)
        return SequenceState(tokens=[], cache=self.contiguous_cache(capacity), adapter=use)

    def adapter_use(self, adapter: str | AdapterUse | None, scale: float = 1.0) -> AdapterUse | None:
        """A sequence's hold on adapter ``adapter`` (a name; a hold is returned
        as it is; None: the base model).

        Raises:
            AdapterNotFoundError: no adapter of that name is loaded.
        """
        if adapter is None or isinstance(adapter, AdapterUse):
            return adapter
        if self.adapters is None:
            raise AdapterNotFoundError(f"no adapter named {adapter!r} is loaded (loaded: none)")
        return self.adapters.use(adapter, scale)

    def contiguous_cache(self, capacity: int) -> ContiguousKVCache:
        """A contiguous cache of ``capacity`` positions for this model (its
        recurrent state in a slot of :attr:`state_store`)."""
        states = None if self.state_store is None else self.state_store.new_sequence()
        return ContiguousKVCache(self.backend, self.model.num_cache_layers, capacity, layer_kv=self._layer_kv,
                                 states=states, dtype=self.kv_dtype)

    def truncate(self, seq: SequenceState, length: int) -> None:
        """Forget ``seq``'s positions from ``length`` on (rejected speculative
        tokens): its cache rolls back and the next forward starts there. A
        state that cannot be cut at ``length`` (recurrent layers between
        checkpoints; a sliding window rolled back past its margin) goes back
        further, and the tokens between are fed again."""
        length = min(length, len(seq.tokens))
        kept = seq.cache.truncate(length)
        replay = seq.tokens[kept:length]
        del seq.tokens[kept:]
        if replay:
            self.run(self.prepare([seq], [replay]))

    def release(self, seq: SequenceState) -> None:
        """Done with ``seq``: its cache's memory (a paged cache's pages) goes back
        now, and it no longer holds its adapter."""
        seq.cache.free()
        if seq.adapter is not None:
            seq.adapter.done = True

    def new_kv_pool(
        self, *, block_size: int = 16, num_blocks: int | None = None, memory_budget: int | None = None,
        shared_pages: bool = False,
    ) -> PagedKVPool:
        """A paged pool for this engine's model, sized by ``num_blocks`` or
        by ``memory_budget`` bytes; then the bytes one position takes are
        those :meth:`kv_bytes_per_position` measures. ``shared_pages``: one
        page size and one allocator for every state group, where the layers
        allow (:func:`~infer.kv.paged.one_page_size`), so the pages sliding
        windows give back serve the full-attention layers too.

        A ``memory_budget`` also holds the LoRA adapters' factors: the pool
        withholds pages covering the bytes of those loaded now, and of those
        loaded or unloaded later (:attr:`budget_pools`; docs/adapters.md, "Memory")."""
        per_token = None if memory_budget is None else self.kv_bytes_per_position()
        store = self.state_store
        if memory_budget is not None and store is not None:  # the state slots come out of the same budget
            memory_budget -= store.num_slots * store.nbytes_per_slot
        # Layers num_layers.. hold the model's MTP modules' keys and values (CausalLM.num_cache_layers).
        pool = PagedKVPool(self.backend, self.model.num_cache_layers, block_size=block_size, num_blocks=num_blocks,
                           memory_budget=memory_budget, bytes_per_token=per_token,
                           layer_states=self.layer_states, state_store=store, shared_pages=shared_pages,
                           dtype=self.kv_dtype)
        if memory_budget is not None:
            # The loaded adapters' factors take pages out of the same budget, as
            # they will when loaded later (Adapters.load): one rule either way.
            adapters = self.adapters
            held = 0 if adapters is None else adapters.nbytes
            try:
                pool.hold_bytes(held)
            except CacheFullError:
                names = ", ".join(adapters.loaded) if adapters is not None else ""
                raise CacheFullError(
                    f"a KV memory budget of {memory_budget:,} bytes leaves no page after the loaded adapters' "
                    f"{held:,} bytes ({names}); raise the budget or unload adapters") from None
            self.budget_pools.add(pool)
        return pool

    def kv_bytes_per_position(self) -> int:
        """Bytes one position takes in every KV cache layer (the main model's
        and the MTP modules'), measured once, with a one-token forward (and
        one step of each MTP module) into a throwaway contiguous cache, so
        every layer's real key and value shapes and dtypes count
        (sliding-window layers, latent attention, ...)."""
        if self._kv_bytes_per_position is None:
            ops, model = self.backend, self.model
            states = None if self.state_store is None else StateStore(
                ops, self.state_store.specs, 1).new_sequence()
            cache = ContiguousKVCache(ops, model.num_cache_layers, 1, layer_kv=self._layer_kv, states=states,
                                      dtype=self.kv_dtype)
            ids = ops.from_numpy(np.zeros(1, dtype=np.int32))
            hidden = model.forward(ids, AttentionContext(ops, [SequenceSlice(cache, 0, 1)]))
            for depth in range(model.num_mtp_modules):
                hidden = model.mtp_forward(depth, hidden, ids, AttentionContext(ops, [SequenceSlice(cache, 0, 1)]))
            self._kv_bytes_per_position = cache.nbytes_per_position
        return self._kv_bytes_per_position

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Every id must be an int within the vocabulary."""
        vocab = self.model.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise GenerationError(f"token id {t!r} at index {i} is outside the vocabulary [0, {vocab})")

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """A prompt must be non-empty, in the vocabulary, and leave room to generate."""
        if len(prompt_ids) == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        self.check_tokens(prompt_ids)
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.max_context} positions, and at least one must remain for generation: "
                f"shorten the prompt by {len(prompt_ids) - self.max_context + 1} tokens or more"
            )

    # -- forwards -------------------------------------------------------------

    def prepare(
        self, seqs: Sequence[SequenceState], token_ids: Sequence[Sequence[int]], *,
        all_logits: bool | Sequence[bool] = False, capture_hidden: bool = False,
    ) -> Batch:
        """One forward's work: ``token_ids[i]`` (non-empty) appended to
        ``seqs[i]``. ``all_logits`` (one flag, or one per sequence) asks for
        the logits of every new token of a sequence (speculative
        verification), else of its last one; ``capture_hidden`` for the
        hidden states of every new token (multi-token prediction). Every
        sequence's new positions are reserved here, before anything runs, so
        a forward never runs out of cache memory half way."""
        if not seqs or len(seqs) != len(token_ids) or any(len(t) == 0 for t in token_ids):
            raise GenerationError("a forward needs one non-empty token list per sequence")
        every = [all_logits] * len(seqs) if isinstance(all_logits, bool) else list(all_logits)
        if len(every) != len(seqs):
            raise GenerationError(f"all_logits has {len(every)} flags for {len(seqs)} sequences")
        slices = []
        for seq, ids in zip(seqs, token_ids):
            start = seq.cache.length
            if start + len(ids) > seq.cache.capacity:
                raise ContextLengthError(
                    f"sequence would reach {start + len(ids)} positions; its cache holds "
                    f"{seq.cache.capacity} (model context {self.max_context})"
                )
            slices.append(SequenceSlice(seq.cache, start, len(ids), media=seq.media))
        for s in slices:
            s.cache.reserve(s.start + s.length)
        for s, ids, whole in zip(slices, token_ids, every):  # recurrent state checkpoints (infer.kv.state)
            s.checkpoints = s.cache.plan_checkpoints(ids, verify=whole and len(ids) > 1)
        chunks = [[int(t) for t in ids] for ids in token_ids]
        flat = np.asarray([t for ids in chunks for t in ids], dtype=np.int32)
        return Batch(list(seqs), chunks, flat, slices, every, capture_hidden)

    def run(self, batch: Batch) -> ForwardOutput:
        """Run the network over ``batch``; afterwards every sequence's cache
        and tokens hold its new tokens."""
        logits, hidden = self._forward(batch)
        for seq, ids in zip(batch.seqs, batch.token_ids):
            seq.cache.commit(ids)  # a paged cache keys its full blocks in the prefix cache with them
            seq.tokens.extend(ids)
        return ForwardOutput(self.backend, batch, logits, hidden)

    def _forward(self, batch: Batch) -> tuple[Array, Array | None]:
        """The network over ``batch``: the logits of the rows it asks for,
        and every new token's hidden states when it asks for them."""
        adapters = self.adapters
        if adapters is not None and any(seq.adapter is not None for seq in batch.seqs):
            logits = self._adapter_step(batch, adapters)
            if logits is not None:
                return logits, None
        if adapters is not None and any(seq.adapter is not None for seq in batch.seqs) and adapters.bind(
                [seq.adapter for seq in batch.seqs], [len(ids) for ids in batch.token_ids]):
            # Rows with adapters the captured step did not take (see _adapter_step) run eagerly.
            try:
                return self._eager_forward(batch)
            finally:
                adapters.unbind()
        ops = self.backend
        offsets = [_rope_offset(s) for s in batch.slices]
        if (self.batch_step is not None and not batch.capture_hidden
                and all(isinstance(s.cache, PagedSequenceCache) and o is not None
                        for s, o in zip(batch.slices, offsets))):
            caches = [s.cache for s in batch.slices]
            logits = self.batch_step(caches, batch.token_ids, batch.logit_tokens,  # type: ignore[arg-type]
                                     [s.checkpoints for s in batch.slices],
                                     offsets if any(offsets) else None)  # type: ignore[arg-type]
            if logits is not None:
                return logits, None
        return self._eager_forward(batch)

    def _adapter_step(self, batch: Batch, adapters: Adapters) -> Array | None:
        """The logits of a forward whose rows use adapters, from the captured
        step (each row's adapter slot and scale, and the pools, are its
        inputs); None where it does not serve: no captured step, an adapter
        that replaces whole modules (``modules_to_save``: the network's
        embedding or head itself changes), or the step's own reasons."""
        uses = [seq.adapter for seq in batch.seqs]
        rows = adapters.slot_rows(uses)
        offsets = [_rope_offset(s) for s in batch.slices]
        if (rows is None or self.batch_step is None or batch.capture_hidden
                or any(u is not None and u.loaded.saved for u in uses)
                or not all(isinstance(s.cache, PagedSequenceCache) and o is not None
                           for s, o in zip(batch.slices, offsets))):
            return None
        return self.batch_step([s.cache for s in batch.slices], batch.token_ids,  # type: ignore[misc]
                               batch.logit_tokens, [s.checkpoints for s in batch.slices],
                               offsets if any(offsets) else None, adapters=(adapters, rows))  # type: ignore[arg-type]

    def _eager_forward(self, batch: Batch) -> tuple[Array, Array | None]:
        ops = self.backend
        ctx = AttentionContext(ops, batch.slices)
        hidden = self.model.forward(ops.from_numpy(batch.ids), ctx)
        logits = self.model.compute_logits(_rows(ops, hidden, batch.logit_tokens))
        return logits, hidden if batch.capture_hidden else None

    def greedy_step(self, seq: SequenceState, token: int) -> int | None:
        """Feed ``token`` to ``seq`` through the captured decode step; the
        greedy token after it, or None where that step does not serve (not
        on, a paged cache, not capturable): then nothing changed and the
        caller runs the eager forward."""
        offset = 0 if seq.media is None else seq.media.rope_offset(seq.cached, seq.cached + 1)
        if (self.decode_step is None or not isinstance(seq.cache, ContiguousKVCache) or offset is None
                or (seq.adapter is not None and seq.adapter.loaded.saved)):
            return None
        self.check_tokens([token])
        # The row's adapter slot and scale are the step's inputs (none: the base model, or a merged adapter).
        rows = None if seq.adapter is None or self.adapters is None else self.adapters.slot_rows([seq.adapter])
        nxt = self.decode_step(seq.cache, token, offset, None if rows is None else (self.adapters, rows[0]))
        if nxt is not None:
            seq.tokens.append(int(token))
        return nxt

    def forward(self, seq: SequenceState, token_ids: Sequence[int], *, all_logits: bool = False) -> Array:
        """One sequence's forward: ``token_ids`` appended to ``seq``; logits
        ``[rows, vocab]`` of every new token (``all_logits``) or of the last."""
        return self.run(self.prepare([seq], [token_ids], all_logits=all_logits)).logits

    def mtp_forward(
        self, depth: int, seqs: Sequence[SequenceState], starts: Sequence[int], hidden: Array,
        token_ids: Sequence[Sequence[int]],
    ) -> tuple[Array, Array]:
        """Run MTP module ``depth`` over several sequences: rows at positions
        ``starts[i]..`` of ``seqs[i]`` (their cache layer ``num_layers +
        depth``; nothing is committed), ``hidden`` the flattened input states,
        ``token_ids[i]`` the tokens one position ahead. Returns each
        sequence's last-row logits and the output hidden states of every row."""
        ops = self.backend
        slices = [SequenceSlice(seq.cache, start, len(ids)) for seq, start, ids in zip(seqs, starts, token_ids)]
        flat = np.asarray([int(t) for ids in token_ids for t in ids], dtype=np.int32)
        out = self.model.mtp_forward(depth, hidden, ops.from_numpy(flat), AttentionContext(ops, slices))
        last = list(itertools.accumulate(len(ids) for ids in token_ids))  # each sequence's last row, + 1
        rows = None if last[-1] == len(last) else [end - 1 for end in last]
        return self.model.mtp_compute_logits(depth, _rows(ops, out, rows)), out
