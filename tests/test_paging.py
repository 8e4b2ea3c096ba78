"""The block allocator (infer.kv.blocks): invariants under random interleavings.

The state machine drives a :class:`BlockAllocator` the way the paged cache
does (allocate on append, fork, write into shared blocks, truncate, free,
start sequences from the prefix cache) and simulates the pool's memory: each
block is a list of ``block_size`` slots, and "keys and values" are simply the
token ids written there. Copy-on-write pairs are applied as the cache would
apply them. After every step:

* every sequence reads back exactly its own tokens through its block table
  (so no write ever landed in a block another sequence still reads, and no
  eviction took a block that was still referenced);
* reference counts equal the number of tables holding each block (no page is
  owned twice without being counted twice);
* ``used + free + cached == total``, and every cached block is unreferenced;
* every block in the prefix cache holds the tokens its key stands for.

At teardown every sequence is freed and every block is back in the pool.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from infer.errors import CacheFullError
from infer.kv.blocks import ROOT_HASH, BlockAllocator, BlockTable, PoolStats, chain_hash

# A tiny alphabet makes equal prefixes (prefix-cache hits) common.
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class Sequence_:
    def __init__(self, table: BlockTable, tokens: list[int]) -> None:
        self.table, self.tokens = table, tokens


class AllocatorMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.alloc: BlockAllocator | None = None
        self.memory: dict[int, list[int | None]] = {}
        self.live: list[Sequence_] = []
        self.key_tokens: dict[bytes, list[int]] = {}  # chain hash -> the prefix it stands for

    # -- setup ----------------------------------------------------------------------

    @rule(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def init(self, num_blocks: int, block_size: int) -> None:
        if self.alloc is None:
            self.alloc = BlockAllocator(num_blocks, block_size, bytes_per_block=1024)
            self.memory = {b: [None] * block_size for b in range(num_blocks)}

    # -- what the paged cache does ------------------------------------------------------

    def _write(self, seq: Sequence_, start: int, new: list[int]) -> bool:
        """prepare_write + the copies + the writes + commit; False if the pool was full."""
        alloc = self.alloc
        assert alloc is not None
        before = (list(seq.table.blocks), seq.table.num_tokens, alloc.stats())
        try:
            copies = alloc.prepare_write(seq.table, start, start + len(new))
        except CacheFullError as err:
            assert "more block(s)" in str(err)
            assert err.blocks_needed > err.blocks_available  # type: ignore[attr-defined]
            assert (list(seq.table.blocks), seq.table.num_tokens, alloc.stats()) == before  # all or nothing
            return False
        for src, dst in copies:
            assert alloc.refcount(src) >= 1 and alloc.refcount(dst) == 1
            self.memory[dst] = list(self.memory[src])
        bs = alloc.block_size
        for p, token in enumerate(new, start):
            block = seq.table.blocks[p // bs]
            assert alloc.refcount(block) == 1, "wrote into a block another table holds"
            self.memory[block][p % bs] = token
        seq.tokens = seq.tokens[:start] + new
        alloc.commit(seq.table, seq.tokens)
        parent = ROOT_HASH
        for i, key in enumerate(seq.table.hashes):
            parent = chain_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
            assert key == parent
            self.key_tokens[key] = seq.tokens[:(i + 1) * bs]
        return True

    @rule(target=seqs, prompt=tokens_st)
    def start_sequence(self, prompt: list[int]) -> Sequence_ | None:
        if self.alloc is None:
            return None
        seq = Sequence_(BlockTable(), [])
        expected = self.alloc.lookup_prefix(prompt)
        reused = self.alloc.attach_prefix(seq.table, prompt)
        assert seq.table.blocks == expected and reused == len(expected) * self.alloc.block_size
        seq.tokens = prompt[:reused]
        self.live.append(seq)
        self._write(seq, reused, prompt[reused:])
        return seq

    @rule(seq=seqs, new=tokens_st)
    def append(self, seq: Sequence_ | None, new: list[int]) -> None:
        if seq is not None and seq in self.live:
            self._write(seq, seq.table.num_tokens, new)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq: Sequence_ | None) -> Sequence_ | None:
        if seq is None or seq not in self.live:
            return None
        assert self.alloc is not None
        child = Sequence_(self.alloc.fork(seq.table), list(seq.tokens))
        self.live.append(child)
        return child

    @rule(seq=seqs, keep=st.integers(0, 16), new=tokens_st)
    def rewrite(self, seq: Sequence_ | None, keep: int, new: list[int]) -> None:
        """Roll back and write different tokens: writes into shared and cached blocks."""
        if seq is not None and seq in self.live:
            assert self.alloc is not None
            self.alloc.truncate(seq.table, keep)
            seq.tokens = seq.tokens[:seq.table.num_tokens]
            self._write(seq, seq.table.num_tokens, new)

    @rule(seq=seqs, at=st.integers(0, 16), new=tokens_st)
    def overwrite(self, seq: Sequence_ | None, at: int, new: list[int]) -> None:
        """Write over committed positions without truncating first."""
        if seq is not None and seq in self.live:
            self._write(seq, min(at, seq.table.num_tokens), new)

    @rule(seq=consumes(seqs))
    def free(self, seq: Sequence_ | None) -> None:
        if seq is not None and seq in self.live:
            assert self.alloc is not None
            self.alloc.free_table(seq.table)
            self.live.remove(seq)

    @rule(tokens=tokens_st)
    def lookup(self, tokens: list[int]) -> None:
        if self.alloc is None:
            return
        before = self.alloc.stats()
        bs = self.alloc.block_size
        for i, block in enumerate(self.alloc.lookup_prefix(tokens)):
            assert self.memory[block] == tokens[i * bs:(i + 1) * bs], "prefix hit on different tokens"
        assert self.alloc.stats() == before

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        if self.alloc is None:
            return
        bs = self.alloc.block_size
        for seq in self.live:
            assert seq.table.num_tokens == len(seq.tokens)
            got = [self.memory[seq.table.blocks[p // bs]][p % bs] for p in range(seq.table.num_tokens)]
            assert got == seq.tokens

    @invariant()
    def counts_balance(self) -> None:
        alloc = self.alloc
        if alloc is None:
            return
        holders: dict[int, int] = {}
        for seq in self.live:
            assert len(set(seq.table.blocks)) == len(seq.table.blocks)
            for b in seq.table.blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in range(alloc.num_blocks):
            assert alloc.refcount(b) == holders.get(b, 0)
        s = alloc.stats()
        assert s.used + s.free + s.cached == s.total
        assert s.used == len(holders) and s.shared == sum(1 for n in holders.values() if n > 1)
        for b in alloc._evictable:
            assert alloc.refcount(b) == 0
        assert not set(alloc._free) & set(holders) and not set(alloc._evictable) & set(holders)

    @invariant()
    def cached_blocks_hold_their_prefix(self) -> None:
        if self.alloc is None:
            return
        bs = self.alloc.block_size
        for key, block in self.alloc._cached.items():
            assert self.alloc._hash_of[block] == key
            assert self.memory[block] == self.key_tokens[key][-bs:]

    def teardown(self) -> None:
        if self.alloc is None:
            return
        for seq in self.live:
            self.alloc.free_table(seq.table)
        s = self.alloc.stats()
        assert s.used == 0 and s.free + s.cached == s.total
        self.alloc.clear_prefix_cache()
        assert self.alloc.stats().free == self.alloc.num_blocks


AllocatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocator = AllocatorMachine.TestCase


# -- targeted properties ------------------------------------------------------------


@given(st.lists(st.integers(0, 3), max_size=20), st.lists(st.integers(0, 3), max_size=20), st.integers(1, 4))
@settings(deadline=None)
def test_prefix_hits_only_on_identical_full_block_prefixes(a: list[int], b: list[int], bs: int) -> None:
    alloc = BlockAllocator(20, bs)
    table = BlockTable()
    alloc.prepare_write(table, 0, len(a))
    alloc.commit(table, a)
    hits = len(alloc.lookup_prefix(b))
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert hits == min(common, len(a)) // bs  # only the full blocks of a are cached
    assert alloc.lookup_prefix(b) == table.blocks[:hits]


def test_eviction_takes_least_recently_freed_unreferenced_blocks_only() -> None:
    alloc = BlockAllocator(6, 2)
    old, live = BlockTable(), BlockTable()
    for table, tokens in ((old, [1, 2, 3, 4]), (live, [5, 6, 7, 8])):
        alloc.prepare_write(table, 0, 4)
        alloc.commit(table, tokens)
    head, tail = old.blocks
    alloc.free_table(old)  # freed tail first: the tail is the least recently used
    assert alloc.stats() == PoolStats(total=6, used=2, free=2, cached=2, shared=0, prefix_blocks=4)
    grow = BlockTable()
    alloc.prepare_write(grow, 0, 6)  # 3 blocks: 2 free + the least recently freed cached one
    alloc.commit(grow, [9] * 6)
    assert tail in grow.blocks and head not in grow.blocks
    assert alloc.lookup_prefix([1, 2, 3, 4]) == [head]  # [1, 2] survives, [3, 4] was evicted
    assert len(alloc.lookup_prefix([5, 6, 7, 8])) == 2  # referenced blocks are never evicted
    with pytest.raises(CacheFullError):
        alloc.prepare_write(grow, 6, 10)  # needs 2; 1 evictable left


def test_cache_full_error_says_what_was_needed() -> None:
    alloc = BlockAllocator(4, 16, bytes_per_block=4096)
    table = BlockTable()
    alloc.prepare_write(table, 0, 40)
    with pytest.raises(CacheFullError) as info:
        alloc.prepare_write(table, 0, 100)
    msg = str(info.value)
    assert "needs 4 more block(s) of 16 positions (16,384 bytes" in msg
    assert "only 1 are available (4,096 bytes): 1 free and 0 evictable cached, of 4 in the pool" in msg
    assert info.value.blocks_needed == 4 and info.value.bytes_needed == 16384  # type: ignore[attr-defined]
    assert table.blocks == [0, 1, 2] and alloc.stats().free == 1  # nothing changed


def test_fork_then_write_copies_only_the_written_shared_block() -> None:
    alloc = BlockAllocator(8, 4)
    parent = BlockTable()
    alloc.prepare_write(parent, 0, 6)
    alloc.commit(parent, list(range(6)))
    child = alloc.fork(parent)
    assert alloc.stats().shared == 2
    copies = alloc.prepare_write(child, 6, 7)  # position 6 lies in the shared, partial block 1
    assert copies == [(parent.blocks[1], child.blocks[1])] and child.blocks[0] == parent.blocks[0]
    assert alloc.prepare_write(parent, 6, 7) == []  # now the parent's alone: written in place
    assert alloc.stats().shared == 1


def test_writing_a_cached_full_block_removes_it_from_the_prefix_cache() -> None:
    alloc = BlockAllocator(4, 2)
    table = BlockTable()
    alloc.prepare_write(table, 0, 4)
    alloc.commit(table, [1, 2, 3, 4])
    alloc.truncate(table, 3)  # the second block is kept, partly valid
    assert len(alloc.lookup_prefix([1, 2, 3, 4])) == 2
    assert alloc.prepare_write(table, 3, 4) == []  # sole owner: no copy, but its key must go
    assert len(alloc.lookup_prefix([1, 2, 3, 4])) == 1
