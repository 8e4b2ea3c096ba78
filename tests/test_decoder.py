"""The shared decoder (``architectures/decoder.py``): its per-layer choices
that no shipped checkpoint exercises, and the head split from the network.

Parity of the architectures built on it is tested against transformers in
``test_parity*.py`` and ``test_deepseek_v3.py``.
"""

from __future__ import annotations

import numpy as np
from reference import tiny_model_dir

import infer
from infer.kv.attention import AttentionContext, SequenceSlice
from infer.kv.cache import ContiguousKVCache

PROMPT = [5, 9, 17, 33, 5, 9, 17, 40]


def logits(model: infer.Model) -> np.ndarray:
    engine = model.engine
    return model.backend.to_numpy(engine.forward(engine.new_sequence(), PROMPT, all_logits=True))


def test_a_layer_without_rope_is_a_layer_whose_rotation_is_the_identity() -> None:
    # SmolLM3-style NoPE layers: DecoderLayer.rope None. With every inverse
    # frequency 0, cos is 1 and sin 0, so rope returns its input exactly.
    path = tiny_model_dir("llama3")
    nope, identity = infer.load(path, backend="numpy"), infer.load(path, backend="numpy")
    for layer in nope.network.layers:
        layer.rope = None
    rope = identity.network.rope["default"]
    rope._inv_freq = identity.backend.mul(rope._inv_freq, 0.0)
    got, want = logits(nope), logits(identity)
    assert np.array_equal(got, want)
    assert not np.allclose(got, logits(infer.load(path, backend="numpy")))  # rope does matter here


def test_forward_returns_every_rows_hidden_state_and_the_head_projects_any_rows() -> None:
    model = infer.load(tiny_model_dir("gemma3_softcap"), backend="numpy")
    net, ops = model.network, model.backend
    cache = ContiguousKVCache(ops, net.num_cache_layers, len(PROMPT))
    hidden = net.forward(ops.from_numpy(np.asarray(PROMPT, np.int32)), AttentionContext(ops, [SequenceSlice(cache, 0, 8)]))
    assert ops.shape(hidden) == (len(PROMPT), net.config.hidden_size)
    rows = ops.to_numpy(net.compute_logits(ops.take(hidden, ops.from_numpy(np.asarray([7, 2], np.int32)), axis=0)))
    every = logits(model)
    np.testing.assert_allclose(rows, every[[7, 2]], rtol=1e-6, atol=1e-6)
    assert np.abs(every).max() < net.config.final_logit_softcapping  # the soft-cap is part of the head
