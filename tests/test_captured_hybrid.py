"""Hybrid models' recurrent layers inside the captured steps (infer.engine.capture).

Recurrent state is the step's data like the KV pool: each sequence's state
slot, the checkpoint rows and their slots are inputs, the state arrays go in
and come back, and the recurrent ops read their ragged batch from the step's
``query_start`` (backends/cpu/record.py's CONV1D, GDR and SSD steps). So a
hybrid records one program per bucket, as an attention-only model does, and
decodes the eager tokens. One family per recurrent op: gated DeltaNet with
its convolution (qwen3_5), the short convolution (lfm2), Mamba2's scan
(mamba2); Falcon-H1 (Mamba2 beside attention in every layer). The softmax
routers of granitemoehybrid and qwen3_next are steps too (TOPK, the pairwise
SUM, EXPERT_GEMV), so those hybrids capture as well.

The contiguous greedy step (``CapturedDecode``, what ``generate`` uses for one
sequence) records one program per cache capacity and per whether the step
writes a state checkpoint (every 16 positions): two here.
"""

from __future__ import annotations

import numpy as np
import pytest
from infer.backends import numpy as numpy_backend
from reference import LOGIT_RTOL, assert_greedy_equal, encode, reference_greedy, reference_logits, tiny_model_dir

import infer
from infer.backends.cpu import record
from infer.engine.capture import CapturedBatchDecode, CapturedDecode, batch_bucket
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.kv.cache import CHECKPOINT_INTERVAL

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


#: The prompt the families' parity tests use (their transformers references are cached for it).
PROMPT = "The capital of France is Paris. Once upon a time"
GREEDY = 16
HYBRIDS = ["qwen3_5", "lfm2", "mamba2", "falcon_h1", "granitemoehybrid", "qwen3_next"]


def _greedy(model: infer.Model, prompt: list[int]) -> list[int]:
    return list(model.generate_tokens(prompt, max_tokens=GREEDY, ignore_eos=True))


# torch/cpu records the same programs: two families (gated DeltaNet; Mamba2 with softmax-routed experts) suffice.
@pytest.mark.parametrize("variant,backend", [*((v, "numpy") for v in HYBRIDS),
                                             ("qwen3_5", "torch:cpu"), ("granitemoehybrid", "torch:cpu")])
def test_greedy_decoding_of_hybrids_is_captured(variant: str, backend: str) -> None:
    if backend != "numpy":
        pytest.importorskip("torch")
    path = tiny_model_dir(variant)
    prompt = encode(path, PROMPT)
    model = infer.load(path, backend=backend, dtype="float32", compile=False)
    want = _greedy(model, prompt)
    model.engine.capture_decode(compile=True)
    step = model.engine.decode_step
    assert isinstance(step, CapturedDecode)
    got = _greedy(model, prompt)
    assert step.reason is None, step.reason
    assert got == want
    assert step.steps == GREEDY - 1  # every token after the prefill's
    # One capacity; the steps ending on a checkpoint position write it (a second program).
    checkpoint = any(p % CHECKPOINT_INTERVAL == 0 for p in range(len(prompt) + 1, len(prompt) + GREEDY))
    assert step.graphs == 1 + checkpoint == 2, f"{step.graphs} programs"
    # ...and they are transformers' tokens (up to a near-tie of its logits).
    ref = reference_greedy(path, prompt, GREEDY)
    logits = reference_logits(path, prompt, ref[:-1])
    assert_greedy_equal(got, ref, np.stack([logits["prefill"][-1], *logits["decode"]]), LOGIT_RTOL,
                        f"{variant} {backend} captured")


@pytest.mark.parametrize("variant", ["qwen3_5", "lfm2", "mamba2", "granitemoehybrid", "qwen3_next"])
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


@pytest.mark.parametrize("variant", ["qwen3_5", "granitemoehybrid"])
def test_torch_cpu_programs_capture_hybrids_too(variant: str) -> None:
    # torch/cpu's captured step is a recorded program of the same kernels (the recurrent ops' and the routers' steps).
    pytest.importorskip("torch")
    model = infer.load(tiny_model_dir(variant), backend="torch:cpu", dtype="float32", compile=False)
    want = _run_batch(model, variant)
    model.engine.capture_decode(compile=True)
    step = model.engine.batch_step
    got = _run_batch(model, variant)
    assert step.reason is None, step.reason
    assert got == want and step.steps == max(NEW_TOKENS) - 1 and step.graphs == 3


def _refuse_experts(self: record.Recorder, *args: object) -> None:
    raise record.NotCapturable("expert_linear: refused by the test")


@pytest.mark.parametrize("greedy", [False, True])
def test_a_refused_trace_leaves_the_recurrent_states_as_they_were(greedy: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Granite 4.0-H's tiny variant with its experts' products refused: the first trace runs
    # some Mamba2 layers on the live states before it is refused, and the eager forward that
    # follows must start from the states as they were (a state, unlike keys and values,
    # cannot be written twice). In the batched step and in the contiguous greedy one.
    variant = "granitemoehybrid"
    model = infer.load(tiny_model_dir(variant), backend="numpy", dtype="float32", compile=False)
    prompt = encode(tiny_model_dir(variant), PROMPT)
    run = (lambda: _greedy(model, prompt)) if greedy else (lambda: _run_batch(model, variant))
    want = run()
    monkeypatch.setattr(record.Recorder, "expert_linear", _refuse_experts)
    model.engine.capture_decode(compile=True)
    got = run()
    step = model.engine.decode_step if greedy else model.engine.batch_step
    assert step.reason is not None and "refused by the test" in step.reason
    assert got == want
