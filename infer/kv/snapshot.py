"""A sequence's state out of a paged pool into a state file, and back into a pool's prefix cache.

:func:`capture` reads what a :class:`~infer.kv.paged.PagedSequenceCache`
holds: its token ids, per cache layer the keys and values of its blocks (a
sliding window's: those still within its window and margin), in the pool's
own dtype, and its recurrent layers' keyed checkpoints at block boundaries
and its final state. :func:`restore` enters them in a pool's prefix cache as
if a request had just computed them and gone: full blocks under their chain
hashes (:func:`~infer.kv.blocks.chain_hash`), checkpoints under the hash of
the block they end, and the partial last block with the final state under
a *tail* key (:func:`~infer.kv.blocks.tail_hash`), so a request whose prompt
starts with the whole saved sequence computes only what follows it
(:meth:`~infer.kv.paged.PagedSequenceCache.reuse_prefix`). Everything
restored is cached and evictable like any prefix block; nothing is held.

Tensors are named per cache layer, not per state group, so a state saved
from a pool with separate allocators restores into one with shared pages:

* ``tokens`` — int64 ``[N]``;
* ``kv.{layer}.keys`` / ``kv.{layer}.values`` — ``[blocks × block_size, *row]``,
  the layer's blocks listed in the description's ``layers[layer]``;
* ``state.{position}.{layer}.{name}`` — a recurrent array after ``position``
  tokens (a block boundary, or ``N``: the final state);
* ``logits`` — float32 ``[vocab]``, the logits after the last token (where
  the saver had them; the description's ``logits`` is true): restored into
  the pool's :class:`~infer.kv.paged.FinalLogits`, they let a request whose
  prompt is exactly the saved tokens draw its first token without computing
  anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.errors import CacheFullError, StateFileError
from infer.kv.blocks import ROOT_HASH, BlockAllocator, chain_hash, tail_hash
from infer.kv.fingerprint import Fingerprint
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.kv.state_file import StateFile, Tensor
from infer.ops import Array, Backend

#: Backend dtype name -> safetensors dtype name.
TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class RestoredState:
    """What :func:`restore` entered in a pool's prefix cache."""

    #: The saved sequence's token ids.
    tokens: list[int]
    #: Leading positions a request starting with :attr:`tokens` finds cached
    #: (all of them unless the pool had too little room).
    cached: int
    #: Whether the logits after the last token came back too, so that a
    #: request of exactly :attr:`tokens` computes nothing (files saved
    #: before they were kept lack them: such a request computes its last block).
    logits: bool = False


def to_host(ops: Backend, x: Array, tag: str) -> np.ndarray:
    """``x`` on the host as a state file stores it (``tag``: its safetensors dtype)."""
    if tag == "BF16":  # numpy has no bfloat16: float32 holds it exactly, its top half is the value
        return (ops.to_numpy(ops.astype(x, "float32")).astype("<f4").view("<u4") >> 16).astype("<u2")
    return ops.to_numpy(x)


def to_device(ops: Backend, t: Tensor, dtype: str) -> Array:
    """A state file's tensor as a backend array of ``dtype``."""
    data = t.data
    if t.dtype == "BF16":
        data = (data.astype("<u4") << 16).view("<f4")
    return ops.from_numpy(np.ascontiguousarray(data), dtype=dtype)


def kv_layers(pool: PagedKVPool) -> list[tuple[int, int, bool]]:
    """Per cache layer of ``pool`` its (storage layer, state group, writes)."""
    return pool.layer_kv or [(i, 0, True) for i in range(pool.num_layers)]


def capture(cache: PagedSequenceCache, fingerprint: Fingerprint,
            logits: np.ndarray | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The description and tensors of a state file holding ``cache``'s state
    (and ``logits``, the row after its last token, where given)."""
    pool, bs = cache.pool, cache.pool.block_size
    ops = pool.backend
    tokens = list(cache.tokens)
    n = len(tokens)
    if n == 0 or n != cache.length:
        raise StateFileError(f"only a computed sequence can be saved (it holds {cache.length} positions, "
                             f"{n} token ids)")
    blocks = -(-n // bs)
    tag = TAGS.get(fingerprint.kv_dtype)
    tensors: dict[str, Tensor] = {"tokens": Tensor("I64", np.asarray(tokens, np.int64))}
    layers: dict[str, list[int]] = {}
    for layer, (storage, group, writes) in enumerate(kv_layers(pool)):
        if group < 0 or not writes or not pool.allocated(storage):
            continue
        table = cache.tables[group].blocks
        present = [i for i in range(blocks) if table[i] >= 0]
        rows = ops.from_numpy(pool.rows_of([table[i] for i in present], 0, len(present) * bs))
        keys, values = pool.stored(storage)
        if tag is None:
            raise StateFileError(f"keys and values stored as {fingerprint.kv_dtype!r} cannot be saved")
        tensors[f"kv.{layer}.keys"] = Tensor(tag, to_host(ops, ops.take(keys, rows, axis=0), tag))
        tensors[f"kv.{layer}.values"] = Tensor(tag, to_host(ops, ops.take(values, rows, axis=0), tag))
        layers[str(layer)] = present
    checkpoints = []
    states = cache.states
    if states is not None:
        store = states.store
        hashes = cache.table.hashes
        for b, key in enumerate(hashes[:n // bs]):
            slot = store.allocator.lookup(key)
            if slot is not None and (b + 1) * bs != n:  # the final state is taken from the live slot below
                _save_slot(store, slot, (b + 1) * bs, tensors)
                checkpoints.append((b + 1) * bs)
        _save_slot(store, states.slot, n, tensors)
        checkpoints.append(n)
    if logits is not None:
        tensors["logits"] = Tensor("F32", np.ascontiguousarray(logits, dtype="<f4").reshape(-1))
    info = {"fingerprint": fingerprint.to_json(), "tokens": n, "layers": layers, "checkpoints": checkpoints,
            "logits": logits is not None}
    return info, tensors


def _save_slot(store: Any, slot: int, position: int, tensors: dict[str, Tensor]) -> None:
    ops = store.backend
    idx = ops.from_numpy(np.asarray([slot], np.int32))
    for layer, arrays in store.arrays.items():
        tag = TAGS.get(store.specs[layer].dtype, "F32")
        for name, a in arrays.items():
            tensors[f"state.{position}.{layer}.{name}"] = Tensor(tag, to_host(ops, ops.take(a, idx, axis=0), tag)[0])


def read_fingerprint(state: StateFile) -> Fingerprint:
    return Fingerprint.from_json(state.info.get("fingerprint"), state.path)


def restore(pool: PagedKVPool, state: StateFile, fingerprint: Fingerprint) -> RestoredState:
    """Enter ``state`` in ``pool``'s prefix cache. Raises
    :class:`~infer.errors.StateMismatchError` when it was computed with
    another :class:`Fingerprint`, :class:`~infer.errors.StateFileError`
    when its tensors do not fit the pool's layers. Blocks already cached
    stay as they are; when the pool has too little room, the longest prefix
    that fits is entered (``cached`` says how much)."""
    path = state.path
    fingerprint.check(read_fingerprint(state), path)
    tokens, layers, checkpoints = _layout(pool, state)
    bs, ops = pool.block_size, pool.backend
    n = len(tokens)
    full = n // bs
    hashes, parent = [], ROOT_HASH
    for b in range(full):
        parent = chain_hash(parent, tokens[b * bs:(b + 1) * bs])
        hashes.append(parent)
    tail = tail_hash(parent, tokens[full * bs:]) if n % bs else None
    held: list[tuple[BlockAllocator, int]] = []  # let go once everything is written: then cached, evictable
    try:
        cached = full * bs + (n % bs)
        kv = kv_layers(pool)
        for g, (alloc, salt) in enumerate(zip(pool.allocators, pool.salts)):
            mine = [i for i, (_, gi, w) in enumerate(kv) if gi == g and w and str(i) in layers]
            # A group whose layers keep no keys and values (a pure recurrent model's) still keys its
            # blocks: they are the prefix cache's bookkeeping, which the checkpoints hang on.
            present = set.intersection(*(set(layers[str(i)]) for i in mine)) if mine else set(range(full + 1))
            wanted = [(b, salt + hashes[b]) for b in range(full) if b in present]
            if tail is not None and full in present:
                wanted.append((full, salt + tail))
            placed: list[tuple[int, int]] = []  # (logical block, pool block)
            for b, key in wanted:
                if alloc.lookup(key) is not None:
                    continue
                try:
                    block = alloc.allocate()
                except CacheFullError:
                    cached = min(cached, b * bs)
                    break
                held.append((alloc, block))
                placed.append((b, block))
                alloc.register(block, key)
            if placed:
                _write_blocks(pool, state, mine, layers, placed)
        store = pool.state_store
        if store is not None:
            for p in checkpoints:
                key = tail if p % bs else hashes[p // bs - 1]
                if key is None or store.allocator.lookup(key) is not None:
                    continue
                slot = store.take_slot()
                if slot is None:
                    cached = min(cached, max((q for q in checkpoints if q < p), default=0))
                    break
                held.append((store.allocator, slot))
                idx = ops.from_numpy(np.asarray([slot], np.int32))
                for layer, arrays in store.arrays.items():
                    for name, a in arrays.items():
                        t = state.tensors[f"state.{p}.{layer}.{name}"]
                        row = to_device(ops, Tensor(t.dtype, t.data[None]), store.specs[layer].dtype)
                        arrays[name] = ops.scatter_rows(a, idx, row)
                store.allocator.register(slot, key)
    finally:
        for alloc, block in reversed(held):  # the head freed last: evicted last
            alloc.free(block)
    logits = state.tensors.get("logits") if state.info.get("logits") else None
    if logits is not None and cached == n:  # with every position in: the next token needs no forward
        key = tail if tail is not None else hashes[-1]
        pool.final_logits.put(key, logits.data)
        if pool.disk is not None:
            pool.disk.write_logits(key, logits.data)
    return RestoredState(tokens, cached, logits is not None and cached == n)


def _write_blocks(pool: PagedKVPool, state: StateFile, layers_of_group: Sequence[int], layers: dict[str, list[int]],
                  placed: Sequence[tuple[int, int]]) -> None:
    ops, bs = pool.backend, pool.block_size
    dst = ops.from_numpy(pool.rows_of([block for _, block in placed], 0, len(placed) * bs))
    kv = kv_layers(pool)
    for i in layers_of_group:
        order = {b: j for j, b in enumerate(layers[str(i)])}
        src = np.concatenate([np.arange(order[b] * bs, order[b] * bs + bs) for b, _ in placed])
        keys_t, values_t = state.tensors[f"kv.{i}.keys"], state.tensors[f"kv.{i}.values"]
        dtype = pool.dtype or pool.backend.compute_dtype
        k = to_device(ops, Tensor(keys_t.dtype, keys_t.data[src]), dtype)
        v = to_device(ops, Tensor(values_t.dtype, values_t.data[src]), dtype)
        storage = kv[i][0]
        keys, values = pool.layer_arrays(storage, k, v)
        if ops.shape(keys)[1:] != ops.shape(k)[1:] or ops.shape(values)[1:] != ops.shape(v)[1:]:
            raise StateFileError(f"{state.path}: layer {i}'s keys are rows of {ops.shape(k)[1:]}, the pool's "
                                 f"{ops.shape(keys)[1:]}")
        pool.set_layer_arrays(storage, ops.scatter_rows(keys, dst, k), ops.scatter_rows(values, dst, v))


def _layout(pool: PagedKVPool, state: StateFile) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """The saved tokens, blocks per layer and checkpoint positions, checked
    against each other and the pool (a file that passed its checksum can
    still have been written for another layout)."""
    path, info, tensors, bs = state.path, state.info, state.tensors, pool.block_size

    def bad(what: str) -> StateFileError:
        return StateFileError(f"{path}: {what}")

    t = tensors.get("tokens")
    n = info.get("tokens")
    if t is None or t.dtype != "I64" or t.data.ndim != 1 or not isinstance(n, int) or t.data.shape[0] != n or n < 1:
        raise bad(f"the tokens tensor does not hold the {n!r} tokens the description says")
    tokens = [int(x) for x in t.data]
    if min(tokens) < 0:
        raise bad("negative token ids")
    blocks = -(-n // bs)
    layers = info.get("layers")
    checkpoints = info.get("checkpoints")
    if not isinstance(layers, dict) or not isinstance(checkpoints, list):
        raise bad("the description has no layers / checkpoints")
    kv = kv_layers(pool)
    for key, present in layers.items():
        if not key.isdigit() or int(key) >= len(kv) or kv[int(key)][1] < 0 or not kv[int(key)][2]:
            raise bad(f"keys and values of cache layer {key}, which keeps none in this model")
        if (not isinstance(present, list) or any(not isinstance(b, int) or not 0 <= b < blocks for b in present)
                or present != sorted(set(present))):
            raise bad(f"layer {key}'s block list {present!r} is not within the {blocks} blocks of {n} tokens")
        for part in ("keys", "values"):
            arr = tensors.get(f"kv.{key}.{part}")
            if arr is None or arr.dtype not in TAGS.values() or arr.data.ndim < 1 \
                    or arr.data.shape[0] != len(present) * bs:
                raise bad(f"kv.{key}.{part} does not hold {len(present)} blocks of {bs} positions")
    if info.get("logits", False) is not False:
        logits = tensors.get("logits")
        if info.get("logits") is not True or logits is None or logits.dtype != "F32" or logits.data.ndim != 1 \
                or not logits.data.size or not np.isfinite(logits.data).all():
            raise bad("the logits after the last token are not one finite float32 row")
    store = pool.state_store
    if store is not None and n not in checkpoints:
        raise bad("a model with recurrent layers needs the final state, which the file lacks")
    for p in checkpoints:
        if not isinstance(p, int) or not 0 < p <= n or (p % bs and p != n):
            raise bad(f"a checkpoint at position {p!r} (block boundaries of {bs}, or {n})")
        if store is None:
            raise bad("recurrent state for a model without recurrent layers")
        for layer, spec in store.specs.items():
            for name, shape in spec.arrays.items():
                arr = tensors.get(f"state.{p}.{layer}.{name}")
                if arr is None or tuple(arr.data.shape) != tuple(shape):
                    raise bad(f"state.{p}.{layer}.{name} is not an array of {tuple(shape)}")
    return tokens, layers, checkpoints

