"""infer-jax's own tests: what the conformance kit cannot see.

The kit (``pytest --pyargs infer.testing --infer-backend jax:cpu``) checks
every op against infer's reference backend. These check the JAX-specific
promises: how many programs decoding compiles, that the KV cache write is
functional and in place, that 64-bit integers do not switch JAX's global
x64 mode on, and that the probes give reasons.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer_jax
from infer.ops import AttentionBatch
from infer_jax import kernels
from infer_jax.backend import JaxBackend, key_bucket


@pytest.fixture(scope="module")
def ops() -> JaxBackend:
    return JaxBackend("cpu", "float32")


def normal(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _one_sequence(ops: JaxBackend, length: int, rows: int = 4, block: int = 64) -> AttentionBatch:
    """One sequence decoding at ``length`` keys, in block 0 of ``block`` rows."""
    arrays = (np.array([0, rows], np.int32), np.array([length], np.int32), np.zeros((1, 1), np.int32))
    return AttentionBatch(*(ops.from_numpy(a) for a in arrays), block, rows, AttentionBatch(*arrays, block, rows))


def test_decoding_compiles_attention_once_per_bucket(ops: JaxBackend) -> None:
    q = ops.from_numpy(normal(0, 1, 4, 8))
    k = ops.from_numpy(normal(1, 64, 2, 8))
    before = kernels.attention._cache_size()
    for tk in range(17, 65):  # 48 decode steps: buckets 32 and 64
        ops.attention(q, k, k, _one_sequence(ops, tk, rows=1), scale=0.3)
    assert kernels.attention._cache_size() - before == 2
    assert [key_bucket(n) for n in (1, 16, 17, 1024, 1025)] == [16, 16, 32, 1024, 2048]


def test_sliding_window_reads_reuse_one_slice_program(ops: JaxBackend) -> None:
    cache = ops.zeros((64, 2, 8))
    before = kernels.slice_axis._cache_size()
    for start in range(0, 40):
        assert ops.shape(ops.slice(cache, 0, start, start + 8)) == (8, 2, 8)
    assert kernels.slice_axis._cache_size() - before == 1


def test_scatter_rows_is_functional_and_in_place(ops: JaxBackend) -> None:
    dst = ops.zeros((6, 2))
    address = dst.unsafe_buffer_pointer()
    out = ops.scatter_rows(dst, ops.from_numpy(np.array([4, 1, 2], np.int32)),
                           ops.from_numpy(np.arange(6, dtype=np.float32).reshape(3, 2)))
    assert ops.to_numpy(out)[:, 0].tolist() == [0, 2, 4, 0, 0, 0]
    assert dst.is_deleted()  # donated: the contract says to use the returned array
    assert out.unsafe_buffer_pointer() == address  # written in place, not copied
    with pytest.raises(IndexError):
        ops.scatter_rows(out, ops.from_numpy(np.array([6], np.int32)), ops.from_numpy(np.ones((1, 2), np.float32)))


def test_int64_without_switching_x64_on_globally(ops: JaxBackend) -> None:
    x = ops.from_numpy(np.array([2**40, -3], np.int64))
    assert ops.dtype(x) == "int64" and ops.to_numpy(ops.add(x, 1)).tolist() == [2**40 + 1, -2]
    assert ops.dtype(ops.argmax(ops.from_numpy(normal(0, 5)))) == "int64"
    assert not jax.config.jax_enable_x64
    assert jnp.zeros(3).dtype == jnp.float32  # other JAX code in the process is unaffected


def test_bfloat16_is_native(ops: JaxBackend) -> None:
    bf = JaxBackend("cpu", "bfloat16")
    x = bf.from_numpy(normal(0, 4, 8))
    assert x.dtype == jnp.bfloat16 and bf.dtype(bf.rms_norm(x, None, 1e-6)) == "bfloat16"
    assert bf.to_numpy(x).dtype == np.float32


def test_probes_give_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert infer_jax._probe_cpu().score == infer_jax.SCORES["cpu"]
    monkeypatch.setattr(infer_jax, "_installed", lambda name: False)
    gpu = infer_jax._probe_gpu()
    assert gpu.score == 0 and "jax[cuda12]" in gpu.reason
    monkeypatch.setattr(infer_jax, "_installed", lambda name: True)
    monkeypatch.setattr(jax, "devices", lambda backend=None: (_ for _ in ()).throw(RuntimeError("no gpu")))
    gpu = infer_jax._probe_gpu()
    assert gpu.score == 0 and "no gpu" in gpu.reason
