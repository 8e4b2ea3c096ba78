"""The torch backend's CPU side: what :class:`~infer.backends.torch.TorchBackend`
does on ``torch:cpu`` only.

* GGUF weights and float32 decoding on the package's C kernels
  (:mod:`infer.backends.cpu.kernels`), run on the tensors' memory, and the custom
  op ``infer::affine_linear`` that lets torch.compile call them; with
  ``activations="q8"`` the quantized products are those kernels' int8 ones, as
  on numpy (the same bits), and on-load ``q4``/``q8`` weights take their affine form;
* CPU int4pack (``_weight_int4pack_mm_for_cpu``) for on-load ``q4``;
* the tensors lent to the CPU package's recorder, when a decode step is recorded as a
  program of those kernels (:mod:`infer.backends.cpu.plan`);
* Inductor's kernel cache kept apart per forced CPU capability.

torch is bound by :func:`bind` (from ``infer.backends.torch``'s first import
of torch), so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from typing import Any

import numpy as np

from infer.ops import PackedWeight, QuantizedTensor
from infer.quantize import AffineTensor, from_gguf, is_embedding

from .cpu import kernels

log = logging.getLogger(__name__)

#: Bound by :func:`bind`.
torch: Any = None


def bind(module: Any) -> None:
    """Use ``module`` (torch, imported by the backend) from now on."""
    global torch
    torch = module


def separate_inductor_cache() -> None:
    """Keep Inductor's on-disk kernel cache apart per forced CPU capability.

    torch 2.13 keys the CPU kernels it caches on their generated source, which
    does not change with ``ATEN_CPU_CAPABILITY``; so a kernel compiled under
    one capability (say ``avx2``) is loaded under another and computes garbage
    (NaN logits, values hundreds off, heap corruption: tests/README.md). Where
    the capability is forced and no cache folder is chosen, each capability
    gets its own folder beside Inductor's default. Inductor reads the variable
    whenever it looks for its cache, so setting it before infer's first
    compile suffices. A ``torch.compile`` of the caller's own that ran first
    has written Inductor's default folder into the variable itself (its
    ``cache_dir()`` does): that is no choice, and is moved too (it pinned
    the shared folder, and every compiled step after it read garbage).
    """
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not forced:
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: leave Inductor's choice alone
        return
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{forced}"
    log.debug("ATEN_CPU_CAPABILITY=%s: Inductor caches its kernels in %s", forced,
              os.environ["TORCHINDUCTOR_CACHE_DIR"])


# -- GGUF weights on the CPU: the C kernels through torch tensors -------------------------
#
# torch has no CPU kernel for GGUF's blocks that is both exact and fast: its
# float32 int4pack path is a generic loop slower than float32 BLAS, and
# dequantized float32 weights read several times the bytes per token. The
# package's C kernels (backends/cpu/kernels.py, the numpy backend's) compute on the
# blocks' affine form exactly in float32, with run-time AVX2/AVX-512 paths;
# torch/cpu runs them on its tensors' memory (no copy: a CPU tensor and its
# .numpy() share it). Measured: docs/backends.md, "Quantized weights and speed".


def kept_for_kernels(tensor: QuantizedTensor, activations: str | None = None) -> PackedWeight | None:
    """A GGUF matrix kept for the C kernels: as the file stores it where a
    load with ``activations`` keeps its blocks (:func:`~infer.backends.cpu.kernels.keeps_stored`),
    else in its affine form; None where it has neither."""
    if kernels.keeps_stored(tensor, activations):
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
    return kept_affine(affine)


def kept_affine(affine: AffineTensor) -> PackedWeight:
    """An affine weight (a GGUF type's form, or quantized on load) for the C
    kernels, its arrays lent to torch as tensors."""
    # A symmetric type holds no biases (affine.bias_factor): an empty tensor stands for them.
    held = affine.stored_biases if affine.stored_biases is not None else np.empty((0, 0), affine.scales.dtype)
    views = tuple(torch.from_numpy(a) for a in (affine.packed, affine.scales, held))
    how = f"{affine.bits}-bit affine group {affine.group}, {affine.scales.dtype} scales, C kernel"
    return PackedWeight(affine.shape, affine.qtype, how, ("affine", affine, views), rows=affine)


def affine_linear(x: Any, affine: AffineTensor, views: tuple[Any, ...], capturing: bool, q8: bool = False) -> Any:
    """``x @ W.T`` in float32 for the affine weight ``W``: the C kernel for up
    to 16 rows, the tiled kernel (or slabs of ``W`` dequantized for torch's
    GEMM: :data:`~infer.backends.cpu.kernels.EXACT_GEMM`) beyond. With
    ``q8`` (``activations="q8"``), the C kernel for every row count, rows of
    two or more quantized to int8 (:func:`~infer.backends.cpu.kernels.affine_gemv`):
    the numpy backend's product, on the tensors' memory. Under
    torch.compile, as the custom op ``infer::affine_linear`` (opaque to it),
    ``q8`` riding in its ``bits`` as :data:`~infer.backends.cpu.kernels.Q8_FLAG`."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    x = x.contiguous()
    if capturing and torch.compiler.is_compiling():
        flag = kernels.Q8_FLAG if q8 else 0
        if isinstance(affine, AffineTensor):
            factor = 0.0 if affine.bias_factor is None else affine.bias_factor
            return torch.ops.infer.affine_linear(x, *views, affine.bits | flag, affine.group, factor)
        bits, group = (kernels.kernel_args(affine)[i] for i in (0, 6))  # blocks as stored: their form as the bits
        return torch.ops.infer.affine_linear(x, *views, bits | flag, group, 0.0)
    return _affine_product(x, affine, q8)


def _affine_product(x: Any, affine: AffineTensor | QuantizedTensor, q8: bool = False) -> Any:
    """The kernels' product on the tensors' memory: the C kernel for few
    rows (any number with ``q8``), else the tiled kernel, or, where
    :data:`~infer.backends.cpu.kernels.EXACT_GEMM` says ``blas``, dequantized
    slabs through torch's GEMM (an affine weight, or GGML blocks as stored)."""
    out = torch.empty((x.shape[0], affine.shape[0]), dtype=torch.float32)

    def product(r0: int, r1: int, slab: np.ndarray) -> None:
        out[:, r0:r1] = x @ torch.from_numpy(slab).T

    kernels.affine_product(x.numpy(), affine, out.numpy(), q8, lambda values: np.empty(values, np.float32), product)
    return out


class _OpBlocks(QuantizedTensor):
    """GGML blocks handed to ``infer::affine_linear`` as a uint8 tensor, for the
    C kernels (which need only :meth:`ggml_blocks` and the shape)."""

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
                    from infer.backends.cpu.plan import NotCapturable

                    raise NotCapturable(f"torch's {getattr(func, '__name__', func)} on a traced tensor, "
                                        "outside the backend's ops")
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))

        _TRACED_TENSOR = TracedTensor
    return _TRACED_TENSOR


class CpuTensors:
    """CPU tensors lent to the numpy backend's recorder (``cpu.plan.HostArrays``):
    ``Tensor.numpy()`` and ``torch.from_numpy`` share the memory both ways."""

    def __init__(self) -> None:
        self._weights: dict[int, tuple[Any, PackedWeight]] = {}
        # Each replayed step passes the same pool and table tensors (dozens, one
        # or two per layer); their numpy views are kept, since making one
        # (``detach().numpy()``, about 2 us) for each of them on each step was a
        # few per cent of a small model's decode step (docs/performance.md,
        # "torch/cpu's step inputs"). An entry lives as long as its tensor and
        # is used only while the tensor's memory, shape and strides are the
        # ones it was made for.
        self._hosts: dict[int, tuple[Any, int, Any, Any, np.ndarray]] = {}

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def to_host(self, x: Any) -> np.ndarray:
        if type(x) is not torch.Tensor:  # a traced tensor (recording): no cache
            with torch._C.DisableTorchFunctionSubclass():
                return x.detach().numpy()
        key = id(x)
        hit = self._hosts.get(key)
        if (hit is not None and hit[0]() is x and hit[1] == x.data_ptr() and hit[2] == x.shape
                and hit[3] == x.stride()):
            return hit[4]
        host = x.detach().numpy()
        hosts = self._hosts
        self._hosts[key] = (weakref.ref(x, lambda _, key=key: hosts.pop(key, None)), x.data_ptr(), x.shape,
                            x.stride(), host)
        return host

    def from_host(self, a: np.ndarray) -> Any:
        return torch.from_numpy(a)

    def guard(self, x: Any) -> Any:
        return x.as_subclass(_traced_tensor())

    def traced(self, x: Any) -> bool:
        return isinstance(x, _traced_tensor())

    def weight(self, w: PackedWeight) -> Any:
        """A GGUF weight kept for the C kernels (:func:`kept_for_kernels`) as the numpy backend holds it."""
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


def register_affine_op() -> None:
    """``infer::affine_linear`` for torch.compile: a captured step calls the
    C kernel as one opaque op (its fake shows Inductor the output's shape)."""
    global _AFFINE_OP_REGISTERED
    if _AFFINE_OP_REGISTERED or not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return

    @torch.library.custom_op("infer::affine_linear", mutates_args=())
    def op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
           bits: int, group: int, bias_factor: float) -> torch.Tensor:
        n = codes.shape[0]
        k = x.shape[1]
        q8 = bool(kernels.Q8_FLAG and bits & kernels.Q8_FLAG)  # activations="q8" (see affine_linear)
        bits &= ~kernels.Q8_FLAG
        named = {form: name for name, form in kernels.BLOCK_FORMS.items()}
        if bits in named:  # GGML blocks as stored: codes are the blocks, no scales or biases
            return _affine_product(x, _OpBlocks(named[bits], (n, k), codes.numpy()), q8)
        held = biases.numpy() if biases.numel() else None  # empty: bias_factor * scales
        affine = AffineTensor("affine", (n, k), bits, codes.numpy(), scales.numpy(), held, group,
                              None if held is not None else bias_factor)
        return _affine_product(x, affine, q8)

    @op.register_fake
    def _(x, codes, scales, biases, bits, group, bias_factor):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], codes.shape[0]))

    _AFFINE_OP_REGISTERED = True


def int4pack(affine: AffineTensor, name: str) -> PackedWeight | None:
    """``affine`` as CPU int4pack with float32 scales and zero points, or None
    when not exact. The kernel computes ``(code - 8) * scale + zero`` fused
    (checked in tests); with ``zero = bias + 8 * scale`` exact in float32
    that is ``scale * code + bias`` rounded once, as in the affine form."""
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


def decode_attention(q: Any, k_pool: Any, v_pool: Any, table: np.ndarray, block_size: int, hi: int, *,
                     scale: float, causal: bool, window: int | None, softcap: float | None, sinks: Any) -> Any:
    """A few query rows ``q`` ``[n, hq, dk]`` of one sequence over its first
    ``hi`` keys, read in place from the float32 (or float16) pools through its block
    ``table`` (int64), in the kernels' one-pass attention: SDPA's CPU path
    costs more in dispatch than the attention of a few rows does."""
    n, hq, dk = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[2]
    out = torch.empty((n, hq, dv), dtype=torch.float32)
    kernels.attention(q.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), out.numpy(), n, hi, hq, hkv, dk, dv,
                      scale, causal, window or 0, softcap or 0.0, table, block_size, True,
                      None if sinks is None else sinks.float().numpy())
    return out


def recurrent_op(fn: Any, *args: Any) -> tuple[Any, ...]:
    """One of the kernels' recurrent ops (:func:`.cpu.kernels.causal_conv1d`,
    ``gated_delta_rule``, ``ssd``) on float32 CPU tensors: each tensor argument
    read in place (its ``.numpy()``), the outputs' memory handed back as tensors."""
    host = [a.detach().contiguous().numpy() if isinstance(a, torch.Tensor) else a for a in args]
    return tuple(torch.from_numpy(out) for out in fn(*host))
