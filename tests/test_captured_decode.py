"""The captured decode step (infer/engine/capture.py) decodes what the eager loop does.

Tiny random models run greedy generations twice, eagerly and through the
static-shape step: compiled as one graph on torch/cpu (``torch.compile``) and
mlx/cpu (``mx.compile``), and uncompiled on numpy (the same static ops run as
they are, which checks the static path itself: writes at a position given as
data, attention masked to the valid length inside a fixed-capacity buffer).
The tokens must be identical; the logits of the step's forward agree within
``COMPILED_RTOL`` of the largest logit (test_graph_capture.py argues it), and
the step builds one graph per cache capacity, not one per token. Where the step
does not serve (sampling, a paged cache, speculative decoding, batching, dynamic
rope scaling) decoding falls back to the eager forward with the same tokens,
and says why where it is the step's own limit.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
from reference import LOGIT_RTOL, assert_logits_close, backend_params, encode, tiny_model_dir

import infer
from infer.backends import numpy as numpy_backend
from infer.engine.capture import MIN_CAPACITY, CapturedDecode, capacity_bucket
from infer.kv.attention import AttentionContext

PROMPT = "The capital of France is Paris. Once upon a time"
COMPILED_RTOL = 2 * LOGIT_RTOL
#: (backend, compiled): numpy's static step uncompiled, and recorded as one
#: program of its C kernels (backends/cpu/plan.py, which has its own tests).
STEPS = [pytest.param("numpy", False, id="numpy-static"),
         pytest.param("numpy", True, id="numpy-program",
                      marks=pytest.mark.skipif(not hasattr(numpy_backend._affine, "run_plan"), reason="no C kernels")),
         *(pytest.param(p.values[0], True, marks=p.marks, id=f"{p.values[0]}-compiled")
           for p in backend_params("torch:cpu", "mlx:cpu"))]


def _ids(variant: str) -> list[int]:
    return encode(tiny_model_dir(variant), PROMPT)


def _eager_and_captured(variant: str, backend: str, compiled: bool, **kwargs) -> tuple[list, list, CapturedDecode]:
    model = infer.load(tiny_model_dir(variant), backend=backend, dtype="float32", compile=False)
    prompt = _ids(variant)
    want = list(model.generate_tokens(prompt, max_tokens=20, ignore_eos=True, **kwargs))
    step = model.engine.capture_decode(compile=compiled)
    got = list(model.generate_tokens(prompt, max_tokens=20, ignore_eos=True, **kwargs))
    return got, want, step


@pytest.mark.parametrize("variant", ["llama3", "gemma3_softcap", "mistral", "qwen2"])
@pytest.mark.parametrize("backend,compiled", [("numpy", False)])
def test_the_static_step_decodes_the_eager_tokens_on_numpy(variant: str, backend: str, compiled: bool) -> None:
    # Sliding windows (mistral, gemma3), soft-capping (gemma3_softcap), a tied head (qwen2).
    got, want, step = _eager_and_captured(variant, backend, compiled)
    assert got == want
    assert step.reason is None and step.steps == len(want) - 1  # every token after the prefill's


NUMPY_PROGRAM = pytest.param("numpy", marks=pytest.mark.skipif(not hasattr(numpy_backend._affine, "run_plan"),
                                                              reason="no C kernels: numpy records no program"))


@pytest.mark.parametrize("backend", [NUMPY_PROGRAM, *backend_params("torch:cpu", "mlx:cpu")])
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_the_captured_step_decodes_the_eager_tokens_in_one_graph(backend: str, variant: str) -> None:
    model = infer.load(tiny_model_dir(variant), backend=backend, dtype="float32", compile=False)
    # torch.compile, as compile=True asks, not torch/cpu's default program (this model's own backend instance)
    model.backend.settings = dataclasses.replace(model.backend.settings, compile=True)
    prompt = _ids(variant)
    want_long = list(model.generate_tokens(prompt, max_tokens=64, ignore_eos=True))
    want_short = list(model.generate_tokens(prompt[:5], max_tokens=30, ignore_eos=True))
    step = model.engine.capture_decode()
    assert list(model.generate_tokens(prompt, max_tokens=64, ignore_eos=True)) == want_long
    # Another prompt length and token count in the same capacity bucket: the same graph.
    assert list(model.generate_tokens(prompt[:5], max_tokens=30, ignore_eos=True)) == want_short
    assert step.reason is None, step.reason
    assert step.steps == 63 + 29
    assert step.graphs == 1, f"{step.graphs} graphs for {step.steps} steps: it recompiles"


@pytest.mark.parametrize("backend,compiled", STEPS)
@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_the_static_forward_gives_the_eager_logits(backend: str, compiled: bool, variant: str) -> None:
    """The step's forward itself, logits out, against the engine's eager forward
    at every position of a short decode."""
    model = infer.load(tiny_model_dir(variant), backend=backend, dtype="float32")
    engine, ops, net = model.engine, model.backend, model.network
    prompt = _ids(variant)

    def static_logits(ids, start, keys, values):  # type: ignore[no-untyped-def]
        ctx = AttentionContext.contiguous(ops, keys, values, start, tokens=1)
        return net.compute_logits(net.forward(ids, ctx)), ctx.keys, ctx.values

    fn = ops.compile(static_logits, static=True) if compiled else static_logits
    eager, static = engine.new_sequence(MIN_CAPACITY), engine.new_sequence(MIN_CAPACITY)
    engine.forward(eager, prompt)
    engine.forward(static, prompt)
    for token in (5, 17, 2, 40, 9):
        want = ops.to_numpy(engine.forward(eager, [token])[-1])
        keys, values = static.cache.layer_rows(net.num_layers)
        start = ops.from_numpy(np.array([static.cache.length], np.int32))
        logits, keys, values = fn(ops.from_numpy(np.array([token], np.int32)), start, keys, values)
        static.cache.replace_layer_rows(keys, values)
        static.cache.commit([token])
        assert_logits_close(np.asarray(ops.to_numpy(logits)[-1], np.float32), np.asarray(want, np.float32),
                            f"static vs eager, token {token}", rtol=COMPILED_RTOL)


def test_load_with_compile_captures_the_decode_step_where_the_backend_compiles() -> None:
    # numpy records its step as one program by default (test_numpy_plan.py); compile=False keeps it eager.
    assert infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False).engine.decode_step is None
    if hasattr(numpy_backend._affine, "run_plan"):
        assert infer.load(tiny_model_dir("llama3"), backend="numpy").engine.decode_step is not None
    if importlib.util.find_spec("torch"):  # on the CPU in float32 the same program; compile=True: torch.compile
        from infer.backends.cpu.plan import PlannedStep

        model = infer.load(tiny_model_dir("llama3"), backend="torch:cpu")
        step = model.engine.decode_step
        if hasattr(numpy_backend._affine, "run_plan"):  # the program needs numpy's C kernels
            assert step is not None and isinstance(step._fn, PlannedStep)
        else:
            assert step is None
        assert infer.load(tiny_model_dir("llama3"), backend="torch:cpu", dtype="bfloat16").engine.decode_step is None
    pytest.importorskip("mlx")
    model = infer.load(tiny_model_dir("llama3"), backend="mlx:cpu", compile=True)
    assert model.engine.decode_step is not None
    model.generate(PROMPT, max_tokens=4)
    assert model.engine.decode_step.describe().startswith("decode step captured: 1 graph(s)")


def test_dynamic_rope_scaling_is_not_captured_and_says_why() -> None:
    # Dynamic NTK recomputes frequencies from the sequence length on the host every step.
    got, want, step = _eager_and_captured("llama_dynamic", "numpy", False)
    assert got == want and step.steps == 0
    assert step.reason is not None and "max_position" in step.reason


@pytest.mark.parametrize("backend,compiled", STEPS[:3])
def test_what_the_step_does_not_serve_decodes_eagerly_with_the_same_tokens(backend: str, compiled: bool) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend=backend, dtype="float32", compile=False)
    prompt = _ids("llama3")
    sampled = dict(temperature=0.8, seed=3)
    want_sampled = list(model.generate_tokens(prompt, max_tokens=12, ignore_eos=True, **sampled))
    want_greedy = list(model.generate_tokens(prompt, max_tokens=12, ignore_eos=True))
    step = model.engine.capture_decode(compile=compiled)
    # Sampling reads logits on the host: the eager forward.
    assert list(model.generate_tokens(prompt, max_tokens=12, ignore_eos=True, **sampled)) == want_sampled
    assert step.steps == 0
    # Speculative decoding verifies several tokens per forward: eager too, the same greedy tokens.
    assert list(model.generate_tokens(prompt, max_tokens=12, ignore_eos=True, speculative="ngram")) == want_greedy
    assert step.steps == 0
    # Batched requests share forwards over paged or contiguous caches: the batch engine's own.
    batch = model.configure_batching(kv_memory=2**20)
    handle = batch.submit(prompt, infer.SamplingParams(), infer.StopConditions(max_tokens=12, ignore_eos=True))
    batch.run_until_done()
    assert handle.tokens == want_greedy and step.steps == 0
    # A paged sequence (the engine's pool) decodes eagerly as well.
    engine = model.engine
    pool = engine.new_kv_pool(num_blocks=8)
    seq = engine.new_sequence(64, kv_pool=pool)
    assert engine.greedy_step(seq, prompt[0]) is None and seq.cached == 0
    engine.release(seq)


def test_capacities_round_up_to_shared_buckets() -> None:
    assert capacity_bucket(1, 8192) == MIN_CAPACITY
    assert capacity_bucket(MIN_CAPACITY + 1, 8192) == 2 * MIN_CAPACITY
    assert capacity_bucket(3000, 2048) == 2048  # never past the context
    model = infer.load(tiny_model_dir("llama3"), backend="numpy")
    model.engine.capture_decode(compile=False)
    seq = model.engine.new_sequence(40)
    assert seq.cache.capacity == MIN_CAPACITY
    model.engine.release(seq)
