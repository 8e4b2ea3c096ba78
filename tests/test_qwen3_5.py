"""Qwen3.5 and Qwen3-Next beyond the family kit (tests/test_families.py runs their parity).

How config.json is read (the nested ``Qwen3_5ForConditionalGeneration`` form, the
defaults transformers fills in), the errors for what is not supported, and the
DeltaNet layers' recurrent state through the engine's features: prefix hits,
forks, speculative rollback and a preempting batch, each against recomputing
without a cache (one fresh forward over the whole sequence).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import assert_logits_close, encode, load_tiny, reference_logits, tiny_model_dir

import infer
from infer.engine import Engine
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.engine.speculative import NGramDraft, Speculation
from infer.errors import ConfigError
from infer.kv.attention import FullAttention, Recurrent

PROMPT = "The capital of France is Paris. Once upon a time"
GREEDY = SamplingParams()


def _copy(path: Path, out: Path, config: dict[str, Any], rename: Any = None, extra: dict[str, Any] | None = None) -> Path:
    """``path`` with ``config`` as config.json and its tensors renamed by ``rename``."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    for f in path.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    if rename is not None:
        tensors = {rename(name): value for name, value in tensors.items()}
    save_file({**tensors, **(extra or {})}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _logits(folder: Path, ids: list[int]) -> np.ndarray:
    model = infer.load(folder, backend="numpy")
    return model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe"])
def test_the_text_half_of_a_conditional_generation_checkpoint(tmp_path: Path, variant: str) -> None:
    # Qwen3_5ForConditionalGeneration's config.json nests the text model's under text_config and keeps
    # tie_word_embeddings at the top; its weights sit under model.language_model. beside model.visual.
    # (A checkpoint without the tower's patch embedding is read as its text half alone.)
    path = tiny_model_dir(variant)
    text = json.loads((path / "config.json").read_text())
    config = {"model_type": variant, "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {**text, "tie_word_embeddings": True}, "tie_word_embeddings": False,
              "vision_config": {"model_type": variant + "_vision", "depth": 1}}
    folder = _copy(path, tmp_path / "vl", config, lambda n: n.replace("model.", "model.language_model.", 1),
                   {"model.visual.blocks.0.norm1.weight": np.zeros((4,), np.float32)})
    ids = encode(path, PROMPT)
    assert_logits_close(_logits(folder, ids), reference_logits(path, ids, [])["prefill"], f"{variant} nested")


def test_layer_types_and_rotary_factor_default_as_in_transformers(tmp_path: Path) -> None:
    # Without layer_types every full_attention_interval-th layer is full attention; without a
    # partial_rotary_factor a quarter of each head rotates.
    path = tiny_model_dir("qwen3_5_interval")
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
    del config["layer_types"]
    config["full_attention_interval"] = 2
    folder = _copy(path, tmp_path / "interval", config)
    ids = encode(path, PROMPT)
    assert_logits_close(_logits(folder, ids), reference_logits(path, ids, [])["prefill"], "qwen3_5 interval")
    path = tiny_model_dir("qwen3_5")
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"].pop("partial_rotary_factor") == 0.25
    # The released configs' multimodal rope settings: text positions are equal on the three axes.
    config["rope_parameters"].update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    folder = _copy(path, tmp_path / "rotary", config)
    ids = encode(path, PROMPT)
    assert_logits_close(_logits(folder, ids), reference_logits(path, ids, [])["prefill"], "qwen3_5 rotary")


@pytest.mark.parametrize(("edit", "message"), [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
     "sliding_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 4 layers"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
])
def test_unsupported_configs_are_named(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    path = tiny_model_dir("qwen3_5")
    config = {**json.loads((path / "config.json").read_text()), **edit}
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        infer.load(folder, backend="numpy")


def test_layer_states() -> None:
    network = load_tiny("qwen3_5").network
    states = network.layer_states()
    assert isinstance(states[2], FullAttention)
    assert states[0] == Recurrent({"conv": (2, 2 * 16 + 48), "ssm": (4, 8, 12)})


# -- the recurrent state through the engine (as tests/test_recurrent_state.py, on the real layers)


@pytest.fixture(scope="module", params=[("qwen3_5", "numpy"), ("qwen3_next", "numpy"), ("qwen3_5", "torch:cpu")],
                ids=lambda p: "-".join(p))
def engine(request: pytest.FixtureRequest) -> Engine:
    pytest.importorskip("torch") if request.param[1] != "numpy" else None
    model = load_tiny(*request.param)
    return Engine(model.network, model.backend)  # its own state store: the slot counts below are this test's


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


TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, 380, 37)]


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert_logits_close(got, want, what)


def test_prefix_hit_fork_and_rollback(engine: Engine) -> None:
    pool = engine.new_kv_pool(block_size=4, num_blocks=32)
    want = full_logits(engine, TOKENS)
    first = engine.new_sequence(64, kv_pool=pool)
    engine.forward(first, TOKENS[:30])
    engine.release(first)
    hit = engine.new_sequence(64, kv_pool=pool)
    reused = hit.cache.reuse_prefix(TOKENS[:-1])
    assert reused == 28
    hit.tokens = TOKENS[:reused]
    close(engine.backend.to_numpy(engine.forward(hit, TOKENS[reused:], all_logits=True)), want[reused:], "hit")
    fork = type(hit)(tokens=list(hit.tokens), cache=hit.cache.fork())
    tail = [11, 50, 7]
    close(engine.backend.to_numpy(engine.forward(fork, tail, all_logits=True)),
          full_logits(engine, TOKENS + tail)[len(TOKENS):], "fork")
    engine.forward(hit, TOKENS[:6], all_logits=True)  # six drafts verified; three accepted
    engine.truncate(hit, len(TOKENS) + 3)
    rest = [9, 8, 7, 6]
    close(engine.backend.to_numpy(engine.forward(hit, rest, all_logits=True)),
          full_logits(engine, TOKENS + TOKENS[:3] + rest)[len(TOKENS) + 3:], "rollback")
    for s in (hit, fork):
        engine.release(s)
    assert pool.stats().used == 0 and engine.state_store.slots_held() == 0


def test_a_batch_preempts_prefix_caches_and_speculates(engine: Engine) -> None:
    prompts = [TOKENS[:9], TOKENS[:9] + [3, 4], TOKENS[10:17], [5, 6, 7, 8, 5, 6, 7]]
    want = [greedy_alone(engine, p, 8) for p in prompts]
    batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=12))
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    handles = [batch.submit(p, GREEDY, stop, Speculation(NGramDraft(), 3) if i == 3 else None)
               for i, p in enumerate(prompts)]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want
    assert batch.pool.stats().used == 0 and engine.state_store.slots_held() == 0
    assert list(generate(engine, prompts[3], GREEDY, stop, Speculation(NGramDraft(), 4))) == want[3]


def test_long_runs_between_checkpoints_on_torch() -> None:
    # Blocks of 16: torch's op runs the rows between checkpoints in the chunked form, and the
    # checkpoint after row 32 restarts a prefix hit exactly.
    pytest.importorskip("torch")
    model = load_tiny("qwen3_5", "torch:cpu")
    engine = Engine(model.network, model.backend)
    tokens = TOKENS + TOKENS[:10]  # 47
    want = full_logits(engine, tokens)
    pool = engine.new_kv_pool(block_size=16, num_blocks=8)
    first = engine.new_sequence(64, kv_pool=pool)
    close(engine.backend.to_numpy(engine.forward(first, tokens[:40], all_logits=True)), want[:40], "chunked runs")
    engine.release(first)
    hit = engine.new_sequence(64, kv_pool=pool)
    assert hit.cache.reuse_prefix(tokens[:-1]) == 32
    hit.tokens = tokens[:32]
    close(engine.backend.to_numpy(engine.forward(hit, tokens[32:], all_logits=True)), want[32:], "hit at 32")
    engine.release(hit)


def test_a_checkpoint_transformers_saves_as_conditional_generation(tmp_path: Path) -> None:
    # What Qwen3_5ForConditionalGeneration.save_pretrained writes (a tiny vision tower beside the text
    # model, transformers' own init): the text model's logits equal transformers' on text input.
    import torch
    import transformers

    text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    torch.manual_seed(0)
    reference = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    reference.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir("qwen3_5") / f, tmp_path / f)
    ids = [5, 6, 7, 8, 9, 10, 11, 200, 300]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(_logits(tmp_path, ids), want, "Qwen3_5ForConditionalGeneration")
