"""Hybrid models' recurrent layers inside the captured batched step (infer.engine.capture).

Recurrent state is the step's data like the KV pool: each sequence's state
slot, the checkpoint rows and their slots are inputs, the state arrays go in
and come back, and the recurrent ops read their ragged batch from the step's
``query_start`` (backends/cpu/record.py's CONV1D, GDR and SSD steps). So a
hybrid records one program per bucket, as an attention-only model does, and
decodes the eager tokens. One family per recurrent op: gated DeltaNet with
its convolution (qwen3_5), the short convolution (lfm2), Mamba2's scan (mamba2).
"""

from __future__ import annotations

import pytest
from infer.backends import numpy as numpy_backend
from reference import encode, tiny_model_dir

import infer
from infer.engine.capture import CapturedBatchDecode, batch_bucket
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not hasattr(numpy_backend._affine, "run_plan"), reason="no C kernels")

PROMPTS = ["The capital of France is", "Once upon a time there was", "a b c d e f g h i j k l m n o p q r s"]
#: New tokens per request: the running batch goes 3, 2, 1 (buckets 4, 2, 1: three programs).
NEW_TOKENS = [12, 16, 20]


def _run_batch(model: infer.Model, variant: str) -> list[list[int]]:
    batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
    ids = [encode(tiny_model_dir(variant), p) for p in PROMPTS]
    handles = [batch.submit(p, SamplingParams(), StopConditions(max_tokens=n, ignore_eos=True))
               for p, n in zip(ids, NEW_TOKENS)]
    batch.run_until_done()
    return [h.tokens for h in handles]


@pytest.mark.parametrize("variant", ["qwen3_5", "lfm2", "mamba2"])
def test_hybrid_decode_steps_are_captured_in_a_program_per_bucket(variant: str) -> None:
    model = infer.load(tiny_model_dir(variant), backend="numpy", dtype="float32", compile=False)
    want = _run_batch(model, variant)
    model.engine.capture_decode(compile=True)
    step = model.engine.batch_step
    assert isinstance(step, CapturedBatchDecode)
    got = _run_batch(model, variant)
    assert step.reason is None, step.reason
    assert got == want
    # Every decode step after the prefills (block boundaries write checkpoints inside the step).
    assert step.steps == max(NEW_TOKENS) - 1 and step.rows == sum(NEW_TOKENS) - len(NEW_TOKENS)
    assert step.graphs == len({batch_bucket(n) for n in (3, 2, 1)}) == 3, f"{step.graphs} programs"


def test_torch_cpu_programs_capture_hybrids_too() -> None:
    # torch/cpu's captured step is a recorded program of the same kernels (the recurrent ops' steps included).
    pytest.importorskip("torch")
    model = infer.load(tiny_model_dir("qwen3_5"), backend="torch:cpu", dtype="float32", compile=False)
    want = _run_batch(model, "qwen3_5")
    model.engine.capture_decode(compile=True)
    step = model.engine.batch_step
    got = _run_batch(model, "qwen3_5")
    assert step.reason is None, step.reason
    assert got == want and step.steps == max(NEW_TOKENS) - 1 and step.graphs == 3


def test_a_refused_trace_leaves_the_recurrent_states_as_they_were() -> None:
    # Granite 4.0-H's tiny variant routes experts with softmax, which no program holds: the
    # first trace runs some Mamba2 layers on the live states before it is refused, and the
    # eager forward that follows must start from the states as they were (a state, unlike
    # keys and values, cannot be written twice).
    variant = "granitemoehybrid"
    model = infer.load(tiny_model_dir(variant), backend="numpy", dtype="float32", compile=False)
    want = _run_batch(model, variant)
    model.engine.capture_decode(compile=True)
    got = _run_batch(model, variant)
    assert model.engine.batch_step.reason is not None and "softmax" in model.engine.batch_step.reason
    assert got == want
