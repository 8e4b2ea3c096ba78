"""``infer.load(..., compile=True)`` captures each layer's pieces around
attention as compiled graphs and gives the same outputs.

Tiny random llama and gemma3 models run on torch/cpu, torch/cuda where there is one
(``torch.compile``, Inductor) and mlx/cpu (``mx.compile``) with and without capture: prefill and decode logits
agree within 1e-4 of the largest logit — compiled kernels fuse elementwise
chains and may reassociate sums, a few float32 ulp per op, far below a
token-changing difference — and the greedy tokens are identical. numpy has
nothing to capture: the flag changes nothing there.
"""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest

import infer
from infer.engine import StopConditions
from infer.sampling import SamplingParams
from reference import tiny_model_dir

PROMPT = list(range(3, 14))


def logits_and_tokens(model: infer.Model) -> tuple[list[np.ndarray], list[int]]:
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence(64)
    rows = [ops.to_numpy(engine.prefill(seq, PROMPT))]
    for token in (5, 17, 2):
        rows.append(ops.to_numpy(engine.decode_one_token(seq, token)))
    tokens = list(engine.generate(PROMPT, SamplingParams(), StopConditions(max_tokens=8, ignore_eos=True)))
    return [np.asarray(r, dtype=np.float32) for r in rows], tokens


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


NO_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")
NO_CUDA = pytest.mark.skipif(not _cuda(), reason="no CUDA device")
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="no mlx")


@pytest.mark.parametrize("backend", [
    pytest.param("torch:cpu", marks=NO_TORCH),
    pytest.param("torch:cuda", marks=NO_CUDA),
    pytest.param("mlx:cpu", marks=NO_MLX),
    "numpy",
])
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_compiled_layers_give_the_same_outputs(backend: str, variant: str) -> None:
    path = tiny_model_dir(variant)
    plain = infer.load(path, backend=backend)
    captured = infer.load(path, backend=backend, compile=True)
    assert captured.backend.graph_capture and not plain.backend.graph_capture
    want_rows, want_tokens = logits_and_tokens(plain)
    got_rows, got_tokens = logits_and_tokens(captured)
    for step, (g, w) in enumerate(zip(got_rows, want_rows)):
        err, tol = float(np.abs(g - w).max()), 1e-4 * float(np.abs(w).max())
        assert err <= tol, f"step {step}: max abs error {err:.3g} > {tol:.3g}"
    assert got_tokens == want_tokens
    # The pieces really are compiled: not the plain closures of layer_pieces.
    after = captured.network.after
    if not hasattr(after, "_torchdynamo_orig_callable"):  # MLX wraps mx.compile's function for packed weights
        after = getattr(after, "__wrapped__", after)
    compiled = hasattr(after, "_torchdynamo_orig_callable") or type(after) is not types.FunctionType
    assert compiled == (backend != "numpy")
    if backend.startswith("torch"):
        from torch._dynamo.utils import counters  # noqa: I001

        assert counters["stats"]["unique_graphs"] >= 3  # first, before, after


@pytest.mark.parametrize("backend", [
    pytest.param("torch:cpu", marks=NO_TORCH),
    pytest.param("torch:cuda", marks=NO_CUDA),
    pytest.param("mlx:cpu", marks=NO_MLX),
])
def test_compiled_layers_take_quantized_weights(backend: str) -> None:
    """Weights kept quantized (on-load q4: torch int4pack, MLX affine)
    pass through the captured graphs: same greedy tokens as uncompiled."""
    path = tiny_model_dir("llama3")
    plain = infer.load(path, backend=backend, quantize="q4")
    captured = infer.load(path, backend=backend, quantize="q4", compile=True)
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    want = list(plain.engine.generate(PROMPT, SamplingParams(), stop))
    assert list(captured.engine.generate(PROMPT, SamplingParams(), stop)) == want
