"""Sliding-window layers hold the keys and values of their window only.

Gemma 3's local layers (architectures/gemma3.py) declare
``SlidingWindow(window)`` (``CausalLM.layer_states``); the paged pool gives
them their own block tables (a state group) and gives back the pages that
fall wholly out of the window (less a margin for rollback) after each
commit. The figures of the first test are in docs/kv-cache.md ("State groups").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from reference import tiny_model_dir

import infer
from infer.engine import Engine
from infer.kv.attention import FullAttention, SlidingWindow
from infer.kv.paged import PagedKVPool

PROMPT_TOKENS = 8192
WINDOW = 64
BLOCK = 16
CHUNK = 512


@pytest.fixture(scope="module")
def long_gemma3(tmp_path_factory: pytest.TempPathFactory) -> infer.Model:
    """The tiny gemma3 (5 sliding : 1 global layer) with a context of 9,000 and a window of 64."""
    path = Path(tmp_path_factory.mktemp("gemma3_long"))
    shutil.copytree(tiny_model_dir("gemma3"), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=9000, sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config))
    return infer.load(path, backend="numpy")


def _greedy(engine: Engine, pool: PagedKVPool, prompt: list[int], new: int) -> tuple[list[int], int]:
    """Greedy tokens after ``prompt`` (prefilled in chunks), and the bytes the
    sequence's pool held after the prefill."""
    seq = engine.new_sequence(kv_pool=pool)
    for at in range(0, len(prompt), CHUNK):
        logits = engine.forward(seq, prompt[at:at + CHUNK])
    held = pool.bytes_held()
    out = []
    for _ in range(new):
        out.append(int(np.argmax(engine.backend.to_numpy(logits)[-1])))
        logits = engine.forward(seq, [out[-1]])
    engine.release(seq)
    assert pool.bytes_held() == 0
    return out, held


def test_an_8k_prompt_holds_the_sliding_layers_window_only(long_gemma3: infer.Model) -> None:
    network, ops = long_gemma3.network, long_gemma3.backend
    states = network.layer_states()
    assert states == [SlidingWindow(WINDOW)] * 5 + [FullAttention()]
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, network.vocab_size, PROMPT_TOKENS)]
    blocks = PROMPT_TOKENS // BLOCK + 8

    before_pool = PagedKVPool(ops, network.num_cache_layers, block_size=BLOCK, num_blocks=blocks)  # every layer full
    before, held_before = _greedy(Engine(network, ops), before_pool, prompt, 8)
    engine = Engine(network, ops)
    pool = engine.new_kv_pool(block_size=BLOCK, num_blocks=blocks)
    assert not pool.shared_pages and pool.windows == [None, WINDOW]
    after, held_after = _greedy(engine, pool, prompt, 8)
    # One page size for all: each local layer a group of one layer (as many as the global
    # layers), every group's pages from one allocator, so what a window gives back serves any layer.
    shared = engine.new_kv_pool(block_size=BLOCK, num_blocks=blocks, shared_pages=True)
    assert shared.shared_pages and shared.windows == [None] + [WINDOW] * 5
    assert shared.num_blocks == (blocks + 1) * 6 - 1  # the same memory, in pages of one layer
    pages, held_shared = _greedy(engine, shared, prompt, 8)
    assert pages == before and held_shared == held_after

    assert after == before
    per_layer_block = 2 * BLOCK * network.config.num_key_value_heads * network.config.head_dim * 4  # k + v, float32
    assert held_before == 6 * (PROMPT_TOKENS // BLOCK) * per_layer_block  # 6,291,456 bytes
    # The global layer holds every position; each local one its window, the margin and the partial block.
    window_blocks = (WINDOW + pool.window_margin) // BLOCK
    assert held_after == (PROMPT_TOKENS // BLOCK + 5 * window_blocks) * per_layer_block  # 1,099,776 bytes
    print(f"KV bytes held after an {PROMPT_TOKENS}-token prompt: {held_before:,} with every layer full, "
          f"{held_after:,} with sliding windows of {WINDOW}")


def test_windowed_pages_come_back_and_rollback_past_the_margin_replays(long_gemma3: infer.Model) -> None:
    network, ops = long_gemma3.network, long_gemma3.backend
    engine = Engine(network, ops)
    pool = engine.new_kv_pool(block_size=BLOCK, num_blocks=64)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, network.vocab_size, 400)]
    seq = engine.new_sequence(kv_pool=pool)
    engine.forward(seq, prompt[:300])
    local = seq.cache.tables[1].blocks
    assert local[:(300 - WINDOW - pool.window_margin) // BLOCK] == [-1] * ((300 - WINDOW - pool.window_margin) // BLOCK)
    # Rolled back within the margin: kept as is; past it (the window's keys are gone): recomputed.
    engine.truncate(seq, 290)
    assert seq.cached == 290 and seq.tokens == prompt[:290]
    engine.truncate(seq, 100)
    assert seq.cached == 100 and seq.tokens == prompt[:100]
    got = ops.to_numpy(engine.forward(seq, prompt[100:120], all_logits=True))
    fresh = engine.new_sequence(kv_pool=pool)
    want = ops.to_numpy(engine.forward(fresh, prompt[:120], all_logits=True))[100:]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # A prefix hit needs the local layers' blocks within the window before the hit point only.
    engine.release(fresh)
    hit = engine.new_sequence(kv_pool=pool)
    reused = hit.cache.reuse_prefix(prompt[:119])
    assert reused == 112
    hit.tokens = prompt[:reused]
    got = ops.to_numpy(engine.forward(hit, prompt[reused:120], all_logits=True))
    np.testing.assert_allclose(got, want[reused - 100:], rtol=1e-5, atol=1e-5)
    for s in (seq, hit):
        engine.release(s)
    assert pool.bytes_held() == 0


def test_shared_pages_run_in_the_captured_batched_step(long_gemma3: infer.Model) -> None:
    from infer.engine.capture import CapturedBatchDecode

    network, ops = long_gemma3.network, long_gemma3.backend
    engine = Engine(network, ops)
    pool = engine.new_kv_pool(block_size=4, num_blocks=64, shared_pages=True)
    step = CapturedBatchDecode(network, ops, engine.max_context, compile=False)
    rng = np.random.default_rng(2)
    seqs = [engine.new_sequence(256, kv_pool=pool) for _ in range(3)]
    for seq, n in zip(seqs, (100, 37, 90)):
        engine.forward(seq, [int(t) for t in rng.integers(3, network.vocab_size, n)])
    for tokens in ([5, 17, 2], [40, 9, 33], [1, 2, 3]):
        eager = ops.to_numpy(engine.run(engine.prepare(seqs, [[t] for t in tokens])).logits)
        for seq in seqs:
            engine.truncate(seq, seq.cached - 1)
        engine.prepare(seqs, [[t] for t in tokens])  # reserves the positions, as the runner does
        logits = step([s.cache for s in seqs], [[t] for t in tokens])
        assert logits is not None, step.reason
        for seq, t in zip(seqs, tokens):
            seq.cache.commit([t])
            seq.tokens.append(t)
        np.testing.assert_allclose(ops.to_numpy(logits), eager, rtol=1e-5, atol=1e-5)
    for seq in seqs:
        engine.release(seq)
    assert pool.stats().used == 0


@pytest.mark.parametrize("shared_pages", [False, True])
def test_a_batch_of_long_prompts_preempts_and_reuses_windowed_prefixes(long_gemma3: infer.Model,
                                                                        shared_pages: bool) -> None:
    from infer.engine.batch import BatchEngine
    from infer.engine.generate import StopConditions, generate
    from infer.engine.sampling import SamplingParams

    network, ops = long_gemma3.network, long_gemma3.backend
    engine = Engine(network, ops)
    rng = np.random.default_rng(3)
    head = [int(t) for t in rng.integers(3, network.vocab_size, 200)]
    prompts = [head + [int(t) for t in rng.integers(3, network.vocab_size, n)] for n in (40, 90, 10)]
    stop = StopConditions(max_tokens=12, ignore_eos=True)
    want = [list(generate(engine, p, SamplingParams(), stop)) for p in prompts]  # contiguous, alone
    # 40 blocks of 16 positions of every layer: each request needs ~17 of the global layer's.
    pool = engine.new_kv_pool(block_size=BLOCK, num_blocks=40, shared_pages=shared_pages)
    batch = BatchEngine(engine, kv_pool=pool, max_batch_tokens=128)
    handles = [batch.submit(p, SamplingParams(), stop) for p in prompts]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    # The same memory: with separate allocators the global layer's blocks run short and a
    # request is preempted; with shared pages what the windows give back holds all three.
    assert batch.stats.preemptions == (0 if shared_pages else 1)
    assert batch.stats.tokens_reused > 0
    assert pool.bytes_held() == 0


@pytest.mark.parametrize("shared_pages", [False, True])
def test_windowed_bookkeeping_keeps_the_window_and_loses_no_page(long_gemma3: infer.Model, shared_pages: bool) -> None:
    """Random appends, rollbacks, forks, prefix hits and frees of sequences in a pool of one
    global and two sliding layers (bookkeeping only: nothing is computed): every page is in
    one state, each window's blocks are held, and freeing everything returns every page."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = long_gemma3.backend
    states = [FullAttention(), SlidingWindow(8), SlidingWindow(8)]
    window, bs = 8, 4

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.sampled_from("aatfrx"), st.integers(1, 13)), max_size=40))
    def run(script: list[tuple[str, int]]) -> None:
        pool = PagedKVPool(ops, 3, block_size=bs, num_blocks=40, layer_states=states, window_margin=4,
                           shared_pages=shared_pages)
        seqs: list = []
        #: Positions each sequence has rolled back since its last commit: the margin
        #: (4) covers that many in total, not per truncation.
        back: dict[int, int] = {}
        for op, n in script:
            if op == "a" or not seqs:  # append n tokens to a sequence (a new one when there is none)
                if not seqs or n % 3 == 0:
                    seqs.append(pool.new_sequence(200))
                    if n % 2:
                        seqs[-1].reuse_prefix([t % 7 for t in range(n * 3)])
                cache = seqs[n % len(seqs)]
                try:
                    cache.reserve(cache.length + n)
                except Exception:  # noqa: BLE001 - a full pool changes nothing
                    continue
                cache.commit([(cache.length + i) % 7 for i in range(n)])
                back[id(cache)] = 0
            elif op == "t":
                cache = seqs[n % len(seqs)]
                target = max(0, cache.length - n)
                back[id(cache)] = back.get(id(cache), 0) + cache.length - target
                kept = cache.truncate(target)  # within the margin: kept; past it: nothing (recomputed)
                assert kept == cache.length and kept in (0, target)
                if back[id(cache)] <= 4:
                    assert kept == target
            elif op == "f":
                parent = seqs[n % len(seqs)]
                seqs.append(parent.fork())
                back[id(seqs[-1])] = back.get(id(parent), 0)
            elif op in "rx":
                seqs.pop(n % len(seqs)).free()
            for alloc in {id(a): a for a in pool.allocators}.values():
                s = alloc.stats()
                assert s.used + s.free + s.cached == s.total
            for cache in seqs:
                for table, w in zip(cache.tables, pool.windows):
                    lo = 0 if w is None else max(0, cache.length - w) // bs
                    assert all(b >= 0 for b in table.blocks[lo:])
        for cache in seqs:
            cache.free()
        assert all(a.stats().used == 0 for a in pool.allocators)

    run()
