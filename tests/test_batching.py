"""Continuous batching gives every request what it gets alone.

Tiny random llama and gemma3 models (``reference.tiny_model_dir``): requests
run through one :class:`BatchEngine` (one forward per step over all of them)
produce, token for token, what :meth:`Engine.generate` gives each alone —
with mixed prompt lengths, requests joining mid-flight, duplicates sharing
cached prefixes, a pool so small that requests are preempted and recomputed,
and per-request sampling parameters. Every test ends with every page back in
the pool.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import backend_params, load_tiny

import infer
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.errors import CacheFullError

BACKENDS = ["numpy", "torch:cpu"]  # (conftest.py: the backend and model fixtures)
VARIANTS = ["llama3", "gemma3"]
GREEDY = SamplingParams()

load = load_tiny


@pytest.fixture(params=["paged", "contiguous"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def batch_engines():
    """Make batch engines through this; each pool must be entirely free at the end.

    ``layout="contiguous"`` makes one with contiguous caches within a budget
    of ``num_blocks * block_size`` positions, the same memory as the pool."""
    made: list[BatchEngine] = []

    def make(engine: Engine, *, block_size: int = 4, num_blocks: int = 64, layout: str = "paged",
             **kwargs) -> BatchEngine:
        if layout == "contiguous":
            memory = num_blocks * block_size * engine.kv_bytes_per_position()
            batch = BatchEngine(engine, kv_layout="contiguous", kv_memory=memory, **kwargs)
        else:
            pool = engine.new_kv_pool(block_size=block_size, num_blocks=num_blocks)
            batch = BatchEngine(engine, kv_pool=pool, **kwargs)
        made.append(batch)
        return batch

    yield make
    for batch in made:
        assert not batch.running, batch.running
        if batch.pool is not None:
            s = batch.pool.stats()
            assert s.used == 0 and s.free + s.cached == s.total, f"pages still held after the test: {s}"


def stop(max_tokens: int) -> StopConditions:
    return StopConditions(max_tokens=max_tokens, ignore_eos=True)


def alone(engine: Engine, prompt: list[int], max_tokens: int, sampling: SamplingParams = GREEDY) -> list[int]:
    return list(generate(engine, prompt, sampling, stop(max_tokens)))


PROMPTS = [list(range(3, 8)), list(range(20, 43)), [9], list(range(50, 63)), list(range(30, 34)) * 3]


def test_batched_greedy_equals_single_requests(model: infer.Model, batch_engines, layout: str) -> None:
    engine = model.engine
    want = [alone(engine, p, 10) for p in PROMPTS]
    batch = batch_engines(engine, layout=layout)
    handles = [batch.submit(p, GREEDY, stop(10)) for p in PROMPTS]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert all(h.finish_reason == "length" for h in handles)
    # Prefill and decode of every request went through shared forwards.
    assert batch.stats.forwards < sum(10 for _ in PROMPTS)
    assert batch.kv_layout == layout


def test_chunked_prefill_with_a_small_token_budget(model: infer.Model, batch_engines, layout: str) -> None:
    engine = model.engine
    want = [alone(engine, p, 6) for p in PROMPTS]
    batch = batch_engines(engine, max_batch_tokens=7, layout=layout)
    handles = [batch.submit(p, GREEDY, stop(6)) for p in PROMPTS]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert max(batch.stats.tokens_per_forward) <= 7


def test_requests_joining_mid_flight(model: infer.Model, batch_engines, layout: str) -> None:
    engine = model.engine
    want = [alone(engine, p, 8) for p in PROMPTS]
    batch = batch_engines(engine, layout=layout)
    handles = [batch.submit(PROMPTS[0], GREEDY, stop(8))]
    for p in PROMPTS[1:]:
        batch.step()
        batch.step()
        handles.append(batch.submit(p, GREEDY, stop(8)))
    # Stream one request: iterating drives the steps of all of them.
    streamed = list(handles[2])
    batch.run_until_done()
    assert streamed == want[2]
    assert [h.tokens for h in handles] == want


def test_shared_prefixes_are_reused(model: infer.Model, batch_engines) -> None:
    engine = model.engine
    prompt = list(range(10, 31))  # 21 tokens: five full blocks of 4 before the last token
    want = alone(engine, prompt, 6)
    batch = batch_engines(engine)
    first = batch.submit(prompt, GREEDY, stop(6))
    batch.step()  # the first prefill fills the prefix cache
    dups = [batch.submit(prompt, GREEDY, stop(6)) for _ in range(3)]
    batch.run_until_done()
    assert [h.tokens for h in [first, *dups]] == [want] * 4
    assert batch.stats.tokens_reused == 3 * 20
    prompt_tokens = 4 * len(prompt)
    decode_tokens = 4 * 5
    assert batch.stats.tokens_processed == prompt_tokens - 3 * 20 + decode_tokens


def test_cancel_returns_pages_at_once(model: infer.Model, batch_engines) -> None:
    engine = model.engine
    batch = batch_engines(engine)
    keep = batch.submit(PROMPTS[1], GREEDY, stop(8))
    gone = batch.submit(PROMPTS[3], GREEDY, stop(8))
    batch.step()
    batch.step()
    used = batch.pool.stats().used
    held = len(gone._seq.cache.table.blocks)
    shared = sum(1 for b in gone._seq.cache.table.blocks if batch.pool.allocator.refcount(b) > 1)
    batch.cancel(gone)
    assert gone.finish_reason == "cancelled" and gone not in batch.running
    assert batch.pool.stats().used == used - held + shared
    waiting = batch.submit(PROMPTS[0], GREEDY, stop(8))
    batch.cancel(waiting)  # never admitted: just leaves the queue
    assert waiting.finish_reason == "cancelled" and not batch.waiting
    batch.run_until_done()
    assert keep.tokens == alone(engine, PROMPTS[1], 8)


def test_a_tiny_pool_preempts_and_recomputes(model: infer.Model, batch_engines) -> None:
    engine = model.engine
    prompts = [list(range(3, 9)), list(range(40, 47)), list(range(60, 65))]
    want = [alone(engine, p, 14) for p in prompts]
    # Each request needs 5 blocks of 4 (prompt + 14 tokens): two are admitted
    # into 9 blocks, then run short while decoding.
    batch = batch_engines(engine, block_size=4, num_blocks=9)
    handles = [batch.submit(p, GREEDY, stop(14)) for p in prompts]
    batch.run_until_done()
    assert batch.stats.preemptions > 0
    assert [h.tokens for h in handles] == want


def test_a_request_that_can_never_fit_is_refused(model: infer.Model, batch_engines) -> None:
    batch = batch_engines(model.engine, block_size=4, num_blocks=3)
    with pytest.raises(CacheFullError, match=r"needs 15 positions = 4 blocks of 4 \([\d,]+ bytes.*3 blocks") as info:
        batch.submit(list(range(5, 10)), GREEDY, stop(10))
    err = info.value
    assert (err.blocks_needed, err.blocks_available) == (4, 3)
    assert err.bytes_needed > err.bytes_available > 0
    assert not batch.waiting


def test_per_request_sampling_parameters(model: infer.Model, batch_engines, layout: str) -> None:
    engine = model.engine
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    penalised = SamplingParams(repetition_penalty=1.3)
    jobs = [(PROMPTS[0], GREEDY), (PROMPTS[1], sampled), (PROMPTS[3], penalised), (PROMPTS[0], sampled)]
    want = [alone(engine, p, 10, s) for p, s in jobs]
    batch = batch_engines(engine, layout=layout)
    handles = [batch.submit(p, s, stop(10)) for p, s in jobs]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want


def test_eos_and_zero_max_tokens(model: infer.Model, batch_engines, layout: str) -> None:
    engine = model.engine
    first = alone(engine, PROMPTS[1], 1)[0]
    batch = batch_engines(engine, layout=layout)
    eos = batch.submit(PROMPTS[1], GREEDY, StopConditions(max_tokens=10, eos_token_ids=frozenset({first})))
    other = batch.submit(PROMPTS[0], GREEDY, stop(5))
    none = batch.submit(PROMPTS[0], GREEDY, stop(0))
    assert none.finished and none.finish_reason == "length" and list(none) == []
    batch.run_until_done()
    assert (eos.tokens, eos.finish_reason) == ([first], "stop")
    assert other.tokens == alone(engine, PROMPTS[0], 5)


def test_model_generate_list_equals_each_prompt_alone() -> None:
    model = load("llama3", "numpy")
    prompts = ["The capital of France is", "Once upon a time", "The capital of France is Paris", "a"]
    want = [model.generate(p, max_tokens=9, ignore_eos=True) for p in prompts]
    assert model.generate(prompts, max_tokens=9, ignore_eos=True) == want
    seeded = [model.generate(p, max_tokens=9, ignore_eos=True, temperature=0.9, seed=7) for p in prompts]
    assert model.generate(prompts, max_tokens=9, ignore_eos=True, temperature=0.9, seed=7) == seeded
    stop_at = want[1][len(want[1]) // 2: len(want[1]) // 2 + 2]
    cut = [model.generate(p, max_tokens=9, ignore_eos=True, stop=stop_at) for p in prompts]
    assert model.generate(prompts, max_tokens=9, ignore_eos=True, stop=stop_at) == cut
    s = model.batch_engine.pool.stats()
    assert s.used == 0 and s.free + s.cached == s.total


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["submit", "step", "cancel"]),
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 12),
        ),
        min_size=1, max_size=25,
    ),
    st.integers(6, 14),
)
def test_random_interleavings_keep_outputs_and_pages_right(ops, num_blocks) -> None:
    """Submits, steps and cancels in any order, in a pool small enough to
    preempt: every finished request equals its single-request result, a
    cancelled one is a prefix of it, and every page comes back."""
    engine = load("llama3", "numpy").engine
    pool = engine.new_kv_pool(block_size=4, num_blocks=num_blocks)
    batch = BatchEngine(engine, kv_pool=pool, max_batch_tokens=16)
    handles = []
    for op, which, n in ops:
        prompt = PROMPTS[which]
        if op == "submit":
            try:
                handles.append((batch.submit(prompt, GREEDY, stop(n)), prompt, n))
            except CacheFullError:
                assert pool.allocator.blocks_for(min(len(prompt) + n, engine.max_context)) > num_blocks
        elif op == "step":
            batch.step()
        elif handles:
            batch.cancel(handles[which % len(handles)][0])
        s = pool.stats()
        assert s.used + s.free + s.cached == s.total
    batch.run_until_done()
    for h, prompt, n in handles:
        want = alone(engine, prompt, n)
        if h.finish_reason == "cancelled":
            assert h.tokens == want[: len(h.tokens)]
        else:
            assert h.tokens == want
    s = pool.stats()
    assert s.used == 0 and s.free + s.cached == s.total


def test_pages_held_outside_the_batch_engine_are_waited_for_not_taken(batch_engines) -> None:
    engine = load("llama3", "numpy").engine
    batch = batch_engines(engine, block_size=4, num_blocks=8)
    outside = engine.new_sequence(kv_pool=batch.pool)
    engine.forward(outside, list(range(100, 125)))  # 7 of the 8 pages
    handle = batch.submit(PROMPTS[0], GREEDY, stop(6))
    with pytest.raises(CacheFullError, match="sequences outside it hold the rest"):
        batch.step()
    assert batch.waiting and outside.cache.length == 25
    engine.release(outside)
    assert list(handle) == alone(engine, PROMPTS[0], 6)


def test_contiguous_budget_admits_in_turn_and_refuses_what_never_fits(batch_engines) -> None:
    """With room for one request's whole cache at a time, the second waits
    for the first to finish (nothing is preempted), and a request larger
    than the whole budget is refused with the bytes it needs."""
    engine = load("llama3", "numpy").engine
    per = engine.kv_bytes_per_position()
    batch = batch_engines(engine, layout="contiguous", num_blocks=5, block_size=4)  # 20 positions
    first = batch.submit(PROMPTS[0], GREEDY, stop(12))  # 5 + 12 = 17 positions
    second = batch.submit(PROMPTS[2], GREEDY, stop(12))  # 1 + 12 = 13
    batch.step()
    assert batch.running == [first] and list(batch.waiting) == [second]
    batch.run_until_done()
    assert first.tokens == alone(engine, PROMPTS[0], 12) and second.tokens == alone(engine, PROMPTS[2], 12)
    assert batch.stats.preemptions == 0
    with pytest.raises(CacheFullError, match=rf"needs a KV cache of 21 positions \({21 * per:,} bytes\).*holds 20 positions"):
        batch.submit(PROMPTS[3], GREEDY, stop(8))


def test_auto_layout_follows_native_paged_attention() -> None:
    """numpy, torch and MLX attend through the block table natively (paged); a
    backend without a native attention (the contract's default, which reads
    the description back per sequence) gets contiguous caches."""
    from infer.errors import GenerationError

    engine = load("llama3", "numpy").engine
    assert BatchEngine(engine, kv_memory=2**20).kv_layout == "paged"

    class NoNative(type(engine.backend)):  # numpy without its native attention
        native_ops = engine.backend.native_ops - {"attention"}

    plain = Engine(engine.model, NoNative())
    assert not plain.backend.supports("attention")
    batch = BatchEngine(plain, kv_memory=2**20)
    assert batch.kv_layout == "contiguous" and batch.pool is None
    handles = [batch.submit(p, GREEDY, stop(6)) for p in PROMPTS]
    batch.run_until_done()
    assert [h.tokens for h in handles] == [alone(engine, p, 6) for p in PROMPTS]
    with pytest.raises(GenerationError, match="kv_layout must be"):
        BatchEngine(engine, kv_layout="pages")
    with pytest.raises(GenerationError, match="kv_memory must be"):
        BatchEngine(engine, kv_memory=0)


@pytest.mark.parametrize("backend", backend_params("mlx:cpu"))
def test_mlx_batches_on_paged_and_contiguous_caches(backend: str) -> None:
    # MLX's attention reads the block table natively: paged by default; its
    # contiguous caches (one block each) still give every request its tokens.
    model = load("llama3", backend)
    for layout in ("auto", "contiguous"):
        batch = model.configure_batching(kv_memory=2**20, kv_layout=layout)
        assert batch.kv_layout == ("paged" if layout == "auto" else "contiguous")
        handles = [batch.submit(p, GREEDY, stop(6)) for p in PROMPTS]
        batch.run_until_done()
        assert [h.tokens for h in handles] == [alone(model.engine, p, 6) for p in PROMPTS], layout
    model.configure_batching()  # back to the defaults


def test_configure_batching_replaces_an_idle_engine_only() -> None:
    from infer.errors import GenerationError

    model = load("llama3", "numpy")
    batch = model.configure_batching(kv_memory=2**20, block_size=8, max_batch_tokens=32)
    assert model.batch_engine is batch and batch.pool.block_size == 8 and batch.max_batch_tokens == 32
    handle = batch.submit(PROMPTS[0], GREEDY, stop(4))
    with pytest.raises(GenerationError, match="still has requests"):
        model.configure_batching()
    handle.cancel()
    assert model.configure_batching(kv_layout="contiguous").kv_layout == "contiguous"
    model.configure_batching()  # back to the defaults for the other tests
