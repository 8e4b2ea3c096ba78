"""``kv_dtype="float16"``: keys and values stored at half width.

docs/kv-cache.md, "Storing keys and values narrower". The engine rounds each
written key and value row to float16 once; attention reads them widened to
the compute dtype. So a model's logits are, bit for bit, those of the exact
model whose written keys and values are rounded through float16 (checked by
rounding them so in float32 pools). float16 keeps 11 significant bits
(relative rounding <= 2**-11 ~ 4.9e-4 per element); on the tiny random models
of every family that rounding moves the logits by at most 2.3e-3 of the
largest logit (gemma4_moe, numpy, torch:cpu and mlx:cpu, 25-token prompt and
3 decode steps), except where it flips a router's near-tie (``ROUTED``).
``KV16_RTOL`` allows 1e-2 of the largest logit: 4x that, and far below what a
wrong key or value moves them (of order the logits themselves). Everything
else is exact: the captured step decodes what the eager forward does,
batching gives each request what it gets alone, and bytes per position are
exactly half.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from reference import assert_greedy_equal, backend_params, encode, tiny_model_dir

import infer
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.runner import Engine
from infer.engine.sampling import SamplingParams
from infer.errors import CacheConfigError
from infer.kv.attention import AttentionContext
from infer.tools import bench
from infer.tools.cli import main

KV16_RTOL = 1e-2
PROMPT = "The capital of France is Paris. Once upon a time"
#: Grouped heads (llama3), sliding windows and soft-capping (gemma3_softcap),
#: latent attention (deepseek_v3: one compressed row per position), sinks
#: (gpt_oss), recurrent layers beside attention (qwen3_5: their state stays in
#: the compute dtype) and layers that read another layer's keys (gemma4).
VARIANTS = ["llama3", "gemma3_softcap", "deepseek_v3", "gpt_oss", "qwen3_5", "gemma4"]
#: Those whose routers pick experts by a top-k: a rounding of 5e-4 flips a
#: near-tied choice, which moves that row's logits by O(1) (gpt_oss's 10th
#: decode step here: 3.7). That is the model's discontinuity, not the cache's,
#: so their logits are held to the bit-exact comparison only.
ROUTED = {"deepseek_v3", "gpt_oss"}
BACKENDS = backend_params("numpy", "torch:cpu", "mlx:cpu")


def _pair(variant: str, backend: str) -> tuple[infer.Model, infer.Model]:
    path = tiny_model_dir(variant)
    exact = infer.load(path, backend=backend, dtype="float32", compile=False)
    half = infer.load(path, backend=backend, dtype="float32", compile=False, kv_dtype="float16")
    return exact, half


def _logits(engine: Engine, prompt: list[int], decode: list[int]) -> np.ndarray:
    """Prefill logits (every row), then one row per decode step."""
    ops, seq = engine.backend, engine.new_sequence()
    rows = [ops.to_numpy(engine.forward(seq, prompt, all_logits=True))]
    rows += [ops.to_numpy(engine.forward(seq, [t])[-1:]) for t in decode]
    engine.release(seq)
    return np.concatenate(rows).astype(np.float64)


def _round_written_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on every attention layer's new keys and values are rounded
    through float16 before they are stored and attended to, in pools of the
    compute dtype: what ``kv_dtype="float16"`` must be, bit for bit (widening
    a half is exact, and each backend's attention reads a float16 pool as the
    same pool widened)."""
    original = AttentionContext.attention

    def attention(self, layer, q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        ops = self.ops
        k, v = (x if x is None else ops.astype(ops.astype(x, "float16"), ops.dtype(x)) for x in (k, v))
        return original(self, layer, q, k, v, **kwargs)

    monkeypatch.setattr(AttentionContext, "attention", attention)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_float16_pools_hold_half_the_bytes_and_round_keys_and_values_only(
        variant: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend != "numpy" and variant not in ("llama3", "gemma3_softcap", "gpt_oss"):
        pytest.skip("the other families' float16 pools are the same code on this backend; numpy runs them all")
    exact, half = _pair(variant, backend)
    assert half.engine.kv_dtype == "float16" and exact.engine.kv_dtype is None
    assert half.engine.kv_bytes_per_position() * 2 == exact.engine.kv_bytes_per_position()

    seq = half.engine.new_sequence()
    half.engine.forward(seq, [5, 6, 7])
    store = seq.cache.store
    layers = store.storage_layers(half.engine.model.num_cache_layers)
    assert layers and all(half.engine.backend.dtype(a) == "float16" for i in layers for a in store.stored(i))
    half.engine.release(seq)

    prompt = encode(tiny_model_dir(variant), PROMPT)
    want = list(exact.generate_tokens(prompt, max_tokens=12, ignore_eos=True))
    got = list(half.generate_tokens(prompt, max_tokens=12, ignore_eos=True))
    w = _logits(exact.engine, prompt, want[:-1])
    g = _logits(half.engine, prompt, want[:-1])
    assert not np.array_equal(g, w)  # the rows really are rounded
    if variant not in ROUTED:
        err, scale = np.abs(g - w).max(), np.abs(w).max()
        assert err <= KV16_RTOL * scale, f"{variant} on {backend}: float16 keys and values moved logits by {err:.3g}"
    assert_greedy_equal(got, want, w[len(prompt) - 1:], KV16_RTOL, f"{variant} kv_dtype=float16 on {backend}")

    _round_written_kv(monkeypatch)
    rounded = _logits(exact.engine, prompt, want[:-1])
    np.testing.assert_array_equal(_logits(half.engine, prompt, want[:-1]), rounded)


def test_the_compute_dtype_named_is_exact() -> None:
    path = tiny_model_dir("llama3")
    exact = infer.load(path, backend="numpy", dtype="float32")
    same = infer.load(path, backend="numpy", dtype="float32", kv_dtype="float32")
    assert same.engine.kv_dtype is None
    ids = encode(path, PROMPT)
    np.testing.assert_array_equal(_logits(same.engine, ids, [7, 9]), _logits(exact.engine, ids, [7, 9]))


@pytest.mark.parametrize("backend,compiled", [("numpy", False), ("numpy", True),
                                               *[(p.values[0], True) for p in backend_params("torch:cpu", "mlx:cpu")]])
def test_the_captured_step_decodes_what_the_eager_forward_does(backend: str, compiled: bool) -> None:
    # The step writes each new row through the same rounding (numpy's program: its scatter's own float16 path).
    model = infer.load(tiny_model_dir("gemma3_softcap"), backend=backend, dtype="float32", compile=False,
                       kv_dtype="float16")
    prompt = encode(tiny_model_dir("gemma3_softcap"), PROMPT)
    want = list(model.generate_tokens(prompt, max_tokens=24, ignore_eos=True))
    step = model.engine.capture_decode(compile=compiled)
    got = list(model.generate_tokens(prompt, max_tokens=24, ignore_eos=True))
    assert step.reason is None and step.steps == len(want) - 1
    assert got == want


@pytest.mark.parametrize("backend", backend_params("numpy", "torch:cpu"))
def test_batched_requests_on_a_float16_pool_get_what_each_gets_alone(backend: str) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend=backend, dtype="float32", kv_dtype="float16")
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
    assert all(engine.backend.dtype(a) == "float16" for i in pool.storage_layers(engine.model.num_cache_layers)
               for a in pool.stored(i))
    s = pool.stats()
    assert s.used == 0 and s.free + s.cached == s.total


def test_a_kv_dtype_the_backend_lacks_is_a_typed_error_naming_the_options() -> None:
    path = tiny_model_dir("llama3")
    with pytest.raises(CacheConfigError, match=r"kv_dtype='int4'.*'float16', 'float32'"):
        infer.load(path, backend="numpy", kv_dtype="int4")
    with pytest.raises(CacheConfigError, match="kv_dtype='bfloat16'"):  # numpy has no bfloat16 arrays
        infer.load(path, backend="numpy", kv_dtype="bfloat16")
    model = infer.load(path, backend="numpy")
    with pytest.raises(CacheConfigError, match="kv_dtype='q4_0'"):
        Engine(model.engine.model, model.engine.backend, kv_dtype="q4_0")


def test_the_cli_takes_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_model_dir("smollm2_like")
    assert main(["-q", "run", str(path), "Once upon a time", "-n", "8", "--ignore-eos", "--backend", "numpy",
                 "--kv-dtype", "float16"]) == 0
    want = infer.load(path, backend="numpy", kv_dtype="float16").generate("Once upon a time", max_tokens=8,
                                                                         ignore_eos=True)
    assert capsys.readouterr().out == want + "\n"
    assert main(["-q", "run", str(path), "hi", "--backend", "numpy", "--kv-dtype", "float8"]) == 1
    assert "kv_dtype='float8'" in capsys.readouterr().err


def test_the_benchmark_passes_kv_dtype_and_marks_it_approximate(tmp_path: Path) -> None:
    path = tiny_model_dir("smollm2_like")
    with pytest.raises(bench.BenchmarkError, match="kv_dtype='float8'"):
        bench.unavailable_reason(bench.infer_engine("numpy", kv_dtype="float8"), path)
    out = tmp_path / "r.json"
    assert main(["bench", str(path), "--backend", "numpy", "--kv-dtype", "float16", "--peers", "none",
                 "--repeats", "1", "--prompt-tokens", "8", "--new-tokens", "4", "--warmup-tokens", "0",
                 "--no-bandwidth", "--no-plot", "-o", str(out)]) == 0
    (row,) = json.loads(out.read_text())["engines"]
    assert row["status"] == "ok" and row["options"]["kv_dtype"] == "float16"
    assert row["label"] == "infer numpy kv_dtype=float16 (approximate)"
