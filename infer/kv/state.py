"""Recurrent state: fixed-size arrays per sequence, in slots, with checkpoints.

A recurrent layer (a convolution window, an SSM or delta-rule matrix; see
:class:`~infer.kv.attention.Recurrent`) keeps per sequence a few arrays whose
size does not grow with the sequence. :class:`StateStore` holds, per such
layer and per named array, one backend array ``[slots, *shape]``; a sequence
owns one *live* slot (:class:`SequenceStates`), which a forward gathers
(``ctx.state(layer)``, ``[B, ...]`` in batch order) and writes back
(``ctx.set_state``, one :meth:`~infer.ops.Backend.scatter_rows` by slot).

Unlike keys and values, a recurrent state cannot be cut back to an earlier
position: the state after ``p`` tokens is gone once token ``p`` is folded
in. So the engine keeps **checkpoints**, copies of the state after given
positions, in further slots of the same arrays:

* at every block boundary (position ``i * block_size``), keyed by the same
  chain hash as the KV block that ends there (:func:`~infer.kv.blocks.chain_hash`),
  so a prefix hit needs both the blocks and the checkpoint at the hit point;
* at the end of every chunk of more than one token (a prompt's end);
* after every row of a speculative verification chunk, so rejecting drafts
  restores the state exactly.

The recurrent op writes a checkpoint as one more output: the state after
each of the forward's *checkpoint rows* (``ctx.checkpoint_rows``).
Truncating to ``length`` restores the newest checkpoint at or before it, and
the engine replays the tokens between (:meth:`infer.engine.Engine.truncate`).

Slots are reference counted and keyed checkpoints cached exactly as KV
blocks are (a :class:`~infer.kv.blocks.BlockAllocator` of blocks of one
slot): a sequence holds its live slot and its newest checkpoints; older
keyed ones stay cached, unreferenced, until a slot is needed (least recently
released first). The cost model is in docs/kv-cache.md ("Checkpoints").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from infer.errors import CacheFullError
from infer.kv.attention import Recurrent
from infer.kv.blocks import BlockAllocator
from infer.ops import Array, Backend

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


class StateStore:
    """Every sequence's recurrent state and checkpoints, ``num_slots`` slots
    of ``specs[layer]`` arrays per recurrent cache layer."""

    def __init__(self, backend: Backend, specs: Mapping[int, Recurrent], num_slots: int) -> None:
        self.backend = backend
        self.specs = dict(specs)
        self.num_slots = num_slots
        self.allocator = BlockAllocator(num_slots, 1)
        #: layer -> name -> ``[num_slots, *shape]``.
        self.arrays: dict[int, dict[str, Array]] = {
            layer: {name: backend.zeros((num_slots, *shape), spec.dtype) for name, shape in spec.arrays.items()}
            for layer, spec in self.specs.items()
        }
        self._zeros = {layer: {name: np.zeros((1, *shape), np.float32) for name, shape in spec.arrays.items()}
                       for layer, spec in self.specs.items()}

    @staticmethod
    def nbytes_per_slot_of(specs: Mapping[int, Recurrent]) -> int:
        """Bytes of one slot (one sequence's state, or one checkpoint) across the layers."""
        total = 0
        for spec in specs.values():
            for shape in spec.arrays.values():
                total += int(np.prod(shape, dtype=np.int64)) * _DTYPE_BYTES.get(spec.dtype, 4)
        return total

    @property
    def nbytes_per_slot(self) -> int:
        return self.nbytes_per_slot_of(self.specs)

    def slots_held(self) -> int:
        """Slots referenced by a sequence (live states and held checkpoints)."""
        return self.allocator.stats().used

    def new_sequence(self) -> SequenceStates:
        """A sequence's live slot, zeroed (the state before any token)."""
        slot = self.take_slot()
        if slot is None:
            raise self.full("a new sequence")
        self.reset(slot)
        return SequenceStates(self, slot)

    def copy(self, src: int, dst: int) -> None:
        ops = self.backend
        s, d = ops.from_numpy(np.asarray([src], np.int32)), ops.from_numpy(np.asarray([dst], np.int32))
        for layer, arrays in self.arrays.items():
            for name, a in arrays.items():
                arrays[name] = ops.scatter_rows(a, d, ops.take(a, s, axis=0))

    def reset(self, slot: int) -> None:
        ops = self.backend
        d = ops.from_numpy(np.asarray([slot], np.int32))
        for layer, arrays in self.arrays.items():
            for name, a in arrays.items():
                arrays[name] = ops.scatter_rows(a, d, ops.from_numpy(self._zeros[layer][name]))

    def full(self, what: str) -> CacheFullError:
        return CacheFullError(f"no recurrent state slot is free for {what}: all {self.num_slots} are held "
                              f"({self.nbytes_per_slot:,} bytes each) by live states and checkpoints; finish or "
                              "free sequences, or give the engine more state_slots")

    def take_slot(self) -> int | None:
        """A free slot (evicting the least recently released cached
        checkpoint), or None when every slot is held."""
        try:
            return self.allocator.allocate()
        except CacheFullError:
            return None


class SequenceStates:
    """One sequence's live slot and the checkpoints it holds (position -> slot)."""

    def __init__(self, store: StateStore, slot: int) -> None:
        self.store = store
        self.slot = slot
        self.checkpoints: dict[int, int] = {}
        #: Checkpoints the forward being prepared writes: (position, slot, key or None).
        self.pending: list[tuple[int, int, bytes | None]] = []

    def plan(self, length: int, positions: Sequence[int], keys: Mapping[int, bytes]) -> list[tuple[int, int]]:
        """Slots for checkpoints after ``positions`` of the coming forward
        (best effort: a checkpoint whose key is cached already, or for which
        no slot is left, is not taken). First the checkpoints no rollback of
        a sequence of ``length`` positions needs are let go: all but the
        newest at or before ``length`` (keyed ones stay cached)."""
        self.prune(length)
        if self.slot < 0:  # freed, and used again (a cache reused after free())
            slot = self.store.take_slot()
            if slot is None:
                raise self.store.full("a sequence used again after free()")
            self.slot = slot
            self.store.reset(slot)
        alloc = self.store.allocator
        planned = []
        for p in sorted(positions, reverse=True):  # short of slots, the newest (the one kept) first
            key = keys.get(p)
            if p in self.checkpoints or (key is not None and alloc.lookup(key) is not None):
                continue
            slot = self.store.take_slot()
            if slot is None:
                break
            self.pending.append((p, slot, key))
            planned.append((p, slot))
        return planned[::-1]

    def commit(self) -> None:
        """The planned checkpoints were written: hold them, and key the boundary ones."""
        for p, slot, key in self.pending:
            self.checkpoints[p] = slot
            if key is not None:
                self.store.allocator.register(slot, key)
        self.pending.clear()

    def cancel(self) -> None:
        for _, slot, _ in self.pending:
            self.store.allocator.free(slot)
        self.pending.clear()

    def prune(self, length: int) -> None:
        keep = max((p for p in self.checkpoints if p <= length), default=None)
        for p in [p for p in self.checkpoints if p != keep]:
            self.store.allocator.free(self.checkpoints.pop(p))

    def restore(self, length: int, keyed: Sequence[tuple[int, bytes]] = ()) -> int:
        """The live state set to the newest checkpoint at or before
        ``length``: one this sequence holds, or a cached one of ``keyed``
        (``(position, chain hash)`` of its block boundaries), or the empty
        state (position 0). Returns the checkpoint's position; later
        checkpoints are let go."""
        self.cancel()
        for p in [p for p in self.checkpoints if p > length]:
            self.store.allocator.free(self.checkpoints.pop(p))
        best, src = 0, None
        if self.checkpoints:
            best = max(self.checkpoints)
            src = self.checkpoints[best]
        for p, key in keyed:
            if best < p <= length:
                slot = self.store.allocator.lookup(key)
                if slot is not None:
                    best, src = p, slot
        if src is None:
            self.store.reset(self.slot)
        else:
            self.store.copy(src, self.slot)
        return best

    def attach(self, position: int, key: bytes) -> bool:
        """Start from the cached checkpoint ``key`` (after ``position``
        tokens); False when it is not cached."""
        alloc = self.store.allocator
        slot = alloc.lookup(key)
        if slot is None:
            return False
        alloc.incref(slot)
        self.checkpoints[position] = slot
        self.store.copy(slot, self.slot)
        return True

    def fork(self) -> SequenceStates:
        """A second sequence with a copy of this state and the same checkpoints."""
        slot = self.store.take_slot()
        if slot is None:
            raise self.store.full("a fork")
        self.store.copy(self.slot, slot)
        other = SequenceStates(self.store, slot)
        for p, s in self.checkpoints.items():
            self.store.allocator.incref(s)
            other.checkpoints[p] = s
        return other

    def __del__(self) -> None:
        # A sequence dropped without free() (an engine.forward on a fresh sequence, never
        # released) gives its slots back when it goes, so such sequences cannot use up the
        # store one by one.
        try:
            self.free()
        except Exception:  # interpreter shutdown: the store may be gone already
            pass

    def free(self) -> None:
        self.cancel()
        for s in self.checkpoints.values():
            self.store.allocator.free(s)
        self.checkpoints.clear()
        if self.slot >= 0:
            self.store.allocator.free(self.slot)
            self.slot = -1
