"""Build configuration beyond pyproject.toml: the numpy backend's optional C
kernels (backends/_affine.c). Everything else is declared in pyproject.toml.

The extension is optional: where it does not compile (no C compiler, no
Python headers) the install still succeeds and the numpy backend uses its
pure-numpy paths (``infer doctor`` says which). OpenMP is used where the
compiler supports it (gcc and clang with libomp on Linux), so a product uses
every core the way BLAS does.
"""

import sys

from setuptools import Extension, setup

openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
setup(
    ext_modules=[
        Extension(
            "infer.backends._affine",
            sources=["backends/_affine.c"],
            depends=["backends/_plan.c", "backends/_q8.c"],  # included by _affine.c
            extra_compile_args=["-O3", "-ffp-contract=off", *openmp],  # dequantize: multiply, then add, as numpy does
            extra_link_args=openmp,
            # libm by name, so expf and tanhf bind to their current versions: an unversioned
            # reference binds to glibc's oldest, whose wrapper takes a slow SVID error path on
            # every underflow (a softmax's far-below-the-maximum scores; docs/performance.md).
            libraries=["m"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ]
)
