"""Qwen2-VL's image processor (``Qwen2VLImageProcessorPil``): Qwen2-VL, Qwen3-VL, Qwen3.5.

An image becomes patches of ``temporal_patch_size x patch_size x patch_size``
pixels per channel, in the order the vision tower's 2x2 merger reads them:

1. :func:`smart_resize`: both sides rounded to multiples of ``patch_size *
   merge_size`` with the pixel count kept within ``[min_pixels, max_pixels]``
   (shrunk or grown by one factor, keeping the aspect ratio), bicubic.
2. Rescale by 1/255, normalize by the CLIP mean and standard deviation.
3. Patchify: the ``[c, H, W]`` image cut into a ``[H/p, W/p]`` grid of patches,
   ordered by ``merge_size x merge_size`` block (rows of blocks, then the
   patches inside a block row by row); each patch repeated
   ``temporal_patch_size`` times (an image is a one-frame video) and flattened
   channel-major: ``pixel_values`` ``[grid_h * grid_w, c * tp * p * p]`` and
   ``grid_thw = (1, grid_h, grid_w)``.

The language model sees ``grid_h * grid_w / merge_size**2`` image tokens per
image: the prompt's ``<|image_pad|>`` (inside the chat template's
``<|vision_start|>...<|vision_end|>``) repeated that many times, as
transformers' ``Qwen3VLProcessor`` expands it (:class:`QwenImages`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.errors import ConfigError, ImageError

from infer.image_processing import ProcessedImage, register_image_processor

from . import CLIP_MEAN, CLIP_STD, RESAMPLE, resize, rescale_normalize, rgb_array


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size Qwen2-VL resizes a ``height x width`` image to: multiples of
    ``factor`` with ``min_pixels <= h * w <= max_pixels``, aspect kept as
    nearly as the rounding allows (transformers' ``smart_resize``)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image of {width}x{height} pixels: the aspect ratio must be at most 200 "
                           f"(found {max(height, width) / min(height, width):.1f})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class Qwen2VLImageProcessor:
    """The settings of ``preprocessor_config.json`` (transformers' names and defaults)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: Sequence[float] = field(default_factory=lambda: CLIP_MEAN)
    image_std: Sequence[float] = field(default_factory=lambda: CLIP_STD)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = RESAMPLE["bicubic"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen2VLImageProcessor:
        """From a processor config dict: ``size`` (``shortest_edge`` /
        ``longest_edge``: the pixel bounds) or the older ``min_pixels`` /
        ``max_pixels``, which win when both are given, as in transformers."""
        out = cls()
        for name in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                     "rescale_factor", "do_resize", "do_rescale", "do_normalize", "resample"):
            if config.get(name) is not None:
                setattr(out, name, config[name])
        size = config.get("size") or {}
        out.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or out.min_pixels)
        out.max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or out.max_pixels)
        return out

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, grid_h, grid_w)`` of an image of ``height x width`` pixels."""
        if self.do_resize:
            height, width = smart_resize(height, width, self.patch_size * self.merge_size,
                                         self.min_pixels, self.max_pixels)
        return 1, height // self.patch_size, width // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """Image tokens the language model sees for an image of this size."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size ** 2

    def __call__(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A PIL image's ``pixel_values`` (float32 ``[patches, c * tp * p * p]``) and ``grid_thw``."""
        x = rgb_array(image)
        height, width = x.shape[:2]
        t, gh, gw = self.grid(height, width)
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if self.do_resize:
            x = resize(x, gh * p, gw * p, self.resample)
        elif height % (p * m) or width % (p * m):
            raise ImageError(f"image of {width}x{height} pixels: without resizing, both sides must be "
                               f"multiples of {p * m}")
        x = rescale_normalize(x, self.rescale_factor if self.do_rescale else None,
                              self.image_mean if self.do_normalize else None, self.image_std)
        c = x.shape[0]
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, in-block, c, p, p
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))  # the frame repeated tp times
        return np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p)), (t, gh, gw)

    def batch(self, images: Sequence[Any]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Several images' patches concatenated, and their grids, in order."""
        out = [self(im) for im in images]
        return np.concatenate([pv for pv, _ in out]), [g for _, g in out]


@dataclass
class QwenImages:
    """Qwen's image side of a prompt (:class:`infer.image_processing.ImageProcessor`):
    the patches, ``meta["grid_thw"]``, and ``<|image_pad|>`` once per image token."""

    pixels: Qwen2VLImageProcessor
    placeholder: str = "<|image_pad|>"

    def preprocess(self, image: Any) -> ProcessedImage:
        pixel_values, grid = self.pixels(image)
        t, h, w = grid
        return ProcessedImage(pixel_values, t * h * w // self.pixels.merge_size ** 2, {"grid_thw": grid})

    def expand(self, image: ProcessedImage) -> str:
        return self.placeholder * image.num_tokens


def qwen2_vl_processor(config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any) -> QwenImages:
    """The image processor of a Qwen3.5 (Qwen2-VL style) folder: its
    ``preprocessor_config.json`` over transformers' defaults, checked against
    the vision tower's patch, merge and temporal sizes."""
    pixels = Qwen2VLImageProcessor.from_config(preprocessor)
    vision = config.get("vision_config") or {}
    for name, mine in (("patch_size", "patch_size"), ("spatial_merge_size", "merge_size"),
                       ("temporal_patch_size", "temporal_patch_size")):
        if name in vision and int(vision[name]) != int(getattr(pixels, mine)):
            raise ConfigError(f"preprocessor_config.json: {mine} {getattr(pixels, mine)} differs from the vision "
                              f"tower's {name} {vision[name]} (config.json)")
    token = config.get("image_token_id")
    placeholder = tokenizer.id_to_token(int(token)) if tokenizer is not None and token is not None else None
    return QwenImages(pixels, placeholder or "<|image_pad|>")


register_image_processor("qwen2_vl", qwen2_vl_processor)
