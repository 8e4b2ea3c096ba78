"""The CPU kernels (the C sources beside this file, one extension module), as the backends call them.

The numpy backend computes on them, and torch/cpu runs the same kernels on
its float32 tensors' memory (a CPU tensor and its ``.numpy()`` share it).
This module is what both import: which kernel path runs (``INFER_NUMPY_KERNELS``),
the thread governor, how an affine or GGML-block weight is handed to them,
and one documented function per kernel. Nothing here imports a framework.

Every array argument is a C-contiguous numpy array (or anything exposing
such a buffer) of the dtype named; ``out`` arguments are written in place.
The kernels check sizes against the buffers and raise ``ValueError`` on a
mismatch, never writing outside them. :data:`native` is None where the
extension is not built or ``INFER_NUMPY_KERNELS=off``: callers check it
before calling any function below.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from infer.errors import ConfigError
from infer.ops import PackedWeight, QuantizedTensor
from infer.quantize import AffineTensor

#: Which C kernel path the backends use: ``auto`` (the best the CPU has),
#: ``avx2`` (AVX2+FMA, as on a CPU without AVX-512), ``portable`` (the plain
#: C loops, as on a CPU without AVX2) or ``off`` (no C kernels: pure numpy,
#: GGUF weights dequantized to float32). Read once at import; it lets a user,
#: and the test suite, run every path on one machine.
KERNELS_ENV = "INFER_NUMPY_KERNELS"
_KERNEL_CHOICES = {"auto": None, "avx512": "avx512", "avx2": "avx2+fma", "portable": "portable", "off": None}

#: The extension as built, whatever ``INFER_NUMPY_KERNELS`` chose (None: not built).
BUILT: Any
try:  # the C kernels (backends/cpu/*.c): optional, built at install where a compiler exists
    from infer.backends.cpu import _kernels as BUILT
except ImportError:  # pragma: no cover - exercised where the extension is not built
    BUILT = None


def _kernel_choice() -> str:
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in _KERNEL_CHOICES:
        raise ConfigError(f"{KERNELS_ENV}={choice!r} is not one of {', '.join(_KERNEL_CHOICES)}")
    return choice


def _load_kernels(choice: str) -> Any:
    if choice == "off" or BUILT is None:
        return None
    path = _KERNEL_CHOICES[choice]
    if path is not None:
        if path not in BUILT.paths():
            raise ConfigError(f"{KERNELS_ENV}={choice}: this CPU runs only {', '.join(BUILT.paths())}")
        BUILT.use_simd(path)
    return BUILT


#: The path chosen at import (``auto`` unless the variable says otherwise).
KERNELS = _kernel_choice()
#: The extension module the backends compute on, or None (not built, or ``off``).
native: Any = _load_kernels(KERNELS)

#: Products with at most this many rows run in the C kernel on the codes;
#: more rows (prefill) by :data:`EXACT_GEMM`'s path, which is
#: faster once the weight's rows are reused that many times (where the
#: decoding kernel and BLAS on slabs crossed: docs/performance.md, "The numpy
#: backend's constants"; the tiled kernel: "The exact prefill kernel").
KERNEL_ROWS = 16
#: How an exact product of more than :data:`KERNEL_ROWS` rows runs:
#: ``tiled``, the blocked kernel that decodes each panel of the weight once,
#: on every thread, and reuses it from L1 for every row (backends/cpu/tiled.c);
#: ``blas``, slabs dequantized on one thread for numpy's (torch's) BLAS.
#: ``tiled`` is the default where the kernels run on AVX2 or AVX-512: with
#: BLAS kept to one thread beside it (prefill's attention GEMMs, whose woken
#: BLAS threads otherwise spin on the cores the kernel's OpenMP threads need),
#: prefill ran 1.3-2.2x faster than on BLAS on every catalog and benchmark
#: model at two threads (docs/performance.md, "The exact prefill kernel").
#: The portable path's plain-C micro-kernel is slower than BLAS (0.28x on
#: SmolLM2), so there ``blas`` is. Read from ``INFER_EXACT_GEMM``
#: (``tiled``, ``blas``, or ``auto``, the default) at import; the backends
#: read it here at each product, so a benchmark may set it between runs
#: (``benchmarks/tiled_gemm.py``). Where the kernels lack the tiled product, ``blas``.
EXACT_GEMM_ENV = "INFER_EXACT_GEMM"
_EXACT_GEMM_CHOICES = ("auto", "tiled", "blas")


def _exact_gemm_choice() -> str:
    choice = os.environ.get(EXACT_GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in _EXACT_GEMM_CHOICES:
        raise ConfigError(f"{EXACT_GEMM_ENV}={choice!r} is not one of {', '.join(_EXACT_GEMM_CHOICES)}")
    if not hasattr(native, "gemm"):
        return "blas"
    if choice == "auto":
        return "blas" if native.simd() == "portable" else "tiled"
    return choice


EXACT_GEMM = _exact_gemm_choice()
#: Float32 bytes of weight rows dequantized at a time for BLAS: the smallest
#: scratch buffer (it counts in the peak memory) with which prefill still runs
#: at full speed (docs/performance.md).
SLAB_BYTES = 2 << 20
#: GGML block types the kernels read as a GGUF file stores them, and the form
#: (the kernels' ``bits`` argument) naming each.
BLOCK_FORMS: dict[str, int] = native.block_forms() if hasattr(native, "block_forms") else {}
#: Or'ed into a product's ``bits`` (:func:`gemv`): with two or more rows of x,
#: round them to int8 per 32 values and multiply in integer dot products
#: (``activations="q8"``; backends/cpu/q8.c, docs/quantization.md "Quantized
#: activations"). 0 where the kernels are not built. Blocks of 32 for every
#: weight type, the K types included: llama.cpp's Q8_K (256 values a scale, the
#: sub-scales applied in integers) measured 1.17-1.32x slower on Q4_K products in
#: this kernel's lanes, and is coarser (docs/performance.md, "The int8 prefill kernel").
Q8_FLAG: int = getattr(native, "Q8_FLAG", 0)
#: The activation schemes (``infer.load(activations=...)``) the kernels
#: compute: ``"q8"`` where they are built with :data:`Q8_FLAG`. Every backend
#: whose quantized products are these kernels' (numpy, torch/cpu) lists these.
ACTIVATION_SCHEMES: frozenset[str] = frozenset({"q8"}) if Q8_FLAG else frozenset()
#: Widest row of a block form the kernels take (its decoded codes fill a tile buffer on the stack).
BLOCK_COLS = 32768
#: The GGML types kept as the file stores them, by kernel path: those whose
#: decoding products measured at least as fast on the blocks as on the converted
#: form (a float16 scale and bias per group of 32, the codes a nibble or a byte
#: each), which the others get at load (docs/performance.md, "All eight types as
#: stored"). As stored a weight reads fewer bytes (the K types, Q5_0, Q5_1) or
#: the same (Q4_0, Q4_1, Q8_0), costs nothing at load and stays the file's pages.
#: AVX-512 decodes all eight in registers; on AVX2, Q5_0's and Q5_1's fifth bits
#: cost more than their bytes save (1.25x the converted time); the portable path
#: decodes the 32-value types through a buffer, 1.1x to 2x slower than converted.
STORED_BY_PATH: dict[str, frozenset[str]] = {
    "avx512": frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}),
    "avx2+fma": frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}),
    "portable": frozenset({"Q4_K", "Q5_K", "Q6_K"}),
}
#: The types kept as stored on the path in use (empty without the kernels).
#: :func:`keeps_stored` reads it at load: setting it here (not on a module that
#: imported it) changes what the next load keeps (``benchmarks/stored_blocks.py``).
STORED_TYPES: frozenset[str] = STORED_BY_PATH.get(native.simd(), frozenset()) if native is not None else frozenset()
#: The same choice for a load with int8 activations (``activations="q8"``),
#: whose products decode the codes into bytes, not floats: there the fifth bits
#: of Q5_0 and Q5_1 cost AVX2 less than the bytes they save (Gemma 3 270M on a
#: Zen 3, both forms in one process: prefill 1.09x, decode 1.07x, the same
#: bits; docs/performance.md, "Q5_0 as stored with int8 activations"). The
#: portable path keeps its exact choice: its one-row q8 product on Q5_0's
#: blocks ran 0.65x the converted form's (level at 128 rows).
STORED_BY_PATH_Q8: dict[str, frozenset[str]] = {
    "avx512": STORED_BY_PATH["avx512"],  # all eight
    "avx2+fma": STORED_BY_PATH["avx512"],
    "portable": STORED_BY_PATH["portable"],
}
#: The types kept as stored on the path in use with ``activations="q8"``.
STORED_TYPES_Q8: frozenset[str] = (STORED_BY_PATH_Q8.get(native.simd(), frozenset()) if native is not None
                                   else frozenset())


class ThreadGovernor:
    """Runs the kernels on fewer threads while other work keeps the cores busy.

    OpenMP's workers spin between the few hundred short products of a decode
    step; when another process holds a core, a descheduled worker stalls
    every product behind it (measured: docs/performance.md, "A busy
    machine"). So every ``interval``
    seconds this reads how much CPU the machine spent busy (``/proc/stat``)
    beyond this process's own (``os.times``), in cores, and allows the
    kernels the cores that are left (at least one). Where ``/proc/stat`` is
    missing, or ``OMP_NUM_THREADS`` sets the threads, it does nothing.
    """

    def __init__(self, kernels: object, interval: float = 0.5, stat: str = "/proc/stat") -> None:
        self.kernels, self.interval, self.stat = kernels, interval, stat
        self.most = kernels.threads()  # type: ignore[attr-defined]
        self.threads = self.most
        self.enabled = self.most > 1 and "OMP_NUM_THREADS" not in os.environ and os.path.exists(stat)
        self._last: tuple[float, float, float] | None = None
        self._next = 0.0

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall seconds, machine busy CPU seconds, this process's CPU seconds)."""
        try:
            with open(self.stat, encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        if len(fields) < 4:
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        mine = os.times()
        return time.monotonic(), (sum(fields[:8]) - idle) / hz, mine.user + mine.system

    def check(self) -> int:
        """The threads the next products may use (re-decided at most every ``interval``)."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now < self._next:
            return self.threads
        self._next = now + self.interval
        sample = self._sample()
        if sample is None:
            return self.threads
        if self._last is not None and sample[0] > self._last[0]:
            wall = sample[0] - self._last[0]
            others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall  # in cores
            threads = max(1, min(self.most, (os.cpu_count() or self.most) - int(others + 0.5)))
            if threads != self.threads:
                self.kernels.set_threads(threads)  # type: ignore[attr-defined]
                self.threads = threads
        self._last = sample
        return self.threads


#: The kernels' thread governor (None without the kernels).
GOVERNOR = ThreadGovernor(native) if native is not None and hasattr(native, "set_threads") else None


# -- the kernels, one function each ---------------------------------------------------------


#: The cache line the kernels' 512-bit loads want their operands to start on.
CACHE_LINE = 64


#: From this many bytes up a zeroed :func:`cache_line_array` is a mapping of its own
#: (:func:`mapped_zeros`), where the system can map one.
MAPPED_ZEROS = 1 << 20
#: numpy asks for huge pages from 4 MiB up (its allocator's own threshold); so do these.
_HUGE_PAGES = 4 << 20


def cache_line_array(shape: tuple[int, ...], dtype: Any, *, zeroed: bool = False) -> np.ndarray:
    """A new C-contiguous array of ``shape`` whose data starts a cache line.

    numpy aligns its data to 16 bytes, and a large array (a KV pool, a state
    pool) lands 16 bytes past a page, so the kernels' 64-byte loads spanned two
    lines three times in four, or on every row of a pool. Measured on a Zen 4:
    decode attention over a float16 pool of 16,384 positions 1.25x the time,
    the exact one-row products 1.04-1.06x (docs/performance.md, "Operands on
    cache lines"). ``zeroed`` gives zeros whose pages are the system's lazily
    zeroed ones, so an unused pool costs no memory: from :data:`MAPPED_ZEROS`
    bytes up a mapping of its own (:func:`mapped_zeros`), below that
    ``np.zeros``."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if zeroed and nbytes >= MAPPED_ZEROS and hasattr(mmap, "MAP_PRIVATE"):
        return mapped_zeros(nbytes).view(dt).reshape(shape)  # a page's start: a line's
    raw = (np.zeros if zeroed else np.empty)(nbytes + CACHE_LINE, np.uint8)
    start = -int(raw.__array_interface__["data"][0]) % CACHE_LINE
    return raw[start:start + nbytes].view(dt).reshape(shape)


def mapped_zeros(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (uint8, writable) in an anonymous private mapping of their
    own, unmapped when the array and its views are gone.

    ``np.zeros`` is ``calloc``, whose pages are the lazily zeroed ones only when glibc
    maps the block afresh; once the process has freed large arrays (glibc then raises
    its mapping threshold, up to 32 MiB) a block of up to that size is cut from the
    heap and cleared byte by byte, all of it resident at once. Measured: after
    test_activations_q8.py's products, ``np.zeros`` of 8 and 30 MB made 7 and 30 MB
    resident at once, and a 33.5 MB float16 pool 34 MB. A mapping of its own is
    lazily zeroed whatever the heap holds, and private, so a forked child writes its
    own copy, as with heap memory. Huge pages are asked for from 4 MiB up, as numpy
    does for its own large arrays (with ``madvise`` huge pages, the default, a pool
    then costs memory 2 MiB at a time as it fills)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if nbytes >= _HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small ones, as numpy would get
            pass
    return np.frombuffer(mapping, np.uint8, nbytes)


def gemv(bits: int, x: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray | None,
         out: np.ndarray, m: int, k: int, n: int, group: int = 32, half: bool = False, factor: float = 0.0) -> None:
    """``out = x @ W.T`` for an affine-quantized ``W`` and up to
    :data:`KERNEL_ROWS` rows: ``x`` float32 ``[m, k]``; ``codes`` uint8
    ``[n, k/2]`` (``bits`` 4) or ``[n, k]`` (8); ``scales`` and ``biases``
    ``[n, k/group]``, float32 (float16 with ``half``), ``biases`` None for
    ``factor * scales``; ``out`` float32 ``[m, n]``. ``group`` 32, or 16 for
    8-bit codes. For GGML blocks as stored, ``bits`` is the form
    (:data:`BLOCK_FORMS`) and ``codes`` the stored bytes (:func:`kernel_args`)."""
    native.gemv(bits, x, codes, scales, biases, out, m, k, n, group, half, factor)


def gemv_f32(x: np.ndarray, w: np.ndarray, out: np.ndarray, m: int, k: int, n: int) -> None:
    """``out = x @ w.T`` for float32 ``x`` ``[m, k]`` (few rows: decoding) and
    float32 ``w`` ``[n, k]``, on the kernels' OpenMP threads (not BLAS's)."""
    native.gemv_f32(x, w, out, m, k, n)


def dequantize(bits: int, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, out: np.ndarray,
               n: int, k: int, parallel: bool = True, group: int = 32, half: bool = False,
               factor: float = 0.0) -> None:
    """``out`` float32 ``[n, k] = scale * code + bias`` (arguments as
    :func:`gemv`'s), the same float32 values as ``AffineTensor.dequantize``.
    ``parallel=False`` keeps it on the calling thread: before a BLAS call,
    OpenMP workers would compete with BLAS's spinning ones."""
    native.dequantize(bits, codes, scales, biases, out, n, k, parallel, group, half, factor)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, out: np.ndarray, rows: int, n: int, eps: float,
             residual: np.ndarray | None = None, h: np.ndarray | None = None) -> None:
    """RMS norm of float32 ``x`` ``[rows, n]`` into ``out``, times ``weight``
    ``[n]`` unless None. With ``residual`` and ``h``: ``h = x + residual``
    first (written), and ``out = rms_norm(h)``. Differs from the numpy
    formula only in the order of its sum of squares."""
    if residual is None:
        native.rms_norm(x, weight, out, rows, n, eps)
    else:
        native.rms_norm(x, weight, out, rows, n, eps, residual, h)


def layer_norm(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, out: np.ndarray, rows: int,
               n: int, eps: float) -> None:
    """LayerNorm of float32 ``x`` ``[rows, n]`` into ``out``, with optional
    ``weight`` and ``bias`` ``[n]``, in one pass."""
    native.layer_norm(x, weight, bias, out, rows, n, eps)


def silu(x: np.ndarray, up: np.ndarray | None, out: np.ndarray) -> None:
    """``out = silu(x)``, times ``up`` unless None (SwiGLU), of float32 ``x``
    ``[rows, n]`` (or ``[n]``) into contiguous ``out`` of the same shape, in one
    pass on the kernels' threads. ``x`` and ``up`` need only contiguous columns:
    the two halves of a fused gate/up product are taken in place. Within 2.3
    ulp of the formula in float64, the same bits on every code path
    (backends/cpu/unary.c)."""
    rows, n = (1, x.shape[0]) if x.ndim == 1 else x.shape
    native.silu(x, up, out, rows, n)


#: The ``act`` argument of ``native.silu`` for GELU's tanh form (unary.c's ACT_GELU_TANH).
GELU_TANH = 1


def gelu_tanh(x: np.ndarray, out: np.ndarray) -> None:
    """``out = 0.5 x (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``
    (GELU's tanh form, ``gelu_pytorch_tanh``), of float32 ``x`` as :func:`silu`
    takes it, computed as ``x / (1 + exp(-2u))`` in the same pass and with the
    same ``exp`` as SiLU: the same bits on every code path. ``u`` is rounded
    step by step in float32, as the numpy formula rounds it; for that ``u`` the
    result is within 2.3 ulp of its float64 value (tested: 2.05), and -0 where
    ``exp(-2u)`` overflows (the value is below 3e-38) (backends/cpu/unary.c)."""
    rows, n = (1, x.shape[0]) if x.ndim == 1 else x.shape
    native.silu(x, None, out, rows, n, GELU_TANH)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray, tokens: int, heads: int, d: int,
         half: int) -> None:
    """Rotary embedding, rotate-half form, of float32 ``x`` ``[tokens, heads,
    d]`` into ``out``: the first ``2 * half`` dims rotated by ``cos``/``sin``
    ``[tokens, half]``, the rest copied. Bit-identical to the numpy formula."""
    native.rope(x, cos, sin, out, tokens, heads, d, half)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, tq: int, tk: int, hq: int, hkv: int,
              dk: int, dv: int, scale: float, causal: bool, window: int, softcap: float,
              table: np.ndarray | None = None, block: int = 0, parallel: bool = True,
              sinks: np.ndarray | None = None) -> None:
    """Attention for the few query rows of decoding, float32: ``q`` ``[tq,
    hq, dk]``, ``k`` ``[tk, hkv, dk]``, ``v`` ``[tk, hkv, dv]``, ``out``
    ``[tq, hq, dv]``. Per query row and head: scores over the visible keys
    (bottom-right aligned causal mask, the sliding window when ``window > 0``),
    tanh soft-capping when ``softcap > 0``, softmax (with each head's sink
    logit from ``sinks`` ``[hq]`` in the denominator), weighted sum of values.
    With an int64 block ``table``, ``k`` and ``v`` are paged pools ``[blocks,
    block, hkv, d]`` read in place. ``k`` and ``v`` may both be float16 (a
    ``kv_dtype="float16"`` pool): they are read as the float32 values they
    hold, so the result has the bits of the same pool widened first. ``k``
    and ``v`` may both be uint8 pools of q8_0 blocks (``kv_dtype="q8_0"``,
    ``[.., hkv, d // 32 * 34]``; ``dk`` and ``dv`` multiples of 32, counted
    in values): the queries are quantized once and the scores are integer
    dot products (backends/cpu/attention.c).
    ``parallel=False`` keeps it on the calling thread (after BLAS products,
    whose spinning threads OpenMP's would fight)."""
    kind = KV_Q8_0 if k.dtype == np.uint8 else int(k.dtype == np.float16)
    native.attention(q, k, v, out, tq, tk, hq, hkv, dk, dv, scale, causal, window, softcap, table, block,
                     parallel, sinks, kind)


#: The kernels' code for a pool of q8_0 blocks (attend_args.half; kernels.h's KV_Q8_0).
KV_Q8_0 = 3


def quantize_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    """Float32 ``x`` (contiguous, a multiple of 32 values) into q8_0 blocks
    at ``out`` (uint8, 34 bytes per 32 values): a ``kv_dtype="q8_0"`` pool's
    write, as :func:`infer.oplib.quantize_q8_0` defines it."""
    native.q8_0(x, out, x.size // 32)


# -- weights handed to the kernels ---------------------------------------------------------


def block_form(tensor: Any) -> int | None:
    """The kernels' form for a matrix they can read in its stored GGML blocks
    (:data:`BLOCK_FORMS`: rows of whole blocks of one of the eight types, at
    most :data:`BLOCK_COLS` wide), or None: the kernels are not built, or the
    tensor is not such blocks. Whether a load keeps a tensor so is
    :func:`keeps_stored`'s choice."""
    if not BLOCK_FORMS or not isinstance(tensor, QuantizedTensor) or len(tensor.shape) != 2:
        return None
    form = BLOCK_FORMS.get(tensor.qtype)
    k, values = tensor.shape[1], 256 if tensor.qtype.endswith("_K") else 32
    if form is None or not (0 < k <= BLOCK_COLS and k % values == 0) or tensor.shape[0] < 1:
        return None
    blocks = tensor.ggml_blocks()
    return form if blocks is not None and blocks[0] == tensor.qtype else None


def stored_types(activations: str | None = None) -> frozenset[str]:
    """The GGML types a load keeps as stored on the path in use:
    :data:`STORED_TYPES`, or :data:`STORED_TYPES_Q8` with ``activations="q8"``
    (read when called, so a benchmark may set either)."""
    return STORED_TYPES_Q8 if activations == "q8" else STORED_TYPES


def keeps_stored(tensor: Any, activations: str | None = None) -> bool:
    """Whether a load with ``activations`` keeps ``tensor`` in its file's
    blocks for the kernels (:func:`block_form`, of a type in
    :func:`stored_types`) rather than converting it to its affine form."""
    return block_form(tensor) is not None and tensor.qtype in stored_types(activations)


#: The scales argument of a block form (its scales are in its blocks).
_IN_BLOCKS = np.empty(0, np.float32)


def kernel_args(w: AffineTensor | QuantizedTensor) -> tuple[Any, ...]:
    """The C kernels' arguments for ``w``: bits (5- and 6-bit codes are
    stored one per byte, so 8), codes, scales, biases (None where they are
    the bias factor times the scales), then k, n, group, whether the scales
    are float16, and the bias factor (0.0 where biases are held). For GGML
    blocks read as stored (:func:`block_form`): the form in place of bits,
    the stored bytes ``[n, bytes_per_row]`` as codes, no scales or biases,
    and the super-block's 256 as group."""
    n, k = w.shape
    if not isinstance(w, AffineTensor):
        form, raw = block_form(w), w.ggml_blocks()
        if form is None or raw is None:
            raise ValueError(f"{w!r} is not a weight the C kernels compute on")
        return (form, np.ascontiguousarray(raw[1]), _IN_BLOCKS, None, k, n, 256 if w.qtype.endswith("_K") else 32,
                False, 0.0)
    return (4 if w.bits == 4 else 8, w.packed, w.scales, w.stored_biases, k, n, w.group, w.scales.dtype == np.float16,
            0.0 if w.bias_factor is None else w.bias_factor)


def affine_gemv(x2: np.ndarray, w: AffineTensor | QuantizedTensor, out: np.ndarray, q8: bool = False) -> None:
    """``out = x2 @ W.T`` for rows of float32 ``x2`` (contiguous), in the C
    kernel on the codes: exact for up to :data:`KERNEL_ROWS` rows; with
    ``q8``, any number of rows, two or more of them quantized to int8 (:data:`Q8_FLAG`)."""
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(w)
    if GOVERNOR is not None:
        GOVERNOR.check()
    native.gemv(bits | Q8_FLAG if q8 else bits, x2, codes, scales, biases, out, x2.shape[0], k, n, group, half,
                factor)


#: Rows of x a tiled product takes at a time: the kernel packs its rows once a
#: call (rows x k float32 beside x itself), which a long prompt's MLP products
#: would otherwise double (a 4,096-token prompt on the 1B shape: 134 MB more at
#: the down projection); each call decodes the weight again, which at 512 rows
#: is a few percent of the product.
TILED_ROWS = 512


def affine_gemm(x2: np.ndarray, w: AffineTensor | QuantizedTensor, out: np.ndarray) -> None:
    """``out = x2 @ W.T`` for any number of rows of float32 ``x2``
    (contiguous), exact, in the tiled kernel: each panel of ``W`` decoded to
    float32 once, on the kernels' threads, for up to :data:`TILED_ROWS` rows
    at a time (:data:`EXACT_GEMM`)."""
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(w)
    if GOVERNOR is not None:
        GOVERNOR.check()
    m = x2.shape[0]
    for i0 in range(0, m, TILED_ROWS):  # a row's result is the same in any call: bits unchanged
        i1 = min(m, i0 + TILED_ROWS)
        native.gemm(bits, x2[i0:i1], codes, scales, biases, out[i0:i1], i1 - i0, k, n, group, half, factor)


def slab_rows(w: AffineTensor | QuantizedTensor, slab_bytes: int = SLAB_BYTES) -> int:
    """Rows of ``w`` dequantized at a time for a many-row product (``slab_bytes`` of float32)."""
    n, k = w.shape
    return max(1, min(n, slab_bytes // (4 * k)))


def affine_slabs(w: AffineTensor | QuantizedTensor, buffer: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(r0, r1, rows r0..r1 of W as float32)``, one slab after another, each
    dequantized into ``buffer`` (float32, a multiple of k values: its size
    decides the slab), for the caller's GEMM. On this thread: OpenMP workers
    woken here would fight BLAS's spinning threads for the cores."""
    bits, codes, scales, biases, k, n, group, half, factor = kernel_args(w)
    rows = buffer.size // k
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        slab = buffer[: (r1 - r0) * k].reshape(r1 - r0, k)
        native.dequantize(bits, codes[r0:r1], scales[r0:r1], None if biases is None else biases[r0:r1], slab, r1 - r0,
                          k, False, group, half, factor)
        yield r0, r1, slab


def affine_product(x2: np.ndarray, w: AffineTensor | QuantizedTensor, out: np.ndarray, q8: bool,
                   slab_buffer: Callable[[int], np.ndarray], slab_product: Callable[[int, int, np.ndarray], None],
                   kernel_rows: int = KERNEL_ROWS, slab_bytes: int = SLAB_BYTES) -> bool:
    """``out = x2 @ W.T`` as every CPU backend runs it: the C kernels for up
    to ``kernel_rows`` rows (any number with ``q8``), else the tiled kernel,
    or, where :data:`EXACT_GEMM` says ``blas``, ``slab_product(r0, r1, slab)``
    (the caller's GEMM of ``x2`` with each dequantized slab into ``out[:, r0:r1]``)
    over slabs of ``slab_bytes`` in ``slab_buffer(values)``, a float32 buffer
    of at least that many values. Returns whether BLAS ran it (its threads may
    still be spinning)."""
    if q8 or x2.shape[0] <= kernel_rows:
        affine_gemv(x2, w, out, q8)
        return False
    if EXACT_GEMM == "tiled":  # read here: a benchmark may switch it between runs
        affine_gemm(x2, w, out)
        return False
    need = slab_rows(w, slab_bytes) * w.shape[1]
    for r0, r1, slab in affine_slabs(w, slab_buffer(need)[:need]):
        slab_product(r0, r1, slab)
    return True


def with_kernel_args(weight: PackedWeight) -> PackedWeight:
    """``weight`` with :func:`kernel_args` kept on it (as
    :attr:`~infer.ops.PackedWeight.kernel`) where the kernel computes it, for
    the decode path's products."""
    w = weight.data
    if (isinstance(w, AffineTensor) and (w.group == 32 or (w.group == 16 and w.bits > 4)) and w.shape[1] > 0
            or block_form(w) is not None):
        weight.kernel = kernel_args(w)
    return weight



# -- the recurrent layers' ops (recurrent.c) -------------------------------------------------

#: Rows a sequence's run needs for gated_delta_rule's chunked form (the UT
#: transform, 64 rows a chunk); shorter runs take the recurrence row by row.
#: 0: never. The chunked form does about 1.5 times the recurrence's arithmetic
#: for 128-wide heads and measured 2.2 times slower on AVX-512 at 512 rows
#: (docs/performance.md, "Recurrent layers in C"): on a CPU the products it
#: turns the scan into run no faster than the scan's own vector loops, so it
#: pays only where products are much cheaper (matrix units), and the
#: recurrence, its state block in L1, serves every length here.
GDR_CHUNKED_ROWS = 0
#: The widest key head gated_delta_rule's kernel takes, and the largest ssd
#: state size (their state blocks live on the stack); wider ones are refused
#: with ValueError, and the backends compute them in numpy instead.
GDR_MAX_K = SSD_MAX_N = 256


def has_recurrent() -> bool:
    """Whether the kernels in use have the recurrent ops."""
    return native is not None and hasattr(native, "ssd")


def _f32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


def _parallel(rows: int, parallel: bool | None = None) -> bool:
    """Whether a recurrent op of ``rows`` rows may use the threads: ``parallel``
    where the caller knows whether the products around it ran on the kernels'
    threads or on BLAS's, whose spinning threads OpenMP's would fight for the
    cores (as prefill's attention and dequantization run on the calling
    thread after BLAS products); otherwise (None) where the step's products
    are surely the kernels' own (up to :data:`KERNEL_ROWS` rows)."""
    return rows <= KERNEL_ROWS if parallel is None else parallel


def _batch(query_start: Any, checkpoint_rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``query_start`` and the checkpoint rows as int32, and the rows' indices in row order."""
    rows = np.zeros(0, np.int32) if checkpoint_rows is None else np.asarray(checkpoint_rows, np.int32).reshape(-1)
    return (np.ascontiguousarray(np.asarray(query_start).reshape(-1), np.int32), np.ascontiguousarray(rows),
            np.argsort(rows, kind="stable").astype(np.int64))


def causal_conv1d(x: np.ndarray, window: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                  query_start: Any, checkpoint_rows: Any, silu: bool,
                  parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.causal_conv1d` in float32 (the arguments
    checked by :func:`infer.oplib.check_causal_conv1d` first): ``(y [T, C],
    window after each sequence [B, K - 1, C], window after each checkpoint row
    [N, K - 1, C])``. Each output the sum over the taps in the reference's
    order; ``silu`` after the bias. ``parallel``: whether it may use the
    kernels' threads (None: :func:`_parallel`'s rule by rows)."""
    qs, rows, order = _batch(query_start, checkpoint_rows)
    if GOVERNOR is not None:
        GOVERNOR.check()
    (total, channels), k = x.shape, weight.shape[-1]
    nseq = len(qs) - 1
    y = np.empty((total, channels), np.float32)
    last = np.empty((nseq, k - 1, channels), np.float32)
    ckpt = np.empty((len(rows), k - 1, channels), np.float32)
    native.causal_conv1d(_f32(x), _f32(window), _f32(np.asarray(weight, np.float32).T), None if bias is None
                         else _f32(bias), qs, rows, order, y, last, ckpt, nseq, len(rows), total, channels, k, silu,
                         _parallel(total, parallel))
    return y, last, ckpt


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray, query_start: Any, checkpoint_rows: Any, scale: float, l2norm_qk: bool,
                     chunked: int | None = None, parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.gated_delta_rule` in float32 (arguments
    checked by :func:`infer.oplib.check_gated_delta_rule` first; ``scale``
    already resolved): ``(o [T, H, V], last states [B, H, K, V], checkpoint
    states [N, H, K, V])``. Runs of at least ``chunked`` rows (None:
    :data:`GDR_CHUNKED_ROWS`; 0: none) take the chunked form; ``parallel``
    as for :func:`causal_conv1d`."""
    qs, rows, order = _batch(query_start, checkpoint_rows)
    if GOVERNOR is not None:
        GOVERNOR.check()
    total, hk, dk = q.shape
    heads, dv = v.shape[1:]
    nseq = len(qs) - 1
    o = np.empty((total, heads, dv), np.float32)
    last = np.empty((nseq, heads, dk, dv), np.float32)
    ckpt = np.empty((len(rows), heads, dk, dv), np.float32)
    native.gated_delta_rule(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), _f32(state), qs, rows, order, o, last,
                            ckpt, nseq, len(rows), total, hk, heads, dk, dv, scale, l2norm_qk,
                            GDR_CHUNKED_ROWS if chunked is None else chunked, _parallel(total, parallel))
    return o, last, ckpt


def ssd(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray, D: np.ndarray | None,
        dt_bias: np.ndarray | None, state: np.ndarray, query_start: Any, checkpoint_rows: Any, dt_softplus: bool,
        dt_min: float, dt_max: float, parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`~infer.ops.Backend.ssd` in float32 (arguments checked by
    :func:`infer.oplib.check_ssd` first): ``(y [T, H, P], last states [B, H,
    P, N], checkpoint states [N, H, P, N])``, the recurrence row by row with
    each head's state in L1 a block of rows at a time; ``parallel`` as for
    :func:`causal_conv1d`."""
    qs, rows, order = _batch(query_start, checkpoint_rows)
    if GOVERNOR is not None:
        GOVERNOR.check()
    total, heads, head_dim = x.shape
    groups, size = B.shape[1:]
    nseq = len(qs) - 1
    y = np.empty((total, heads, head_dim), np.float32)
    last = np.empty((nseq, heads, head_dim, size), np.float32)
    ckpt = np.empty((len(rows), heads, head_dim, size), np.float32)
    native.ssd(_f32(x), _f32(dt), _f32(A), _f32(B), _f32(C), None if D is None else _f32(D),
               None if dt_bias is None else _f32(dt_bias), _f32(state), qs, rows, order, y, last, ckpt, nseq,
               len(rows), total, heads, head_dim, groups, size, dt_softplus, dt_min, min(dt_max, 3.0e38),
               _parallel(total, parallel))
    return y, last, ckpt
