"""LoRA adapters inside a KV pool's memory budget (docs/adapters.md, "Memory").

An adapter's stacked factors take pages out of every KV pool sized by a
memory budget (the batch engine's, the server's) when it loads, whether the
pool was made before or after, and give them back when it unloads. An
adapter whose bytes the spare pages cannot cover is refused with an
``AdapterMemoryError`` (on the server: 507) that names it, its bytes and
what is free, and nothing changes: the running requests keep their pages,
and the largest request keeps what it needs to finish, so their output is
the output they give alone (greedy, token for token).
"""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest
from adapters_reference import build_peft_adapter
from reference import encode, tiny_model_dir

import infer
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.errors import AdapterLimitError, AdapterMemoryError, CacheFullError
from infer.kv.blocks import BlockAllocator

VARIANT = "qwen3"
PROMPT = "The capital of France is Paris. Once upon a time"
BLOCK = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, path = tmp_path_factory.mktemp("adapter-memory"), tiny_model_dir(VARIANT)
    return {"a": build_peft_adapter(path, root / "a", r=4, lora_alpha=8, seed=41),
            "b": build_peft_adapter(path, root / "b", r=8, lora_alpha=8, seed=42),
            "c": build_peft_adapter(path, root / "c", r=16, lora_alpha=8, seed=43)}


def page_bytes(model: infer.Model) -> int:
    return model.engine.kv_bytes_per_position() * BLOCK


def batching(model: infer.Model, pages: int) -> infer.engine.BatchEngine:
    """A paged batch engine whose budget buys ``pages`` pages (and the scratch page)."""
    return model.configure_batching(kv_memory=(pages + 1) * page_bytes(model), kv_layout="paged", block_size=BLOCK)


def test_the_allocator_withholds_only_unreferenced_blocks() -> None:
    alloc = BlockAllocator(8, BLOCK)
    held = [alloc.allocate(), alloc.allocate()]  # blocks 0 and 1, referenced
    cached = alloc.allocate()
    alloc.register(cached, b"k" * 32)
    alloc.free(cached)  # block 2: unreferenced, in the prefix cache
    alloc.withhold(5)  # the free ones first, highest ids first: 7..3
    assert alloc.stats().withheld == 5 and alloc.available() == 1 and alloc.lookup(b"k" * 32) == cached
    alloc.withhold(1)  # then the cached one, which leaves the prefix cache
    assert alloc.available() == 0 and alloc.lookup(b"k" * 32) is None
    with pytest.raises(CacheFullError):
        alloc.withhold(1)  # the referenced blocks are never taken
    assert all(alloc.refcount(b) == 1 for b in held)
    alloc.release_withheld(6)
    stats = alloc.stats()
    assert stats.withheld == 0 and stats.free == 6 and stats.used + stats.free + stats.cached == stats.total


def test_pages_are_the_same_whether_adapters_load_before_or_after_the_pool(dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    after = infer.load(path, backend="numpy")
    pool = batching(after, 120).pool
    assert pool.usable_blocks == pool.num_blocks == 120
    for name in ("a", "b"):
        after.load_adapter(name, dirs[name])
    before = infer.load(path, backend="numpy", adapters={n: dirs[n] for n in ("a", "b")})
    other = batching(before, 120).pool
    held = after.adapters.nbytes
    assert held == before.adapters.nbytes > 0
    per = page_bytes(after)
    assert pool.held_bytes == other.held_bytes == held
    assert pool.stats() == other.stats() and pool.stats().withheld == -(-held // per)
    assert pool.usable_blocks == other.usable_blocks == 120 - -(-held // per)
    # Unloading gives the pages back, in both.
    for model, p in ((after, pool), (before, other)):
        model.unload_adapter("a")
        assert p.held_bytes == model.adapters.nbytes and p.stats().withheld == -(-model.adapters.nbytes // per)
        model.unload_adapter("b")
        assert p.held_bytes == 0 and p.usable_blocks == 120 and p.stats().free == 120


def test_the_count_before_loading_is_what_loading_holds(dirs: dict) -> None:
    """The bytes checked before anything is built are the bytes the stacked pools then hold
    (every slot padded to the largest rank: adapters of ranks 4, 16 and 8, loaded in that order)."""
    model = infer.load(tiny_model_dir(VARIANT), backend="numpy")
    pool = batching(model, 400).pool
    for name in ("a", "c", "b"):
        before = model.adapters.nbytes
        model.load_adapter(name, dirs[name])
        assert pool.held_bytes == model.adapters.nbytes > before
    assert all(w.a.shape[0] == 3 for w in model.adapters.adapted.values() if w.a is not None)  # one slot each


def test_an_adapter_the_spare_pages_cannot_hold_is_refused_and_requests_run_on(dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    model = infer.load(path, backend="numpy")
    ids = encode(path, PROMPT)
    max_tokens = 4 * 60 - len(ids)  # the request needs 60 pages at its longest
    alone = list(model.generate_tokens(ids, max_tokens=max_tokens, ignore_eos=True))
    batch = batching(model, 90)
    pool = batch.pool
    per = page_bytes(model)
    handle = batch.submit(ids, SamplingParams(), StopConditions(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(4):
        batch.step()
    used = pool.stats().used
    assert used > 0
    # b's 112,640 bytes need 37 pages: 86 are free, but the running request keeps the 60 it will need.
    with pytest.raises(AdapterMemoryError) as caught:
        model.load_adapter("b", dirs["b"])
    err = caught.value
    assert isinstance(err, AdapterLimitError) and err.adapter == "b"
    assert err.bytes_needed > err.bytes_free and err.bytes_free == (90 - 60) * per
    assert "'b'" in str(err) and f"{err.bytes_needed:,}" in str(err) and f"{err.bytes_free:,} bytes are free" in str(err)
    assert "b" not in model.adapters.loaded and pool.stats().withheld == 0 and pool.stats().used == used
    model.load_adapter("a", dirs["a"])  # a's 19 pages fit beside the request's 60
    assert pool.stats().withheld == -(-model.adapters.nbytes // per) <= 30
    batch.run_until_done()
    assert handle.finish_reason == "length" and handle.tokens == alone  # never hurt
    # The request done (its pages only cached now), b fits beside a.
    model.load_adapter("b", dirs["b"])
    assert pool.stats().withheld == -(-model.adapters.nbytes // per)
    # A replacement that does not fit changes nothing: the old adapter stays.
    old = model.adapters.loaded["b"]
    with pytest.raises(AdapterMemoryError, match="'b'"):
        model.load_adapter("b", dirs["c"])
    assert model.adapters.loaded["b"] is old and pool.held_bytes == model.adapters.nbytes
    model.unload_adapter("a")
    model.unload_adapter("b")
    assert pool.stats().withheld == 0 and pool.usable_blocks == 90
    # And a request whose whole length the withheld pages would leave no room for is refused at submit.
    model.load_adapter("c", dirs["c"])
    with pytest.raises(CacheFullError, match="held for LoRA adapters"):
        batch.submit(ids, SamplingParams(), StopConditions(max_tokens=4 * 89 - len(ids), ignore_eos=True))


def test_pages_taken_while_requests_run_preempt_but_never_change_them(dirs: dict) -> None:
    """Three requests that together need more than the pages a loaded adapter leaves: the
    load takes only spare pages, the batch engine preempts (and recomputes) as it does
    when the pool fills, and every request gives what it gives alone."""
    path = tiny_model_dir(VARIANT)
    model = infer.load(path, backend="numpy")
    ids = encode(path, PROMPT)
    lengths = [4 * 24 - len(ids) - i for i in range(3)]  # 24 pages each at the longest
    alone = [list(model.generate_tokens(ids[i:], max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    batch = batching(model, 90)
    handles = [batch.submit(ids[i:], SamplingParams(), StopConditions(max_tokens=n, ignore_eos=True))
               for i, n in enumerate(lengths)]
    for _ in range(3):
        batch.step()
    model.load_adapter("b", dirs["b"])  # 37 pages: 53 are left for the 72 the requests reach
    assert batch.pool.usable_blocks == 90 - 37
    batch.run_until_done()
    assert batch.stats.preemptions > 0
    assert [h.tokens for h in handles] == alone


def test_a_budget_the_loaded_adapters_fill_makes_no_pool(dirs: dict) -> None:
    model = infer.load(tiny_model_dir(VARIANT), backend="numpy", adapters={"c": dirs["c"]})
    with pytest.raises(CacheFullError, match="after the loaded adapters"):
        batching(model, 20)


def test_the_server_answers_507_and_gives_pages_back(dirs: dict) -> None:
    pytest.importorskip("uvicorn")
    from test_serve import running

    from infer.serve import create_app

    model = infer.load(tiny_model_dir(VARIANT), backend="numpy")
    pool = batching(model, 60).pool
    # Something running holds 30 pages (as a long stream's sequence does).
    seq = model.engine.new_sequence(4 * 30, kv_pool=pool)
    seq.cache.reserve(4 * 30)
    with running(create_app(model, model_name="tiny", enable_adapter_updates=True)) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(dirs["b"])})
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "adapter_memory_exceeded" and "'b'" in error["message"]
        assert "bytes are free" in error["message"] and pool.stats().withheld == 0
        model.engine.release(seq)
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(dirs["b"])})
        assert r.status_code == 200, r.text
        assert pool.stats().withheld == -(-model.adapters.nbytes // page_bytes(model)) > 0
        text = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True}).json()
        assert text["choices"][0]["text"] == model.generate(PROMPT, adapter="b", max_tokens=6, temperature=0,
                                                            ignore_eos=True)
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200, r.text
    assert pool.stats().withheld == 0 and pool.stats().used == 0
