"""On-load quantization of a real float checkpoint: top-1 agreement with the float path.

SmolLM2-135M-Instruct in its Hugging Face float32 form (built by transformers from
the catalog GGUF, see tests/reference.py) is loaded three times on numpy: float32,
``quantize="q8"`` and ``quantize="q4"`` (codes with a float32 scale and bias per
group of 32; MLX's ``mx.quantize`` computes the same scheme, torch's ``q4`` too
with bfloat16-rounded scales). Under teacher forcing (one prefill of each fixed
prompt, logits at every position) the quantized model's argmax must equal the
float model's at >= 95% of positions for q8 and >= 80% for q4 (measured:
docs/quantization.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import infer
from reference import smollm2_hf_dir

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes, the boiling point",
    "<|im_start|>user\nWhat are the three primary colors?<|im_end|>\n<|im_start|>assistant\n"
    "The three primary colors are red, blue and yellow.",
]
MINIMUM = {"q8": 0.95, "q4": 0.80}


def top1(model: infer.Model, ids: list[int]) -> np.ndarray:
    engine = model.engine
    logits = model.backend.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))
    return logits.argmax(axis=-1)


@pytest.fixture(scope="module")
def float_top1() -> list[tuple[list[int], np.ndarray]]:
    model = infer.load(smollm2_hf_dir(), backend="numpy")
    return [(ids, top1(model, ids)) for ids in (model.tokenizer.encode(p) for p in PROMPTS)]


@pytest.mark.parametrize("scheme", ["q8", "q4"])
def test_top1_agreement_with_the_float_path(scheme: str, float_top1: list[tuple[list[int], np.ndarray]]) -> None:
    quantized = infer.load(smollm2_hf_dir(), backend="numpy", quantize=scheme)
    same = sum(int((top1(quantized, ids) == want).sum()) for ids, want in float_top1)
    measured = same / sum(len(ids) for ids, _ in float_top1)
    print(f"{scheme}: top-1 agreement {measured:.3f} over {sum(len(i) for i, _ in float_top1)} positions")
    assert measured >= MINIMUM[scheme]


# -- kept-quantized GGUF weights: exact weights, float32 activations ---------------------------

GREEDY_PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "The three primary colors are"]


@pytest.mark.parametrize("backend", ["mlx:cpu", "torch:cpu"])
def test_kept_quantized_gguf_greedy_tokens_equal_transformers_float32(backend: str) -> None:
    """SmolLM2 Q4_1 kept quantized (MLX affine / torch int4pack, float32 scales and
    activations): the weights are the GGUF values exactly, so greedy tokens equal
    the float32 reference, as on the dequantized path (tests/test_real_gguf.py)."""
    pytest.importorskip("mlx.core" if backend.startswith("mlx") else "torch")
    from reference import assert_greedy_equal, encode, float32_rtol, reference_greedy, reference_teacher_forced

    model = infer.load("smollm2-135m", backend=backend, quantize="q4")
    hf_dir = smollm2_hf_dir()
    for prompt in GREEDY_PROMPTS:
        ids = encode(hf_dir, prompt)
        got = list(model.generate_tokens(ids, max_tokens=8, ignore_eos=True))
        want = reference_greedy(hf_dir, ids, 16)[:8]
        assert_greedy_equal(got, want, reference_teacher_forced(hf_dir, ids, want), float32_rtol(hf_dir), prompt)
