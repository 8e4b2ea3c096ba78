"""Every engine feature for the families whose layers keep other state than full-attention KV.

test_families.py shows each family equal to transformers on one sequence; here the
same tiny models go through what a server does with them, and each result must equal
running the sequence alone without a cache (one fresh forward over all of it) or
plain greedy decoding:

* a prompt in chunks of 1, 7 and 64 tokens, contiguous and paged;
* a ragged batch (prompts of 5, 23 and 41 tokens decoding together);
* a warm prefix-cache hit against the cold run's logits;
* greedy n-gram speculation, whose rejected drafts roll the state back;
* preemption in a pool too small for the whole batch;
* ``n > 1`` through the server (the choices fork one prompt);
* tensor parallelism, refused with a typed reason where the sharding table
  has no plan for the family.

The kinds: Gemma 4's sliding windows of two head sizes and its shared-KV layers
(which allocate nothing: their KV bytes are counted here), and the recurrent layers
of the hybrid families. Logits are compared at rtol/atol 2e-5 (float32, the same
kernels in another order of rows; the parity tests' own tolerance).
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from reference import load_tiny, tiny_model_dir

import infer
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.errors import TensorParallelConfigError

#: Tiny variants (tests/reference.py) whose layers keep sliding, shared or recurrent state.
STATE_FAMILIES = (
    "gemma4", "gemma4_moe", "gpt_oss", "gpt_oss_top3",  # sliding windows, shared KV, sinks
    "lfm2", "lfm2_conv_bias",  # short convolutions
    "mamba2", "mamba2_groups", "granitemoehybrid", "granitemoehybrid_dense", "falcon_h1", "falcon_h1_norm",  # Mamba2
    "qwen3_5", "qwen3_5_interval", "qwen3_next", "qwen3_5_moe",  # gated DeltaNet
)
GREEDY = SamplingParams()
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 250, 70)]


@pytest.fixture(scope="module", params=STATE_FAMILIES)
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(variant: str) -> infer.Model:
    return load_tiny(variant)


def full_logits(model: infer.Model, tokens: list[int]) -> np.ndarray:
    """Every position's logits from one fresh forward (no cache carried in)."""
    engine = model.engine
    seq = engine.new_sequence(len(tokens) + 1)
    logits = model.backend.to_numpy(engine.forward(seq, tokens, all_logits=True))
    engine.release(seq)
    return logits


def greedy(model: infer.Model, prompt: list[int], n: int) -> list[int]:
    return list(model.generate_tokens(prompt, max_tokens=n, ignore_eos=True))


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_prompt_in_chunks_equals_one_forward(model: infer.Model, chunk: int, layout: str) -> None:
    engine = model.engine
    want = full_logits(model, PROMPT)
    pool = engine.new_kv_pool(block_size=4, num_blocks=64) if layout == "paged" else None
    seq = engine.new_sequence(128, kv_pool=pool)
    for at in range(0, len(PROMPT), chunk):
        part = PROMPT[at:at + chunk]
        close(model.backend.to_numpy(engine.forward(seq, part, all_logits=True)), want[at:at + len(part)],
              f"chunk {chunk} at {at}")
    engine.release(seq)


def test_a_ragged_batch_equals_each_sequence_alone(model: infer.Model) -> None:
    prompts = [PROMPT[:5], PROMPT[3:26], PROMPT[20:61]]
    want = [greedy(model, p, 12) for p in prompts]
    batch = BatchEngine(model.engine, kv_pool=model.engine.new_kv_pool(block_size=4, num_blocks=96))
    handles = [batch.submit(p, GREEDY, StopConditions(max_tokens=12, ignore_eos=True)) for p in prompts]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.pool.stats().used == 0


def test_a_warm_prefix_hit_gives_the_cold_logits(model: infer.Model) -> None:
    engine = model.engine
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    want = full_logits(model, PROMPT[:40])
    first = engine.new_sequence(64, kv_pool=pool)
    engine.forward(first, PROMPT[:30])
    engine.release(first)
    hit = engine.new_sequence(64, kv_pool=pool)
    reused = hit.cache.reuse_prefix(PROMPT[:39])
    assert reused >= 24  # whole blocks of the first run's 30 positions
    hit.tokens = PROMPT[:reused]
    close(model.backend.to_numpy(engine.forward(hit, PROMPT[reused:40], all_logits=True)), want[reused:],
          f"after a hit of {reused}")
    engine.release(hit)
    assert pool.stats().used == 0


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_ngram_speculation_gives_the_greedy_tokens(model: infer.Model, layout: str) -> None:
    from infer.engine import Engine

    # The model's own continuation of a start, then the start again: the n-gram source finds earlier
    # matches of the latest tokens and drafts what followed them (and some drafts are rejected).
    prompt = PROMPT[:8] + greedy(model, PROMPT[:8], 20) + PROMPT[:8]
    want = greedy(model, prompt, 14)
    engine = model.engine
    if layout == "paged":
        engine = Engine(engine.model, engine.backend, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=64))
    spec = Speculation(NGramDraft(), 4)
    assert list(generate(engine, prompt, GREEDY, StopConditions(max_tokens=14, ignore_eos=True), spec)) == want
    assert spec.stats.drafted > 0


def test_a_batch_too_big_for_its_pool_preempts_and_gives_the_same_tokens(model: infer.Model) -> None:
    prompts = [PROMPT[:13], PROMPT[:13] + PROMPT[40:43], PROMPT[14:29], PROMPT[30:41]]
    want = [greedy(model, p, 20) for p in prompts]
    batch = BatchEngine(model.engine, kv_pool=model.engine.new_kv_pool(block_size=4, num_blocks=12))
    handles = [batch.submit(p, GREEDY, StopConditions(max_tokens=20, ignore_eos=True)) for p in prompts]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.stats.preemptions > 0
    assert batch.pool.stats().used == 0


def test_the_server_serves_n_choices(variant: str) -> None:
    from test_serve import running

    from infer.serve import create_app

    path = tiny_model_dir(variant)
    reference = load_tiny(variant)
    text = "Once upon a time"
    want = reference.generate(text, max_tokens=8, temperature=0, ignore_eos=True)
    with running(create_app(infer.load(path, backend="numpy"), model_name="tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, n=3,
                                          extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [want] * 3


def test_tensor_parallel_is_refused_with_the_reason(variant: str) -> None:
    model_type = json.loads((tiny_model_dir(variant) / "config.json").read_text())["model_type"]
    with pytest.raises(TensorParallelConfigError, match=f"model_type '{model_type}' cannot be sharded: its "):
        infer.load(tiny_model_dir(variant), backend="torch:cpu", tensor_parallel=2)


def test_shared_layers_hold_no_kv_bytes() -> None:
    model = load_tiny("gemma4")
    network = model.network
    own = [layer for layer in network.layers if layer.source is None]
    assert len(own) == 4 and len(network.layers) == 6  # two layers read layers 3 and 2
    # keys and values of float32, per position, of the four layers that compute them
    want = sum(2 * layer.kv_heads * layer.head_dim * 4 for layer in own)
    assert model.engine.kv_bytes_per_position() == want == 3 * (2 * 2 * 16 * 4) + 2 * 1 * 32 * 4
