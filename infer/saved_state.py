"""Sequence state that outlives the process: what ``Model.save_state`` and ``Model.load_state`` run.

A saved state is a prompt's (or a conversation's) keys and values and
recurrent state, written to a state file (:mod:`infer.kv.state_file`, laid
out by :mod:`infer.kv.snapshot`) with the :class:`~infer.kv.fingerprint.Fingerprint`
of the model and cache settings that computed it. Loading it enters it in
the model's prefix cache — the pool of :attr:`infer.Model.batch_engine` —
so the next request whose prompt starts with it computes only what follows
(``usage.cached_tokens`` says how much was found). Loading it into another
model, another ``kv_dtype`` or block size, or with another tokenizer is a
:class:`~infer.errors.StateMismatchError`; a damaged file a
:class:`~infer.errors.StateFileError`. Tensor parallelism is refused
(:class:`~infer.errors.StateUnsupportedError`): each rank holds its own share
of the heads, which one file does not gather yet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.errors import GenerationError, StateUnsupportedError
from infer.kv.disk import DiskTier
from infer.kv.fingerprint import Fingerprint, tokenizer_hash, weights_hash
from infer.kv.paged import PagedKVPool
from infer.kv.snapshot import RestoredState, capture, restore
from infer.kv.state_file import StateFile, read_state_file, write_state_file
from infer.ops import Backend
from infer.package import ModelPackage
from infer.tokenizer import Tokenizer


class Model(Protocol):
    """What of an :class:`infer.Model` saving and loading states use."""

    package: ModelPackage
    backend: Backend
    engine: Engine

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def batch_engine(self) -> BatchEngine: ...

#: The prompt cache's default bound on disk.
DEFAULT_PROMPT_CACHE_BYTES = 4 * 2**30

#: What a state is saved of: token ids, a text prompt, or a conversation (messages).
StateSource = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]


@dataclass(frozen=True)
class SavedState:
    """What :func:`save_state` wrote."""

    path: Path
    #: The token ids whose state the file holds.
    tokens: list[int]
    #: Of those, positions that were in the prefix cache already (not computed for the save).
    cached_tokens: int
    #: Size of the file.
    nbytes: int


def check_supported(model: Model) -> None:
    """Refuse tensor parallelism and models without weight files."""
    if model.backend.world_size > 1:
        raise StateUnsupportedError(
            f"saving and restoring sequence state under tensor parallelism ({model.backend.world_size} ranks) is "
            "not supported yet: each rank holds a share of the keys and values; load the model without "
            "tensor_parallel to save or restore states")
    if model.package.path is None:
        raise StateUnsupportedError("this model was not loaded from a file, so a saved state cannot be tied to its "
                                    "weights; load it with infer.load(path)")


def prefix_pool(batch: BatchEngine) -> PagedKVPool:
    """The pool whose prefix cache saved states go to and come from (the batch engine's)."""
    pool = batch.pool
    if pool is None:
        raise StateUnsupportedError(
            "the batch engine keeps contiguous caches, which have no prefix cache to restore a state into; "
            "configure_batching(kv_layout='paged')")
    return pool


def fingerprint(model: Model, pool: PagedKVPool) -> Fingerprint:
    """The fingerprint of states computed by ``model`` in ``pool``."""
    check_supported(model)
    assert model.package.path is not None
    engine = model.engine
    return Fingerprint(
        architecture=model.package.model_type, weights=weights_hash(model.package.path),
        dtype=model.backend.compute_dtype, kv_dtype=engine.kv_dtype or model.backend.compute_dtype,
        block_size=pool.block_size, tokenizer=tokenizer_hash(model.package.tokenizer))


def state_ids(model: Model, source: StateSource) -> list[int]:
    """Token ids of ``source``: ids as they are, a text encoded as a prompt
    is, a conversation rendered with the chat template without a generation
    prompt (so that the next turn's prompt starts with it)."""
    if isinstance(source, str):
        ids = model.tokenizer.encode(source)
    elif isinstance(source, Sequence) and source and all(isinstance(m, Mapping) for m in source):
        text = model.tokenizer.apply_chat_template(source, add_generation_prompt=False)  # type: ignore[arg-type]
        ids = model.tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(source, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in source):
        ids = [int(t) for t in source]  # type: ignore[arg-type]
    else:
        raise GenerationError("save_state takes token ids, a prompt text or a conversation (a list of messages)")
    if not ids:
        raise GenerationError("there is no state to save for an empty prompt")
    model.engine.check_tokens(ids)
    if len(ids) > model.engine.max_context:
        raise GenerationError(f"{len(ids)} tokens are more than the model's context of {model.engine.max_context}")
    return ids


def save_state(model: Model, path: str | os.PathLike[str], source: StateSource,
               batch: BatchEngine | None = None) -> SavedState:
    """Compute ``source``'s state in the pool of ``batch`` (default: the
    model's batch engine; what its prefix cache holds of it already is not
    computed again) and write it to ``path`` atomically."""
    check_supported(model)
    ids = state_ids(model, source)
    batch = batch or model.batch_engine
    pool = prefix_pool(batch)
    fp = fingerprint(model, pool)
    engine = model.engine
    seq = engine.new_sequence(len(ids), kv_pool=pool)
    try:
        # What the prefix cache holds of it is not computed again; the last token is, for the logits
        # after it, unless they were kept with it (a state restored or saved before).
        cached, logits = seq.cache.reuse_prompt(ids)  # type: ignore[attr-defined]
        seq.tokens = ids[:cached]
        step = batch.max_batch_tokens
        for start in range(cached, len(ids), step):  # in the batch engine's chunks: bounded activations
            out = engine.run(engine.prepare([seq], [ids[start:start + step]]))
            logits = out.host_logits()[0]
        info, tensors = capture(seq.cache, fp, logits)  # type: ignore[arg-type]
        nbytes = write_state_file(path, info, tensors)
        # Its tail and final state enter this pool's prefix cache too (the full blocks are there
        # already), so a request here that goes on from the saved prompt starts at its very end.
        restore(pool, StateFile(Path(path), dict(info), tensors), fp)
    finally:
        engine.release(seq)
    return SavedState(Path(path), ids, cached, nbytes)


def load_state(model: Model, path: str | os.PathLike[str], batch: BatchEngine | None = None) -> RestoredState:
    """Read the state file at ``path``, check it against ``model``, and enter
    it in the prefix cache of ``batch``'s pool (default: the model's batch engine)."""
    check_supported(model)
    pool = prefix_pool(batch or model.batch_engine)
    fp = fingerprint(model, pool)
    return restore(pool, read_state_file(path), fp)


def attach_prompt_cache(model: Model, batch: BatchEngine, folder: str | os.PathLike[str],
                        max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> DiskTier:
    """Give ``batch``'s prefix cache a disk tier in ``folder`` of at most
    ``max_bytes`` (:mod:`infer.kv.disk`): prefix blocks are written there as
    they become cached and read back by a later request, in this process or
    the next."""
    check_supported(model)
    pool = prefix_pool(batch)
    tier = DiskTier(folder, max_bytes, fingerprint(model, pool))
    tier.attach(pool)
    return tier
