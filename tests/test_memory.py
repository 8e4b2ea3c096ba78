"""infer.loading.release_free_heap: freed heap memory leaves the resident set."""

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
