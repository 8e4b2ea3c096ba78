"""The families on the shared decoder match transformers in float32, on numpy, torch and MLX.

One runner for every tiny variant of ``reference.FAMILY_VARIANTS`` (configs and what
each one varies: tests/reference.py, ``_FAMILIES``): prefill logits and decode steps
against transformers' cached decoding, greedy tokens against ``generate``, and
cached decoding in chunks against one full forward, on each backend. Tolerance:
``reference.LOGIT_RTOL * max|logit|`` (2.0e-5; float32 on both sides, different
summation orders; ``rounding_rtol`` in tests/reference.py derives it), and greedy
tokens may part only at a near-tie of the reference (``assert_greedy_equal``).

Each family's own knobs are shown to matter: the same checkpoint with one knob
switched (config.json edited, or the knob of the loaded network turned off) moves
the logits by more than 5 times that tolerance (``KNOBS``), so a family that
ignored it could not pass the parity tests. Most move them by 1e-2 or more; the
closest is GPT-2's tanh-approximated gelu against the exact one, 1.4e-4 (7 times).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import (
    FAMILY_VARIANTS,
    LOGIT_RTOL,
    assert_greedy_equal,
    assert_logits_close,
    encode,
    load_tiny,
    reference_greedy,
    reference_logits,
    tiny_model_dir,
)

import infer

PROMPT = "The capital of France is Paris. Once upon a time"
DECODE_TEXT = " the quick brown fox jumps over"
BACKENDS = ("numpy", "torch:cpu", "mlx:cpu")  # each test taking `backend` runs on each (tests/conftest.py)


@pytest.fixture(scope="module", params=FAMILY_VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


def test_prefill_and_decode_logits_match_transformers(variant: str, backend: str) -> None:
    path = tiny_model_dir(variant)
    prompt, decode = encode(path, PROMPT), encode(path, DECODE_TEXT)
    ref = reference_logits(path, prompt, decode)
    model = load_tiny(variant, backend)
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence()
    assert_logits_close(ops.to_numpy(engine.forward(seq, prompt, all_logits=True)), ref["prefill"],
                        f"{variant} {backend} prefill")
    for step, (token, want) in enumerate(zip(decode, ref["decode"])):
        assert_logits_close(ops.to_numpy(engine.forward(seq, [token])[-1]), want, f"{variant} {backend} decode {step}")


def test_greedy_tokens_match_transformers(variant: str, backend: str) -> None:
    path = tiny_model_dir(variant)
    prompt = encode(path, PROMPT)
    want = reference_greedy(path, prompt, 16)
    got = list(load_tiny(variant, backend).generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    ref = reference_logits(path, prompt, want[:-1])  # the logits generate() chose from, step by step
    assert_greedy_equal(got, want, np.stack([ref["prefill"][-1], *ref["decode"]]), LOGIT_RTOL, f"{variant} {backend}")


def test_cached_decode_equals_full_forward(variant: str, backend: str) -> None:
    if variant == "phi3_longrope":
        # LongRoPE picks its factors per forward from the sequence length: a first chunk shorter than
        # the original length is rotated with the short factors, one full pass with the long ones
        # (in transformers' forward as here).
        pytest.skip("longrope: a chunk within the original length uses other factors than the full pass")
    path = tiny_model_dir(variant)
    ids = encode(path, PROMPT + DECODE_TEXT)
    model = load_tiny(variant, backend)
    engine, ops = model.engine, model.backend
    full = ops.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))
    seq = engine.new_sequence()
    rows = [ops.to_numpy(engine.forward(seq, ids[:5], all_logits=True))]
    rows += [ops.to_numpy(engine.forward(seq, ids[start:start + 3], all_logits=True)) for start in (5, 8)]
    rows += [ops.to_numpy(engine.forward(seq, [t], all_logits=True)) for t in ids[11:]]
    assert_logits_close(np.concatenate(rows), full, f"{variant} {backend} cached vs full")


def test_longrope_uses_the_short_factors_within_the_original_length() -> None:
    # phi3_longrope: original length 20. 16 tokens rotate with the short factors (against
    # transformers), and those rows differ from the same rows in a 35-token pass (long factors).
    path = tiny_model_dir("phi3_longrope")
    ids = encode(path, PROMPT + DECODE_TEXT)
    model = load_tiny("phi3_longrope")
    engine, ops = model.engine, model.backend
    short = ops.to_numpy(engine.forward(engine.new_sequence(), ids[:16], all_logits=True))
    assert_logits_close(short, reference_logits(path, ids[:16], [])["prefill"], "longrope, short factors")
    long = ops.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))[:16]
    assert np.abs(long - short).max() > 100 * LOGIT_RTOL * np.abs(short).max()


def test_phi3_reads_longrope_under_its_first_name_su(tmp_path: Path) -> None:
    path = tiny_model_dir("phi3_longrope")
    config = json.loads((path / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    edited = _edited(path, tmp_path, {"rope_parameters": None, "rope_theta": 10000.0,
                                      "rope_scaling": {**rope, "type": "su"}})
    ids = encode(path, PROMPT)
    model = infer.load(edited, backend="numpy")
    got = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))
    assert_logits_close(got, reference_logits(path, ids, encode(path, DECODE_TEXT))["prefill"], "phi3, su")


# ----------------------------------------------------------------------------- the knobs matter


def _edited(path: Path, tmp: Path, edit: dict[str, Any]) -> Path:
    """The folder ``path`` with config.json updated by ``edit`` (other files linked)."""
    out = tmp / "edited"
    out.mkdir()
    for f in path.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def _no_qk_norm(model: infer.Model) -> None:
    for layer in model.network.layers:
        layer.block.attention.qk_norm = False


def _gemma4_layers(change: Callable[[Any], None]) -> Callable[[infer.Model], None]:
    def edit(model: infer.Model) -> None:
        for layer in model.network.layers:
            change(layer)
    return edit


def _gemma4_no_ple(model: infer.Model) -> None:
    model.network.ple_dim = 0
def _lfm2_no_qk_norm(model: infer.Model) -> None:
    for layer in model.network.layers:
        if layer.kind == "attention":
            layer.block.attention.qk_norm = False


def _lfm2_no_conv_bias(model: infer.Model) -> None:
    for layer in model.network.layers:
        if layer.kind == "conv":
            for name in ("in_proj.bias", "conv.bias", "out_proj.bias"):
                del layer.weights[name]
def _no_sinks(model: infer.Model) -> None:
    for layer in model.network.layers:
        layer.sinks = None
def _mamba2_norm(**change: Any) -> Callable[[infer.Model], None]:
    def switch(model: infer.Model) -> None:
        for name, value in change.items():
            setattr(model.network.mixer, name, value)
    return switch
def _no_attention_gate(model: infer.Model) -> None:
    model.network.attention.gated = False


#: variant -> (what is switched, a config.json edit or a change to the loaded model).
KNOBS: dict[str, list[tuple[str, dict[str, Any] | Callable[[infer.Model], None]]]] = {
    "qwen3": [("per-head q/k norms off", _no_qk_norm)],
    "qwen3_bias": [("sliding window off", {"use_sliding_window": False, "layer_types": None}),
                   ("biases off", {"attention_bias": False})],
    "mixtral": [("top-1 routing", {"num_experts_per_tok": 1}), ("sliding window off", {"sliding_window": None})],
    "mixtral_top3": [("top-2 routing", {"num_experts_per_tok": 2})],
    "qwen3_moe": [("top-k weights not renormalised", {"norm_topk_prob": False})],
    "qwen3_moe_sparse_step": [("top-k weights renormalised", {"norm_topk_prob": True})],
    "phi3": [("full rotary", {"partial_rotary_factor": 1.0, "rope_parameters": {"partial_rotary_factor": 1.0}})],
    "phi3_longrope": [("short factors throughout",
                       {"rope_parameters": {"long_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]}}),
                      ("no attention factor", {"rope_parameters": {"attention_factor": 1.0}})],
    "olmo2": [("q/k norms off", _no_qk_norm)],
    "smollm3": [("rope on every layer", {"no_rope_layers": [1, 1, 1, 1]})],
    "smollm3_pattern": [("sliding window off", {"use_sliding_window": False})],
    "granite": [(f"{knob} 1", {knob: 1.0}) for knob in
                ("embedding_multiplier", "residual_multiplier", "logits_scaling")]
    + [("softmax scale head_dim ** -0.5", {"attention_multiplier": 0.25})],
    "gpt2": [("exact gelu", {"activation_function": "gelu"})],
    "gemma4": [("no per-layer inputs", _gemma4_no_ple),
               ("no layer scalars", _gemma4_layers(lambda layer: layer.w.update(layer_scalar=None))),
               ("sliding window 64", {"sliding_window": 64}),
               ("no final soft-cap", {"final_logit_softcapping": None})],
    "gemma4_moe": [("no MoE block", _gemma4_layers(lambda layer: layer.w.pop("experts"))),
                   ("no per-expert scale", _gemma4_layers(
                       lambda layer: layer.w.update({"router.per_expert_scale": layer.w["router.per_expert_scale"] * 0 + 1})
                   )),
                   ("unscaled proportional rope", {"rope_parameters": {"full_attention": {
                       "rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1_000_000.0}}})],
    "gpt2_scaled": [("softmax scale not divided by layer + 1", {"scale_attn_by_inverse_layer_idx": False}),
                    ("unscaled softmax", {"scale_attn_weights": False})],
    "lfm2": [("rope theta 1e4", {"rope_parameters": {"rope_theta": 10000.0}}), ("q/k norms off", _lfm2_no_qk_norm)],
    "lfm2_conv_bias": [("conv biases off", _lfm2_no_conv_bias)],
    "gpt_oss": [("attention sinks off", _no_sinks), ("SwiGLU clamp at 7", {"swiglu_limit": 7.0}),
                ("sliding window off", {"layer_types": ["full_attention"] * 4}), ("top-1 routing", {"num_experts_per_tok": 1}),
                ("no yarn", {"rope_parameters": {"rope_type": "default"}}),
                ("swiglu_alpha 1", {"swiglu_alpha": 1.0})],
    "gpt_oss_top3": [("attention sinks off", _no_sinks), ("SwiGLU clamp at 7", {"swiglu_limit": 7.0}),
                     ("sliding window 4", {"sliding_window": 4}), ("top-2 routing", {"num_experts_per_tok": 2})],
    "falcon_h1": [(f"{knob} 1", {knob: 1.0}) for knob in
                  ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                   "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")]
    + [(f"{knob} all 1", {knob: [1.0] * n}) for knob, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2))]
    + [("time steps clamped to 0.05", {"time_step_limit": [0.0, 0.05]})],
    "falcon_h1_norm": [("mamba norm after the gate", {"mamba_norm_before_gate": False}),
                       ("2 groups of B/C and of the norm", {"mamba_n_groups": 2, "mamba_d_state": 4})],
    "mamba2": [("dt clamped to [0, 0.3]", {"time_step_limit": [0.0, 0.3]}),
               ("gated norm: normed before the gate", _mamba2_norm(norm_before_gate=True))],
    "mamba2_groups": [("gated norm over the whole inner width", _mamba2_norm(norm_groups=1)),
                      ("dt at least 1", {"time_step_limit": [1.0, {"__float__": "Infinity"}]})],
    "granitemoehybrid": [("top-1 routing", {"num_experts_per_tok": 1}), ("no rope", {"position_embedding_type": "nope"}),
                         ("dt clamped to [0, 0.3]", {"time_step_limit": [0.0, 0.3]})]
    + [(f"{knob} 1", {knob: 1.0}) for knob in ("embedding_multiplier", "residual_multiplier", "logits_scaling")]
    + [("softmax scale head_dim ** -0.5", {"attention_multiplier": 0.25})],
    "granitemoehybrid_dense": [("rope", {"position_embedding_type": "rope"}),
                               ("residual_multiplier 1", {"residual_multiplier": 1.0})],
    "qwen3_5": [("full rotary", {"rope_parameters": {"partial_rotary_factor": 1.0}}),
                ("attention output ungated", _no_attention_gate)],
    "qwen3_5_interval": [("a quarter rotary", {"rope_parameters": {"partial_rotary_factor": 0.25}})],
    "qwen3_next": [("top-k weights not renormalised", {"norm_topk_prob": False}),
                   ("attention output ungated", _no_attention_gate)],
    "qwen3_5_moe": [("attention output ungated", _no_attention_gate)],
}


@pytest.mark.parametrize(("name", "what", "change"),
                         [(v, what, change) for v, knobs in KNOBS.items() for what, change in knobs],
                         ids=[f"{v}-{what}" for v, knobs in KNOBS.items() for what, _ in knobs])
def test_switching_a_knob_moves_the_logits_far_beyond_the_tolerance(
        name: str, what: str, change: Any, tmp_path: Path) -> None:
    path = tiny_model_dir(name)
    prompt, decode = encode(path, PROMPT), encode(path, DECODE_TEXT)
    ids, want = prompt + decode, reference_logits(path, prompt, decode)["full"]  # the parity test's reference
    if callable(change):
        model = infer.load(path, backend="numpy")
        change(model)
    else:
        model = infer.load(_edited(path, tmp_path, change), backend="numpy")
    engine = model.engine
    got = model.backend.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel > 5 * LOGIT_RTOL, f"{name}, {what}: the logits moved by only {rel:.2g} relative"
    shutil.rmtree(tmp_path / "edited", ignore_errors=True)


def test_gpt2_reads_the_original_openai_names(tmp_path: Path) -> None:
    # openai-community/gpt2 stores its tensors without the "transformer." prefix, with the causal
    # mask buffers h.N.attn.bias and h.N.attn.masked_bias beside the real c_attn.bias.
    from safetensors.numpy import load_file, save_file

    path = tiny_model_dir("gpt2")
    out = tmp_path / "openai"
    shutil.copytree(path, out)
    state = {name.removeprefix("transformer."): value for name, value in load_file(path / "model.safetensors").items()}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
        state[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    ids = encode(path, PROMPT)
    model = infer.load(out, backend="numpy")
    got = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))
    assert_logits_close(got, reference_logits(path, ids, [])["prefill"], "gpt2 with OpenAI's names")
