"""Model.save_state / Model.load_state: a prompt's state outlives its process.

Per family kind — llama (full attention), gemma3 (sliding windows), gemma4 (windows of two
head sizes and shared-KV layers), qwen3_5 (gated DeltaNet), granitemoehybrid (Mamba2) — and
per backend, a state is saved here and restored in a NEW process, which continues the
prompt: its logits must equal those of one uninterrupted forward within float32 rounding
(1e-5 relative, the warm prefix hit's tolerance), and only the tokens after the saved ones
are computed (counted). A state saved by another model or cache setting, a damaged file,
and tensor parallelism are refused with typed errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from reference import backend_params, load_tiny, tiny_model_dir

import infer
from infer.engine.generate import StopConditions
from infer.errors import StateFileError, StateMismatchError, StateUnsupportedError

FAMILIES = ("llama3", "gemma3", "gemma4", "qwen3_5", "granitemoehybrid")
RNG = np.random.default_rng(11)
PROMPT = [int(t) for t in RNG.integers(3, 250, 64)]
#: Saved prefixes: one ending inside a block (a tail of 13 after 2 blocks of 16), one on a boundary.
SAVED = {"tail": 45, "boundary": 48}
#: Tokens of the request that continues each saved prefix.
CONTINUE = 60

# The restoring process: loads the model, the state, and continues the prompt.
RESTORE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import infer
    from infer.engine.generate import StopConditions
    job = json.loads(sys.argv[1])
    out = {}
    for variant, case in job["cases"]:
        model = infer.load(job["dirs"][variant], backend=job["backend"])
        restored = model.load_state(job["files"][variant + "/" + case])
        prompt = job["prompt"][:job["continue"]]
        engine, pool = model.engine, model.batch_engine.pool
        seq = engine.new_sequence(len(prompt), kv_pool=pool)
        reused = seq.cache.reuse_prefix(prompt[:-1])
        seq.tokens = prompt[:reused]
        logits = model.backend.to_numpy(engine.forward(seq, prompt[reused:], all_logits=True))
        engine.release(seq)
        other = infer.load(job["dirs"][variant], backend=job["backend"])  # a cache holding the saved state only
        other.load_state(job["files"][variant + "/" + case])
        done = other.complete(prompt, max_tokens=4, ignore_eos=True)
        path = job["out"] + "/" + variant + "-" + case + ".npy"
        np.save(path, logits)
        # A request of exactly the saved tokens: every position and the logits after them come back.
        saved = job["prompt"][:job["saved"][case]]
        exact = infer.load(job["dirs"][variant], backend=job["backend"])
        exact.load_state(job["files"][variant + "/" + case])
        seq = exact.engine.new_sequence(len(saved) + 1, kv_pool=exact.batch_engine.pool)
        exact_reused, kept = seq.cache.reuse_prompt(saved)
        exact.engine.release(seq)
        np.save(path + ".exact.npy", kept)
        batch = exact.batch_engine
        handle = batch.submit(saved, exact.sampling_params(), StopConditions(max_tokens=3, ignore_eos=True))
        batch.run_until_done()
        single = exact.complete(saved, max_tokens=3, ignore_eos=True)
        out[variant + "/" + case] = {"restored": restored.cached, "reused": reused, "logits": path,
                                     "tokens": done.token_ids, "cached_tokens": done.usage.cached_tokens,
                                     "exact_reused": exact_reused, "exact_tokens": list(handle.tokens),
                                     "exact_cached": handle.cached_tokens,
                                     "exact_processed": batch.stats.tokens_processed,
                                     "single_tokens": single.token_ids,
                                     "single_cached": single.usage.cached_tokens}
    print(json.dumps(out))
""")


def full_logits(model: infer.Model, tokens: list[int]) -> np.ndarray:
    engine = model.engine
    seq = engine.new_sequence(len(tokens) + 1)
    logits = model.backend.to_numpy(engine.forward(seq, tokens, all_logits=True))
    engine.release(seq)
    return logits


@pytest.fixture(scope="module", params=backend_params("numpy", "torch:cpu"))
def restored(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every family's states saved here, restored and continued in one new process."""
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"states-{backend.replace(':', '-')}")
    files, want = {}, {}
    for variant in FAMILIES:
        model = infer.load(tiny_model_dir(variant), backend=backend)
        for case, n in SAVED.items():
            path = tmp / f"{variant}-{case}.state"
            saved = model.save_state(path, PROMPT[:n])
            assert saved.tokens == PROMPT[:n] and path.stat().st_size == saved.nbytes
            files[f"{variant}/{case}"] = str(path)
        prompt = PROMPT[:CONTINUE]
        greedy = list(model.generate_tokens(prompt, max_tokens=4, ignore_eos=True))
        exact = {case: list(model.generate_tokens(PROMPT[:n], max_tokens=3, ignore_eos=True))
                 for case, n in SAVED.items()}
        want[variant] = (full_logits(model, prompt), greedy, exact)
    job = {"backend": backend, "dirs": {v: str(tiny_model_dir(v)) for v in FAMILIES}, "files": files,
           "prompt": PROMPT, "continue": CONTINUE, "out": str(tmp), "saved": SAVED,
           "cases": [[v, c] for v in FAMILIES for c in SAVED]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(job)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"got": json.loads(run.stdout.strip().splitlines()[-1]), "want": want}


@pytest.mark.parametrize("case", SAVED)
@pytest.mark.parametrize("variant", FAMILIES)
def test_a_state_restored_in_a_new_process_continues_as_one_run(restored: dict, variant: str, case: str) -> None:
    got = restored["got"][f"{variant}/{case}"]
    want_logits, want_tokens, _ = restored["want"][variant]
    n = SAVED[case]
    # Only the tokens after the saved ones are computed: the whole saved prefix is found.
    assert got["restored"] == n
    assert got["reused"] == n
    logits = np.load(got["logits"])
    assert logits.shape[0] == CONTINUE - n
    want = want_logits[n:]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                               err_msg=f"{variant}, {case}: restored then continued")
    # Through the public API: the same greedy tokens, and the cached prompt tokens reported.
    assert got["tokens"] == want_tokens
    assert got["cached_tokens"] == n


@pytest.mark.parametrize("case", SAVED)
@pytest.mark.parametrize("variant", FAMILIES)
def test_a_request_of_exactly_the_saved_tokens_computes_nothing(restored: dict, variant: str, case: str) -> None:
    """The logits after the last saved token are in the file: a request repeating exactly the saved
    prefix draws its first token from them, in a new process, and feeds only what it generates."""
    got = restored["got"][f"{variant}/{case}"]
    want_logits, _, want_exact = restored["want"][variant]
    n = SAVED[case]
    assert got["exact_reused"] == n
    kept = np.load(got["logits"] + ".exact.npy")
    want = want_logits[n - 1]  # the uninterrupted forward's row after token n
    np.testing.assert_allclose(kept, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Batched: the whole prompt found, no prompt token fed; only the 2 tokens after the first are.
    assert got["exact_cached"] == n
    assert got["exact_processed"] == 2
    assert got["exact_tokens"] == want_exact[case]
    # A single request (beside the batch engine, in its pool) likewise.
    assert got["single_cached"] == n
    assert got["single_tokens"] == want_exact[case]


def test_a_saved_state_is_found_in_the_same_process_too(tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("qwen3_5"))
    path = tmp_path / "a.state"
    model.save_state(path, PROMPT[:45])
    model.batch_engine.pool.allocator.clear_prefix_cache()
    model.batch_engine.pool.state_store.allocator.clear_prefix_cache()
    assert model.load_state(path).cached == 45
    batch = model.batch_engine
    before = batch.stats.tokens_processed
    done = model.complete(PROMPT[:50], max_tokens=1, ignore_eos=True)
    assert done.usage.cached_tokens == 45
    assert batch.stats.tokens_processed == before  # single requests run beside the batch engine, in its pool
    again = model.save_state(tmp_path / "b.state", PROMPT[:45])
    assert again.cached_tokens == 45  # nothing computed: the restored state is what is saved


def test_a_saved_prompt_is_found_whole_where_it_was_saved(tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("gemma3"))
    model.save_state(tmp_path / "a.state", PROMPT[:45])
    assert model.save_state(tmp_path / "b.state", PROMPT[:45]).cached_tokens == 45
    batch = model.batch_engine
    handle = batch.submit(PROMPT[:50], model.sampling_params(), StopConditions(max_tokens=1))
    batch.run_until_done()
    assert handle.cached_tokens == 45


def test_a_conversation_is_saved_as_the_next_turns_prefix(tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}]
    saved = model.save_state(tmp_path / "chat.state", messages)
    fresh = infer.load(tiny_model_dir("llama3"))
    fresh.load_state(tmp_path / "chat.state")
    reply = fresh.complete(fresh.tokenizer.encode(fresh.tokenizer.apply_chat_template(messages),
                                                  add_special_tokens=False), max_tokens=2)
    assert reply.usage.cached_tokens == len(saved.tokens)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "a.state"
    load_tiny("llama3").save_state(path, PROMPT[:40])
    return path


def test_another_kv_dtype_is_refused(saved_llama: Path) -> None:
    half = infer.load(tiny_model_dir("llama3"), kv_dtype="float16")
    with pytest.raises(StateMismatchError, match="kv_dtype") as info:
        half.load_state(saved_llama)
    assert info.value.field == "kv_dtype"


def test_another_block_size_is_refused(saved_llama: Path) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    model.configure_batching(block_size=8)
    with pytest.raises(StateMismatchError, match="block_size"):
        model.load_state(saved_llama)


def copy_model(tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir("llama3"), copy)
    return copy


def test_other_weights_of_the_same_shapes_are_refused(saved_llama: Path, tmp_path: Path) -> None:
    copy = copy_model(tmp_path)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight: same header, same sizes (a re-quantized file)
    weights.write_bytes(bytes(data))
    with pytest.raises(StateMismatchError, match="weights") as info:
        infer.load(copy).load_state(saved_llama)
    assert info.value.field == "weights"


def test_another_tokenizer_is_refused(saved_llama: Path, tmp_path: Path) -> None:
    copy = copy_model(tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(StateMismatchError) as info:
        infer.load(copy).load_state(saved_llama)
    assert info.value.field == "tokenizer"


def test_a_damaged_file_is_refused(saved_llama: Path, tmp_path: Path) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    raw = saved_llama.read_bytes()
    cut = tmp_path / "cut.state"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(StateFileError):
        model.load_state(cut)
    flipped = tmp_path / "flipped.state"
    flipped.write_bytes(raw[:-100] + bytes([raw[-100] ^ 4]) + raw[-99:])
    with pytest.raises(StateFileError, match="checksum"):
        model.load_state(flipped)
    assert model.batch_engine.pool.stats().prefix_blocks == 0  # nothing of it entered the cache


def test_a_file_without_the_final_logits(saved_llama: Path, tmp_path: Path) -> None:
    """One that says it has them and lacks them is refused; one written before they were kept loads,
    and a request of exactly its tokens then computes its last block (the rest stays cached)."""
    from infer.kv.state_file import read_state_file, write_state_file

    state = read_state_file(saved_llama)
    assert state.info["logits"] is True and state.tensors["logits"].data.shape == (load_tiny("llama3").network.vocab_size,)
    tensors = {k: v for k, v in state.tensors.items() if k != "logits"}
    lying = tmp_path / "lying.state"
    write_state_file(lying, dict(state.info), tensors)
    with pytest.raises(StateFileError, match="logits"):
        infer.load(tiny_model_dir("llama3")).load_state(lying)
    older = tmp_path / "older.state"
    write_state_file(older, {k: v for k, v in state.info.items() if k != "logits"}, tensors)
    model = infer.load(tiny_model_dir("llama3"))
    restored = model.load_state(older)
    assert restored.cached == 40 and not restored.logits
    assert model.complete(PROMPT[:40], max_tokens=1).usage.cached_tokens == 32


def test_tensor_parallelism_is_refused(saved_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = infer.load(tiny_model_dir("llama3"))
    monkeypatch.setattr(model.backend, "world_size", 2)  # what a tensor-parallel model's backend reports
    with pytest.raises(StateUnsupportedError, match="tensor parallel"):
        model.save_state(tmp_path / "x.state", PROMPT[:20])
    with pytest.raises(StateUnsupportedError, match="tensor parallel"):
        model.load_state(saved_llama)


@pytest.mark.parametrize("variant", ["mamba2", "gemma3"])
def test_a_fresh_model_continues_from_a_loaded_state(variant: str, tmp_path: Path) -> None:
    """A pure recurrent model (its blocks are bookkeeping only) and windows, through generate_tokens."""
    path = tmp_path / "a.state"
    infer.load(tiny_model_dir(variant)).save_state(path, PROMPT[:45])
    model = infer.load(tiny_model_dir(variant))
    assert model.load_state(path).cached == 45
    gen = model.generate_tokens(PROMPT[:50], max_tokens=4, ignore_eos=True)
    tokens = list(gen)
    assert gen.cached_tokens == 45
    assert tokens == list(infer.load(tiny_model_dir(variant)).generate_tokens(PROMPT[:50], max_tokens=4,
                                                                               ignore_eos=True))


def test_a_state_saved_with_separate_pages_loads_into_shared_pages(tmp_path: Path) -> None:
    from infer.engine.batch import BatchEngine
    from infer.saved_state import load_state

    path = tmp_path / "a.state"
    infer.load(tiny_model_dir("gemma3")).save_state(path, PROMPT[:45])
    model = infer.load(tiny_model_dir("gemma3"))
    pool = model.engine.new_kv_pool(block_size=16, num_blocks=64, shared_pages=True)
    assert pool.shared_pages
    assert load_state(model, path, BatchEngine(model.engine, kv_pool=pool)).cached == 45
    engine = model.engine
    seq = engine.new_sequence(60, kv_pool=pool)
    assert seq.cache.reuse_prefix(PROMPT[:59]) == 45
    seq.tokens = PROMPT[:45]
    got = model.backend.to_numpy(engine.forward(seq, PROMPT[45:60], all_logits=True))
    want = full_logits(model, PROMPT[:60])[45:]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")
def test_a_real_tensor_parallel_model_refuses(saved_llama: Path, tmp_path: Path) -> None:
    with infer.load(tiny_model_dir("llama3"), backend="torch:cpu", tensor_parallel=2) as parallel:
        with pytest.raises(StateUnsupportedError, match="tensor parallel"):
            parallel.save_state(tmp_path / "x.state", PROMPT[:20])
        with pytest.raises(StateUnsupportedError, match="tensor parallel"):
            parallel.load_state(saved_llama)
        with pytest.raises(StateUnsupportedError, match="tensor parallel"):
            parallel.configure_batching(prompt_cache_dir=tmp_path / "cache")
