"""The numpy backend: float32 on any CPU, the fast default (the plain reference every backend,
this one included, is checked against is :mod:`infer.backends.reference`).

It is the CPU package composed and registered under its name: the ops are
:class:`~infer.backends.cpu.backend.CpuBackend`'s (numpy's BLAS, and the C
kernels of :mod:`infer.backends.cpu.kernels` where they are built: GGUF weights
computed on as the file stores them, few-row products, norms, rope and
decoding's attention in C, the decode step recorded as one program). How it
computes, and what it does without the kernels: :mod:`infer.backends.cpu.backend`.
"""

from __future__ import annotations

import numpy as np

from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe

from .cpu import kernels
from .cpu.backend import CpuBackend, available_memory, records_programs, reference_attention  # noqa: F401 - re-exported
# The kernels' names this module has always offered, from their module
# (backends/cpu/kernels.py), which torch/cpu imports too.
from .cpu.kernels import (  # noqa: F401 - re-exported
    BLOCK_COLS,
    BLOCK_FORMS,
    GOVERNOR,
    KERNELS,
    KERNELS_ENV,
    Q8_FLAG,
    STORED_TYPES,
    ThreadGovernor,
    affine_gemv,
    affine_slabs,
    block_form,
    kernel_args,
    slab_rows,
    with_kernel_args,
)

#: The C kernels the numpy backend computes on (None: pure numpy, GGUF weights
#: dequantized to float32): :data:`infer.backends.cpu.kernels.native`.
_affine = kernels.native


class NumpyBackend(CpuBackend):
    """Float32 compute on the CPU with numpy (and the CPU package's C kernels)."""

    name = "numpy"


@hookimpl
def infer_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    """Register numpy on the CPU: always available, lowest preference."""
    register(
        BackendSpec(
            name="numpy",
            device="cpu",
            factory=lambda dtype: NumpyBackend(dtype),
            probe=lambda: Probe(10, None, tuple(sorted(NumpyBackend.native_ops))),
            description=f"numpy {np.__version__} float32 on the CPU",
            details=kernel_details,
            score_ceiling=10,
        )
    )


def kernel_details() -> str:
    """Which C kernel path runs here (and whether ``INFER_NUMPY_KERNELS`` chose
    it), for ``infer doctor``."""
    if _affine is not None:
        chosen = f" [{KERNELS_ENV}={KERNELS}]" if KERNELS != "auto" else ""
        return f"numpy C kernels: {_affine.simd()}, {_affine.threads()} threads (GGUF weights stay quantized){chosen}"
    if KERNELS == "off":
        return f"numpy C kernels: off ({KERNELS_ENV}=off; GGUF weights become float32)"
    return "numpy C kernels: not built (GGUF weights become float32; reinstall with a C compiler)"
