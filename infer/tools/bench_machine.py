"""The machine a benchmark runs on: CPU, cores, memory, library versions,
the GPU when one is measured, and the memory read bandwidth of each (what
bounds decoding, see docs/performance.md)."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

VERSIONED = ("infer-engine", "numpy", "torch", "mlx", "transformers", "llama-cpp-python", "mlx-lm", "gguf")


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    wanted = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_int8", "neon", "asimd"}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python, and the versions of every engine."""
    return {
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: dist_version(d) for d in VERSIONED},
    }


def measure_read_bandwidth(megabytes: int = 256, repeats: int = 7, threads: int | None = None) -> float:
    """Memory read bandwidth in bytes/s: the median time of summing a
    ``megabytes`` float32 array (much larger than any cache), split over
    ``threads`` threads (numpy releases the GIL while it reduces)."""
    import numpy as np

    threads = threads or os.cpu_count() or 1
    data = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    times = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats + 1):  # the first pass faults the pages in
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - t0)
    return data.nbytes / statistics.median(times[1:])


def gpu_info() -> dict[str, Any] | None:
    """The CUDA GPU torch sees (name, memory, compute capability), or None.
    Imports torch: called only when an engine runs on the GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda}


def measure_gpu_read_bandwidth(megabytes: int = 2048, repeats: int = 20) -> float:
    """GPU memory read bandwidth in bytes/s: the median time, by CUDA events,
    of summing a ``megabytes`` float32 tensor (far larger than the L2 cache).
    Decoding reads each weight once per token, as this reads each element once."""
    import torch

    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device="cuda")
    times = []
    for _ in range(repeats + 3):  # three warm-ups
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        data.sum()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del data
    torch.cuda.empty_cache()
    return megabytes * 2**20 / statistics.median(times[3:])
