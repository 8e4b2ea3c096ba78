"""LoRA adapters inside the captured step, and the batch engine's adapter limits.

A continuous batch mixing adapters and the base model runs in the captured
step (infer/engine/capture.py): each row's adapter slot and scale, and the
stacked pools, are the step's inputs, so the recorded program (numpy's, and
torch/cpu's, of the C kernels: backends/cpu/plan.c, OP_LORA) serves every
mix of adapters with one graph per bucket. Checked on a tiny Qwen3 with
LoRA (r=4, alpha=8) and rsLoRA (r=8) adapters on all seven projections:

* decode steps of one batch of [A, B, base] give PEFT's logits
  (``adapter_names=["a", "b", "__base__"]``) and the eager forward's within
  ``LOGIT_RTOL`` (the tolerance of tests/test_adapters.py, which argues it;
  the program's adapter product and SiLU call the eager numpy ops' own
  kernels, but its rope tables use the C library's transcendentals, a few ulp
  from numpy's: measured 5e-6 of logits of ~7 here); the counts show every
  decode step was captured and that a new mix of adapters made no new graph;
* ``max_loras`` holds a request back until a running one frees its
  adapter's place, instead of failing the forward;
* a KV pool sized by a memory budget withholds pages for the adapters' bytes;
* tensor parallelism refuses adapters by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from adapters_reference import build_peft_adapter, peft_logits
from infer.backends import numpy as numpy_backend
from reference import LOGIT_RTOL, assert_logits_close, backend_params, encode, tiny_model_dir

import infer
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.errors import UnsupportedAdapterError

HAS_PROGRAMS = hasattr(numpy_backend._affine, "run_plan")
VARIANT = "qwen3"
PROMPT = "The capital of France is Paris. Once upon a time"
BACKENDS = [pytest.param("numpy", marks=pytest.mark.skipif(not HAS_PROGRAMS, reason="no C kernels")),
            *backend_params("torch:cpu")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, path = tmp_path_factory.mktemp("captured-adapters"), tiny_model_dir(VARIANT)
    return {"a": build_peft_adapter(path, root / "a", r=4, lora_alpha=8, seed=31),
            "b": build_peft_adapter(path, root / "b", r=8, lora_alpha=8, use_rslora=True, seed=32)}


def decode_mixed(model: infer.Model, rows: list[list[int]], names: list[str | None],
                 feeds: list[list[int]]) -> list[np.ndarray]:
    """Prefill ``rows`` in one forward of a paged pool, then feed ``feeds[i]``
    (one token per sequence) step by step; each step's logits."""
    engine, ops = model.engine, model.backend
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    seqs = [engine.new_sequence(64, kv_pool=pool, adapter=n) for n in names]
    engine.run(engine.prepare(seqs, rows))
    out = [ops.to_numpy(engine.run(engine.prepare(seqs, [[t] for t in feed])).logits) for feed in feeds]
    for seq in seqs:
        engine.release(seq)
    return [np.asarray(o, np.float32) for o in out]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_adapter_batches_decode_in_the_captured_step(backend: str, dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    ids = encode(path, PROMPT)
    rows = [ids, ids[::-1], ids[1:] + ids[:1]]
    feeds = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    names = ["a", "b", None]
    eager = infer.load(path, backend=backend, adapters=dirs, compile=False)
    captured = infer.load(path, backend=backend, adapters=dirs)
    step = captured.engine.batch_step
    assert step is not None and step.compiled  # numpy and torch/cpu record programs by default
    want_eager = decode_mixed(eager, rows, names, feeds)
    got = decode_mixed(captured, rows, names, feeds)
    assert step.reason is None and not step.refused, step.describe()
    assert step.adapter_steps == len(feeds), step.describe()  # every decode step with adapter rows was captured
    graphs = step.graphs
    want_peft = peft_logits(path, dirs, [r + [f[i] for f in feeds] for i, r in enumerate(rows)],
                            ["a", "b", "__base__"])
    for k, (g, e) in enumerate(zip(got, want_eager)):
        assert_logits_close(g, e, f"{backend} step {k}: captured vs eager")
        assert_logits_close(g, want_peft[:, len(ids) + k], f"{backend} step {k}: captured vs PEFT")
    # Another mix of the same adapters (and a scale) in the same bucket: no new graph.
    engine = captured.engine
    pool = engine.new_kv_pool(block_size=4, num_blocks=64)
    seqs = [engine.new_sequence(64, kv_pool=pool, adapter=n, adapter_scale=s)
            for n, s in (("b", 1.0), ("b", 0.5), ("a", 1.0))]
    engine.run(engine.prepare(seqs, rows))
    before = step.adapter_steps
    for t in (3, 4):
        engine.run(engine.prepare(seqs, [[t]] * 3))
    assert step.adapter_steps == before + 2 and step.graphs == graphs, step.describe()


def torch_compile_runs() -> str | None:
    """Why torch.compile cannot run here (None: it can): Inductor builds C++
    kernels on the CPU, which needs a working compiler."""
    import torch

    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4))
    except Exception as err:  # any failure of the toolchain, reported as the skip's reason
        return f"torch.compile cannot run on this machine: {type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("backend", backend_params("torch:cpu"))
def test_torch_compile_runs_the_gathered_adapter_product(backend: str, dirs: dict) -> None:
    """``compile=True`` on torch/cpu: the captured batch step is a torch.compile (Inductor)
    graph, inside which ``lora_linear`` is the contract's gathered form (each row's
    factors taken by its slot; the eager torch op reads segments on the host, which a
    graph cannot). A batch of [A, B, base] equals PEFT and the eager forward within
    ``LOGIT_RTOL`` (Inductor fuses and reorders the sums: measured 1.2e-5 from eager and
    1.7e-5 from PEFT, of logits up to 18.8), every decode step is captured, and a new
    mix is no new graph; one sequence's greedy step gives eager's tokens. Skipped, saying
    why, where torch.compile cannot run."""
    reason = torch_compile_runs()
    if reason is not None:
        pytest.skip(reason)
    path = tiny_model_dir(VARIANT)
    ids = encode(path, PROMPT)
    rows = [ids, ids[::-1], ids[1:] + ids[:1]]
    feeds = [[5, 6, 7], [8, 9, 10]]
    eager = infer.load(path, backend=backend, adapters=dirs, compile=False)
    compiled = infer.load(path, backend=backend, adapters=dirs, compile=True)
    step = compiled.engine.batch_step
    assert step is not None and step.compiled and compiled.backend.graph_capture
    want_eager = decode_mixed(eager, rows, ["a", "b", None], feeds)
    got = decode_mixed(compiled, rows, ["a", "b", None], feeds)
    assert step.reason is None and not step.refused and step.adapter_steps == len(feeds), step.describe()
    assert step.graphs == 1, step.describe()  # Inductor compiled the step once
    want_peft = peft_logits(path, dirs, [r + [f[i] for f in feeds] for i, r in enumerate(rows)],
                            ["a", "b", "__base__"])
    for k, (g, e) in enumerate(zip(got, want_eager)):
        assert_logits_close(g, e, f"step {k}: torch.compile vs eager")
        assert_logits_close(g, want_peft[:, len(ids) + k], f"step {k}: torch.compile vs PEFT")
    again = decode_mixed(compiled, rows, ["b", None, "a"], feeds[:1])  # another mix, the same graph
    assert step.graphs == 1 and step.adapter_steps == len(feeds) + 1, step.describe()
    assert_logits_close(again[0], decode_mixed(eager, rows, ["b", None, "a"], feeds[:1])[0],
                        "another mix: torch.compile vs eager")
    # One sequence's greedy step (CapturedDecode) compiles the same form: the same tokens as eager.
    want = eager.generate(PROMPT, adapter="b", max_tokens=10, ignore_eos=True)
    assert compiled.generate(PROMPT, adapter="b", max_tokens=10, ignore_eos=True) == want
    single = compiled.engine.decode_step
    assert single is not None and single.reason is None and single.adapter_steps >= 8, single and single.describe()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_decode_with_an_adapter_is_captured(backend: str, dirs: dict) -> None:
    """One sequence on a contiguous cache: the greedy step (CapturedDecode) takes the adapter's row too."""
    path = tiny_model_dir(VARIANT)
    eager = infer.load(path, backend=backend, adapters=dirs, compile=False)
    captured = infer.load(path, backend=backend, adapters=dirs)
    want = eager.generate(PROMPT, adapter="b", max_tokens=10, ignore_eos=True)
    assert captured.generate(PROMPT, adapter="b", max_tokens=10, ignore_eos=True) == want
    step = captured.engine.decode_step
    assert step is not None and step.reason is None and step.adapter_steps >= 8, step and step.describe()


def test_max_loras_holds_requests_back_until_an_adapter_frees(dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    model = infer.load(path, backend="numpy", adapters=dirs, max_loras=1)
    engine = model.engine
    ids = encode(path, PROMPT)
    names = ["a", "b", "a", None]
    alone = {}
    for i, n in enumerate(names):
        alone[i] = list(model.generate_tokens(ids, adapter=n, max_tokens=6 + i, ignore_eos=True))
    batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
    seen: list[set[str]] = []
    run = engine.run

    def recording(b):  # the adapters each forward mixes
        seen.append({s.adapter.name for s in b.seqs if s.adapter is not None})
        return run(b)

    engine.run = recording  # type: ignore[method-assign]
    handles = [batch.submit(ids, SamplingParams(), StopConditions(max_tokens=6 + i, ignore_eos=True), adapter=n)
               for i, n in enumerate(names)]
    batch.run_until_done()
    assert all(len(s) <= 1 for s in seen), seen  # never two adapters in one step
    assert {"a"} in seen and {"b"} in seen
    for i, h in enumerate(handles):
        assert h.finish_reason == "length" and h.tokens == alone[i], (i, names[i])
    assert all(model.adapters.in_use(n) == 0 for n in ("a", "b"))


def test_a_request_held_for_max_loras_is_not_starved_by_a_stream_of_others(dirs: dict) -> None:
    """Under ``max_loras=1``, a request for "a" arrives at every step, so some request for
    "a" always runs; one request for "b" arrives among them. Without a bound on how long a
    held request waits, requests for "a" keep passing it and "b" never runs (vLLM
    behaves so). Once it has waited ``ADAPTER_WAIT_STEPS`` steps, no request for another
    adapter is admitted until it runs: the running ones finish and it goes in."""
    from infer.engine.batch import ADAPTER_WAIT_STEPS

    path = tiny_model_dir(VARIANT)
    model = infer.load(path, backend="numpy", adapters=dirs, max_loras=1)
    ids = encode(path, PROMPT)
    batch = model.configure_batching(kv_memory=2**22, kv_layout="paged", block_size=4)
    stop = StopConditions(max_tokens=6, ignore_eos=True)
    want_b = list(model.generate_tokens(ids, adapter="b", max_tokens=6, ignore_eos=True))
    streams = [batch.submit(ids, SamplingParams(), stop, adapter="a")]
    batch.step()
    late = batch.submit(ids, SamplingParams(), stop, adapter="b")
    base = []
    steps = 0
    while late.cached_tokens is None and steps < 10 * ADAPTER_WAIT_STEPS:  # set when it is admitted
        streams.append(batch.submit(ids, SamplingParams(), stop, adapter="a"))
        base.append(batch.submit(ids, SamplingParams(), stop))  # base-model requests are not held back
        batch.step()
        steps += 1
    # Held ADAPTER_WAIT_STEPS steps, then the "a" requests running drain (6 steps at most).
    assert late.cached_tokens is not None, f"b still waits after {steps} steps"
    assert steps <= ADAPTER_WAIT_STEPS + 7, steps
    assert all(r.cached_tokens is not None for r in base[:steps - 1])  # base requests went on meanwhile
    batch.run_until_done()
    assert late.tokens == want_b and all(r.finish_reason == "length" for r in streams + base)


def test_a_pool_sized_by_memory_leaves_the_adapters_their_bytes(dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    plain = infer.load(path, backend="numpy")
    adapted = infer.load(path, backend="numpy", adapters=dirs)
    held = adapted.adapters.nbytes
    assert held > 0
    budget = 2**21
    per_block = plain.engine.kv_bytes_per_position() * 4
    blocks = plain.engine.new_kv_pool(block_size=4, memory_budget=budget).usable_blocks
    # The pages covering the adapters' bytes are withheld (as from a pool made before they loaded:
    # tests/test_adapter_memory.py).
    fewer = adapted.engine.new_kv_pool(block_size=4, memory_budget=budget).usable_blocks
    assert blocks == budget // per_block - 1 and fewer == blocks - -(-held // per_block), (blocks, fewer, held)


def test_tensor_parallelism_refuses_adapters_by_name(dirs: dict) -> None:
    path = tiny_model_dir(VARIANT)
    with pytest.raises(UnsupportedAdapterError, match="tensor parallelism"):
        infer.load(path, backend="numpy", tensor_parallel=2, adapters=dirs)
    with pytest.raises(UnsupportedAdapterError, match="tensor parallelism"):
        infer.load(path, backend="numpy", tensor_parallel=2, max_loras=2)
    model = infer.load(path, backend="numpy")
    model.network.ranks = 2  # what a tensor-parallel model's network says (infer.distributed.TensorParallelLM)
    with pytest.raises(UnsupportedAdapterError, match="over 2 ranks"):
        model.load_adapter("a", dirs["a"])
