"""Speculative decoding: same tokens as plain decoding, same distribution when sampling.

Tiny random models (``reference.tiny_model_dir``) on the numpy backend. For
every draft source — n-gram lookup, a draft model, MTP — greedy decoding with
speculation gives, token for token, what plain greedy decoding gives: alone
(contiguous and paged caches) and inside the continuous-batching engine (both
KV layouts, with preemption), stopping where plain decoding stops (EOS inside
an accepted run, max_tokens, the context). The accept/reject rule is tested
statistically on an 8-token vocabulary; KV cache rollback against fresh
computation.

MTP: the tiny deepseek_v3 checkpoint with two random MTP modules
(``test_deepseek_v3.mtp_model_dir``) checks the real thing, but its random
modules never guess right; so :class:`ShadowMTP`, a test-only model wrapping
the tiny llama, adds "MTP modules" that run the llama's own layers once more in
cache layers of their own, module ``d`` ``d + 1`` positions behind (module
position ``p`` holds token ``p + 1 + d``; rope is relative, so this is the llama
on the sequence without its first ``d + 1`` tokens), plus a small random mix of
the incoming hidden state. About 40% of its drafts are right, so runs of
accepted, partly accepted and rejected drafts all occur.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference import assert_logits_close, backend_params, tiny_model_dir

import infer
from infer.architecture import CausalLM
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import (
    DraftJob,
    DraftModelSource,
    MTPDraft,
    NGramDraft,
    Speculation,
    verify_sampled,
)
from infer.errors import GenerationError, SamplingParameterError
from infer.kv.attention import AttentionContext
from infer.kv.blocks import sequence_key
from infer.kv.paged import PagedKVPool
from infer.ops import Array

GREEDY = SamplingParams()
# Repeats make n-gram lookup find matches; the rest is arbitrary.
PROMPTS = [
    [5, 9, 17, 33, 5, 9, 17, 40, 5, 9],
    [7, 8, 9, 7, 8, 9, 7],
    list(range(3, 24)),
]

_MODELS: dict[str, infer.Model] = {}


def load(variant: str) -> infer.Model:
    if variant not in _MODELS:
        _MODELS[variant] = infer.load(tiny_model_dir(variant), backend="numpy")
    return _MODELS[variant]


class ShadowMTP(CausalLM):
    """Test-only: the tiny llama plus ``depths`` MTP-like modules (see the module docs)."""

    def __init__(self, base: CausalLM, depths: int = 1, mix: float = 0.005, seed: int = 0) -> None:
        self.base, self.ops, self.config = base, base.ops, base.config
        self.num_layers, self.max_context, self.vocab_size = base.num_layers, base.max_context, base.vocab_size
        self.num_mtp_modules = depths
        # Module d runs the llama's layers in cache layers of its own, after the decoder's.
        self.shadow = [[dataclasses.replace(layer, index=layer.index + (1 + d) * base.num_layers)
                        for layer in base.layers] for d in range(depths)]  # type: ignore[attr-defined]
        d = base.config.hidden_size
        rng = np.random.default_rng(seed)
        self.eh_proj = self.ops.from_numpy((rng.standard_normal((d, d)) * mix / np.sqrt(d)).astype(np.float32))

    @property
    def num_cache_layers(self) -> int:
        return (1 + self.num_mtp_modules) * self.num_layers

    def _stack(self, h: Array, layers: list, ctx: AttentionContext) -> Array:
        base, residual = self.base, None
        tables = base.rope_tables(ctx)  # type: ignore[attr-defined]
        for layer in layers:
            h, residual = layer.block.forward(h, residual, layer, ctx, tables)
        h, _ = self.ops.fused_add_rms_norm(h, residual, base.norm, base.eps)  # type: ignore[attr-defined]
        return h

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        return self._stack(self.ops.embedding(self.base.embed_tokens, input_ids), self.base.layers, ctx)  # type: ignore[attr-defined]

    def compute_logits(self, hidden: Array) -> Array:
        return self.base.compute_logits(hidden)

    def mtp_forward(self, depth: int, hidden: Array, input_ids: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        x = ops.add(ops.embedding(self.base.embed_tokens, input_ids), ops.linear(hidden, self.eh_proj))  # type: ignore[attr-defined]
        return self._stack(x, self.shadow[depth], ctx)

    def mtp_compute_logits(self, depth: int, hidden: Array) -> Array:
        return self.base.compute_logits(hidden)


_MTP: dict[str, Engine] = {}


def mtp_engine(depths: int = 1) -> Engine:
    key = f"shadow{depths}"
    if key not in _MTP:
        base = load("llama3")
        _MTP[key] = Engine(ShadowMTP(base.network, depths), base.backend)
    return _MTP[key]


def plain(engine: Engine, prompt: list[int], n: int, stop: StopConditions | None = None) -> list[int]:
    return list(generate(engine, prompt, GREEDY, stop or StopConditions(max_tokens=n)))


def source(name: str) -> tuple[Engine, object]:
    """(target engine, draft source) for a named source."""
    if name == "ngram":
        return load("llama3").engine, NGramDraft()
    if name == "draft_same":  # the target as its own draft: every draft accepted
        return load("llama3").engine, DraftModelSource(load("llama3").engine, 384)
    if name == "draft_other":  # another random model: nearly every draft rejected
        return load("llama3").engine, DraftModelSource(load("tinyllama").engine, 384)
    if name.startswith("mtp"):  # "mtp": one module, "mtp2": two
        engine = mtp_engine(2 if name == "mtp2" else 1)
        return engine, MTPDraft(engine)
    raise AssertionError(name)


SOURCES = ["ngram", "draft_same", "draft_other", "mtp", "mtp2"]


# -- single sequence --------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", SOURCES)
def test_greedy_with_speculation_equals_plain_greedy(name: str, paged: bool) -> None:
    target, src = source(name)
    engine = Engine(target.model, target.backend)
    if paged:
        engine.kv_pool = PagedKVPool(engine.backend, engine.model.num_cache_layers, block_size=4, num_blocks=64)
    stats = []
    for prompt in PROMPTS:
        want = plain(target, prompt, 24)
        for k in (1, 3):
            spec = Speculation(src, k)  # type: ignore[arg-type]
            gen = generate(engine, prompt, GREEDY, StopConditions(max_tokens=24), spec)
            assert list(gen) == want, (name, k, prompt)
            assert gen.stats is spec.stats and gen.stats.tokens == 24
            stats.append(spec.stats)
    if paged:
        assert engine.kv_pool.stats().used == 0
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    forwards = sum(s.forwards for s in stats)
    assert drafted > 0
    if name.startswith("mtp"):  # roughly 40% of its drafts are right
        assert accepted / drafted > 0.2 and 24 * len(stats) / forwards > 1.15
    if name == "draft_same":
        assert accepted == drafted


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "mlx:cpu"))
def test_other_backends_give_plain_greedy_tokens_too(backend: str) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend=backend)
    for prompt in PROMPTS[:2]:
        want = list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
        for spec in ("ngram", model):
            got = model.generate_tokens(prompt, max_tokens=16, ignore_eos=True, speculative=spec, num_speculative_tokens=3)
            assert list(got) == want
    texts = [model.tokenizer.decode(p) for p in PROMPTS[:2]]
    assert model.generate(texts, max_tokens=8, ignore_eos=True, speculative="ngram") == [
        model.generate(t, max_tokens=8, ignore_eos=True) for t in texts]


@pytest.mark.parametrize("name", SOURCES)
def test_stops_where_plain_decoding_stops(name: str) -> None:
    target, src = source(name)
    prompt = PROMPTS[0]
    full = plain(target, prompt, 24)
    # An EOS inside what speculation accepts in one run: the output ends there.
    eos = full[7]
    stop = StopConditions(max_tokens=24, eos_token_ids=frozenset({eos}))
    gen = generate(target, prompt, GREEDY, stop, Speculation(src, 4))  # type: ignore[arg-type]
    assert list(gen) == full[: full.index(eos) + 1] and gen.finish_reason == "stop"
    for n in (1, 2, 5):
        gen = generate(target, prompt, GREEDY, StopConditions(max_tokens=n), Speculation(src, 4))  # type: ignore[arg-type]
        assert list(gen) == full[:n] and gen.finish_reason == "length"
    # The context: a copy of the engine whose model context ends 6 positions after the prompt.
    short = Engine(target.model, target.backend)
    short.max_context = len(prompt) + 6
    want = plain(short, prompt, 24)
    gen = generate(short, prompt, GREEDY, StopConditions(max_tokens=24), Speculation(src, 4))  # type: ignore[arg-type]
    assert list(gen) == want == full[:7] and gen.finish_reason == "length"


@pytest.mark.parametrize("which", ["shadow1", "shadow2", "deepseek_v3"])
def test_mtp_drafts_after_rollbacks_equal_drafts_from_scratch(which: str) -> None:
    """The MTP modules' cache layers, kept in step across verify forwards and
    rollbacks (deeper modules lag one position per depth), give the same
    drafts as a fresh sequence computed at once."""
    if which.startswith("shadow"):
        engine = mtp_engine(int(which[-1]))
    else:
        from test_deepseek_v3 import mtp_model_dir

        engine = infer.load(mtp_model_dir(), backend="numpy").engine
    recorded: list[tuple[list[int], list[int]]] = []

    class Recording(MTPDraft):
        def propose(self, jobs):  # type: ignore[no-untyped-def]
            drafts = super().propose(jobs)
            recorded.extend((list(j.tokens), list(d.tokens)) for j, d in zip(jobs, drafts))
            return drafts

    gen = generate(engine, PROMPTS[2], GREEDY, StopConditions(max_tokens=30), Speculation(Recording(engine), 3))
    list(gen)
    assert gen.stats.accepted < gen.stats.drafted  # rollbacks happened
    if which != "deepseek_v3":
        assert gen.stats.accepted > 0  # and accepted runs (random MTP weights accept nothing)
    fresh_source = MTPDraft(engine)
    for tokens, drafts in recorded[1:]:
        seq = engine.new_sequence(len(tokens) + 3)
        out = engine.run(engine.prepare([seq], [tokens[:-1]], capture_hidden=True))
        job = DraftJob(tokens=tokens, k=len(drafts), sampler=infer.engine.sampling.Sampler(GREEDY),
                       state=fresh_source.new_state(), capacity=len(tokens) + 3, seq=seq, hidden=out.hidden)
        assert fresh_source.propose([job])[0].tokens == drafts


# -- rollback ---------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_rollback_then_forward_equals_fresh_computation(paged: bool) -> None:
    model = load("llama3")
    engine = Engine(model.network, model.backend)
    pool = PagedKVPool(engine.backend, engine.model.num_layers, block_size=4, num_blocks=32) if paged else None
    ops = engine.backend
    prompt = PROMPTS[2][:10]
    seq = engine.new_sequence(32, kv_pool=pool)
    engine.forward(seq, prompt)
    engine.forward(seq, [40, 41, 42, 43], all_logits=True)  # drafts, rejected from the second on
    engine.truncate(seq, len(prompt) + 1)
    assert seq.cached == len(prompt) + 1 and seq.tokens == prompt + [40]
    got = ops.to_numpy(engine.forward(seq, [50, 51], all_logits=True))
    fresh = engine.new_sequence(32, kv_pool=pool)
    want = ops.to_numpy(engine.forward(fresh, prompt + [40, 50, 51], all_logits=True))[-2:]
    assert_logits_close(got, want, "after rollback vs fresh")
    for s in (seq, fresh):
        engine.release(s)
    if pool is not None:
        assert pool.stats().used == 0


def test_paged_rollback_keeps_prefix_cache_keys_true_and_copies_shared_blocks() -> None:
    """Rolling back into a block: the block's prefix-cache key (of the rejected
    tokens) still describes its contents, so a sequence that attaches it gets
    the right keys and values; the rolled-back sequence's next write copies it."""
    model = load("llama3")
    engine = Engine(model.network, model.backend)
    pool = PagedKVPool(engine.backend, engine.model.num_layers, block_size=4, num_blocks=32)
    ops = engine.backend
    tokens = PROMPTS[2][:8]  # two full blocks, both entered in the prefix cache
    seq = engine.new_sequence(32, kv_pool=pool)
    engine.forward(seq, tokens)
    engine.truncate(seq, 6)  # half of the second block rejected
    table = seq.cache.table  # type: ignore[union-attr]
    assert len(table.hashes) == 1 and table.num_tokens == 6 and len(table.blocks) == 2
    other = engine.new_sequence(32, kv_pool=pool)
    assert other.cache.reuse_prefix(tokens + [99]) == 8  # type: ignore[union-attr]
    other.tokens = list(tokens)
    shared = table.blocks[1]
    assert pool.allocator.refcount(shared) == 2
    a = ops.to_numpy(engine.forward(seq, [60, 61]))
    assert table.blocks[1] != shared  # copy on write
    b = ops.to_numpy(engine.forward(other, [99]))
    for ids, got in ((tokens[:6] + [60, 61], a), (tokens + [99], b)):
        fresh = engine.new_sequence(32)
        assert_logits_close(got, ops.to_numpy(engine.forward(fresh, ids)), "after a shared block's copy vs fresh")
    engine.release(seq)
    engine.release(other)
    assert pool.stats().used == 0


# -- batched ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", SOURCES)
def test_batched_speculation_equals_plain_greedy(name: str, layout: str) -> None:
    target, src = source(name)
    want = [plain(target, p, 20) for p in PROMPTS]
    batch = BatchEngine(target, kv_layout=layout, block_size=4, max_batch_tokens=12, kv_memory=8 * 2**20)
    stop = StopConditions(max_tokens=20)
    handles = [batch.submit(p, GREEDY, stop, speculation=Speculation(src, 3)) for p in PROMPTS]  # type: ignore[arg-type]
    handles.append(batch.submit(PROMPTS[0], GREEDY, stop))  # a plain request in the same batch
    batch.run_until_done()
    assert [h.tokens for h in handles] == want + [want[0]]
    stats = batch.stats.speculative[src.name]  # type: ignore[attr-defined]
    assert stats.tokens == 60 and stats.drafted > 0
    assert stats.forwards == sum(h.stats.forwards for h in handles[:3])  # type: ignore[union-attr]
    if name in ("draft_same", "mtp", "mtp2"):
        assert stats.tokens_per_forward > 1.15
    if batch.pool is not None:
        assert batch.pool.stats().used == 0


@pytest.mark.parametrize("name", ["ngram", "mtp", "mtp2"])
def test_batched_speculation_survives_preemption(name: str) -> None:
    target, src = source(name)
    want = [plain(target, p, 24) for p in PROMPTS]
    pool = PagedKVPool(target.backend, target.model.num_cache_layers, block_size=4, num_blocks=20)
    batch = BatchEngine(target, kv_pool=pool, max_batch_tokens=16)
    handles = [batch.submit(p, GREEDY, StopConditions(max_tokens=24), speculation=Speculation(src, 4))  # type: ignore[arg-type]
               for p in PROMPTS]
    batch.run_until_done()
    assert batch.stats.preemptions > 0
    assert [h.tokens for h in handles] == want
    assert pool.stats().used == 0


def keep_prompt(engine: Engine, pool: PagedKVPool, prompt: list[int]) -> None:
    """``prompt``'s blocks cached in ``pool`` and the logits after it kept, as a restored state leaves them."""
    seq = engine.new_sequence(len(prompt) + 1, kv_pool=pool)
    logits = engine.backend.to_numpy(engine.forward(seq, prompt))[-1]
    engine.release(seq)
    pool.final_logits.put(sequence_key(prompt, pool.block_size), logits)


@pytest.mark.parametrize("name", SOURCES)
def test_speculation_from_kept_logits_equals_plain_greedy(name: str) -> None:
    """A prompt whose state and final logits are kept: the first token comes from the logits (an
    MTP source, drafting from the last hidden state, computes the last position instead)."""
    target, src = source(name)
    prompt = PROMPTS[0][:8]  # two whole blocks of 4
    want = plain(target, prompt, 12)
    pool = PagedKVPool(target.backend, target.model.num_cache_layers, block_size=4, num_blocks=64)
    keep_prompt(target, pool, prompt)
    batch = BatchEngine(target, kv_pool=pool, max_batch_tokens=16)
    handle = batch.submit(prompt, GREEDY, StopConditions(max_tokens=12), speculation=Speculation(src, 3))  # type: ignore[arg-type]
    batch.run_until_done()
    assert handle.tokens == want
    assert handle.cached_tokens == (7 if src.needs_hidden else 8)  # type: ignore[attr-defined]
    gen = generate(target, prompt, GREEDY, StopConditions(max_tokens=12), Speculation(src, 3), kv_pool=pool)  # type: ignore[arg-type]
    assert list(gen) == want
    assert gen.cached_tokens == (4 if src.needs_hidden else 8)  # type: ignore[attr-defined]
    assert pool.stats().used == 0


@pytest.mark.parametrize("name", ["ngram", "draft_other", "mtp"])
def test_batched_sampling_with_speculation_is_repeatable(name: str) -> None:
    target, src = source(name)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=7)
    runs = []
    for _ in range(2):
        batch = BatchEngine(target, kv_layout="paged", block_size=4, kv_memory=8 * 2**20)
        handles = [batch.submit(p, params, StopConditions(max_tokens=12), speculation=Speculation(src, 3))  # type: ignore[arg-type]
                   for p in PROMPTS]
        batch.run_until_done()
        runs.append([h.tokens for h in handles])
        assert all(len(t) == 12 for t in runs[-1]) and batch.pool.stats().used == 0  # type: ignore[union-attr]
    assert runs[0] == runs[1]


# -- the accept/reject rule -------------------------------------------------------------------

# Chi-square critical values at a false-failure probability of 1e-6 each
# (scipy.stats.chi2.isf(1e-6, df)): df 7 -> 40.52, df 63 -> 131.37.
CHI2_7, CHI2_63 = 40.52, 131.37


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[seen] / expected[seen]).sum())


def _markov(rng: np.random.Generator, sparse: bool) -> np.ndarray:
    m = rng.random((8, 8)) ** 2
    if sparse:
        m[rng.random((8, 8)) < 0.3] = 0.0  # tokens the target never picks
        m[:, 0] += 0.05
    return m / m.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled_draft", "onehot_draft"])
def test_rejection_sampling_keeps_the_target_distribution(deterministic: bool) -> None:
    """Target and draft are Markov chains on 8 tokens. Decoding two tokens
    after token 0 by repeated draft (k = 3) + verify must give the target's
    joint distribution P[0, a] P[a, b]: chi-square over the 64 pairs, and over
    the 8 first tokens; each fails by chance with probability 1e-6 (fixed
    seed, so the test is deterministic)."""
    rng = np.random.default_rng(1234)
    P, Q = _markov(rng, sparse=True), _markov(rng, sparse=False)
    cq = np.cumsum(Q, axis=1)
    n = 40_000
    pairs = np.zeros((8, 8))
    for _ in range(n):
        out: list[int] = []
        last = 0
        while len(out) < 2:
            drafts, qs, prev = [], [], last
            for _ in range(3):
                if deterministic:  # e.g. n-gram lookup: a fixed guess, q one-hot
                    x = int(np.argmax(Q[prev]))
                else:
                    x = min(int(np.searchsorted(cq[prev], rng.random(), side="right")), 7)
                drafts.append(x)
                qs.append(Q[prev])
                prev = x
            p = np.stack([P[t] for t in [last] + drafts])
            emitted = verify_sampled(p, drafts, None if deterministic else np.stack(qs), rng)
            assert 1 <= len(emitted) <= 4 and emitted[:-1] == drafts[: len(emitted) - 1]
            out += emitted
            last = out[-1]
        pairs[out[0], out[1]] += 1
    joint = P[0][:, None] * P
    assert _chi_square(pairs.sum(axis=1), P[0]) < CHI2_7
    assert _chi_square(pairs.ravel(), joint.ravel()) < CHI2_63


def test_verify_sampled_accepts_everything_when_draft_equals_target() -> None:
    rng = np.random.default_rng(0)
    p = np.full((3, 8), 1 / 8)
    assert verify_sampled(p, [3, 4], p[:2].copy(), rng)[:2] == [3, 4]


# -- the API ---------------------------------------------------------------------------------


def test_generate_api_every_form_gives_plain_greedy_text() -> None:
    model = load("llama3")
    prompts = ["the cat sat on the mat and the cat", "hello hello hello"]
    want = [model.generate(p, max_tokens=16, ignore_eos=True) for p in prompts]
    for spec in ("ngram", load("llama3")):
        got = [model.generate(p, max_tokens=16, ignore_eos=True, speculative=spec, num_speculative_tokens=2)
               for p in prompts]
        assert got == want
        streamed = "".join(model.generate(prompts[0], max_tokens=16, ignore_eos=True, stream=True, speculative=spec))
        assert streamed == want[0]
        assert model.generate(prompts, max_tokens=16, ignore_eos=True, speculative=spec) == want
    assert model.speculative_stats["ngram"].tokens >= 64 and model.speculative_stats["draft_model"].drafted > 0
    gen = model.generate_tokens([5, 9, 5, 9, 5], max_tokens=8, ignore_eos=True, speculative="ngram")
    assert len(list(gen)) == 8 and gen.stats is not None and gen.stats.source == "ngram"
    assert model.batch_engine.pool is None or model.batch_engine.pool.stats().used == 0


def test_sampling_with_speculation_is_repeatable_and_in_range() -> None:
    model = load("llama3")
    args = dict(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, seed=3, speculative="ngram")
    a = list(model.generate_tokens(PROMPTS[0], **args))
    assert a == list(model.generate_tokens(PROMPTS[0], **args)) and len(a) == 12
    d = list(model.generate_tokens(PROMPTS[0], **{**args, "speculative": load("tinyllama")}))
    assert len(d) == 12


def test_bad_speculative_arguments_raise_typed_errors() -> None:
    model = load("llama3")
    with pytest.raises(GenerationError, match="ships none"):
        model.generate("hi", speculative="mtp")
    with pytest.raises(SamplingParameterError, match="'ngram', 'mtp'"):
        model.generate("hi", speculative="medusa")
    with pytest.raises(SamplingParameterError, match="'ngram', 'mtp'"):
        model.generate("hi", speculative=3)  # type: ignore[arg-type]
    with pytest.raises(SamplingParameterError, match="num_speculative_tokens"):
        model.generate("hi", speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(SamplingParameterError, match="needs speculative"):
        model.generate("hi", num_speculative_tokens=2)
    with pytest.raises(SamplingParameterError, match="min_n"):
        NGramDraft(min_n=3, max_n=2)
    with pytest.raises(SamplingParameterError, match="'ngram', 'mtp'"):
        model.generate(["a", "b"], speculative="nope")


def test_a_draft_model_with_another_vocabulary_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load("llama3")
    draft = infer.load(tiny_model_dir("llama3"), backend="numpy")
    vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    swapped = dict(vocab)
    a, b = sorted(vocab)[10:12]
    swapped[a], swapped[b] = vocab[b], vocab[a]
    monkeypatch.setattr(draft.package, "tokenizer", _FakeTokenizer(swapped))
    with pytest.raises(GenerationError, match="does not share the target's tokenizer"):
        model.generate("hi", speculative=draft)


class _FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.backend = self
        self.vocab = vocab

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return self.vocab


def test_ngram_lookup_prefers_the_longest_latest_match() -> None:
    ngram = NGramDraft(min_n=1, max_n=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]  # latest 3-gram match
    assert ngram.lookup([7, 1, 2, 8, 2], 3) == [8, 2]  # only the 1-gram [2] matches
    assert ngram.lookup([1, 2, 3], 2) == []
    assert NGramDraft(min_n=2, max_n=2).lookup([5, 6, 7, 5], 2) == []


# -- the real deepseek_v3 MTP modules ---------------------------------------------------------


def test_deepseek_v3_mtp_modules_draft_for_speculative_decoding() -> None:
    """The tiny deepseek_v3 checkpoint with MTP modules (tests/test_deepseek_v3.py):
    greedy decoding with speculative="mtp" gives plain greedy's tokens, alone on a
    contiguous and a paged cache and in a batch."""
    from test_deepseek_v3 import mtp_model_dir

    model = infer.load(mtp_model_dir(), backend="numpy")
    engine = model.engine
    assert model.network.num_mtp_modules > 0
    want = [plain(engine, p, 16) for p in PROMPTS]
    paged = Engine(engine.model, engine.backend)
    paged.kv_pool = PagedKVPool(engine.backend, engine.model.num_cache_layers, block_size=4, num_blocks=64)
    for e in (engine, paged):
        for prompt, w in zip(PROMPTS, want):
            gen = model.generate_tokens(prompt, max_tokens=16, ignore_eos=True, speculative="mtp",
                                        num_speculative_tokens=2) if e is engine else \
                generate(e, prompt, GREEDY, StopConditions(max_tokens=16), Speculation(MTPDraft(e), 2))
            assert list(gen) == w
    assert paged.kv_pool.stats().used == 0
    batch = BatchEngine(engine, kv_layout="paged", block_size=4, max_batch_tokens=12, kv_memory=8 * 2**20)
    handles = [batch.submit(p, GREEDY, StopConditions(max_tokens=16), speculation=Speculation(MTPDraft(engine), 2))
               for p in PROMPTS]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want and batch.pool.stats().used == 0  # type: ignore[union-attr]
    assert batch.stats.speculative["mtp"].drafted > 0


# -- the real SmolLM2 -----------------------------------------------------------------------

CODE_TASK = (
    "Rewrite this Python function, adding type hints:\n\n"
    "def total_price(items, tax_rate):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item.price * item.quantity\n"
    "    return total * (1 + tax_rate)\n"
)


@pytest.mark.slow
def test_smollm2_ngram_lookup_gives_plain_greedy_tokens_and_accepts_drafts() -> None:
    """A rewriting task copies from its prompt, so prompt lookup's drafts get accepted."""
    model = infer.load("smollm2-135m", backend="numpy")
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": CODE_TASK}], add_generation_prompt=True)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    want = list(model.generate_tokens(ids, max_tokens=32, ignore_eos=True))
    gen = model.generate_tokens(ids, max_tokens=32, ignore_eos=True, speculative="ngram", num_speculative_tokens=4)
    assert list(gen) == want
    assert gen.stats is not None and gen.stats.acceptance_rate > 0 and gen.stats.tokens_per_forward > 1
