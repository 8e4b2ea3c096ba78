"""``infer serve``: the OpenAI API over the batch engine, driven by the official ``openai`` client.

Each server runs in the test process, uvicorn on a thread, on a free port of
127.0.0.1, serving the tiny random llama-family model with a tokenizer and a
ChatML template (``reference.tiny_model_dir("smollm2_like")``) on numpy. What
the server answers is compared with what the same model gives through the
Python API (``Model.generate`` / ``Model.chat``, a separate instance): token
for token, as tests/test_batching.py compares the batch engine with lone
requests — the tiny models are built so their two best logits are never
within float32 rounding of each other (tests/README.md), so one batched
forward's different summation order cannot change a greedy choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import LOGIT_RTOL, load_tiny, reference_logits, reference_teacher_forced, tiny_model_dir

import infer
from infer.engine.batch import BatchEngine
from infer.serve import create_app, load_app
from infer.tool_parsers import get_tool_parser

uvicorn = pytest.importorskip("uvicorn")

NAME = "tiny"
KEY = "sk-test-key"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a thread, on a free port of 127.0.0.1; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve_model(**options: Any) -> Any:
    """A fresh instance of the tiny model (the server owns its batch engine)."""
    return infer.load(tiny_model_dir("smollm2_like"), backend="numpy")


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model through the Python API."""
    return load_tiny("smollm2_like")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(serve_model(), model_name=NAME, api_key=KEY)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(infer_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def settled(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once no request runs or waits (cancellations land between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["infer_requests_running"], m["infer_requests_waiting"], m["infer_kv_blocks_used"]) == (0, 0, 0):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# -- generation ---------------------------------------------------------------------------------


def test_models_health_and_metrics_endpoints(url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # no key needed
    m = metrics(url)
    for name in ("infer_requests_running", "infer_requests_waiting", "infer_kv_blocks_used", "infer_kv_blocks_total",
                 "infer_prompt_tokens_total", "infer_generated_tokens_total",
                 "infer_time_to_first_token_seconds_count", "infer_time_per_output_token_seconds_count"):
        assert name in m, name
    assert m["infer_kv_blocks_total"] > 0
    assert m["infer_kv_bytes_held"] >= 0 and m["infer_state_slots_total"] == 0  # no recurrent layers


def test_load_app_loads_with_the_cli_options_and_health_follows_the_engine_thread(reference: Any) -> None:
    app = load_app(tiny_model_dir("smollm2_like"), backend="numpy", max_batch_tokens=64, model_name=NAME)
    assert app.state.server.loop.batch.max_batch_tokens == 64
    with running(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == reference.generate(PROMPT, max_tokens=8, temperature=0)
        assert httpx.get(base + "/health").status_code == 200
        app.state.server.loop.stop()  # as if the engine thread had died: a load balancer must stop routing here
        gone = httpx.get(base + "/health")
        assert gone.status_code == 503 and gone.json()["status"] == "error"


def test_greedy_completions_equal_generate(client: openai.OpenAI, reference: Any) -> None:
    prompts = [PROMPT, "The capital of France is", "Numbers are words too:"]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    want = [reference.generate(p, max_tokens=12, temperature=0) for p in prompts]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want
    prompt_tokens = sum(len(reference.tokenizer.encode(p)) for p in prompts)
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens <= 3 * 12
    # Token ids as the prompt give the same as their text.
    ids = reference.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want[0]


def test_streamed_completion_is_the_same_text_with_usage_last(client: openai.OpenAI, reference: Any) -> None:
    want = reference.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_streamed_and_not_equal_model_chat(url: str, reference: Any) -> None:
    want = reference.chat(MESSAGES, max_tokens=16, temperature=0)

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        whole = await client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
        stream = await client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                                      stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert whole.choices[0].message.role == "assistant"
        return whole.choices[0].message.content, "".join(pieces)

    whole, streamed = asyncio.run(run())
    assert whole == streamed == want


def test_stop_strings_cut_the_text_as_generate_does(client: openai.OpenAI, reference: Any) -> None:
    full = reference.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop and full.find(stop) > 0
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == reference.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop)


def test_a_seed_repeats_a_sampled_run_and_matches_generate(client: openai.OpenAI, reference: Any) -> None:
    args = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95)
    first = client.completions.create(seed=7, **args).choices[0].text
    assert client.completions.create(seed=7, **args).choices[0].text == first
    assert reference.generate(PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=7) == first
    # n choices draw with seeds seed, seed + 1, ...: choice 1 of seed 6 is choice 0 of seed 7.
    two = client.completions.create(seed=6, n=2, **args)
    assert sorted(two.choices, key=lambda c: c.index)[1].text == first


def test_penalties_and_logit_bias_equal_generate(client: openai.OpenAI, reference: Any) -> None:
    first = reference.tokenizer.encode(reference.generate(PROMPT, max_tokens=1, temperature=0),
                                       add_special_tokens=False)[0]
    kwargs = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={first: -100})
    want = reference.generate(PROMPT, max_tokens=12, temperature=0, **kwargs)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    presence_penalty=1.5, frequency_penalty=0.5, logit_bias={str(first): -100})
    assert out.choices[0].text == want
    assert want != reference.generate(PROMPT, max_tokens=12, temperature=0)


# -- log-probabilities ----------------------------------------------------------------------------


def log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logprob_tolerance(logits: np.ndarray) -> np.ndarray:
    """Per row: log_softmax(x)_i = x_i - logsumexp(x), and logsumexp moves by at
    most the largest change of any x, so a logprob errs by at most twice the
    logits' error, which the suite bounds by LOGIT_RTOL * max|logit| (tests/README.md)."""
    return 2 * LOGIT_RTOL * np.abs(logits).max(axis=-1)


def test_completion_logprobs_and_echo_match_transformers(client: openai.OpenAI, reference: Any) -> None:
    prompt_ids = reference.tokenizer.encode(PROMPT)
    generated = list(reference.generate_tokens(prompt_ids, max_tokens=6, temperature=0, ignore_eos=True))
    full = reference_logits(tiny_model_dir("smollm2_like"), prompt_ids, generated)["full"]
    want, tolerance = log_softmax(full), logprob_tolerance(full)
    ids = prompt_ids + generated
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == PROMPT + reference.tokenizer.decode(generated)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):  # position i is predicted by row i - 1
        assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]]) <= tolerance[i - 1], i
        # Alternatives are keyed by text, so two ids that read the same (half a character) show once.
        best = np.sort(want[i - 1])[::-1][:3]
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert abs(top[0] - best[0]) <= tolerance[i - 1]
        assert all(np.abs(best - v).min() <= tolerance[i - 1] for v in top)
        if i >= len(prompt_ids):  # greedy: the generated token is the most likely one
            assert lp.token_logprobs[i] == max(lp.top_logprobs[i].values())
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # Streamed: the same tokens and log-probabilities, chunk by chunk.
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    # lm-eval's loglikelihood request: echo, no new tokens, one alternative.
    score = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True)
    assert score.choices[0].text == PROMPT
    assert score.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt_ids)]


def test_chat_logprobs_match_transformers(client: openai.OpenAI, reference: Any) -> None:
    text = reference.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt_ids = reference.tokenizer.encode(text, add_special_tokens=False)
    generated = list(reference.generate_tokens(prompt_ids, max_tokens=6, temperature=0, ignore_eos=True))
    logits = reference_teacher_forced(tiny_model_dir("smollm2_like"), prompt_ids, generated)
    want, tolerance = log_softmax(logits), logprob_tolerance(logits)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == len(generated)
    for i, entry in enumerate(content):
        assert abs(entry.logprob - want[i, generated[i]]) <= tolerance[i]
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"


# -- refusals -------------------------------------------------------------------------------------


def test_llama_cpp_samplers_are_extra_body_fields(client: openai.OpenAI) -> None:
    extra = dict(seed=4, dry_multiplier=0.8, dry_sequence_breakers=["\n"], xtc_probability=0.5, typical_p=0.9,
                 penalty_last_n=8, samplers=["penalties", "dry", "typ_p", "xtc", "temperature"])
    for create in (lambda: client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0.9,
                                                     extra_body=extra).choices[0].text,
                   lambda: client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0.9,
                                                          extra_body=extra).choices[0].message.content):
        assert create() == create()


def test_bad_and_unsupported_parameters_are_400s_naming_the_parameter(client: openai.OpenAI) -> None:
    cases = [
        (dict(extra_body={"mirostat": 3}), "mirostat"),
        (dict(extra_body={"dry_base": -1}), "dry_base"),
        (dict(extra_body={"xtc_probability": 2}), "xtc_probability"),
        (dict(extra_body={"samplers": ["top_k", "nope"]}), "samplers"),
        (dict(extra_body={"tfs_z": 0.9}), "tfs_z"),
        (dict(temperature=5), "temperature"),
        (dict(best_of=3), "best_of"),
        (dict(suffix="!"), "suffix"),
        (dict(logit_bias={"99999": 1}), "logit_bias"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, **kwargs)
        assert info.value.body["param"] == param, (kwargs, info.value.body)
        assert param in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, response_format={"type": "xml"})
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert info.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_found"


def test_a_prompt_longer_than_the_context_is_a_400(client: openai.OpenAI, reference: Any) -> None:
    long = [5] * reference.context_length
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=long, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"
    assert str(reference.context_length) in info.value.body["message"]


def test_max_tokens_is_capped_by_the_context(client: openai.OpenAI, reference: Any) -> None:
    ids = [5] * (reference.context_length - 3)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=10_000, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_api_key_and_body_limit(url: str) -> None:
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPT}).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    big = httpx.post(url + "/v1/completions", headers=headers, content=b'{"prompt": "' + b"a" * 2**21 + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(url + "/v1/completions", headers=headers, content=b"{not json")
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]


def test_a_request_that_can_never_fit_is_a_400_with_the_numbers(reference: Any) -> None:
    model = serve_model()
    # 4 blocks' bytes: 3 for requests and the pool's scratch block.
    model.configure_batching(kv_memory=64 * model.engine.kv_bytes_per_position(), block_size=16)
    with running(create_app(model, model_name=NAME)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=100)
        message = info.value.body["message"]
        assert "blocks" in message and "bytes" in message and "3 blocks" in message, message
        # One that fits runs.
        assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4).choices


def test_a_full_queue_is_a_429_with_retry_after() -> None:
    with running(create_app(serve_model(), model_name=NAME, max_queue=0)) as base:
        reply = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2})
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)


# -- disconnects and load ---------------------------------------------------------------------------


def test_a_client_that_goes_away_frees_its_pages(url: str, client: openai.OpenAI) -> None:
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    m = settled(url)
    assert (m["infer_requests_running"], m["infer_kv_blocks_used"]) == (0, 0)
    assert m['infer_requests_total{endpoint="completions",finish_reason="cancelled"}'] >= 1


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_pages() -> None:
    # Every engine step takes at least 20 ms here, so the answer (the whole
    # context's worth of tokens) cannot come before the client's 0.3 s are up,
    # however fast the machine is.
    model = serve_model()
    step = model.engine.run
    model.engine.run = lambda batch: (time.sleep(0.02), step(batch))[1]  # type: ignore[method-assign]
    key = 'infer_requests_total{endpoint="completions",finish_reason="cancelled"}'
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 10_000, "temperature": 0, "ignore_eos": True}
    with running(create_app(model, model_name=NAME)) as base:
        before = metrics(base)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json=body, timeout=0.3)
        m = settled(base)
        assert (m["infer_requests_running"], m["infer_kv_blocks_used"]) == (0, 0)
        assert m[key] - before.get(key, 0) == 1


def test_load_64_streaming_clients_a_quarter_leaving(url: str, reference: Any) -> None:
    """64 clients stream at once; every fourth goes away after a few chunks.
    The rest each get exactly their own greedy text; afterwards no page is
    held and the server still answers."""
    prompts = [f"Story {i}: the {w} walked to the market" for i, w in
               zip(range(64), ["farmer", "children", "model", "fox"] * 16)]
    tokens = 24
    want = reference.generate(prompts, max_tokens=tokens, temperature=0, ignore_eos=True)

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(model=NAME, prompt=prompts[i], max_tokens=tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text = []
        async for chunk in stream:
            text.append(chunk.choices[0].text if chunk.choices else "")
            if i % 4 == 0 and len(text) == 3:
                await stream.close()
                return None
        return "".join(text)

    async def run() -> list[str | None]:
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 120)

    before = metrics(url)
    got = asyncio.run(run())
    for i, text in enumerate(got):
        if i % 4:
            assert text == want[i], f"client {i}"
    m = settled(url)
    assert (m["infer_requests_running"], m["infer_requests_waiting"], m["infer_kv_blocks_used"]) == (0, 0, 0)
    for reason, count in (("length", 48), ("cancelled", 16)):
        key = f'infer_requests_total{{endpoint="completions",finish_reason="{reason}"}}'
        assert m[key] - before.get(key, 0) == count, reason
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text == \
        reference.generate(PROMPT, max_tokens=12, temperature=0)


# -- tool calls -----------------------------------------------------------------------------------------


def test_hermes_tool_calls_are_parsed() -> None:
    hermes = get_tool_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    reply = hermes.parse(text)
    assert reply.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", {"city": "Paris"}),
                                                                       ("get_time", {})]
    # A block cut off by the end of generation still counts; broken JSON stays text.
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}').calls[0].name == "f"
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes.parse(broken).content == broken and not hermes.parse(broken).calls


@given(st.text())
def test_tool_call_parsing_never_raises(text: str) -> None:
    reply = get_tool_parser("hermes").parse("<tool_call>" + text)
    assert reply.calls or reply.content == "<tool_call>" + text


def merged_tool_calls(chunks: list[Any]) -> list[tuple[str, Any]]:
    """Streamed tool-call deltas joined as a client joins them: by index, the
    name from the first, the arguments' fragments concatenated."""
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(t.index, {"name": "", "arguments": ""})
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


class ScriptedBatch(BatchEngine):
    """A batch engine whose every request 'generates' the token ids of a fixed
    text, one per step, then EOS: what a model trained on the Hermes format
    would write, so the whole HTTP path of a tool call can be tested with a
    tiny random model. Admission, cancellation and pages are the real ones."""

    def __init__(self, model: Any, text: str) -> None:
        super().__init__(model.engine)
        self.script = model.tokenizer.encode(text, add_special_tokens=False) + [sorted(model.eos_token_ids)[0]]

    def step(self) -> None:
        with self._lock:
            self._admit()
            for r in list(self.running):
                token = self.script[len(r.tokens)]
                r.tokens.append(token)
                reason = r.stop.finish_reason(token, len(r.tokens), len(r.prompt), self.engine.max_context)
                if reason is not None:
                    self._finish(r, reason)


def test_chat_tool_calls_reach_the_client_streamed_and_not() -> None:
    model = serve_model()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    batch = ScriptedBatch(model, "Checking the weather. " + call)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with running(create_app(model, model_name=NAME, batch_engine=batch)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking the weather."
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "get_weather"
        assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
        chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert content == choice.message.content == "Checking the weather."  # streamed or not, the same
        assert merged_tool_calls(chunks) == [("get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # Without tools the same reply is plain text.
        plain = client.chat.completions.create(model=NAME, messages=MESSAGES)
        assert plain.choices[0].message.content == "Checking the weather. " + call
        # The conversation may carry the call and its result back.
        follow = MESSAGES + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": tool_call.id, "content": "18 C"}]
        assert client.chat.completions.create(model=NAME, messages=follow, tools=tools).choices


class FailingBatch(BatchEngine):
    """A batch engine whose forward fails after ``steps`` good steps, then
    again ``steps`` later: a device error in the middle of a stream."""

    def __init__(self, model: Any, steps: int) -> None:
        super().__init__(model.engine)
        self.steps = self.left = steps

    def step(self) -> None:
        if self.left == 0:
            self.left = self.steps
            raise RuntimeError("the device fell over")
        self.left -= 1
        super().step()


def sse_events(response: Any) -> list[tuple[str | None, str]]:
    """A server-sent event stream's ``(event name, data)`` pairs."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            out.append((name, line.split(":", 1)[1].strip()))
            name = None
    return out


def test_a_failure_mid_stream_ends_each_apis_stream_with_its_error_event() -> None:
    model = serve_model()
    with running(create_app(model, model_name=NAME, batch_engine=FailingBatch(model, 3))) as base:
        def stream(path: str, **body: Any) -> list[tuple[str | None, str]]:
            reply = httpx.post(base + path, json={"model": NAME, "stream": True, "temperature": 0, **body}, timeout=60)
            assert reply.status_code == 200
            return sse_events(reply)

        openai_error = {"error": {"message": "the device fell over", "type": "server_error", "param": None,
                                  "code": None}}
        for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 20}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20})):
            events = stream(path, **body)
            assert len(events) > 3 and events[-1] == (None, "[DONE]"), path  # some chunks came first
            assert json.loads(events[-2][1]) == openai_error, path
        events = stream("/v1/messages", messages=MESSAGES, max_tokens=20)
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        assert json.loads(events[-1][1]) == {"type": "error", "error": {"type": "api_error",
                                                                         "message": "the device fell over"}}
        events = stream("/v1/responses", input=MESSAGES[0]["content"], max_output_tokens=20)
        assert events[0][0] == "response.created" and events[-1][0] == "error"
        assert json.loads(events[-1][1]) == {"type": "error", "code": "server_error", "message": "the device fell over",
                                             "param": None, "sequence_number": 0}


#: A Hermes/Qwen-style tool-use template: the tools' JSON in a system block.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_are_rendered_into_the_prompt_through_the_template(tmp_path: Any) -> None:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("smollm2_like"), folder)
    default = load_tiny("smollm2_like").tokenizer.chat_templates["default"]
    (folder / "chat_template.jinja").write_text(default, encoding="utf-8")  # beside the named one
    (folder / "chat_templates").mkdir(exist_ok=True)
    (folder / "chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    model = infer.load(folder, backend="numpy")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    rendered = model.tokenizer.apply_chat_template(MESSAGES, tools=tools)
    assert '"name": "get_weather"' in rendered  # the template took the tools
    want = len(model.tokenizer.encode(rendered, add_special_tokens=False))
    with running(create_app(model, model_name=NAME)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with_tools = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=1)
        without = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
        none = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, tool_choice="none",
                                              max_tokens=1)
    assert with_tools.usage.prompt_tokens == want
    assert without.usage.prompt_tokens < want and none.usage.prompt_tokens == without.usage.prompt_tokens


def test_a_missing_extra_is_a_typed_error(monkeypatch: pytest.MonkeyPatch, reference: Any) -> None:
    import importlib.util

    from infer.errors import MissingDependencyError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"uvicorn.*infer-engine\[serve\]"):
        create_app(reference)


# -- the command --------------------------------------------------------------------------------------


def test_infer_serve_passes_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.serve
    from infer.tools.cli import main

    seen: dict[str, Any] = {}
    monkeypatch.setattr(infer.serve, "serve", lambda model, **kwargs: seen.update(model=model, **kwargs))
    monkeypatch.setenv("INFER_API_KEY", "from-env")
    path = str(tiny_model_dir("smollm2_like"))
    assert main(["-q", "serve", path, "--port", "8123", "--kv-memory", "1MiB", "--max-batch-tokens", "64",
                 "--model-name", "mine", "--max-queue", "3", "--encoder-memory", "3MiB"]) == 0
    model = seen.pop("model")
    pool = model.batch_engine.pool
    held = pool.num_blocks + 1  # the sequences' blocks and the scratch block
    assert held * pool.allocator.bytes_per_block <= 2**20 < (held + 1) * pool.allocator.bytes_per_block
    assert model.batch_engine.max_batch_tokens == 64
    assert model.batch_engine.encoder.memory == 3 * 2**20
    assert seen == dict(host="127.0.0.1", port=8123, model_name="mine", api_key="from-env", max_queue=3,
                        max_body_bytes=2**20, reasoning_parser=None, tool_parser=None, body_timeout=10.0,
                        slot_save_path=None, allowed_media_domains=[], enable_adapter_updates=False,
                        adapter_scales={}, log_level="warning")
    with pytest.raises(SystemExit):
        main(["serve", path, "--kv-memory", "lots"])
    # float16 keys and values: the same budget holds twice the positions
    assert main(["-q", "serve", path, "--kv-memory", "1MiB", "--kv-dtype", "float16"]) == 0
    half = seen.pop("model").batch_engine.pool
    assert half.dtype == "float16" and half.allocator.bytes_per_block * 2 == pool.allocator.bytes_per_block
    assert half.num_blocks >= 2 * pool.num_blocks


def test_load_app_takes_kv_dtype() -> None:
    app = load_app(tiny_model_dir("smollm2_like"), backend="numpy", kv_dtype="float16")
    batch = app.state.server.loop.batch
    assert batch.engine.kv_dtype == "float16" and batch.pool.dtype == "float16"
