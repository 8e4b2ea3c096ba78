"""LoRA adapters match PEFT in float32: alone, mixed in one batch, merged, on numpy, torch and MLX.

Adapters are built as tests/adapters_reference.py says (PEFT's own ``get_peft_model`` on the
tiny reference models, every factor redrawn). Tolerance: ``reference.LOGIT_RTOL * max|logit|``
(2.0e-5), the float32 bound the families' parity tests use: an adapter adds two thin
products per projection (rank 4-8, far shorter reductions than the layer's own), so the
rounding envelope of the tiny models holds, while a wrong scale, factor or row moves the
logits by far more (each adapter here moves them by ~1 relative to the base's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapters_reference import ALL_SEVEN, build_peft_adapter, peft_greedy, peft_logits
from reference import LOGIT_RTOL, assert_greedy_equal, backend_params, assert_logits_close, encode, reference_logits, tiny_model_dir

import infer
from infer.ops import PackedWeight
from infer.errors import (
    AdapterInUseError,
    AdapterLimitError,
    AdapterMergeError,
    AdapterMismatchError,
    AdapterNotFoundError,
    AdapterResizesEmbeddingsError,
    UnsupportedAdapterError,
)

BACKENDS = ("numpy", "torch:cpu", "mlx:cpu")  # each test taking `backend` runs on each (tests/conftest.py)
VARIANTS_UNDER_TEST = ("llama3", "qwen3", "gemma3")
PROMPT = "The capital of France is Paris. Once upon a time"
#: The two adapters of the done-when check: LoRA on all seven projections (r=4, alpha=8),
#: and rsLoRA (r=8, scale alpha / sqrt(r)).
ADAPTERS: dict[str, dict[str, Any]] = {
    "lora": dict(r=4, lora_alpha=8, seed=1),
    "rslora": dict(r=8, lora_alpha=8, use_rslora=True, seed=2),
}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per variant, the two adapters' PEFT folders."""
    root = tmp_path_factory.mktemp("adapters")
    return {v: {name: build_peft_adapter(tiny_model_dir(v), root / v / name, **kw) for name, kw in ADAPTERS.items()}
            for v in VARIANTS_UNDER_TEST}


_MODELS: dict[tuple[str, str], Any] = {}


def adapted_model(variant: str, backend: str, dirs: dict[str, Path]) -> Any:
    """The variant on the backend with both adapters loaded (once per process)."""
    key = (variant, backend)
    if key not in _MODELS:
        _MODELS[key] = infer.load(tiny_model_dir(variant), backend=backend, adapters=dirs)
    return _MODELS[key]


def infer_logits(model: Any, ids: list[int], adapter: str | None, decode: list[int] = ()) -> np.ndarray:
    """Every row's logits: the prompt in one forward, then ``decode`` one token at a time."""
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence(adapter=adapter)
    rows = [ops.to_numpy(engine.forward(seq, ids, all_logits=True))]
    rows += [ops.to_numpy(engine.forward(seq, [t]))[-1:] for t in decode]
    engine.release(seq)
    return np.concatenate(rows)


@pytest.mark.parametrize("variant", VARIANTS_UNDER_TEST)
@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_logits_match_peft(variant: str, kind: str, backend: str, adapter_dirs: dict) -> None:
    path = tiny_model_dir(variant)
    ids, decode = encode(path, PROMPT), encode(path, " the quick")
    want = peft_logits(path, {kind: adapter_dirs[variant][kind]}, [ids + decode])[0]
    model = adapted_model(variant, backend, adapter_dirs[variant])
    got = infer_logits(model, ids, kind, decode)
    assert_logits_close(got, want, f"{variant} {kind} {backend}")
    base = reference_logits(path, ids, [])["prefill"]
    assert np.abs(want[:len(ids)] - base).max() > 0.1 * np.abs(base).max()  # the adapter matters


#: The mixed batch on every family on numpy, and on one family on torch and MLX: which
#: rows use which adapter is the engine's bookkeeping, the same on every backend (each
#: backend's lora_linear is checked by the conformance kit).
MIXED = [pytest.param(v, "numpy") for v in VARIANTS_UNDER_TEST] + [
    pytest.param("qwen3", b.values[0], marks=b.marks) for b in backend_params("torch:cpu", "mlx:cpu")]


@pytest.mark.parametrize("variant,backend", MIXED)
def test_one_batch_of_two_adapters_and_the_base_equals_peft(variant: str, backend: str, adapter_dirs: dict) -> None:
    path = tiny_model_dir(variant)
    ids = encode(path, PROMPT)
    rows = [ids, ids[::-1], ids[1:] + ids[:1]]  # equal lengths: PEFT's batch has no padding
    want = peft_logits(path, adapter_dirs[variant], rows, ["lora", "rslora", "__base__"])
    model = adapted_model(variant, backend, adapter_dirs[variant])
    engine, ops = model.engine, model.backend
    seqs = [engine.new_sequence(adapter=a) for a in ("lora", "rslora", None)]
    logits = ops.to_numpy(engine.run(engine.prepare(seqs, rows, all_logits=True)).logits)
    for i, name in enumerate(("lora", "rslora", "base")):
        assert_logits_close(logits[i * len(ids):(i + 1) * len(ids)], want[i], f"{variant} {backend} row {name}")
    # The next step mixes decode rows of the three in one forward too.
    step = engine.run(engine.prepare(seqs, [[5], [6], [7]]))
    want_next = peft_logits(path, adapter_dirs[variant], [r + [t] for r, t in zip(rows, (5, 6, 7))],
                            ["lora", "rslora", "__base__"])[:, -1]
    assert_logits_close(ops.to_numpy(step.logits), want_next, f"{variant} {backend} mixed decode")
    for seq in seqs:
        engine.release(seq)


def test_greedy_tokens_match_peft_generate(adapter_dirs: dict) -> None:
    path = tiny_model_dir("qwen3")
    ids = encode(path, PROMPT)
    adapter = adapter_dirs["qwen3"]["lora"]
    want = peft_greedy(path, adapter, ids, 12)
    model = adapted_model("qwen3", "numpy", adapter_dirs["qwen3"])
    got = list(model.generate_tokens(ids, max_tokens=12, ignore_eos=True, adapter="lora"))
    ref = peft_logits(path, {"lora": adapter}, [ids + want[:-1]])[0][len(ids) - 1:]
    assert_greedy_equal(got, want, ref, LOGIT_RTOL, "qwen3 lora greedy")


def test_batch_of_prompts_with_one_adapter_each_equals_each_alone(adapter_dirs: dict) -> None:
    model = adapted_model("llama3", "numpy", adapter_dirs["llama3"])
    prompts = [PROMPT, "Once upon a time", PROMPT]
    names = ["lora", "rslora", None]
    together = model.generate(prompts, adapter=names, max_tokens=8, ignore_eos=True)
    alone = [model.generate(p, adapter=n, max_tokens=8, ignore_eos=True) for p, n in zip(prompts, names)]
    assert together == alone
    assert together[0] != together[2]  # the same prompt under an adapter and under the base differs
    assert model.adapters.in_use("lora") == 0 and model.adapters.in_use("rslora") == 0


def test_merged_equals_unmerged_and_unmerging_restores_the_base(adapter_dirs: dict) -> None:
    path = tiny_model_dir("llama3")
    ids = encode(path, PROMPT)
    unmerged = infer_logits(adapted_model("llama3", "numpy", adapter_dirs["llama3"]), ids, "rslora")
    model = infer.load(path, backend="numpy")
    base = infer_logits(model, ids, None)
    model.load_adapter("rslora", adapter_dirs["llama3"]["rslora"], merge=True)
    assert_logits_close(infer_logits(model, ids, None), unmerged, "merged")
    assert_logits_close(infer_logits(model, ids, "rslora"), unmerged, "merged, named")
    with pytest.raises(AdapterMergeError, match="merged"):
        model.load_adapter("lora", adapter_dirs["llama3"]["lora"])
    model.unload_adapter("rslora")
    assert_logits_close(infer_logits(model, ids, None), base, "unmerged again")


def test_merge_is_refused_on_a_quantized_base(adapter_dirs: dict) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend="numpy", quantize="q8")
    with pytest.raises(AdapterMergeError, match="quantized"):
        model.load_adapter("a", adapter_dirs["llama3"]["lora"], merge=True)
    model.load_adapter("a", adapter_dirs["llama3"]["lora"])  # unmerged: the base products stay quantized
    assert all(isinstance(w.base, PackedWeight) for w in model.adapters.adapted.values())
    ids = encode(tiny_model_dir("llama3"), PROMPT)
    exact = adapted_model("llama3", "numpy", adapter_dirs["llama3"])
    q8_error = np.abs(infer_logits(model, ids, None) - infer_logits(exact, ids, None)).max()
    got, want = infer_logits(model, ids, "a"), infer_logits(exact, ids, "lora")
    # What differs is q8's rounding of the base weights, which the adapter's larger activations
    # carry further (2x here); the term itself is exact on a quantized base (kit case lora_linear-Q4_0).
    assert np.abs(got - want).max() < 4 * q8_error < 0.5 * np.abs(got - infer_logits(model, ids, None)).max()


def test_prefix_cache_keys_by_adapter_and_reload_invalidates(adapter_dirs: dict, tmp_path: Path) -> None:
    path = tiny_model_dir("llama3")
    dirs = adapter_dirs["llama3"]
    model = infer.load(path, backend="numpy", adapters={"a": dirs["lora"], "b": dirs["rslora"]})
    engine, ops = model.engine, model.backend
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    ids = encode(path, PROMPT)

    def run(adapter: str | None) -> tuple[int, np.ndarray]:
        seq = engine.new_sequence(kv_pool=pool, adapter=adapter)
        reused = seq.cache.reuse_prefix(ids[:-1])
        seq.tokens = ids[:reused]
        logits = ops.to_numpy(engine.forward(seq, ids[reused:]))[-1]
        engine.release(seq)
        return reused, logits

    cold = {name: infer_logits(adapted_model("llama3", "numpy", dirs), ids, name)[-1]
            for name in ("lora", "rslora", None)}
    assert run("a")[0] == 0
    reused, logits = run("a")
    assert reused > 0
    assert_logits_close(logits, cold["lora"], "a, warm")
    reused, logits = run("b")  # A's blocks are cached: B must not read them
    assert reused == 0
    assert_logits_close(logits, cold["rslora"], "b after a")
    assert run(None)[0] == 0
    model.load_adapter("a", dirs["rslora"])  # same name, other weights
    reused, logits = run("a")
    assert reused > 0  # B's blocks: the same content, so the same keys, reused rightly
    assert_logits_close(logits, cold["rslora"], "a reloaded with b's weights")
    shutil.copytree(dirs["lora"], tmp_path / "c")
    model.load_adapter("a", tmp_path / "c")
    reused, logits = run("a")
    assert_logits_close(logits, cold["lora"], "a reloaded back")


def test_patterns_subsets_and_regex_targets_match_peft(tmp_path: Path) -> None:
    path = tiny_model_dir("qwen3")
    ids = encode(path, PROMPT)
    cases = {
        "subset": dict(r=6, lora_alpha=3, target_modules=["q_proj", "v_proj", "down_proj"], seed=3),
        "regex": dict(r=2, lora_alpha=16, target_modules=r".*\.(k_proj|up_proj)", seed=4),
        "patterns": dict(r=4, lora_alpha=8, target_modules=list(ALL_SEVEN), seed=5,
                         rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 8},
                         alpha_pattern={"v_proj": 32, "gate_proj": 1}, use_rslora=True),
        "head": dict(r=4, lora_alpha=8, target_modules=["o_proj"], modules_to_save=["lm_head"], seed=6),
    }
    model = infer.load(path, backend="numpy")
    for name, kw in cases.items():
        folder = build_peft_adapter(path, tmp_path / name, **kw)
        model.load_adapter(name, folder)
        want = peft_logits(path, {name: folder}, [ids])[0]
        assert_logits_close(infer_logits(model, ids, name), want, name)


def test_modules_to_save_runs_alone_in_a_batch(tmp_path: Path) -> None:
    path = tiny_model_dir("llama3")
    folder = build_peft_adapter(path, tmp_path / "h", target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = infer.load(path, backend="numpy", adapters={"h": folder})
    engine = model.engine
    seqs = [engine.new_sequence(adapter="h"), engine.new_sequence()]
    with pytest.raises(infer.errors.AdapterError, match="modules_to_save"):
        engine.run(engine.prepare(seqs, [[1, 2], [3, 4]]))


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_refusals_name_the_problem(adapter_dirs: dict, tmp_path: Path) -> None:
    path = tiny_model_dir("llama3")
    dirs = adapter_dirs["llama3"]
    model = infer.load(path, backend="numpy")
    with pytest.raises(UnsupportedAdapterError, match="DoRA"):
        model.load_adapter("d", _edit_config(dirs["lora"], tmp_path / "dora", use_dora=True))
    with pytest.raises(AdapterMismatchError, match="another base model"):
        model.load_adapter("q", adapter_dirs["qwen3"]["lora"])  # qwen3's projections have other shapes
    folder = build_peft_adapter(path, tmp_path / "embed", target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    name = next(k for k in tensors if "embed_tokens" in k)
    tensors[name] = np.concatenate([tensors[name], np.zeros((2, tensors[name].shape[1]), np.float32)])
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterResizesEmbeddingsError, match="adds tokens"):
        model.load_adapter("e", folder)
    small = infer.load(path, backend="numpy", max_lora_rank=4, max_cpu_loras=1, max_loras=1)
    with pytest.raises(AdapterLimitError, match="max_lora_rank=4"):
        small.load_adapter("r8", dirs["rslora"])
    small.load_adapter("a", dirs["lora"])
    with pytest.raises(AdapterLimitError, match="max_cpu_loras=1"):
        small.load_adapter("b", dirs["lora"])
    with pytest.raises(AdapterNotFoundError, match="'zz'"):
        small.generate("hi", adapter="zz", max_tokens=2)
    model.load_adapter("a", dirs["lora"])
    model.load_adapter("b", dirs["rslora"])
    engine = model.engine
    seqs = [engine.new_sequence(adapter="a"), engine.new_sequence(adapter="b")]
    model.adapters.max_loras = 1
    with pytest.raises(AdapterLimitError, match="max_loras=1"):
        engine.run(engine.prepare(seqs, [[1, 2], [3, 4]]))
    model.adapters.max_loras = 8
    stream = model.generate(PROMPT, adapter="a", max_tokens=4, stream=True, ignore_eos=True)
    first = next(iter(stream))
    with pytest.raises(AdapterInUseError, match="'a'"):
        model.unload_adapter("a")
    rest = "".join(stream)
    assert first + rest == model.generate(PROMPT, adapter="a", max_tokens=4, ignore_eos=True)
    for seq in seqs:
        engine.release(seq)
    del seqs
    model.adapters.get("a")  # still loaded


@pytest.mark.parametrize("variant", ["llama3", "gemma3"])
def test_peft_to_gguf_adapter_gives_the_same_logits(variant: str, tmp_path: Path) -> None:
    """llama3: Q/K rows in llama.cpp's permuted order; rsLoRA and patterns folded into lora_b."""
    path = tiny_model_dir(variant)
    folder = build_peft_adapter(path, tmp_path / "a", r=8, lora_alpha=8, use_rslora=True, seed=7,
                                rank_pattern={"q_proj": 4}, alpha_pattern={"down_proj": 3})
    gguf_path = infer.convert(folder, tmp_path / "a.gguf")
    from infer.formats.gguf_file import read_gguf

    file = read_gguf(gguf_path)
    assert (file.metadata["general.type"], file.metadata["adapter.type"]) == ("adapter", "lora")
    assert file.metadata["adapter.lora.alpha"] == 8.0
    file.close()
    ids = encode(path, PROMPT)
    want = peft_logits(path, {"a": folder}, [ids])[0]
    model = infer.load(path, backend="numpy", adapters={"g": gguf_path})
    assert_logits_close(infer_logits(model, ids, "g"), want, f"{variant} through GGUF")
    other = infer.load(tiny_model_dir("qwen3"), backend="numpy")
    with pytest.raises(AdapterMismatchError, match="another base model"):
        other.load_adapter("g", gguf_path)


def test_llama_cpp_loads_a_converted_adapter(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")  # an optional peer, not a CI requirement
    path = tiny_model_dir("llama3")
    folder = build_peft_adapter(path, tmp_path / "a", use_rslora=True, seed=8)
    adapter = infer.convert(folder, tmp_path / "a.gguf")
    base = infer.convert(path, tmp_path / "base.gguf", type="f32")
    # A float32 KV cache: llama.cpp's default float16 one alone puts the last positions' logits
    # 0.7% of the largest apart from PEFT's (float32: 8e-6), more than the adapter's own effect here.
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter), n_ctx=64, logits_all=True, verbose=False,
                          type_k=f32, type_v=f32)
    ids = encode(path, PROMPT)
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)], np.float32)
    want = peft_logits(path, {"a": folder}, [ids])[0]
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_base_requests_keep_the_captured_step_and_speculation_keeps_the_adapter(adapter_dirs: dict) -> None:
    path = tiny_model_dir("llama3")
    model = adapted_model("llama3", "numpy", adapter_dirs["llama3"])
    plain = infer.load(path, backend="numpy")
    step = model.engine.decode_step
    assert step is not None  # numpy captures its decode step by default
    before = step.steps
    assert model.generate(PROMPT, max_tokens=8, ignore_eos=True) == plain.generate(PROMPT, max_tokens=8,
                                                                                   ignore_eos=True)
    assert step.steps > before  # the base request's steps replayed the recorded program
    with_adapter = model.generate(PROMPT, adapter="lora", max_tokens=12, ignore_eos=True)
    assert model.generate(PROMPT, adapter="lora", max_tokens=12, ignore_eos=True, speculative="ngram") == with_adapter


@pytest.mark.parametrize("variant", ["phi3", "gpt2", "gemma4"])
def test_other_families_alone_and_mixed_match_peft(variant: str, tmp_path: Path) -> None:
    """Adapters attach where each family reads its weights: Phi-3's stored qkv_proj and gate_up_proj,
    GPT-2's Conv1D (PEFT's fan_in_fan_out), Gemma 4's own layer objects; "all-linear" as PEFT picks."""
    path = tiny_model_dir(variant)
    a = build_peft_adapter(path, tmp_path / "a", target_modules="all-linear", seed=21)
    b = build_peft_adapter(path, tmp_path / "b", r=2, lora_alpha=4, use_rslora=True, target_modules="all-linear",
                           seed=22)
    ids = encode(path, PROMPT)
    rows = [ids, ids[::-1], ids]
    want = peft_logits(path, {"a": a, "b": b}, rows, ["a", "b", "__base__"])
    model = infer.load(path, backend="numpy", adapters={"a": a, "b": b})
    engine, ops = model.engine, model.backend
    seqs = [engine.new_sequence(adapter=x) for x in ("a", "b", None)]
    got = ops.to_numpy(engine.run(engine.prepare(seqs, rows, all_logits=True)).logits).reshape(want.shape)
    assert_logits_close(got, want, f"{variant} mixed batch")
