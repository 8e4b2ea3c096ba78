"""Image requests' decode steps inside the captured step (infer.engine.capture).

Once a prompt with its images is in, every decode step is text: Gemma 3's
tokens need their ids only, and Qwen3.5's M-RoPE tokens sit at their index +
the prompt's ``position_delta`` on all three streams, which is plain rope at
that position. So the captured steps take that offset as data (the batched
step's positions input, the contiguous step's offset input) and one graph
serves every offset. For each: the greedy tokens with capture on equal those
with capture off and transformers' ``generate``, and the decode steps were
counted by the captured step (a step that fell back to the eager forward is
not counted), on numpy and torch:cpu (whose captured steps are recorded
programs of the C kernels).
"""

from __future__ import annotations

from typing import Any

import pytest
from infer.backends import numpy as numpy_backend

import infer
from infer.engine.capture import CapturedBatchDecode, batch_bucket
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not hasattr(numpy_backend._affine, "run_plan"), reason="no C kernels")

import vision_models  # noqa: E402
import vision_models_b  # noqa: E402

BACKENDS = ("numpy", "torch:cpu")
#: Per family: its folder maker, reference inputs, image placeholder.
FAMILIES: dict[str, tuple[Any, Any, str]] = {
    "qwen3_5": (vision_models_b, vision_models_b, "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": (vision_models, vision_models, "<start_of_image>"),
}
#: New tokens per request: the running batch goes 2, 1 (buckets 2, 1: two programs).
NEW_TOKENS = [6, 9]


def _requests(name: str) -> list[tuple[str, list[Any]]]:
    ph = FAMILIES[name][2]
    one = vision_models.synthetic_image(27, 20, seed=3)
    two = vision_models.synthetic_image(12, 30, "RGBA", seed=4)
    return [(f"Look: {ph} The capital of France is", [one]),
            (f"The capital {ph} of France is {ph} Paris, and", [one, two])]


def _folder(name: str) -> Any:
    return FAMILIES[name][0].vlm_dir(name)


def _transformers_greedy(folder: Any, module: Any, text: str, pics: list[Any], steps: int) -> list[int]:
    inputs = module.reference_inputs(folder, text, pics)
    with torch.no_grad():
        out = module.reference_model(folder).generate(**inputs, max_new_tokens=steps, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _run_batch(model: infer.Model, name: str) -> list[list[int]]:
    batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
    handles = []
    for (text, pics), n in zip(_requests(name), NEW_TOKENS):
        ids, media = model.image_prompt(text, pics)
        handles.append(batch.submit(ids, SamplingParams(), StopConditions(max_tokens=n, ignore_eos=True),
                                    media=media))
    batch.run_until_done()
    return [h.tokens for h in handles]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_image_requests_decode_in_the_batched_captured_step(name: str, backend: str) -> None:
    if backend != "numpy":
        pytest.importorskip("torch")
    model = infer.load(_folder(name), backend=backend, dtype="float32", compile=False)
    if name == "qwen3_5":  # the offset is the point: the tokens after the prompt are not at their index
        assert all(model.image_prompt(text, pics)[1].position_delta != 0 for text, pics in _requests(name))
    want = _run_batch(model, name)
    model.engine.capture_decode(compile=True)
    step = model.engine.batch_step
    assert isinstance(step, CapturedBatchDecode)
    got = _run_batch(model, name)
    assert step.reason is None, step.reason
    assert got == want
    # The prompts (image rows, spans) ran eagerly in one forward; every decode step after it was captured.
    assert step.steps == max(NEW_TOKENS) - 1 and step.rows == sum(NEW_TOKENS) - len(NEW_TOKENS)
    assert step.graphs == len({batch_bucket(n) for n in (2, 1)}) == 2, f"{step.graphs} programs"
    if backend == "numpy":  # the families' own tests compare every backend with transformers
        module = FAMILIES[name][1]
        for (text, pics), n, tokens in zip(_requests(name), NEW_TOKENS, got):
            reference = _transformers_greedy(_folder(name), module, text, pics, n)
            assert tokens[:len(reference)] == reference, f"{name}: {text!r}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mrope_offset_is_an_input_of_the_contiguous_captured_step(backend: str) -> None:
    # A Qwen3.5 whose layers are all attention (no DeltaNet state), so the contiguous greedy step serves it.
    name = "qwen3_5_attention"
    folder = vision_models_b.vlm_dir(name)
    model = infer.load(folder, backend=backend, dtype="float32", compile=False)
    runs = []
    for text, pics in _requests("qwen3_5"):
        runs.append((text, pics, model.complete(text, images=pics, max_tokens=8, temperature=0,
                                                ignore_eos=True).token_ids))
    step = model.engine.capture_decode(compile=True)
    for text, pics, want in runs:
        assert model.image_prompt(text, pics)[1].position_delta != 0
        got = model.complete(text, images=pics, max_tokens=8, temperature=0, ignore_eos=True).token_ids
        assert got == want, text
    assert step.reason is None, step.reason
    # The first token comes from the prompt's forward; the other 7 of each request from the step,
    # one graph for both (their deltas differ, the capacity bucket is the same).
    assert step.steps == 2 * 7 and step.graphs == 1
    if backend == "numpy":
        for text, pics, want in runs:
            assert want == _transformers_greedy(folder, vision_models_b, text, pics, 8), text
