"""Memory that loading hands back: freed heap (infer.loading.release_free_heap) and
the file pages of GGUF matrices once converted (infer.quantize.from_gguf)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from infer.loading import release_free_heap


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_freed_heap_memory_is_returned() -> None:
    if not release_free_heap():
        pytest.skip("this C library has no malloc_trim")
    # 96 MiB in 64 KiB blocks: below glibc's mmap threshold, so they come from the
    # heap; keeping the last one pins the heap's top, so free() alone keeps the rest.
    blocks = [np.ones(16 * 1024, np.float32) for _ in range(1536)]
    last = blocks[-1]
    before = resident_kib()
    del blocks
    kept = resident_kib()
    assert release_free_heap()
    after = resident_kib()
    assert kept - after > 64 * 1024, (before, kept, after)  # most of the 96 MiB went back
    assert last.sum() == 16 * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets /proc/self/status's VmHWM")
def test_a_large_gguf_matrix_converts_without_holding_its_file_pages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``from_gguf`` converts a memory-mapped matrix a slab of rows at a time
    and releases each slab's file pages once read, so the peak stays near the
    result's own size. Here (34 MiB stored, 40 MiB result) the peak above the
    start was 52 MiB in slabs and 66 MiB in one piece; the bound is the result
    plus half the stored bytes."""
    gguf = pytest.importorskip("gguf")
    from infer.formats import gguf_quants
    from infer.formats.gguf import GGUFQuantizedTensor, read_gguf
    from infer.quantize import from_gguf

    raw = gguf_quants.random_blocks("Q8_0", 16384, 2048, 0)
    stored = raw.nbytes
    w = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del raw
    file = read_gguf(tmp_path / "big.gguf")
    info = file.tensors["blk.0.ffn_up.weight"]
    tensor = GGUFQuantizedTensor("Q8_0", (16384, 2048), file.raw(info), "up", file, info.begin)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = resident_kib()
    converted = from_gguf(tensor)
    with open("/proc/self/status") as f:
        peak = (int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) - base) * 1024
    assert converted is not None
    assert peak < converted.nbytes + stored / 2, (peak / 2**20, converted.nbytes / 2**20, stored / 2**20)
    # Released pages leave memory, not the file: the rows read back the same.
    assert np.array_equal(converted.dequantize()[::997], tensor.dequantize_rows(np.arange(0, 16384, 997)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_stored_type_stays_the_files_pages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The numpy backend computes on Q4_K (and the other STORED_TYPES) where the
    file's map holds them: preparing the weight allocates nothing and reads
    nothing, the kernel's codes are the map's bytes (shared with every process
    mapping the file, evictable, counted once), and the first product reads them."""
    gguf = pytest.importorskip("gguf")
    from infer.backends import numpy as numpy_backend
    from infer.formats import gguf_quants
    from infer.formats.gguf import GGUFQuantizedTensor, read_gguf
    from infer.ops import PackedWeight

    if "Q4_K" not in numpy_backend.STORED_TYPES or numpy_backend._affine is None:
        pytest.skip("the C kernels are not built here")
    raw = gguf_quants.random_blocks("Q4_K", 8192, 2048, 0)  # 9.4 MB of blocks
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file = read_gguf(tmp_path / "k.gguf")
    info = file.tensors["blk.0.ffn_up.weight"]
    tensor = GGUFQuantizedTensor("Q4_K", (8192, 2048), file.raw(info), "up", file, info.begin)
    before = resident_kib()
    weight = numpy_backend.NumpyBackend().prepare_weight(tensor, name="model.layers.0.mlp.up_proj.weight")
    grown = resident_kib() - before
    assert isinstance(weight, PackedWeight) and weight.data is tensor and weight.data.nbytes == raw.nbytes
    assert np.shares_memory(weight.kernel[1], file.raw(info))  # the map's own bytes
    assert grown < 1024, grown  # KiB: nothing converted, no page of the tensor read
    x = np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32)
    y = numpy_backend.NumpyBackend().linear(x, weight)
    # The float32 sums' order against float64 (tests/test_numpy_kernels.py's bound): 1e-6 of sum |x * w|.
    dense = tensor.dequantize_rows(np.arange(64)).astype(np.float64)
    assert (np.abs(y[0, :64] - dense @ x[0]) <= 1e-6 * (np.abs(dense) @ np.abs(x[0]))).all()
