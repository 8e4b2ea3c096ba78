"""``kv_dtype="q8_0"``: keys and values stored in llama.cpp's q8_0 blocks.

docs/kv-cache.md, "Keys and values in 8 bits". Each 32 values of a written
row become a float16 scale and 32 int8 codes (34 bytes for 128 of float32);
attention quantizes each query row once and scores on integer dot products
(backends/cpu/attention.c on numpy; :func:`infer.oplib.attend_one` plainly).

What is exact: the C quantizer gives the bits of :func:`infer.oplib.quantize_q8_0`,
and every kernel path (portable, AVX2, AVX-512) gives the same output bits.
What is approximate by design: the logits. On the tiny models with heads of
32, q8_0 pools move them by 2%-6% of the largest logit from the float32 pool
(24% on gpt_oss, whose router flips an expert) since the codes round each
value by up to 1/254 of its block's largest. So the tests compare the q8_0
pool with the same numpy model whose written keys and values, and whose
queries, are rounded through q8_0 in float32 pools: those differ only by float
rounding (integer sums against float products, the online softmax), measured
at most 4e-7 of the largest logit here, against ``Q8_RTOL`` = 1e-3; leaving
out either rounding (of the keys and values, or of the queries) moves them by
1.2e-2 and more.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import backend_params, encode, tiny_model_dir

import infer
from infer.backends.cpu import kernels
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.runner import Engine
from infer.engine.sampling import SamplingParams
from infer.errors import CacheConfigError, StateFileError
from infer.kv.attention import AttentionContext
from infer.oplib import dequantize_q8_0, q8_0_query, quantize_q8_0
from infer.ops import AttentionBatch
from infer.tools.cli import main

Q8_RTOL = 1e-3
PROMPT = "The capital of France is Paris. Once upon a time"
#: Grouped heads (llama3), sliding windows and soft-capping (gemma3_softcap),
#: sinks (gpt_oss) and layers that read another layer's keys (gemma4), all
#: with heads of 32 (a q8_0 block; the tiny models' own 16 are refused).
VARIANTS = ["llama3", "gemma3_softcap", "gpt_oss", "gemma4"]
native = kernels.native
PATHS = native.paths() if native is not None else []


def _dir(variant: str) -> object:
    return tiny_model_dir(variant, head_dim=32)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    chosen = native.simd()
    native.use_simd(request.param)
    yield request.param
    native.use_simd(chosen)


def _logits(engine: Engine, prompt: list[int], decode: list[int]) -> np.ndarray:
    ops, seq = engine.backend, engine.new_sequence()
    rows = [ops.to_numpy(engine.forward(seq, prompt, all_logits=True))]
    rows += [ops.to_numpy(engine.forward(seq, [t])[-1:]) for t in decode]
    engine.release(seq)
    return np.concatenate(rows).astype(np.float64)


def test_the_quantizer_gives_the_reference_blocks_on_every_path(path: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 3, 64)) * rng.uniform(1e-3, 1e3, (40, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x[1, 1, 5] = 1e-30  # a block far below the others' scales
    out = np.empty((40, 3, 68), np.uint8)
    kernels.quantize_q8_0(x, out)
    want = quantize_q8_0(x)
    np.testing.assert_array_equal(out, want)
    back = dequantize_q8_0(want)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    # Each value within half a code of its block (plus the float16 scale's own rounding).
    assert (np.abs(back - x).reshape(-1, 32) <= amax * (0.5 / 127 + 2.0 ** -11)).all()


def _pools(rng: np.random.Generator, rows: int, hkv: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
    return (quantize_q8_0(rng.standard_normal((rows, hkv, dk)).astype(np.float32)),
            quantize_q8_0(rng.standard_normal((rows, hkv, dv)).astype(np.float32)))


def test_every_path_attends_over_q8_0_pools_with_the_same_bits() -> None:
    if not PATHS:
        pytest.skip("the C kernels are not built")
    from infer.backends.cpu.backend import CpuBackend

    ops, rng, chosen = CpuBackend(), np.random.default_rng(3), native.simd()
    for trial in range(12):
        hkv, group, dk, dv = int(rng.integers(1, 4)), int(rng.integers(1, 7)), 32 * int(rng.integers(1, 4)), 64
        length, block = int(rng.integers(1, 200)), int(rng.choice([1, 16]))
        tq = min(int(rng.integers(1, 4)), length)
        blocks = -(-length // block) + 1
        table = rng.permutation(blocks)[:blocks - 1].astype(np.int32)[None]
        k, v = _pools(rng, blocks * block, hkv, dk, dv)
        q = (rng.standard_normal((tq, hkv * group, dk)) * 2).astype(np.float32)
        batch = AttentionBatch(np.array([0, tq], np.int32), np.array([length], np.int32), table, block, tq)
        kw = {"scale": dk ** -0.5, "window": [None, 7][trial % 2], "softcap": [None, 20.0][trial // 2 % 2],
              "sinks": rng.standard_normal(hkv * group).astype(np.float32) if trial % 3 == 0 else None}
        outs = []
        try:
            for p in PATHS:
                native.use_simd(p)
                outs.append(ops.attention(q, k, v, batch, **kw))
        finally:
            native.use_simd(chosen)
        for p, o in zip(PATHS[1:], outs[1:]):
            np.testing.assert_array_equal(o, outs[0], err_msg=f"{p} against {PATHS[0]}, trial {trial}")


def _round_through_q8_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on every attention layer's new keys and values, and its
    queries, are rounded through q8_0 before they are stored and attended to,
    in float32 pools: what a q8_0 pool computes, up to float rounding."""
    original = AttentionContext.attention

    def attention(self, layer, q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        ops = self.ops
        k, v = (x if x is None else ops.from_numpy(dequantize_q8_0(quantize_q8_0(ops.to_numpy(x)))) for x in (k, v))
        return original(self, layer, ops.from_numpy(q8_0_query(ops.to_numpy(q))), k, v, **kwargs)

    monkeypatch.setattr(AttentionContext, "attention", attention)


@pytest.mark.parametrize("variant", VARIANTS)
def test_q8_0_pools_hold_34_bytes_per_32_values_and_round_keys_values_and_queries(
        variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _dir(variant)
    exact = infer.load(path, backend="numpy", dtype="float32", compile=False)
    q8 = infer.load(path, backend="numpy", dtype="float32", compile=False, kv_dtype="q8_0")
    assert q8.engine.kv_dtype == "q8_0"
    assert q8.engine.kv_bytes_per_position() * 128 == exact.engine.kv_bytes_per_position() * 34

    seq = q8.engine.new_sequence()
    q8.engine.forward(seq, [5, 6, 7])
    store = seq.cache.store
    layers = store.storage_layers(q8.engine.model.num_cache_layers)
    assert layers and all(q8.engine.backend.dtype(a) == "uint8" for i in layers for a in store.stored(i))
    keys, _ = seq.cache.read(layers[0], 0, 3)  # read() gives the values the blocks hold
    assert q8.engine.backend.dtype(keys) == "float32"
    q8.engine.release(seq)

    prompt = encode(path, PROMPT)
    want = list(exact.generate_tokens(prompt, max_tokens=8, ignore_eos=True))
    g = _logits(q8.engine, prompt, want[:-1])
    assert not np.allclose(g, _logits(exact.engine, prompt, want[:-1]), rtol=0, atol=1e-3)  # really rounded
    _round_through_q8_0(monkeypatch)
    w = _logits(exact.engine, prompt, want[:-1])
    err, scale = np.abs(g - w).max(), np.abs(w).max()
    assert err <= Q8_RTOL * scale, f"{variant}: q8_0 pool against rounding through q8_0 moved logits by {err:.3g}"


@pytest.mark.parametrize("compiled", [False, True])
def test_the_captured_step_decodes_what_the_eager_forward_does(compiled: bool) -> None:
    # The step quantizes each new row in its scatter (plan.c) and attends with the same kernel.
    model = infer.load(_dir("gemma3_softcap"), backend="numpy", dtype="float32", compile=False, kv_dtype="q8_0")
    prompt = encode(_dir("gemma3_softcap"), PROMPT)
    want = list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    step = model.engine.capture_decode(compile=compiled)
    got = list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    assert step.reason is None and step.steps == len(want) - 1
    assert got == want


def test_batched_requests_on_a_paged_q8_0_pool_get_what_each_gets_alone() -> None:
    model = infer.load(_dir("llama3"), backend="numpy", dtype="float32", kv_dtype="q8_0")
    engine = model.engine
    prompts = [list(range(3, 30)), list(range(3, 30)) + [40, 41], [9, 8, 7], list(range(50, 63))]
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    want = [list(generate(engine, p, SamplingParams(), stop)) for p in prompts]
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    batch = BatchEngine(engine, kv_pool=pool)
    first = batch.submit(prompts[0], SamplingParams(), stop)
    batch.run_until_done()  # its pages stay cached: the second prompt starts from them
    handles = [batch.submit(p, SamplingParams(), stop) for p in prompts[1:]]
    batch.run_until_done()
    assert [first.tokens] + [h.tokens for h in handles] == want
    assert batch.stats.tokens_reused >= 24
    assert all(engine.backend.dtype(a) == "uint8" for i in pool.storage_layers(engine.model.num_cache_layers)
               for a in pool.stored(i))


def test_heads_that_are_not_whole_blocks_are_a_typed_error() -> None:
    model = infer.load(tiny_model_dir("llama3"), backend="numpy", kv_dtype="q8_0")  # heads of 16
    with pytest.raises(CacheConfigError, match=r"kv_dtype='q8_0' stores blocks of 32 values.*16 per head"):
        model.generate("Once upon a time", max_tokens=2)


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "mlx:cpu"))
def test_backends_without_q8_0_pools_refuse_them(backend: str) -> None:
    with pytest.raises(CacheConfigError, match=r"kv_dtype='q8_0': backend .* stores keys and values in"):
        infer.load(_dir("llama3"), backend=backend, kv_dtype="q8_0")


def test_a_q8_0_pool_is_not_saved_as_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = infer.load(_dir("llama3"), backend="numpy", kv_dtype="q8_0")
    with pytest.raises(StateFileError, match="q8_0"):
        model.save_state(tmp_path / "state.safetensors", encode(_dir("llama3"), PROMPT))


def test_the_cli_takes_kv_dtype_q8_0(capsys: pytest.CaptureFixture[str]) -> None:
    path = _dir("llama3")
    assert main(["-q", "run", str(path), "Once upon a time", "-n", "6", "--ignore-eos", "--backend", "numpy",
                 "--kv-dtype", "q8_0"]) == 0
    want = infer.load(path, backend="numpy", kv_dtype="q8_0").generate("Once upon a time", max_tokens=6,
                                                                       ignore_eos=True)
    assert capsys.readouterr().out == want + "\n"
