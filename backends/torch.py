"""The torch backend: CUDA, Apple MPS and the CPU through PyTorch.

Arrays are ``torch.Tensor`` on the backend's device. Weights are copied to
the device once, at load (:meth:`~infer.ops.Backend.prepare_weight` calls
:meth:`TorchBackend.from_numpy`); from then on nothing leaves the device but
what the engine asks for with :meth:`TorchBackend.to_numpy`.

torch itself is imported only by the probes and the factory, so listing
backends on a machine without torch is cheap and says "torch is not
installed" instead of failing.

Compute dtypes: float32, bfloat16 and float16 on every device (bfloat16 on
CUDA only where the GPU supports it; on MPS only where the OS does). The
default is float32, except on CUDA where it is bfloat16 when supported:
decoding is bound by the bytes of weights read per token.

Quantized weights (docs/quantization.md): on the CPU, GGUF matrices with an
affine form stay in it and are computed by the numpy backend's C kernels on
the tensors' memory (exact; see ``_cpu_affine`` below), which also serve
float32 norms, rope and decoding's attention. Without those kernels, GGUF
Q4_0/Q4_1/Q4_K matrices can be kept as int4pack with float32 scales (exact),
and float checkpoints quantized on load (``q4``: int4pack; ``q8``: int8 per
output channel), when ``infer.load(..., quantize=...)`` asks for it;
otherwise GGUF weights are dequantized, because torch's float32 int4pack
kernel is slower than float32 BLAS here. On CUDA in bfloat16 the same is done with
tinygemm's int4 kernel (bfloat16 scales) and, where this torch has it, the
int8 one; on MPS nothing is kept quantized.

Where the contract leaves precision open, this backend widens: norms,
softmax, rope and the soft-capped attention path compute in float32 and
round once at the end.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infer.errors import UnsupportedOpError
from infer.ops import (
    Array,
    AttentionBatch,
    Backend,
    PackedWeight,
    QuantizedTensor,
    ShardedWeight,
    attention_mask,
    row_run,
)
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe, gpu_driver_absent
from infer.quantize import SCHEME_BITS, AffineTensor, from_gguf, is_embedding, is_linear_weight, quantize_affine

from . import kernels, torch_recurrent

log = logging.getLogger(__name__)

# Bound by _import_torch() on first use, so importing this module stays cheap.
torch: Any = None
F: Any = None
_DTYPES: dict[str, Any] = {}
_NAMES: dict[Any, str] = {}
_HAS_ENABLE_GQA = False
#: On CUDA, a context in which SDPA may pick every attention kernel but cuDNN's
#: (see ``attention``); a null context where this torch cannot choose.
_CUDA_SDPA: Callable[[], Any] = contextlib.nullcontext

NATIVE_OPS = ("softcap", "swiglu", "synchronize", "attention", "topk", "compile", "prepare_weight",
              "quantized_linear", "clip", "causal_conv1d", "ssd", "softplus", "gated_delta_rule",
              "all_reduce", "all_gather", "broadcast")
# On the CPU, torch's float32 matrix-vector products are slower than numpy's
# BLAS (docs/backends.md, "Why these scores"), so torch/cpu ranks just below
# numpy: the default picks the faster path, and torch/cpu stays one
# `backend="torch:cpu"` away.
SCORES = {"cuda": 100, "mps": 90, "cpu": 8}


def _import_inductor_helpers() -> None:
    """Import ``torch.utils.mkldnn`` with its deprecation warning silenced.

    Inductor imports that module when a compiled function first runs. Its
    class bodies decorate 14 methods with ``torch.jit.script_method``, and
    each decoration warns that the decorator is deprecated (torch 2.13): a
    warning about torch's own code, on an import infer cannot avoid. So it is
    silenced here, where infer starts Inductor, for exactly that message;
    Inductor's own import then finds the module loaded and nothing warns.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        importlib.import_module("torch.utils.mkldnn")


def _separate_inductor_cache() -> None:
    """Keep Inductor's on-disk kernel cache apart per forced CPU capability.

    torch 2.13 keys the CPU kernels it caches on their generated source, which
    does not change with ``ATEN_CPU_CAPABILITY``; so a kernel compiled under
    one capability (say ``avx2``) is loaded under another and computes garbage
    (NaN logits, values hundreds off, heap corruption: tests/README.md). Where
    the capability is forced and no cache folder is chosen, each capability
    gets its own folder beside Inductor's default. Inductor reads the variable
    whenever it looks for its cache, so setting it before the first compile
    suffices.
    """
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not forced or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: leave Inductor's choice alone
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{forced}"
    log.debug("ATEN_CPU_CAPABILITY=%s: Inductor caches its kernels in %s", forced,
              os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _import_torch() -> None:
    global torch, F, _HAS_ENABLE_GQA, _CUDA_SDPA
    if torch is not None:
        return
    import torch as _torch
    import torch.nn.functional as _F

    _DTYPES.update({
        "float32": _torch.float32, "float16": _torch.float16, "bfloat16": _torch.bfloat16,
        "int32": _torch.int32, "int64": _torch.int64, "int8": _torch.int8,
        "uint8": _torch.uint8, "bool": _torch.bool,
    })
    _NAMES.update({v: k for k, v in _DTYPES.items()})
    # scaled_dot_product_attention grew grouped-query support in torch 2.5.
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in _torch.__version__.split(".")[:2])
    _HAS_ENABLE_GQA = (major, minor) >= (2, 5)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no way to choose, and no cuDNN attention either
        pass
    else:
        kept = [b for b in SDPBackend.__members__.values() if b.name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")]
        _CUDA_SDPA = functools.partial(sdpa_kernel, kept)
    torch, F = _torch, _F


# -- GGUF weights on the CPU: numpy's C kernels through torch tensors ---------------------
#
# torch has no CPU kernel for GGUF's blocks that is both exact and fast: its
# float32 int4pack path is a generic loop slower than float32 BLAS, and
# dequantized float32 weights read several times the bytes per token. The
# package's C kernels (backends/kernels.py), the numpy backend's, compute on the blocks' affine form
# exactly in float32, with run-time AVX2/AVX-512 paths; torch/cpu runs them on
# its tensors' memory (no copy: a CPU tensor and its .numpy() share it).
# Measured: docs/backends.md, "Quantized weights and speed".


def _cpu_affine(tensor: QuantizedTensor) -> PackedWeight | None:
    """A GGUF matrix kept for the C kernels: as the file stores it where they
    read its blocks (the numpy backend's STORED_TYPES), else in its affine
    form; None where it has neither."""
    if kernels.block_form(tensor) is not None:
        raw = kernels.kernel_args(tensor)[1]
        with warnings.catch_warnings():  # the map is read-only, and nothing writes to the view
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw)
        empty = torch.empty(0, dtype=torch.float32)
        return PackedWeight(tensor.shape, tensor.qtype, f"{tensor.qtype} blocks as stored, C kernel",
                            ("affine", tensor, (blocks, empty, empty)), rows=tensor)
    affine = from_gguf(tensor, groups=(16, 32), half=True)
    if affine is None or not (affine.group == 32 or affine.bits > 4):
        return None
    # A symmetric type holds no biases (affine.bias_factor): an empty tensor stands for them.
    held = affine.stored_biases if affine.stored_biases is not None else np.empty((0, 0), affine.scales.dtype)
    views = tuple(torch.from_numpy(a) for a in (affine.packed, affine.scales, held))
    how = f"{affine.bits}-bit affine group {affine.group}, {affine.scales.dtype} scales, C kernel"
    return PackedWeight(affine.shape, affine.qtype, how, ("affine", affine, views), rows=affine)


def _affine_linear(x: Any, affine: AffineTensor, views: tuple[Any, ...], capturing: bool) -> Any:
    """``x @ W.T`` in float32 for the affine weight ``W``: the C kernel for up
    to 16 rows, slabs of ``W`` dequantized for torch's GEMM beyond. Under
    torch.compile, as the custom op ``infer::affine_linear`` (opaque to it)."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    x = x.contiguous()
    if capturing and torch.compiler.is_compiling():
        if isinstance(affine, AffineTensor):
            factor = 0.0 if affine.bias_factor is None else affine.bias_factor
            return torch.ops.infer.affine_linear(x, *views, affine.bits, affine.group, factor)
        bits, group = (kernels.kernel_args(affine)[i] for i in (0, 6))  # blocks as stored: their form as the bits
        return torch.ops.infer.affine_linear(x, *views, bits, group, 0.0)
    return _affine_product(x, affine)


def _affine_product(x: Any, affine: AffineTensor | QuantizedTensor) -> Any:
    """The numpy backend's product on the tensors' memory: its C kernel for
    few rows, else its dequantized slabs through torch's GEMM (an affine
    weight, or GGML blocks as stored)."""
    n, k = affine.shape
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if x.shape[0] <= kernels.KERNEL_ROWS:
        kernels.affine_gemv(x.numpy(), affine, out.numpy())
        return out
    buffer = torch.empty(kernels.slab_rows(affine) * k, dtype=torch.float32)
    for r0, r1, slab in kernels.affine_slabs(affine, buffer.numpy()):
        out[:, r0:r1] = x @ torch.from_numpy(slab).T
    return out


class _OpBlocks(QuantizedTensor):
    """GGML blocks handed to ``infer::affine_linear`` as a uint8 tensor, for the
    numpy kernels (which need only :meth:`ggml_blocks` and the shape)."""

    def __init__(self, qtype: str, shape: tuple[int, int], raw: np.ndarray) -> None:
        self.qtype, self.shape, self.raw = qtype, shape, raw

    def ggml_blocks(self) -> tuple[str, np.ndarray]:
        return self.qtype, self.raw

    def dequantize(self) -> np.ndarray:
        raise NotImplementedError("blocks handed to a compiled op are only multiplied")


def _metadata() -> frozenset[Any]:
    """What a traced tensor may be asked outside the ops: its shape, dtype and layout."""
    t = torch.Tensor
    return frozenset({t.shape.__get__, t.dtype.__get__, t.device.__get__, t.ndim.__get__, t.is_cuda.__get__,
                      t.requires_grad.__get__, t.size, t.dim, t.numel, t.__len__, t.stride, t.is_contiguous,
                      t.element_size, t.data_ptr})


_TRACED_TENSOR: Any = None


def _traced_tensor() -> Any:
    """The tensor subclass the traced function sees while numpy's recorder
    records a torch/cpu step (made once, after torch's import): a tensor
    whose values depend on the step's inputs. torch computing on it outside
    the backend's ops would not be recorded (its trace-time result would be
    frozen into the program), so that raises instead; its shape, dtype and
    layout can be read."""
    global _TRACED_TENSOR
    if _TRACED_TENSOR is None:
        allowed = _metadata()

        class TracedTensor(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func not in allowed:
                    from infer.backends.numpy_plan import NotCapturable

                    raise NotCapturable(f"torch's {getattr(func, '__name__', func)} on a traced tensor, "
                                        "outside the backend's ops")
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))

        _TRACED_TENSOR = TracedTensor
    return _TRACED_TENSOR


class _CpuTensors:
    """CPU tensors lent to the numpy backend's recorder (``numpy_plan.HostArrays``):
    ``Tensor.numpy()`` and ``torch.from_numpy`` share the memory both ways."""

    def __init__(self) -> None:
        self._weights: dict[int, tuple[Any, PackedWeight]] = {}

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def to_host(self, x: Any) -> np.ndarray:
        with torch._C.DisableTorchFunctionSubclass():
            return x.detach().numpy()

    def from_host(self, a: np.ndarray) -> Any:
        return torch.from_numpy(a)

    def guard(self, x: Any) -> Any:
        return x.as_subclass(_traced_tensor())

    def traced(self, x: Any) -> bool:
        return isinstance(x, _traced_tensor())

    def weight(self, w: PackedWeight) -> Any:
        """A GGUF weight kept for the C kernels (``_cpu_affine``) as the numpy backend holds it."""
        hit = self._weights.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        data = w.data
        if not (isinstance(data, tuple) and len(data) == 3 and data[0] == "affine"):
            return w  # int4pack and the like: the recorder refuses it by name
        affine = data[1]
        host = kernels.with_kernel_args(PackedWeight(w.shape, w.qtype, w.scheme, affine, rows=affine))
        self._weights[id(w)] = (w, host)  # w kept alive: its id stays its own
        return host


_AFFINE_OP_REGISTERED = False


def _register_affine_op() -> None:
    """``infer::affine_linear`` for torch.compile: a captured step calls the
    C kernel as one opaque op (its fake shows Inductor the output's shape)."""
    global _AFFINE_OP_REGISTERED
    if _AFFINE_OP_REGISTERED or not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return

    @torch.library.custom_op("infer::affine_linear", mutates_args=())
    def affine_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                      bits: int, group: int, bias_factor: float) -> torch.Tensor:
        n = codes.shape[0]
        k = x.shape[1]
        named = {form: name for name, form in kernels.BLOCK_FORMS.items()}
        if bits in named:  # GGML blocks as stored: codes are the blocks, no scales or biases
            return _affine_product(x, _OpBlocks(named[bits], (n, k), codes.numpy()))
        held = biases.numpy() if biases.numel() else None  # empty: bias_factor * scales
        affine = AffineTensor("affine", (n, k), bits, codes.numpy(), scales.numpy(), held, group,
                              None if held is not None else bias_factor)
        return _affine_product(x, affine)

    @affine_linear.register_fake
    def _(x, codes, scales, biases, bits, group, bias_factor):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], codes.shape[0]))

    _AFFINE_OP_REGISTERED = True


class TorchBackend(Backend):
    """PyTorch on one device (``"cuda"``, ``"mps"`` or ``"cpu"``)."""

    name = "torch"
    float_dtypes = ("float32", "bfloat16", "float16")
    native_ops = frozenset(NATIVE_OPS)

    def __init__(self, device: str = "cpu", dtype: str | None = None) -> None:
        _import_torch()
        self.device = device
        self._device = torch.device(device)
        if device == "cuda":
            bf16 = torch.cuda.is_bf16_supported()
            self.float_dtypes = ("bfloat16", "float32", "float16") if bf16 else ("float32", "float16")
        super().__init__(dtype)
        if device == "mps" and self.compute_dtype == "bfloat16":
            try:  # bfloat16 on MPS needs macOS 14; ask the device rather than the OS version
                torch.zeros(1, dtype=torch.bfloat16, device=self._device)
            except (RuntimeError, TypeError) as exc:
                raise UnsupportedOpError(f"torch/mps cannot compute in bfloat16 here: {exc}") from None
        #: The C kernels (:mod:`infer.backends.kernels`) for float32 CPU tensors: norms,
        #: rope, decoding's attention and GGUF products, run on the tensors'
        #: memory; None off the CPU or where they are not built.
        self._kernels: Any = None
        if device == "cpu":
            self.native_ops = frozenset(NATIVE_OPS) - {"synchronize"}
            _register_affine_op()
            self._kernels = kernels.native
            if self._kernels is not None:
                self.native_ops = self.native_ops | {"fused_add_rms_norm"}
        elif device == "cuda" and self.compute_dtype == "bfloat16" and _cuda_int4_layout() is not None:
            # tinygemm int4 (bfloat16 activations, scales and zero points); q8 only
            # where this torch has a CUDA int8 kernel (probed once per process).
            self.quantize_schemes = frozenset({"q4", "q8"} if _cuda_int8_works() else {"q4"})
        else:
            # MPS, or CUDA in float32/float16 (tinygemm takes bfloat16 only), or a
            # torch whose CUDA int4 kernel failed the probe: nothing kept quantized,
            # and asking for on-load quantization is an error.
            self.native_ops = frozenset(NATIVE_OPS) - {"prepare_weight", "quantized_linear"}
            self.quantize_schemes = frozenset()
        if device not in ("cpu", "cuda"):  # gloo takes CPU tensors, NCCL CUDA ones: no process group for MPS
            self.native_ops = self.native_ops - {"all_reduce", "all_gather", "broadcast"}
        self._float = _DTYPES[self.compute_dtype]
        self._masks: dict[tuple[int, int, bool, int | None], Any] = {}

    # -- quantized weights ------------------------------------------------

    #: GGUF types packed into int4pack (groups of 32, 4-bit codes).
    INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
    quantize_schemes = frozenset(SCHEME_BITS)

    def prepare_weight(self, tensor: np.ndarray | QuantizedTensor, *, name: str = "") -> Array:
        """int4pack for GGUF Q4_0/Q4_1/Q4_K matrices where exact and asked for
        (see :meth:`keeps_gguf`); on-load ``q4`` as int4pack and ``q8`` as
        int8 per output channel; everything else in the compute dtype."""
        if isinstance(tensor, QuantizedTensor):
            if self._kernels is not None and self.quantize != "off" and len(tensor.shape) == 2:
                kept = _cpu_affine(tensor)
                if kept is not None:
                    return kept
            if self.keeps_gguf() and tensor.qtype in self.INT4_TYPES:
                affine = from_gguf(tensor)
                packed = None if affine is None else self._int4pack(affine, name)
                if packed is not None:
                    return packed
            return self.from_numpy(tensor.dequantize())  # never quantized a second time
        host = np.asarray(tensor)
        if (self.quantize in self.quantize_schemes and host.dtype.kind == "f"
                and host.ndim == 2 and host.shape[1] % 32 == 0
                and (is_linear_weight(name, host.shape) or is_embedding(name))):
            packed = self._quantize_on_load(host, name)
            if packed is not None:
                return packed
        return self.from_numpy(host)

    def keeps_gguf(self) -> bool:
        """Whether GGUF Q4 weights stay quantized (int4pack) here.

        On the CPU with float32 compute the kernel takes float32 scales, which
        is what makes GGUF blocks exact, but torch's float32 int4pack path is
        a slow generic loop, far slower than the float32 BLAS matrix-vector
        product (docs/backends.md, "Quantized weights and speed"), so it is used when
        ``quantize`` asks for quantized compute (``"q4"``/``"q8"``), not by
        default. On CUDA the tinygemm kernel (``_weight_int4pack_mm``) takes
        bfloat16 scales and zero points: GGUF's float16 scales are rounded to
        bfloat16 (within the bfloat16 rounding the dequantized weights get
        anyway in bfloat16 compute, but not bit-exact), also only when asked."""
        return self.quantize in self.quantize_schemes

    def _int4pack(self, affine: AffineTensor, name: str) -> PackedWeight | None:
        """``affine`` as int4pack with float32 scales and zero points, or None
        when not exact. The kernel computes ``(code - 8) * scale + zero`` fused
        (checked in tests); with ``zero = bias + 8 * scale`` exact in float32
        that is ``scale * code + bias`` rounded once, as in the affine form."""
        if self._device.type == "cuda":
            return self._int4pack_cuda(affine, name)
        if affine.bits != 4 or affine.group != 32 or affine.shape[0] % 16:
            return None  # the CPU packing takes N (output rows) in multiples of 16
        scale = affine.scales.astype(np.float64)
        zero = affine.biases.astype(np.float64) + 8.0 * scale
        if not np.array_equal(zero.astype(np.float32).astype(np.float64), zero):
            log.debug("%s: int4pack zero points not exact in float32; dequantized instead", name)
            return None
        codes = torch.from_numpy(affine.codes().astype(np.int32))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.from_numpy(np.stack([affine.scales.T, zero.astype(np.float32).T], axis=-1).copy())
        rows = affine if is_embedding(name) else None
        return PackedWeight(affine.shape, affine.qtype, "int4pack g32 f32", ("int4", packed, sz), rows)

    def _int4pack_cuda(self, affine: AffineTensor, name: str) -> PackedWeight | None:
        """``affine`` in tinygemm's layout: codes packed by
        ``_convert_weight_to_int4pack`` and ``[K/32, N, 2]`` bfloat16 scales and
        zero points (``zero = bias + 8 * scale``, rounded to bfloat16)."""
        n, k = affine.shape
        tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
        n_tile = 16 if torch.version.hip else 8  # the packed layout's output-row tile
        if affine.bits != 4 or affine.group != 32 or n % n_tile or tiles is None:
            log.debug("%s: %s does not fit tinygemm's int4 layout; kept in %s", name, affine.shape, self.compute_dtype)
            return None
        codes = torch.from_numpy(_nibbles(affine.codes(), _cuda_int4_layout())).to(self._device)
        packed = torch.ops.aten._convert_weight_to_int4pack(codes, tiles)
        zero = affine.biases.astype(np.float64) + 8.0 * affine.scales.astype(np.float64)
        sz = np.stack([affine.scales.T, zero.astype(np.float32).T], axis=-1)
        sz = torch.from_numpy(np.ascontiguousarray(sz)).to(self._device, torch.bfloat16)
        rows = affine if is_embedding(name) else None
        return PackedWeight(affine.shape, affine.qtype, "int4 tinygemm g32 bf16", ("int4", packed, sz), rows)

    def _quantize_on_load(self, host: np.ndarray, name: str) -> PackedWeight | None:
        if self.quantize == "q4":
            # bfloat16-rounded scales and biases keep zero = bias + 8 * scale exact in float32.
            return self._int4pack(quantize_affine(host, "q4", scale_dtype="bfloat16", name=name), name)
        # q8: torch's int8 kernel scales per output channel (no groups):
        # symmetric codes, scale = max|w| / 127 per row, rounded to bfloat16 so
        # that code * scale is exact in float32 (the host form matches).
        w = np.asarray(host, np.float32)
        scale = _bf16_up(np.abs(w).max(axis=1) / np.float32(127))
        scale = np.where(scale > 0, scale, np.float32(1))
        codes = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
        rows = None
        if is_embedding(name):
            rows = AffineTensor("q8", w.shape, 8, (codes.view(np.uint8) ^ np.uint8(0x80)), scale[:, None].copy(),
                                (scale * np.float32(-128))[:, None].copy(), group=w.shape[1])
        scale_dtype = torch.float32 if self._device.type == "cpu" else torch.bfloat16
        data = ("int8", torch.from_numpy(codes.copy()).to(self._device),
                torch.from_numpy(scale.astype(np.float32)).to(self._device, scale_dtype))
        return PackedWeight(w.shape, "q8", "int8 per channel", data, rows)

    def quantized_linear(self, x: Array, weight: PackedWeight, bias: Array | None = None) -> Array:
        """int4 / int8 matmul: in float32 on the CPU (activations widened,
        result rounded once to ``x``'s dtype), in bfloat16 on CUDA (the
        kernels' only activation dtype there)."""
        kind, w, s = weight.data
        if kind == "affine":
            y = _affine_linear(x.reshape(-1, x.shape[-1]), w, s, self.graph_capture)
            if bias is not None:
                y = y + bias.float()
            y = y.reshape(*x.shape[:-1], weight.shape[0])
            return y if y.dtype == x.dtype else y.to(x.dtype)
        lead = x.shape[:-1]
        wide = torch.float32 if self._device.type == "cpu" else torch.bfloat16
        x2 = x.reshape(-1, x.shape[-1]).to(wide)
        if kind == "int4" and self._device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, 32, s)
        elif kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm(x2, w, 32, s)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, w, s)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*lead, weight.shape[0]).to(x.dtype)

    # -- transfer, creation, casting -------------------------------------

    def _dtype(self, dtype: str) -> Any:
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise UnsupportedOpError(f"torch backend has no dtype {dtype!r}") from None

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        array = np.asarray(array)
        if dtype is None:
            target = self._float if array.dtype.kind == "f" else self._dtype(str(array.dtype))
        else:
            target = self._dtype(dtype)
        if array.dtype == np.float64 and target.is_floating_point:
            array = array.astype(np.float32)  # MPS has no float64; no device needs it here
        array = np.ascontiguousarray(array)
        if array.flags.writeable:
            host = torch.from_numpy(array)
        else:
            with warnings.catch_warnings():
                # torch warns that a read-only array (a memory-mapped weight)
                # could be written through the tensor; it is copied below, never written.
                warnings.simplefilter("ignore", UserWarning)
                host = torch.from_numpy(array)
        if self._device.type == "cpu":
            return host.to(dtype=target, copy=True)  # never share the caller's memory
        return host.to(self._device).to(target)  # the cast runs on the device

    def to_numpy(self, x: Array) -> np.ndarray:
        """Copy to the host; bfloat16 becomes float32 (exact)."""
        t = x.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        elif t.device.type == "cpu":
            t = t.clone()  # .numpy() of a CPU tensor would share its memory
        return t.cpu().numpy()

    def astype(self, x: Array, dtype: str) -> Array:
        return x.to(self._dtype(dtype))

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(int(d) for d in x.shape)

    def dtype(self, x: Array) -> str:
        try:
            return _NAMES[x.dtype]
        except KeyError:
            raise UnsupportedOpError(f"torch backend has no name for dtype {x.dtype}") from None

    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        target = self._dtype(dtype) if dtype else self._float
        return torch.zeros(tuple(shape), dtype=target, device=self._device)

    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        return torch.arange(start, stop, dtype=self._dtype(dtype), device=self._device)

    # -- linear algebra -----------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        return torch.matmul(a, _like(a, b))

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        if isinstance(weight, PackedWeight):
            return self.quantized_linear(x, weight, bias)
        if isinstance(weight, ShardedWeight):
            return self.sharded_linear(x, weight, bias)
        return F.linear(x, _like(x, weight), None if bias is None else _like(x, bias))

    # -- elementwise ---------------------------------------------------------

    def add(self, a: Array, b: Array | float) -> Array:
        return torch.add(a, _like(a, b))

    def sub(self, a: Array, b: Array | float) -> Array:
        return torch.sub(a, _like(a, b))

    def mul(self, a: Array, b: Array | float) -> Array:
        return torch.mul(a, _like(a, b))

    def div(self, a: Array, b: Array | float) -> Array:
        """True division; integer operands give float32, as in the numpy backend."""
        return torch.div(a, _like(a, b))

    def exp(self, x: Array) -> Array:
        return torch.exp(x)

    def sqrt(self, x: Array) -> Array:
        return torch.sqrt(x)

    def tanh(self, x: Array) -> Array:
        return torch.tanh(x)

    def cos(self, x: Array) -> Array:
        return torch.cos(x)

    def sin(self, x: Array) -> Array:
        return torch.sin(x)

    def silu(self, x: Array) -> Array:
        return F.silu(x)

    def gelu(self, x: Array) -> Array:
        return F.gelu(x)

    def gelu_tanh(self, x: Array) -> Array:
        return F.gelu(x, approximate="tanh")

    # -- reductions ----------------------------------------------------------

    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return torch.sum(x, dim=axis, keepdim=keepdims)

    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return torch.mean(x, dim=axis, keepdim=keepdims)

    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        return torch.amax(x, dim=axis, keepdim=keepdims)

    def argmax(self, x: Array, axis: int = -1) -> Array:
        """int64; torch documents that the first maximal index wins, as in numpy."""
        return torch.argmax(x, dim=axis)

    def topk(self, x: Array, k: int) -> tuple[Array, Array]:
        """A stable descending sort (``torch.topk`` leaves the order of ties
        unspecified; the contract puts the lower index first)."""
        values, order = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], order[..., :k]

    def softmax(self, x: Array, axis: int = -1) -> Array:
        if x.dtype in (torch.float16, torch.bfloat16):
            return torch.softmax(x, dim=axis, dtype=torch.float32).to(x.dtype)
        return torch.softmax(x, dim=axis)

    # -- normalisation, position, gather ---------------------------------------

    def _host(self, *xs: Any) -> bool:
        """Whether the C kernels take these tensors (float32, contiguous, on the
        CPU backend, not inside torch.compile's trace)."""
        return (self._kernels is not None and all(x.dtype == torch.float32 and x.is_contiguous() for x in xs)
                and not torch.compiler.is_compiling())

    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        if x.numel() and (self._host(x) if weight is None else self._host(x, weight) and weight.shape == x.shape[-1:]):
            out = torch.empty_like(x)
            kernels.rms_norm(x.numpy(), None if weight is None else weight.numpy(), out.numpy(),
                             x.numel() // x.shape[-1], x.shape[-1], eps)
            return out
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
        return y if weight is None else y * weight

    def fused_add_rms_norm(self, x: Array, residual: Array, weight: Array | None, eps: float) -> tuple[Array, Array]:
        """On the CPU in float32 one C pass (numpy's kernel); elsewhere add, then norm."""
        if (x.numel() and weight is not None and residual.shape == x.shape and self._host(x, residual, weight)
                and weight.shape == x.shape[-1:]):
            h, out = torch.empty_like(x), torch.empty_like(x)
            kernels.rms_norm(x.numpy(), weight.numpy(), out.numpy(), x.numel() // x.shape[-1], x.shape[-1],
                             eps, residual.numpy(), h.numpy())
            return out, h
        h = self.add(x, residual)
        return self.rms_norm(h, weight, eps), h

    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(x.dtype)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        """Computed in float32 (or wider), rounded once to ``x``'s dtype."""
        half = cos.shape[-1]
        if (not interleaved and x.dim() == 3 and x.numel() and cos.shape == sin.shape == (x.shape[0], half)
                and 2 * half <= x.shape[-1] and self._host(x, cos, sin)):
            out = torch.empty_like(x)
            kernels.rope(x.numpy(), cos.numpy(), sin.numpy(), out.numpy(), *x.shape, half)
            return out  # the same formula, bit for bit
        rot = 2 * half
        wide = torch.promote_types(x.dtype, torch.float32)
        cos = cos[:, None, :].to(wide)  # [tokens, 1, rot/2], broadcast over heads
        sin = sin[:, None, :].to(wide)
        xr = x[..., :rot].to(wide)
        if interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = xr[..., :half], xr[..., half:]
            rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        rotated = rotated.to(x.dtype)
        return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)

    def embedding(self, table: Array, ids: Array) -> Array:
        """Checks the range first: on CUDA an out-of-range index is a device
        assert that kills the process, not an exception. Not while a graph is
        being captured, where the ids are not known yet: the engine checks
        them before they enter a captured step."""
        if isinstance(table, PackedWeight):
            return self.packed_rows(table, ids)
        if ids.numel() and not torch.compiler.is_compiling():
            lo, hi = torch.stack((ids.min(), ids.max())).tolist()  # one device sync, not two
            if lo < 0 or hi >= table.shape[0]:
                raise IndexError(f"token id out of range [0, {table.shape[0]}): found {lo if lo < 0 else hi}")
        return F.embedding(self._index(ids), table)

    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        return torch.index_select(x, axis, self._index(indices))

    def _index(self, ids: Array) -> Array:
        # int32 indices work on the CPU and CUDA; int64 is what every device
        # documents, so other devices get that.
        return ids if ids.dtype == torch.int64 or self._device.type in ("cpu", "cuda") else ids.long()

    # -- shapes ------------------------------------------------------------------

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return x.reshape(tuple(shape))

    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        return x.permute(tuple(axes))

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        return torch.cat(list(xs), dim=axis)

    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        if axis == -1:
            return x[..., start:stop]
        index: list[Any] = [slice(None)] * (axis % x.dim())
        index.append(slice(start, stop))
        return x[tuple(index)]

    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        """In place, at rows given as a device tensor (no host read); rows
        outside ``dst`` raise ``IndexError`` (checked on the host only where the
        rows are there: in a captured step the kernel's own check stands)."""
        index = rows.reshape(-1).to(torch.int64)
        if index.device.type == "cpu" and not _is_traced(index) and index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= dst.shape[0]:
                raise IndexError(f"scatter_rows: row {low if low < 0 else high} is outside the {dst.shape[0]} rows "
                                 "of dst")
        return dst.index_copy_(0, index, src.to(dst.dtype))

    # -- optional ops ---------------------------------------------------------------

    def join_group(self, rank: int, world_size: int, *, init_method: str | None = None,
                   timeout: float = 60.0) -> None:
        """``torch.distributed.init_process_group``: gloo on the CPU, NCCL on
        CUDA (each rank on ``cuda:LOCAL_RANK``, else ``cuda:rank % devices``).
        ``timeout`` bounds every collective, so a dead peer is an error, not
        a hang."""
        import datetime

        import torch.distributed as dist

        if world_size == 1:
            return
        if self.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
            torch.cuda.set_device(local)
            self._device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo", init_method=init_method or "env://",
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        elif init_method is not None or (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            # One default group per process: a second tensor-parallel model would talk to the first's ranks.
            raise UnsupportedOpError(
                f"this process is rank {dist.get_rank()} of {dist.get_world_size()} in a torch.distributed "
                f"group already (another tensor-parallel model still open?); it cannot join another as rank "
                f"{rank} of {world_size}: close the other model first")
        self.rank, self.world_size = rank, world_size
        if self.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The ranks on this machine share its cores: more threads than that spin against each
            # other, and every collective waits for the slowest rank (docs/distributed.md).
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
            log.info("rank %d of %d: %d torch threads", rank, world_size, torch.get_num_threads())

    def leave_group(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to leave
                dist.destroy_process_group()
        if getattr(self, "_threads_before", None):
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.rank, self.world_size = 0, 1

    def all_reduce(self, x: Array) -> Array:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    def all_gather(self, x: Array, axis: int = -1) -> Array:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=axis)

    def broadcast(self, x: Array, src: int = 0) -> Array:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.broadcast(out, src)
        return out

    # -- gated DeltaNet's ops (backends/torch_delta_rule.py) ------------------------------

    def softplus(self, x: Array) -> Array:
        """``torch.nn.functional.softplus`` in float32 (x itself past 20, where
        ``log(1 + exp(x))`` rounds to x in float32 anyway)."""
        return F.softplus(x.float()).to(x.dtype)

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                         query_start: Array, checkpoint_rows: Array | None = None, *, scale: float | None = None,
                         l2norm_qk: bool = True) -> tuple[Array, Array, Array]:
        """On the device in float32: a decode step's rows one batched step,
        a prefill's long runs chunked (``torch_delta_rule``); the shapes are
        checked as the reference checks them."""
        from infer.backends import torch_delta_rule
        from infer.ops import ragged_rows

        total, key_heads, dk = self.shape(q)
        heads, dv = self.shape(v)[1:]
        if (self.shape(k) != (total, key_heads, dk) or self.shape(v)[0] != total or not key_heads
                or heads % key_heads or self.shape(g) != (total, heads) or self.shape(beta) != (total, heads)):
            return super().gated_delta_rule(q, k, v, g, beta, state, query_start, checkpoint_rows, scale=scale,
                                            l2norm_qk=l2norm_qk)  # the reference names what is wrong
        qs, rows = ragged_rows(self.to_numpy(query_start),
                               None if checkpoint_rows is None else self.to_numpy(checkpoint_rows), total)
        if self.shape(state) != (len(qs) - 1, heads, dk, dv):
            return super().gated_delta_rule(q, k, v, g, beta, state, query_start, checkpoint_rows, scale=scale,
                                            l2norm_qk=l2norm_qk)
        o, last, ckpt = torch_delta_rule.gated_delta_rule(q, k, v, g, beta, state, qs, rows, scale=scale,
                                                         l2norm_qk=l2norm_qk)
        return o.to(v.dtype), last.to(state.dtype), ckpt.to(state.dtype)

    def sharded_linear(self, x: Array, weight: ShardedWeight, bias: Array | None = None) -> Array:
        """As the contract's, without the copy: the product is this op's own
        tensor, so the sum is taken in place."""
        if weight.combine != "sum" or self.world_size == 1:
            return super().sharded_linear(x, weight, bias)
        import torch.distributed as dist

        y = self.linear(x, weight.local).contiguous()
        dist.all_reduce(y)
        return y if bias is None else torch.add(y, _like(y, bias))

    def _sdpa(self, q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
        """Masked SDPA of ``[batch, heads, rows, dim]`` tensors."""
        hq, hkv = q.shape[1], k.shape[1]
        if hkv != hq:  # with a mask, native GQA misses the fused kernels: repeat the kv heads
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        with _CUDA_SDPA() if self._device.type == "cuda" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def swiglu(self, gate: Array, up: Array) -> Array:
        return F.silu(gate).mul_(up)  # one temporary instead of two

    # -- recurrent layers' ops (backends/torch_recurrent.py) --------------------

    def causal_conv1d(self, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                      checkpoint_rows: Array | None = None, *,
                      activation: str | None = None) -> tuple[Array, Array, Array]:
        """One gather and one weighted sum over the whole ragged batch."""
        return torch_recurrent.causal_conv1d(torch, x, window, weight, bias, query_start, checkpoint_rows,
                                             activation)

    def ssd(self, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
            state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
            dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
        """A decode step updates every state at once; longer runs take the chunked scan."""
        return torch_recurrent.ssd(torch, x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows,
                                   dt_softplus, dt_min, dt_max)

    def clip(self, x: Array, lo: float | None, hi: float | None) -> Array:
        return x if lo is None and hi is None else torch.clamp(x, min=lo, max=hi)

    def softcap(self, x: Array, cap: float) -> Array:
        """Computed in float32, rounded once to ``x``'s dtype."""
        return (torch.tanh(x.float() / cap) * cap).to(x.dtype)

    @property
    def capture_by_default(self) -> bool:  # type: ignore[override]
        """On the CPU in float32 with numpy's C kernels: the greedy decode
        step is recorded as their program by default (see :meth:`compile`)."""
        return self._records_programs()

    @property
    def max_capture_tokens(self) -> int | None:  # type: ignore[override]
        """numpy's programs (the CPU's default capture) take its kernel rows at a
        time; torch.compile's graphs take any batch."""
        if self._records_programs() and not self.graph_capture:
            return kernels.KERNEL_ROWS
        return None

    def _records_programs(self) -> bool:
        from infer.backends import numpy as numpy_backend

        return (self._kernels is not None and self.device == "cpu" and self.compute_dtype == "float32"
                and numpy_backend.records_programs(type(self), TorchBackend))

    def compile(self, fn: Callable[..., Any], *, static: bool = False) -> Callable[..., Any]:
        """A captured decode step (``static``) on the CPU in float32, unless
        ``infer.load(..., compile=True)`` asked for torch.compile: recorded
        as one program of numpy's C kernels on the tensors' memory
        (:mod:`infer.backends.numpy_plan`), the kernels this backend's eager
        CPU ops call. Measured on SmolLM2 (GGUF, 2 cores, median of 5
        alternating runs): 97 tokens/s, where ``compile=True`` decoded 38
        (torch.compile stops at a data-dependent branch of the step and keeps
        only the layers' compiled pieces) and the eager step 70.

        Otherwise ``torch.compile`` (Inductor): the ops of ``fn`` traced into one
        graph with fused kernels, recompiled once with dynamic shapes when a
        second token count appears (decode steps are 1 token, prefills
        vary). ``fullgraph=True``: the pieces an architecture captures are
        pure, so a graph break would be a bug to report, not to hide.

        No CUDA graphs (``mode="reduce-overhead"``): a graph replay reuses its
        output buffers, and the pieces of consecutive layers hand outputs to
        one another around the engine's KV-cache writes, which stay outside
        the graphs (untested on a GPU here)."""
        if static and not self.graph_capture and self._records_programs():
            from infer.backends import numpy as numpy_backend
            from infer.backends.numpy_plan import PlannedStep

            return PlannedStep(numpy_backend.NumpyBackend(), fn, kernels=self._kernels, governor=kernels.GOVERNOR,
                               target=self, arrays=_CpuTensors())
        _import_inductor_helpers()
        _separate_inductor_cache()
        inductor = torch._dynamo.lookup_backend("inductor")
        graphs = [0]

        def counting(gm: Any, example_inputs: Any) -> Any:
            graphs[0] += 1
            return inductor(gm, example_inputs)

        if not static:
            compiled = torch.compile(fn, fullgraph=True, backend=counting)
            compiled.graphs = lambda: graphs[0]  # type: ignore[attr-defined]
            return compiled
        # A captured step: dynamic=False, one graph per input shape (batch
        # bucket, cache capacity or table width). Dynamo keeps its graphs and
        # counts recompiles per code object, so each step gets a code object of
        # its own (two models' steps, or a single step's and a batched one's,
        # would otherwise share one list of graphs and its limit of 8), and
        # runs under a limit that holds every bucket: 7 batch buckets (1..64)
        # times 6 widths (256..8192 positions) is 42 graphs.
        step = torch.compile(_own_code(fn), fullgraph=True, backend=counting, dynamic=False)

        def captured(*args: Any) -> Any:
            with torch._dynamo.config.patch(recompile_limit=STEP_GRAPHS):
                return step(*args)

        captured.graphs = lambda: graphs[0]  # type: ignore[attr-defined]
        return captured

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        elif self._device.type == "mps":
            torch.mps.synchronize()

    # -- attention -----------------------------------------------------------------

    def attention(
        self,
        q: Array,
        k_pool: Array,
        v_pool: Array,
        batch: AttentionBatch,
        *,
        scale: float,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
    ) -> Array:
        """Eagerly, one sequence at a time over its visible keys (a slice of
        the pool where they are consecutive rows, else ``index_select``d:
        torch has no public attention kernel that reads a block table; a
        CUDA kernel such as vLLM's PagedAttention or FlashAttention's
        ``block_table`` argument would read the pages in place): decode rows
        on the CPU in numpy's one-pass C kernel, which reads them in place,
        others through SDPA (:meth:`_dense`). In a captured step (no host
        copy of the description), every sequence's table of blocks is
        gathered and one masked SDPA built on the device serves every token
        (:meth:`_static_attention`): the same kernels and shapes at every step.
        """
        if batch.host is None and not isinstance(batch.query_start, np.ndarray):
            return self._static_attention(q, k_pool, v_pool, batch, scale, causal, window, softcap, sinks)
        host = batch.on_host(self)
        outputs = []
        for b, q0, q1, lo, hi in host.sequences(causal, window):
            n = q1 - q0
            qb = q[q0:q1]
            if (n <= 16 and (softcap is None or softcap > 0) and (window is None or window > 0)
                    and self._host(qb, k_pool, v_pool) and (sinks is None or self._host(sinks))):
                # Decoding on the CPU: numpy's one-pass C kernel (SDPA's CPU path
                # costs more in dispatch than the attention of a few rows does).
                hq, dk, hkv, dv = qb.shape[1], qb.shape[2], k_pool.shape[1], v_pool.shape[2]
                table = np.ascontiguousarray(np.asarray(host.block_tables[b])[:-(-hi // host.block_size)], np.int64)
                out = torch.empty((n, hq, dv), dtype=torch.float32)
                kernels.attention(qb.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), out.numpy(), n, hi,
                                  hq, hkv, dk, dv, scale, causal, window or 0, softcap or 0.0, table,
                                  host.block_size, True, None if sinks is None else sinks.float().numpy())
                outputs.append(out)
                continue
            rows = host.key_rows(b, lo, hi, k_pool.shape[0])
            run = row_run(rows)
            if run:  # one run of pool rows: a view
                k, v = k_pool[run[0]:run[1]], v_pool[run[0]:run[1]]
            else:
                index = torch.from_numpy(rows.astype(np.int64)).to(k_pool.device)
                k, v = k_pool.index_select(0, index), v_pool.index_select(0, index)
            outputs.append(self._dense(qb, k, v, hi - n, lo, scale, causal, window, softcap, sinks))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _dense(self, q: Array, k: Array, v: Array, first: int, lo: int, scale: float, causal: bool,
               window: int | None, softcap: float | None, sinks: Array | None) -> Array:
        """Queries at positions ``first..`` over keys at positions ``lo..``,
        through ``scaled_dot_product_attention``, except with ``softcap`` or
        ``sinks`` (neither of which SDPA has: then the scores are formed,
        capped, masked and soft-maxed here in float32).

        torch's ``is_causal=True`` aligns the mask top-left; it is used only
        where that is the contract's mask (as many queries as keys, starting
        together), a single query needs no mask at all, and every other case
        passes an explicit boolean mask.

        On CUDA, cuDNN's attention is left out of SDPA's choice: SDPA picks
        it for decode, and cuDNN builds an execution plan for every new key
        count, while a decode step always has one more key than the last, so
        every step of a first generation would pay a plan build (the GPU run
        that showed it: docs/performance.md, "The H200 run"; MLX's CUDA
        backend found the same, ml-explore/mlx pull request 2743). Flash and
        memory-efficient attention need no per-shape plan.
        """
        tq, hq, dk = q.shape
        tk, hkv, dv = v.shape
        mask, is_causal = self._mask(first, tq, lo, tk, causal, window)
        if softcap is not None or sinks is not None:
            return self._attention_float32(q, k, v, scale, softcap, sinks, mask, is_causal)
        # [1, heads, tokens, dim]: the fused kernels take only 4-D inputs.
        qt, kt, vt = (a.transpose(0, 1).unsqueeze(0) for a in (q, k, v))
        gqa: dict[str, bool] = {}
        if hkv != hq:
            # Native GQA reaches the flash kernels only without a mask; with
            # one (and on MPS) repeat the kv heads: query head h reads h // group.
            if _HAS_ENABLE_GQA and mask is None and self._device.type != "mps":
                gqa["enable_gqa"] = True
            else:
                kt = kt.repeat_interleave(hq // hkv, dim=1)
                vt = vt.repeat_interleave(hq // hkv, dim=1)
        with _CUDA_SDPA() if self._device.type == "cuda" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal, scale=scale, **gqa)
        return out[0].transpose(0, 1)  # [tq, hq, dv]

    def _static_attention(self, q: Array, k_pool: Array, v_pool: Array, batch: AttentionBatch, scale: float,
                          causal: bool, window: int | None, softcap: float | None, sinks: Array | None) -> Array:
        """Attention with the description as device data only: each
        sequence's whole table of blocks gathered, each token's query against
        its sequence's keys, the visible ones a mask built on the device."""
        tokens, hq, dk = q.shape
        seqs, width = batch.block_tables.shape
        bs = batch.block_size
        starts = batch.query_start.reshape(-1).to(torch.int64)
        lengths = batch.seq_lens.reshape(-1).to(torch.int64)
        table = batch.block_tables.reshape(-1).to(torch.int64)
        rows = (table[:, None] * bs + torch.arange(bs, device=q.device)).reshape(seqs, width * bs)
        t = torch.arange(tokens, device=q.device)
        seq = torch.searchsorted(starts[1:], t, right=True).clamp(max=seqs - 1)  # each token's sequence
        pos = lengths[seq] - (starts[seq + 1] - starts[seq]) + (t - starts[seq])  # each token's position
        j = torch.arange(width * bs, device=q.device)[None, :]
        mask = j < lengths[seq][:, None]
        if causal:
            mask = mask & (j <= pos[:, None])
        if window is not None:
            mask = mask & ((pos[:, None] - j).abs() < window)
        index = rows[seq]  # [tokens, keys]
        k = k_pool[index]  # [tokens, keys, hkv, dk]
        v = v_pool[index]
        if softcap is not None or sinks is not None:
            return torch.cat([self._attention_float32(q[i:i + 1], k[i], v[i], scale, softcap, sinks, mask[i:i + 1],
                                                      False) for i in range(tokens)])
        out = self._sdpa(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale)
        return out[:, :, 0, :]  # [tokens, hq, dv]

    def _mask(self, first: int, tq: int, lo: int, tk: int, causal: bool, window: int | None) -> tuple[Any, bool]:
        """(boolean [tq, tk] mask of the keys at positions ``lo..`` visible to
        queries at positions ``first..``, or None, is_causal)."""
        if window is not None and window >= first + tq and (causal or window >= lo + tk):
            window = None  # the window reaches every key: no effect
        if window is None:
            if not causal or (tq == 1 and first + 1 >= lo + tk):
                return None, False
            if first == lo and tq == tk:
                return None, True
            if first + 1 >= lo + tk:  # every query sees every key
                return None, False
        key = (first - lo, tq, tk, causal, window)  # visibility is relative: one mask per shape
        mask = self._masks.get(key)
        if mask is None:
            hm = attention_mask(first - lo, tq, 0, tk, causal, window)
            mask = None if hm is None else torch.from_numpy(hm == 0).to(self._device)
            if len(self._masks) >= 32:  # every layer of a step shares one; keep a few steps
                self._masks.clear()
            self._masks[key] = mask
        return mask, False

    def _attention_float32(self, q: Array, k: Array, v: Array, scale: float, softcap: float | None,
                           sinks: Array | None, mask: Array | None, is_causal: bool) -> Array:
        """Scores formed, capped, masked and soft-maxed in float32, with the
        sinks' logits in each softmax's denominator."""
        tq, hq, dk = q.shape
        tk, hkv, dv = v.shape
        group = hq // hkv
        # [hkv, group*tq, dk] @ [hkv, dk, tk]: grouped-query attention without repeating keys.
        qg = q.float().reshape(tq, hkv, group, dk).permute(1, 2, 0, 3).reshape(hkv, group * tq, dk)
        scores = torch.matmul(qg, k.float().permute(1, 2, 0)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if is_causal:
            mask = torch.ones((tq, tk), dtype=torch.bool, device=q.device).tril()
        scores = scores.reshape(hkv, group, tq, tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(hkv, group, 1, 1).expand(hkv, group, tq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :tk]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.reshape(hkv, group * tq, tk), v.float().transpose(0, 1))  # [hkv, group*tq, dv]
        return out.reshape(hkv, group, tq, dv).permute(2, 0, 1, 3).reshape(tq, hq, dv).to(q.dtype)


#: Graphs one captured step may build (its input shapes: batch buckets times
#: table widths) before torch.compile stops compiling it.
STEP_GRAPHS = 64


def _is_traced(t: Any) -> bool:
    """Whether ``t`` is being traced (torch.compile): its values are not on the host."""
    return bool(torch.compiler.is_compiling()) or type(t).__name__ == "FakeTensor"


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a function or a bound method) on a copy of its code object:
    torch.compile's graphs for it are then its own."""
    func = getattr(fn, "__func__", fn)
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    owner = getattr(fn, "__self__", None)
    return own if owner is None else types.MethodType(own, owner)


# -- CUDA quantized kernels -------------------------------------------------------------
#
# torch's CUDA int4 kernel (tinygemm) is a private op whose input packing has
# changed between releases (int32 codes before 2.5, two codes per uint8 since).
# Rather than trust a version table, each process checks once, on a small
# random matrix, which packing reproduces ``(code - 8) * scale + zero``; if
# none does, int4 is not offered on CUDA and the load says so.

#: Nibble orders tried: the even column in the high nibble (torch >= 2.5, as
#: torchao packs), or in the low one.
_INT4_LAYOUTS = ("even-high", "even-low")


def _nibbles(codes: np.ndarray, layout: str | None) -> np.ndarray:
    """uint8 codes ``[N, K]`` (0..15) as ``[N, K/2]`` bytes, two per byte."""
    even, odd = codes[:, 0::2].astype(np.uint8), codes[:, 1::2].astype(np.uint8)
    return (even << 4 | odd) if layout == "even-high" else (odd << 4 | even)


_CUDA_INT4: list[str | None] = []


def _cuda_int4_layout() -> str | None:
    """The packing under which this torch's CUDA int4 kernel computes
    ``(code - 8) * scale + zero`` (None: no working kernel). Probed once."""
    if not _CUDA_INT4:
        _CUDA_INT4.append(_probe_cuda_int4())
    return _CUDA_INT4[0]


def _probe_cuda_int4() -> str | None:
    rng = np.random.default_rng(0)
    n, k = 64, 256
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    sz = torch.randn(k // 32, n, 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale, zero = sz[..., 0].float().repeat_interleave(32, 0), sz[..., 1].float().repeat_interleave(32, 0)
    want = (torch.from_numpy(codes.T.astype(np.float32)) - 8) * scale + zero  # [K, N] = W^T
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    for layout in _INT4_LAYOUTS:
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(torch.from_numpy(_nibbles(codes, layout)).cuda(), 2)
            got = torch.ops.aten._weight_int4pack_mm(eye, packed, 32, sz.cuda()).float().cpu()
        except Exception as exc:  # a missing or changed private op: not offered, never a crash
            log.info("torch/cuda: no int4 kernel (%s: %s); int4 weights not offered", type(exc).__name__, exc)
            return None
        if torch.allclose(got, want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2):
            log.debug("torch/cuda int4 kernel: codes packed %s", layout)
            return layout
    log.info("torch/cuda: the int4 kernel matched no known packing; int4 weights not offered")
    return None


_CUDA_INT8: list[bool] = []


def _cuda_int8_works() -> bool:
    """Whether ``_weight_int8pack_mm`` runs on CUDA with bfloat16 and computes
    ``x @ (codes * scale).T`` (probed once)."""
    if not _CUDA_INT8:
        ok = False
        try:
            w = torch.randint(-127, 128, (16, 64), dtype=torch.int8, device="cuda")
            s = torch.rand(16, device="cuda").to(torch.bfloat16)
            x = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
            got = torch.ops.aten._weight_int8pack_mm(x, w, s).float()
            ok = bool(torch.allclose(got, x.float() @ (w.float() * s.float()[:, None]).T, rtol=2e-2, atol=1e-1))
        except Exception as exc:
            log.info("torch/cuda: no int8 kernel (%s: %s); q8 not offered", type(exc).__name__, exc)
        _CUDA_INT8.append(ok)
    return _CUDA_INT8[0]


def _bf16_up(x: np.ndarray) -> np.ndarray:
    """float32 -> a bfloat16 value >= x (rounded up), kept as float32: a scale
    that never lets a code overflow its range."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    up = (u + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
    return up.view(np.float32)


def _like(a: Array, b: Any) -> Any:
    """``b`` cast to ``a``'s dtype when both are float tensors of different
    dtypes: the contract's float ops return their first float input's dtype
    (torch would promote to the wider one)."""
    if (isinstance(b, torch.Tensor) and b.dtype != a.dtype
            and a.is_floating_point() and b.is_floating_point()):
        return b.to(a.dtype)
    return b


# -- registration ----------------------------------------------------------------------


def _no_device_without_import(device: str) -> str | None:
    """Why torch cannot have ``device`` here, found without importing torch
    (about 2 s and 200 MB), or None when only torch can tell: a CPU-only
    wheel says so in its version (``2.13.0+cpu``), CUDA and ROCm need a
    driver (:func:`~infer.plugins.registry.gpu_driver_absent`), MPS macOS."""
    import sys

    if device == "mps":
        return None if sys.platform == "darwin" else "torch was built without MPS (Apple silicon only)"
    if device != "cuda":
        return None
    try:
        from importlib.metadata import version

        if version("torch").endswith("+cpu"):
            return "torch was built without CUDA"
    except Exception:  # no metadata: let torch answer
        return None
    return gpu_driver_absent()


def _probe(device: str) -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(0, "torch is not installed (pip install torch)")
    reason = _no_device_without_import(device)
    if reason is not None:
        return Probe(0, reason)
    try:
        _import_torch()
    except Exception as exc:  # a broken install is a reason, not a crash
        return Probe(0, f"torch failed to import: {type(exc).__name__}: {exc}")
    # Off the CPU the quantized ops depend on the dtype and a kernel probe
    # (see TorchBackend.__init__); the listing names what every dtype has.
    off_cpu = {"prepare_weight", "quantized_linear"}
    native = tuple(sorted(set(NATIVE_OPS) - ({"synchronize"} if device == "cpu" else off_cpu)))
    try:
        if device == "cuda":
            if not torch.backends.cuda.is_built():
                return Probe(0, "torch was built without CUDA")
            if not torch.cuda.is_available():
                return Probe(0, "no CUDA device")
        elif device == "mps":
            mps = getattr(torch.backends, "mps", None)
            if mps is None or not mps.is_built():
                return Probe(0, "torch was built without MPS (Apple silicon only)")
            if not mps.is_available():
                return Probe(0, "no MPS device (needs macOS 12.3+ on Apple silicon)")
    except Exception as exc:
        return Probe(0, f"torch could not query {device}: {type(exc).__name__}: {exc}")
    return Probe(SCORES[device], None, native)


def _spec(device: str, description: str) -> BackendSpec:
    return BackendSpec(
        name="torch",
        device=device,
        factory=lambda dtype: TorchBackend(device, dtype),
        probe=lambda: _probe(device),
        description=description,
        score_ceiling=SCORES[device],
    )


@hookimpl
def infer_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    """Register torch on CUDA, MPS and the CPU."""
    register(_spec("cuda", "PyTorch on an NVIDIA (or ROCm) GPU; bfloat16 by default where supported"))
    register(_spec("mps", "PyTorch on Apple silicon through Metal"))
    register(_spec("cpu", "PyTorch on the CPU; float32 by default"))
