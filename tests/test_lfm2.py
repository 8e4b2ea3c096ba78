"""LFM2 beyond the shared family runner: its conv state through the batch engine, and its config.

tests/test_families.py checks the tiny variants against transformers; here the
conv layers' state goes through a ragged batch with prefix hits and n-gram
speculation (every answer must equal greedy decoding alone), and config.json is
read as transformers reads it (Liquid's names, ``full_attn_idxs``, the
feed-forward rule) or refused naming the key.
"""

from __future__ import annotations

import gc

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import encode, load_tiny, reference_logits, tiny_model_dir

import infer
from infer.architectures.lfm2 import Lfm2Config, read_config
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.errors import ConfigError

GREEDY = SamplingParams()


def _config(**edit: Any) -> Lfm2Config:
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    return read_config({**base, **edit})


@pytest.mark.parametrize("variant", ["lfm2", "lfm2_conv_bias"])
def test_a_batch_with_prefix_hits_and_speculation_equals_greedy_alone(variant: str) -> None:
    model = load_tiny(variant)
    engine = Engine(model.engine.model, model.backend)  # its own state slots: other tests leave theirs held
    prompt = encode(tiny_model_dir(variant), "The capital of France is Paris. Once upon a time")
    prompts = [prompt, prompt + [5, 6], prompt[:13] + [7], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    want = [list(model.generate_tokens(p, max_tokens=8, ignore_eos=True)) for p in prompts]
    gc.collect()  # sequences earlier tests dropped give their state slots back (SequenceStates.__del__)
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=64))
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    first = batch.submit(prompts[0], GREEDY, stop)
    batch.run_until_done()  # its blocks and conv checkpoints stay cached for the prefix hits below
    handles = [first] + [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if p[0] == 5 else None)
                         for p in prompts[1:]]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.stats.tokens_reused > 0
    assert batch.pool.stats().used == 0 and engine.state_store.slots_held() == 0


def test_liquid_config_names_are_read_as_transformers_reads_them(tmp_path: Path) -> None:
    # Liquid's configs give block_ff_dim, tie_embedding and full_attn_idxs (no layer_types).
    path = tiny_model_dir("lfm2")
    config = json.loads((path / "config.json").read_text())
    attn = [i for i, kind in enumerate(config.pop("layer_types")) if kind == "full_attention"]
    config.update(full_attn_idxs=attn, block_ff_dim=config.pop("intermediate_size"),
                  tie_embedding=config.pop("tie_word_embeddings"))
    out = tmp_path / "liquid"
    shutil.copytree(path, out)
    (out / "config.json").write_text(json.dumps(config))
    ids = encode(path, "The capital of France is Paris.")
    model = infer.load(out, backend="numpy")
    got = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))
    np.testing.assert_allclose(got, reference_logits(path, ids, [])["prefill"], rtol=1e-4, atol=1e-4)


def test_the_feed_forward_width_rule() -> None:
    assert _config(block_auto_adjust_ff_dim=False).ff_dim() == 128
    assert _config(block_multiple_of=256).ff_dim() == 256  # int(2 * 128 / 3) = 85, rounded up to 256
    assert _config(block_ffn_dim_multiplier=None).ff_dim() == 85  # no multiplier: no rounding either
    assert _config(intermediate_size=160, block_ffn_dim_multiplier=1.3, block_multiple_of=16).ff_dim() == 144
    assert _config(block_ff_dim=12288, intermediate_size=1).ff_dim() == 8192  # LFM2-1.2B's


def test_layer_kinds_default_as_in_transformers() -> None:
    assert _config().layer_types == ["full_attention"] * 4  # neither given: every layer attends
    assert _config(full_attn_idxs=[2]).layer_types == ["conv", "conv", "full_attention", "conv"]
    assert _config(full_attn_idxs=[2], layer_types=["conv"] * 4).layer_types == ["conv"] * 4


@pytest.mark.parametrize(("edit", "message"), [
    ({"layer_types": ["conv", "sliding_attention", "conv", "conv"]}, "'sliding_attention'"),
    ({"layer_types": ["conv"] * 3}, "layer_types has 3 entries for 4 layers"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"intermediate_size": 1}, "feed-forward width"),
])
def test_bad_configs_name_the_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**edit)
