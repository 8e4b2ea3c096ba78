"""The asyncio API: agenerate, acomplete, achat, and `async for` over a stream."""

from __future__ import annotations

import asyncio

import pytest
from reference import tiny_model_dir

import infer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model() -> infer.Model:
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


def test_async_calls_return_what_the_sync_ones_do(model: infer.Model) -> None:
    kw = dict(max_tokens=8, ignore_eos=True)

    async def main() -> tuple:
        text = await model.agenerate(PROMPT, **kw)
        texts = await model.agenerate([PROMPT, "Hello"], **kw)
        completion = await model.acomplete(PROMPT, logprobs=2, **kw)
        reply = await model.achat([{"role": "user", "content": "Hi"}], **kw)
        return text, texts, completion, reply

    text, texts, completion, reply = asyncio.run(main())
    assert text == model.generate(PROMPT, **kw)
    assert texts == model.generate([PROMPT, "Hello"], **kw)
    assert completion == model.complete(PROMPT, logprobs=2, **kw)
    assert reply == model.chat([{"role": "user", "content": "Hi"}], **kw)


def test_async_streams_interleave_and_keep_the_event_loop_running(model: infer.Model) -> None:
    kw = dict(max_tokens=12, ignore_eos=True, stream=True)
    ticks = 0

    async def collect(prompt: str) -> list[str]:
        return [chunk async for chunk in model.generate(prompt, **kw)]

    async def ticker(done: asyncio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def main() -> list[list[str]]:
        done = asyncio.Event()
        tick = asyncio.create_task(ticker(done))
        chunks = await asyncio.gather(collect(PROMPT), collect("Hello"),
                                      _chunks(await model.acomplete(PROMPT, logprobs=1, **kw)))
        done.set()
        await tick
        return chunks

    a, b, c = asyncio.run(main())
    assert a == list(model.generate(PROMPT, **kw)) and b == list(model.generate("Hello", **kw))
    assert [x.token_ids for x in c] == [x.token_ids for x in model.complete(PROMPT, logprobs=1, **kw)]
    assert ticks > 0  # the loop ran other tasks while the tokens were computed in a thread


async def _chunks(stream: infer.Stream) -> list:
    return [chunk async for chunk in stream]
