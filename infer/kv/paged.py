"""The paged KV cache: one pool of backend memory, pages handed to sequences.

:class:`PagedKVPool` holds, per layer, one key and one value array of
``(num_blocks + 1) * block_size`` rows (``[rows, kv_heads, head_dim]``; the
last block is scratch, see below); row ``block * block_size + offset`` is
position ``offset`` of physical block ``block``. These rows are the
``k_pool``/``v_pool`` of :meth:`infer.ops.Backend.attention`, which reads
each sequence's keys through its block table.
Like :class:`~infer.kv.cache.ContiguousKVCache`, each layer's arrays are created
at its first write, from the shapes written, so layers of different widths
need no special case; the *number* of blocks is fixed at start-up (a block
count, or a memory budget in bytes).

:class:`PagedSequenceCache` is one sequence's view: a
:class:`~infer.kv.blocks.BlockTable` from the pool's
:class:`~infer.kv.blocks.BlockAllocator`. Its :meth:`~PagedSequenceCache.locate`
gives the pool rows (slots) of a forward's new positions and its block
table, from which the forward's description is built
(:func:`infer.kv.attention.describe`): the attention context then writes each
layer's keys and values to those rows (:meth:`~infer.ops.Backend.scatter_rows`,
in place on numpy and torch, functionally on MLX) and attends through the
tables. Its lifecycle is every cache's (:class:`~infer.kv.cache.SequenceCache`):
``reserve`` takes the pages a forward will write (copying shared ones first),
``commit`` enters full blocks in the prefix cache, ``truncate`` and ``free``
give pages back. Padding rows of a captured step use the scratch block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from infer.errors import CacheConfigError, CacheFullError
from infer.kv.blocks import BlockAllocator, BlockTable, PoolStats
from infer.kv.cache import LayerStore, SequenceCache
from infer.ops import Backend

log = logging.getLogger(__name__)


class PagedKVPool(LayerStore):
    """Keys and values of every sequence, in pages of ``block_size`` positions.

    Size it with ``num_blocks``, or with ``memory_budget`` (bytes for keys and
    values of every layer) together with ``bytes_per_token`` (what one
    position costs across all layers;
    :meth:`~infer.engine.Engine.new_kv_pool` measures it).

    The layers' arrays hold one block more than ``num_blocks``: the scratch
    block (:attr:`scratch_block`), never handed to a sequence, where the
    padding rows of a captured batched decode step write and read
    (:mod:`infer.engine.capture`; a batch of 5 runs the graph made for 8).
    A ``memory_budget`` counts it.
    """

    def __init__(
        self,
        backend: Backend,
        num_layers: int,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_budget: int | None = None,
        bytes_per_token: int | None = None,
    ) -> None:
        if (num_blocks is None) == (memory_budget is None):
            raise CacheConfigError("size the KV pool with exactly one of num_blocks and memory_budget")
        bytes_per_block = None if bytes_per_token is None else bytes_per_token * block_size
        if memory_budget is not None:
            if bytes_per_block is None:
                raise CacheConfigError("a memory_budget needs bytes_per_token (Engine.new_kv_pool measures it)")
            num_blocks = memory_budget // bytes_per_block - 1  # the scratch block's share
            if num_blocks < 1:
                raise CacheFullError(
                    f"a KV memory budget of {memory_budget:,} bytes holds no block: one block of "
                    f"{block_size} positions takes {bytes_per_block:,} bytes, and the pool needs two (one is "
                    "its scratch block); raise the budget or lower block_size"
                )
        assert num_blocks is not None
        super().__init__(backend, num_layers, (num_blocks + 1) * block_size, block_size)  # the scratch block last
        self.num_blocks = num_blocks
        #: The block past the sequences' blocks: padding rows of a captured
        #: batched step write there (its contents are never keys of a sequence).
        self.scratch_block = num_blocks
        self.allocator = BlockAllocator(num_blocks, block_size, bytes_per_block=bytes_per_block)
        self._bytes_known = bytes_per_token is not None
        #: Called with every list of block copies :meth:`copy_blocks` makes
        #: (a tensor-parallel driver repeats them on the other ranks' pools).
        self.copy_listeners: list[Callable[[Sequence[tuple[int, int]]], None]] = []
        log.info("paged KV cache: %d blocks of %d positions on %s/%s", num_blocks, block_size, backend.name,
                 backend.device)

    # -- sequences --------------------------------------------------------------------

    def new_sequence(self, capacity: int) -> PagedSequenceCache:
        """An empty sequence of at most ``capacity`` positions."""
        return PagedSequenceCache(self, BlockTable(), capacity)

    def stats(self) -> PoolStats:
        """Block counts (see :class:`~infer.kv.blocks.PoolStats`)."""
        return self.allocator.stats()

    # -- backend memory ---------------------------------------------------------------

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every allocated layer (copy-on-write)."""
        for listener in self.copy_listeners:
            listener(copies)
        ops, bs = self.backend, self.block_size
        src = np.concatenate([np.arange(s * bs, s * bs + bs) for s, _ in copies]).astype(np.int32)
        dst = ops.from_numpy(np.concatenate([np.arange(d * bs, d * bs + bs) for _, d in copies]).astype(np.int32))
        ids = ops.from_numpy(src)
        for layer in range(self.num_layers):
            keys, values = self._keys[layer], self._values[layer]
            if keys is None:
                continue
            self._keys[layer] = ops.scatter_rows(keys, dst, ops.take(keys, ids, axis=0))
            self._values[layer] = ops.scatter_rows(values, dst, ops.take(values, ids, axis=0))

    def _allocated(self, layer: int) -> None:
        if not self._bytes_known:  # grows to the true figure as layers appear
            self.allocator.bytes_per_block = self.nbytes_per_position * self.block_size

    def rows_of(self, blocks: Sequence[int], start: int, stop: int) -> np.ndarray:
        """int32 pool rows of positions ``start..stop`` of a sequence whose table is ``blocks``."""
        bs = self.block_size
        p = np.arange(start, stop)
        return (np.asarray(blocks, np.int64)[p // bs] * bs + p % bs).astype(np.int32)


class PagedSequenceCache(SequenceCache):
    """One sequence's keys and values in a :class:`PagedKVPool`.

    The engine reserves a forward's pages, writes its new keys and values
    layer by layer, then :meth:`commit`\\ s the forward's token ids: full
    blocks then join the pool's prefix cache. :meth:`free` returns the pages
    at once.
    """

    def __init__(self, pool: PagedKVPool, table: BlockTable, capacity: int, tokens: list[int] | None = None) -> None:
        self.pool = pool
        self.table = table
        #: Most positions this sequence may hold (its context).
        self.capacity = capacity
        #: Token ids of the committed positions (the prefix-cache keys).
        self.tokens: list[int] = [] if tokens is None else tokens

    @property
    def length(self) -> int:
        """Positions written and committed."""
        return self.table.num_tokens

    @property
    def store(self) -> PagedKVPool:  # type: ignore[override]
        return self.pool

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        """Positions ``start..stop`` made writable (taking blocks from the pool
        as needed, copying a shared block first) and their pool rows, with
        the block table up to ``stop``."""
        self._check_capacity(start, stop - start)
        self.prepare_positions(start, stop)
        blocks = self.table.blocks[:-(-stop // self.pool.block_size)]
        return self.pool.rows_of(blocks, start, stop), list(blocks)

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        return self.pool.rows_of(self.table.blocks, start, stop), list(self.table.blocks)

    # -- lifecycle --------------------------------------------------------------------

    def reserve(self, stop: int) -> None:
        """Take the pages of positions ``length..stop`` now, copying shared
        ones (all or nothing: :class:`~infer.errors.CacheFullError` when the
        pool, counting evictable cached pages, cannot supply them)."""
        self._check_capacity(self.length, stop - self.length)
        self._prepare(self.length, stop)

    def commit(self, token_ids: Sequence[int]) -> None:
        """Record the ids of the positions just written (after a forward)."""
        self.tokens.extend(int(t) for t in token_ids)
        self.pool.allocator.commit(self.table, self.tokens)

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Start this (empty) sequence with the pool's cached blocks for the
        longest full-block prefix of ``tokens``; returns how many positions
        need no computing. Pass a prompt without its last token, so at least
        one token is left to compute the next logits from."""
        reused = self.pool.allocator.attach_prefix(self.table, tokens)
        self.tokens = [int(t) for t in tokens[:reused]]
        return reused

    def fork(self) -> PagedSequenceCache:
        """A sequence sharing this one's blocks (e.g. parallel samples of one
        prompt); a block is copied only when one of them writes it."""
        table = self.pool.allocator.fork(self.table)
        return PagedSequenceCache(self.pool, table, self.capacity, list(self.tokens))

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (e.g. rejected speculative
        tokens); their blocks go back to the pool."""
        self.pool.allocator.truncate(self.table, length)
        del self.tokens[self.table.num_tokens:]

    def free(self) -> None:
        """Return every page to the pool now; the cache is empty afterwards."""
        self.pool.allocator.free_table(self.table)
        self.tokens.clear()

    @property
    def nbytes_per_position(self) -> int:
        return self.pool.nbytes_per_position

    def prepare_positions(self, start: int, stop: int) -> None:
        """Make positions ``start..stop`` writable as :meth:`write` does
        first (taking blocks, copying shared ones); doing it again changes
        nothing. A write past the committed end (an MTP module's chained
        draft positions) reserves the gap too: tables have no holes."""
        self._prepare(min(start, self.length), stop)

    def _prepare(self, start: int, stop: int) -> None:
        copies = self.pool.allocator.prepare_write(self.table, start, stop)
        if copies:
            self.pool.copy_blocks(copies)
