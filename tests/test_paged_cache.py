"""The paged KV cache gives what the contiguous cache gives, on every backend.

Tiny random llama and gemma3 models (``reference.tiny_model_dir``) run through
the engine twice: with a contiguous cache per sequence, and with pages of a
:class:`PagedKVPool` (block sizes 1, 4, 16). Logits agree within 1e-5 of the
largest logit and greedy tokens are identical, on numpy, torch/cpu and MLX,
whose native ``attention`` reads the pages through the block tables, and with
the contract's default (each sequence's keys gathered). Forked
sequences, prefix reuse, rollback and a full pool are checked the same way,
and every test ends with every page back in the pool.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import assert_logits_close, backend_params, encode, load_tiny, tiny_model_dir

import infer
from infer.engine import Engine
from infer.errors import CacheFullError
from infer.kv.paged import PagedKVPool, PagedSequenceCache
from infer.ops import AttentionBatch, Backend
from infer.testing.strategies import attention_calls

PROMPT = "The capital of France is Paris. Once upon a time"
BACKENDS = ["numpy", "torch:cpu", "mlx:cpu"]  # (conftest.py: the backend and model fixtures)
VARIANTS = ["llama3", "gemma3"]  # gemma3: sliding-window layers (window 4) and global ones
DECODE_STEPS = 8



load = load_tiny


@pytest.fixture
def pools():
    """Make pools through this; each must be entirely free again at the end."""
    made: list[PagedKVPool] = []

    def make(engine: Engine, block_size: int, num_blocks: int = 64) -> PagedKVPool:
        pool = engine.new_kv_pool(block_size=block_size, num_blocks=num_blocks)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        s = pool.stats()
        assert s.used == 0 and s.free + s.cached == s.total, f"pages still held after the test: {s}"


def run(engine: Engine, seq, prompt: list[int], decode: list[int]) -> list[np.ndarray]:
    """Prefill logits (every row), then one row per decode step."""
    ops = engine.backend
    out = [ops.to_numpy(engine.forward(seq, prompt, all_logits=True))]
    out += [ops.to_numpy(engine.forward(seq, [t])[-1]) for t in decode]
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_logits_and_greedy_tokens_equal_contiguous(model: infer.Model, block_size: int, pools) -> None:
    engine = model.engine
    prompt = encode(tiny_model_dir("llama3"), PROMPT)  # both variants share the tokenizer
    assert len(prompt) % 4 and len(prompt) % 16  # a partial last block
    decode = [7, 11, 13, 17, 19, 23, 29, 31]
    want = run(engine, engine.new_sequence(), prompt, decode)
    pool = pools(engine, block_size)
    seq = engine.new_sequence(kv_pool=pool)
    got = run(engine, seq, prompt, decode)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_logits_close(g, w, f"block_size {block_size} step {step}")
    assert seq.cache.length == len(prompt) + len(decode) and pool.stats().used == -(-seq.cache.length // block_size)
    engine.release(seq)

    greedy = list(model.generate_tokens(prompt, max_tokens=DECODE_STEPS, ignore_eos=True))
    engine.kv_pool = pool
    try:
        paged = list(model.generate_tokens(prompt, max_tokens=DECODE_STEPS, ignore_eos=True))
    finally:
        engine.kv_pool = None
    assert paged == greedy


@pytest.mark.parametrize("backend", backend_params(*BACKENDS))
def test_native_and_default_attention_agree(backend: str, pools) -> None:
    engine = load("gemma3", backend).engine
    pool = pools(engine, 4)
    assert engine.backend.supports("attention")
    prompt, decode = list(range(5, 24)), [3, 1, 4, 1, 5, 9]
    native_seq = engine.new_sequence(kv_pool=pool)
    native = run(engine, native_seq, prompt, decode)
    ops = engine.backend
    ops.attention = lambda *args, **kwargs: Backend.attention(ops, *args, **kwargs)  # this instance only
    try:
        default_seq = engine.new_sequence(kv_pool=pool)
        default = run(engine, default_seq, prompt, decode)
    finally:
        del ops.attention
    for g, n in zip(default, native):
        assert_logits_close(g, n, "the contract's default vs native")
    assert [int(np.argmax(r[-1])) for r in default] == [int(np.argmax(r[-1])) for r in native]
    engine.release(native_seq)
    engine.release(default_seq)


def test_forked_sequences_continue_correctly_after_copy_on_write(model: infer.Model, pools) -> None:
    engine = model.engine
    prompt = list(range(40, 50))  # 10 tokens: block 2 of size 4 is shared and half full
    pool = pools(engine, 4)
    parent = engine.new_sequence(kv_pool=pool)
    engine.forward(parent, prompt)
    child = type(parent)(tokens=list(parent.tokens), cache=parent.cache.fork())
    assert pool.stats().shared == 3
    a, b = [5, 6, 7, 8, 9], [60, 61, 62, 63, 64]
    got_child = [engine.backend.to_numpy(engine.forward(child, [t])[-1]) for t in b]
    got_parent = [engine.backend.to_numpy(engine.forward(parent, [t])[-1]) for t in a]
    assert pool.stats().shared == 2  # the two full prompt blocks; the partial one was copied
    for tokens, got in ((a, got_parent), (b, got_child)):
        want = run(engine, engine.new_sequence(), prompt, tokens)[1:]
        for step, (g, w) in enumerate(zip(got, want)):
            assert_logits_close(g, w, f"fork step {step}")
    engine.release(child)
    engine.release(parent)


def test_prefix_reuse_skips_the_cached_blocks(model: infer.Model, pools) -> None:
    engine = model.engine
    pool = pools(engine, 4)
    system = list(range(100, 113))  # 13 tokens: 3 full blocks
    first = engine.new_sequence(kv_pool=pool)
    engine.forward(first, system + [7, 8])
    engine.release(first)
    assert pool.stats().cached == 3  # the full blocks stay, unreferenced

    prompt = system + [9, 10, 11]
    seq = engine.new_sequence(kv_pool=pool)
    assert isinstance(seq.cache, PagedSequenceCache)
    reused = seq.cache.reuse_prefix(prompt[:-1])
    assert reused == 12 and pool.stats().cached == 0
    seq.tokens = prompt[:reused]
    got = engine.backend.to_numpy(engine.forward(seq, prompt[reused:], all_logits=True))  # 4 tokens, not 16
    want = engine.backend.to_numpy(engine.forward(engine.new_sequence(), prompt, all_logits=True))
    assert got.shape[0] == len(prompt) - reused
    assert_logits_close(got, want[reused:], "after prefix reuse")
    engine.release(seq)


def test_truncate_rolls_back(model: infer.Model, pools) -> None:
    engine = model.engine
    pool = pools(engine, 4)
    prompt = list(range(20, 33))
    seq = engine.new_sequence(kv_pool=pool)
    engine.forward(seq, prompt)
    engine.forward(seq, [1, 2, 3, 4, 5])  # rejected, say, by a speculative verifier
    seq.cache.truncate(len(prompt))
    seq.tokens = seq.tokens[:len(prompt)]
    got = [engine.backend.to_numpy(engine.forward(seq, [t])[-1]) for t in [6, 7, 8]]
    want = run(engine, engine.new_sequence(), prompt, [6, 7, 8])[1:]
    for g, w in zip(got, want):
        assert_logits_close(g, w, "after truncate")
    engine.release(seq)


def test_a_full_pool_raises_cache_full_and_recovers(pools) -> None:
    engine = load("llama3", "numpy").engine
    pool = pools(engine, 4, num_blocks=5)  # 20 positions
    big = engine.new_sequence(kv_pool=pool)
    engine.forward(big, list(range(30, 46)))  # 4 blocks
    other = engine.new_sequence(kv_pool=pool)
    with pytest.raises(CacheFullError, match=r"needs 2 more block\(s\) of 4 positions \(\d[\d,]* bytes"):
        engine.forward(other, list(range(8)))
    assert other.cache.length == 0 and other.tokens == [] and pool.stats().used == 4
    engine.release(big)
    engine.forward(other, list(range(8)))  # evicts big's cached blocks
    engine.release(other)


def test_generation_returns_its_pages_when_it_ends_or_is_dropped(pools) -> None:
    model = load("llama3", "numpy")
    pool = pools(model.engine, 4)
    model.engine.kv_pool = pool
    try:
        assert len(list(model.generate_tokens(list(range(3, 12)), max_tokens=5, ignore_eos=True))) == 5
        assert pool.stats().used == 0
        tokens = iter(model.generate_tokens(list(range(3, 12)), max_tokens=50, ignore_eos=True))
        next(tokens)
        assert pool.stats().used == 3
        del tokens
        gc.collect()
        assert pool.stats().used == 0
    finally:
        model.engine.kv_pool = None


def test_memory_budget_sizes_the_pool() -> None:
    model = load("llama3", "numpy")
    cfg = model.config
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4
    model.engine.kv_pool = PagedKVPool(model.backend, cfg["num_hidden_layers"], num_blocks=1)
    try:  # the measurement ignores the engine's own pool
        pool = model.engine.new_kv_pool(block_size=8, memory_budget=10 * 8 * per_token + 5)
    finally:
        model.engine.kv_pool = None
    # Ten blocks' bytes: nine for sequences, and the scratch block captured batched steps pad with.
    assert pool.num_blocks == 9 and pool.scratch_block == 9 and pool.allocator.bytes_per_block == 8 * per_token
    with pytest.raises(CacheFullError, match="holds no block"):
        model.engine.new_kv_pool(block_size=8, memory_budget=per_token)
    with pytest.raises(CacheFullError, match="needs two"):
        model.engine.new_kv_pool(block_size=8, memory_budget=8 * per_token)  # one block: only the scratch


@pytest.mark.parametrize("backend", backend_params(*BACKENDS))
@given(call=attention_calls(sinks=st.booleans()))
@settings(max_examples=40, deadline=None)
def test_native_attention_equals_the_contract_default(backend: str, call) -> None:
    """The conformance kit compares backends with numpy's attention; this pins
    numpy's (and torch's and MLX's) to the contract's gather-then-attend default."""
    from infer.plugins.selection import select_backend

    ops = select_backend(backend)
    args = [ops.from_numpy(a.value, None if a.dtype == "float" else a.dtype) for a in call.args]
    kwargs = {k: ops.from_numpy(v.value) if hasattr(v, "value") else v for k, v in call.kwargs.items()}
    i = call.info
    host = AttentionBatch(i["host"]["query_start"], i["host"]["seq_lens"], i["host"]["block_tables"], i["block_size"],
                          i["max_query"])
    batch = AttentionBatch(*args[3:], i["block_size"], i["max_query"], host)
    got = ops.attention(*args[:3], batch, **kwargs)
    want = Backend.attention(ops, *args[:3], batch, **kwargs)
    # The same float32 attention over the same keys, read in place or gathered: the
    # sums may be blocked differently (a few u of the output, |v| <~ 4 here).
    np.testing.assert_allclose(ops.to_numpy(got), ops.to_numpy(want), rtol=1e-5, atol=1e-6)
