"""The paged KV cache: one pool of backend memory, pages handed to sequences.

:class:`PagedKVPool` holds, per layer, one key and one value array of
``(num_blocks + 1) * block_size`` rows (``[rows, kv_heads, head_dim]``; the
last block is scratch, see below); row ``block * block_size + offset`` is
position ``offset`` of physical block ``block``. Viewed as ``[num_blocks + 1,
block_size, kv_heads, head_dim]`` it is exactly the ``k_pool``/``v_pool`` of
:meth:`infer.ops.Backend.paged_attention`.
Like :class:`~infer.kv.cache.ContiguousKVCache`, each layer's arrays are created
at its first write, from the shapes written, so layers of different widths
need no special case; the *number* of blocks is fixed at start-up (a block
count, or a memory budget in bytes).

:class:`PagedSequenceCache` is one sequence's view: a
:class:`~infer.kv.blocks.BlockTable` from the pool's
:class:`~infer.kv.blocks.BlockAllocator`. It implements the attention context's
``KVStore`` protocol (``write``/``read``) plus ``attend``, which the context
calls instead of ``read`` + ``attention`` when the backend has a native
``paged_attention``; then keys and values are read through the block table
and never copied into a per-sequence array by the cache. Its lifecycle is
every cache's (:class:`~infer.kv.cache.SequenceCache`): ``reserve`` takes the
pages a forward will write (copying shared ones first), ``commit`` enters
full blocks in the prefix cache, ``truncate`` and ``free`` give pages back.

Writes go through :meth:`~infer.ops.Backend.update_rows`, one call per run of
physically consecutive rows (a fresh sequence's blocks usually are: the
allocator hands out the lowest free ids first), so the pool is updated in
place on numpy and torch and functionally on MLX. A captured batched decode
step (:mod:`infer.engine.capture`) writes instead through
:meth:`~infer.ops.Backend.scatter_rows`, one row per sequence at a row given
as data, and attends through
:meth:`~infer.ops.Backend.batched_paged_attention` with the block tables as
data; its padding rows use the scratch block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from infer.errors import CacheConfigError, CacheFullError
from infer.kv.blocks import BlockAllocator, BlockTable, PoolStats
from infer.kv.cache import SequenceCache, row_nbytes
from infer.ops import Array, Backend

log = logging.getLogger(__name__)


class PagedKVPool:
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
        self.backend = backend
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        #: The block past the sequences' blocks: padding rows of a captured
        #: batched step write there (its contents are never keys of a sequence).
        self.scratch_block = num_blocks
        self.allocator = BlockAllocator(num_blocks, block_size, bytes_per_block=bytes_per_block)
        self._keys: list[Array | None] = [None] * num_layers
        self._values: list[Array | None] = [None] * num_layers
        self._bytes_known = bytes_per_token is not None
        #: Called with every list of block copies :meth:`copy_blocks` makes
        #: (a tensor-parallel driver repeats them on the other ranks' pools).
        self.copy_listeners: list[Callable[[Sequence[tuple[int, int]]], None]] = []
        #: ``"paged_attention"`` (the backend reads through block tables) or
        #: ``"gather"`` (blocks are gathered into contiguous keys and values,
        #: then the ordinary attention op runs).
        self.attention_path = "paged_attention" if backend.supports("paged_attention") else "gather"
        log.info(
            "paged KV cache: %d blocks of %d positions on %s/%s; attention %s", num_blocks, block_size,
            backend.name, backend.device,
            "through the backend's native paged_attention" if self.attention_path == "paged_attention"
            else "by gathering each sequence's blocks (the backend has no native paged_attention)",
        )

    # -- sequences --------------------------------------------------------------------

    def new_sequence(self, capacity: int) -> PagedSequenceCache:
        """An empty sequence of at most ``capacity`` positions."""
        return PagedSequenceCache(self, BlockTable(), capacity)

    def stats(self) -> PoolStats:
        """Block counts (see :class:`~infer.kv.blocks.PoolStats`)."""
        return self.allocator.stats()

    # -- backend memory ---------------------------------------------------------------

    def write(self, layer: int, blocks: list[int], start: int, k: Array, v: Array) -> None:
        """Scatter ``k``, ``v`` (``[n, kv_heads, dim]``) to positions
        ``start..start+n`` of the sequence whose blocks are ``blocks``."""
        ops = self.backend
        n = ops.shape(k)[0]
        if self._keys[layer] is None:
            self._allocate(layer, k, v)
        runs = self._runs(blocks, start, start + n)
        keys, values = self._keys[layer], self._values[layer]
        for row, src, count in runs:
            ks = k if count == n else ops.slice(k, 0, src, src + count)
            vs = v if count == n else ops.slice(v, 0, src, src + count)
            keys = ops.update_rows(keys, row, ks)
            values = ops.update_rows(values, row, vs)
        self._keys[layer], self._values[layer] = keys, values

    def read(
        self, layer: int, blocks: list[int], start: int, stop: int,
        table: Callable[[int, int], Array] | None = None,
    ) -> tuple[Array, Array]:
        """Keys and values of positions ``start..stop``: a view when they lie
        in one physical run, else gathered block by block (``table(i, j)``
        gives ``blocks[i:j]`` as a backend int array; by default it is built)."""
        ops = self.backend
        keys, values = self._keys[layer], self._values[layer]
        runs = self._runs(blocks, start, stop)
        if len(runs) == 1:
            row = runs[0][0]
            return ops.slice(keys, 0, row, row + stop - start), ops.slice(values, 0, row, row + stop - start)
        bs = self.block_size
        first, last = start // bs, -(-stop // bs)
        if table is None:
            ids = ops.from_numpy(np.asarray(blocks[first:last], dtype=np.int32))
        else:
            ids = table(first, last)
        out = []
        for pool in (keys, values):
            tail = tuple(ops.shape(pool)[1:])
            gathered = ops.reshape(ops.take(self.paged_view(pool), ids, axis=0), (-1,) + tail)
            out.append(ops.slice(gathered, 0, start - first * bs, stop - first * bs))
        return out[0], out[1]

    def paged_view(self, pool: Array) -> Array:
        """A layer's rows viewed as ``[num_blocks, block_size, heads, dim]``."""
        ops = self.backend
        return ops.reshape(pool, (self.num_blocks + 1, self.block_size) + tuple(ops.shape(pool)[1:]))

    def layer_rows(self, layers: int) -> tuple[list[Array], list[Array]] | None:
        """The first ``layers`` layers' key and value arrays, ``[rows, heads,
        dim]`` (the scratch block's rows last), as a captured step takes
        them; None while one of them is not allocated yet (no write so far)."""
        keys, values = self._keys[:layers], self._values[:layers]
        if any(a is None for a in (*keys, *values)):
            return None
        return list(keys), list(values)  # type: ignore[arg-type]

    def replace_layer_rows(self, keys: Sequence[Array], values: Sequence[Array]) -> None:
        """After a captured step: its arrays are the layers' from now on (the
        same arrays on a backend that writes in place, new ones on MLX)."""
        self._keys[:len(keys)] = list(keys)
        self._values[:len(values)] = list(values)

    def layer_pools(self, layer: int) -> tuple[Array, Array]:
        """``(k_pool, v_pool)`` of ``layer``, shaped for
        :meth:`~infer.ops.Backend.paged_attention`."""
        return self.paged_view(self._keys[layer]), self.paged_view(self._values[layer])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every allocated layer (copy-on-write)."""
        for listener in self.copy_listeners:
            listener(copies)
        ops, bs = self.backend, self.block_size
        for layer in range(self.num_layers):
            keys, values = self._keys[layer], self._values[layer]
            if keys is None:
                continue
            for src, dst in copies:
                keys = ops.update_rows(keys, dst * bs, ops.slice(keys, 0, src * bs, src * bs + bs))
                values = ops.update_rows(values, dst * bs, ops.slice(values, 0, src * bs, src * bs + bs))
            self._keys[layer], self._values[layer] = keys, values

    def _allocate(self, layer: int, k: Array, v: Array) -> None:
        ops = self.backend
        rows = (self.num_blocks + 1) * self.block_size  # the scratch block last
        self._keys[layer] = ops.zeros((rows,) + ops.shape(k)[1:], ops.dtype(k))
        self._values[layer] = ops.zeros((rows,) + ops.shape(v)[1:], ops.dtype(v))
        if not self._bytes_known:  # grows to the true figure as layers appear
            self.allocator.bytes_per_block = self.nbytes_per_position * self.block_size

    @property
    def nbytes_per_position(self) -> int:
        """Bytes one position occupies across the layers allocated so far."""
        return sum(row_nbytes(self.backend, a) for a in (*self._keys, *self._values) if a is not None)

    def _runs(self, blocks: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(pool row, source row, count)`` for each run of consecutive pool
        rows holding positions ``start..stop``."""
        bs = self.block_size
        runs: list[tuple[int, int, int]] = []
        p = start
        while p < stop:
            offset = p % bs
            count = min(bs - offset, stop - p)
            row = blocks[p // bs] * bs + offset
            if runs and runs[-1][0] + runs[-1][2] == row:
                last = runs[-1]
                runs[-1] = (last[0], last[1], last[2] + count)
            else:
                runs.append((row, p - start, count))
            p += count
        return runs


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
        self._table_arrays: dict[tuple[int, int], Array] = {}
        self._table_key: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Positions written and committed."""
        return self.table.num_tokens

    # -- keys and values --------------------------------------------------------------

    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        """Store ``k``, ``v`` (``[n, kv_heads, dim]``) at positions
        ``start..start+n``, taking blocks from the pool as needed and copying
        a shared block before writing it."""
        n = self.pool.backend.shape(k)[0]
        self._check_capacity(start, n)
        self.prepare_positions(start, start + n)
        self.pool.write(layer, self.table.blocks, start, k, v)

    def read(self, layer: int, start: int, stop: int) -> tuple[Array, Array]:
        """Keys and values of positions ``start..stop``, gathered through the block table."""
        return self.pool.read(layer, self.table.blocks, start, stop, self._table_array)

    def attend(
        self, layer: int, q: Array, start: int, stop: int, *, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> Array:
        """Causal attention of ``q`` (the last positions up to ``stop``) over
        keys ``start..stop``, by the backend's ``paged_attention`` reading the
        pool through this sequence's block table. Whole blocks before
        ``start`` (outside a sliding window) are left out of the table; the
        keys then begin at a block boundary at or before ``start``, which
        changes nothing because the mask is relative to the last key."""
        bs = self.pool.block_size
        first, last = start // bs, -(-stop // bs)
        k_pool, v_pool = self.pool.layer_pools(layer)
        return self.pool.backend.paged_attention(
            q, k_pool, v_pool, self._table_array(first, last), stop - first * bs,
            scale=scale, window=window, softcap=softcap,
        )

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

    def _table_array(self, first: int, last: int) -> Array:
        """``table.blocks[first:last]`` as a backend int32 array, cached until
        the table changes (every layer of a forward reuses it)."""
        key = tuple(self.table.blocks)
        if key != self._table_key:
            self._table_key, self._table_arrays = key, {}
        arr = self._table_arrays.get((first, last))
        if arr is None:
            arr = self.pool.backend.from_numpy(np.asarray(self.table.blocks[first:last], dtype=np.int32))
            self._table_arrays[(first, last)] = arr
        return arr
