"""MXFP4 expert weights in Hugging Face folders (gpt-oss's released checkpoints).

OpenAI ships gpt-oss with the mixture-of-experts weights in MXFP4 (OCP
"Microscaling Formats (MX) Specification" v1.0, section 5.3): blocks of 32
FP4 (E2M1) values sharing one E8M0 scale. A checkpoint stores each such
tensor ``X`` as two: ``X_blocks`` (``uint8`` ``[..., rows, groups, 16]``, two
FP4 codes a byte, the low nibble first) and ``X_scales`` (``uint8``
``[..., rows, groups]``, the exponent plus 127), and config.json says
``quantization_config.quant_method`` ``"mxfp4"``. transformers' dequantizing
load (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``) gives
``value = FP4[code] * 2 ** (scale - 127)`` per entry, rows of ``groups * 32``
values, then swaps the last two axes (the blocks are ``[experts, out, in]``;
the model's parameters ``[experts, in, out]``).

:class:`Mxfp4Source` shows a folder's tensors with every ``X_blocks`` /
``X_scales`` pair as the one float32 tensor ``X`` transformers' parameter
holds, dequantized when read: the architecture sees the unquantized names
and shapes (the values are exact in float32 and bfloat16 alike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import ConfigError, FormatError
from infer.package import TensorSource

#: The E2M1 values of codes 0..15 (sign bit 3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., rows, groups, 16]`` codes and ``[..., rows, groups]`` scales as
    float32 ``[..., rows, groups * 32]``: even entries from the low nibbles."""
    blocks = np.asarray(blocks, np.uint8)
    out = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, (np.asarray(scales).astype(np.int32) - 127)[..., None]).astype(np.float32, copy=False)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)


class Mxfp4Source(TensorSource):
    """``base`` with each ``X_blocks`` / ``X_scales`` pair read as the float32 ``X``."""

    def __init__(self, base: TensorSource, packed: dict[str, tuple[str, str]]) -> None:
        self.base, self._packed = base, packed  # name -> (blocks, scales)
        self._names = [n for n in base.names() if not any(n in pair for pair in packed.values())] + list(packed)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._packed or (name in self.base and not any(name in p for p in self._packed.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._packed:
            return self.base.shape(name)
        *lead, rows, groups, width = self.base.shape(self._packed[name][0])
        return (*lead, groups * width * 2, rows)  # dequantized [..., rows, cols], the last two swapped

    def storage_dtype(self, name: str) -> str:
        return "mxfp4" if name in self._packed else self.base.storage_dtype(name)

    def get(self, name: str) -> Any:
        if name not in self._packed:
            return self.base.get(name)
        blocks, scales = (self.base.get(n) for n in self._packed[name])
        return np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2))

    def stored_nbytes(self, name: str) -> int:
        if name not in self._packed:
            return self.base.stored_nbytes(name)
        return sum(self.base.stored_nbytes(n) for n in self._packed[name])

    def location(self, name: str) -> str:
        if name not in self._packed:
            return self.base.location(name)
        return f"{self.base.location(self._packed[name][0])} (MXFP4 as {name}_blocks, {name}_scales)"

    def release(self, name: str) -> None:
        for stored in self._packed.get(name, (name,)):
            self.base.release(stored)

    def close(self) -> None:
        self.base.close()


def mxfp4_tensors(config: dict[str, Any], tensors: TensorSource, where: Path) -> TensorSource:
    """``tensors`` with MXFP4 pairs dequantized (:class:`Mxfp4Source`) when
    config.json's ``quantization_config`` says ``mxfp4``; as they are otherwise."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        return tensors
    packed: dict[str, tuple[str, str]] = {}
    for name in tensors.names():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            scales = base + "_scales"
            if scales not in tensors:
                raise FormatError(f"{where}: MXFP4 tensor {name!r} has no {scales!r} beside it")
            b, s = tensors.shape(name), tensors.shape(scales)
            if len(b) < 2 or tuple(b[:-1]) != tuple(s) or tensors.storage_dtype(name) != "uint8":
                raise FormatError(f"{where}: MXFP4 tensors {name!r} {list(b)} and {scales!r} {list(s)} do not "
                                  "pair (uint8 blocks [..., groups, 16] with scales [..., groups])")
            packed[base] = (name, scales)
    if not packed:
        raise ConfigError(f"{where}: quantization_config.quant_method is 'mxfp4' but no tensor is stored as "
                          "<name>_blocks with <name>_scales")
    return Mxfp4Source(tensors, packed)
