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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from infer.errors import CacheConfigError, CacheFullError
from infer.kv.attention import LayerState, state_groups
from infer.kv.blocks import ROOT_HASH, BlockAllocator, BlockTable, PoolStats, chain_hash, root_hash, sequence_key, tail_hash
from infer.kv.cache import LayerStore, SequenceCache, row_nbytes
from infer.kv.state import SequenceStates, StateStore
from infer.ops import Backend

log = logging.getLogger(__name__)


#: Blocks of a pool whose layers keep no keys and values (they cost no memory).
BOOKKEEPING_BLOCKS = 1 << 16


class PrefixTier(Protocol):
    """A slower tier of a pool's prefix cache (:class:`infer.kv.disk.DiskTier`)."""

    def fill(self, tokens: Sequence[int]) -> int:
        """Enter in the pool's prefix cache the blocks of ``tokens`` this tier
        holds and memory lacks; returns how many it read."""

    def write_logits(self, key: bytes, logits: np.ndarray) -> None:
        """Keep a sequence's final logits row under ``key`` (:func:`~infer.kv.blocks.sequence_key`)."""

    def read_logits(self, key: bytes) -> np.ndarray | None:
        """The final logits row kept under ``key``, or None."""


#: Bytes of final logits rows a pool keeps in memory (:class:`FinalLogits`).
FINAL_LOGITS_BYTES = 64 * 2**20


class FinalLogits:
    """The logits row after the last token of restored states, by
    :func:`~infer.kv.blocks.sequence_key` of their tokens, least recently
    used first out past ``max_bytes``.

    A restored state's blocks, tail and final recurrent state give a request
    every position of the saved tokens, but the next token is drawn from the
    logits after the last one: with them kept, a request whose prompt is
    exactly the saved tokens computes nothing
    (:meth:`PagedSequenceCache.reuse_prompt`). A row is only ever used
    together with a cache hit on every one of those tokens, so a row whose
    blocks were evicted is harmless, and it ages out here."""

    def __init__(self, max_bytes: int = FINAL_LOGITS_BYTES) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0

    def put(self, key: bytes, logits: np.ndarray) -> None:
        # A copy: a row read from a state file is a view of the whole file's bytes, which it would keep alive.
        row = np.array(logits, dtype=np.float32).reshape(-1)
        old = self._rows.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._rows[key] = row
        self._bytes += row.nbytes
        while self._bytes > self.max_bytes and len(self._rows) > 1:
            _, dropped = self._rows.popitem(last=False)
            self._bytes -= dropped.nbytes

    def get(self, key: bytes) -> np.ndarray | None:
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def __len__(self) -> int:
        return len(self._rows)


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
    A ``memory_budget`` counts it. ``dtype`` stores keys and values
    narrower than they are computed (the engine's ``kv_dtype``; see
    :class:`~infer.kv.cache.LayerStore`).
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
        layer_states: Sequence[LayerState] | None = None,
        state_store: StateStore | None = None,
        window_margin: int | None = None,
        shared_pages: bool = False,
        dtype: str | None = None,
    ) -> None:
        if (num_blocks is None) == (memory_budget is None):
            raise CacheConfigError("size the KV pool with exactly one of num_blocks and memory_budget")
        bytes_per_block = None if bytes_per_token is None else bytes_per_token * block_size
        if memory_budget is not None:
            if bytes_per_block is None:
                raise CacheConfigError("a memory_budget needs bytes_per_token (Engine.new_kv_pool measures it)")
            if bytes_per_block == 0:
                # No layer keeps keys and values (a pure recurrent model, Mamba2): blocks are
                # bookkeeping only (prefix hashes, checkpoints at their boundaries) and cost no
                # memory; the state slots are what the budget buys (Engine.new_kv_pool).
                num_blocks = BOOKKEEPING_BLOCKS
            else:
                num_blocks = memory_budget // bytes_per_block - 1  # the scratch block's share
            if num_blocks < 1:
                raise CacheFullError(
                    f"a KV memory budget of {memory_budget:,} bytes holds no block: one block of "
                    f"{block_size} positions takes {bytes_per_block:,} bytes, and the pool needs two (one is "
                    "its scratch block); raise the budget or lower block_size"
                )
        assert num_blocks is not None
        layer_kv, windows = state_groups(layer_states) if layer_states is not None else (None, [None])
        shared = None if layer_kv is None or not shared_pages else one_page_size(layer_kv, windows)
        #: Whether every state group takes its pages from one allocator
        #: (``shared_pages=True`` where :func:`one_page_size` applies): a page
        #: given back by a window then serves any layer, and :meth:`stats`
        #: counts the pages of every group.
        self.shared_pages = shared is not None
        if shared is not None:
            # Same memory: a page now holds the keys of one group's layers, not of every layer.
            layer_kv, windows, scale = shared
            num_blocks = (num_blocks + 1) * scale - 1
            bytes_per_block = None if bytes_per_block is None else bytes_per_block // scale
        super().__init__(backend, num_layers, (num_blocks + 1) * block_size, block_size,  # the scratch block last
                         layer_kv, dtype)
        self.num_blocks = num_blocks
        #: The bytes the pool was sized by (None: sized by ``num_blocks``).
        self.memory_budget = memory_budget
        #: Bytes of the budget one page stands for (withheld in every
        #: allocator: :meth:`hold_bytes`); None where unknown, 0 where pages
        #: hold no keys (a pure recurrent model).
        self.page_bytes = bytes_per_block
        #: Bytes of the budget other things hold now (:meth:`hold_bytes`: the LoRA adapters' factors).
        self.held_bytes = 0
        #: Callables (weak references to them) that each give the blocks the
        #: pool must keep for its users' requests (a batch engine's largest
        #: request), which :meth:`hold_bytes` never withholds.
        self.keep_for: list[Callable[[], Callable[[], int] | None]] = []
        #: The block past the sequences' blocks: padding rows of a captured
        #: batched step write there (its contents are never keys of a sequence).
        self.scratch_block = num_blocks
        #: Per state group its window (None: full attention), its blocks'
        #: allocator (group 0's is :attr:`allocator`; one for all with
        #: :attr:`shared_pages`) and the salt of its prefix-cache keys.
        self.windows = windows
        if self.shared_pages:
            self.allocators = [BlockAllocator(num_blocks, block_size, bytes_per_block=bytes_per_block)] * len(windows)
        else:
            self.allocators = [BlockAllocator(num_blocks, block_size, bytes_per_block=bytes_per_block)
                               for _ in windows]
        self.salts = [b"" if g == 0 else b"group %d:" % g for g in range(len(windows))]
        self.allocator = self.allocators[0]
        #: A sliding window's pages are given back once wholly this many
        #: positions before the window, so that rolling back that far
        #: (rejected drafts) still finds its keys.
        self.window_margin = max(16, block_size) if window_margin is None else window_margin
        #: The recurrent layers' states (None: the model has none).
        self.state_store = state_store
        #: The prefix cache's disk tier (:class:`infer.kv.disk.DiskTier`; None: memory only).
        self.disk: PrefixTier | None = None
        #: Restored states' logits after their last token (:class:`FinalLogits`).
        self.final_logits = FinalLogits()
        self._bytes_known = bytes_per_token is not None
        #: Called with every list of block copies :meth:`copy_blocks` makes and
        #: their state group (a tensor-parallel driver repeats them on the other ranks' pools).
        self.copy_listeners: list[Callable[[Sequence[tuple[int, int]], int], None]] = []
        log.info("paged KV cache: %d blocks of %d positions on %s/%s", num_blocks, block_size, backend.name,
                 backend.device)

    # -- sequences --------------------------------------------------------------------

    def new_sequence(self, capacity: int, *, extra_key: bytes = b"") -> PagedSequenceCache:
        """An empty sequence of at most ``capacity`` positions. ``extra_key``:
        what its keys and values depend on besides its tokens (a LoRA
        adapter's content, images), folded into the root of its prefix-cache
        keys (:func:`~infer.kv.blocks.root_hash`): it shares blocks only with
        sequences of the same extra key."""
        states = None if self.state_store is None else self.state_store.new_sequence()
        tables = [BlockTable() for _ in self.windows]
        cache = PagedSequenceCache(self, tables[0], capacity, tables=tables, states=states)
        cache.extra_key = extra_key  # sets every table's root
        return cache

    def stats(self) -> PoolStats:
        """Block counts of group 0 (see :class:`~infer.kv.blocks.PoolStats`)."""
        return self.allocator.stats()

    def bytes_per_block(self, group: int) -> int:
        """Bytes one block of ``group`` holds across its layers allocated so far."""
        kv = self.layer_kv or [(i, 0, True) for i in range(self.num_layers)]
        layers = {storage for storage, g, _ in kv if g == group}
        arrays = [a for i in layers for a in (self._keys[i], self._values[i]) if a is not None]
        return sum(row_nbytes(self.backend, a) for a in arrays) * self.block_size

    def bytes_held(self) -> int:
        """Bytes of keys and values referenced by sequences now (used blocks of
        every allocator, at its layers' bytes per block), plus the recurrent
        state slots held: what the sequences hold, not what the pool preallocates."""
        groups = range(1) if self.shared_pages else range(len(self.allocators))
        kv = sum(self.allocators[g].stats().used * self.bytes_per_block(g) for g in groups)
        store = self.state_store
        return kv + (0 if store is None else store.slots_held() * store.nbytes_per_slot)

    # -- the budget's other holders ----------------------------------------------------

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences may hold: :attr:`num_blocks` less the withheld ones."""
        return self.num_blocks - self.allocator.withheld

    def pages_for(self, nbytes: int) -> int:
        """Pages whose share of the budget covers ``nbytes``."""
        per = self.page_bytes
        return 0 if not per or nbytes <= 0 else -(-nbytes // per)

    def spare_pages(self) -> int:
        """Pages :meth:`hold_bytes` may withhold beyond those withheld now: free
        or only cached (never a page a sequence holds), and leaving every
        user's largest request its blocks (:attr:`keep_for`), one block at the least."""
        keep = [1]
        for ref in self.keep_for:
            need = ref()
            if need is not None:
                keep.append(need())
        available = min(a.available() for a in self._distinct_allocators())
        return max(0, min(available, self.usable_blocks - max(keep)))

    def hold_bytes(self, nbytes: int) -> None:
        """Let something else hold ``nbytes`` of the pool's budget (replacing
        what it held before): pages covering them are withheld from the
        sequences (:meth:`~infer.kv.blocks.BlockAllocator.withhold`, free or
        cached ones only), or given back when ``nbytes`` shrinks. All or
        nothing: :class:`~infer.errors.CacheFullError` when the pages it needs
        beyond those withheld now are more than :meth:`spare_pages`."""
        want, have = self.pages_for(nbytes), self.allocator.withheld
        if want > have:
            spare = self.spare_pages()
            if want - have > spare:
                per = self.page_bytes or 0
                err = CacheFullError(
                    f"{nbytes:,} bytes of the KV pool's budget need {want} pages of {per:,} bytes, {want - have} "
                    f"more than the {have} withheld now, but only {spare} can be spared ({spare * per:,} bytes): "
                    f"{self.stats()}")
                err.bytes_needed, err.bytes_available = nbytes, (have + spare) * per  # type: ignore[attr-defined]
                raise err
            for alloc in self._distinct_allocators():
                alloc.withhold(want - have)
        elif want < have:
            for alloc in self._distinct_allocators():
                alloc.release_withheld(have - want)
        self.held_bytes = max(0, nbytes)

    def _distinct_allocators(self) -> list[BlockAllocator]:
        return list({id(a): a for a in self.allocators}.values())

    # -- backend memory ---------------------------------------------------------------

    def copy_blocks(self, copies: Sequence[tuple[int, int]], group: int = 0) -> None:
        """Copy whole blocks ``src -> dst`` in every allocated layer of state
        ``group`` (copy-on-write)."""
        for listener in self.copy_listeners:
            listener(copies, group)
        ops, bs = self.backend, self.block_size
        src = np.concatenate([np.arange(s * bs, s * bs + bs) for s, _ in copies]).astype(np.int32)
        dst = ops.from_numpy(np.concatenate([np.arange(d * bs, d * bs + bs) for _, d in copies]).astype(np.int32))
        ids = ops.from_numpy(src)
        for layer in range(self.num_layers):
            keys, values = self._keys[layer], self._values[layer]
            # Separate allocators number their blocks alike: copy in the group's own layers only.
            if keys is None or (not self.shared_pages and self.layer_kv is not None
                                and self.layer_kv[layer][1] != group):
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


def one_page_size(layer_kv: list[tuple[int, int, bool]], windows: list[int | None],
                 ) -> tuple[list[tuple[int, int, bool]], list[int | None], int] | None:
    """One page size for every state group (vLLM's hybrid allocator): where
    every window has a multiple of the full-attention layers' count ``n``,
    the windowed layers are split into groups of ``n``, and layer ``j`` of
    every group keeps its keys in full layer ``j``'s arrays, each group at
    its own pages of one allocator. A page a window gives back then serves
    any layer. Returns the new layout and how many pages of ``n`` layers one
    block of every layer makes; None where the layers do not divide so (each
    group then has its allocator)."""
    if windows[0] is not None or len(windows) == 1:
        return None
    full = [i for i, (s, g, w) in enumerate(layer_kv) if g == 0 and w]
    by_group = {g: [i for i, (s, gi, w) in enumerate(layer_kv) if gi == g and w] for g in range(1, len(windows))}
    if not full or any(len(ls) % len(full) for ls in by_group.values()):
        return None
    n, new_windows = len(full), [None]
    place: dict[int, tuple[int, int]] = {i: (i, 0) for i in full}
    for g, layers in by_group.items():
        for k, i in enumerate(layers):
            place[i] = (full[k % n], len(new_windows) + k // n)
        new_windows += [windows[g]] * (len(layers) // n)
    out = []
    for i, (storage, g, writes) in enumerate(layer_kv):
        if g < 0:
            out.append((storage, g, writes))
        else:
            out.append((*place[storage if not writes else i], writes))
    return out, new_windows, len(new_windows)


class PagedSequenceCache(SequenceCache):
    """One sequence's keys and values in a :class:`PagedKVPool`: one block
    table per state group (:attr:`table`, group 0's, and :attr:`tables`),
    and its recurrent state, when the model has recurrent layers.

    The engine reserves a forward's pages, writes its new keys and values
    layer by layer, then :meth:`commit`\\ s the forward's token ids: full
    blocks then join the pool's prefix cache, and a sliding window's group
    gives back the pages wholly before its window. :meth:`free` returns the
    pages at once.
    """

    def __init__(self, pool: PagedKVPool, table: BlockTable, capacity: int, tokens: list[int] | None = None, *,
                 tables: list[BlockTable] | None = None, states: SequenceStates | None = None) -> None:
        self.pool = pool
        self.table = table
        #: Per state group its block table (``tables[0] is table``).
        self.tables = [table] + [BlockTable(root=table.root) for _ in pool.windows[1:]] if tables is None else tables
        #: Most positions this sequence may hold (its context).
        self.capacity = capacity
        #: Token ids of the committed positions (the prefix-cache keys).
        self.tokens: list[int] = [] if tokens is None else tokens
        self.states = states
        self._extra_key = b""

    @property
    def length(self) -> int:
        """Positions written and committed."""
        return self.table.num_tokens

    @property
    def extra_key(self) -> bytes:
        """What keys this sequence's blocks beside its tokens (:func:`~infer.kv.blocks.root_hash`)."""
        return self._extra_key

    @extra_key.setter
    def extra_key(self, key: bytes) -> None:
        """Set before anything is cached or attached: the images of a prompt, a LoRA adapter."""
        if self.length or any(t.blocks for t in self.tables):
            raise CacheConfigError("a sequence's extra key is set before its first block")
        self._extra_key = bytes(key)
        for table in self.tables:
            table.root = root_hash(self._extra_key)

    @property
    def store(self) -> PagedKVPool:  # type: ignore[override]
        return self.pool

    @property
    def checkpoint_interval(self) -> int:
        return self.pool.block_size

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        """Positions ``start..stop`` made writable (taking blocks from the pool
        as needed, copying a shared block first) and their pool rows, with
        the block table up to ``stop`` (group 0's)."""
        return self.locate_groups(start, stop)[0]

    def locate_groups(self, start: int, stop: int) -> list[tuple[np.ndarray, list[int]]]:
        self._check_capacity(start, stop - start)
        self.prepare_positions(start, stop)
        out, scratch = [], self.pool.scratch_block
        for table in self.tables:
            # A window's given-back blocks (-1) are never read: the scratch block stands in.
            blocks = [b if b >= 0 else scratch for b in table.blocks[:-(-stop // self.pool.block_size)]]
            out.append((self.pool.rows_of(blocks, start, stop), blocks))
        return out

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, list[int]]:
        return self.pool.rows_of(self.table.blocks, start, stop), list(self.table.blocks)

    def _checkpoint_keys(self, token_ids: Sequence[int]) -> dict[int, bytes]:
        bs, hashes = self.pool.block_size, self.table.hashes
        tokens = self.tokens + [int(t) for t in token_ids]
        keys, parent = {}, hashes[-1] if hashes else self.table.root
        for i in range(len(hashes), len(tokens) // bs):
            parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            keys[(i + 1) * bs] = parent
        return keys

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
        for table, alloc, window, salt in zip(self.tables, self.pool.allocators, self.pool.windows, self.pool.salts):
            alloc.commit(table, self.tokens, salt)
            if window is not None:
                alloc.release_before(table, len(self.tokens) - window - self.pool.window_margin)
        if self.states is not None:
            self.states.commit()

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Start this (empty) sequence with the pool's cached blocks for the
        longest full-block prefix of ``tokens`` that every state group holds
        (a sliding window's group: the blocks within its window before the
        hit point; recurrent layers: the checkpoint at it), and a restored
        state's partial last block after them where ``tokens`` go on with it
        (:meth:`_find_tail`); returns how many positions need no computing.
        Pass a prompt without its last token, so at least one token is left
        to compute the next logits from."""
        pool, bs = self.pool, self.pool.block_size
        root = self.table.root
        # What memory lacks of the prompt's blocks, read back from disk (which keys blocks by
        # their tokens alone, so it holds none of a sequence with an extra key).
        if pool.disk is not None and root == ROOT_HASH:
            pool.disk.fill(tokens)
        keys = [key for key, _ in pool.allocator._cached_prefix(tokens, root)]
        n = len(keys)
        tail = self._find_tail(keys[n - 1] if n else root, tokens, n * bs)
        if tail is not None and self._hit(keys, n, n * bs + tail[1], recurrent=False):
            self._attach(keys, n, n * bs + tail[1])
            if self._attach_tail(tail[0], n * bs + tail[1]):
                self.tokens = [int(t) for t in tokens[:n * bs + tail[1]]]
                return n * bs + tail[1]
            for table, alloc in zip(self.tables, pool.allocators):  # no page for its copy: whole blocks only
                alloc.free_table(table)
        while n > 0 and not self._hit(keys, n, n * bs):
            n -= 1
        self._attach(keys, n, n * bs)
        if self.states is not None and n:
            self.states.attach(n * bs, keys[n - 1])
        self.tokens = [int(t) for t in tokens[:n * bs]]
        return n * bs

    def reuse_prompt(self, prompt: Sequence[int]) -> tuple[int, np.ndarray | None]:
        """:meth:`reuse_prefix` for a request about to draw its first token
        after ``prompt``: where the prefix cache holds every one of its tokens
        and the logits after the last (a restored state of exactly this
        prompt, :class:`FinalLogits`), all of it, and those logits: nothing
        is left to compute. Otherwise the prompt without its last token, which
        is left to compute the logits from, and None."""
        pool = self.pool
        if len(prompt) > 1 and (len(pool.final_logits) or pool.disk is not None):  # else no hashing: none kept
            key = sequence_key(prompt, pool.block_size, self.table.root)
            logits = pool.final_logits.get(key)
            if logits is None and pool.disk is not None:
                logits = pool.disk.read_logits(key)
                if logits is not None:
                    pool.final_logits.put(key, logits)
            if logits is not None:
                found = self.reuse_prefix(prompt)
                # Fewer positions (blocks evicted since) still leave the rest to compute, as below.
                self.kept_logits = logits if found == len(prompt) else None
                return found, self.kept_logits
        return self.reuse_prefix(prompt[:-1]), None

    def _attach(self, keys: list[bytes], n: int, stop: int) -> None:
        """Every group's table starts with the cached blocks ``keys[:n]`` that
        a sequence of ``stop`` positions reads (a window's: those within it)."""
        pool, bs = self.pool, self.pool.block_size
        for table, alloc, window, salt in zip(self.tables, pool.allocators, pool.windows, pool.salts):
            first = 0 if window is None else max(0, stop - window - pool.window_margin) // bs
            alloc.attach_blocks(table, keys[:n], first, salt)

    def _find_tail(self, parent: bytes, tokens: Sequence[int], start: int) -> tuple[bytes, int] | None:
        """The longest cached *tail* that ``tokens`` continue with after
        ``start`` positions of full blocks keyed up to ``parent``: a restored
        state's partial last block in every group and, with recurrent
        layers, its final state (:func:`~infer.kv.blocks.tail_hash`).
        Returns its key and length."""
        pool = self.pool
        for j in range(min(pool.block_size - 1, len(tokens) - start), 0, -1):
            key = tail_hash(parent, tokens[start:start + j])
            if all(alloc.lookup(salt + key) is not None for alloc, salt in zip(pool.allocators, pool.salts)) and (
                    self.states is None or self.states.store.allocator.lookup(key) is not None):
                return key, j
        return None

    def _attach_tail(self, key: bytes, stop: int) -> bool:
        """Append to every group's table a private copy of the tail block
        cached under ``key`` (the cached one stays for the next hit), and
        start the recurrent state from the tail's; False, changing nothing,
        when the pool has no page left for the copies."""
        pool = self.pool
        allocs = pool.allocators
        sources = [alloc.lookup(salt + key) for alloc, salt in zip(allocs, pool.salts)]
        for alloc, src in zip(allocs, sources):  # held while copying, so no allocation evicts them
            alloc.incref(src)  # type: ignore[arg-type]
        try:
            unique = {id(a): a for a in allocs}
            if any(a.available() < sum(1 for b in allocs if b is a) for a in unique.values()):
                return False
            for g, (table, alloc, src) in enumerate(zip(self.tables, allocs, sources)):
                block = alloc.allocate()
                pool.copy_blocks([(src, block)], g)  # type: ignore[list-item]
                table.blocks.append(block)
                table.num_tokens = stop
        finally:
            for alloc, src in zip(allocs, sources):
                alloc.free(src)  # type: ignore[arg-type]
        if self.states is not None:
            self.states.attach(stop, key)
        return True

    def _hit(self, keys: list[bytes], n: int, stop: int, recurrent: bool = True) -> bool:
        """Whether every group can start a sequence of ``stop`` positions with
        blocks ``keys[:n]`` (a window's group: those within its window), and
        (``recurrent``) the recurrent state after block ``n``."""
        pool, bs = self.pool, self.pool.block_size
        for alloc, window, salt in zip(pool.allocators[1:], pool.windows[1:], pool.salts[1:]):
            first = 0 if window is None else max(0, stop - window - pool.window_margin) // bs
            if any(alloc.lookup(salt + k) is None for k in keys[first:n]):
                return False
        return not recurrent or self.states is None or self.states.store.allocator.lookup(keys[n - 1]) is not None

    def fork(self) -> PagedSequenceCache:
        """A sequence sharing this one's blocks (e.g. parallel samples of one
        prompt); a block is copied only when one of them writes it. Its
        recurrent state is a copy."""
        tables = [alloc.fork(t) for alloc, t in zip(self.pool.allocators, self.tables)]
        states = None if self.states is None else self.states.fork()
        return PagedSequenceCache(self.pool, tables[0], self.capacity, list(self.tokens), tables=tables,
                                  states=states)

    def truncate(self, length: int) -> int:
        """Forget positions from ``length`` on (e.g. rejected speculative
        tokens); their blocks go back to the pool. Returns the positions
        kept (see :meth:`SequenceCache.truncate`)."""
        length = max(0, min(length, self.length))
        bs = self.pool.block_size
        while True:
            kept = length
            if not self._window_intact(kept):
                kept = 0
            if self.states is not None:
                keyed = [((i + 1) * bs, h) for i, h in enumerate(self.table.hashes[:kept // bs])]
                kept = self.states.restore(kept, keyed)
            if kept == length:
                break
            length = kept
        for table, alloc in zip(self.tables, self.pool.allocators):
            if length == 0:
                alloc.free_table(table)
            else:
                alloc.truncate(table, length)
        del self.tokens[length:]
        return length

    def _window_intact(self, length: int) -> bool:
        """Whether every sliding window still holds the keys the position after ``length`` reads."""
        bs = self.pool.block_size
        for table, window in zip(self.tables, self.pool.windows):
            if window is not None and length:
                lo = max(0, length - window) // bs
                if any(b < 0 for b in table.blocks[lo:-(-length // bs)]):
                    return False
        return True

    def free(self) -> None:
        """Return every page to the pool now; the cache is empty afterwards."""
        for table, alloc in zip(self.tables, self.pool.allocators):
            alloc.free_table(table)
        self.tokens.clear()
        if self.states is not None:
            self.states.free()

    @property
    def nbytes_per_position(self) -> int:
        return self.pool.nbytes_per_position

    def blocks_needed(self, stop: int) -> list[int]:
        """Per state group, the new blocks positions ``length..stop`` take."""
        return [alloc.blocks_needed(t, self.length, stop) for t, alloc in zip(self.tables, self.pool.allocators)]

    def prepare_positions(self, start: int, stop: int) -> None:
        """Make positions ``start..stop`` writable as :meth:`write` does
        first (taking blocks, copying shared ones); doing it again changes
        nothing. A write past the committed end (an MTP module's chained
        draft positions) reserves the gap too: tables have no holes."""
        self._prepare(min(start, self.length), stop)

    def _prepare(self, start: int, stop: int) -> None:
        allocs = self.pool.allocators
        if len(allocs) > 1:  # all groups or none
            needs: dict[int, int] = {}
            for table, alloc in zip(self.tables, allocs):
                needs[id(alloc)] = needs.get(id(alloc), 0) + alloc.blocks_needed(table, start, stop)
            for alloc in {id(a): a for a in allocs}.values():
                if needs[id(alloc)] > alloc.available():
                    raise alloc._full(needs[id(alloc)])
        for g, (table, alloc) in enumerate(zip(self.tables, allocs)):
            copies = alloc.prepare_write(table, start, stop)
            if copies:
                self.pool.copy_blocks(copies, g)
