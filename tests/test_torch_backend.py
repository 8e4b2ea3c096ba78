"""The torch backend: what the conformance kit (test_conformance.py) does not cover.

* attention against the formula written out in float64, on the cases where
  torch's own ``is_causal`` would be wrong (bottom-right alignment, tq < tk),
  and which SDPA path each case takes;
* every tiny parity model (tests/reference.py) generates the same greedy
  tokens on torch/cpu float32 as on numpy, and matches transformers' logits
  at test_parity's tolerance;
* bfloat16: top-1 agreement with numpy float32 of at least
  :data:`BF16_AGREEMENT` on the tiny models;
* loading: weights on the device, in the compute dtype, uploaded once;
* registration: probes and their reasons; torch imported only when needed.

CUDA tests run only where a CUDA device is present; CI never depends on them.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infer
from infer.backends import torch as torch_backend
from infer.backends.torch import TorchBackend
from infer.errors import UnsupportedOpError
from infer.ops import AttentionBatch
from reference import TINY_VARIANTS, encode, reference_greedy, reference_logits, tiny_model_dir
from test_parity import DECODE_TEXT, LONG_PROMPT, PROMPT, assert_logits_close

ops = TorchBackend("cpu")

#: Least fraction of teacher-forced steps whose bfloat16 top-1 token agrees
#: with numpy float32, over 32 steps of each tiny model below. Measured
#: 158/160 = 0.99 (407/416 = 0.98 over all 13 tiny variants); bfloat16 logits
#: are off by ~1% rms, so the few steps whose best two tokens are closer than
#: that may flip, while a real error (a wrong mask or rope) drops it to ~0.1.
BF16_AGREEMENT = 0.9
BF16_VARIANTS = ("llama3", "mistral", "qwen2", "smollm2_like", "gemma3")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


# -- attention -----------------------------------------------------------------------------


def formula_attention(q, k, v, scale, causal, window, softcap, sinks=None):
    """The contract's attention for one sequence (its keys contiguous), one
    query and head at a time, in float64."""
    tq, hq, _ = q.shape
    tk, hkv, dv = v.shape
    out = np.zeros((tq, hq, dv))
    for i in range(tq):
        p = tk - tq + i  # bottom-right: query i sits at position p
        for h in range(hq):
            kv = h // (hq // hkv)
            s = k[:, kv, :].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            j = np.arange(tk)
            visible = np.ones(tk, dtype=bool)
            if causal:
                visible &= j <= p
            if window is not None:
                visible &= np.abs(p - j) < window  # symmetric where not causal
            extra = [] if sinks is None else [float(sinks[h])]  # a logit with no value
            top = max([s[visible].max(), *extra])
            w = np.exp(s[visible] - top)
            out[i, h] = w @ v[visible, kv, :] / (w.sum() + sum(math.exp(e - top) for e in extra))
    return out


def normal(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def described(batch: AttentionBatch, host: bool = True) -> AttentionBatch:
    """``batch`` (numpy arrays) as torch tensors, with its host copy or without
    (a captured step's description: the device-only path)."""
    arrays = (torch.from_numpy(a) for a in (batch.query_start, batch.seq_lens, batch.block_tables))
    return AttentionBatch(*arrays, batch.block_size, batch.max_query, batch if host else None)


def one_sequence(tq: int, tk: int, capacity: int | None = None) -> AttentionBatch:
    """One sequence's tq queries at the end of its tk keys in a contiguous cache of
    ``capacity`` rows (one block of that size), host copy included."""
    return described(AttentionBatch(np.array([0, tq], np.int32), np.array([tk], np.int32), np.zeros((1, 1), np.int32),
                                    capacity or tk, tq))


def ragged(lengths, block, seed):
    """(query rows, keys) per sequence, pages scattered over a pool (numpy
    description, pool rows): ``block`` rows a page, or None for a contiguous
    cache per sequence. Table entries past a sequence's keys name other
    sequences' pages, as a reused table does."""
    size = block or max(tk for _, tk in lengths) + 3
    need = [-(-tk // size) for _, tk in lengths]
    total = sum(need) + 1
    pages = np.random.default_rng(seed).permutation(total)
    tables = np.zeros((len(lengths), max(need) + 1), np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = pages[sum(need[:b]):sum(need[:b]) + n]
        tables[b, n:] = np.roll(pages, b + 1)[:tables.shape[1] - n]
    starts = np.cumsum([0] + [tq for tq, _ in lengths]).astype(np.int32)
    return AttentionBatch(starts, np.array([tk for _, tk in lengths], np.int32), tables, size,
                          max(tq for tq, _ in lengths)), total * size


def up(*arrays):
    return [None if a is None else ops.from_numpy(a) for a in arrays]


batch_cases = dict(seqs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=3),
                   block=st.sampled_from([None, 1, 4, 16]), hkv=st.integers(1, 3), group=st.integers(1, 3),
                   dk=st.sampled_from([4, 16]), causal=st.booleans(), window=st.none() | st.integers(1, 10),
                   softcap=st.none() | st.floats(1.0, 30.0), sinks=st.booleans(), seed=st.integers(0, 2**31))


def draw(seqs, block, hkv, group, dk, seed, sinks):
    lengths = [(tq, tq + past) for tq, past in seqs]
    batch, rows = ragged(lengths, block, seed)
    q = normal(seed, int(batch.query_start[-1]), hkv * group, dk)
    k, v = normal(seed + 1, rows, hkv, dk), normal(seed + 2, rows, hkv, dk)
    return lengths, batch, q, k, v, normal(seed + 3, hkv * group) * 2 if sinks else None


@settings(max_examples=150, deadline=None)
@given(**batch_cases)
def test_attention_matches_formula(seqs, block, hkv, group, dk, causal, window, softcap, sinks, seed):
    lengths, batch, q, k, v, sink = draw(seqs, block, hkv, group, dk, seed, sinks)
    kw = dict(scale=1 / math.sqrt(dk), causal=causal, window=window, softcap=softcap)
    got = ops.to_numpy(ops.attention(*up(q, k, v), described(batch), sinks=up(sink)[0], **kw))
    for b, (tq, tk) in enumerate(lengths):
        keys = batch.key_rows(b, 0, tk)
        rows = slice(batch.query_start[b], batch.query_start[b + 1])
        # Against float64: scores of dk <= 16 unit normals, each rounded once; the output
        # is a convex mix of v (|v| <~ 5), a few float32 roundings of it: <~ 5 * 6 u = 2e-6.
        np.testing.assert_allclose(got[rows], formula_attention(q[rows], k[keys], v[keys], sinks=sink, **kw),
                                   rtol=1e-5, atol=2e-6)


@settings(max_examples=60, deadline=None)
@given(**batch_cases)
def test_static_attention_matches_numpy(seqs, block, hkv, group, dk, causal, window, softcap, sinks, seed):
    # A captured step's description has no host copy: one masked attention over
    # every sequence's whole table, built on the device (_static_attention).
    from infer.backends.numpy import NumpyBackend

    lengths, batch, q, k, v, sink = draw(seqs, block, hkv, group, dk, seed, sinks)
    kw = dict(scale=1 / math.sqrt(dk), causal=causal, window=window, softcap=softcap)
    calls = []
    real = ops._static_attention
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ops, "_static_attention", lambda *a: calls.append(1) or real(*a))
        got = ops.to_numpy(ops.attention(*up(q, k, v), described(batch, host=False), sinks=up(sink)[0], **kw))
    assert calls == [1]
    want = NumpyBackend().attention(q, k, v, batch, sinks=sink, **kw)
    # Each within 2e-6 of the float64 formula (above): within 4e-6 of each other.
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=4e-6)


def test_top_left_causal_would_be_wrong():
    # The trap this backend avoids: with tq < tk, torch's is_causal hides keys the
    # queries must see. Ours matches the formula; is_causal does not.
    q, k, v = normal(0, 3, 2, 8), normal(1, 7, 2, 8), normal(2, 7, 2, 8)
    want = formula_attention(q, k, v, 0.35, True, None, None)
    got = ops.to_numpy(ops.attention(*up(q, k, v), one_sequence(3, 7), scale=0.35))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a).transpose(0, 1) for a in (q, k, v)), is_causal=True, scale=0.35).transpose(0, 1)
    assert np.abs(top_left.numpy() - want).max() > 0.1


@pytest.mark.skipif(torch_backend.TorchBackend("cpu")._kernels is None, reason="numpy's C kernels are not built")
@pytest.mark.parametrize("lengths, block, window, softcap, sinks", [
    ([(1, 9)], None, None, None, False), ([(3, 9)], None, 4, None, False), ([(1, 40)], None, None, 30.0, False),
    ([(1, 9)], None, None, None, True),
    ([(1, 40), (4, 9), (2, 2)], 8, 5, 20.0, True),  # a ragged batch of decode and verification rows, paged
])
def test_cpu_float32_decoding_runs_numpys_c_kernels(monkeypatch, lengths, block, window, softcap, sinks):
    # torch/cpu decodes through the numpy backend's kernels (SDPA's dispatch costs more than
    # the attention of a few rows), and gets the numpy backend's values, bit for bit.
    from infer.backends.numpy import NumpyBackend

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", None)  # never reached
    batch, rows = ragged(lengths, block, 7)
    q, k, v = normal(0, int(batch.query_start[-1]), 4, 8), normal(1, rows, 2, 8), normal(2, rows, 2, 8)
    sink = normal(3, 4) if sinks else None
    kw = dict(scale=0.3, window=window, softcap=softcap)
    got = ops.attention(*up(q, k, v), described(batch), sinks=up(sink)[0], **kw)
    want = NumpyBackend().attention(q, k, v, batch, sinks=sink, **kw)
    assert np.array_equal(ops.to_numpy(got), want)
    x, r, w = normal(3, 2, 576), normal(4, 2, 576), normal(5, 576)
    out, h = ops.fused_add_rms_norm(ops.from_numpy(x), ops.from_numpy(r), ops.from_numpy(w), 1e-5)
    want_out, want_h = NumpyBackend().fused_add_rms_norm(x, r, w, 1e-5)
    assert np.array_equal(ops.to_numpy(out), want_out) and np.array_equal(ops.to_numpy(h), want_h)


@pytest.mark.parametrize("tq, tk, hq, window, want_mask, want_causal, want_gqa", [
    (1, 9, 4, None, False, False, True),   # decode: the single query sees every key
    (9, 9, 4, None, False, True, True),    # square prefill: top-left == bottom-right
    (4, 9, 4, None, True, False, False),   # chunked prefill: explicit bottom-right mask
    (9, 9, 4, 3, True, False, False),      # sliding window
    (9, 9, 4, 9, False, True, True),       # a window reaching every key is no window
    (9, 9, 2, None, False, True, False),   # no grouping: nothing to enable
])
def test_sdpa_path(monkeypatch, tq, tk, hq, window, want_mask, want_causal, want_gqa):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        calls.append((attn_mask is not None, is_causal, enable_gqa, k.shape[-3]))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(ops, "_kernels", None)  # SDPA's path, as off the CPU (below: the CPU's C kernel)
    q, k, v = normal(0, tq, hq, 8), normal(1, tk, 2, 8), normal(2, tk, 2, 8)
    got = ops.attention(*up(q, k, v), one_sequence(tq, tk), scale=0.3, window=window)
    assert calls == [(want_mask, want_causal, want_gqa, 2 if want_gqa or hq == 2 else hq)]
    np.testing.assert_allclose(ops.to_numpy(got), formula_attention(q, k, v, 0.3, True, window, None),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tq", [1, 17], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("table", [[0, 5, 9, 1, 2], [4, 5, 6, 7, 8]], ids=["scattered", "consecutive"])
def test_attention_rejects_a_table_outside_the_pool(tq, table):
    # A pool of 8 blocks of 4 rows; 20 keys in 5 blocks, one of which (9, or 8:
    # rows 32..35 of a run of rows 16..35) the pool does not hold. Reading the
    # keys that are there would be a wrong answer, not an error.
    k = ops.from_numpy(np.ones((8 * 4, 1, 8), np.float32))
    batch = described(AttentionBatch(np.array([0, tq], np.int32), np.array([20], np.int32),
                                     np.array([table], np.int32), 4, tq))
    with pytest.raises(IndexError):
        ops.attention(ops.from_numpy(np.ones((tq, 1, 8), np.float32)), k, k, batch, scale=1.0)


# -- small contract points ---------------------------------------------------------------------


def test_dtypes_and_in_place_update():
    bf = TorchBackend("cpu", "bfloat16")
    x = bf.from_numpy(np.array([[1.0, 2.0, 3.0]], dtype=np.float32))
    assert bf.dtype(x) == "bfloat16" and bf.to_numpy(x).dtype == np.float32
    assert bf.dtype(bf.argmax(x)) == "int64"
    # Float ops return their first float input's dtype (torch alone would promote).
    assert bf.dtype(bf.mul(x, bf.from_numpy(np.ones(3, np.float32), "float32"))) == "bfloat16"
    dst = bf.zeros((4, 3))
    out = bf.scatter_rows(dst, bf.from_numpy(np.array([2, 1], np.int32)), bf.from_numpy(np.ones((2, 3)), "float32"))
    assert out is dst and bf.dtype(out) == "bfloat16" and bf.to_numpy(dst)[:, 0].tolist() == [0, 1, 1, 0]
    with pytest.raises(IndexError, match="outside the 4 rows"):
        bf.scatter_rows(dst, bf.from_numpy(np.array([4], np.int32)), bf.from_numpy(np.ones((1, 3), np.float32)))
    assert bf.to_numpy(dst)[:, 0].tolist() == [0, 1, 1, 0]
    with pytest.raises(UnsupportedOpError, match="float64"):
        TorchBackend("cpu", "float64")


@pytest.mark.parametrize("array", [
    np.array([7], np.int32), np.arange(6, dtype=np.int64).reshape(2, 3), np.array([True, False]),
    np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # strided
    np.arange(4, dtype=np.float64),  # to the compute dtype
    np.frombuffer(np.arange(4, dtype=np.int32).tobytes(), np.int32),  # read-only, as a mapped weight
], ids=["int32", "int64", "bool", "strided", "float64", "read-only"])
def test_transfers_copy_both_ways(array):
    # A step's inputs are made from arrays the engine reuses (a token, a position), and
    # the host's copy of a result outlives the tensor: neither side may see the other's writes.
    before = array.copy()
    t = ops.from_numpy(array)
    want = {"f": "float32", "b": "bool"}.get(array.dtype.kind, str(array.dtype))
    assert ops.dtype(t) == want and tuple(t.shape) == array.shape
    np.testing.assert_array_equal(t.numpy(), array.astype(want))
    if array.dtype == bool:
        t.logical_not_()
    else:
        t.zero_()
    np.testing.assert_array_equal(array, before)
    host = ops.to_numpy(t)
    t.fill_(1)
    np.testing.assert_array_equal(host, np.zeros_like(before, dtype=want) if array.dtype != bool else ~before)
    with pytest.raises(UnsupportedOpError, match="uint16"):
        ops.from_numpy(np.zeros(2, np.uint16))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_a_cpu_pool_costs_memory_only_as_it_fills(dtype):
    # State stores and KV pools are allocated whole (Qwen3.5: 1.2 GB of state slots)
    # and filled a slot at a time: the zeros must not be resident before they are
    # written, as the numpy backend's are not, and must read as zeros.
    before = resident_bytes()
    pool = ops.zeros((64, 16, 128, 128), dtype)  # 64-128 MiB
    assert resident_bytes() - before < 16 << 20
    row = pool[3]
    assert ops.dtype(pool) == dtype and not row.any()
    # On a cache line, as the numpy backend's pools: the C kernels' 64-byte loads of a
    # row then read one line, not two (Qwen3.5's captured step took 1.04-1.2x the time).
    assert pool.data_ptr() % 64 == 0 and pool.is_contiguous()
    assert all(ops.zeros(shape, dtype).data_ptr() % 64 == 0 for shape in [(1024,), (33, 65), (2, 3, 17, 11)])
    ops.scatter_rows(pool, ops.from_numpy(np.array([5], np.int32)), ops.from_numpy(np.ones((1, 16, 128, 128), dtype)))
    assert pool[5].all() and not pool[4].any() and resident_bytes() - before < 24 << 20


def test_embedding_rejects_out_of_range_ids():
    table = ops.from_numpy(normal(0, 5, 4))
    with pytest.raises(IndexError, match="out of range"):
        ops.embedding(table, ops.from_numpy(np.array([1, 5], np.int32)))


# -- models ----------------------------------------------------------------------------------------


def prompt_for(variant: str) -> str:
    return LONG_PROMPT if variant == "llama_dynamic" else PROMPT


@pytest.fixture(scope="module", params=TINY_VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[str, infer.Model]:
    return request.param, infer.load(tiny_model_dir(request.param), backend="torch:cpu")


def test_greedy_tokens_match_numpy_and_transformers(variant):
    name, model = variant
    path = tiny_model_dir(name)
    prompt = encode(path, prompt_for(name))
    got = list(model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    numpy_model = infer.load(path, backend="numpy")
    assert got == list(numpy_model.generate_tokens(prompt, max_tokens=16, ignore_eos=True))
    assert got == reference_greedy(path, prompt, 16)


def test_logits_match_transformers(variant):
    name, model = variant
    path = tiny_model_dir(name)
    prompt, decode = encode(path, prompt_for(name)), encode(path, DECODE_TEXT)
    ref = reference_logits(path, prompt, decode)
    engine = model.engine
    seq = engine.new_sequence()
    assert_logits_close(ops.to_numpy(engine.forward(seq, prompt, all_logits=True)), ref["prefill"], f"{name} prefill")
    for step, (token, want) in enumerate(zip(decode, ref["decode"])):
        assert_logits_close(ops.to_numpy(engine.forward(seq, [token])[-1]), want, f"{name} decode {step}")


def teacher_forced_top1(model: infer.Model, prompt: list[int], tokens: list[int]) -> list[int]:
    engine, backend = model.engine, model.backend
    seq = engine.new_sequence(len(prompt) + len(tokens))
    picks = [int(backend.to_numpy(backend.argmax(engine.forward(seq, prompt)[-1], axis=-1)))]
    for t in tokens[:-1]:
        picks.append(int(backend.to_numpy(backend.argmax(engine.forward(seq, [t])[-1], axis=-1))))
    return picks


def test_bfloat16_top1_agreement():
    agree = total = 0
    for name in BF16_VARIANTS:
        path = tiny_model_dir(name)
        prompt = encode(path, PROMPT)
        reference = infer.load(path, backend="numpy")
        want = list(reference.generate_tokens(prompt, max_tokens=32, ignore_eos=True))
        got = teacher_forced_top1(infer.load(path, backend="torch:cpu", dtype="bfloat16"), prompt, want)
        agree += sum(a == b for a, b in zip(got, want))
        total += len(want)
    assert agree / total >= BF16_AGREEMENT, f"bfloat16 top-1 agreement {agree}/{total}"


def weight_tensors(network) -> list[torch.Tensor]:
    """Every tensor reachable from the network's attributes."""
    found, seen, stack = [], set(), [network]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, TorchBackend)):
            stack.extend(vars(obj).values())
    return found


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_load_puts_weights_on_the_device_once(device, monkeypatch):
    path = tiny_model_dir("smollm2_like")
    model = infer.load(path, backend=f"torch:{device}", dtype="bfloat16")
    assert model.backend.compute_dtype == "bfloat16" and model.backend.device == device
    tensors = weight_tensors(model.network)
    assert len(tensors) > 20
    assert {t.device.type for t in tensors} == {device}
    # Every matrix in the compute dtype (rope's [1, head_dim/2] frequencies stay float32).
    assert {t.dtype for t in tensors if t.dim() == 2 and min(t.shape) > 1} == {torch.bfloat16}
    # Decoding uploads only small integer arrays (the new token's id, its row and
    # the step's attention description): the weights stay where they are.
    uploads = []
    real = model.backend.from_numpy
    monkeypatch.setattr(model.backend, "from_numpy",
                        lambda a, dtype=None: uploads.append((a.shape, a.dtype.kind)) or real(a, dtype))
    prompt = model.tokenizer.encode("The capital of France is")
    steps = iter(model.generate_tokens(prompt, max_tokens=5, ignore_eos=True))
    next(steps)  # the prefill
    prefill, uploads[:] = list(uploads), []
    assert len(list(steps)) == 4
    assert ((len(prompt),), "i") in prefill and all(kind in "iu" and math.prod(shape) <= len(prompt)
                                                    for shape, kind in prefill), prefill
    # Each of the 4 decode steps the same few uploads of at most 2 integers (query_start).
    step = uploads[:len(uploads) // 4]
    assert uploads == step * 4 and all(kind in "iu" and math.prod(shape) <= 2 for shape, kind in step), uploads


@CUDA
def test_cuda_float32_generates_numpy_tokens():
    path = tiny_model_dir("llama3")
    prompt = encode(path, PROMPT)
    got = infer.load(path, backend="torch:cuda", dtype="float32").generate_tokens(prompt, max_tokens=16, ignore_eos=True)
    want = infer.load(path, backend="numpy").generate_tokens(prompt, max_tokens=16, ignore_eos=True)
    assert list(got) == list(want)


@CUDA
def test_cuda_decode_does_not_use_cudnn_attention():
    """cuDNN's attention builds a plan per key count, so every decode step of
    a first generation paid one (77 against 27 ms a token on an H200); the
    backend keeps SDPA to the kernels that need none."""
    from torch.profiler import ProfilerActivity, profile

    path = tiny_model_dir("llama3")
    model = infer.load(path, backend="torch:cuda", dtype="bfloat16")
    prompt = encode(path, PROMPT)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = list(model.generate_tokens(prompt, max_tokens=4, ignore_eos=True))
    names = {e.key for e in prof.key_averages()}
    assert len(tokens) == 4
    assert any("scaled_dot_product" in n for n in names)  # attention did go through SDPA
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)


# -- registration --------------------------------------------------------------------------------------


def test_probes_and_selection():
    infos = {b.key: b for b in infer.list_backends()}
    cpu = infos["torch/cpu"]
    assert cpu.available and cpu.score == 8 and "swiglu" in cpu.native_ops
    # numpy's BLAS decodes faster on CPUs like this one, so numpy stays the CPU default.
    assert infos["torch/cpu"].score < infos["numpy/cpu"].score
    if not torch.backends.cuda.is_built():
        assert infos["torch/cuda"].reason == "torch was built without CUDA"
    elif not torch.cuda.is_available():
        assert infos["torch/cuda"].reason == "no CUDA device"
    else:
        assert infos["torch/cuda"].score == 100
    if not torch.backends.mps.is_available():
        assert not infos["torch/mps"].available and "MPS" in infos["torch/mps"].reason


def test_missing_torch_is_a_reason(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else object())
    for device in ("cuda", "mps", "cpu"):
        probe = torch_backend._probe(device)
        assert probe.score == 0 and probe.reason.startswith("torch is not installed")


def test_listing_backends_does_not_import_torch():
    code = ("import sys, infer.backends.torch as t; assert 'torch' not in sys.modules; "
            "t.infer_register_backends(lambda spec: None); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_warns_nothing_about_torch_jit():
    # Inductor's first run imports torch.utils.mkldnn, which warns 14 times that
    # torch.jit.script_method is deprecated; the backend silences exactly that
    # message. A fresh process, since this one may have imported the module already.
    code = ("import numpy as np; from infer.backends.torch import TorchBackend; ops = TorchBackend('cpu'); "
            "f = ops.compile(lambda x: ops.add(ops.mul(x, x), x)); "
            "print(ops.to_numpy(f(ops.from_numpy(np.full(3, 2, np.float32)))).tolist())")
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[6.0, 6.0, 6.0]"
    assert "script_method" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("forced", ["avx2", None])
@pytest.mark.parametrize("own_compile_first", [False, True])
def test_a_forced_cpu_capability_gets_its_own_inductor_cache(forced: str | None, own_compile_first: bool) -> None:
    # torch's kernel cache ignores ATEN_CPU_CAPABILITY, so a kernel compiled
    # under one is loaded under another and computes garbage: compile keeps
    # them apart (backends/torch_cpu.py, separate_inductor_cache). A plain
    # torch.compile run first writes Inductor's default folder into the
    # variable; that must not pin the shared folder (it made the forced-avx2
    # suite's compiled steps read NaN after the probe in test_captured_adapters).
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    if forced:
        env["ATEN_CPU_CAPABILITY"] = forced
    own = ("import torch._inductor.runtime.cache_dir_utils as c; c.cache_dir(); "
           "assert os.environ['TORCHINDUCTOR_CACHE_DIR'] == c.default_cache_dir(); ") if own_compile_first else ""
    probe = (f"import os; {own}from infer.backends.torch import TorchBackend; TorchBackend('cpu').compile(lambda x: x); "
             "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = out.stdout.strip()
    assert folder == (f"{default_cache_dir()}-avx2" if forced else default_cache_dir())
