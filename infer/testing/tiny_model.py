"""The kit's end-to-end check: a tiny random model decodes the same on every backend.

The models are built here, deterministically, with numpy and an in-memory
:class:`~infer.package.TensorSource` (no files, no transformers), and run
through the registered llama architecture and the engine exactly as
:func:`infer.load` would: prefill, then one token per step through the KV
cache (``zeros``, ``scatter_rows``, decode attention over the pool with
``tq = 1``). Two variants: ``llama`` (grouped-query attention, separate
output head) and ``mistral`` (sliding window of 5 over a 12-token prompt,
one kv head, tied embeddings).

Weights follow the recipe of infer's own parity fixtures: every matrix
~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1), the final norm further scaled
by 4 so logits spread to ~4 and the best token usually leads the second by
far more than float32 rounding (the smallest lead on the float32 path is
checked by infer's tests).

* float32: the candidate must produce the same greedy tokens as the
  reference backend (:data:`~infer.testing.conformance.REFERENCE`).
* float16 / bfloat16: tokens cannot be expected to match; the candidate is
  fed the reference's greedy sequence (teacher forcing) and its top-1 token
  at each step must agree with the reference's at least :data:`AGREEMENT`
  of the time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infer.architecture import WeightLoader
from infer.engine import Engine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.errors import BackendOutputError
from infer.ops import Backend
from infer.package import TensorSource
from infer.plugins import get_registry
from infer.testing.conformance import reference_backend

#: Least top-1 agreement with the reference (float32) over the teacher-forced steps,
#: per variant (32 steps each; what torch and MLX reach: docs/conformance.md).
#: A bfloat16 logit is off by ~1% rms, ~0.04 at logits of ~4, while the best
#: two tokens are usually 0.1-1 apart, so a few near-ties may flip; a real
#: error (a wrong mask, rope or norm in one dtype) drops the rate to ~0.1.
AGREEMENT: dict[str, float] = {"bfloat16": 0.85, "float16": 0.9}

_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
    bos_token_id=1, eos_token_id=2,
)
VARIANTS: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama", num_key_value_heads=2, tie_word_embeddings=False),
    "mistral": dict(_BASE, model_type="mistral", num_key_value_heads=1, sliding_window=5, tie_word_embeddings=True),
}
PROMPT_LENGTH = 12
STEPS = 32


class ArrayTensorSource(TensorSource):
    """Tensors held in a dict of numpy arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._array(name).shape)

    def storage_dtype(self, name: str) -> str:
        return str(self._array(name).dtype)

    def get(self, name: str) -> np.ndarray:
        return self._array(name)

    def location(self, name: str) -> str:
        return "the conformance kit's tiny model"

    def _array(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise self._missing(name)
        return self.arrays[name]


def tiny_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for a llama-family ``config``, in Hugging Face names."""
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    nq, nkv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(gain: float = 1.0) -> np.ndarray:
        return ((1.0 + 0.1 * rng.standard_normal(d)) * gain).astype(np.float32)

    w = {"model.embed_tokens.weight": matrix(v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = matrix(nq, d)
        w[p + "self_attn.k_proj.weight"] = matrix(nkv, d)
        w[p + "self_attn.v_proj.weight"] = matrix(nkv, d)
        w[p + "self_attn.o_proj.weight"] = matrix(d, nq)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = matrix(f, d)
        w[p + "mlp.up_proj.weight"] = matrix(f, d)
        w[p + "mlp.down_proj.weight"] = matrix(d, f)
    w["model.norm.weight"] = norm(4.0)
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = matrix(v, d)
    return w


def tiny_engine(variant: str, ops: Backend, seed: int = 0) -> Engine:
    """The tiny model ``variant`` on ``ops``, ready to run."""
    config = dict(VARIANTS[variant])
    arch = get_registry().architecture_for(config["model_type"])
    network = arch.build(config, WeightLoader(ArrayTensorSource(tiny_weights(config, seed)), ops), ops)
    return Engine(network, ops)


def prompt_ids(variant: str) -> list[int]:
    vocab = VARIANTS[variant]["vocab_size"]
    return [int(t) for t in np.random.default_rng(1234).integers(3, vocab, PROMPT_LENGTH)]


def greedy(engine: Engine, prompt: Sequence[int], steps: int = STEPS) -> list[int]:
    """Greedy decoding: prefill, then one token per step."""
    stop = StopConditions(max_tokens=steps, ignore_eos=True)
    return list(generate(engine, list(prompt), SamplingParams(), stop))


def teacher_forced(engine: Engine, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """Top-1 token and logits at each step when fed ``tokens`` after ``prompt``."""
    ops = engine.backend
    seq = engine.new_sequence(len(prompt) + len(tokens))
    rows = [ops.to_numpy(engine.forward(seq, list(prompt))[-1])]
    for t in tokens[:-1]:
        rows.append(ops.to_numpy(engine.forward(seq, [t])[-1]))
    logits = np.stack(rows).astype(np.float32)
    return [int(i) for i in logits.argmax(-1)], logits


@dataclass
class EndToEndResult:
    """How the candidate decoded one tiny model."""

    variant: str
    dtype: str
    reference_tokens: list[int]
    candidate_tokens: list[int]
    #: Fraction of steps whose top-1 token agrees with the reference's.
    agreement: float
    #: What it had to reach: 1.0 (identical tokens) for float32.
    required: float
    #: Smallest gap between the reference's best and second-best logit on the path.
    reference_margin: float
    logits_nmse: float
    #: What the candidate raised instead of decoding (a wrong shape, NaN logits), or "".
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and self.agreement >= self.required

    def describe(self) -> str:
        if self.error:
            return f"{self.variant} in {self.dtype}: the candidate failed to decode: {self.error}"
        first = next((i for i, (a, b) in enumerate(zip(self.candidate_tokens, self.reference_tokens)) if a != b), None)
        where = "" if first is None else f"; first difference at step {first}"
        return (f"{self.variant} in {self.dtype}: top-1 agreement {self.agreement:.3f} "
                f"(required {self.required}){where}; logits NMSE {self.logits_nmse:.2e}; "
                f"the reference's smallest top-2 margin {self.reference_margin:.3g}\n"
                f"  reference: {self.reference_tokens}\n  candidate: {self.candidate_tokens}")


def check_end_to_end(candidate: Backend, variants: Sequence[str] = tuple(VARIANTS),
                     reference: Backend | None = None) -> list[EndToEndResult]:
    """Decode each tiny model on ``candidate`` and on the reference backend
    (float32, :func:`~infer.testing.conformance.reference_backend` unless
    ``reference`` is given) and compare.

    float32: greedy tokens, generated independently on both, must be
    identical. Other dtypes: teacher-forced top-1 agreement must reach
    :data:`AGREEMENT`.
    """
    if reference is None:
        reference = reference_backend()
    dtype = candidate.compute_dtype
    results = []
    for variant in variants:
        prompt = prompt_ids(variant)
        ref_engine = tiny_engine(variant, reference)
        want = greedy(ref_engine, prompt)
        ref_top1, ref_logits = teacher_forced(ref_engine, prompt, want)
        top2 = np.sort(ref_logits, axis=-1)[:, -2:]
        margin = float(np.min(top2[:, 1] - top2[:, 0]))
        try:
            engine = tiny_engine(variant, candidate)
            got_top1, got_logits = teacher_forced(engine, prompt, want)
            if got_logits.shape != ref_logits.shape or np.isnan(got_logits).any():
                raise BackendOutputError(
                    f"logits of shape {list(got_logits.shape)} with {int(np.isnan(got_logits).sum())} NaNs; "
                    f"expected shape {list(ref_logits.shape)} and no NaN")
            got_greedy = greedy(engine, prompt) if dtype == "float32" else got_top1
        except Exception as exc:  # a broken backend is a failed result with its reason, not a crash
            results.append(EndToEndResult(variant, dtype, want, [], 0.0, 1.0, margin, math.inf,
                                          error=f"{type(exc).__name__}: {exc}"))
            continue
        err = float(np.sum((got_logits.astype(np.float64) - ref_logits) ** 2) / np.sum(ref_logits.astype(np.float64) ** 2))
        if dtype == "float32":
            got = got_greedy
            required = 1.0
            agreement = float(np.mean([a == b for a, b in zip(got, want)])) if len(got) == len(want) else 0.0
        else:
            got = got_top1
            required = AGREEMENT.get(dtype, 0.9)
            agreement = float(np.mean([a == b for a, b in zip(got_top1, ref_top1)]))
        results.append(EndToEndResult(variant, dtype, want, got, agreement, required, margin, err))
    return results
