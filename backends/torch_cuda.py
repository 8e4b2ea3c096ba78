"""The torch backend's CUDA side: what :class:`~infer.backends.torch.TorchBackend`
does on ``torch:cuda`` only.

* the SDPA kernels attention may use there (every one but cuDNN's: see
  :func:`sdpa_kernels`);
* tinygemm's int4 kernel and the int8 one, each checked by a probe on the
  device before it is offered, and the packing of affine weights for int4.

torch is bound by :func:`bind` (from ``infer.backends.torch``'s first import
of torch), so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from infer.ops import PackedWeight
from infer.quantize import AffineTensor, is_embedding

log = logging.getLogger(__name__)

#: Bound by :func:`bind`.
torch: Any = None
#: A context in which SDPA may pick every attention kernel but cuDNN's; a
#: null context where this torch cannot choose (bound by :func:`bind`).
_SDPA: Callable[[], Any] = contextlib.nullcontext


def bind(module: Any) -> None:
    """Use ``module`` (torch, imported by the backend) from now on."""
    global torch, _SDPA
    torch = module
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no way to choose, and no cuDNN attention either
        pass
    else:
        kept = [b for b in SDPBackend.__members__.values() if b.name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")]
        _SDPA = functools.partial(sdpa_kernel, kept)


def sdpa_kernels() -> Any:
    """A context for ``scaled_dot_product_attention`` on CUDA that leaves
    cuDNN's attention out of SDPA's choice: SDPA picks it for decode, and
    cuDNN builds an execution plan for every new key count, while a decode
    step always has one more key than the last (docs/performance.md, "The
    H200 run"). Flash and memory-efficient attention need no per-shape plan."""
    return _SDPA()


def int4pack(affine: AffineTensor, name: str, device: Any, compute_dtype: str) -> PackedWeight | None:
    """``affine`` in tinygemm's layout on ``device``, or None where it does
    not fit: codes packed by ``_convert_weight_to_int4pack`` and ``[K/32, N,
    2]`` bfloat16 scales and zero points (``zero = bias + 8 * scale``, rounded
    to bfloat16)."""
    n, k = affine.shape
    tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
    n_tile = 16 if torch.version.hip else 8  # the packed layout's output-row tile
    if affine.bits != 4 or affine.group != 32 or n % n_tile or tiles is None:
        log.debug("%s: %s does not fit tinygemm's int4 layout; kept in %s", name, affine.shape, compute_dtype)
        return None
    codes = torch.from_numpy(nibbles(affine.codes(), int4_layout())).to(device)
    packed = torch.ops.aten._convert_weight_to_int4pack(codes, tiles)
    zero = affine.biases.astype(np.float64) + 8.0 * affine.scales.astype(np.float64)
    sz = np.stack([affine.scales.T, zero.astype(np.float32).T], axis=-1)
    sz = torch.from_numpy(np.ascontiguousarray(sz)).to(device, torch.bfloat16)
    rows = affine if is_embedding(name) else None
    return PackedWeight(affine.shape, affine.qtype, "int4 tinygemm g32 bf16", ("int4", packed, sz), rows)


# -- CUDA quantized kernels -------------------------------------------------------------
#
# torch's CUDA int4 kernel (tinygemm) is a private op whose input packing has
# changed between releases (int32 codes before 2.5, two codes per uint8 since).
# Rather than trust a version table, each process checks once, on a small
# random matrix, which packing reproduces ``(code - 8) * scale + zero``; if
# none does, int4 is not offered on CUDA and the load says so.

#: Nibble orders tried: the even column in the high nibble (torch >= 2.5, as
#: torchao packs), or in the low one.
INT4_LAYOUTS = ("even-high", "even-low")


def nibbles(codes: np.ndarray, layout: str | None) -> np.ndarray:
    """uint8 codes ``[N, K]`` (0..15) as ``[N, K/2]`` bytes, two per byte."""
    even, odd = codes[:, 0::2].astype(np.uint8), codes[:, 1::2].astype(np.uint8)
    return (even << 4 | odd) if layout == "even-high" else (odd << 4 | even)


_CUDA_INT4: list[str | None] = []


def int4_layout() -> str | None:
    """The packing under which this torch's CUDA int4 kernel computes
    ``(code - 8) * scale + zero`` (None: no working kernel). Probed once."""
    if not _CUDA_INT4:
        _CUDA_INT4.append(_probe_int4())
    return _CUDA_INT4[0]


def _probe_int4() -> str | None:
    rng = np.random.default_rng(0)
    n, k = 64, 256
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    sz = torch.randn(k // 32, n, 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale, zero = sz[..., 0].float().repeat_interleave(32, 0), sz[..., 1].float().repeat_interleave(32, 0)
    want = (torch.from_numpy(codes.T.astype(np.float32)) - 8) * scale + zero  # [K, N] = W^T
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    for layout in INT4_LAYOUTS:
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(torch.from_numpy(nibbles(codes, layout)).cuda(), 2)
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


def int8_works() -> bool:
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
