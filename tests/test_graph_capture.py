"""``infer.load(..., compile=True)`` captures the engine's steps as compiled
graphs (infer/engine/capture.py) and gives the same outputs.

Tiny random llama and gemma3 models run on torch/cpu, torch/cuda where there is one
(``torch.compile``, Inductor) and mlx/cpu (``mx.compile``) with and without capture: prefill and decode logits
agree within ``COMPILED_RTOL`` of the largest logit (below: compiled kernels
fuse elementwise chains and may reassociate sums, a few float32 ulp per op, far
below a token-changing difference) and the greedy tokens are identical. numpy has
nothing to capture: the flag changes nothing there.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import LOGIT_RTOL, assert_logits_close, backend_params, tiny_model_dir

import infer
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams

PROMPT = list(range(3, 14))
# Compiled kernels also contract multiply-adds into FMAs and reassociate the
# elementwise chains they fuse (Inductor's C++ and mx.compile's codegen): on top of
# the reordered sums of LOGIT_RTOL, at most one extra rounding per fused op (~10 a
# layer). Twice LOGIT_RTOL covers it; measured worst in tests/README.md.
COMPILED_RTOL = 2 * LOGIT_RTOL


def logits_and_tokens(model: infer.Model) -> tuple[list[np.ndarray], list[int]]:
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence(64)
    rows = [ops.to_numpy(engine.forward(seq, PROMPT)[-1])]
    for token in (5, 17, 2):
        rows.append(ops.to_numpy(engine.forward(seq, [token])[-1]))
    tokens = list(generate(engine, PROMPT, SamplingParams(), StopConditions(max_tokens=8, ignore_eos=True)))
    return [np.asarray(r, dtype=np.float32) for r in rows], tokens


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "torch:cuda", "mlx:cpu", "numpy"))
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_compiled_layers_give_the_same_outputs(backend: str, variant: str) -> None:
    path = tiny_model_dir(variant)
    # float32 named, since torch/cuda computes in bfloat16 by default (test below).
    plain = infer.load(path, backend=backend, dtype="float32")
    captured = infer.load(path, backend=backend, dtype="float32", compile=True)
    assert captured.backend.graph_capture and not plain.backend.graph_capture
    want_rows, want_tokens = logits_and_tokens(plain)
    got_rows, got_tokens = logits_and_tokens(captured)
    for step, (g, w) in enumerate(zip(got_rows, want_rows)):
        assert_logits_close(g, w, f"compiled vs eager, step {step}", rtol=COMPILED_RTOL)
    assert got_tokens == want_tokens
    # The engine's captured step served the greedy decode, compiled where the backend compiles.
    step = captured.engine.decode_step
    assert step is not None and step.reason is None and step.steps > 0, step and step.describe()
    compiles = captured.backend.supports("compile")  # numpy: its recorded program, where the C kernels are built
    assert step.compiled == compiles and (step.graphs or 0) >= compiles


def distances(rows: list[np.ndarray], exact: list[np.ndarray]) -> list[float]:
    """Per step: the largest difference from ``exact``, over its largest logit."""
    return [float(np.abs(r - e).max() / np.abs(e).max()) for r, e in zip(rows, exact)]


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "torch:cuda"))
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_compiled_bfloat16_stays_within_bfloat16_rounding(backend: str, variant: str) -> None:
    """In bfloat16 captured and plain layers cannot agree to float32 ulps: the
    plain ops round every intermediate to bfloat16 (8-bit mantissa, 2^-9
    relative), Inductor's fused kernels keep them in float32 and round once.
    Both are bfloat16 approximations of the same float32 function, 1 to 3% of
    the largest logit away from it on these models; what capture must not do
    is add error of its own. So: at each step the captured logits are at most
    twice as far from float32 as the plain bfloat16 ones (measured 0.5 to 1.3
    times on torch/cpu; a wrong graph is off by the logits' own size)."""
    path = tiny_model_dir(variant)
    exact, _ = logits_and_tokens(infer.load(path, backend=backend, dtype="float32"))
    plain, _ = logits_and_tokens(infer.load(path, backend=backend, dtype="bfloat16"))
    captured, _ = logits_and_tokens(infer.load(path, backend=backend, dtype="bfloat16", compile=True))
    for step, (c, p) in enumerate(zip(distances(captured, exact), distances(plain, exact))):
        assert 0 < p < 0.1, f"step {step}: plain bfloat16 is {p:.3g} of the largest logit from float32"
        assert c <= 2 * p, f"step {step}: captured {c:.3g} against plain {p:.3g} of the largest logit"


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "torch:cuda", "mlx:cpu"))
def test_compiled_layers_take_quantized_weights(backend: str) -> None:
    """Weights kept quantized (on-load q4: torch int4pack, MLX affine)
    pass through the captured graphs: same greedy tokens as uncompiled where
    the kernels compute in float32 (torch/cpu, MLX). CUDA's int4 kernel
    computes in bfloat16, where tokens of a tiny random model can flip on a
    rounding: there the captured logits stay within twice the plain ones'
    distance from float32 (see the test above)."""
    path = tiny_model_dir("llama3")
    plain = infer.load(path, backend=backend, quantize="q4")
    captured = infer.load(path, backend=backend, quantize="q4", compile=True)
    if backend == "torch:cuda":
        exact, _ = logits_and_tokens(infer.load(path, backend=backend, dtype="float32"))
        far = distances(logits_and_tokens(plain)[0], exact)
        for step, (c, p) in enumerate(zip(distances(logits_and_tokens(captured)[0], exact), far)):
            assert c <= 2 * p, f"step {step}: captured {c:.3g} against plain {p:.3g} of the largest logit"
        return
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    want = list(generate(plain.engine, PROMPT, SamplingParams(), stop))
    assert list(generate(captured.engine, PROMPT, SamplingParams(), stop)) == want
