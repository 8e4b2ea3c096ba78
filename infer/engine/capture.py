"""A decode step with static shapes, run as one captured graph where the backend can.

An eager decode step is hundreds of ops dispatched from Python, each with
shapes that grow with the sequence (the keys attended over), so a compiler
would see a new graph every step. This step is written so that it does not:

* the sequence's keys and values are the fixed-capacity buffers of its
  :class:`~infer.kv.cache.ContiguousKVCache`, written at a position given as
  data (:meth:`~infer.ops.Backend.update_rows_at`) and attended over with the
  valid length as data (:meth:`~infer.ops.Backend.cached_attention`, masking
  inside attention);
* positions come from that device array too
  (:class:`~infer.kv.attention.StaticAttentionContext`);
* the greedy choice is made on the device: only the next token id is read
  back.

The architecture's ``forward`` and ``compute_logits`` run unchanged inside
it. The backend then captures the whole step with
:meth:`~infer.ops.Backend.compile` (``torch.compile``, ``mx.compile``): one
graph, traced once per cache capacity, replayed every token. Capacities are
rounded up to a power of two (:func:`capacity_bucket`) so that requests of
different lengths share graphs.

Where the step cannot be captured, decoding stays eager and
:attr:`CapturedDecode.reason` says why: an architecture that reads the
sequence length on the host (dynamic rope scaling), an op that reads back to
the host inside the step, a compile error. It serves greedy decoding of one
sequence on a contiguous cache; sampling on the host, paged caches, batching
and speculative decoding take the eager forward (docs/performance.md).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from infer.errors import BackendOutputError, CaptureError
from infer.kv.attention import StaticAttentionContext
from infer.kv.cache import ContiguousKVCache
from infer.ops import Array, Backend

log = logging.getLogger(__name__)

#: Smallest cache capacity a captured step is traced for.
MIN_CAPACITY = 256


def capacity_bucket(capacity: int, max_context: int) -> int:
    """``capacity`` rounded up to a power of two (at least
    :data:`MIN_CAPACITY`), never past ``max_context``: requests of similar
    lengths then share one traced graph."""
    bucket = MIN_CAPACITY
    while bucket < capacity:
        bucket *= 2
    return min(bucket, max_context)


class CapturedDecode:
    """Greedy decode steps of one sequence at a time with static shapes,
    compiled by the backend (``compile=True``) or run as they are
    (``compile=False``: the same static ops eagerly, which tests use to check
    the static path itself on every backend)."""

    def __init__(self, model: Any, ops: Backend, *, compile: bool = True) -> None:
        self.model, self.ops = model, ops
        self.compiled = compile and ops.supports("compile")
        #: Why steps run eagerly instead (None while the captured step works).
        self.reason: str | None = None
        #: Steps run by the captured path.
        self.steps = 0
        self._fn = ops.compile(self._step, static=True) if self.compiled else self._step

    @property
    def graphs(self) -> int | None:
        """Graphs the backend has built for the step (one per cache capacity
        and dtype; not one per token); None when not compiled."""
        count = getattr(self._fn, "graphs", None)
        return count() if count is not None else None

    def _step(self, ids: Array, start: Array, keys: list[Array], values: list[Array]) -> tuple[Array, Array, list, list]:
        ctx = StaticAttentionContext(self.ops, keys, values, start, tokens=1)
        hidden = self.model.forward(ids, ctx)
        logits = self.model.compute_logits(hidden)
        # The row maximum rides along: an argmax over NaNs is an index, never a token.
        return self.ops.argmax(logits, -1), self.ops.max(logits, -1), ctx.keys, ctx.values

    def __call__(self, cache: ContiguousKVCache, token: int) -> int | None:
        """Feed ``token`` at ``cache``'s next position; the greedy token after
        it, or None where this step cannot run (the caller runs the eager
        forward instead, which writes this position's keys and values again:
        a refused capture may have written some of them)."""
        if self.reason is not None:
            return None
        buffers = cache.layer_buffers(self.model.num_layers)
        if buffers is None:  # a layer not written yet (no prefill): its shapes are unknown
            return None
        ops, position = self.ops, cache.length
        if position + 1 > cache.capacity:
            return None  # full: the eager forward says so with its typed error
        cache.reserve(position + 1)
        ids = ops.from_numpy(np.array([token], dtype=np.int32))
        start = ops.from_numpy(np.array([position], dtype=np.int32))
        first = self.steps == 0
        try:
            next_id, top, keys, values = self._fn(ids, start, *buffers)
            token_out = int(ops.to_numpy(next_id).reshape(-1)[0])
            nan = bool(np.isnan(ops.to_numpy(top)).any())
        except Exception as exc:  # noqa: BLE001 - the first step decides; later errors are real
            # ...except a capture refused later, for a new capacity (another input
            # signature): the eager forward serves from then on, as after a first refusal.
            if not first and not isinstance(exc, CaptureError):
                raise
            self.reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            log.info("decode step not captured on %s/%s (%s); decoding eagerly", ops.name, ops.device, self.reason)
            return None
        if nan:
            raise BackendOutputError(f"backend {ops.name}/{ops.device} returned NaN logits in the captured decode "
                                     "step; the model's weights or the backend's kernels produce NaN: try another "
                                     "backend or dtype")
        cache.replace_layer_buffers(keys, values)
        cache.commit([token])
        self.steps += 1
        return token_out

    def describe(self) -> str:
        """One line for ``infer doctor`` and logs: captured or not, and why."""
        if self.reason is not None:
            return f"decode step eager: {self.reason}"
        if not self.compiled:
            return f"decode step with static shapes, not compiled ({self.steps} steps)"
        return f"decode step captured: {self.graphs} graph(s) for {self.steps} steps"
