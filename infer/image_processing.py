"""Image preprocessing: what Hugging Face's PIL image processors compute.

A vision-language family turns a picture into ``pixel_values`` the way its
``preprocessor_config.json`` says, and its prompt's image placeholder into
the tokens the picture's embeddings replace. Both are the family's
:class:`ImageProcessor`, found by name in :data:`PROCESSORS` (the name is
the network's :attr:`~infer.architecture.VisionSpec.processor`); a family
registers its own with :func:`register_image_processor`.

The steps here are those of transformers' ``image_processing_pil_*`` modules
(the slow processors, which run without torchvision): convert to RGB
(transparency composited onto white), resize with PIL's filter on the uint8
image, center crop (zero padding where the crop is larger), rescale in
float64 then float32, normalize in float32, channels first. So
``pixel_values`` equal theirs to the last bit (tests/test_vision.py checks
within 1e-6 on RGB, RGBA, greyscale, odd-aspect and tiny images).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from infer.errors import ConfigError, ImageError
from infer.images import pil

IMAGENET_STANDARD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))

#: transformers' defaults per image processor class, before preprocessor_config.json's own keys.
PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ImageProcessor": {"resample": 2, "size": {"height": 224, "width": 224}, "do_center_crop": False,
                             "image_mean": IMAGENET_STANDARD[0], "image_std": IMAGENET_STANDARD[1]},
    "SiglipImageProcessor": {"resample": 3, "size": {"height": 224, "width": 224}, "do_center_crop": False,
                             "image_mean": IMAGENET_STANDARD[0], "image_std": IMAGENET_STANDARD[1]},
    "CLIPImageProcessor": {"resample": 3, "size": {"shortest_edge": 224}, "do_center_crop": True,
                           "crop_size": {"height": 224, "width": 224},
                           "image_mean": OPENAI_CLIP[0], "image_std": OPENAI_CLIP[1]},
}


@dataclass
class ProcessedImage:
    """One image made ready for its family's vision tower."""

    #: float32, channels first: ``[3, height, width]`` (or what the family's tower reads).
    pixel_values: np.ndarray
    #: Tokens its embeddings take in the prompt (the expanded placeholder's image tokens).
    num_tokens: int
    #: What else the family's tower or position rule needs (e.g. a patch grid).
    meta: dict[str, Any] = field(default_factory=dict)


class ImageProcessor(Protocol):
    """A family's image side of the prompt (docs/vision.md, "A family's hooks")."""

    #: The text one image stands for in a prompt or a rendered chat template
    #: (Gemma 3: ``<start_of_image>``, LLaVA: ``<image>``).
    placeholder: str

    def preprocess(self, image: Any) -> ProcessedImage:
        """A decoded PIL image as its ``pixel_values`` and token count."""
        ...

    def expand(self, image: ProcessedImage) -> str:
        """The text that replaces one placeholder: the image tokens (and the
        family's markers around them) its embeddings go to."""
        ...


@dataclass
class ResizeNormalize:
    """The resize / crop / rescale / normalize pipeline of transformers'
    PIL processors, set by a ``preprocessor_config.json`` dict."""

    size: dict[str, int]
    resample: int = 3
    do_resize: bool = True
    do_center_crop: bool = False
    crop_size: dict[str, int] | None = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: Sequence[float] = IMAGENET_STANDARD[0]
    image_std: Sequence[float] = IMAGENET_STANDARD[1]
    do_convert_rgb: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any], kind: str) -> ResizeNormalize:
        """``config`` (preprocessor_config.json) over transformers' defaults for processor class ``kind``."""
        merged = {**PROCESSOR_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}
        size = merged.get("size")
        if isinstance(size, int):  # an old config's square size
            size = {"height": size, "width": size} if kind != "CLIPImageProcessor" else {"shortest_edge": size}
        crop = merged.get("crop_size")
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        names = {f for f in cls.__dataclass_fields__}
        args = {k: v for k, v in merged.items() if k in names}
        args.update(size=dict(size), crop_size=None if crop is None else dict(crop))
        mean, std = args.get("image_mean"), args.get("image_std")
        if isinstance(mean, (int, float)):
            args["image_mean"] = [float(mean)] * 3
        if isinstance(std, (int, float)):
            args["image_std"] = [float(std)] * 3
        return cls(**args)

    def __call__(self, image: Any) -> np.ndarray:
        """float32 ``[3, height, width]`` pixel values of a PIL image."""
        Image = pil()
        if self.do_convert_rgb:
            image = to_rgb(image)
        array = np.asarray(image)
        if array.ndim == 2:
            array = array[:, :, None]
        if self.do_resize:
            height, width = self.output_size(array.shape[0], array.shape[1])
            squeeze = array.shape[2] == 1
            source = Image.fromarray(array[:, :, 0] if squeeze else array)
            array = np.asarray(source.resize((width, height), resample=self.resample))
            array = array[:, :, None] if array.ndim == 2 else array
        chw = np.moveaxis(array, -1, 0)
        if self.do_center_crop:
            assert self.crop_size is not None
            chw = center_crop(chw, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            chw = (chw.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            chw = chw.astype(np.float32) if not np.issubdtype(chw.dtype, np.floating) else chw
            mean = np.asarray(self.image_mean, dtype=chw.dtype)
            std = np.asarray(self.image_std, dtype=chw.dtype)
            chw = ((chw.T - mean) / std).T  # as transformers' normalize: over the channel axis
        return np.ascontiguousarray(chw, dtype=np.float32)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize, as transformers' PIL backend computes it."""
        size = self.size
        if size.get("shortest_edge") and size.get("longest_edge"):
            return size_with_aspect_ratio(height, width, size["shortest_edge"], size["longest_edge"])
        if size.get("shortest_edge"):
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        if size.get("height") and size.get("width"):
            return size["height"], size["width"]
        raise ConfigError(f"preprocessor_config.json: size {size} names neither height and width nor shortest_edge")


def to_rgb(image: Any) -> Any:
    """As transformers' ``convert_to_rgb``: transparency composited onto white."""
    Image = pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop``: zero padding where the image is smaller than the crop."""
    h, w = chw.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return chw[..., top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros(chw.shape[:-2] + (new_h, new_w), chw.dtype)
    tp, lp = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[..., tp:tp + h, lp:lp + w] = chw
    top, left = top + tp, left + lp
    return padded[..., max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' ``get_size_with_aspect_ratio``."""
    raw = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw = max_size * lo / hi
        size = int(round(raw))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw * height / width) if raw is not None else int(size * height / width)), size
    return size, (int(raw * width / height) if raw is not None else int(size * width / height))


# -- the registry -----------------------------------------------------------------------------------

#: ``factory(config, preprocessor_config, tokenizer) -> ImageProcessor`` by the name a
#: network's :attr:`~infer.architecture.VisionSpec.processor` gives.
PROCESSORS: dict[str, Callable[[dict[str, Any], dict[str, Any], Any], ImageProcessor]] = {}


def register_image_processor(name: str,
                             factory: Callable[[dict[str, Any], dict[str, Any], Any], ImageProcessor]) -> None:
    """Make ``factory`` the image processor of networks whose vision spec names ``name``."""
    PROCESSORS[name] = factory


def read_preprocessor_config(folder: Path | None) -> dict[str, Any]:
    """A model folder's image processor settings: ``preprocessor_config.json``,
    else the ``image_processor`` of ``processor_config.json``; ``{}`` where neither is."""
    if folder is None or not folder.is_dir():
        return {}
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = folder / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{path}: not readable JSON ({exc})") from exc
            if key is not None:
                data = data.get(key) if isinstance(data, dict) else None
            if isinstance(data, dict):
                return data
    return {}


def image_processor(name: str, config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any) -> ImageProcessor:
    """The registered processor ``name`` for a model."""
    factory = PROCESSORS.get(name)
    if factory is None:
        raise ImageError(f"no image processor is registered for {name!r} (known: {', '.join(sorted(PROCESSORS))})")
    return factory(config, preprocessor, tokenizer)


# -- the families of this package ---------------------------------------------------------------------


def pan_and_scan_crops(height: int, width: int, min_crop_size: int, max_crops: int,
                       min_ratio: float) -> list[tuple[int, int, int, int]]:
    """Gemma 3's pan-and-scan (transformers' ``Gemma3ImageProcessor.pan_and_scan``):
    ``(top, left, bottom, right)`` of the crops of an image of ``height x
    width`` pixels, row by row; none where its aspect ratio is below
    ``min_ratio`` or the crops would be smaller than ``min_crop_size``. The
    long side is cut into its aspect ratio rounded half up, at least 2 and
    at most ``max_crops`` crops of ``ceil(side / n)`` pixels (the last one
    shorter where that overshoots)."""
    long, short = max(width, height), min(width, height)
    if long / short < min_ratio:
        return []
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop_size)))
    n = min(max_crops, max(2, n))
    crops_w, crops_h = (n, 1) if width >= height else (1, n)
    crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    if min(crop_w, crop_h) < min_crop_size:
        return []
    return [(top, left, min(top + crop_h, height), min(left + crop_w, width))
            for top in range(0, crop_h * crops_h, crop_h) for left in range(0, crop_w * crops_w, crop_w)]


@dataclass
class Gemma3Images:
    """Gemma 3: a square resize (896 px in the released models), and
    ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens +
    ``<end_of_image>\\n\\n`` per ``<start_of_image>`` (transformers'
    ``Gemma3Processor``). With pan-and-scan (``do_pan_and_scan``), a long
    image is also cut into crops (:func:`pan_and_scan_crops`), each resized
    as the whole image is: ``pixel_values`` ``[1 + crops, 3, size, size]``
    (the whole image first) and the text ``Here is the original image``
    + its tokens + `` and here are some crops to help you see better`` + each
    crop's tokens."""

    pixels: ResizeNormalize
    tokens: int
    boi: str = "<start_of_image>"
    eoi: str = "<end_of_image>"
    image_token: str = "<image_soft_token>"
    placeholder: str = "<start_of_image>"
    #: ``(min_crop_size, max_num_crops, min_ratio_to_activate)`` with pan-and-scan on, else None.
    pan_and_scan: tuple[int, int, float] | None = None

    def preprocess(self, image: Any) -> ProcessedImage:
        if self.pan_and_scan is None:
            return ProcessedImage(self.pixels(image), self.tokens)
        rgb = to_rgb(image)  # transformers converts first, then crops the RGB pixels
        array = np.asarray(rgb)
        crops = pan_and_scan_crops(array.shape[0], array.shape[1], *self.pan_and_scan)
        if not crops:
            return ProcessedImage(self.pixels(rgb), self.tokens, {"crops": 0})
        Image = pil()
        views = [self.pixels(rgb)] + [self.pixels(Image.fromarray(np.ascontiguousarray(array[t:b, l:r])))
                                      for t, l, b, r in crops]
        return ProcessedImage(np.stack(views), self.tokens * len(views), {"crops": len(crops)})

    def expand(self, image: ProcessedImage) -> str:
        crops = image.meta.get("crops", 0)
        one = f"\n\n{self.boi}{self.image_token * (image.num_tokens // (1 + crops))}{self.eoi}\n\n"
        if not crops:
            return one
        return f"Here is the original image {one} and here are some crops to help you see better " + " ".join(
            [one] * crops)


@dataclass
class RepeatedToken:
    """One placeholder token repeated once per image embedding (LLaVA's ``<image>``)."""

    pixels: ResizeNormalize
    tokens: int
    placeholder: str = "<image>"

    def preprocess(self, image: Any) -> ProcessedImage:
        return ProcessedImage(self.pixels(image), self.tokens)

    def expand(self, image: ProcessedImage) -> str:
        return self.placeholder * image.num_tokens


def _token(tokenizer: Any, token_id: int | None, default: str) -> str:
    if tokenizer is not None and token_id is not None:
        text = tokenizer.id_to_token(int(token_id))
        if text:
            return str(text)
    return default


def gemma3_processor(config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any) -> Gemma3Images:
    vision = config.get("vision_config") or {}
    kind = "Gemma3ImageProcessor"
    image_size = int(vision.get("image_size", 224))
    settings = {"size": {"height": image_size, "width": image_size}, **preprocessor}
    pan_and_scan = None
    if settings.get("do_pan_and_scan"):  # unset values: Gemma3Processor's defaults
        pan_and_scan = (int(settings.get("pan_and_scan_min_crop_size") or 256),
                        int(settings.get("pan_and_scan_max_num_crops") or 4),
                        float(settings.get("pan_and_scan_min_ratio_to_activate") or 1.2))
    tokens = int(config.get("mm_tokens_per_image", 256))
    return Gemma3Images(ResizeNormalize.from_config(settings, kind), tokens, pan_and_scan=pan_and_scan,
                        boi=_token(tokenizer, config.get("boi_token_index", config.get("boi_token_id")),
                                   "<start_of_image>"),
                        eoi=_token(tokenizer, config.get("eoi_token_index", config.get("eoi_token_id")),
                                   "<end_of_image>"),
                        image_token=_token(tokenizer, config.get("image_token_index",
                                                                 config.get("image_token_id")), "<image_soft_token>"),
                        placeholder=_token(tokenizer, config.get("boi_token_index", config.get("boi_token_id")),
                                           "<start_of_image>"))


def llava_processor(config: dict[str, Any], preprocessor: dict[str, Any], tokenizer: Any) -> RepeatedToken:
    vision = config.get("vision_config") or {}
    vtype = vision.get("model_type", "clip_vision_model")
    kind = preprocessor.get("image_processor_type", "")
    kind = kind[:-4] if kind.endswith("Fast") else kind[:-3] if kind.endswith("Pil") else kind
    if kind not in PROCESSOR_DEFAULTS or kind == "Gemma3ImageProcessor":
        kind = "SiglipImageProcessor" if "siglip" in vtype else "CLIPImageProcessor"
    image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 14))
    defaults = ({"size": {"shortest_edge": image_size}, "crop_size": {"height": image_size, "width": image_size}}
                if kind == "CLIPImageProcessor" else {"size": {"height": image_size, "width": image_size}})
    pixels = ResizeNormalize.from_config({**defaults, **preprocessor}, kind)
    # transformers' LlavaProcessor: the patches, CLIP's class token, less one row for "default" (which drops
    # the tower's first row, the class token in CLIP, a patch in SigLIP).
    tokens = (image_size // patch) ** 2 + (0 if "siglip" in vtype else 1)
    if config.get("vision_feature_select_strategy", "default") == "default":
        tokens -= 1
    return RepeatedToken(pixels, tokens,
                         placeholder=_token(tokenizer, config.get("image_token_index",
                                                                  config.get("image_token_id")), "<image>"))


register_image_processor("gemma3", gemma3_processor)
register_image_processor("llava", llava_processor)
