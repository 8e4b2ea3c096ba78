"""Idefics3's image processor (``Idefics3ImageProcessorPil``): Idefics3 and SmolVLM.

An image becomes square tiles of ``max_image_size`` pixels plus one global view:

1. Resize (Lanczos) so the longest edge is ``size["longest_edge"]`` (4 x 364 in
   Idefics3; the image grows or shrinks to it), the other edge kept in ratio
   and rounded up to even, both within 4096.
2. Resize again so both sides are multiples of ``max_image_size``.
3. If the image is larger than one tile, cut it into ``rows x cols`` tiles
   (row by row) and append the whole image resized to one tile (the global
   image); otherwise the one tile is the image (``rows = cols = 0``).
   Without ``do_image_splitting`` the image is resized to one tile.
4. Rescale by 1/255, normalize by mean and std 0.5.

``pixel_values`` is float32 ``[tiles, 3, max_image_size, max_image_size]``.
The prompt's ``<image>`` becomes, per tile, ``<fake_token_around_image>``,
``<row_r_col_c>`` and ``image_seq_len`` image tokens, a newline after each
row, then ``\\n<fake_token_around_image><global-img>``, the global image's
tokens and a closing ``<fake_token_around_image>`` (transformers'
``Idefics3Processor`` / ``SmolVLMProcessor``); an unsplit image is the last
part alone, without the leading newline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.errors import ConfigError
from infer.image_processing import ProcessedImage, register_image_processor

from . import RESAMPLE, STANDARD_MEAN, STANDARD_STD, resize, rescale_normalize, rgb_array

#: transformers' absolute bound on a resized side.
MAX_IMAGE_SIZE = 4096


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """Step 1's size: the longest edge set to ``longest``, the other in ratio
    (truncated, then rounded up to even), both within :data:`MAX_IMAGE_SIZE`."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Step 2's size: both sides rounded up to multiples of ``tile``, the
    shorter side derived from the longer through the aspect ratio first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass
class Idefics3ImageProcessor:
    """The settings of ``preprocessor_config.json`` (transformers' names and defaults)."""

    longest_edge: int = 4 * 364
    max_image_size: int = 364
    do_resize: bool = True
    do_image_splitting: bool = True
    image_mean: Sequence[float] = field(default_factory=lambda: STANDARD_MEAN)
    image_std: Sequence[float] = field(default_factory=lambda: STANDARD_STD)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = RESAMPLE["lanczos"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Idefics3ImageProcessor:
        """From a processor config dict (``size`` and ``max_image_size`` as ``{"longest_edge": n}``)."""
        out = cls()
        for name in ("do_resize", "do_image_splitting", "image_mean", "image_std", "rescale_factor", "do_rescale",
                     "do_normalize", "resample"):
            if config.get(name) is not None:
                setattr(out, name, config[name])
        out.longest_edge = int((config.get("size") or {}).get("longest_edge") or out.longest_edge)
        out.max_image_size = int((config.get("max_image_size") or {}).get("longest_edge") or out.max_image_size)
        return out

    def tiles(self, image: Any) -> tuple[list[np.ndarray], int, int]:
        """The ``uint8`` ``[h, w, 3]`` tiles of a PIL image (the global image
        last when split) and the ``rows``, ``cols`` of the split (0, 0: none)."""
        x = rgb_array(image)
        tile = self.max_image_size
        if self.do_resize:
            x = resize(x, *longest_edge_size(x.shape[0], x.shape[1], self.longest_edge), self.resample)
        if not self.do_image_splitting:
            return [resize(x, tile, tile, self.resample)], 0, 0
        x = resize(x, *tile_multiple_size(x.shape[0], x.shape[1], tile), self.resample)
        height, width = x.shape[:2]
        if height <= tile and width <= tile:
            return [x], 0, 0
        rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
        out = [x[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
        return out + [resize(x, tile, tile, self.resample)], rows, cols

    def __call__(self, image: Any) -> tuple[np.ndarray, int, int]:
        """A PIL image's ``pixel_values`` (float32 ``[tiles, 3, tile, tile]``), ``rows`` and ``cols``."""
        tiles, rows, cols = self.tiles(image)
        scale = self.rescale_factor if self.do_rescale else None
        mean = self.image_mean if self.do_normalize else None
        return np.stack([rescale_normalize(t, scale, mean, self.image_std) for t in tiles]), rows, cols

    def prompt(self, rows: int, cols: int, image_seq_len: int, image_token: str = "<image>",
               fake_token: str = "<fake_token_around_image>", global_token: str = "<global-img>") -> str:
        """The text that stands for an image split into ``rows x cols`` tiles
        (module docstring), each tile taking ``image_seq_len`` image tokens."""
        tokens = image_token * image_seq_len
        whole = f"{fake_token}{global_token}{tokens}{fake_token}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{fake_token}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return grid + "\n" + whole


@dataclass
class Idefics3Images:
    """Idefics3's image side of a prompt (:class:`infer.image_processing.ImageProcessor`):
    the tiles, ``meta["rows"]`` / ``meta["cols"]``, and the prompt text of
    :meth:`Idefics3ImageProcessor.prompt` for each ``<image>``."""

    pixels: Idefics3ImageProcessor
    tokens_per_tile: int
    placeholder: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"

    def preprocess(self, image: Any) -> ProcessedImage:
        tiles, rows, cols = self.pixels(image)
        return ProcessedImage(tiles, tiles.shape[0] * self.tokens_per_tile, {"rows": rows, "cols": cols})

    def expand(self, image: ProcessedImage) -> str:
        return self.pixels.prompt(image.meta["rows"], image.meta["cols"], self.tokens_per_tile, self.placeholder,
                                  self.fake_token, self.global_token)


def idefics3_processor(config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any) -> Idefics3Images:
    """The image processor of an Idefics3 / SmolVLM folder: its
    ``preprocessor_config.json`` over transformers' defaults; a tile must be
    the vision encoder's ``image_size`` (the encoder reads whole tiles)."""
    pixels = Idefics3ImageProcessor.from_config(preprocessor)
    vision = config.get("vision_config") or {}
    size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
    if pixels.max_image_size != size:
        raise ConfigError(f"preprocessor_config.json: max_image_size {pixels.max_image_size} differs from the vision "
                          f"encoder's image_size {size} (config.json); tiles must be whole encoder inputs")
    scale = int(config.get("scale_factor", 2))
    token = config.get("image_token_id")
    placeholder = tokenizer.id_to_token(int(token)) if tokenizer is not None and token is not None else None
    return Idefics3Images(pixels, (size // patch) ** 2 // scale ** 2, placeholder or "<image>")


register_image_processor("idefics3", idefics3_processor)
