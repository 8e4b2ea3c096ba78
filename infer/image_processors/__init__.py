"""Images to ``pixel_values`` as Hugging Face's PIL image processors compute them.

One module per processor family, named after transformers' (``qwen2_vl``:
``Qwen2VLImageProcessorPil``, which Qwen2-VL, Qwen3-VL and Qwen3.5 use;
``idefics3``: ``Idefics3ImageProcessorPil``, Idefics3 and SmolVLM). This module
holds the steps they share, each the same arithmetic as transformers' so that
the arrays are equal, not merely close:

* :func:`rgb_array`: any PIL image to RGB ``uint8`` ``[height, width, 3]``;
  an alpha channel (or a palette's transparency) is composited on white, as
  ``transformers.image_transforms.convert_to_rgb`` does.
* :func:`resize`: Pillow's ``Image.resize`` of the ``uint8`` image (the PIL
  processors resize before rescaling, so every resize sees bytes).
* :func:`rescale_normalize`: ``x * scale`` in float64 rounded to float32, then
  ``(x - mean) / std`` in float32, channels first.

Pillow is an optional dependency (the ``vision`` extra); it is imported when
an image is first read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from infer.errors import MissingDependencyError

#: transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD`` (Qwen2-VL's defaults).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: transformers' ``IMAGENET_STANDARD_MEAN`` / ``IMAGENET_STANDARD_STD`` (Idefics3's defaults).
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)

#: Pillow's resampling filter numbers by the names processor configs use (``resample``).
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def pil() -> Any:
    """The ``PIL.Image`` module, or a :class:`~infer.errors.MissingDependencyError` saying how to get it."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("images need Pillow: pip install 'infer-engine[vision]'") from e
    return Image


def rgb_array(image: Any) -> np.ndarray:
    """A PIL image as RGB ``uint8`` ``[height, width, 3]``: transparent
    pixels blended onto white (transformers' ``convert_to_rgb``)."""
    Image = pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"))


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
