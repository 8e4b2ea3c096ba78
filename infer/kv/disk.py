"""The disk tier of the prefix cache (``prompt_cache_dir``): prefix blocks that outlive the process.

When a prefix block becomes *cached* — its last holder let it go, so it is
unreferenced, reusable and evictable (:mod:`infer.kv.blocks`) — its keys and
values (every layer of its state group) are written to one file named after
its prefix-cache key; a recurrent checkpoint keyed by a block hash likewise.
A later request whose prompt goes on past what memory holds reads the next
blocks back from disk (:meth:`DiskTier.fill`, called by
:meth:`~infer.kv.paged.PagedSequenceCache.reuse_prefix`), into the pool's
prefix cache, and computes only what neither holds. Writing at release
rather than at eviction means the files are there when the process ends,
however it ends, and evicting from memory costs nothing.

Each entry is a state file (:mod:`infer.kv.state_file`: checksummed,
written to a temporary file and renamed), under a folder named after the
:class:`~infer.kv.fingerprint.Fingerprint` of the model and cache settings,
so two models never read each other's blocks. Processes sharing one folder
need no lock: a rename is atomic, so a reader sees a whole file or none; two
writers of one key write the same bytes; a file deleted under a reader is a
miss; a damaged one is a miss and is deleted. The folder is kept under
``max_bytes``: after a write past the bound, the least recently used files
(modification time; a hit touches its file) are deleted until it holds 90%
of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from infer.errors import CacheFullError, StateFileError
from infer.kv.blocks import ROOT_HASH, BlockAllocator, chain_hash, tail_hash
from infer.kv.fingerprint import Fingerprint
from infer.kv.paged import PagedKVPool
from infer.kv.snapshot import TAGS, kv_layers, to_device, to_host
from infer.kv.state_file import StateFile, Tensor, read_state_file, write_state_file

log = logging.getLogger(__name__)


class DiskTier:
    """Prefix blocks and checkpoints of one model's pool in ``folder``, at
    most ``max_bytes`` of them (see the module docs)."""

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int, fingerprint: Fingerprint) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise StateFileError(f"the prompt cache's bound must be a positive number of bytes, got {max_bytes!r}")
        self.root = Path(folder)
        self.fingerprint = fingerprint
        name = hashlib.sha256(json.dumps(fingerprint.to_json(), sort_keys=True).encode()).hexdigest()[:32]
        #: This model's entries (another model's folder is a sibling).
        self.folder = self.root / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._bytes = self._scan_bytes()
        #: Blocks and checkpoints read back and written, for figures and tests.
        self.hits = 0
        self.writes = 0
        self.pool: PagedKVPool | None = None

    def attach(self, pool: PagedKVPool) -> None:
        """Write ``pool``'s prefix blocks and checkpoints here as they become cached."""
        self.pool = pool
        seen: set[int] = set()
        for alloc in pool.allocators:
            if id(alloc) not in seen:
                seen.add(id(alloc))
                alloc.on_cached = self._spill_block
        if pool.state_store is not None:
            pool.state_store.allocator.on_cached = self._spill_checkpoint
        pool.disk = self

    # -- files ------------------------------------------------------------------------

    def _path(self, key: bytes, kind: str) -> Path:
        return self.folder / f"{hashlib.sha256(key).hexdigest()}.{kind}"

    def _scan_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.folder):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def _write(self, path: Path, tensors: dict[str, Tensor], kind: str) -> None:
        if path.exists():  # written before (by this process or another): only its use is new
            _touch(path)
            return
        size = sum(t.data.nbytes for t in tensors.values())
        if size > self.max_bytes:
            return
        try:
            info = {"fingerprint": self.fingerprint.to_json(), "kind": kind}
            self._bytes += write_state_file(path, info, tensors, durable=False)
        except OSError as exc:  # a full or read-only disk costs the disk tier, never the request
            log.warning("prompt cache: cannot write %s: %s", path, exc)
            return
        self.writes += 1
        if self._bytes > self.max_bytes:
            self._trim()

    def _trim(self) -> None:
        """Delete the least recently used files until the folder holds 90% of the bound."""
        entries = []
        for entry in os.scandir(self.folder):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, entry.path))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes * 9 // 10:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:  # another process trimmed it first
                pass
            total -= size
        self._bytes = total

    def _read(self, path: Path) -> StateFile | None:
        try:
            state = read_state_file(path)
            if Fingerprint.from_json(state.info.get("fingerprint"), path) != self.fingerprint:
                return None
        except StateFileError as exc:
            if path.exists():  # damaged: a miss, and gone so the next writer replaces it
                log.warning("prompt cache: dropping %s: %s", path, exc)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return None
        _touch(path)
        return state

    # -- writing: blocks as they become cached -------------------------------------------

    def _group_of(self, key: bytes) -> int:
        """The state group a (salted) prefix-cache key is of: ``b"group N:"`` + hash, or a bare hash (group 0)."""
        salt = key[:-32]
        return int(salt[6:-1]) if salt else 0

    def _spill_block(self, alloc: BlockAllocator, block: int, key: bytes) -> None:
        pool = self.pool
        assert pool is not None
        group = self._group_of(key) if pool.shared_pages else pool.allocators.index(alloc)
        tensors = {}
        ops = pool.backend
        rows = ops.from_numpy(pool.rows_of([block], 0, pool.block_size))
        for layer in self._layers(group):
            storage = kv_layers(pool)[layer][0]
            keys, values = pool.stored(storage)
            tag = TAGS[ops.dtype(keys)]
            tensors[f"kv.{layer}.keys"] = Tensor(tag, to_host(ops, ops.take(keys, rows, axis=0), tag))
            tensors[f"kv.{layer}.values"] = Tensor(tag, to_host(ops, ops.take(values, rows, axis=0), tag))
        # An empty entry for a group without keys and values (a pure recurrent model): the block's
        # key is what a hit follows, and its checkpoint hangs on it.
        self._write(self._path(key, "kv"), tensors, "kv")

    def _spill_checkpoint(self, alloc: BlockAllocator, slot: int, key: bytes) -> None:
        pool = self.pool
        assert pool is not None and pool.state_store is not None
        store = pool.state_store
        ops = store.backend
        idx = ops.from_numpy(np.asarray([slot], np.int32))
        tensors = {}
        for layer, arrays in store.arrays.items():
            tag = TAGS.get(store.specs[layer].dtype, "F32")
            for name, a in arrays.items():
                tensors[f"state.{layer}.{name}"] = Tensor(tag, to_host(ops, ops.take(a, idx, axis=0), tag)[0])
        self._write(self._path(key, "state"), tensors, "state")

    def _layers(self, group: int) -> list[int]:
        pool = self.pool
        assert pool is not None
        return [i for i, (s, g, w) in enumerate(kv_layers(pool)) if g == group and w and pool.allocated(s)]

    # -- reading: what a prompt goes on with ---------------------------------------------

    def fill(self, tokens: Sequence[int]) -> int:
        """Enter in the pool's prefix cache the blocks of ``tokens`` (full
        blocks, in order) that memory lacks and disk holds, up to the first
        one neither holds, with the recurrent checkpoints at their ends, and
        then a saved state's tail that ``tokens`` go on with. Returns the
        blocks read back."""
        pool = self.pool
        assert pool is not None
        bs = pool.block_size
        held: list[tuple[BlockAllocator, int]] = []  # held while filling, so no allocation evicts them
        read = 0
        try:
            parent, done = ROOT_HASH, 0
            while done < len(tokens) // bs:
                key = chain_hash(parent, tokens[done * bs:(done + 1) * bs])
                got = self._fill_block(key, held)
                if got is None:
                    break
                read, parent, done = read + got, key, done + 1
            # Where the full blocks end, a saved state's partial last block may go on (as reuse_prefix looks).
            read += self._fill_tail(parent, tokens[done * bs:], held)
        finally:
            for alloc, block in reversed(held):
                alloc.free(block)
        self.hits += read
        return read

    def _fill_tail(self, parent: bytes, rest: Sequence[int], held: list[tuple[BlockAllocator, int]]) -> int:
        """Where the full blocks found end: the longest restored tail (a saved state's
        partial last block with its final recurrent state, keyed by
        :func:`~infer.kv.blocks.tail_hash`) that ``rest`` starts with, read
        back where memory lacks it. Returns the blocks read."""
        pool = self.pool
        assert pool is not None
        for j in range(min(pool.block_size - 1, len(rest)), 0, -1):
            key = tail_hash(parent, rest[:j])
            if pool.allocator.lookup(key) is not None or self._path(key, "kv").exists():
                return self._fill_block(key, held) or 0  # what memory lacks of it (a group, the final state)
        return 0

    def write_logits(self, key: bytes, logits: np.ndarray) -> None:
        """Keep the logits row after a restored state's last token (its
        :func:`~infer.kv.blocks.sequence_key`), so that a later process
        finds the whole state and computes nothing for exactly its tokens."""
        self._write(self._path(key, "logits"), {"logits": Tensor("F32", np.ascontiguousarray(logits, "<f4"))},
                    "logits")

    def read_logits(self, key: bytes) -> np.ndarray | None:
        """The logits row :meth:`write_logits` kept under ``key``, or None."""
        path = self._path(key, "logits")
        state = self._read(path) if path.exists() else None
        t = None if state is None else state.tensors.get("logits")
        if t is None or t.dtype != "F32" or t.data.ndim != 1 or not np.isfinite(t.data).all():
            return None
        return t.data

    def _fill_block(self, key: bytes, held: list[tuple[BlockAllocator, int]]) -> int | None:
        """Block ``key`` in every group and its checkpoint in memory (read from
        disk where missing); None when neither holds group 0's block."""
        pool = self.pool
        assert pool is not None
        read = 0
        for g, (alloc, salt) in enumerate(zip(pool.allocators, pool.salts)):
            block = alloc.lookup(salt + key)
            if block is not None:
                alloc.incref(block)
                held.append((alloc, block))
                continue
            path = self._path(salt + key, "kv")
            state = self._read(path) if path.exists() else None
            if state is None:
                if g == 0:
                    return None
                continue  # a window's block long out of its window: the hit decides whether it matters
            try:
                block = alloc.allocate()
            except CacheFullError:
                return None
            held.append((alloc, block))
            if not self._load_block(g, block, state):
                return None
            alloc.register(block, salt + key)
            read += 1
        store = pool.state_store
        if store is not None and store.allocator.lookup(key) is None:
            path = self._path(key, "state")
            state = self._read(path) if path.exists() else None
            if state is not None:
                slot = store.take_slot()
                if slot is not None:
                    held.append((store.allocator, slot))
                    if self._load_checkpoint(slot, state):
                        store.allocator.register(slot, key)
        return read

    def _load_block(self, group: int, block: int, state: StateFile) -> bool:
        pool = self.pool
        assert pool is not None
        ops = pool.backend
        dst = ops.from_numpy(pool.rows_of([block], 0, pool.block_size))
        kv = kv_layers(pool)
        layers = [i for i, (s, g, w) in enumerate(kv) if g == group and w]
        for layer in layers:
            k, v = state.tensors.get(f"kv.{layer}.keys"), state.tensors.get(f"kv.{layer}.values")
            if k is None or v is None or k.data.shape[0] != pool.block_size:
                return False
            dtype = pool.dtype or ops.compute_dtype
            keys_in, values_in = to_device(ops, k, dtype), to_device(ops, v, dtype)
            keys, values = pool.layer_arrays(kv[layer][0], keys_in, values_in)
            if ops.shape(keys)[1:] != ops.shape(keys_in)[1:] or ops.shape(values)[1:] != ops.shape(values_in)[1:]:
                return False
            pool.set_layer_arrays(kv[layer][0], ops.scatter_rows(keys, dst, keys_in),
                                  ops.scatter_rows(values, dst, values_in))
        return True

    def _load_checkpoint(self, slot: int, state: StateFile) -> bool:
        pool = self.pool
        assert pool is not None and pool.state_store is not None
        store = pool.state_store
        ops = store.backend
        idx = ops.from_numpy(np.asarray([slot], np.int32))
        for layer, arrays in store.arrays.items():
            for name, a in arrays.items():
                t = state.tensors.get(f"state.{layer}.{name}")
                if t is None or tuple(t.data.shape) != tuple(store.specs[layer].arrays[name]):
                    return False
                arrays[name] = ops.scatter_rows(a, idx, to_device(ops, Tensor(t.dtype, t.data[None]),
                                                                 store.specs[layer].dtype))
        return True


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass
