"""Images in the server's requests: the three APIs' image parts, remote URLs, errors.

Each API names an image its own way; all become the content part
``{"type": "image", "image": SOURCE}`` that :func:`infer.multimodal.image_parts`
reads, so the same picture gives the same tokens whichever API sent it:

* OpenAI chat completions: ``{"type": "image_url", "image_url": {"url": U}}``
  (or ``"image_url": U``);
* the Responses API: ``{"type": "input_image", "image_url": U}``;
* Anthropic's Messages API: ``{"type": "image", "source": {"type": "base64",
  "media_type": M, "data": D}}`` or ``{"source": {"type": "url", "url": U}}``.

``U`` is a ``data:image/...`` URL, or an ``http(s)`` URL that the server fetches
only from the domains its operator allows (``--allowed-media-domains``): a
server that fetched any URL would reach into its own network for whoever asks
(server-side request forgery). A broken image is a 400 naming its part.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Sequence
from typing import Any

from infer.errors import RequestError
from infer.images import DEFAULT_LIMITS

#: Seconds a remote image may take to arrive.
FETCH_TIMEOUT = 10.0

IMAGE_KINDS = ("image_url", "input_image", "image")


def image_source(part: dict[str, Any], where: str) -> str:
    """The URL (``data:`` or remote) of one API's image part; a 400 naming ``where`` when malformed."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if kind == "input_image" and url is None and part.get("file_id") is not None:
            raise RequestError(f"{where}: file_id images are not supported; send the image as image_url", where)
    else:  # Anthropic's image block
        source = part.get("source")
        if not isinstance(source, dict):
            raise RequestError(f"{where}: an image block needs a 'source' object", where)
        if source.get("type") == "base64":
            media, data = source.get("media_type"), source.get("data")
            if not isinstance(media, str) or not isinstance(data, str):
                raise RequestError(f"{where}: a base64 image source needs 'media_type' and 'data' strings", where)
            url = f"data:{media};base64,{data}"
        elif source.get("type") == "url":
            url = source.get("url")
        else:
            raise RequestError(f"{where}: image source type {source.get('type')!r} is not 'base64' or 'url'", where)
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}: the image needs a URL (a data: URL, or http(s) from an allowed domain)", where)
    return url


def content(parts: Any, where: str, text_kinds: Collection[str], refuse: Callable[[int, str], RequestError], *,
            part_param: bool = False) -> str | list[dict[str, Any]]:
    """A message's content with its image parts: the joined text where it has
    none (as before), else the parts in order, text as ``{"type": "text"}`` and
    each image as ``{"type": "image", "image": URL, "where": ..., "param": ...}``
    (``param``: what an error about it names, the part with ``part_param``, else
    the content, as each API's errors name things)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise RequestError(f"{where} must be a string or a list of content parts", where)
    out: list[dict[str, Any]] = []
    images = False
    for j, part in enumerate(parts):
        kind: Any = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in text_kinds and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_KINDS:
            at = f"{where}[{j}]"
            out.append({"type": "image", "image": image_source(part, at), "where": at,
                        "param": at if part_param else where})
            images = True
        else:
            raise refuse(j, kind)
    return out if images else "".join(p["text"] for p in out)


def has_images(conversation: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in conversation)


def first_image(conversation: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """Where the conversation's first image part came from (e.g.
    ``messages[0].content[1]``), and the parameter an error about it names."""
    for message in conversation:
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            if part.get("type") == "image":
                where = str(part.get("where", "messages"))
                return where, str(part.get("param", where))
    return "messages", "messages"


def resolve(conversation: list[dict[str, Any]], allowed: Collection[str],
            max_bytes: int = DEFAULT_LIMITS.max_bytes) -> list[dict[str, Any]]:
    """The conversation with each remote image fetched (from an allowed
    domain) into bytes; a remote URL elsewhere is a 400 naming its part."""
    out = []
    for message in conversation:
        parts = message.get("content")
        if not isinstance(parts, list):
            out.append(message)
            continue
        fixed = []
        for part in parts:
            if part.get("type") == "image" and isinstance(part.get("image"), str) \
                    and not part["image"].startswith("data:"):
                part = {**part, "image": fetch(part["image"], allowed, part.get("where", "image"), max_bytes)}
            fixed.append(part)
        out.append({**message, "content": fixed})
    return out


def fetch(url: str, allowed: Collection[str], where: str, max_bytes: int) -> bytes:
    """The bytes at ``url`` when its host is one of ``allowed`` (or a subdomain of one)."""
    parsed = urllib.parse.urlsplit(url)
    host = (parsed.hostname or "").lower()
    if parsed.scheme not in ("http", "https") or not host:
        raise RequestError(f"{where}: an image URL must be a data: URL or http(s), got {url[:40]!r}", where)
    if not any(host == d or host.endswith("." + d) for d in (a.lower().lstrip(".") for a in allowed)):
        raise RequestError(f"{where}: remote image URLs are refused ({host!r} is not an allowed media domain; the "
                           "operator allows domains with --allowed-media-domains); send the image as a data: URL",
                           where, status=400)
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:  # noqa: S310 (scheme checked)
            data = response.read(max_bytes + 1)
    except OSError as err:
        raise RequestError(f"{where}: could not fetch {url[:80]!r} ({err})", where, status=400) from None
    if len(data) > max_bytes:
        raise RequestError(f"{where}: the image at {url[:80]!r} is over {max_bytes:,} bytes", where, status=400)
    return data
