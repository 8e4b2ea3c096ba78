"""The recurrent state kind, driven through every engine feature by a test-only layer.

An exponential moving average, ``h_t = a * h_{t-1} + (1 - a) * x_t``, is the
smallest recurrent layer: one array ``[hidden]`` per sequence, which cannot be
cut back to an earlier position. ``EMAModel`` takes the tiny llama3's
decoder layers and replaces the middle one with an EMA layer, so attention
and recurrent layers mix in one forward. The EMA op has the shape the real
families' ops have (``causal_conv1d``, ``gated_delta_rule``, ``ssd``): the
flattened tokens ``[T, D]``, the per-sequence state ``[B, D]`` gathered by
state slot, the batch's ragged ``query_start``, and the checkpoint rows; it
returns the outputs, the new states and the states after the checkpoint rows.

Every test compares with recomputing without a cache: one fresh forward over
the whole sequence. Prefix hits, forks (n > 1), preemption and speculative
(n-gram) rollback each go through the state's checkpoints.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import load_tiny

from infer.architecture import CausalLM
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.kv.attention import AttentionContext, FullAttention, LayerState, Recurrent
from infer.ops import Array, Backend

DECAY = 0.75
EMA_LAYERS = (1,)
GREEDY = SamplingParams()


def ema(ops: Backend, x: Array, state: Array, query_start: Array, checkpoint_rows: Array,
        a: float) -> tuple[Array, Array, Array]:
    """The EMA over a ragged batch: ``x`` ``[T, D]``, ``state`` ``[B, D]``,
    ``query_start`` ``[B + 1]``; returns ``y`` ``[T, D]`` (``y_t = h_t``), the
    states after each sequence's last token ``[B, D]`` and ``y`` at the
    checkpoint rows ``[C, D]`` (the state after a row is its output)."""
    xs, h0 = ops.to_numpy(x).astype(np.float32), ops.to_numpy(state).astype(np.float32)
    qs = ops.to_numpy(query_start)
    y, last = np.empty_like(xs), np.empty_like(h0)
    for b in range(len(qs) - 1):
        h = h0[b]
        for t in range(qs[b], qs[b + 1]):
            h = a * h + (1 - a) * xs[t]
            y[t] = h
        last[b] = h
    return ops.from_numpy(y), ops.from_numpy(last), ops.from_numpy(y[ops.to_numpy(checkpoint_rows)])


def ema_reference(x: np.ndarray, a: float) -> np.ndarray:
    """The same EMA from an empty state, in closed form: ``h_t = (1 - a) * sum_j a^(t-j) x_j``."""
    t = np.arange(len(x))
    weights = np.tril(a ** (t[:, None] - t[None, :]).astype(np.float64)) * (1 - a)
    return (weights @ x.astype(np.float64)).astype(np.float32)


class EMAModel(CausalLM):
    """The tiny llama3's decoder with layer 1 an EMA layer (its attention and MLP unused)."""

    def __init__(self, base: CausalLM) -> None:
        self.base, self.ops, self.config = base, base.ops, base.config
        self.num_layers, self.max_context, self.vocab_size = base.num_layers, base.max_context, base.vocab_size
        self.lm_head = base.lm_head
        self.hidden = base.config.hidden_size

    def layer_states(self) -> list[LayerState]:
        return [Recurrent({"h": (self.hidden,)}) if i in EMA_LAYERS else FullAttention()
                for i in range(self.num_cache_layers)]

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ops, base = self.ops, self.base
        h = base.embed(input_ids, ctx)
        tables = base.rope_tables(ctx)
        for layer in base.layers:
            if layer.index in EMA_LAYERS:
                x = ops.rms_norm(h, layer.weights["attn_norm"], base.eps)
                y, state, checkpoints = ema(ops, x, ctx.state(layer.index)["h"], ctx.query_start,
                                            ctx.checkpoint_rows, DECAY)
                ctx.set_state(layer.index, {"h": state}, {"h": checkpoints})
                h = ops.add(h, y)
            else:
                out, residual = layer.block.forward(h, None, layer, ctx, tables)
                h = ops.add(out, residual)
        return ops.rms_norm(h, base.norm, base.eps)


@pytest.fixture(scope="module")
def engine() -> Engine:
    base = load_tiny("llama3")
    return Engine(EMAModel(base.network), base.backend)


def full_logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    """Every position's logits, recomputed without a cache (one fresh sequence, one forward)."""
    seq = engine.new_sequence(len(tokens) + 1)
    logits = engine.backend.to_numpy(engine.forward(seq, tokens, all_logits=True))
    engine.release(seq)
    return logits


def greedy_alone(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens recomputing the whole sequence for each one (no cache carried)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(full_logits(engine, tokens)[-1])))
    return tokens[len(prompt):]


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 200, 37)]


def test_the_ema_op_is_the_plain_recurrence_over_a_ragged_batch(engine: Engine) -> None:
    ops, rng = engine.backend, np.random.default_rng(1)
    x = rng.standard_normal((9, 5)).astype(np.float32)
    qs = np.asarray([0, 4, 9], np.int32)
    y, last, ckpt = ema(ops, ops.from_numpy(x), ops.zeros((2, 5), "float32"), ops.from_numpy(qs),
                        ops.from_numpy(np.asarray([1, 8], np.int32)), DECAY)
    want = np.concatenate([ema_reference(x[:4], DECAY), ema_reference(x[4:], DECAY)])
    close(ops.to_numpy(y), want)
    close(ops.to_numpy(last), want[[3, 8]])
    close(ops.to_numpy(ckpt), want[[1, 8]])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_chunked_forwards_carry_the_state(engine: Engine, layout: str) -> None:
    want = full_logits(engine, PROMPT)
    pool = engine.new_kv_pool(block_size=4, num_blocks=32) if layout == "paged" else None
    seq = engine.new_sequence(64, kv_pool=pool)
    at = 0
    for n in (5, 1, 9, 3, 1, 1, 17):
        close(engine.backend.to_numpy(engine.forward(seq, PROMPT[at:at + n], all_logits=True)), want[at:at + n])
        at += n
    engine.release(seq)


def test_a_prefix_hit_needs_the_blocks_and_a_checkpoint(engine: Engine) -> None:
    pool = engine.new_kv_pool(block_size=4, num_blocks=32)
    want = full_logits(engine, PROMPT)
    first = engine.new_sequence(64, kv_pool=pool)
    engine.forward(first, PROMPT[:30])  # one chunk: checkpoints at each block boundary and at 30
    engine.release(first)
    hit = engine.new_sequence(64, kv_pool=pool)
    reused = hit.cache.reuse_prefix(PROMPT[:-1])
    assert reused == 28  # the last full block of the first sequence's 30 positions
    hit.tokens = PROMPT[:reused]
    close(engine.backend.to_numpy(engine.forward(hit, PROMPT[reused:], all_logits=True)), want[reused:])
    engine.release(hit)
    # Without the checkpoint the blocks alone are no hit: the state after them is unknown.
    store = engine.state_store
    assert store is not None
    store.allocator.clear_prefix_cache()
    miss = engine.new_sequence(64, kv_pool=pool)
    assert miss.cache.reuse_prefix(PROMPT[:-1]) == 0
    engine.release(miss)
    assert pool.stats().used == 0 and store.slots_held() == 0


def test_forks_each_continue_from_the_shared_state(engine: Engine) -> None:
    pool = engine.new_kv_pool(block_size=4, num_blocks=32)
    seq = engine.new_sequence(64, kv_pool=pool)
    engine.forward(seq, PROMPT)
    forks = [seq] + [type(seq)(tokens=list(seq.tokens), cache=seq.cache.fork()) for _ in range(2)]
    for i, s in enumerate(forks):
        tail = [11 + i, 50 + i, 7]
        got = engine.backend.to_numpy(engine.forward(s, tail, all_logits=True))
        close(got, full_logits(engine, PROMPT + tail)[len(PROMPT):])
    for s in forks:
        engine.release(s)
    assert pool.stats().used == 0 and engine.state_store.slots_held() == 0


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_rollback_restores_the_newest_checkpoint_and_replays(engine: Engine, layout: str) -> None:
    pool = engine.new_kv_pool(block_size=4, num_blocks=32) if layout == "paged" else None
    seq = engine.new_sequence(64, kv_pool=pool)
    engine.forward(seq, PROMPT[:20])
    drafts = PROMPT[20:26]
    engine.forward(seq, drafts, all_logits=True)  # a verification: checkpoints after every row
    engine.truncate(seq, 23)  # three drafts accepted: restored exactly
    assert seq.cached == 23 and seq.tokens == PROMPT[:23]
    close(engine.backend.to_numpy(engine.forward(seq, PROMPT[23:30], all_logits=True)),
          full_logits(engine, PROMPT[:30])[23:])
    engine.truncate(seq, 13)  # between checkpoints: back to one, the tokens after it replayed
    assert seq.cached == 13 and seq.tokens == PROMPT[:13]
    close(engine.backend.to_numpy(engine.forward(seq, PROMPT[13:37], all_logits=True)),
          full_logits(engine, PROMPT)[13:])
    engine.release(seq)


def test_one_chunk_writes_only_the_checkpoints_a_rollback_can_reach(engine: Engine) -> None:
    # A contiguous cache checkpoints every 16 positions. A 37-token prompt in one forward writes
    # its newest boundary (32) and its end, not 16: the next forward lets go of every checkpoint
    # but the newest at or before the length, so 16 could serve only a rollback in between, and
    # each costs a slot of state (18 MiB at Qwen3.5's shape).
    want = full_logits(engine, PROMPT)
    seq = engine.new_sequence(64)
    engine.forward(seq, PROMPT)
    states = seq.cache.states
    assert states is not None and sorted(states.checkpoints) == [32, 37]
    assert engine.state_store.slots_held() == 3  # the live state and the two checkpoints
    engine.truncate(seq, 34)  # back to 32, two tokens replayed
    assert seq.cached == 34 and seq.tokens == PROMPT[:34]
    close(engine.backend.to_numpy(engine.forward(seq, PROMPT[34:], all_logits=True)), want[34:])
    engine.truncate(seq, 20)  # before every checkpoint held: from the start
    assert seq.cached == 20 and seq.tokens == PROMPT[:20]
    close(engine.backend.to_numpy(engine.forward(seq, PROMPT[20:], all_logits=True)), want[20:])
    engine.release(seq)
    assert engine.state_store.slots_held() == 0


def test_speculative_ngram_decoding_equals_greedy(engine: Engine) -> None:
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repetitive: the n-gram source drafts, some are rejected
    want = greedy_alone(engine, prompt, 12)
    stop = StopConditions(max_tokens=12, ignore_eos=True)
    assert list(generate(engine, prompt, GREEDY, stop, Speculation(NGramDraft(), 4))) == want
    paged = Engine(engine.model, engine.backend, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=32))
    spec = Speculation(NGramDraft(), 4)
    assert list(generate(paged, prompt, GREEDY, stop, spec)) == want
    assert spec.stats.drafted > 0


def test_a_batch_preempts_prefix_caches_and_speculates(engine: Engine) -> None:
    prompts = [PROMPT[:9], PROMPT[:9] + [3, 4], PROMPT[10:17], [5, 6, 7, 8, 5, 6, 7]]
    want = [greedy_alone(engine, p, 10) for p in prompts]
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=12))
    stop = StopConditions(max_tokens=10, ignore_eos=True)
    handles = [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if i == 3 else None)
               for i, p in enumerate(prompts)]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.stats.preemptions > 0 and batch.stats.tokens_reused > 0
    assert batch.pool.stats().used == 0 and engine.state_store.slots_held() == 0


def test_admission_counts_state_slots(engine: Engine) -> None:
    # Four slots: a request is admitted with room for its live state and a checkpoint, and for a
    # checkpoint of every running request that has none yet: two are admitted, the third waits.
    few = Engine(engine.model, engine.backend, state_slots=4)
    prompts = [PROMPT[:9], PROMPT[10:17], PROMPT[20:26]]
    batch = BatchEngine(few, kv_pool=few.new_kv_pool(block_size=4, num_blocks=32))
    stop = StopConditions(max_tokens=6, ignore_eos=True)
    handles = [batch.submit(p, GREEDY, stop) for p in prompts]
    batch.step()
    assert len(batch.running) == 2 and len(batch.waiting) == 1
    batch.run_until_done()
    assert [h.tokens for h in handles] == [greedy_alone(engine, p, 6) for p in prompts]
    assert few.state_store.slots_held() == 0


def test_too_few_slots_is_a_clear_error(engine: Engine) -> None:
    from infer.errors import CacheConfigError, CacheFullError

    with pytest.raises(CacheConfigError, match="state_slots must be at least 2"):
        Engine(engine.model, engine.backend, state_slots=1)
    two = Engine(engine.model, engine.backend, state_slots=2)
    held = [two.new_sequence(8), two.new_sequence(8)]
    with pytest.raises(CacheFullError, match="no recurrent state slot is free for a new sequence"):
        two.new_sequence(8)
    for seq in held:
        two.release(seq)
    assert two.state_store.slots_held() == 0
