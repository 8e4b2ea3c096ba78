"""Mamba2 (no attention layer at all) through the engine's features, and its config checks.

A model of recurrent layers only leaves the KV pool nothing to store: blocks
still number the positions (a prefix hit needs them and a state checkpoint),
but no key or value array is ever made. Each test compares with recomputing
without a cache, as tests/test_recurrent_state.py does for its EMA layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from reference import load_tiny, tiny_model_dir

import infer
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.errors import ConfigError

GREEDY = SamplingParams()
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 300, 29)]


@pytest.fixture(scope="module")
def engine() -> Engine:
    # An engine of its own: the shared tiny model's may hold other tests' sequences.
    model = load_tiny("mamba2")
    return Engine(model.network, model.backend)


def full_logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    seq = engine.new_sequence(len(tokens) + 1)
    logits = engine.backend.to_numpy(engine.forward(seq, tokens, all_logits=True))
    engine.release(seq)
    return logits


def greedy_alone(engine: Engine, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(full_logits(engine, tokens)[-1])))
    return tokens[len(prompt):]


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


def test_every_layer_is_recurrent(engine: Engine) -> None:
    from infer.kv.attention import Recurrent

    specs = engine.model.layer_states()
    assert len(specs) == 2 and all(isinstance(s, Recurrent) for s in specs)
    assert dict(specs[0].arrays) == {"conv": (3, 128 + 2 * 16), "ssm": (8, 16, 16)}


def test_a_paged_pool_of_no_keys_carries_prefix_hits_and_rollback(engine: Engine) -> None:
    pool = engine.new_kv_pool(block_size=4, num_blocks=16)
    want = full_logits(engine, PROMPT)
    first = engine.new_sequence(64, kv_pool=pool)
    engine.forward(first, PROMPT[:22])
    engine.release(first)
    hit = engine.new_sequence(64, kv_pool=pool)
    reused = hit.cache.reuse_prefix(PROMPT[:-1])
    assert reused == 20
    hit.tokens = PROMPT[:reused]
    close(engine.backend.to_numpy(engine.forward(hit, PROMPT[reused:], all_logits=True)), want[reused:])
    engine.truncate(hit, 13)  # back to a checkpoint, the tokens after it replayed
    close(engine.backend.to_numpy(engine.forward(hit, PROMPT[13:], all_logits=True)), want[13:])
    engine.release(hit)
    assert pool.stats().used == 0 and engine.state_store.slots_held() == 0


def test_a_batch_preempts_and_speculates(engine: Engine) -> None:
    prompts = [PROMPT[:9], PROMPT[:9] + [3, 4], [5, 6, 7, 8, 5, 6, 7, 8, 5]]
    want = [greedy_alone(engine, p, 8) for p in prompts]
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=8))
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    handles = [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if i == 2 else None)
               for i, p in enumerate(prompts)]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.pool.stats().used == 0 and engine.state_store.slots_held() == 0
    assert list(generate(engine, prompts[2], GREEDY, stop, Speculation(NGramDraft(), 4))) == want[2]


def _edited(tmp_path: Path, **edit: object) -> Path:
    path = tiny_model_dir("mamba2")
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **edit}))
    return out


@pytest.mark.parametrize(("edit", "match"), [
    ({"num_heads": 4}, "hidden_size \\* expand \\(128\\) must equal num_heads \\* head_dim \\(64\\)"),
    ({"n_groups": 3}, "multiple of n_groups"),
    ({"hidden_act": "relu6"}, "hidden_act 'relu6'"),
    ({"time_step_limit": [0.5]}, "time_step_limit"),
])
def test_a_bad_config_names_the_field(tmp_path: Path, edit: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        infer.load(_edited(tmp_path, **edit), backend="numpy")


# -- Granite 4.0-H: Mamba2 and attention layers in one forward -------------------------------


@pytest.fixture(scope="module")
def hybrid() -> Engine:
    model = load_tiny("granitemoehybrid")
    return Engine(model.network, model.backend)


def test_the_hybrid_declares_each_layer_its_kind(hybrid: Engine) -> None:
    from infer.kv.attention import FullAttention, Recurrent

    kinds = [type(s) for s in hybrid.model.layer_states()]
    assert kinds == [Recurrent, FullAttention, Recurrent, FullAttention]


def test_the_hybrid_batches_prefix_caches_and_speculates(hybrid: Engine) -> None:
    pool = hybrid.new_kv_pool(block_size=4, num_blocks=24)
    want = full_logits(hybrid, PROMPT)
    first = hybrid.new_sequence(64, kv_pool=pool)
    hybrid.forward(first, PROMPT[:22])
    hybrid.release(first)
    hit = hybrid.new_sequence(64, kv_pool=pool)
    reused = hit.cache.reuse_prefix(PROMPT[:-1])
    assert reused == 20
    hit.tokens = PROMPT[:reused]
    close(hybrid.backend.to_numpy(hybrid.forward(hit, PROMPT[reused:], all_logits=True)), want[reused:])
    hybrid.release(hit)
    prompts = [PROMPT[:9], PROMPT[:9] + [3, 4], [5, 6, 7, 8, 5, 6, 7, 8, 5]]
    expected = [greedy_alone(hybrid, p, 6) for p in prompts]
    batch = BatchEngine(hybrid, kv_pool=pool)
    stop = StopConditions(max_tokens=6, ignore_eos=True)
    handles = [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if i == 2 else None)
               for i, p in enumerate(prompts)]
    batch.run_until_done()
    assert [h.tokens for h in handles] == expected
    assert batch.pool.stats().used == 0 and hybrid.state_store.slots_held() == 0


@pytest.mark.parametrize(("edit", "match"), [
    ({"layer_types": ["mamba", "sliding_attention", "mamba", "attention"]}, "layer_types holds 'sliding_attention'; supported: mamba"),
    ({"layer_types": ["mamba", "attention"]}, "layer_types has 2 entries for 4 layers"),
    ({"mamba_d_head": 12}, "mamba_n_heads \\(8\\) \\* mamba_d_head \\(12\\)"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok \\(5\\)"),
])
def test_a_bad_hybrid_config_names_the_field(tmp_path: Path, edit: dict, match: str) -> None:
    path = tiny_model_dir("granitemoehybrid")
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=match):
        infer.load(out, backend="numpy")


@pytest.mark.parametrize("variant", ["mamba2", "granitemoehybrid_dense"])
def test_tensor_parallelism_refuses_the_mixers_by_name(variant: str) -> None:
    pytest.importorskip("torch")
    from infer.errors import TensorParallelConfigError

    with pytest.raises(TensorParallelConfigError, match="Mamba2 mixers"):
        infer.load(tiny_model_dir(variant), backend="torch:cpu", tensor_parallel=2)
