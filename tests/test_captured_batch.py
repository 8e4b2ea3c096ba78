"""The captured batched decode step (CapturedBatchDecode, infer/engine/capture.py).

Every forward in which each sequence of a paged pool feeds one token runs as
one graph per batch-size bucket and table width: keys written to pool rows
given as data (``scatter_rows``), attention through block tables and lengths
given as data (``batched_paged_attention``), padding rows on the pool's
scratch block. Tiny random models decode batches of requests twice, eagerly
and through the step, on numpy (uncompiled: the static ops as they are; and
recorded as one program of its C kernels), torch/cpu (``torch.compile``) and
mlx/cpu (``mx.compile``): the tokens must be identical, the step's logits
agree with the eager forward's within ``COMPILED_RTOL`` of the largest logit
(test_captured_decode.py argues it: products over a padded batch may round
differently), and the graphs are one per batch bucket, not one per step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from infer.backends import numpy as numpy_backend
from reference import (
    LOGIT_RTOL,
    assert_logits_close,
    backend_params,
    encode,
    tiny_model_dir,
)

import infer
from infer.engine.capture import CapturedBatchDecode, batch_bucket
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.kv.attention import AttentionContext, LayerArrays
from infer.ops import AttentionBatch

COMPILED_RTOL = 2 * LOGIT_RTOL
HAS_PROGRAMS = hasattr(numpy_backend._affine, "run_plan")
#: (backend, compiled): torch with torch.compile (not torch/cpu's default program, which is numpy's, tested here too).
STEPS = [pytest.param("numpy", False, id="numpy-static"),
         pytest.param("numpy", True, id="numpy-program", marks=pytest.mark.skipif(not HAS_PROGRAMS, reason="no C kernels")),
         *(pytest.param(p.values[0], True, marks=p.marks, id=f"{p.values[0]}-compiled")
           for p in backend_params("torch:cpu", "mlx:cpu"))]
PROMPTS = ["The capital of France is", "Once upon a time there was", "a b c d e f g h i j k l m n o p q r s",
           "The capital of France is"]  # the last shares the first's prompt: its full blocks come from the prefix cache
#: New tokens per request: the running batch goes 4, 3, 2, 1 (buckets 4, 4, 2, 1: three graphs).
NEW_TOKENS = [20, 26, 32, 40]


def _model(variant: str, backend: str, compiled: bool) -> infer.Model:
    model = infer.load(tiny_model_dir(variant), backend=backend, dtype="float32", compile=False)
    # torch.compile for the captured steps, as compile=True asks, on this model's own backend instance
    compiler = compiled and backend.startswith("torch")
    model.backend.settings = dataclasses.replace(model.backend.settings, compile=compiler)
    return model


def _run_batch(model: infer.Model, variant: str, sampling: SamplingParams | None = None) -> list[list[int]]:
    batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
    ids = [encode(tiny_model_dir(variant), p) for p in PROMPTS]
    handles = [batch.submit(p, sampling or SamplingParams(), StopConditions(max_tokens=n, ignore_eos=True))
               for p, n in zip(ids, NEW_TOKENS)]
    batch.run_until_done()
    return [h.tokens for h in handles]


@pytest.mark.parametrize("backend,compiled", STEPS)
@pytest.mark.parametrize("variant", ["llama3", "gemma3", "gemma3_softcap"])
def test_batched_decode_steps_give_the_eager_tokens_in_a_graph_per_batch_bucket(
        backend: str, compiled: bool, variant: str) -> None:
    # Sliding windows and their pages (gemma3), soft-capped attention (gemma3_softcap).
    model = _model(variant, backend, compiled)
    want = _run_batch(model, variant)
    model.engine.capture_decode(compile=compiled)
    step = model.engine.batch_step
    assert isinstance(step, CapturedBatchDecode)
    got = _run_batch(model, variant)
    assert got == want
    assert step.reason is None, step.reason
    # Every decode step after the four prefills: batches of 4, 3, 2 and 1 sequences.
    assert step.steps == max(NEW_TOKENS) - 1 and step.rows == sum(NEW_TOKENS) - len(NEW_TOKENS)
    if compiled:
        assert step.graphs == len({batch_bucket(n) for n in (4, 3, 2, 1)}) == 3, f"{step.graphs} graphs"
    assert model.engine.decode_step is not None and model.engine.decode_step.steps == 0  # that one is for contiguous


@pytest.mark.parametrize("backend,compiled", STEPS[:2])
def test_sampled_batches_sample_from_the_steps_logits(backend: str, compiled: bool) -> None:
    """The step hands every sequence's logits to the engine's samplers: seeded
    sampling draws the eager run's tokens (numpy: the same C kernels)."""
    model = _model("llama3", backend, compiled)
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    want = _run_batch(model, "llama3", sampling)
    model.engine.capture_decode(compile=compiled)
    assert _run_batch(model, "llama3", sampling) == want
    assert model.engine.batch_step.steps > 0


@pytest.mark.parametrize("backend,compiled", STEPS)
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_the_batched_step_gives_the_eager_logits(backend: str, compiled: bool, variant: str) -> None:
    """Three sequences of different lengths (a padding row in the bucket of
    4), several steps: the step's logits against the eager forward's, the
    sequences' caches rolled back in between."""
    model = _model(variant, backend, compiled)
    engine, ops = model.engine, model.backend
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    step = CapturedBatchDecode(model.network, ops, engine.max_context, compile=compiled)
    prompts = [encode(tiny_model_dir(variant), p) for p in PROMPTS[:3]]
    seqs = [engine.new_sequence(256, kv_pool=pool) for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        engine.forward(seq, prompt)
    for tokens in ([5, 17, 2], [40, 9, 33], [1, 2, 3], [7, 7, 7]):
        eager = ops.to_numpy(engine.run(engine.prepare(seqs, [[t] for t in tokens])).logits)
        for seq in seqs:
            engine.truncate(seq, seq.cached - 1)
        batch = engine.prepare(seqs, [[t] for t in tokens])  # reserves the positions, as the runner does
        logits = step([s.cache for s in seqs], [[t] for t in tokens])
        assert logits is not None, step.reason
        for seq, t in zip(seqs, tokens):
            seq.cache.commit([t])
            seq.tokens.append(t)
        assert len(batch.seqs) == 3 and ops.shape(logits) == (3, model.network.vocab_size)
        assert_logits_close(np.asarray(ops.to_numpy(logits), np.float32), np.asarray(eager, np.float32),
                            f"batched step vs eager, tokens {tokens}", rtol=COMPILED_RTOL)
    for seq in seqs:
        engine.release(seq)


@pytest.mark.parametrize("backend,compiled", STEPS[1:])
def test_the_step_does_not_recompile_per_token(backend: str, compiled: bool) -> None:
    """Two sequences decoding 64 steps: one graph for all of them."""
    model = _model("llama3", backend, compiled)
    model.engine.capture_decode(compile=compiled)
    engine, step = model.engine, model.engine.batch_step
    pool = engine.new_kv_pool(block_size=8, num_blocks=64)
    seqs = [engine.new_sequence(256, kv_pool=pool) for _ in range(2)]
    for seq, prompt in zip(seqs, PROMPTS[:2]):
        engine.forward(seq, encode(tiny_model_dir("llama3"), prompt))
    prompts = step.steps  # the prompts' forwards are captured steps too (a graph per prompt bucket)
    graphs = step.graphs
    tokens = [3, 4]
    for _ in range(64):
        out = engine.run(engine.prepare(seqs, [[t] for t in tokens]))
        tokens = [int(t) for t in out.argmax()]
    assert step.steps == prompts + 64 and step.graphs == (graphs or 0) + 1, \
        f"{step.graphs} graphs for {step.steps} steps: it recompiles"


def test_mixed_steps_are_captured_and_what_the_step_does_not_serve_runs_eagerly() -> None:
    """Prompt chunks, verification rows and decode rows of one pool, in any mix,
    are one captured step; a sequence's first forward (no layer arrays yet), a
    contiguous cache, two pools, or a forward wanting hidden states run eagerly."""
    model = _model("llama3", "numpy", HAS_PROGRAMS)
    model.engine.capture_decode(compile=HAS_PROGRAMS)
    engine, step = model.engine, model.engine.batch_step
    pool = engine.new_kv_pool(block_size=4, num_blocks=32)
    prompt = encode(tiny_model_dir("llama3"), PROMPTS[0])
    seq = engine.new_sequence(64, kv_pool=pool)
    # A sequence's first forward: the pool has no layer arrays yet (their shapes come from the first write).
    assert step([seq.cache], [[prompt[0]]]) is None and seq.cached == 0
    engine.forward(seq, prompt)
    assert step.steps == 0
    engine.forward(seq, [3, 4])  # speculative verification's shape: two rows of one sequence
    assert step.steps == 1 and step.mixed == 1
    contiguous = engine.new_sequence(64)
    engine.forward(contiguous, prompt)
    engine.run(engine.prepare([seq, contiguous], [[5], [5]]))  # a contiguous cache in the batch
    assert step.steps == 1
    engine.run(engine.prepare([seq], [[6]]))
    assert step.steps == 2 and step.reason is None
    # Two pools in one forward: eager.
    other = engine.new_sequence(64, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=32))
    engine.forward(other, prompt)
    engine.run(engine.prepare([seq, other], [[7], [7]]))
    assert step.steps == 2
    engine.run(engine.prepare([seq], [[8]], capture_hidden=True))  # multi-token prediction wants hidden states
    assert step.steps == 2
    for s in (seq, contiguous, other):
        engine.release(s)


@pytest.mark.parametrize("backend,compiled", STEPS)
def test_four_decoding_sequences_and_a_prompt_chunk_are_one_captured_step(backend: str, compiled: bool) -> None:
    """The batch engine's mixed step: 4 sequences decoding one token each and a
    fifth's prompt chunk, in one forward, one graph, the eager logits."""
    model = _model("llama3", backend, compiled)
    engine, ops = model.engine, model.backend
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    prompts = [encode(tiny_model_dir("llama3"), p) for p in PROMPTS]
    seqs = [engine.new_sequence(128, kv_pool=pool) for _ in range(5)]
    for seq, prompt in zip(seqs[:4], prompts):
        engine.forward(seq, prompt)
    engine.forward(seqs[4], prompts[2][:3])  # the fifth has the start of its prompt cached
    chunk = prompts[2][3:10]
    feeds = [[5], [17], [2], [40], chunk]
    eager = ops.to_numpy(engine.run(engine.prepare(seqs, feeds)).logits)
    for seq, feed in zip(seqs, feeds):
        engine.truncate(seq, seq.cached - len(feed))
    engine.capture_decode(compile=compiled)
    step = engine.batch_step
    out = engine.run(engine.prepare(seqs, feeds))
    assert step.steps == 1 and step.mixed == 1 and step.reason is None, step.describe()
    if step.graphs is not None:
        assert step.graphs == 1
    assert_logits_close(np.asarray(ops.to_numpy(out.logits), np.float32), np.asarray(eager, np.float32),
                        "mixed captured step vs eager", rtol=COMPILED_RTOL)
    for seq in seqs:
        engine.release(seq)


def test_padding_rows_use_the_scratch_block_only() -> None:
    """A batch of 3 in the bucket of 4: the padding row writes to the scratch
    block and reads only it, and the step's inputs say so."""
    model = _model("llama3", "numpy", False)
    engine = model.engine
    pool = engine.new_kv_pool(block_size=4, num_blocks=16)
    step = CapturedBatchDecode(model.network, model.backend, engine.max_context, compile=False)
    seqs = [engine.new_sequence(64, kv_pool=pool) for _ in range(3)]
    for i, seq in enumerate(seqs):
        engine.forward(seq, list(range(1, 4 + 3 * i)))
    engine.prepare(seqs, [[1]] * 3)
    host = step.inputs([s.cache for s in seqs], [[1], [2], [3]], None)
    ids, positions, slots, tables, lengths = host.ids, host.positions, host.slots, host.tables, host.lengths
    # 3 tokens padded to 4: the padding row is a fourth sequence on the scratch block.
    assert ids.tolist() == [1, 2, 3, 0] and lengths.tolist() == [4, 7, 10, 1]
    assert positions.tolist() == [3, 6, 9, 0] and host.query_start.tolist() == [0, 1, 2, 3, 4]
    scratch = pool.scratch_block
    assert slots[3] == scratch * 4 and set(tables[3].tolist()) == {scratch}
    for i, seq in enumerate(seqs):
        blocks = seq.cache.table.blocks
        assert slots[i] == blocks[positions[i] // 4] * 4 + positions[i] % 4
        assert tables[i, :len(blocks)].tolist() == blocks and scratch not in blocks
    before = [np.array(a) for a in pool.layer_rows(model.network.num_layers)[0]]
    step([s.cache for s in seqs], [[1], [2], [3]])
    after = pool.layer_rows(model.network.num_layers)[0]
    written = {int(s) for s in slots[:3]} | set(range(scratch * 4, scratch * 4 + 4))
    for b, a in zip(before, after):
        changed = {int(r) for r in np.nonzero(np.any(b != a, axis=(1, 2)))[0]}
        assert changed <= written and changed & {int(s) for s in slots[:3]}
    for seq in seqs:
        engine.release(seq)


def test_the_static_context_refuses_host_reads_of_the_length() -> None:
    model = _model("llama3", "numpy", False)
    ops = model.backend
    zero = ops.from_numpy(np.zeros(1, np.int32))
    batch = AttentionBatch(ops.from_numpy(np.array([0, 1], np.int32)), ops.from_numpy(np.ones(1, np.int32)),
                           ops.from_numpy(np.zeros((1, 1), np.int32)), 4, 1)
    ctx = AttentionContext.static(ops, LayerArrays([], [], 4), zero, zero, batch, tokens=1)
    with pytest.raises(infer.errors.CaptureError, match="max_position"):
        ctx.max_position  # noqa: B018 - the read is the test


def test_speculative_batches_decode_the_eager_tokens() -> None:
    """Requests verifying drafts (several rows each) run their forwards
    eagerly, one-token forwards of the others and of a paged draft model are
    captured: the tokens are the uncaptured run's."""
    from infer.engine.speculative import DraftModelSource, NGramDraft, Speculation

    target = _model("llama3", "numpy", HAS_PROGRAMS)
    draft = _model("llama3", "numpy", HAS_PROGRAMS)
    draft.engine.kv_pool = draft.engine.new_kv_pool(block_size=4, num_blocks=64)
    ids = [encode(tiny_model_dir("llama3"), p) for p in PROMPTS[:3]]

    def run() -> list[list[int]]:
        batch = target.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
        specs = [Speculation(NGramDraft(), 3), Speculation(DraftModelSource(draft.engine, target.network.vocab_size), 3),
                 None]
        handles = [batch.submit(p, SamplingParams(), StopConditions(max_tokens=n, ignore_eos=True), spec)
                   for p, n, spec in zip(ids, (12, 12, 30), specs)]
        batch.run_until_done()
        return [h.tokens for h in handles]

    want = run()
    target.engine.capture_decode(compile=HAS_PROGRAMS)
    draft.engine.capture_decode(compile=HAS_PROGRAMS)
    assert run() == want
    assert target.engine.batch_step.steps > 0 and target.engine.batch_step.reason is None  # the last request alone
    assert draft.engine.batch_step.steps > 0  # the draft model's one-token forwards


def test_multi_token_prediction_runs_its_forwards_eagerly_with_the_same_tokens() -> None:
    """MTP needs every row's hidden states: its forwards are not the step's
    (DeepSeek-V3 is mixture-of-experts besides, whose routing reads the host)."""
    from test_deepseek_v3 import mtp_model_dir

    from infer.engine.speculative import MTPDraft, Speculation

    path = mtp_model_dir()
    model = infer.load(path, backend="numpy", dtype="float32", compile=False)
    ids = encode(path, PROMPTS[0])

    def run() -> list[int]:
        batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
        handle = batch.submit(ids, SamplingParams(), StopConditions(max_tokens=10, ignore_eos=True),
                              Speculation(MTPDraft(model.engine), 1))
        batch.run_until_done()
        return handle.tokens

    want = run()
    model.engine.capture_decode(compile=HAS_PROGRAMS)
    assert run() == want
    step = model.engine.batch_step
    assert step.steps == 0


@pytest.mark.skipif(not HAS_PROGRAMS, reason="no C kernels")
def test_batches_past_the_backends_capture_batch_run_as_several_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy's programs take its kernel rows (16) at a time; 2 here, so that 4 requests are two steps of 2.
    monkeypatch.setattr(numpy_backend.NumpyBackend, "max_capture_tokens", 2)
    model = _model("llama3", "numpy", True)
    want = _run_batch(model, "llama3")
    model.engine.capture_decode()
    assert _run_batch(model, "llama3") == want
    step = model.engine.batch_step
    assert step.reason is None and step.steps == max(NEW_TOKENS) - 1
    assert step.graphs == 2  # the buckets of 2 and 1: a batch of 3 is 2 + 1


@pytest.mark.skipif(not HAS_PROGRAMS, reason="no C kernels")
def test_a_shape_refused_after_the_first_step_runs_eagerly_alone() -> None:
    model = _model("llama3", "numpy", True)
    want = _run_batch(model, "llama3")
    model.engine.capture_decode()
    step = model.engine.batch_step
    real = step._fn

    def refusing(ids, positions, slots, query_start, *args):  # type: ignore[no-untyped-def]
        if model.backend.shape(ids)[0] == 2 and model.backend.shape(query_start)[0] == 3:  # two decode rows
            raise infer.errors.CaptureError("no graph for two rows here")
        return real(ids, positions, slots, query_start, *args)

    step._fn = refusing
    assert _run_batch(model, "llama3") == want
    assert step.reason is None and list(step.refused) == [(2, 2, 64, 2, 1)]
    assert "2 tokens x 2 sequences x 64 blocks eager (CaptureError: no graph for two rows here)" in step.describe()
