"""Images as inputs: reading one from what a caller hands over, within limits.

An image reaches infer as a path, raw bytes, a ``PIL.Image.Image``, a
``data:`` URL (``data:image/png;base64,...``) or, at the server, a remote URL
the operator allowed (docs/vision.md, "Limits"). :func:`load_image` turns
any of them into a decoded RGB-or-whatever-mode PIL image, checked against
:class:`ImageLimits` before and after decoding, so that a hostile file (a
decompression bomb, a 100000 x 1 strip, a truncated PNG, text posing as an
image) is an :class:`~infer.errors.ImageError` naming the input, never a
``PIL`` traceback or a process out of memory.

:func:`image_key` is an image's identity for the prefix cache: a SHA-256 of
its decoded pixels, mode and size, so the same picture sent as a file, as
bytes or as a data URL shares cached keys and values, and two different
pictures never do.

Pillow is an optional dependency (``pip install infer[vision]``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.errors import ImageError, MissingDependencyError

#: What :func:`load_image` takes.
ImageSource = Any  # str | os.PathLike | bytes | PIL.Image.Image


@dataclass(frozen=True)
class ImageLimits:
    """Bounds an image must keep (checked before decoding where the header
    tells, and after)."""

    #: Most bytes of an encoded image (a file, bytes, a data URL's payload).
    max_bytes: int = 20 * 2**20
    #: Most pixels (width x height) of the decoded image.
    max_pixels: int = 50_000_000
    #: Most width / height (or height / width): a 100000 x 1 strip is no picture.
    max_aspect_ratio: float = 200.0


DEFAULT_LIMITS = ImageLimits()

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)


def pil() -> Any:
    """The ``PIL.Image`` module, or :class:`~infer.errors.MissingDependencyError`."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow is in the test extra
        raise MissingDependencyError("images need Pillow: pip install 'infer[vision]' (or pip install pillow)") \
            from exc
    return Image


def decode_data_url(url: str, what: str = "image") -> bytes:
    """The bytes of a ``data:`` URL; :class:`~infer.errors.ImageError` when
    it is malformed or does not say it holds an image."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError(f"{what}: not a data URL (expected 'data:image/...;base64,...')")
    mime = (match.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise ImageError(f"{what}: the data URL holds {mime or 'text/plain'!r}, not an image")
    payload = match.group("data")
    if not match.group("b64"):
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{what}: the data URL's base64 payload is malformed ({exc})") from exc


def load_image(source: ImageSource, *, limits: ImageLimits = DEFAULT_LIMITS, what: str = "image") -> Any:
    """``source`` decoded as a ``PIL.Image.Image`` (fully loaded, so a
    truncated file fails here), within ``limits``.

    Args:
        source: a path (``str`` or ``os.PathLike``), bytes, a PIL image, or a
            ``data:image/...`` URL string.
        limits: the bounds (:class:`ImageLimits`).
        what: how an error names the input (e.g. ``"messages[0].content[1]"``).

    Raises:
        ImageError: unreadable, not an image, truncated, or beyond ``limits``.
    """
    Image = pil()
    if isinstance(source, Image.Image):
        _check_size(source.size, limits, what)
        return source
    if isinstance(source, str) and source.startswith("data:"):
        data = decode_data_url(source, what)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source):
            raise ImageError(f"{what}: {source.split('://')[0]} URLs are not read here; pass a path, bytes, a PIL "
                             "image or a data URL (the server fetches allowed remote URLs: --allowed-media-domains)")
        path = Path(source)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ImageError(f"{what}: cannot read {str(path)!r} ({exc.strerror or exc})") from exc
        if size > limits.max_bytes:
            raise ImageError(f"{what}: {str(path)!r} is {size:,} bytes; images are limited to {limits.max_bytes:,}")
        data = path.read_bytes()
    else:
        raise ImageError(f"{what}: expected a path, bytes, a PIL image or a data URL, got {type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what}: {len(data):,} bytes; images are limited to {limits.max_bytes:,}")
    if not data:
        raise ImageError(f"{what}: the image is empty (0 bytes)")
    try:
        # Pillow's own bomb check warns at max_pixels and raises at twice that: ours is
        # stricter and comes first, from the header, before any pixel is decoded.
        image = Image.open(io.BytesIO(data))
        _check_size(image.size, limits, what)
        image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what}: {exc}") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's ways of saying "not an image"
        raise ImageError(f"{what}: not a readable image ({exc})") from exc
    return image


def _check_size(size: tuple[int, int], limits: ImageLimits, what: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"{what}: the image is {width} x {height} pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"{what}: {width} x {height} = {width * height:,} pixels; images are limited to "
                         f"{limits.max_pixels:,}")
    if max(width / height, height / width) > limits.max_aspect_ratio:
        raise ImageError(f"{what}: {width} x {height} pixels is too narrow (aspect ratio beyond "
                         f"{limits.max_aspect_ratio:g}:1)")


def image_key(image: Any) -> bytes:
    """SHA-256 of a PIL image's mode, size and pixels: its prefix-cache identity."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.digest()
