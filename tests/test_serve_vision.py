"""``infer serve`` with images: the three APIs' image forms, with the official clients.

The same picture sent as OpenAI's ``image_url`` (object and bare string), the
Responses API's ``input_image`` and Anthropic's base64 ``image`` block must give
the tokens of :meth:`infer.Model.chat` for the same conversation; hostile
images and remote URLs get a 400 naming the part, and the server keeps serving.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from test_serve import KEY, NAME, running
from vision_models import synthetic_image, vlm_dir

import infer
from infer.serve import create_app

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("PIL")

GREEDY = {"temperature": 0}


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PICTURE = synthetic_image(24, 40, seed=7)
B64 = base64.b64encode(_png(PICTURE)).decode()
URL = "data:image/png;base64," + B64


@pytest.fixture(scope="module")
def model() -> infer.Model:
    return infer.load(vlm_dir("llava_clip"), backend="numpy")


@pytest.fixture(scope="module")
def url(model: infer.Model) -> Iterator[str]:
    app = create_app(infer.load(vlm_dir("llava_clip"), backend="numpy"), model_name=NAME, api_key=KEY,
                     max_body_bytes=4 * 2**20, allowed_media_domains=["images.example"])
    with running(app) as base:
        yield base


def test_three_apis_give_model_chat_tokens(url: str, model: infer.Model) -> None:
    messages = [{"role": "user", "content": [{"type": "image", "image": PICTURE},
                                             {"type": "text", "text": "What is it?"}]}]
    want = str(model.chat(messages, max_tokens=6, temperature=0))
    plan = model.plan_chat(messages, infer.GenerationRequest(max_tokens=6))
    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    for image_url in ({"url": URL}, URL):
        reply = oa.chat.completions.create(model=NAME, max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": image_url},
                                         {"type": "text", "text": "What is it?"}]}])
        assert reply.choices[0].message.content == want
        assert reply.usage.prompt_tokens == len(plan.prompt_ids) > plan.media.image_tokens
    response = oa.responses.create(model=NAME, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": URL},
                                     {"type": "input_text", "text": "What is it?"}]}])
    assert response.output_text == want
    an = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
              {"type": "text", "text": "What is it?"}]
    message = an.messages.create(model=NAME, max_tokens=6, messages=[{"role": "user", "content": blocks}],
                                 extra_body=GREEDY)
    assert message.content[0].text == want
    count = an.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": blocks}])
    # The earlier requests cached the image's blocks: Anthropic's input_tokens leaves out the cache reads.
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens == len(plan.prompt_ids)
    assert usage.cache_read_input_tokens > 0


def test_hostile_images_are_400s_naming_the_part_and_the_server_keeps_serving(url: str) -> None:
    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    png = _png(PICTURE)
    from PIL import Image

    bomb = _png(Image.new("L", (7200, 7200)))  # 52 million pixels in ~50 kB: refused from its header, unread
    hostile = {
        "truncated PNG": "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode(),
        "100000 x 1": "data:image/png;base64," + base64.b64encode(_png(synthetic_image(100_000, 1))).decode(),
        "not an image": "data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode(),
        "text data URL": "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
        "remote URL": "https://example.com/cat.png",
        "disallowed subdomain trick": "https://images.example.evil.com/cat.png",
        "decompression bomb": "data:image/png;base64," + base64.b64encode(bomb).decode(),
    }
    for what, image_url in hostile.items():
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=NAME, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": image_url}}]}])
        assert "messages[0].content[1]" in info.value.body["message"], what
    ok = oa.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "still there?"}])
    assert ok.choices[0].finish_reason in ("stop", "length")
