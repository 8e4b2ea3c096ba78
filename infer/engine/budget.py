"""How a batch engine's requests share KV memory.

A :class:`KVBudget` answers the three questions admission asks, so the batch
engine (:mod:`infer.engine.batch`) never asks which kind of cache it holds:

* :meth:`~KVBudget.check` — could a request ever fit, even alone?
* :meth:`~KVBudget.admit` — a sequence for the request now, or None while
  the requests already running leave too little;
* :meth:`~KVBudget.blocked` — the error when a request waits though none of
  the batch engine's own requests runs.

Positions for the next step are reserved through every cache's own
``reserve`` (:class:`~infer.kv.cache.SequenceCache`); where that fails the batch
engine preempts.

Two budgets:

* :class:`PagedBudget` — pages of one :class:`~infer.kv.paged.PagedKVPool`.
  A request starts with the cached blocks of its prompt's longest full-block
  prefix and is admitted while the pool, less what the running requests
  still need for their known tokens, can hold its prompt + ``max_tokens``;
  pages are taken as it grows, so decoding may run short (preemption).
* :class:`ContiguousBudget` — each admitted request gets a contiguous cache
  of its whole prompt + ``max_tokens`` within a number of positions; nothing
  is ever preempted, and there is no prefix caching.

Beside the KV memory, :class:`EncoderBudget` counts what requests with
images hold of the vision tower's memory: a request waits until its images'
activations and embeddings fit beside the running requests' (docs/vision.md,
"Memory").
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

from infer.adapters.slots import AdapterUse
from infer.engine.runner import Engine, SequenceState
from infer.errors import CacheFullError, EncoderMemoryError
from infer.kv.paged import PagedKVPool, PagedSequenceCache

log = logging.getLogger("infer.engine.batch")

#: Bytes of vision-tower activations and image embeddings a batch engine's
#: requests may hold together by default (:class:`EncoderBudget`).
DEFAULT_ENCODER_MEMORY = 4 * 2**30


class KVBudget(abc.ABC):
    """Where a batch engine's requests keep their keys and values."""

    #: The paged pool every request's pages come from (None: contiguous caches).
    pool: PagedKVPool | None = None

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @abc.abstractmethod
    def check(self, prompt_tokens: int, max_tokens: int, positions: int) -> None:
        """Raise :class:`~infer.errors.CacheFullError` when a request of
        ``positions`` (its prompt + ``max_tokens``, within the context) could
        not fit even with nothing else running."""

    @abc.abstractmethod
    def admit(
        self, positions: int, known: list[int], running: Sequence[tuple[SequenceState, int]], extra_key: bytes = b"",
        adapter: AdapterUse | None = None,
    ) -> SequenceState | None:
        """A sequence for a request of at most ``positions``, whose ``known``
        tokens are its prompt and what it generated before a preemption;
        None while the ``running`` requests (each its sequence and number of
        known tokens) leave too little. The sequence's tokens are those its
        cache starts with (a reused prefix). ``extra_key`` keys its cached
        blocks beside its tokens (:func:`infer.kv.blocks.root_hash`: a prompt's
        images); ``adapter``: the request's LoRA adapter, which the sequence
        carries (its prefix is looked up under the adapter's keys and
        ``extra_key`` together)."""

    @abc.abstractmethod
    def blocked(self, request: int, positions: int) -> CacheFullError:
        """Why request ``request``, of ``positions``, cannot be admitted
        although none of the batch engine's requests runs."""


class PagedBudget(KVBudget):
    """Requests in pages of one pool, with prefix caching and preemption."""

    def __init__(self, engine: Engine, pool: PagedKVPool) -> None:
        super().__init__(engine)
        self.pool = pool
        log.info("batch engine: paged KV pool of %d blocks of %d positions on %s/%s, %s", pool.num_blocks,
                 pool.block_size, engine.backend.name, engine.backend.device,
                 "native attention through block tables" if engine.backend.supports("attention")
                 else "pages gathered for attention (no native attention)")
        _state_capacity(engine, pool.num_blocks * pool.block_size)

    def blocks_for(self, positions: int) -> int:
        """Blocks (of group 0's allocator) a request of ``positions`` holds at its longest."""
        pool = self.pool
        need = pool.allocator.blocks_for(positions)
        if pool.shared_pages:  # the windows' pages come from the same allocator
            need += sum(min(pool.allocator.blocks_for(positions), pool.allocator.blocks_for(w + pool.window_margin) + 2)
                        for w in pool.windows[1:] if w is not None)
        return need

    def check(self, prompt_tokens: int, max_tokens: int, positions: int) -> None:
        pool = self.pool
        need = self.blocks_for(positions)
        usable = pool.usable_blocks  # less the pages the adapters' bytes hold (Adapters.budgets)
        if need <= usable:
            return
        per = pool.allocator.bytes_per_block or self.engine.kv_bytes_per_position() * pool.block_size
        held = f", {pool.allocator.withheld} more held for LoRA adapters" if pool.allocator.withheld else ""
        err = CacheFullError(
            f"a request of {prompt_tokens} prompt tokens + max_tokens {max_tokens} needs "
            f"{positions} positions = {need} blocks of {pool.block_size} ({need * per:,} bytes of keys and "
            f"values), but the whole KV pool is {usable} blocks ({usable * per:,} bytes{held}): shorten the "
            f"prompt, lower max_tokens, or size the pool larger"
        )
        err.blocks_needed, err.blocks_available = need, usable  # type: ignore[attr-defined]
        err.bytes_needed, err.bytes_available = need * per, usable * per  # type: ignore[attr-defined]
        raise err

    def admit(
        self, positions: int, known: list[int], running: Sequence[tuple[SequenceState, int]], extra_key: bytes = b"",
        adapter: AdapterUse | None = None,
    ) -> SequenceState | None:
        pool = self.pool
        if _slots_short(self.engine, running):
            return None
        try:
            # The adapter's key and the images' together: a block is shared only under both.
            cache = pool.new_sequence(positions, extra_key=(b"" if adapter is None else adapter.extra_key) + extra_key)
        except CacheFullError:  # no recurrent state slot free
            return None
        # The last known token is left to compute, its logits giving the next token, unless the prefix
        # cache kept them with every known position (a restored state: cache.kept_logits).
        reused, _ = cache.reuse_prompt(known)
        # Per state group: blocks the running requests still need for tokens they already know,
        # and what this one needs (a sliding window's group: its window and margin at most).
        # Groups of one allocator (shared pages) add up.
        short: dict[int, int] = {}
        for g, (alloc, window) in enumerate(zip(pool.allocators, pool.windows)):
            pending = sum(_paged(seq).blocks_needed(n)[g] for seq, n in running)
            need = alloc.blocks_for(positions)
            if window is not None:
                need = min(need, alloc.blocks_for(window + pool.window_margin) + 2)
            held = sum(1 for b in cache.tables[g].blocks if b >= 0)
            short[id(alloc)] = short.get(id(alloc), -alloc.available()) + need - held + pending
        if any(v > 0 for v in short.values()):
            cache.free()
            return None
        return SequenceState(tokens=list(known[:reused]), cache=cache, adapter=adapter)

    def blocked(self, request: int, positions: int) -> CacheFullError:
        alloc = self.pool.allocator
        return CacheFullError(
            f"request {request} needs {alloc.blocks_for(positions)} blocks of "
            f"{alloc.block_size} positions but only {alloc.available()} of the pool's "
            f"{self.pool.num_blocks} are available, and this batch engine holds none: "
            f"sequences outside it hold the rest ({self.pool.stats()}); free them first"
        )


class ContiguousBudget(KVBudget):
    """A contiguous cache per request, each reserved whole at admission."""

    def __init__(self, engine: Engine, memory: int) -> None:
        super().__init__(engine)
        store = engine.state_store
        if store is not None:  # the recurrent state slots come out of the same memory
            memory = max(0, memory - store.num_slots * store.nbytes_per_slot)
        #: Positions all admitted requests together may reserve.
        self.positions = memory // engine.kv_bytes_per_position()
        native = engine.backend.supports("attention")
        log.info("batch engine: contiguous KV caches on %s/%s, %d positions within %d bytes%s; no prefix caching",
                 engine.backend.name, engine.backend.device, self.positions, memory,
                 "" if native else " (no native attention)")
        _state_capacity(engine, self.positions)

    def check(self, prompt_tokens: int, max_tokens: int, positions: int) -> None:
        if positions <= self.positions:
            return
        per, have = self.engine.kv_bytes_per_position(), self.positions
        err = CacheFullError(
            f"a request of {prompt_tokens} prompt tokens + max_tokens {max_tokens} needs a KV cache of "
            f"{positions} positions ({positions * per:,} bytes), but the batch engine's budget holds {have} "
            f"positions ({have * per:,} bytes): shorten the prompt, lower max_tokens, or raise kv_memory"
        )
        err.bytes_needed, err.bytes_available = positions * per, have * per  # type: ignore[attr-defined]
        raise err

    def admit(
        self, positions: int, known: list[int], running: Sequence[tuple[SequenceState, int]], extra_key: bytes = b"",
        adapter: AdapterUse | None = None,
    ) -> SequenceState | None:
        if sum(seq.cache.capacity for seq, _ in running) + positions > self.positions or _slots_short(
                self.engine, running):
            return None
        engine = self.engine
        try:
            cache = engine.contiguous_cache(positions)
        except CacheFullError:  # no recurrent state slot free
            return None
        return SequenceState(tokens=[], cache=cache, adapter=adapter)

    def blocked(self, request: int, positions: int) -> CacheFullError:
        # Not reached: with nothing running the whole budget is free, and
        # check() refused every request larger than that.
        return CacheFullError(f"request {request} needs {positions} positions of a budget of {self.positions}")


def _paged(seq: SequenceState) -> PagedSequenceCache:
    assert isinstance(seq.cache, PagedSequenceCache)
    return seq.cache


def _slots_short(engine: Engine, running: Sequence[tuple[SequenceState, int]]) -> bool:
    """Whether the recurrent state slots are too few for one more request:
    its live state and one checkpoint, and a checkpoint for every running
    request that holds none yet (without one a rollback replays from further back)."""
    store = engine.state_store
    if store is None:
        return False
    want = 2 + sum(1 for seq, _ in running if seq.cache.states is not None and not seq.cache.states.checkpoints)
    return store.allocator.available() < want


def _state_capacity(engine: Engine, positions: int) -> None:
    """Say so when the KV memory holds less than one request of the model's whole
    context: such a request is refused at submit (``Model.generate([...])`` then
    runs it alone, as ``Model.generate(prompt)`` would)."""
    if positions < engine.max_context:
        log.info("batch engine: the KV memory holds %d positions, fewer than the model's context of %d; a "
                 "request needing more is refused with CacheFullError (raise kv_memory to batch it)",
                 positions, engine.max_context)


class EncoderBudget:
    """The vision tower's memory, shared by a batch engine's requests with
    images: ``memory`` bytes of tower activations and image embeddings.

    A request's images (:class:`~infer.multimodal.PromptMedia`) hold, from
    admission until the tower has encoded them, their embeddings' bytes plus
    the most the tower holds at once while encoding one of them (images go
    through one at a time); once encoded, their embeddings (the encoder
    cache) until the request ends. A request whose prompt is cached past its
    last image (a prefix hit) needs no forward over them and holds nothing
    until then. A request is admitted only when its images fit beside what
    the others hold; one whose images could not fit even alone fails at
    submission with :class:`~infer.errors.EncoderMemoryError`."""

    def __init__(self, memory: int) -> None:
        self.memory = memory

    def check(self, media: Any) -> None:
        """Raise :class:`~infer.errors.EncoderMemoryError` when ``media``'s
        images could not be encoded even with nothing else held."""
        if media is None or media.embedding_bytes + media.activation_bytes <= self.memory:
            return
        image = max(media.images, key=lambda i: i.activation_bytes)
        shape = "x".join(str(n) for n in image.processed.pixel_values.shape)
        err = EncoderMemoryError(
            f"{image.name} (pixel values {shape}) needs {image.activation_bytes:,} bytes of vision tower "
            f"activations while it is encoded, beside {media.embedding_bytes:,} bytes of the request's image "
            f"embeddings ({len(media.images)} image(s), {media.image_tokens} tokens), but the batch engine's "
            f"encoder_memory is {self.memory:,} bytes: send a smaller image or raise encoder_memory")
        err.bytes_needed = media.embedding_bytes + image.activation_bytes  # type: ignore[attr-defined]
        err.bytes_available = self.memory  # type: ignore[attr-defined]
        raise err

    @staticmethod
    def held(media: Any, seq: SequenceState | None) -> int:
        """What a request's images ``media`` hold now, its sequence ``seq``
        (None while it waits): see the class docstring."""
        if media is None or not media.image_tokens:
            return 0
        if media.encoded:
            return media.embedding_bytes
        if seq is not None and seq.cached <= int(media.rows[-1]):
            return media.embedding_bytes + media.activation_bytes
        return 0

    def fits(self, media: Any, held: int) -> bool:
        """Whether a request with images ``media`` can be admitted while the
        others hold ``held`` bytes (its own embeddings among them if it holds
        them still, after a preemption)."""
        need = 0 if media is None or media.encoded else media.embedding_bytes + media.activation_bytes
        return held + need <= self.memory
