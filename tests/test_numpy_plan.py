"""The numpy backend's captured decode step (backends/cpu/plan.py, backends/cpu/plan.c).

``infer.load`` on numpy records the greedy decode step once as a program of
C kernel calls and runs it as one C call per token. What a user relies on:

* the same greedy tokens as the eager loop (``compile=False``), on every
  architecture that captures, every code path of the kernels, and over
  enough tokens to cross a capacity bucket;
* the step's logits equal the eager forward's within ``PLAN_RTOL`` of the
  largest logit: products, norms, rope and attention are the eager ops' own
  C code (bit for bit), and only silu/gelu and the rope tables call the C
  library's ``expf``/``tanhf``/``sinf``/``cosf`` where numpy uses its own
  (a few ulp each), so the step is far inside the suite's float32 tolerance
  for another summation order (``LOGIT_RTOL``);
* one program per cache capacity, not one per token;
* a step that cannot be one program (MoE routing reads the host, LayerNorm,
  interleaved rope) decodes eagerly and says which op stopped it;
* bad data inside the program (a token id past the vocabulary, a position
  past the cache) is a typed error, not a write outside the buffers;
* arithmetic outside the backend's ops on a traced value refuses to record,
  and the trace's check against the eager ops can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import LOGIT_RTOL, assert_logits_close, encode, tiny_model_dir

import infer
from infer.backends import numpy as numpy_backend
from infer.engine.capture import MIN_CAPACITY
from infer.kv.attention import AttentionContext

_affine = numpy_backend._affine
pytestmark = pytest.mark.skipif(not hasattr(_affine, "run_plan"), reason="the C kernels are not built here")
from infer.backends.cpu import plan  # noqa: E402

PROMPT = "The capital of France is Paris. Once upon a time"
#: libm's transcendentals against numpy's SIMD ones: a few ulp in the MLP's
#: activations and the rope table, well inside the float32 reordering tolerance.
PLAN_RTOL = LOGIT_RTOL
CAPTURED = ["llama3", "mistral", "qwen2", "gemma3", "gemma3_softcap", "qwen3", "phi3", "olmo2", "smollm3_pattern",
            "granite_bias", "gpt2", "mixtral", "qwen3_moe"]
#: Softmax-routed MoE (mixtral, qwen3_moe) records since the router has steps (tests/test_captured_hybrid.py).
EAGER = {"deepseek_v3": "interleaved=True", "llama_dynamic": "max_position"}


def _generate(model: infer.Model, variant: str, n: int = 24) -> list[int]:
    return list(model.generate_tokens(encode(tiny_model_dir(variant), PROMPT), max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("variant", CAPTURED)
def test_the_default_numpy_load_captures_the_step_with_the_eager_tokens(variant: str) -> None:
    eager = infer.load(tiny_model_dir(variant), backend="numpy", compile=False)
    assert eager.engine.decode_step is None
    model = infer.load(tiny_model_dir(variant), backend="numpy")
    step = model.engine.decode_step
    assert step is not None and step.compiled
    assert _generate(model, variant) == _generate(eager, variant)
    assert step.reason is None, step.reason
    assert step.steps == 23 and step.graphs == 1
    assert step.describe() == "decode step captured: 1 graph(s) for 23 steps"


@pytest.mark.parametrize("variant,op", EAGER.items())
def test_what_one_program_cannot_hold_decodes_eagerly_and_says_why(variant: str, op: str) -> None:
    eager = infer.load(tiny_model_dir(variant), backend="numpy", compile=False)
    model = infer.load(tiny_model_dir(variant), backend="numpy")
    assert _generate(model, variant, 8) == _generate(eager, variant, 8)
    step = model.engine.decode_step
    assert step.steps == 0 and step.reason is not None and op in step.reason


@pytest.mark.parametrize("path", _affine.paths() if _affine is not None else [])
def test_every_kernel_path_records_a_program_with_the_eager_tokens(path: str) -> None:
    chosen = _affine.simd()
    _affine.use_simd(path)
    try:
        want = _generate(infer.load(tiny_model_dir("gemma3"), backend="numpy", compile=False), "gemma3")
        model = infer.load(tiny_model_dir("gemma3"), backend="numpy")
        assert _generate(model, "gemma3") == want and model.engine.decode_step.steps == 23
    finally:
        _affine.use_simd(chosen)


def test_quantized_weights_are_recorded_as_the_kernels_products() -> None:
    # On-load q4 and q8 (the C kernel's codes) and float32 weights all capture.
    for quantize in ("q4", "q8", "off"):
        eager = infer.load(tiny_model_dir("llama3"), backend="numpy", quantize=quantize, compile=False)
        model = infer.load(tiny_model_dir("llama3"), backend="numpy", quantize=quantize)
        assert _generate(model, "llama3") == _generate(eager, "llama3"), quantize
        assert model.engine.decode_step.reason is None


def _stored_types(value: object, seen: set[int] | None = None) -> set[str]:
    """The GGML types of the weights under ``value`` kept as their file stores them."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, np.ndarray)):
        return set()
    seen.add(id(value))
    if isinstance(value, infer.ops.PackedWeight):
        return {value.qtype} if value.scheme.endswith("blocks as stored, C kernel") else set()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else \
        vars(value).values() if hasattr(value, "__dict__") else ()
    return set().union(*(_stored_types(v, seen) for v in items))


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Llama in a Q4_K_M GGUF file: 256 columns, so its matrices are
    Q4_K and Q6_K blocks (the tiny models' 64 would fall back to Q5_0)."""
    import json
    import shutil

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src, hf = tiny_model_dir("llama3"), tmp_path_factory.mktemp("k_quant")
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.float32)
    model.save_pretrained(hf, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, hf / name)
    return infer.convert(hf, hf / "m.gguf", type="q4_k_m", progress=False)


@pytest.mark.parametrize("path", _affine.paths() if _affine is not None else [])
def test_blocks_as_stored_are_recorded_as_the_kernels_products(k_quant_gguf, path: str) -> None:  # type: ignore[no-untyped-def]
    # The program's products and its embedding rows read the file's Q4_K and Q6_K
    # blocks, as the eager ops do: the eager tokens, on every kernel path.
    chosen = _affine.simd()
    _affine.use_simd(path)
    try:
        eager = infer.load(k_quant_gguf, backend="numpy", compile=False)
        model = infer.load(k_quant_gguf, backend="numpy")
        assert {"Q4_K", "Q6_K"} <= _stored_types(model.network)
        prompt = encode(tiny_model_dir("llama3"), PROMPT)
        want = list(eager.generate_tokens(prompt, max_tokens=24, ignore_eos=True))
        assert list(model.generate_tokens(prompt, max_tokens=24, ignore_eos=True)) == want
        step = model.engine.decode_step
        assert step.reason is None and step.steps == 23, step.reason
    finally:
        _affine.use_simd(chosen)


@pytest.mark.parametrize("variant", ["llama3", "gemma3_softcap"])
def test_the_programs_logits_are_the_eager_forwards(variant: str) -> None:
    model = infer.load(tiny_model_dir(variant), backend="numpy", compile=False)
    engine, ops, net = model.engine, model.backend, model.network
    prompt = encode(tiny_model_dir(variant), PROMPT)

    def static_logits(ids, start, keys, values):  # type: ignore[no-untyped-def]
        ctx = AttentionContext.contiguous(ops, keys, values, start, tokens=1)
        return net.compute_logits(net.forward(ids, ctx)), ctx.keys, ctx.values

    fn = ops.compile(static_logits, static=True)
    assert isinstance(fn, plan.PlannedStep)
    eager, static = engine.new_sequence(MIN_CAPACITY), engine.new_sequence(MIN_CAPACITY)
    engine.forward(eager, prompt)
    engine.forward(static, prompt)
    for token in (5, 17, 2, 40, 9, 5):
        want = ops.to_numpy(engine.forward(eager, [token])[-1])
        keys, values = static.cache.layer_rows(net.num_layers)
        start = ops.from_numpy(np.array([static.cache.length], np.int32))
        logits, keys2, values2 = fn(ops.from_numpy(np.array([token], np.int32)), start, keys, values)
        assert all(a is b for a, b in zip(keys2 + values2, keys + values))  # written in place
        static.cache.commit([token])
        assert_logits_close(logits[-1], want, f"program vs eager, token {token}", rtol=PLAN_RTOL)
        # The cache rows the program wrote are the eager forward's.
        pos = static.cache.length - 1
        for layer in range(net.num_layers):
            got_k, _ = static.cache.read(layer, pos, pos + 1)
            want_k, _ = eager.cache.read(layer, pos, pos + 1)
            # The activations differ by the ulps of silu and the rope table: within the logits' tolerance.
            np.testing.assert_allclose(got_k, want_k, rtol=0, atol=PLAN_RTOL * float(np.abs(want_k).max()))
    assert fn.graphs() == 1


def test_a_new_capacity_records_a_new_program_and_steps_do_not_re_record() -> None:
    model, fn, _ = _planned()
    engine, net = model.engine, model.network
    prompt = encode(tiny_model_dir("llama3"), PROMPT)
    for capacity in (64, 128, 64):
        seq = engine.new_sequence(capacity)
        engine.forward(seq, prompt)
        for _ in range(30):
            keys, values = seq.cache.layer_rows(net.num_layers)
            fn(np.array([7], np.int32), np.array([seq.cache.length], np.int32), keys, values)
            seq.cache.commit([7])
    assert fn.graphs() == 2  # one per capacity, none per token or per sequence


def _planned(variant: str = "llama3"):  # type: ignore[no-untyped-def]
    """A recorded step of ``variant`` and its sequence after the prompt."""
    model = infer.load(tiny_model_dir(variant), backend="numpy", compile=False)
    engine, ops, net = model.engine, model.backend, model.network

    def greedy(ids, start, keys, values):  # type: ignore[no-untyped-def]
        ctx = AttentionContext.contiguous(ops, keys, values, start, tokens=1)
        return ops.argmax(net.compute_logits(net.forward(ids, ctx)), -1)

    seq = engine.new_sequence(MIN_CAPACITY)
    engine.forward(seq, encode(tiny_model_dir(variant), PROMPT))
    return model, ops.compile(greedy, static=True), seq


def test_bad_data_inside_the_program_is_a_typed_error_not_a_stray_write() -> None:
    model, fn, seq = _planned()
    keys, values = seq.cache.layer_rows(model.network.num_layers)
    at = np.array([seq.cache.length], np.int32)
    fn(np.array([3], np.int32), at, keys, values)  # recorded
    before = [k.copy() for k in keys + values]
    with pytest.raises(IndexError, match="token id 100000 out of range"):
        fn(np.array([100000], np.int32), at, keys, values)
    with pytest.raises(IndexError, match="token id -1 out of range"):
        fn(np.array([-1], np.int32), at, keys, values)
    with pytest.raises(IndexError, match=f"writes row {MIN_CAPACITY} of a KV pool of {MIN_CAPACITY} rows"):
        fn(np.array([3], np.int32), np.array([MIN_CAPACITY], np.int32), keys, values)
    with pytest.raises(IndexError, match="writes row -4"):
        fn(np.array([3], np.int32), np.array([-4], np.int32), keys, values)
    assert all(np.array_equal(a, b) for a, b in zip(keys + values, before))
    # Inputs unlike the recorded ones get their own program, or a clear refusal.
    with pytest.raises(plan.NotCapturable, match="C-contiguous"):
        fn(np.array([3], np.int32), at, [k[:, :, ::2] for k in keys], values)


def test_arithmetic_outside_the_ops_or_host_reads_refuse_to_record() -> None:
    model = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False)
    ops = model.backend
    x = np.ones((1, 8), np.float32)
    with pytest.raises(plan.NotCapturable, match="outside the backend's ops"):
        ops.compile(lambda a: ops.add(a * 2, 1.0), static=True)(x)
    with pytest.raises(plan.NotCapturable, match="host"):
        ops.compile(lambda a: ops.mul(a, float(a[0, 0])), static=True)(x)
    with pytest.raises(plan.NotCapturable, match="to_numpy"):
        ops.compile(lambda a: ops.from_numpy(ops.to_numpy(a)), static=True)(x)
    with pytest.raises(plan.NotCapturable, match="outside the backend's ops"):
        ops.compile(lambda a: np.concatenate([a, a]), static=True)(x)
    # The backend's own ops are restored after a failed trace.
    assert "add" not in vars(ops) and np.array_equal(ops.add(x, 1.0), x + 1)


def test_copies_writes_and_shared_inputs_outside_the_ops_refuse_to_record() -> None:
    """Each would be frozen at its trace-time value, or lost at the next replay."""
    ops = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False).backend
    x = np.arange(4, dtype=np.float32)
    refused = {
        "copied": lambda a: ops.add(a, 1.0).copy(),
        "fancy-indexed": lambda a: ops.add(a, 1.0)[[0, 1]],
        "written in place": lambda a: (lambda y: (y.__setitem__(0, 7.0), ops.mul(y, 1.0))[1])(ops.add(a, 0.0)),
        "cast outside": lambda a: ops.add(a, 1.0).astype(np.float64),
        "written into a constant": lambda a: ops.mul(
            ops.scatter_rows(ops.zeros((4,)), ops.from_numpy(np.arange(4, dtype=np.int32)), a), 2.0),
        "all-reduced": lambda a: ops.all_reduce(ops.add(a, 1.0)),
    }
    for what, fn in refused.items():
        with pytest.raises(plan.NotCapturable):
            ops.compile(fn, static=True)(x.copy())
        assert not any(name in vars(ops) for name in ("add", "mul")), what  # the ops are the backend's again
    with pytest.raises(plan.NotCapturable, match="share memory"):
        ops.compile(lambda p, q: ops.sub(p, q), static=True)(x, x)
    # What is refused is a CaptureError, which the engine answers by decoding eagerly.
    assert issubclass(plan.NotCapturable, infer.errors.CaptureError)


def test_a_capture_refused_for_a_later_capacity_decodes_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False)
    engine = model.engine
    prompt = encode(tiny_model_dir("llama3"), PROMPT)
    short, long = engine.new_sequence(64), engine.new_sequence(128)  # two capacities: two programs
    for seq in (short, long):
        engine.forward(seq, prompt)
    step = engine.capture_decode()
    assert step(short.cache, 5) is not None and step.reason is None
    monkeypatch.setattr(plan.Recorder, "rope", lambda self, *a, **k: (_ for _ in ()).throw(
        plan.NotCapturable("rope: refused for the test")))
    assert step(long.cache, 5) is None  # the caller's eager forward serves it
    assert step.reason is not None and "refused for the test" in step.reason
    assert engine.greedy_step(short, 6) is None  # and every step after


def test_the_trace_checks_each_step_against_the_eager_op(monkeypatch: pytest.MonkeyPatch) -> None:
    model = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False)
    ops = model.backend
    x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)
    assert np.allclose(ops.compile(lambda a: ops.silu(a), static=True)(x), ops.silu(x), rtol=1e-6)
    monkeypatch.setitem(plan.UNARY_KINDS, "silu", plan.UNARY_KINDS["exp"])  # a wrongly wired step
    with pytest.raises(plan.NotCapturable, match="silu: the step's values differ"):
        ops.compile(lambda a: ops.silu(a), static=True)(x)


def test_elementwise_steps_broadcast_and_view_as_numpy_does() -> None:
    ops = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False).backend
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.linspace(1, 2, 4, dtype=np.float32)

    def fn(x):  # type: ignore[no-untyped-def]
        t = ops.transpose(x, (2, 0, 1))  # a strided view
        y = ops.div(ops.sub(ops.mul(ops.reshape(ops.transpose(t, (1, 2, 0)), (6, 4)), b), 0.5), 3.0)
        c = ops.concat([ops.slice(y, 0, 0, 2), ops.slice(ops.reshape(ops.sqrt(ops.add(t, 1.0)), (4, 6)), 1, 0, 4)], 0)
        i = ops.add(ops.astype(ops.arange(0, 4, "int32"), "float32"), ops.max(c, -1, keepdims=True))
        return ops.argmax(i, -1), ops.max(c, -1), c

    fn_step = ops.compile(fn, static=True)
    for scale in (1.0, -2.5):  # the recorded program on new values
        x = a * np.float32(scale)
        got, want = fn_step(x), fn(x)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    assert fn_step.graphs() == 1


def test_transcendental_steps_split_over_threads_give_the_one_thread_bits() -> None:
    """A unary step of 1,024 values or more (exp, tanh, the GELUs, silu) is split
    over the kernels' threads (plan.c's UNARY_PARALLEL); each value is its own,
    so the program's result is the one-thread run's, bit for bit, also on a
    strided view whose rows the split cuts in the middle."""
    ops = infer.load(tiny_model_dir("llama3"), backend="numpy", compile=False).backend
    most = _affine.threads()
    if most < 2:
        pytest.skip("one kernel thread here: nothing is split")

    def fn(x):  # type: ignore[no-untyped-def]
        t = ops.transpose(x, (1, 0))  # [700, 3] of a [3, 700]: strided rows of 3
        return ops.gelu_tanh(x), ops.silu(t), ops.exp(ops.tanh(x))

    fn_step = ops.compile(fn, static=True)
    x = np.random.default_rng(3).standard_normal((3, 700)).astype(np.float32) * 4
    spread = [np.array(v) for v in fn_step(x)]
    try:
        _affine.set_threads(1)
        alone = [np.array(v) for v in fn_step(x)]
    finally:
        _affine.set_threads(most)
    for s, a, w in zip(spread, alone, fn(x)):
        assert np.array_equal(s, a)
        np.testing.assert_allclose(s, w, rtol=1e-5, atol=1e-6)  # libm's against numpy's (the module docstring)
    assert fn_step.graphs() == 1


@pytest.mark.parametrize("variant", ["llama3", "gemma3_softcap", "qwen2"])
def test_torch_cpu_records_the_same_program_on_its_tensors_by_default(variant: str) -> None:
    """torch/cpu in float32 runs numpy's kernels on its tensors' memory eagerly;
    its default decode step is their program too (compile=True: torch.compile)."""
    torch = pytest.importorskip("torch")
    eager = infer.load(tiny_model_dir(variant), backend="torch:cpu", compile=False)
    model = infer.load(tiny_model_dir(variant), backend="torch:cpu")
    step = model.engine.decode_step
    assert isinstance(step._fn, plan.PlannedStep)
    assert _generate(model, variant) == _generate(eager, variant)
    assert step.reason is None and step.steps == 23 and step.graphs == 1
    # The cache stays torch's: the program wrote its tensors in place.
    seq = model.engine.new_sequence(MIN_CAPACITY)
    model.engine.forward(seq, [1, 2, 3])
    assert model.engine.greedy_step(seq, 4) is not None
    keys, _ = seq.cache.layer_rows(model.network.num_layers)
    assert isinstance(keys[0], torch.Tensor) and float(keys[0][3].abs().sum()) > 0
    model.engine.release(seq)


def test_torch_arithmetic_outside_the_ops_refuses_to_record() -> None:
    torch = pytest.importorskip("torch")
    model = infer.load(tiny_model_dir("llama3"), backend="torch:cpu", compile=False)
    ops = model.backend
    x = torch.ones(4)
    for fn in (lambda a: ops.add(a * 2, 1.0), lambda a: ops.add(ops.add(a, 0.0).clone(), 1.0),
               lambda a: ops.mul(a, float(a[0]))):
        with pytest.raises(plan.NotCapturable, match="traced tensor"):
            ops.compile(fn, static=True)(x.clone())
    # Through the ops it records, and replays on new values.
    fn = ops.compile(lambda a: ops.add(ops.mul(a, 2.0), 1.0), static=True)
    assert fn(torch.ones(4)).tolist() == [3.0] * 4 and fn(torch.full((4,), 5.0)).tolist() == [11.0] * 4
    assert type(fn(torch.ones(4))) is torch.Tensor  # results are plain tensors


def test_a_tensor_given_new_memory_is_read_where_it_now_lies() -> None:
    """torch/cpu keeps each step input's numpy view (made afresh, about 2 us a
    tensor and dozens a step); a tensor whose memory or shape changed in place
    is viewed anew, never read where it was."""
    torch = pytest.importorskip("torch")
    ops = infer.load(tiny_model_dir("llama3"), backend="torch:cpu", compile=False).backend
    fn = ops.compile(lambda a: ops.add(ops.mul(a, 2.0), 1.0), static=True)
    x = torch.ones(4)
    assert fn(x).tolist() == [3.0] * 4
    x.set_(torch.full((4,), 5.0))  # the same tensor object on new memory
    assert fn(x).tolist() == [11.0] * 4
    x.resize_(2, 2)  # the same memory, another shape: another program
    assert fn(x).tolist() == [[11.0] * 2] * 2


def test_a_backend_that_overrides_an_op_is_not_bypassed_by_a_program() -> None:
    class Doubling(numpy_backend.NumpyBackend):
        def silu(self, x):  # type: ignore[no-untyped-def]
            return super().silu(x) * 2

    ops = Doubling()
    assert not ops.capture_by_default
    fn = lambda a: ops.silu(a)  # noqa: E731
    assert ops.compile(fn, static=True) is fn


def test_bad_data_inside_a_batched_program_is_a_typed_error_not_a_stray_write() -> None:
    """The batched step's slots, block tables and lengths are data: each is
    checked inside the program against the pool it indexes."""
    from infer.engine.capture import CapturedBatchDecode

    model = infer.load(tiny_model_dir("llama3"), backend="numpy")
    engine = model.engine
    pool = engine.new_kv_pool(block_size=4, num_blocks=16)
    step = CapturedBatchDecode(model.network, model.backend, engine.max_context)
    seqs = [engine.new_sequence(64, kv_pool=pool) for _ in range(2)]
    for seq in seqs:
        engine.forward(seq, encode(tiny_model_dir("llama3"), PROMPT))
    engine.prepare(seqs, [[3], [3]])
    inputs = step.inputs([s.cache for s in seqs], [[3], [3]], None)
    host = list(inputs.arrays())
    keys, values = pool.layer_rows(model.network.num_layers)
    step._fn(*host, keys, values, 4, inputs.max_query)  # recorded
    assert step.graphs == 1
    rows = keys[0].shape[0]
    before = [k.copy() for k in keys + values]

    def run(i: int, patch: object) -> None:
        args = [a.copy() for a in host]
        args[i][...] = patch
        step._fn(*args, keys, values, 4, inputs.max_query)

    ids, positions, slots, query_start, tables, lengths, logit_rows = range(7)
    with pytest.raises(IndexError, match=f"writes row {rows} of a KV pool of {rows} rows"):
        run(slots, [0, rows])
    with pytest.raises(IndexError, match="writes row -1"):
        run(slots, [-1, 0])
    assert all(np.array_equal(a, b) for a, b in zip(keys + values, before))  # nothing written: checked first
    with pytest.raises(IndexError, match=r"token id 1000000 out of range \[0, "):
        run(ids, [3, 10**6])
    with pytest.raises(IndexError, match=r"row index 1000000 out of range \[0, 2\)"):  # not a token id
        run(logit_rows, [0, 10**6])
    with pytest.raises(IndexError, match="block table entry 17 is outside the pool of 17 blocks"):
        run(tables, 17)  # 16 blocks and the scratch block
    most = host[tables].shape[1] * 4  # the table's width of blocks of 4
    with pytest.raises(IndexError, match=f"attention over {most + 1} keys of a cache of {most}"):
        run(lengths, most + 1)
    with pytest.raises(IndexError, match="attention over 0 keys for 1 query rows"):
        run(lengths, 0)
    assert step.graphs == 1
