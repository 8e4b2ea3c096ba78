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
affine form stay in it and are computed by the CPU package's C kernels on
the tensors' memory (exact; :mod:`infer.backends.torch_cpu`), which also serve
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

This module holds what every device shares: :class:`TorchBackend`, torch's
lazy import and the plugin hook. What one device does alone lives beside it:
:mod:`infer.backends.torch_cpu` (the C kernels on CPU tensors, CPU int4pack,
the tensors the CPU package's recorder borrows, Inductor's cache per CPU capability)
and :mod:`infer.backends.torch_cuda` (SDPA's kernel choice, the probed int4
and int8 kernels); the recurrent ops are in :mod:`infer.backends.torch_recurrent`
and :mod:`infer.backends.torch_delta_rule`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infer.errors import UnsupportedOpError
from infer.oplib import (attention_mask, check_causal_conv1d, check_gated_delta_rule, check_ssd, lora_segments, row_run,
                         span_rows)
from infer.ops import (AdaptedWeight, Array, AttentionBatch, Backend, LoadSettings, PackedWeight, QuantizedTensor,
                       ShardedWeight)
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe, gpu_driver_absent
from infer.quantize import SCHEME_BITS, AffineTensor, from_gguf, is_embedding, is_linear_weight, quantize_affine

from . import torch_cpu, torch_cuda, torch_recurrent
from .cpu import kernels

# The CUDA kernel probes by the names TorchBackend's constructor calls them
# (tests replace them here), and the nibble packing.
from .torch_cuda import int4_layout as _cuda_int4_layout
from .torch_cuda import int8_works as _cuda_int8_works
from .torch_cuda import nibbles as _nibbles  # noqa: F401 - tests import it from here

log = logging.getLogger(__name__)

# Bound by _import_torch() on first use, so importing this module stays cheap.
torch: Any = None
F: Any = None
_DTYPES: dict[str, Any] = {}
_NAMES: dict[Any, str] = {}
#: numpy's dtypes to torch's (no bfloat16): ``str(dtype)`` is a few microseconds,
#: which a decode step paid on each of its scalar inputs (:meth:`TorchBackend.from_numpy`).
_FROM_NUMPY: dict[np.dtype, Any] = {}
#: Elements from which :meth:`TorchBackend.zeros` on the CPU starts its array on a cache line
#: (the numpy backend's zeros always do): below it, the arrays an eager step makes each token
#: (a (1, 1) table), for which the aligned form cost 7 us against 1 us a call.
_ALIGNED_ZEROS = 1024
_HAS_ENABLE_GQA = False

NATIVE_OPS = ("softcap", "swiglu", "synchronize", "attention", "attention_spans", "topk", "compile", "prepare_weight",
              "quantized_linear", "clip", "causal_conv1d", "ssd", "softplus", "gated_delta_rule",
              "all_reduce", "all_gather", "broadcast", "lora_linear")
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


def _compiling() -> bool:
    """Whether torch.compile is tracing the caller (``torch.compiler.is_compiling``
    from torch 2.3; Dynamo's own before)."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = importlib.import_module("torch._dynamo").is_compiling
    return bool(fn())


def _import_torch() -> None:
    global torch, F, _HAS_ENABLE_GQA
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
    _FROM_NUMPY.update({np.dtype(k): v for k, v in _DTYPES.items() if k != "bfloat16"})
    # scaled_dot_product_attention grew grouped-query support in torch 2.5.
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in _torch.__version__.split(".")[:2])
    _HAS_ENABLE_GQA = (major, minor) >= (2, 5)
    torch_cpu.bind(_torch)
    torch_cuda.bind(_torch)
    torch, F = _torch, _F


class TorchBackend(Backend):
    """PyTorch on one device (``"cuda"``, ``"mps"`` or ``"cpu"``)."""

    name = "torch"
    float_dtypes = ("float32", "bfloat16", "float16")
    kv_dtypes = frozenset({"float16", "bfloat16"})  # KV pools stored narrower: attention reads them widened
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
        #: The C kernels (:mod:`infer.backends.cpu.kernels`) for float32 CPU tensors: norms,
        #: rope, decoding's attention and GGUF products, run on the tensors'
        #: memory; None off the CPU or where they are not built.
        self._kernels: Any = None
        if device == "cpu":
            self.native_ops = frozenset(NATIVE_OPS) - {"synchronize"}
            torch_cpu.register_affine_op()
            self._kernels = kernels.native
            if self._kernels is not None:
                self.native_ops = self.native_ops | {"fused_add_rms_norm"}
                # The quantized products are the C kernels', which also take int8 activations.
                self.activation_schemes = kernels.ACTIVATION_SCHEMES
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
                kept = torch_cpu.kept_for_kernels(tensor, self.activations)
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
        """``affine`` as int4 on this device, or None where that is not exact
        or does not fit: tinygemm's layout on CUDA (:func:`.torch_cuda.int4pack`),
        int4pack with float32 scales on the CPU (:func:`.torch_cpu.int4pack`)."""
        if self._device.type == "cuda":
            return torch_cuda.int4pack(affine, name, self._device, self.compute_dtype)
        return torch_cpu.int4pack(affine, name)

    def _quantize_on_load(self, host: np.ndarray, name: str) -> PackedWeight | None:
        if self.activations is not None and self._kernels is not None:
            # Int8 activations are the C kernels' (activation_schemes): the weight in
            # their affine form, groups of 32, as the numpy backend quantizes it.
            return torch_cpu.kept_affine(quantize_affine(host, self.quantize, name=name))
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
            y = torch_cpu.affine_linear(x.reshape(-1, x.shape[-1]), w, s, self.graph_capture,
                                        self.activations == "q8")
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
            target = self._float if array.dtype.kind == "f" else _FROM_NUMPY.get(array.dtype)
            if target is None:
                target = self._dtype(str(array.dtype))  # the typed error
        else:
            target = self._dtype(dtype)
        if array.dtype == np.float64 and target.is_floating_point:
            array = array.astype(np.float32)  # MPS has no float64; no device needs it here
        if self._device.type == "cpu" and _FROM_NUMPY.get(array.dtype) is target:
            return torch.from_numpy(np.array(array, order="C"))  # a copy: never the caller's memory
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
            return t.numpy().copy()  # .numpy() of a CPU tensor shares its memory
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
        name = _NAMES.get(target)
        if self._device.type == "cpu" and name is not None and name != "bfloat16":  # bfloat16: no numpy dtype
            # Zeros made through numpy are pages the kernel hands out zeroed when first
            # written (kernels.cache_line_array: from 1 MiB a mapping of their own), so a
            # pool of state slots or KV blocks costs memory only as it fills.
            # torch.zeros writes every byte at once: Qwen3.5's 64 state slots
            # held 1.2 GB more than the numpy backend's (docs/performance.md). A pool
            # starts on a cache line, as the numpy backend's do: numpy's own start 16
            # bytes past one, and the C kernels' 64-byte loads of every row then span
            # two (Qwen3.5's captured step up to 1.2x the time; docs/performance.md,
            # "torch/cpu's pools on cache lines"). Not while torch.compile traces (it
            # cannot follow the address arithmetic; a step's zeros there are a few bytes).
            if math.prod(shape) >= _ALIGNED_ZEROS and not _compiling():
                return torch.from_numpy(kernels.cache_line_array(tuple(shape), name, zeroed=True))
            return torch.from_numpy(np.zeros(tuple(shape), name))
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
        if type(weight) is AdaptedWeight:
            return self.adapted_linear(x, weight, bias)
        return F.linear(x, _like(x, weight), None if bias is None else _like(x, bias))

    def lora_linear(self, x: Array, weight: Array, bias: Array | None, a: Array, b: Array, slots: Array,
                    scales: Array) -> Array:
        """By segments (Punica's SGMV): the base product, then per adapter
        slot one pair of small products over its rows, added in place. The
        segments are read on the host (slots are few); inside a
        ``torch.compile`` graph, which cannot read them there, the gathered
        form of the contract's default instead (each row's factors taken
        by its slot: the slots and the pools are the graph's inputs, so a
        new mix of adapters is no new graph)."""
        if torch.compiler.is_compiling():
            return Backend.lora_linear(self, x, weight, bias, a, b, slots, scales)
        y = self.linear(x, weight, bias)
        segments = lora_segments(slots.cpu().numpy(), scales.float().cpu().numpy())
        if not segments:
            return y
        sc = _like(x, scales)
        for rows, slot in segments:
            index = rows if isinstance(rows, slice) else torch.as_tensor(rows, device=x.device)
            u = torch.mul(x[index] @ _like(x, a[slot]).T, sc[index, None])  # [n, rank]
            y[index] += u @ _like(x, b[slot]).T
        return y

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

    def _recurrent_kernels(self, *xs: Any) -> bool:
        """Whether the recurrent ops run in the C kernels: float32 tensors on
        the CPU where the kernels have them, outside torch.compile's trace
        (torch/cuda keeps its own ops)."""
        return self._host(*(x for x in xs)) and kernels.has_recurrent()

    def _host(self, *xs: Any, dtype: Any = None) -> bool:
        """Whether the C kernels take these tensors (all of ``dtype``, None:
        float32, contiguous, on the CPU backend, not inside torch.compile's
        trace)."""
        dtype = torch.float32 if dtype is None else dtype
        return (self._kernels is not None and all(x.dtype == dtype and x.is_contiguous() for x in xs)
                and not torch.compiler.is_compiling())

    def _host_pool(self, k: Any, v: Any) -> bool:
        """Whether the C attention reads these pools in place: both float32,
        or both float16 (a ``kv_dtype="float16"`` pool), as :meth:`_host` takes them."""
        return k.dtype in (torch.float32, torch.float16) and self._host(k, v, dtype=k.dtype)

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
        a prefill's long runs chunked (``torch_delta_rule``), after the
        reference's own argument check."""
        from infer.backends import torch_delta_rule

        qs, rows = check_gated_delta_rule(q, k, v, g, beta, state, self.to_numpy(query_start),
                                          None if checkpoint_rows is None else self.to_numpy(checkpoint_rows))
        if self._recurrent_kernels(q, k, v, g, beta, state) and q.shape[-1] <= kernels.GDR_MAX_K:
            return torch_cpu.recurrent_op(kernels.gated_delta_rule, q, k, v, g, beta, state, qs, rows,
                                          q.shape[-1] ** -0.5 if scale is None else scale, l2norm_qk)
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
        with torch_cuda.sdpa_kernels() if self._device.type == "cuda" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def swiglu(self, gate: Array, up: Array) -> Array:
        return F.silu(gate).mul_(up)  # one temporary instead of two

    # -- recurrent layers' ops (backends/torch_recurrent.py) --------------------

    def causal_conv1d(self, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                      checkpoint_rows: Array | None = None, *,
                      activation: str | None = None) -> tuple[Array, Array, Array]:
        """On the CPU in float32, the C kernel (backends/cpu/recurrent.c);
        elsewhere one gather and one weighted sum over the whole ragged batch."""
        if self._recurrent_kernels(x, window, weight, *([] if bias is None else [bias])):
            qs, rows = check_causal_conv1d(x, window, weight, self.to_numpy(query_start),
                                           None if checkpoint_rows is None else self.to_numpy(checkpoint_rows),
                                           activation)
            return torch_cpu.recurrent_op(kernels.causal_conv1d, x, window, weight, bias, qs, rows,
                                          activation == "silu")
        return torch_recurrent.causal_conv1d(torch, x, window, weight, bias, query_start, checkpoint_rows,
                                             activation)

    def ssd(self, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
            state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
            dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
        """On the CPU in float32, the C kernel (backends/cpu/recurrent.c);
        elsewhere a decode step updates every state at once and longer runs
        take the chunked scan."""
        if (self._recurrent_kernels(x, dt, A, B, C, state, *(t for t in (D, dt_bias) if t is not None))
                and B.shape[-1] <= kernels.SSD_MAX_N):
            qs, rows = check_ssd(x, dt, A, B, C, D, dt_bias, state, self.to_numpy(query_start),
                                 None if checkpoint_rows is None else self.to_numpy(checkpoint_rows))
            return torch_cpu.recurrent_op(kernels.ssd, x, dt, A, B, C, D, dt_bias, state, qs, rows, dt_softplus,
                                          dt_min, dt_max)
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
        from infer.backends.cpu.backend import records_programs

        return (self._kernels is not None and self.device == "cpu" and self.compute_dtype == "float32"
                and records_programs(type(self), TorchBackend))

    def compile(self, fn: Callable[..., Any], *, static: bool = False) -> Callable[..., Any]:
        """A captured decode step (``static``) on the CPU in float32, unless
        ``infer.load(..., compile=True)`` asked for torch.compile: recorded
        as one program of numpy's C kernels on the tensors' memory
        (:mod:`infer.backends.cpu.plan`), the kernels this backend's eager
        CPU ops call: faster than ``compile=True`` and the eager step
        (docs/performance.md, "Figures behind the code"; torch.compile stops
        at a data-dependent branch of the step and keeps only the layers'
        compiled pieces).

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
            from infer.backends.cpu.backend import CpuBackend
            from infer.backends.cpu.plan import PlannedStep

            # The recording numpy backend computes as this one: int8 activations included.
            ops = CpuBackend().configure(LoadSettings(activations=self.activations))
            return PlannedStep(ops, fn, kernels=self._kernels, governor=kernels.GOVERNOR,
                               target=self, arrays=torch_cpu.CpuTensors())
        _import_inductor_helpers()
        torch_cpu.separate_inductor_cache()
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
            spans = span_rows(host, q0, q1, causal)  # bidirectional spans: an explicit mask
            if (spans is None and n <= 16 and (softcap is None or softcap > 0) and (window is None or window > 0)
                    and self._host(qb) and self._host_pool(k_pool, v_pool) and (sinks is None or self._host(sinks))):
                # Decoding on the CPU: the kernels' one-pass attention (torch_cpu).
                table = np.ascontiguousarray(np.asarray(host.block_tables[b])[:-(-hi // host.block_size)], np.int64)
                outputs.append(torch_cpu.decode_attention(qb, k_pool, v_pool, table, host.block_size, hi, scale=scale,
                                                          causal=causal, window=window, softcap=softcap, sinks=sinks))
                continue
            rows = host.key_rows(b, lo, hi, k_pool.shape[0])
            run = row_run(rows)
            if run:  # one run of pool rows: a view
                k, v = k_pool[run[0]:run[1]], v_pool[run[0]:run[1]]
            else:
                index = torch.from_numpy(rows.astype(np.int64)).to(k_pool.device)
                k, v = k_pool.index_select(0, index), v_pool.index_select(0, index)
            k, v = k.to(qb.dtype), v.to(qb.dtype)  # a pool stored narrower (kv_dtype): its values, widened
            outputs.append(self._dense(qb, k, v, hi - n, lo, scale, causal, window, softcap, sinks, spans))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _dense(self, q: Array, k: Array, v: Array, first: int, lo: int, scale: float, causal: bool,
               window: int | None, softcap: float | None, sinks: Array | None,
               spans: np.ndarray | None = None) -> Array:
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
        if spans is not None:  # the rows' bidirectional spans (key positions relative to lo)
            hm = attention_mask(first - lo, tq, 0, tk, causal, window, spans - lo)
            mask, is_causal = None if hm is None else torch.from_numpy(hm == 0).to(self._device), False
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
        with torch_cuda.sdpa_kernels() if self._device.type == "cuda" else contextlib.nullcontext():
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
            seen = j <= pos[:, None]
            if batch.spans is not None:  # a bidirectional span's keys ahead too
                span = batch.spans.reshape(-1, 2).to(torch.int64)
                seen = seen | ((j >= span[:, :1]) & (j < span[:, 1:]))
            mask = mask & seen
        if window is not None:
            mask = mask & ((pos[:, None] - j < window) if causal else ((pos[:, None] - j).abs() < window))
        index = rows[seq]  # [tokens, keys]
        k = k_pool[index].to(q.dtype)  # [tokens, keys, hkv, dk], widened from a narrower pool (kv_dtype)
        v = v_pool[index].to(q.dtype)
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
    (seconds and hundreds of MB: docs/performance.md, "Figures behind the
    code"), or None when only torch can tell: a CPU-only
    wheel says so in its version (``2.13.0+cpu``), CUDA and ROCm need a
    driver (:func:`~infer.plugins.registry.gpu_driver_absent`), MPS macOS."""
    import sys

    if device == "mps":
        return None if sys.platform == "darwin" else "torch was built without MPS (Apple silicon only)"
    if device != "cuda":
        return None
    from infer.plugins.registry import distribution_version  # (not importlib.metadata: ~15 ms to import)

    version = distribution_version("torch")
    if version is None:  # no metadata: let torch answer
        return None
    if version.endswith("+cpu"):
        return "torch was built without CUDA"
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
