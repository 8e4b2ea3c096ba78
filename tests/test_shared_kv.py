"""A ``SharedKV`` layer stores nothing: it attends over an earlier layer's keys and values.

The tiny llama3 declares its last layer ``SharedKV(0)`` (a test-only
declaration: the architecture's code is unchanged, ``ctx.attention`` does the
rest): no arrays are allocated for it, a paged and chunked run equals one
contiguous forward, and the logits differ from the model's own (so the
layer really reads layer 0's keys).
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import load_tiny

from infer.architecture import CausalLM
from infer.engine import Engine
from infer.kv.attention import AttentionContext, FullAttention, LayerState, SharedKV
from infer.ops import Array


class SharedLast(CausalLM):
    def __init__(self, base: CausalLM) -> None:
        self.base, self.ops, self.config = base, base.ops, base.config
        self.num_layers, self.max_context, self.vocab_size = base.num_layers, base.max_context, base.vocab_size
        self.lm_head = base.lm_head

    def layer_states(self) -> list[LayerState]:
        return [FullAttention()] * (self.num_layers - 1) + [SharedKV(0)]

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        return self.base.forward(input_ids, ctx)


def test_a_shared_layer_allocates_nothing_and_reads_its_source() -> None:
    base = load_tiny("llama3")
    ops, prompt = base.backend, [int(t) for t in np.random.default_rng(0).integers(3, 200, 23)]
    engine = Engine(SharedLast(base.network), ops)
    full = ops.to_numpy(engine.forward(engine.new_sequence(32), prompt, all_logits=True))
    own = ops.to_numpy(base.engine.forward(base.engine.new_sequence(32), prompt, all_logits=True))
    assert np.abs(full - own).max() > 1e-3
    pool = engine.new_kv_pool(block_size=4, num_blocks=16)
    seq = engine.new_sequence(32, kv_pool=pool)
    at = 0
    for n in (5, 1, 7, 10):
        got = ops.to_numpy(engine.forward(seq, prompt[at:at + n], all_logits=True))
        np.testing.assert_allclose(got, full[at:at + n], rtol=2e-5, atol=2e-5)
        at += n
    assert pool.storage_layers(3) == [0, 1] and len(pool.layer_rows(3)[0]) == 2  # layer 2 has no arrays
    with pytest.raises(IndexError):
        pool.stored(2)
    assert engine.kv_bytes_per_position() * 3 == base.engine.kv_bytes_per_position() * 2
    engine.release(seq)
