"""Falcon-H1 beyond the shared family runner: the other norm order, the engine, the config.

tests/test_families.py checks the tiny variants against transformers; here the
gated norm's other order is checked against transformers too (an edited
config.json), the two cache layers per layer (keys and values, the mixer's
state) go through a ragged batch with prefix hits and n-gram speculation (every
answer must equal greedy decoding alone), and config.json is read as
transformers reads it or refused naming the key.
"""

from __future__ import annotations

import gc

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from reference import assert_logits_close, encode, load_tiny, reference_logits, tiny_model_dir

import infer
from infer.architectures.falcon_h1 import read_config
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.errors import ConfigError

GREEDY = SamplingParams()
PROMPT = "The capital of France is Paris. Once upon a time"


def _config(**edit: Any) -> Any:
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=8)
    return read_config({**base, **edit})


@pytest.mark.parametrize("backend", ["numpy", "torch:cpu"])
def test_the_gate_before_the_norm_matches_transformers(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("torch")
    path = tiny_model_dir("falcon_h1_norm")
    out = tmp_path / "gate_first"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mamba_norm_before_gate": False}))
    prompt, decode = encode(path, PROMPT), encode(path, " the quick brown fox")
    ref = reference_logits(out, prompt, decode)
    model = infer.load(out, backend=backend)
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence()
    assert_logits_close(ops.to_numpy(engine.forward(seq, prompt, all_logits=True)), ref["prefill"], "gate first")
    for step, (token, want) in enumerate(zip(decode, ref["decode"])):
        assert_logits_close(ops.to_numpy(engine.forward(seq, [token])[-1]), want, f"gate first, decode {step}")


@pytest.mark.parametrize("variant", ["falcon_h1", "falcon_h1_norm"])
def test_a_batch_with_prefix_hits_and_speculation_equals_greedy_alone(variant: str) -> None:
    model = load_tiny(variant)
    engine = Engine(model.engine.model, model.backend)  # its own state slots: other tests leave theirs held
    prompt = encode(tiny_model_dir(variant), PROMPT)
    prompts = [prompt, prompt + [5, 6], prompt[:13] + [7], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    want = [list(model.generate_tokens(p, max_tokens=8, ignore_eos=True)) for p in prompts]
    gc.collect()  # sequences earlier tests dropped give their state slots back (SequenceStates.__del__)
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=64))
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    first = batch.submit(prompts[0], GREEDY, stop)
    batch.run_until_done()  # its blocks and state checkpoints stay cached for the prefix hits below
    handles = [first] + [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if p[0] == 5 else None)
                         for p in prompts[1:]]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.stats.tokens_reused > 0
    assert batch.pool.stats().used == 0 and engine.state_store.slots_held() == 0


def test_each_layer_has_a_kv_cache_layer_and_a_state_layer() -> None:
    network = load_tiny("falcon_h1").network
    kinds = [type(s).__name__ for s in network.layer_states()]
    assert network.num_cache_layers == 6 and kinds == ["FullAttention"] * 3 + ["Recurrent"] * 3
    assert dict(network.layer_states()[3].arrays) == {"conv": (3, 96), "ssm": (8, 8, 8)}  # conv_dim 64 + 2 * 2 * 8


def test_config_nulls_and_defaults_as_in_transformers() -> None:
    assert _config(num_key_value_heads=None).num_key_value_heads == 4  # null: one per head
    assert _config().mamba_d_head == 8  # "auto": mamba_d_ssm / mamba_n_heads
    cfg = _config(mamba_d_ssm=None, mamba_expand=2)
    assert (cfg.mamba_d_ssm, cfg.mamba_d_head) == (128, 16)
    assert _config(head_dim=32).head_dim == 32 and _config().head_dim == 16
    assert _config(time_step_limit=[0.0, {"__float__": "Infinity"}]).time_step_limit == [0.0, float("inf")]


@pytest.mark.parametrize(("edit", "message"), [
    ({"mamba_d_head": 16}, "mamba_d_head"),
    ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ({"hidden_act": "relu2"}, "hidden_act"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers must hold 5"),
    ({"mlp_multipliers": [1.0]}, "mlp_multipliers must hold 2"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_bad_configs_name_the_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**edit)
