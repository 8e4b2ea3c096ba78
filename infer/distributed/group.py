"""The driver and its workers: one model over the ranks of a process group.

Rank 0 (the *driver*) runs the whole engine; its network is a
:class:`TensorParallelLM`, which wraps its own shard and, before each model
call the engine makes (``forward``, ``compute_logits``, ``mtp_forward``,
``mtp_compute_logits``), broadcasts a description of it to the other ranks
(the *workers*): the token ids, and for each sequence of the batch where its
keys and values go (its cache's id and capacity, or its pool and block
table) and which positions it writes. Each worker repeats the call on its
own shard, with caches that mirror the driver's (:class:`Worker`), so the
collectives inside the products meet. Everything above the network —
batching, paging, prefix caching, speculative decoding, scoring, the server
— is the engine's and runs unchanged; sampling happens on the driver only.

Block copies of a paged pool (copy-on-write) reach the workers through the
pool's ``copy_listeners``; a cache or pool the driver drops is dropped on the
workers with the next command. Commands are pickled and broadcast through
the backend's :meth:`~infer.ops.Backend.broadcast` (the ranks trust each
other); an idle driver sends a ping every quarter of the timeout so that a
waiting worker's collective never times out.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from infer.architecture import CausalLM
from infer.errors import WorkerError
from infer.kv.attention import AttentionContext, LayerState, SequenceSlice
from infer.kv.blocks import BlockTable
from infer.kv.cache import ContiguousKVCache
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.ops import Array, Backend

from .sharding import weight_bytes

log = logging.getLogger(__name__)


def send(ops: Backend, message: Any) -> None:
    """Broadcast ``message`` (pickled) from rank 0: a length, then the bytes."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    ops.broadcast(ops.from_numpy(np.asarray([len(data)], dtype=np.int64)))
    padded = data + b"\0" * (-len(data) % 4)
    ops.broadcast(ops.from_numpy(np.frombuffer(padded, dtype=np.int32).copy()))


def receive(ops: Backend) -> Any:
    """The next message :func:`send` broadcasts (on a rank other than 0)."""
    size = int(ops.to_numpy(ops.broadcast(ops.zeros((1,), "int64")))[0])
    words = ops.to_numpy(ops.broadcast(ops.zeros((-(-size // 4),), "int32")))
    return pickle.loads(words.tobytes()[:size])


class DriverGroup:
    """Rank 0's side of the group: sends commands, tracks caches and pools,
    watches the workers it started, and stops them."""

    def __init__(self, ops: Backend, *, timeout: float, processes: list[Any] | None = None) -> None:
        self.ops = ops
        self.timeout = timeout
        #: Worker processes this driver started (none under torchrun).
        self.processes = list(processes or [])
        self.lock = threading.RLock()
        self.broken: str | None = None
        self.closed = False
        self._events: list[tuple[Any, ...]] = []
        self._ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_id = 0
        self._last = time.monotonic()
        self._pinger = threading.Thread(target=self._ping, name="infer-tp-ping", daemon=True)
        self._pinger.start()

    # -- commands

    def call(self, message: dict[str, Any], local: Callable[[], Any], *tensors: Array,
             ctx: AttentionContext | None = None) -> Any:
        """Send ``message`` (with ``ctx``'s sequences described, and the
        pending events), broadcast ``tensors``, then run ``local`` (rank 0's
        share of the same call). Any failure once the command is out leaves
        the ranks out of step: the group is then broken and every later call
        raises :class:`WorkerError`."""
        with self.lock:
            self._check()
            if ctx is not None:
                message["slices"] = self.describe(ctx)
            message["events"], self._events = self._events, []
            try:
                send(self.ops, message)
                for t in tensors:
                    self.ops.broadcast(t)
                out = local()
            except Exception as exc:  # a collective failed (a peer died, or timed out), or rank 0's share did
                raise self._fail(exc) from exc
            except BaseException:  # KeyboardInterrupt mid-call: the workers are left inside it
                self.broken = "rank 0 was interrupted during a call"
                self._stop_processes(grace=0.0)
                raise
            finally:
                self._last = time.monotonic()
            return out

    def describe(self, ctx: AttentionContext) -> list[tuple[Any, ...]]:
        """Each sequence of ``ctx`` as the workers rebuild it: where its keys
        and values live and which positions this forward writes."""
        out = []
        for s in ctx.sequences:
            cache = s.cache
            if isinstance(cache, PagedSequenceCache):
                cache.prepare_positions(s.start, s.start + s.length)  # copies now, sent with this command
                pool = cache.pool
                out.append(("paged", self._pool_id(pool), pool.num_layers, pool.block_size, pool.num_blocks,
                            [list(t.blocks) for t in cache.tables], cache.capacity, s.start, s.length, pool.dtype))
            else:
                layers = getattr(cache, "num_layers", None)
                out.append(("contiguous", self._cache_id(cache), layers, cache.capacity, s.start, s.length,
                            getattr(cache, "dtype", None)))
        return out

    def _cache_id(self, cache: Any) -> int:
        key = self._ids.get(cache)
        if key is None:
            key = self._ids[cache] = self._new_id()
            weakref.finalize(cache, self._events.append, ("drop_cache", key))
        return key

    def _pool_id(self, pool: PagedKVPool) -> int:
        key = self._ids.get(pool)
        if key is None:
            key = self._ids[pool] = self._new_id()
            pool.copy_listeners.append(
                lambda copies, group, key=key: self._events.append(("copy", key, list(copies), group)))
            weakref.finalize(pool, self._events.append, ("drop_pool", key))
        return key

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- health and shutdown

    def _check(self) -> None:
        if self.closed:
            raise WorkerError("this tensor-parallel model is closed; load it again")
        if self.broken is not None:
            raise WorkerError(f"this tensor-parallel model's group is broken ({self.broken}); close it and load "
                              "it again")

    def _fail(self, exc: BaseException) -> WorkerError:
        deadline = time.monotonic() + 1.0  # a dead worker's sockets close a moment before it can be reaped
        while time.monotonic() < deadline and all(p.poll() is None for p in self.processes):
            time.sleep(0.05)
        dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.poll()})" for i, p in enumerate(self.processes)
                if p.poll() is not None]
        what = f"{', '.join(dead)} exited" if dead else "a rank failed or stopped answering"
        self.broken = f"{what}: {type(exc).__name__}: {exc}"
        log.error("tensor parallel: %s", self.broken)
        self._stop_processes(grace=0.0)
        return WorkerError(f"tensor parallelism over {self.ops.world_size} ranks: {self.broken} "
                           f"(collectives time out after {self.timeout:g} s)")

    def _ping(self) -> None:
        period = max(0.5, self.timeout / 4)
        while not self.closed:
            time.sleep(period / 4)
            if self.closed or self.broken is not None or time.monotonic() - self._last < period:
                continue
            if not self.lock.acquire(timeout=period):
                continue
            try:
                if not self.closed and self.broken is None:
                    send(self.ops, {"op": "ping", "events": []})
            except Exception as exc:  # noticed here first: the next call says so
                self.broken = f"a rank stopped answering: {type(exc).__name__}: {exc}"
                log.error("tensor parallel: %s", self.broken)
            finally:
                self._last = time.monotonic()
                self.lock.release()

    def close(self) -> None:
        """Tell the workers to exit, leave the group, and reap the workers
        this driver started (killed if they do not exit within 10 s)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.broken is None:
                try:
                    send(self.ops, {"op": "close", "events": []})
                except Exception as exc:
                    log.warning("tensor parallel: telling the workers to stop failed: %s", exc)
            self.ops.leave_group()
            self._stop_processes(grace=10.0 if self.broken is None else 0.0)

    def _stop_processes(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.processes:
            if p.poll() is None and grace > 0:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait()


class TensorParallelLM(CausalLM):
    """Rank 0's network: its own shard, with every call mirrored to the other
    ranks first (module docstring). The engine sees an ordinary
    :class:`~infer.architecture.CausalLM`."""

    def __init__(self, shard: CausalLM, group: DriverGroup, loader: Any = None) -> None:
        self.shard = shard
        self.group = group
        self.config = shard.config
        self.ops = shard.ops
        self.num_layers = shard.num_layers
        self.num_mtp_modules = shard.num_mtp_modules
        self.max_context = shard.max_context
        self.vocab_size = shard.vocab_size
        self.lm_head = shard.lm_head
        self.ignored_tensors = shard.ignored_tensors
        self._bytes_by_role = dict(loader.bytes_by_role) if loader is not None else {}

    @property
    def num_cache_layers(self) -> int:
        return self.shard.num_cache_layers

    def layer_states(self) -> list[LayerState]:
        """The shard's: every rank lays its state groups out alike."""
        return self.shard.layer_states()

    @property
    def ranks(self) -> int:
        """Ranks the model runs over."""
        return self.ops.world_size

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ids = self.ops.to_numpy(input_ids).astype(np.int32)
        return self.group.call({"op": "forward", "ids": ids}, lambda: self.shard.forward(input_ids, ctx), ctx=ctx)

    def compute_logits(self, hidden: Array) -> Array:
        message = {"op": "logits", "shape": self.ops.shape(hidden), "dtype": self.ops.dtype(hidden)}
        return self.group.call(message, lambda: self.shard.compute_logits(hidden), hidden)

    def mtp_forward(self, depth: int, hidden: Array, input_ids: Array, ctx: AttentionContext) -> Array:
        ids = self.ops.to_numpy(input_ids).astype(np.int32)
        message = {"op": "mtp_forward", "depth": depth, "ids": ids, "shape": self.ops.shape(hidden),
                   "dtype": self.ops.dtype(hidden)}
        return self.group.call(message, lambda: self.shard.mtp_forward(depth, hidden, input_ids, ctx), hidden,
                               ctx=ctx)

    def mtp_compute_logits(self, depth: int, hidden: Array) -> Array:
        message = {"op": "mtp_logits", "depth": depth, "shape": self.ops.shape(hidden),
                   "dtype": self.ops.dtype(hidden)}
        return self.group.call(message, lambda: self.shard.mtp_compute_logits(depth, hidden), hidden)

    def wait_ready(self) -> None:
        """Return once every rank has built its shard and waits for commands
        (one all-reduce); :class:`WorkerError` if one died meanwhile."""
        self.group.call({"op": "ready"}, lambda: self.ops.all_reduce(self.ops.zeros((1,))))

    def rank_weights(self) -> list[dict[str, int]]:
        """Per rank: the bytes of weights it holds by role (``heads``,
        ``kv_heads``, ``column``, ``row``, ``vocab``, ``replicated``), their
        ``total`` as prepared, and its resident set ``rss`` in bytes."""
        roles = ("heads", "kv_heads", "column", "row", "vocab", "replicated", "total", "rss")

        def local() -> Array:
            mine = dict(self._bytes_by_role, total=weight_bytes(self.shard, self.ops), rss=resident_bytes())
            row = np.asarray([[mine.get(r, 0) for r in roles]], dtype=np.int64)
            return self.ops.all_gather(self.ops.from_numpy(row), axis=0)

        table = self.ops.to_numpy(self.group.call({"op": "weights", "roles": roles}, local))
        return [dict(zip(roles, (int(v) for v in row))) for row in table]

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        self.group.close()


def resident_bytes() -> int:
    """This process's resident set size in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _MirroredPagedCache(PagedSequenceCache):
    """A worker's view of one driver sequence in a paged pool: the driver's
    block table of this forward, written where the driver's is (the
    driver's allocator chose the blocks and made them writable)."""

    def __init__(self, pool: PagedKVPool, tables: list[list[int]], capacity: int) -> None:
        mirrored = [BlockTable(blocks=list(blocks)) for blocks in tables]
        super().__init__(pool, mirrored[0], capacity, tables=mirrored)

    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        self.pool.write(layer, self.table.blocks, start, k, v)


class Worker:
    """A rank other than 0: repeats the driver's model calls on its shard
    until the driver closes the model."""

    def __init__(self, network: CausalLM, ops: Backend, loader: Any = None) -> None:
        self.network, self.ops = network, ops
        self.bytes_by_role = dict(loader.bytes_by_role) if loader is not None else {}
        self.caches: dict[int, ContiguousKVCache] = {}
        self.pools: dict[int, PagedKVPool] = {}

    def serve(self) -> None:
        """Run commands until ``close``."""
        ops = self.ops
        while True:
            message = receive(ops)
            self._apply(message["events"])
            op = message["op"]
            if op == "close":
                return
            if op == "forward":
                self.network.forward(ops.from_numpy(message["ids"]), self._context(message["slices"]))
            elif op == "logits":
                self.network.compute_logits(self._hidden(message))
            elif op == "mtp_forward":
                hidden = self._hidden(message)
                self.network.mtp_forward(message["depth"], hidden, ops.from_numpy(message["ids"]),
                                         self._context(message["slices"]))
            elif op == "mtp_logits":
                self.network.mtp_compute_logits(message["depth"], self._hidden(message))
            elif op == "ready":
                ops.all_reduce(ops.zeros((1,)))
            elif op == "weights":
                mine = dict(self.bytes_by_role, total=weight_bytes(self.network, ops), rss=resident_bytes())
                row = np.asarray([[mine.get(r, 0) for r in message["roles"]]], dtype=np.int64)
                ops.all_gather(ops.from_numpy(row), axis=0)
            elif op != "ping":
                raise WorkerError(f"rank {ops.rank}: unknown command {op!r} from rank 0")

    def _hidden(self, message: dict[str, Any]) -> Array:
        return self.ops.broadcast(self.ops.zeros(message["shape"], message["dtype"]))

    def _apply(self, events: list[tuple[Any, ...]]) -> None:
        for event in events:
            if event[0] == "drop_cache":
                self.caches.pop(event[1], None)
            elif event[0] == "drop_pool":
                self.pools.pop(event[1], None)
            elif event[0] == "copy" and event[1] in self.pools:
                self.pools[event[1]].copy_blocks(event[2], event[3])

    def _context(self, slices: list[tuple[Any, ...]]) -> AttentionContext:
        seqs = []
        for d in slices:
            if d[0] == "paged":
                _, key, layers, block_size, num_blocks, blocks, capacity, start, length, dtype = d
                pool = self.pools.get(key)
                if pool is None:  # this rank's share of the heads, stored as rank 0's (kv_dtype)
                    pool = self.pools[key] = PagedKVPool(self.ops, layers, block_size=block_size,
                                                         num_blocks=num_blocks,
                                                         layer_states=self.network.layer_states(), dtype=dtype)
                seqs.append(SequenceSlice(_MirroredPagedCache(pool, blocks, capacity), start, length))
            else:
                _, key, layers, capacity, start, length, dtype = d
                cache = self.caches.get(key)
                if cache is None:
                    cache = self.caches[key] = ContiguousKVCache(self.ops, layers or self.network.num_cache_layers,
                                                                 capacity, dtype=dtype)
                seqs.append(SequenceSlice(cache, start, length))
        return AttentionContext(self.ops, seqs)
