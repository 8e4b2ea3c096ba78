"""infer-jax: a JAX compute backend for infer, published as a plugin.

infer finds it through the ``infer`` entry point this distribution declares
(``jax = "infer_jax"``); nothing in infer names it. It registers two
backend/device pairs:

* ``jax/cpu`` — XLA on the CPU, float32 (default) or bfloat16;
* ``jax/gpu`` — XLA on a GPU, where a JAX GPU plugin is installed
  (``pip install "jax[cuda12]"``) and sees a device; bfloat16 by default.

Both score below infer's numpy backend (10), so installing this package
never changes which backend ``infer.load`` picks by default; ask for it by
name: ``infer.load(path, backend="jax")``.

Importing this module is cheap: JAX is imported by the backend factory, and
by the GPU probe only when a GPU plugin is installed.
"""

from __future__ import annotations

import importlib.util

from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe

__version__ = "0.1.0"

#: Optional ops the backend implements natively (here, so that probing imports no jax).
NATIVE_OPS = ("attention", "fused_add_rms_norm", "softcap", "swiglu")

#: Probe scores: below numpy/cpu (10) so that installing the plugin changes no default.
SCORES = {"cpu": 5, "gpu": 8}

#: Distributions that give jaxlib a GPU platform (JAX >= 0.4.30 ships GPUs as plugins).
GPU_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm60-plugin", "jax-rocm7-plugin")


def _probe_cpu() -> Probe:
    for module in ("jax", "jaxlib"):
        if importlib.util.find_spec(module) is None:
            return Probe(0, f"{module} is not installed (pip install 'jax[cpu]')")
    return Probe(SCORES["cpu"], None, NATIVE_OPS)


def _installed(distribution: str) -> bool:
    import importlib.metadata  # here, not at the top: its import is a noticeable share of a process's start

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _probe_gpu() -> Probe:
    cpu = _probe_cpu()
    if cpu.score == 0:
        return cpu
    if not any(_installed(d) for d in GPU_PLUGINS):
        return Probe(0, "no JAX GPU plugin is installed (pip install 'jax[cuda12]')")
    try:
        import jax

        devices = jax.devices("gpu")
    except Exception as exc:  # no device, a driver mismatch, JAX_PLATFORMS=cpu: a reason, not a crash
        return Probe(0, f"jax.devices('gpu') failed: {type(exc).__name__}: {exc}")
    if not devices:
        return Probe(0, "jax sees no GPU")
    return Probe(SCORES["gpu"], None, NATIVE_OPS)


def _factory(device: str):  # type: ignore[no-untyped-def]
    def make(dtype: str | None):  # type: ignore[no-untyped-def]
        from infer_jax.backend import JaxBackend  # imports jax

        return JaxBackend(device, dtype)

    return make


@hookimpl
def infer_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    """Register JAX on the CPU and on a GPU."""
    register(BackendSpec(
        name="jax", device="cpu", factory=_factory("cpu"), probe=_probe_cpu, score_ceiling=SCORES["cpu"],
        description="JAX/XLA on the CPU: jit-compiled kernels, float32 or bfloat16 (infer-jax plugin)",
    ))
    register(BackendSpec(
        name="jax", device="gpu", factory=_factory("gpu"), probe=_probe_gpu, score_ceiling=SCORES["gpu"],
        description="JAX/XLA on a CUDA or ROCm GPU; bfloat16 by default (infer-jax plugin)",
    ))
