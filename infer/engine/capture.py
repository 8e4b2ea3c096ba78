"""A decode step with static shapes, run as one captured graph where the backend can.

An eager decode step is hundreds of ops dispatched from Python, each with
shapes that grow with the sequence (the keys attended over), so a compiler
would see a new graph every step. This step is written so that it does not:

* the sequence's keys and values are the fixed-capacity buffers of its
  :class:`~infer.kv.cache.ContiguousKVCache`, written at a position given as
  data (:meth:`~infer.ops.Backend.update_rows_at`) and attended over with the
  valid length as data (:meth:`~infer.ops.Backend.cached_attention`, masking
  inside attention);
* positions come from that device array too
  (:class:`~infer.kv.attention.StaticAttentionContext`);
* the greedy choice is made on the device: only the next token id is read
  back.

The architecture's ``forward`` and ``compute_logits`` run unchanged inside
it. The backend then captures the whole step with
:meth:`~infer.ops.Backend.compile` (``torch.compile``, ``mx.compile``): one
graph, traced once per cache capacity, replayed every token. Capacities are
rounded up to a power of two (:func:`capacity_bucket`) so that requests of
different lengths share graphs.

Where the step cannot be captured, decoding stays eager and
:attr:`CapturedDecode.reason` says why: an architecture that reads the
sequence length on the host (dynamic rope scaling), an op that reads back to
the host inside the step, a compile error.

Two steps are captured. :class:`CapturedDecode` serves greedy decoding of one
sequence on a contiguous cache, the device choosing the token.
:class:`CapturedBatchDecode` serves every forward in which each sequence of
a paged pool feeds one token (the batch engine's decode steps, one request's
decode on a paged cache, a draft model's steps): the new keys land in the
pool at rows given as data, attention reads each sequence's pages through
its block table given as data, and the step returns every sequence's logits,
so the engine's samplers, logits processors and grammars run on them as on
the eager forward's. Batch sizes are rounded up to a power of two
(:func:`batch_bucket`; the padding rows write to the pool's scratch block)
and block-table widths to the blocks of a :func:`capacity_bucket`, so the
batch engine's changing batches share a few graphs. Prefill, chunks of a
prompt mixed into a step, speculative verification (several rows per
sequence) and multi-token prediction take the eager forward
(docs/performance.md).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from infer.errors import BackendOutputError, CaptureError
from infer.kv.attention import PagedStaticAttentionContext, StaticAttentionContext
from infer.kv.cache import ContiguousKVCache
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.ops import Array, Backend

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
        self._fn = ops.compile(self._step, static=True) if self.compiled else self._step

    @property
    def graphs(self) -> int | None:
        """Graphs the backend has built for the step (one per cache capacity
        and dtype; not one per token); None when not compiled."""
        count = getattr(self._fn, "graphs", None)
        return count() if count is not None else None

    def _step(self, ids: Array, start: Array, keys: list[Array], values: list[Array]) -> tuple[Array, Array, list, list]:
        ctx = StaticAttentionContext(self.ops, keys, values, start, tokens=1)
        hidden = self.model.forward(ids, ctx)
        logits = self.model.compute_logits(hidden)
        # The row maximum rides along: an argmax over NaNs is an index, never a token.
        return self.ops.argmax(logits, -1), self.ops.max(logits, -1), ctx.keys, ctx.values

    def __call__(self, cache: ContiguousKVCache, token: int) -> int | None:
        """Feed ``token`` at ``cache``'s next position; the greedy token after
        it, or None where this step cannot run (the caller runs the eager
        forward instead, which writes this position's keys and values again:
        a refused capture may have written some of them)."""
        if self.reason is not None:
            return None
        buffers = cache.layer_buffers(self.model.num_layers)
        if buffers is None:  # a layer not written yet (no prefill): its shapes are unknown
            return None
        ops, position = self.ops, cache.length
        if position + 1 > cache.capacity:
            return None  # full: the eager forward says so with its typed error
        cache.reserve(position + 1)
        ids = ops.from_numpy(np.array([token], dtype=np.int32))
        start = ops.from_numpy(np.array([position], dtype=np.int32))
        first = self.steps == 0
        try:
            next_id, top, keys, values = self._fn(ids, start, *buffers)
            token_out = int(ops.to_numpy(next_id).reshape(-1)[0])
            nan = bool(np.isnan(ops.to_numpy(top)).any())
        except Exception as exc:  # noqa: BLE001 - the first step decides; later errors are real
            # ...except a capture refused later, for a new capacity (another input
            # signature): the eager forward serves from then on, as after a first refusal.
            if not first and not isinstance(exc, CaptureError):
                raise
            self.reason = _why(exc)
            log.info("decode step not captured on %s/%s (%s); decoding eagerly", ops.name, ops.device, self.reason)
            return None
        if nan:
            raise BackendOutputError(f"backend {ops.name}/{ops.device} returned NaN logits in the captured decode "
                                     "step; the model's weights or the backend's kernels produce NaN: try another "
                                     "backend or dtype")
        cache.replace_layer_buffers(keys, values)
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


class CapturedBatchDecode:
    """Decode forwards of several sequences of one paged pool, one token
    each, with static shapes: compiled by the backend (``compile=True``) or
    run as they are (``compile=False``). Returns every sequence's logits."""

    def __init__(self, model: Any, ops: Backend, max_context: int, *, compile: bool = True) -> None:
        self.model, self.ops, self.max_context = model, ops, max_context
        self.compiled = compile and ops.supports("compile")
        #: Why steps run eagerly instead (None while the captured step works).
        self.reason: str | None = None
        #: Forwards run by the captured path, and the sequences they served.
        self.steps = self.rows = 0
        #: (batch bucket, table width) shapes the backend refused after the
        #: first step, and why: their forwards run eagerly, the others' not.
        self.refused: dict[tuple[int, int], str] = {}
        self._fn = ops.compile(self._step, static=True) if self.compiled else self._step

    @property
    def graphs(self) -> int | None:
        """Graphs the backend has built (one per batch bucket, table width and
        dtype; not one per step); None when not compiled."""
        count = getattr(self._fn, "graphs", None)
        return count() if count is not None else None

    def _step(self, ids: Array, positions: Array, slots: Array, tables: Array, lengths: Array,
              keys: list[Array], values: list[Array], block_size: int) -> tuple[Array, list, list]:
        ctx = PagedStaticAttentionContext(self.ops, keys, values, positions, slots, tables, lengths,
                                          block_size=block_size, tokens=self.ops.shape(ids)[0])
        hidden = self.model.forward(ids, ctx)
        return self.model.compute_logits(hidden), ctx.keys, ctx.values

    def inputs(self, caches: list[PagedSequenceCache], token_ids: list[int]) -> tuple[np.ndarray, ...]:
        """The step's host arrays for feeding ``token_ids[i]`` at ``caches[i]``'s
        next position (reserved): ids, positions, slots, block tables and
        lengths, padded to the batch bucket with rows on the scratch block."""
        pool = caches[0].pool
        bs, scratch = pool.block_size, pool.scratch_block
        rows = batch_bucket(len(caches))
        longest = max(c.length for c in caches) + 1
        width = -(-capacity_bucket(longest, self.max_context) // bs)
        ids = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        slots = np.full(rows, scratch * bs, np.int32)
        tables = np.full((rows, width), scratch, np.int32)
        lengths = np.ones(rows, np.int32)
        for i, (cache, token) in enumerate(zip(caches, token_ids)):
            p = cache.length
            blocks = cache.table.blocks[:p // bs + 1]
            ids[i], positions[i], lengths[i] = token, p, p + 1
            slots[i] = blocks[p // bs] * bs + p % bs
            tables[i, :len(blocks)] = blocks
        return ids, positions, slots, tables, lengths

    def __call__(self, caches: list[PagedSequenceCache], token_ids: list[int]) -> Array | None:
        """Feed ``token_ids[i]`` at the next position of ``caches[i]`` (all of
        one pool, the position reserved); the logits ``[len(caches), vocab]``,
        or None where this step cannot run (the caller runs the eager
        forward, which writes these positions again). Nothing is committed.
        More sequences than the backend's :attr:`~infer.ops.Backend.max_capture_batch`
        run as several steps (each sequence's rows are its own)."""
        if self.reason is not None or not caches:
            return None
        pool: PagedKVPool = caches[0].pool
        if any(c.pool is not pool for c in caches):
            return None
        buffers = pool.layer_rows(self.model.num_layers)
        if buffers is None:  # a layer not written yet: its shapes are unknown
            return None
        limit = self.ops.max_capture_batch or len(caches)
        parts = []
        for i in range(0, len(caches), limit):
            logits = self._run(pool, caches[i:i + limit], token_ids[i:i + limit])
            if logits is None:
                return None
            parts.append(logits)
        self.steps += 1
        self.rows += len(caches)
        return parts[0] if len(parts) == 1 else self.ops.concat(parts, 0)

    def _run(self, pool: PagedKVPool, caches: list[PagedSequenceCache], token_ids: list[int]) -> Array | None:
        ops = self.ops
        host = self.inputs(caches, token_ids)
        shape = (len(host[0]), host[3].shape[1])  # the batch bucket and the table width
        if shape in self.refused:
            return None
        buffers = pool.layer_rows(self.model.num_layers)  # anew: the previous part's arrays on MLX
        assert buffers is not None
        try:
            logits, keys, values = self._fn(*(ops.from_numpy(a) for a in host), *buffers, pool.block_size)
        except Exception as exc:  # noqa: BLE001 - the first step decides; later errors are real
            reason = _why(exc)
            if self.steps == 0 and not self.refused:
                self.reason = reason
            elif isinstance(exc, CaptureError):  # refused for this shape only: its batches run eagerly
                self.refused[shape] = reason
            else:
                raise
            log.info("batched decode step of %d rows, %d blocks wide, not captured on %s/%s (%s); those steps "
                     "run eagerly", shape[0], shape[1], ops.name, ops.device, reason)
            return None
        pool.replace_layer_rows(keys, values)
        return logits if len(caches) == shape[0] else ops.slice(logits, 0, 0, len(caches))

    def describe(self) -> str:
        """One line for ``infer doctor`` and logs: captured or not, and why."""
        if self.reason is not None:
            return f"batched decode step eager: {self.reason}"
        if not self.compiled:
            return f"batched decode step with static shapes, not compiled ({self.steps} steps)"
        refused = "".join(f"; {b} rows x {w} blocks eager ({why})" for (b, w), why in self.refused.items())
        return (f"batched decode step captured: {self.graphs} graph(s) for {self.steps} steps of {self.rows} rows"
                f"{refused}")
