"""Tensor parallelism on torch/cpu over gloo (infer.distributed, docs/distributed.md).

Each model is loaded once per module, in one process and over ranks, and the two
must agree: greedy tokens equal (single sequence and batched, the batch through the
paged cache), prefill logits within ``reference.LOGIT_RTOL * max|logit|``. That
float32 tolerance is the one the family tests use between two correct float32
implementations that sum in different orders, and it is the right one here: the
all-reduce of a row-parallel product adds the ranks' partial dot products, each
over 1/N of the inner dimension, where one process adds them in one BLAS loop —
the same values, summed in another order (rounding of order u sqrt(K) per output).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reference import LOGIT_RTOL, encode, tiny_model_dir

import infer
from infer.errors import TensorParallelConfigError, WorkerError
from infer.ops import ShardedWeight

pytest.importorskip("torch")
import torch.distributed  # noqa: E402

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch has no gloo backend", allow_module_level=True)

PROMPT = "The capital of France is Paris. Once upon a time"
STEPS = 10
#: llama (GQA), qwen2 (biases, tied), qwen3 (q/k norms, head_dim 24), gemma3, two MoE
#: families (each expert's intermediate dim sharded), smollm3 (NoPE layers, o_proj and
#: down_proj biases: added once, after the sum) and granite (its multipliers and logit
#: scaling); five have one KV head, replicated on both ranks (qwen3_bias, mixtral_top3,
#: smollm3_pattern, granite_bias, gemma3).
FAMILIES = ("llama3", "qwen2", "qwen3", "gemma3", "mixtral", "qwen3_moe", "qwen3_bias", "mixtral_top3",
            "smollm3_pattern", "granite_bias")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """(single-process model, 2-rank model, prompt ids) of one family."""
    path = tiny_model_dir(request.param)
    single = infer.load(path, backend="torch:cpu")
    _close_open()
    parallel = _OPEN["pair"] = infer.load(path, backend="torch:cpu", tensor_parallel=2)
    for model in (single, parallel):  # a small paged pool: zeroing the default 256 MiB costs seconds
        model.configure_batching(kv_memory=4 << 20)
    yield single, parallel, encode(path, PROMPT)
    parallel.close()


#: The open 2-rank model of ``pair``: a process has one default process group, so
#: the other tests close it before loading their own (pytest runs a module-scoped
#: parameter's tests together, so none of them needs it again).
_OPEN: dict[str, infer.Model] = {}


def _close_open() -> None:
    for model in _OPEN.values():
        model.close()
    _OPEN.clear()


@pytest.fixture
def alone() -> None:
    """No other 2-rank model open in this process."""
    _close_open()


def _prefill_logits(model: infer.Model, ids: list[int]) -> np.ndarray:
    seq = model.engine.new_sequence(64)
    try:
        return model.backend.to_numpy(model.engine.forward(seq, ids, all_logits=True))
    finally:
        model.engine.release(seq)


def test_greedy_tokens_and_logits_equal_one_process(pair) -> None:  # type: ignore[no-untyped-def]
    single, parallel, ids = pair
    assert isinstance(parallel.network.shard.lm_head, ShardedWeight)
    want = list(single.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True))
    assert list(parallel.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True)) == want
    a, b = _prefill_logits(single, ids), _prefill_logits(parallel, ids)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) <= LOGIT_RTOL * np.max(np.abs(a))


def test_batched_generation_equals_one_process(pair) -> None:  # type: ignore[no-untyped-def]
    single, parallel, _ = pair
    prompts = ["Once upon a time", "The capital of France is", "the quick brown fox"]
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert parallel.generate(prompts, **kw) == single.generate(prompts, **kw)


def test_scoring_speculation_and_prefix_reuse_equal_one_process(pair) -> None:  # type: ignore[no-untyped-def]
    single, parallel, ids = pair
    text = PROMPT + " the quick brown fox jumps over the lazy dog"
    a, b = single.score(text), parallel.score(text)
    assert a.token_ids == b.token_ids
    assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    want = list(single.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True))
    assert list(parallel.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True, speculative="ngram")) == want
    # The same long prompt twice in a batch: the second reuses the first's cached blocks.
    long = [PROMPT * 2] * 2
    kw = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert parallel.generate(long, **kw) == single.generate(long, **kw)


def test_each_rank_holds_its_share_of_the_weights(alone: None) -> None:
    path = tiny_model_dir("llama3")
    single = infer.load(path, backend="torch:cpu")
    from infer.distributed.group import weight_bytes

    whole = weight_bytes(single.network, single.backend)
    with infer.load(path, backend="torch:cpu", tensor_parallel=2) as parallel:
        ranks = parallel.network.rank_weights()
        # 2 KV heads: each rank's cache holds one of them
        assert 2 * parallel.engine.kv_bytes_per_position() == single.engine.kv_bytes_per_position()
    assert len(ranks) == 2
    for r in ranks:
        sharded = sum(r[k] for k in ("heads", "kv_heads", "column", "row"))
        counted = sharded + r["vocab"] + r["replicated"]  # the walk also finds the rotary tables
        assert counted <= r["total"] <= counted + 1024
        # The untied head is split as well: half of everything but the replicated weights.
        assert r["total"] <= r["replicated"] + (whole - r["replicated"]) / 2 * 1.01
        assert r["total"] < 0.75 * whole


def test_float16_keys_and_values_on_every_rank_equal_one_process(alone: None) -> None:
    # Each worker makes its pools and caches in the driver's kv_dtype (its slice
    # descriptions carry the store's dtype): the same rounded rows as one process.
    path = tiny_model_dir("llama3")
    single = infer.load(path, backend="torch:cpu", kv_dtype="float16")
    ids = encode(path, PROMPT)
    with infer.load(path, backend="torch:cpu", tensor_parallel=2, kv_dtype="float16") as parallel:
        assert 4 * parallel.engine.kv_bytes_per_position() == infer.load(
            path, backend="torch:cpu").engine.kv_bytes_per_position()  # half the heads, half the width
        assert (list(parallel.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True))
                == list(single.generate_tokens(ids, max_tokens=STEPS, ignore_eos=True)))
        # Rounding moves logits by ~1e-3 of the largest, far past LOGIT_RTOL: a rank storing float32 would show.
        a, b = _prefill_logits(single, ids), _prefill_logits(parallel, ids)
        assert np.max(np.abs(a - b)) <= LOGIT_RTOL * np.max(np.abs(a))
        kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        parallel.configure_batching(kv_memory=4 << 20)
        single.configure_batching(kv_memory=4 << 20)
        prompts = ["Once upon a time", "The capital of France is"]
        assert parallel.generate(prompts, **kw) == single.generate(prompts, **kw)


def test_bad_tensor_parallel_arguments_are_typed_errors(alone: None) -> None:
    path = tiny_model_dir("llama3")  # 4 heads, 2 KV heads
    for bad in (0, -1, "2", 1.5):
        with pytest.raises(TensorParallelConfigError, match="at least 1"):
            infer.load(path, backend="torch:cpu", tensor_parallel=bad)
    with pytest.raises(TensorParallelConfigError, match="num_attention_heads 4 is not divisible by 3"):
        infer.load(path, backend="torch:cpu", tensor_parallel=3)
    with pytest.raises(TensorParallelConfigError, match="no native all_reduce"):
        infer.load(path, backend="numpy", tensor_parallel=2)
    with pytest.raises(TensorParallelConfigError, match="compile"):
        infer.load(path, backend="torch:cpu", tensor_parallel=2, compile=True)
    with pytest.raises(TensorParallelConfigError, match="olmo2"):
        infer.load(tiny_model_dir("olmo2"), backend="torch:cpu", tensor_parallel=2)


def test_a_killed_worker_is_a_typed_error_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch,
                                                                  alone: None) -> None:
    monkeypatch.setenv("INFER_TP_TIMEOUT", "20")
    path = tiny_model_dir("llama3")
    model = infer.load(path, backend="torch:cpu", tensor_parallel=2)
    (worker,) = model.network.group.processes
    tokens = iter(model.generate_tokens(encode(path, PROMPT), max_tokens=50, ignore_eos=True))
    next(tokens), next(tokens)
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {worker.pid}, exit code -9\) exited"):
        for _ in tokens:
            pass
    assert time.monotonic() - started < 20
    with pytest.raises(WorkerError, match="broken"):
        list(model.generate_tokens([1, 2, 3], max_tokens=2))
    model.close()
    assert worker.poll() is not None
    assert not _alive(worker.pid)


def test_close_stops_the_workers(alone: None) -> None:
    model = infer.load(tiny_model_dir("qwen3"), backend="torch:cpu", tensor_parallel=2)
    (worker,) = model.network.group.processes
    model.close()
    model.close()  # again: nothing
    assert worker.returncode == 0
    with pytest.raises(WorkerError, match="closed"):
        list(model.generate_tokens([1, 2, 3], max_tokens=2))


def test_the_cli_runs_tensor_parallel(alone: None, capsys: pytest.CaptureFixture[str]) -> None:
    from infer.tools.cli import main

    path = tiny_model_dir("llama3")
    args = ["-q", "run", str(path), PROMPT, "-n", "6", "--ignore-eos", "--backend", "torch:cpu"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main(args + ["--tensor-parallel", "2"]) == 0  # and closes the model: the next load may start a group
    assert capsys.readouterr().out == want
    assert main(args + ["--tensor-parallel", "3"]) == 1
    assert "num_attention_heads 4 is not divisible by 3" in capsys.readouterr().err


def test_workers_exit_when_the_driver_dies(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys, infer\n"
        f"m = infer.load({str(tiny_model_dir('llama3'))!r}, backend='torch:cpu', tensor_parallel=2)\n"
        "print(m.network.group.processes[0].pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


TORCHRUN_SCRIPT = """
import json, sys, time, infer
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = infer.load(path, backend="torch:cpu", tensor_parallel=2)   # ranks > 0 serve here and exit
time.sleep(6)   # idle past INFER_TP_TIMEOUT: the driver's pings keep the waiting rank's collective alive
tokens = list(model.generate_tokens(ids, max_tokens=%d, ignore_eos=True))
model.close()
open(out, "w").write(json.dumps(tokens))
""" % STEPS


def test_torchrun_launch_gives_the_same_tokens(tmp_path: Path) -> None:
    path = tiny_model_dir("qwen3")
    ids = encode(path, PROMPT)
    want = list(infer.load(path, backend="torch:cpu").generate_tokens(ids, max_tokens=STEPS, ignore_eos=True))
    script, out = tmp_path / "tp.py", tmp_path / "tokens.json"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["INFER_TP_TIMEOUT"] = "4"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), str(script), str(path), json.dumps(ids), str(out)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(out.read_text()) == want


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_real_smollm2_over_three_ranks(alone: None) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: 2 ranks cannot split it, 3 can."""
    with pytest.raises(TensorParallelConfigError, match="num_attention_heads 9 is not divisible by 2"):
        infer.load("smollm2-135m", backend="torch:cpu", tensor_parallel=2)
    # Float32 weights here, to bound the ranks' shares by; the ranks keep the GGUF blocks
    # where their slices are whole rows of blocks (checked below), dequantize the rest.
    single = infer.load("smollm2-135m", backend="torch:cpu", quantize="off")
    ids = single.tokenizer.encode("The capital of France is")
    want = list(single.generate_tokens(ids, max_tokens=12, ignore_eos=True))
    from infer.distributed.group import weight_bytes

    whole = weight_bytes(single.network, single.backend)
    with infer.load("smollm2-135m", backend="torch:cpu", tensor_parallel=3) as parallel:
        assert list(parallel.generate_tokens(ids, max_tokens=12, ignore_eos=True)) == want
        assert 3 * parallel.engine.kv_bytes_per_position() == single.engine.kv_bytes_per_position()
        ranks = parallel.network.rank_weights()
    embedding = weight_bytes(single.network.embed_tokens, single.backend)  # float32, and tied: the head too
    for r in ranks:
        # The tied head: the embedding stays whole (replicated: its Q8_0 blocks, which the ranks
        # keep as one process would), and each rank adds its third of it, dequantized, as the head.
        assert r["vocab"] <= embedding / 3 * 1.01
        sharded = r["total"] - r["replicated"] - r["vocab"]
        assert 0 < sharded <= (whole - embedding) / 3 * 1.01
        # q, k, v, gate and up split by rows: their slices stay Q4_1 blocks (0.625 bytes a
        # value, not float32's 4): 30 layers of 576x576 + 2 x 192x576 + 2 x 1536x576, a third.
        column_float32 = 30 * (576 * 576 + 2 * 192 * 576 + 2 * 1536 * 576) * 4 / 3
        assert r["heads"] + r["kv_heads"] + r["column"] < column_float32 / 4
