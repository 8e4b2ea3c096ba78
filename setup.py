"""Build configuration beyond pyproject.toml: the CPU kernels (backends/cpu/,
one extension module, ``infer.backends.cpu._kernels``). Everything else is
declared in pyproject.toml.

The extension is optional: where it does not compile (no C compiler, no
Python headers) the install still succeeds and the numpy backend uses its
pure-numpy paths (``infer doctor`` says which). OpenMP is used where the
compiler supports it (gcc and clang with libomp on Linux), so a product uses
every core the way BLAS does.
"""

import sys

from setuptools import Extension, setup

CPU = "backends/cpu/"
openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
setup(
    ext_modules=[
        Extension(
            "infer.backends.cpu._kernels",
            # One file per concern (kernels.h lists them); the x86 forms apart, each
            # function compiled for its instructions by a target attribute, so one set
            # of flags builds every file and the module still runs on any x86-64 CPU.
            sources=[CPU + name for name in (
                "module.c", "gemv.c", "blocks.c", "q8.c", "tiled.c", "rows.c", "unary.c", "attention.c", "plan.c",
                "recurrent.c",
                "x86/gemv_avx2.c", "x86/gemv_avx512.c", "x86/blocks_x86.c", "x86/q8_x86.c", "x86/q8row_x86.c", "x86/kvq8_x86.c",
                "x86/tiled_x86.c",
            )],
            depends=[CPU + "kernels.h", CPU + "x86/simd.h"],
            extra_compile_args=["-O3", "-ffp-contract=off", *openmp],  # dequantize: multiply, then add, as numpy does
            extra_link_args=openmp,
            # libm by name, so expf and tanhf bind to their current versions: an unversioned
            # reference binds to glibc's oldest, whose wrapper takes a slow SVID error path on
            # every underflow (a softmax's far-below-the-maximum scores; docs/performance.md).
            libraries=["m"] if sys.platform.startswith("linux") else [],
            optional=True,
        ),
        # GGUF SentencePiece vocabularies encoded by score (formats/gguf_spm.py); plain C,
        # no SIMD; optional too: without it tokenizers encodes them.
        Extension("infer.formats._sentencepiece", sources=["formats/sentencepiece.c"], depends=["formats/bpe.h"],
                  extra_compile_args=["-O2"], optional=True),
        # GGUF byte-level BPE vocabularies from their stored merges (formats/gguf_bpe.py); plain C,
        # optional too: without it tokenizers encodes them.
        Extension("infer.formats._bytelevel", sources=["formats/bytelevel.c"], depends=["formats/bpe.h"],
                  extra_compile_args=["-O2"], optional=True),
        # A GGUF string array's length-prefix walk (formats/gguf_file.py); Python walks it without.
        Extension("infer.formats._gguf_strings", sources=["formats/gguf_strings.c"],
                  extra_compile_args=["-O2"], optional=True),
    ]
)
