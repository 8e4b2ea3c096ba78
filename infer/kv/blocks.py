"""Block allocation for a paged KV cache: pages, block tables, prefix caching.

The engine's paged cache splits one large pool of key/value memory into
``num_blocks`` fixed-size *blocks* (pages) of ``block_size`` token positions.
A sequence owns a :class:`BlockTable`: the physical blocks holding its
logical blocks 0, 1, 2, ... in order, so position ``p`` lives in block
``table.blocks[p // block_size]`` at offset ``p % block_size`` (the scheme of
vLLM's PagedAttention, Kwon et al. 2023, section 4.2).

This module is the bookkeeping only, in pure Python: it never touches backend
memory. When a write needs a block's contents copied first (copy-on-write),
:meth:`BlockAllocator.prepare_write` returns the ``(src, dst)`` pairs and the
caller copies the rows (:class:`infer.kv.paged.PagedKVPool` does).

Every block is in exactly one of three states:

* **used** — referenced by one or more block tables (``refcount > 0``; more
  than one makes it *shared*, e.g. after :meth:`BlockAllocator.fork`);
* **cached** — unreferenced, but holding a full block registered in the prefix
  cache: reusable by a later sequence with the same prefix, and evictable
  (least recently freed first) when the pool runs short;
* **free** — unreferenced and holding nothing worth keeping.

A fourth, outside those three: **withheld** blocks (:meth:`BlockAllocator.withhold`),
taken out of circulation while their bytes of the memory budget pay for
something else (a LoRA adapter's factors, :mod:`infer.adapters.slots`).

Prefix caching: a *full* block is keyed by a hash of its whole token prefix,
chained as ``h_i = sha256(h_{i-1} || tokens of block i)`` (vLLM's "automatic
prefix caching"). The chain makes a block's key depend on every token before
it, so equal keys mean equal prefixes, and hence equal keys and values.
SHA-256 rather than Python's ``hash``: a collision would hand one request
another request's keys and values, and 64-bit tuple hashes can be collided on
purpose.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from infer.errors import CacheConfigError, CacheFullError

#: The chain hash of the empty prefix (the parent of block 0).
ROOT_HASH = b""


def root_hash(extra_key: bytes = b"") -> bytes:
    """The parent of block 0 for a sequence with ``extra_key``: what its
    tokens do not say but its keys and values depend on (its images'
    content, a LoRA adapter), folded into the root of the chain so that every
    block key depends on it. ``b""`` (none) keeps :data:`ROOT_HASH`."""
    return ROOT_HASH if not extra_key else hashlib.sha256(b"extra:" + extra_key).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its parent's key and its own tokens."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def tail_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a *partial* last block (fewer than
    ``block_size`` tokens after the full blocks keyed ``parent``): a restored
    state's tail (:mod:`infer.kv.snapshot`). Apart from :func:`chain_hash`'s
    keys by a prefix, so a tail never stands for a full block."""
    return hashlib.sha256(b"tail:" + parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def sequence_key(tokens: Sequence[int], block_size: int, root: bytes = ROOT_HASH) -> bytes:
    """The prefix-cache key of the last block of ``tokens``, full or not
    (:func:`chain_hash` over the full blocks from ``root``, then
    :func:`tail_hash` of the rest): a key of the whole sequence, under which a
    restored state's final logits are kept (:class:`~infer.kv.paged.FinalLogits`).
    ``root`` is the sequence's :func:`root_hash`, so logits kept for plain
    tokens are never found by a sequence whose images or adapter differ."""
    parent = root
    full = len(tokens) // block_size
    for b in range(full):
        parent = chain_hash(parent, tokens[b * block_size:(b + 1) * block_size])
    rest = tokens[full * block_size:]
    return tail_hash(parent, rest) if len(rest) else parent


@dataclass
class BlockTable:
    """One sequence's blocks: physical block ids in logical order.

    ``blocks`` may run past ``num_tokens`` (blocks reserved by a write that
    was not committed yet); ``hashes[i]`` is the prefix-cache key of logical
    block ``i``, known for the committed full blocks only.
    """

    blocks: list[int] = field(default_factory=list)
    #: Positions written and committed.
    num_tokens: int = 0
    #: Chain hashes of the committed full blocks, in order.
    hashes: list[bytes] = field(default_factory=list)
    #: The parent of block 0 (:func:`root_hash` of the sequence's extra key).
    root: bytes = ROOT_HASH


@dataclass(frozen=True)
class PoolStats:
    """Where a pool's blocks are: ``used + free + cached == total``."""

    total: int
    #: Referenced by at least one block table.
    used: int
    #: Unreferenced and empty.
    free: int
    #: Unreferenced full blocks kept for prefix reuse (evictable).
    cached: int
    #: Referenced by more than one block table (a subset of ``used``).
    shared: int
    #: Blocks registered in the prefix cache, referenced or not.
    prefix_blocks: int
    #: Out of circulation (:meth:`BlockAllocator.withhold`): ``used + free +
    #: cached + withheld == total``.
    withheld: int = 0


class BlockAllocator:
    """Reference-counted blocks, block tables, copy-on-write and a prefix cache.

    ``bytes_per_block`` (keys and values of one block across every layer), when
    known, lets :class:`~infer.errors.CacheFullError` say how much memory a
    failed allocation needed.
    """

    def __init__(self, num_blocks: int, block_size: int, *, bytes_per_block: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise CacheConfigError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._refcount = [0] * num_blocks
        # Lowest id first, so fresh sequences get physically consecutive
        # blocks and the pool writes them with one copy per run.
        self._free = list(range(num_blocks))
        #: Prefix cache: chain hash -> block, and back.
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        #: Unreferenced cached blocks, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: Blocks out of circulation (:meth:`withhold`).
        self._withheld: list[int] = []
        #: Called ``(allocator, block, key)`` when a registered block becomes
        #: cached (its last holder let it go; its contents are still there):
        #: the disk tier of the prefix cache writes it out (:mod:`infer.kv.disk`).
        self.on_cached: Callable[[BlockAllocator, int, bytes], None] | None = None

    # -- single blocks --------------------------------------------------------------

    def refcount(self, block: int) -> int:
        """Number of block tables (or other holders) referencing ``block``."""
        return self._refcount[block]

    def available(self) -> int:
        """Blocks an allocation may take: free ones, then evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A block with reference count 1, evicting the least recently used
        cached block when no free one is left."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        else:
            raise self._full(1)
        self._refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference (a cached block stops being evictable)."""
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise CacheConfigError(f"block {block} is free: allocate it instead of sharing it")
            del self._evictable[block]
        self._refcount[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference. An unreferenced block becomes *cached* if it is
        in the prefix cache (most recently used end), else *free*."""
        count = self._refcount[block]
        if count <= 0:
            raise CacheConfigError(f"block {block} freed more often than it was referenced")
        self._refcount[block] = count - 1
        if count == 1:
            if block in self._hash_of:
                self._evictable[block] = None
                if self.on_cached is not None:
                    self.on_cached(self, block, self._hash_of[block])
            else:
                heapq.heappush(self._free, block)

    @property
    def withheld(self) -> int:
        """Blocks out of circulation (:meth:`withhold`)."""
        return len(self._withheld)

    def withhold(self, n: int) -> None:
        """Take ``n`` unreferenced blocks out of circulation (free ones, the
        highest ids first: those a pool that hands out the lowest first
        writes last; then the least recently used cached ones, leaving the
        prefix cache), until :meth:`release_withheld`. Blocks a table
        references are never taken. All or nothing: raises
        :class:`~infer.errors.CacheFullError` when fewer than ``n`` are available."""
        if n > self.available():
            raise self._full(n)
        take_free = min(n, len(self._free))
        if take_free:
            self._free.sort()
            self._withheld += self._free[len(self._free) - take_free:]
            del self._free[len(self._free) - take_free:]  # a sorted list is still a heap
        for _ in range(n - take_free):
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self._withheld.append(block)

    def release_withheld(self, n: int) -> None:
        """Put ``n`` withheld blocks back into circulation, free."""
        if not 0 <= n <= len(self._withheld):
            raise CacheConfigError(f"cannot release {n} withheld blocks: {len(self._withheld)} are withheld")
        for _ in range(n):
            heapq.heappush(self._free, self._withheld.pop())

    # -- block tables ---------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, table: BlockTable, start: int, stop: int) -> int:
        """New blocks :meth:`prepare_write` would take for ``start..stop``."""
        bs = self.block_size
        grow = max(0, self.blocks_for(stop) - len(table.blocks))
        existing = range(start // bs, min(self.blocks_for(stop), len(table.blocks)))
        return grow + sum(1 for i in existing if table.blocks[i] >= 0 and self._refcount[table.blocks[i]] > 1)

    def prepare_write(self, table: BlockTable, start: int, stop: int) -> list[tuple[int, int]]:
        """Make positions ``start..stop`` of ``table`` writable.

        Appends blocks as needed, and gives the table a private copy of every
        shared block in the range (copy-on-write). Returns the ``(src, dst)``
        block copies the caller must perform *before* writing. A block written
        while registered in the prefix cache leaves the cache (its contents
        are about to change). All or nothing: raises
        :class:`~infer.errors.CacheFullError` before changing anything when
        the pool cannot supply the blocks even after evicting cached ones.
        """
        if not 0 <= start <= table.num_tokens or stop < start:
            raise CacheConfigError(
                f"cannot write positions {start}..{stop} of a sequence holding {table.num_tokens}: "
                f"writes start at or before the end"
            )
        need = self.blocks_needed(table, start, stop)
        if need > self.available():
            raise self._full(need)
        bs = self.block_size
        del table.hashes[start // bs:]  # blocks from here on change: their keys no longer hold
        copies = []
        for i in range(start // bs, min(self.blocks_for(stop), len(table.blocks))):
            block = table.blocks[i]
            if block < 0:  # given back by a sliding window: never written again
                continue
            if self._refcount[block] > 1:
                new = self.allocate()
                self.free(block)
                table.blocks[i] = new
                copies.append((block, new))
            elif block in self._hash_of:
                del self._cached[self._hash_of.pop(block)]
        while len(table.blocks) < self.blocks_for(stop):
            table.blocks.append(self.allocate())
        return copies

    def commit(self, table: BlockTable, tokens: Sequence[int], salt: bytes = b"") -> None:
        """Record that the table's positions now hold ``tokens`` (the whole
        sequence so far), and enter its newly full blocks in the prefix cache.

        A full block whose key is already cached (the same prefix computed
        twice) stays out: the cache keeps the first one.
        """
        bs = self.block_size
        if len(tokens) > len(table.blocks) * bs:
            raise CacheConfigError(f"{len(tokens)} tokens committed to a table of {len(table.blocks)} blocks of {bs}")
        table.num_tokens = len(tokens)
        for i in range(len(table.hashes), len(tokens) // bs):
            parent = table.hashes[-1] if table.hashes else table.root
            key = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            table.hashes.append(key)
            # A salt (the state group) keeps apart the blocks of groups that share one allocator.
            self.register(table.blocks[i], salt + key)

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table sharing every block of ``table`` (reference counts
        +1); whichever writes a shared block first gets a copy."""
        for block in table.blocks:
            if block >= 0:  # a sliding window's given-back blocks are -1
                self.incref(block)
        return BlockTable(list(table.blocks), table.num_tokens, list(table.hashes), table.root)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Forget positions from ``num_tokens`` on, freeing the blocks past them."""
        num_tokens = max(0, min(num_tokens, table.num_tokens))
        keep = self.blocks_for(num_tokens)
        for block in reversed(table.blocks[keep:]):
            if block >= 0:
                self.free(block)
        del table.blocks[keep:]
        del table.hashes[num_tokens // self.block_size:]
        table.num_tokens = num_tokens

    def free_table(self, table: BlockTable) -> None:
        """Return every block of ``table``. Freed last block first, so that
        under pressure a cached prefix is evicted from its tail, keeping its
        head reusable."""
        for block in reversed(table.blocks):
            if block >= 0:
                self.free(block)
        table.blocks.clear()
        table.hashes.clear()
        table.num_tokens = 0

    # -- prefix cache ---------------------------------------------------------------

    def release_before(self, table: BlockTable, position: int) -> int:
        """Give back the blocks wholly before ``position`` (a sliding window's
        keys no query reads again): their entries become -1, and a registered
        one stays cached for prefix hits. Returns the blocks given back."""
        freed = 0
        for i in range(min(position // self.block_size, len(table.blocks))):
            if table.blocks[i] >= 0:
                self.free(table.blocks[i])
                table.blocks[i] = -1
                freed += 1
        return freed

    def attach_blocks(self, table: BlockTable, keys: Sequence[bytes], first: int, salt: bytes = b"") -> None:
        """Start an empty ``table`` with the cached blocks of ``keys[first:]``
        (the blocks before ``first`` -1: a sliding window's prefix hit needs
        only those within the window)."""
        if table.blocks:
            raise CacheConfigError("a cached prefix can only start an empty block table")
        for i, key in enumerate(keys):
            block = -1 if i < first else self._cached[salt + key]
            if block >= 0:
                self.incref(block)
            table.blocks.append(block)
        table.hashes = list(keys)
        table.num_tokens = len(keys) * self.block_size

    def lookup_prefix(self, tokens: Sequence[int], root: bytes = ROOT_HASH) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``tokens``
        (a query: nothing is referenced or reordered)."""
        return [block for _, block in self._cached_prefix(tokens, root)]

    def attach_prefix(self, table: BlockTable, tokens: Sequence[int]) -> int:
        """Start an empty ``table`` with the cached blocks of the longest
        full-block prefix of ``tokens``; returns the positions reused."""
        if table.blocks:
            raise CacheConfigError("a cached prefix can only start an empty block table")
        for key, block in self._cached_prefix(tokens, table.root):
            self.incref(block)
            table.blocks.append(block)
            table.hashes.append(key)
        table.num_tokens = len(table.blocks) * self.block_size
        return table.num_tokens

    def _cached_prefix(self, tokens: Sequence[int], root: bytes = ROOT_HASH) -> list[tuple[bytes, int]]:
        """``(chain hash, block)`` of each cached block of the longest
        full-block prefix of ``tokens`` (chained from ``root``), in order."""
        found, parent, bs = [], root, self.block_size
        for i in range(len(tokens) // bs):
            parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            block = self._cached.get(parent)
            if block is None:
                break
            found.append((parent, block))
        return found

    def register(self, block: int, key: bytes) -> None:
        """Enter ``block`` in the prefix cache under ``key`` (a recurrent
        state checkpoint keyed by the chain hash of the KV block ending where
        it was taken); a key already cached keeps its first block."""
        if block not in self._hash_of and key not in self._cached:
            self._cached[key] = block
            self._hash_of[block] = key

    def lookup(self, key: bytes) -> int | None:
        """The block cached under ``key``, or None (a query: nothing changes)."""
        return self._cached.get(key)

    def clear_prefix_cache(self) -> int:
        """Drop every cached entry (referenced blocks stay allocated); returns
        the number of blocks freed."""
        freed = len(self._evictable)
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
        return freed

    # -- statistics -----------------------------------------------------------------

    def stats(self) -> PoolStats:
        """Counts of used, free, cached and shared blocks."""
        used = sum(1 for c in self._refcount if c > 0)
        return PoolStats(
            total=self.num_blocks, used=used, free=len(self._free), cached=len(self._evictable),
            shared=sum(1 for c in self._refcount if c > 1), prefix_blocks=len(self._cached),
            withheld=len(self._withheld),
        )

    def _full(self, need: int) -> CacheFullError:
        bs, per = self.block_size, self.bytes_per_block
        size = "" if per is None else f" ({need * per:,} bytes at {per:,} bytes per block)"
        have = "" if per is None else f" ({self.available() * per:,} bytes)"
        withheld = f" ({len(self._withheld)} withheld for adapters)" if self._withheld else ""
        err = CacheFullError(
            f"the paged KV cache needs {need} more block(s) of {bs} positions{size} but only "
            f"{self.available()} are available{have}: {len(self._free)} free and {len(self._evictable)} "
            f"evictable cached, of {self.num_blocks} in the pool{withheld}; finish or free sequences, or size "
            f"the pool larger (num_blocks / memory_budget)"
        )
        err.blocks_needed, err.blocks_available = need, self.available()  # type: ignore[attr-defined]
        err.bytes_needed = None if per is None else need * per  # type: ignore[attr-defined]
        return err
