"""Image processors of the families whose preprocessing is more than a resize.

:mod:`infer.image_processing` holds the registry, the common resize /
rescale / normalize pipeline and the families it covers (Gemma 3, LLaVA);
each module here is one more of transformers' PIL image processors, named
after it (``qwen2_vl``: ``Qwen2VLImageProcessorPil``, which Qwen2-VL, Qwen3-VL
and Qwen3.5 use; ``idefics3``: ``Idefics3ImageProcessorPil``, Idefics3 and
SmolVLM), registered with :func:`~infer.image_processing.register_image_processor`
when :mod:`infer.multimodal` is imported. The steps they share, each the
same arithmetic as transformers' so that the arrays are equal, not merely close:

* :func:`rgb_array`: any PIL image to RGB ``uint8`` ``[height, width, 3]``
  (transparency composited on white: :func:`infer.image_processing.to_rgb`).
* :func:`resize`: Pillow's ``Image.resize`` of the ``uint8`` image (the PIL
  processors resize before rescaling, so every resize sees bytes).
* :func:`rescale_normalize`: ``x * scale`` in float64 rounded to float32, then
  ``(x - mean) / std`` in float32, channels first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from infer.image_processing import to_rgb
from infer.images import pil

#: transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD`` (Qwen2-VL's defaults).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: transformers' ``IMAGENET_STANDARD_MEAN`` / ``IMAGENET_STANDARD_STD`` (Idefics3's defaults).
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)

#: Pillow's resampling filter numbers by the names processor configs use (``resample``).
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def rgb_array(image: Any) -> np.ndarray:
    """A PIL image as RGB ``uint8`` ``[height, width, 3]``: transparent
    pixels blended onto white (transformers' ``convert_to_rgb``)."""
    return np.asarray(to_rgb(image))


def resize(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """``uint8`` ``[h, w, 3]`` resized to ``[height, width, 3]`` by Pillow's
    filter ``resample`` (a :data:`RESAMPLE` value)."""
    Image = pil()
    return np.asarray(Image.fromarray(image).resize((width, height), resample=resample))


def rescale_normalize(image: np.ndarray, scale: float | None, mean: Sequence[float] | None,
                      std: Sequence[float] | None) -> np.ndarray:
    """``uint8`` ``[h, w, c]`` to float32 ``[c, h, w]``: ``x * scale`` (if
    ``scale``), then ``(x - mean) / std`` per channel (if ``mean``), in the
    dtypes transformers uses (float64 product, float32 difference)."""
    x = np.moveaxis(image, -1, 0)
    x = (x.astype(np.float64) * scale).astype(np.float32) if scale is not None else x.astype(np.float32)
    if mean is not None and std is not None:
        m = np.asarray(mean, np.float32).reshape(-1, 1, 1)
        s = np.asarray(std, np.float32).reshape(-1, 1, 1)
        x = (x - m) / s
    return np.ascontiguousarray(x, dtype=np.float32)
